"""User hooks (tool and interaction methods) run on an event loop of their own, each call under a time limit.

Tools and interactions are user code. The agent loop awaits their hooks (``create``,
``execute``, ``calc_reward``, ``release``; ``start_interaction``, ``generate_response``,
``calculate_score``, ``finalize_interaction``) through one :class:`HookRunner`, which:

- calls every hook on a daemon thread running an event loop of its own (the *hook loop*), so
  a hook that blocks (``time.sleep`` in an ``async def``, a plain ``def`` doing I/O) blocks that
  thread, never the agent loop's event loop: generation of the other requests goes on;
- bounds each call by ``timeout_s`` from the hook's start: the caller gets :class:`HookTimeout`
  when it expires, the hook's task is cancelled and a late result is dropped;
- replaces a blocked hook loop (no heartbeat for half of ``timeout_s``) by a fresh one: calls
  queued on it that have not started move to the new loop, so a blocking hook costs only its
  own call (and any hook suspended on that loop at the time). The blocked thread is abandoned
  (a daemon: it ends with its hook or the process). Replacements are counted
  (:attr:`num_loop_replacements`) and logged with the hook that was running.

All hooks of one runner share its loop, so a tool's own asyncio objects (locks, sessions) stay
on one loop for as long as no hook blocks it. Hooks may be ``async def`` or plain functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from megarl.errors import FieldsError

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.05
"""How often the hook loop proves it is not blocked."""
WATCH_S = 0.1
"""How often a waiting call checks its loop."""


class HookTimeout(FieldsError, Exception):
    """A hook call did not finish within the runner's time limit."""

    def __init__(self, hook: str, timeout_s: float, loop_blocked_s: float, loop_blocked: bool) -> None:
        self.hook, self.timeout_s, self.loop_blocked_s = hook, timeout_s, loop_blocked_s
        blocked = (f"; the hook loop has been blocked for {loop_blocked_s:.1f} s: a tool or interaction runs "
                   f"blocking code (await asyncio.to_thread(...) for it)" if loop_blocked else "")
        super().__init__(f"{hook} timed out after {timeout_s:g} s{blocked}")


class _HookLoop:
    """An event loop on a daemon thread, with a heartbeat that shows whether it is blocked."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.last_beat = time.monotonic()
        self.running_hooks: set[str] = set()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._beat)
        try:
            self.loop.run_forever()
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            self.loop.close()

    def _beat(self) -> None:
        self.last_beat = time.monotonic()
        self.loop.call_later(HEARTBEAT_S, self._beat)

    def blocked_for(self) -> float:
        """Seconds since the loop last ran its heartbeat (~0 when it is free)."""
        return max(time.monotonic() - self.last_beat - HEARTBEAT_S, 0.0)

    def stop(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            pass


class _Claim:
    """Whether a call started on its loop or was abandoned before starting: exactly one of the two happens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "queued"
        self.started_at: float | None = None
        """``time.monotonic()`` when the hook started."""

    def start(self) -> bool:
        with self._lock:
            if self._state == "queued":
                self._state = "started"
                self.started_at = time.monotonic()
            return self._state == "started"

    def abandon(self) -> bool:
        with self._lock:
            if self._state == "queued":
                self._state = "abandoned"
            return self._state == "abandoned"


_NOT_RUN = object()


async def _invoke(hook_loop: _HookLoop, claim: _Claim, hook: str, function: Callable[..., Any], args: tuple,
                  kwargs: dict, outcome: concurrent.futures.Future) -> None:
    """Run one hook on ``hook_loop`` unless its call moved elsewhere before it started; its result (or error)
    goes into ``outcome`` within the hook's own step of the loop. (Through the task's done callback it would
    wait for the loop's next turn, and a blocking hook scheduled in between would hold a finished hook's result
    until the caller timed it out.)"""
    if not claim.start():
        _settle(outcome, outcome.set_result, _NOT_RUN)
        return
    hook_loop.running_hooks.add(hook)
    try:
        result = function(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
    except asyncio.CancelledError:
        outcome.cancel()
        raise
    except BaseException as error:
        _settle(outcome, outcome.set_exception, error)
        raise
    else:
        _settle(outcome, outcome.set_result, result)
    finally:
        hook_loop.running_hooks.discard(hook)


def _settle(outcome: concurrent.futures.Future, setter: Callable[[Any], None], value: Any) -> None:
    try:
        setter(value)
    except concurrent.futures.InvalidStateError:  # cancelled by the caller meanwhile
        pass


class HookRunner:
    """Runs hooks on the hook loop, each bounded by ``timeout_s`` (None: unbounded).

    Use as a context manager, or call :meth:`close` (idempotent). The loop thread starts on the
    first call.
    """

    def __init__(self, timeout_s: float | None, *, name: str = "megarl-hooks") -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"hook timeout must be > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s
        self.name = name
        self.num_loop_replacements = 0
        """Hook loops abandoned because a hook blocked them."""
        self._hook_loop: _HookLoop | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _current(self) -> _HookLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"HookRunner {self.name!r} is closed")
            if self._hook_loop is None:
                self._hook_loop = _HookLoop(self.name)
            return self._hook_loop

    @property
    def blocked_after_s(self) -> float:
        """A hook loop without a heartbeat for this long is blocked: half the time limit (10 s when unbounded)."""
        return 10.0 if self.timeout_s is None else self.timeout_s / 2

    async def call(self, hook: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``await function(*args, **kwargs)`` (or its plain result) on the hook loop, within ``timeout_s``.

        ``hook`` names the call in errors and logs (e.g. ``"'calc' create"``). Exceptions of the
        hook propagate; expiry raises :class:`HookTimeout`. The time limit runs from the hook's
        start: a call queued on a loop that a blocking hook holds moves to a fresh loop (it has
        not started, so it runs once) and starts there.
        """
        while True:
            hook_loop = self._current()
            claim = _Claim()
            outcome: concurrent.futures.Future = concurrent.futures.Future()
            future = asyncio.run_coroutine_threadsafe(
                _invoke(hook_loop, claim, hook, function, args, kwargs, outcome), hook_loop.loop)
            future.add_done_callback(lambda task: task.cancelled() and outcome.cancel())
            waiting = asyncio.wrap_future(outcome)
            while True:
                left = None
                if claim.started_at is not None and self.timeout_s is not None:
                    left = claim.started_at + self.timeout_s - time.monotonic()
                done, _ = await asyncio.wait({waiting}, timeout=WATCH_S if left is None else min(WATCH_S, left))
                if done:
                    if waiting.cancelled():  # its loop was abandoned (blocked) while the hook awaited something
                        raise HookTimeout(hook, self.timeout_s, hook_loop.blocked_for(), True)
                    result = waiting.result()
                    if result is _NOT_RUN:
                        break
                    return result
                blocked = hook_loop.blocked_for()
                loop_blocked = blocked >= self.blocked_after_s
                if claim.started_at is None:
                    if loop_blocked and claim.abandon():
                        future.cancel()
                        self._replace(hook_loop, blocked)
                        break  # resubmit on a fresh loop
                elif self.timeout_s is not None and time.monotonic() - claim.started_at >= self.timeout_s:
                    future.cancel()
                    if loop_blocked:
                        self._replace(hook_loop, blocked)
                    raise HookTimeout(hook, self.timeout_s, blocked, loop_blocked)

    def _replace(self, hook_loop: _HookLoop, blocked_s: float) -> None:
        """Abandon ``hook_loop`` (blocked) for a fresh loop, once per blocked loop."""
        with self._lock:
            if self._hook_loop is not hook_loop:
                return
            self._hook_loop = None
            self.num_loop_replacements += 1
        logger.warning("a tool/interaction hook has blocked the hook event loop for %.1f s (running: %s); later "
                       "hooks run on a new loop. Make blocking hook code async (asyncio.to_thread)",
                       blocked_s, sorted(hook_loop.running_hooks) or "unknown")
        hook_loop.stop()

    def close(self) -> None:
        """Stop the hook loop (a thread blocked in a hook is left to die with the process)."""
        with self._lock:
            self._closed = True
            hook_loop, self._hook_loop = self._hook_loop, None
        if hook_loop is not None:
            hook_loop.stop()
            hook_loop.thread.join(timeout=1.0)

    def __enter__(self) -> "HookRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
