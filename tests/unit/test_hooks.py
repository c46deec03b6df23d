"""The hook runner: tool and interaction hooks on their own event loop thread, each call bounded."""

import asyncio
import threading
import time

import pytest

from megarl.rollout.hooks import HookRunner, HookTimeout


def test_a_blocking_hook_times_out_its_result_is_dropped_and_the_next_call_gets_a_fresh_loop():
    """The blocking hook blocks its thread until the test releases it, after everything is checked: the timeout, the
    next call answered on a fresh loop while the old one is still blocked (on a machine of any speed)."""
    finished, release = [], threading.Event()

    async def blocking():
        release.wait(60)  # the mistake: blocking code inside an async hook
        finished.append("late")
        return "late result"

    async def quick(x):
        await asyncio.sleep(0)
        return threading.current_thread().name, x

    async def main(runner):
        start = time.perf_counter()
        with pytest.raises(HookTimeout) as error:
            await runner.call("tool 'slow' execute", blocking)
        waited = time.perf_counter() - start
        name, value = await runner.call("tool 'quick' execute", quick, 7)
        return waited, error.value, name, value

    with HookRunner(0.3) as runner:
        try:
            waited, error, thread_name, value = asyncio.run(main(runner))
            assert finished == []  # the quick call did not wait for the blocked hook
        finally:
            release.set()
        assert waited >= 0.25  # the limit held (a timer may fire a scheduler tick early, never far)
        assert str(error).startswith("tool 'slow' execute timed out after 0.3 s; the hook loop has been blocked for")
        assert error.loop_blocked_s >= 0.15
        assert runner.num_loop_replacements == 1
        assert value == 7 and thread_name == "megarl-hooks"  # on the new loop
        deadline = time.monotonic() + 60
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == ["late"]  # the blocked hook ran to its end on the abandoned thread; nobody took its result


def test_an_awaiting_hook_is_cancelled_and_the_loop_is_kept():
    events = []

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    async def main(runner):
        with pytest.raises(HookTimeout, match=r"^'x' create timed out after 0.2 s$"):
            await runner.call("'x' create", forever)
        await asyncio.sleep(0.1)

    with HookRunner(0.2) as runner:
        asyncio.run(main(runner))
        assert events == ["cancelled"] and runner.num_loop_replacements == 0


def test_plain_functions_exceptions_and_no_limit():
    def plain(a, *, b):
        return a + b, threading.current_thread() is threading.main_thread()

    async def broken():
        raise KeyError("no instance")

    async def slow():
        await asyncio.sleep(0.3)
        return "slow"

    async def main(runner):
        result = await runner.call("plain", plain, 1, b=2)
        with pytest.raises(KeyError, match="no instance"):
            await runner.call("broken", broken)
        return result, await runner.call("slow", slow)

    with HookRunner(None) as runner:
        (total, on_main), slow_result = asyncio.run(main(runner))
    assert total == 3 and not on_main and slow_result == "slow"
    with pytest.raises(ValueError, match="hook timeout must be > 0"):
        HookRunner(0)


def test_close_stops_the_thread_and_refuses_later_calls():
    runner = HookRunner(1.0, name="megarl-hooks-close-test")

    async def hello():
        return "hi"

    assert asyncio.run(runner.call("hello", hello)) == "hi"
    assert any(t.name == "megarl-hooks-close-test" for t in threading.enumerate())
    runner.close()
    assert not any(t.name == "megarl-hooks-close-test" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="is closed"):
        asyncio.run(runner.call("hello", hello))
    runner.close()  # idempotent


def test_calls_queued_behind_a_blocking_hook_move_to_a_fresh_loop_and_run_once():
    """Ten calls queued behind a hook that blocks the loop's thread (until the test releases it, after they have
    all answered): each moves to a fresh loop and runs exactly once; the blocking one times out."""
    runs, release = [], threading.Event()

    async def blocking():
        release.wait(60)

    async def quick(i):
        runs.append(i)
        return i

    async def main(runner):
        start = time.perf_counter()
        calls = [runner.call("'block' create", blocking)] + [runner.call(f"'q' create {i}", quick, i) for i in range(10)]

        async def timed(call):
            try:
                return await call, time.perf_counter() - start
            except HookTimeout as error:
                return error, time.perf_counter() - start

        return await asyncio.gather(*(timed(c) for c in calls))

    with HookRunner(1.0) as runner:
        try:
            (blocked, blocked_s), *quick_results = asyncio.run(main(runner))
        finally:
            release.set()
        assert runner.num_loop_replacements == 1
    assert isinstance(blocked, HookTimeout) and blocked_s >= 0.95
    assert [value for value, _ in quick_results] == list(range(10))  # answered while the hook still blocked
    assert sorted(runs) == list(range(10))  # each ran exactly once


def test_a_finished_hook_keeps_its_result_when_a_blocking_hook_runs_right_after_it():
    """A quick hook and a blocking one submitted together: the quick one finishes in the loop's first turn and the
    blocking one takes the next. The quick result must reach its caller at once; handed over through the task's
    done callback it would wait behind the blocking hook until its caller timed it out (the extra calc_reward
    timeouts of the e2e hanging-tool run)."""

    async def quick():
        return "done"

    async def blocking():
        time.sleep(1.5)

    async def main(runner):
        start = time.perf_counter()
        results = await asyncio.gather(runner.call("tool 'quick' calc_reward", quick),
                                       runner.call("tool 'slow' release", blocking), return_exceptions=True)
        return results, time.perf_counter() - start

    with HookRunner(0.5) as runner:
        (value, error), _ = asyncio.run(main(runner))
        assert value == "done"
        assert isinstance(error, HookTimeout) and error.hook == "tool 'slow' release"
        time.sleep(1.5)  # the blocked thread ends before the runner closes
