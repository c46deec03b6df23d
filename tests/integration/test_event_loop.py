"""The process's one event loop (megarl.engines.event_loop): calls from synchronous code, interrupts, ownership and
shutdown, and the engine client's one HTTP session on it."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

from megarl.engines import event_loop
from megarl.engines.client import EngineClient
from megarl.engines.event_loop import EventLoopThread


@pytest.fixture
def loop():
    running = EventLoopThread(name="megarl-loop-test")
    yield running
    running.stop()


def test_calls_run_on_the_loops_one_thread(loop):
    async def where():
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert loop.run(where()) == "megarl-loop-test"
    assert loop.gather([where(), asyncio.sleep(0, result=3)]) == ["megarl-loop-test", 3]
    assert loop.submit(asyncio.sleep(0, result=5)).result(10) == 5


def test_an_interrupt_inside_a_task_goes_to_its_caller_and_the_loop_goes_on(loop):
    """Ctrl-C (or SystemExit) raised inside a task reaches the caller waiting for it; the loop keeps serving, and
    the tasks awaiting the interrupted one are not resumed later with it."""
    async def request():
        raise KeyboardInterrupt

    async def rollout():
        await asyncio.gather(request(), asyncio.sleep(30))

    with pytest.raises(KeyboardInterrupt):
        loop.run(rollout())
    assert loop.run(asyncio.sleep(0, result=7)) == 7


def test_a_synchronous_call_refuses_a_running_loop_and_the_loops_own_thread(loop):
    async def inside():
        return loop.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="cannot run inside a running event loop"):
        asyncio.run(inside())

    async def on_the_loop():
        return loop.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="on the event loop's own thread"):
        loop.run(on_the_loop())


def test_a_timeout_or_interrupt_of_the_caller_cancels_the_task(loop):
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        loop.run(forever(), timeout_s=0.05)
    assert cancelled.wait(10)


def test_stop_cancels_the_tasks_joins_the_thread_and_refuses_later_calls():
    running = EventLoopThread(name="megarl-loop-stopped")
    started, cancelled = threading.Event(), threading.Event()

    async def forever():
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    pending = running.submit(forever())
    assert started.wait(10)
    running.stop()
    assert cancelled.is_set() and pending.cancelled()
    assert not running.thread.is_alive() and running.loop.is_closed()
    running.stop()  # idempotent
    with pytest.raises(RuntimeError, match="is stopped"):
        running.submit(asyncio.sleep(0))


def test_the_processs_loop_runs_while_held_and_the_last_release_stops_it():
    """The test session holds the process's loop (tests/conftest.py); a second holder shares it, and its release
    leaves it running."""
    session = event_loop.current()
    with event_loop.holding() as held:
        assert held is session
    assert event_loop.current() is session and session.thread.is_alive()
    assert event_loop.run_sync(asyncio.sleep(0, result=1)) == 1
    with pytest.raises(RuntimeError, match="without a matching hold"):
        for _ in range(2):  # the session's hold, then none left
            event_loop.release()
    assert not session.thread.is_alive()
    with pytest.raises(RuntimeError, match="no event loop is running"):
        event_loop.run_sync(asyncio.sleep(0))
    event_loop.hold()  # back for the rest of the session (its fixture releases it)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_client_keeps_one_session_on_the_loop_it_opened_it_on(loop):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = EngineClient(f"http://127.0.0.1:{server.server_address[1]}", name="engine 0")
        assert loop.run(client.health())
        session = client._http
        assert loop.run(client.health()) and client._http is session  # reused: keep-alive connections
        with pytest.raises(RuntimeError, match="HTTP session open on another event loop"):
            asyncio.run(client.call("/health"))
        client.close_sync()
        assert session.closed

        async def elsewhere():
            try:
                return await client.health()
            finally:
                await client.close()

        assert asyncio.run(elsewhere())  # closed: the next call opens one on the loop it runs on
    finally:
        server.shutdown()
        server.server_close()
