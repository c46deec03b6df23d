"""The rollout producer of asynchronous training: groups generated into a :class:`RolloutBuffer` while the trainer
trains.

The producer runs on the process's event loop (:mod:`megarl.engines.event_loop`), as its engine clients and the
rollout manager do. An admission task issues the run's prompt groups as the buffer's staleness bound allows
(at most ``max_inflight`` generating: the buffer counts them); each group (the ``n`` samples of one prompt) is a
task that generates it with :meth:`RolloutManager.agenerate`, seeded by its place in the prompt sequence and its
attempt (``derive_seed(base_seed, index, attempt)``: a group issued again after a resume samples what it sampled
before), scored by the caller's ``score`` on the producer's scoring thread (user code that may block, so never on
the loop) and stored in the buffer. The producer's state belongs to the loop: the trainer's calls run there and
wait. The trainer takes each step's groups with :meth:`RolloutProducer.take` and wraps every weight sync in
:meth:`RolloutProducer.weight_update`:

- without partial rollouts, admission stops and the groups in flight finish before the sync (each sample is of one
  version; ``one_step_off`` training);
- with partial rollouts, the engines pause (SGLang's ``/pause_generation``, ``retract`` or ``in_place``), the
  weights change under the held requests, and generation continues: a request spanning the update has tokens of
  both versions (``rollout_weight_versions``), and the cache is flushed unless held in place.

Errors of the groups' tasks come back from :meth:`take`. :meth:`stop` aborts what runs, cancels the tasks and
waits for them and for the scoring thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from megarl.data.batch import Batch
from megarl.engines import event_loop
from megarl.rollout.buffer import GroupRecord, GroupStatus, RolloutBuffer
from megarl.rollout.manager import RolloutManager
from megarl.seeds import derive_seed

PAUSE_MODES_WITH_CONTINUATION = ("retract", "in_place")
"""Pause modes under which held requests continue after an update (``abort`` ends them: their rows would have
to be continued by new requests, which the producer does not do)."""


class RolloutProducer:
    """See the module docstring. ``prompts_of(index)``: the one-prompt batch of group ``index`` (with its ``uid``);
    ``score(group)``: the group with its rewards; ``max_inflight``: groups generating at once; ``loop``: the event
    loop to run on (the process's, :func:`megarl.engines.event_loop.current`, by default)."""

    def __init__(self, manager: RolloutManager, buffer: RolloutBuffer, *, prompts_of: Callable[[int], Batch],
                 score: Callable[[Batch], Batch], base_seed: int, max_inflight: int, partial_rollout: bool = False,
                 pause_mode: str = "retract", loop: event_loop.EventLoopThread | None = None) -> None:
        if max_inflight < 1:
            raise ValueError(f"async_training.max_inflight_groups must be >= 1, got {max_inflight}")
        if partial_rollout and pause_mode not in PAUSE_MODES_WITH_CONTINUATION:
            raise ValueError(f"async_training.pause_mode={pause_mode!r} with partial_rollout=true: choose one of "
                             f"{', '.join(PAUSE_MODES_WITH_CONTINUATION)} (abort ends the held requests)")
        self.manager, self.buffer = manager, buffer
        self.prompts_of, self.score = prompts_of, score
        self.base_seed, self.max_inflight = base_seed, max_inflight
        self.partial_rollout, self.pause_mode = partial_rollout, pause_mode
        self._loop = loop if loop is not None else event_loop.current()
        # The state below is read and changed on the loop only.
        self._changed = asyncio.Event()
        """Set (and replaced) at every change of the state: :meth:`_wait_until` wakes up and looks again."""
        self._version = 0
        self._admitting = True
        self._stopping = False
        self._inflight = 0
        self._again: list[GroupRecord] = []
        self._error: BaseException | None = None
        self._admission: asyncio.Task | None = None
        self._groups: set[asyncio.Task] = set()
        self._scoring = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-score")
        self._stopped = False
        self._busy_since: float | None = None
        self._busy_s = 0.0

    def _on_loop(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` run on the loop (the state's one thread), from the trainer's thread."""
        async def call() -> Any:
            return function(*args)

        return self._loop.run(call())

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    # --------------------------------------------------------------------------- life
    def start(self, version: int, again: list[GroupRecord] = ()) -> None:
        """Start issuing groups, the engines holding weight version ``version``; ``again``: groups to issue first
        (those generating when a checkpoint was saved)."""
        self._on_loop(self._start, version, list(again))

    def _start(self, version: int, again: list[GroupRecord]) -> None:
        self._version = version
        self._again = again
        self._inflight = len(again)  # issued: they count against max_inflight
        self._admission = asyncio.ensure_future(self._admit())
        self._admission.add_done_callback(self._admission_ended)

    def stop(self) -> None:
        """Stop issuing, abort the engines' requests, cancel the groups' tasks and wait for them and the scoring
        thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._loop.run(self._stop())
        finally:
            self._scoring.shutdown(wait=True, cancel_futures=True)

    async def _stop(self) -> None:
        self._stopping = True
        self._notify()
        if self._admission is not None:
            with contextlib.suppress(Exception):
                await asyncio.gather(*(engine.abort_request(abort_all=True) for engine in self.manager.engines))
        tasks = [task for task in (self._admission, *self._groups) if task is not None and not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --------------------------------------------------------------------------- producer
    async def _admit(self) -> None:
        while True:
            await self._wait_until(lambda: self._stopping or self._issuable())
            if self._stopping:
                return
            again, self._again = self._again, []  # already counted: the buffer keeps them issued
            fresh = self.buffer.capacity(self._version, self.max_inflight) if self._admitting else 0
            records = again + [self.buffer.issue_next() for _ in range(fresh)]
            self._inflight += fresh
            if self._inflight and self._busy_since is None:
                self._busy_since = time.perf_counter()
            for record in records:
                task = asyncio.ensure_future(self._generate(record))
                self._groups.add(task)
                task.add_done_callback(self._groups.discard)

    def _admission_ended(self, task: asyncio.Task) -> None:
        """An admission that failed (the buffer, the prompt sequence) fails the run through :meth:`take`."""
        if not task.cancelled() and task.exception() is not None and self._error is None and not self._stopping:
            self._error = task.exception()
            self._notify()

    def _issuable(self) -> bool:
        if self._error is not None:
            return False
        return bool(self._again) or (self._admitting and self.buffer.capacity(self._version, self.max_inflight) > 0)

    async def _generate(self, record: GroupRecord) -> None:
        try:
            prompts = self.prompts_of(record.index)
            group = await self.manager.agenerate(prompts, seed=derive_seed(self.base_seed, record.index,
                                                                           record.attempt))
            if not self._stopping:  # else aborted by stop(): nothing to score or keep
                group = await asyncio.get_running_loop().run_in_executor(self._scoring, self.score, group)
                self.buffer.completed(record.index, record.attempt, group)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - handed to the trainer by take()
            if not self._stopping and self._error is None:
                self._error = error
        finally:
            self._finished()

    def _finished(self) -> None:
        self._inflight -= 1
        if not self._inflight and self._busy_since is not None:
            self._busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None
        self._notify()

    # --------------------------------------------------------------------------- trainer
    def take(self, step: int, *, timeout_s: float) -> Batch:
        """Step ``step``'s groups, whole and in order (rows of a group adjacent), once generated."""
        taken = self._loop.run(self._take(step, timeout_s))
        return Batch.concat([record.batch for record in taken])

    async def _take(self, step: int, timeout_s: float) -> list[GroupRecord]:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._error is not None:
                raise RuntimeError(f"asynchronous rollout failed: {self._error}") from self._error
            out = self.buffer.take(step)
            if out is not None:
                taken, again = out
                if again:
                    self._again.extend(again)
                    self._inflight += len(again)
                    self._notify()
                if taken:
                    return taken
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"step {step}: no batch within {timeout_s:.0f} s (trainer.worker_timeout_s); "
                                   f"{self._inflight} groups generating")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[bool]:
        """Wrap a weight sync to version ``version``; yields whether the sync may flush the engines' caches."""
        engines = self.manager.engines
        if not self.partial_rollout:
            self._loop.run(self._drain())
            try:
                yield True
            finally:
                self._on_loop(self._resume, version, True)
            return
        self._loop.gather([engine.pause_generation(self.pause_mode) for engine in engines])
        try:
            yield self.pause_mode != "in_place"  # SGLang refuses to flush a cache held requests still use
        finally:
            self._on_loop(self._resume, version, None)
            self._loop.gather([engine.continue_generation() for engine in engines])

    async def _drain(self) -> None:
        """Stop admitting and wait for the groups in flight (or an error)."""
        self._admitting = False
        await self._wait_until(lambda: not self._inflight or self._error is not None)

    def _resume(self, version: int, admitting: bool | None) -> None:
        """The engines hold ``version`` now; ``admitting``: admit again (None: as before)."""
        self._version = version
        if admitting is not None:
            self._admitting = admitting
        self._notify()

    def take_busy(self) -> float:
        """Seconds with at least one group generating since the last call."""
        return self._on_loop(self._take_busy)

    def _take_busy(self) -> float:
        now = time.perf_counter()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        self._busy_s, self._busy_since = 0.0, (now if self._busy_since is not None else None)
        return busy

    @property
    def started(self) -> bool:
        return self._admission is not None

    @property
    def pending(self) -> dict[str, int]:
        """Groups generating and groups generated but not yet taken."""
        def count() -> dict[str, int]:
            done = sum(r.status is GroupStatus.DONE for r in self.buffer.records.values())
            return {"generating": self._inflight, "ready": done}

        return self._on_loop(count)

    @property
    def consumed(self) -> int:
        """Groups of the prompt sequence consumed, filtered or dropped (the buffer's head)."""
        return self._on_loop(lambda: self.buffer.head)

    @property
    def version(self) -> int:
        return self._on_loop(lambda: self._version)

    def state(self):
        """The buffer's checkpoint (:meth:`RolloutBuffer.state_dict`), taken on the loop while generation goes
        on."""
        return self._on_loop(self.buffer.state_dict)
