"""The hook runner: tool and interaction hooks on their own event loop thread, each call bounded."""

import asyncio
import threading
import time

import pytest

from megarl.rollout.hooks import HookRunner, HookTimeout


def test_a_blocking_hook_times_out_its_result_is_dropped_and_the_next_call_gets_a_fresh_loop():
    finished = []

    async def blocking():
        time.sleep(1.0)  # the mistake: blocking code inside an async hook
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
        start = time.perf_counter()
        name, value = await runner.call("tool 'quick' execute", quick, 7)
        return waited, error.value, time.perf_counter() - start, name, value

    with HookRunner(0.3) as runner:
        waited, error, quick_s, thread_name, value = asyncio.run(main(runner))
        assert 0.25 < waited < 0.6
        assert str(error).startswith("tool 'slow' execute timed out after 0.3 s; the hook loop has been blocked for")
        assert error.loop_blocked_s >= 0.15
        assert runner.num_loop_replacements == 1
        assert value == 7 and quick_s < 0.2 and thread_name == "megarl-hooks"  # on the new loop, at once
        time.sleep(1.0)
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
    runs = []

    async def blocking():
        time.sleep(1.5)

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
        (blocked, blocked_s), *quick_results = asyncio.run(main(runner))
        assert runner.num_loop_replacements == 1
    assert isinstance(blocked, HookTimeout) and 0.95 < blocked_s < 1.4
    assert [value for value, _ in quick_results] == list(range(10))
    assert max(seconds for _, seconds in quick_results) < 0.9  # moved once the loop was blocked for 0.5 s
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
