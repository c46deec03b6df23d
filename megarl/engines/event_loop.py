"""The process's one asyncio event loop, run by one thread: every engine client's HTTP session lives on it, the
rollout manager's generation and the producer's groups run on it as coroutines, and synchronous code (the trainer,
a weight transport in an actor process) hands coroutines to it and waits::

    with event_loop.holding():                  # or event_loop.hold() ... event_loop.release()
        info = event_loop.run_sync(client.model_info())

Ownership is explicit: whoever builds what uses the loop holds it (the driver's roles, :func:`~megarl.controller.
build.build_roles`; a weight transport in an actor process; a test session), and the last holder's
:func:`release` stops it: its tasks are cancelled and awaited, async generators and the default executor (aiohttp's
name resolution) shut down, the thread joined and the loop closed, so no thread of it outlives its owners. Using
the loop while nobody holds it is an error, not a loop started on the side.

A coroutine submitted here that raises ``KeyboardInterrupt`` (or ``SystemExit``) hands it to its caller and the
loop goes on. Tool and interaction hooks keep an event loop of their own (:mod:`megarl.rollout.hooks`): user
code that may block must not block this one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long :meth:`EventLoopThread.stop` waits for the loop's tasks to end once cancelled."""


class EventLoopThread:
    """One asyncio event loop, run by one thread from construction until :meth:`stop`."""

    def __init__(self, name: str = "megarl-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._stopping = False
        # A daemon only so that a process whose owner never stops it can still exit; stop() joins it.
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def __repr__(self) -> str:
        return f"EventLoopThread({self.thread.name}, {'running' if self.thread.is_alive() else 'stopped'})"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        while True:
            try:
                self.loop.run_forever()
            except BaseException:  # noqa: BLE001 - a task's KeyboardInterrupt/SystemExit: its caller has it
                pass
            if self._stopping:
                return

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    # ---------------------------------------------------------------------------- calls
    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Start ``coroutine`` on the loop; its future, for code that goes on meanwhile (``.result()`` waits,
        ``.cancel()`` cancels the task)."""
        if self._stopping or self.loop.is_closed():
            coroutine.close()
            raise RuntimeError(f"{self!r} is stopped: hold the event loop (megarl.engines.event_loop.hold) for as "
                               f"long as its clients are used")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run ``coroutine`` on the loop and wait for its result (from synchronous code on another thread). An
        interrupt or a timeout while waiting cancels it."""
        problem = None
        if self.in_loop_thread():
            problem = "on the event loop's own thread, which it would block for ever"
        elif _running_loop() is not None:
            problem = "inside a running event loop, which it would block"
        if problem is not None:
            coroutine.close()
            raise RuntimeError(f"a synchronous call blocks until its coroutine is done, so it cannot run {problem}; "
                               f"await the coroutine instead (e.g. RolloutManager.agenerate)")
        future = self.submit(coroutine)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()
            raise

    def gather(self, coroutines: Sequence[Coroutine[Any, Any, Any]], timeout_s: float | None = None) -> list[Any]:
        """Run ``coroutines`` concurrently on the loop; their results in order (the first error raises)."""
        async def together() -> list[Any]:
            return list(await asyncio.gather(*coroutines))

        return self.run(together(), timeout_s)

    # ---------------------------------------------------------------------------- end
    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Cancel and await the loop's tasks, shut its async generators and default executor down, stop it, join
        its thread and close it (idempotent; not from the loop's own thread)."""
        if self.in_loop_thread():
            raise RuntimeError("the event loop cannot be stopped from its own thread")
        if self._stopping:
            return
        self._stopping = True
        if self.thread.is_alive():
            finishing = asyncio.run_coroutine_threadsafe(self._finish(), self.loop)
            try:
                finishing.result(timeout_s)
            except BaseException as error:  # noqa: BLE001 - stopping goes on whatever the tasks did
                logger.warning("the event loop's tasks did not end within %s s of being cancelled (%r); stopping it "
                               "with them pending", timeout_s, error)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
        if self.thread.is_alive():
            logger.warning("the event loop's thread did not end within %s s; leaving it (a daemon)", timeout_s)
            return
        self.loop.close()

    async def _finish(self) -> None:
        this = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not this]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# ------------------------------------------------------------------------------------ the process's loop

_lock = threading.Lock()
_current: EventLoopThread | None = None
_holders = 0


def hold() -> EventLoopThread:
    """Hold the process's event loop, starting it if nobody holds it; :func:`release` once done with it."""
    global _current, _holders
    with _lock:
        if _current is None:
            _current = EventLoopThread()
        _holders += 1
        return _current


def release(timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Let go of the loop :func:`hold` gave; the last holder's release stops it (:meth:`EventLoopThread.stop`)."""
    global _current, _holders
    with _lock:
        if _holders < 1:
            raise RuntimeError("event_loop.release() without a matching hold()")
        _holders -= 1
        if _holders:
            return
        ending, _current = _current, None
    ending.stop(timeout_s)


@contextlib.contextmanager
def holding() -> Iterator[EventLoopThread]:
    """The process's event loop, held for the ``with`` block."""
    loop = hold()
    try:
        yield loop
    finally:
        release()


def current() -> EventLoopThread:
    """The process's event loop; an error when nobody holds it."""
    loop = _current
    if loop is None:
        raise RuntimeError("no event loop is running in this process: whoever builds the engine clients holds it "
                           "(megarl.engines.event_loop.hold / holding)")
    return loop


def submit(coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
    """:meth:`EventLoopThread.submit` on the process's loop."""
    try:
        loop = current()
    except RuntimeError:
        coroutine.close()
        raise
    return loop.submit(coroutine)


def run_sync(coroutine: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
    """:meth:`EventLoopThread.run` on the process's loop."""
    try:
        loop = current()
    except RuntimeError:
        coroutine.close()
        raise
    return loop.run(coroutine, timeout_s)


def gather_sync(coroutines: Sequence[Coroutine[Any, Any, Any]], timeout_s: float | None = None) -> list[Any]:
    """:meth:`EventLoopThread.gather` on the process's loop."""
    try:
        loop = current()
    except RuntimeError:
        for coroutine in coroutines:
            coroutine.close()
        raise
    return loop.gather(coroutines, timeout_s)
