"""Concurrent single requests to the CPU engine run as batches (one per sampling setting) on its engine thread."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from megarl.engines.engine import GenerateOutput, SamplingParams


class RequestBatcher:
    """Collects single requests made on one event loop and runs them as batches on the engine thread."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        """``engine``: the :class:`~megarl.engines.cpu_engine.hf_engine.HFEngine` whose thread runs the batches."""
        self._engine = engine
        self._loop = loop
        # (prompt, params, return_logprob, row seed, future) per waiting request.
        self._pending: list[tuple[list[int], SamplingParams, bool, int, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    async def submit(self, prompt: list[int], params: SamplingParams, return_logprob: bool,
                     row_seed: int) -> GenerateOutput:
        future = self._loop.create_future()
        self._pending.append((prompt, params, return_logprob, row_seed, future))
        if self._worker is None or self._worker.done():
            # The task's first step runs after the coroutines already scheduled in this
            # iteration, so requests started together (asyncio.gather) form one batch.
            self._worker = self._loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            pending, self._pending = self._pending, []
            # Requests that differ only in seed and max_new_tokens share a batch (both are per row).
            groups: dict[tuple[SamplingParams, bool], list] = {}
            for item in pending:
                key = dataclasses.replace(item[1], seed=None, max_new_tokens=1)
                groups.setdefault((key, item[2]), []).append(item)
            for (params, return_logprob), items in groups.items():
                live = [item for item in items if not item[4].done()]
                if not live:
                    continue
                # An error of the batch (e.g. generating inside a weight-update session) is handed to
                # every request of it, which re-raises it in its caller.
                (outcome,) = await asyncio.gather(self._loop.run_in_executor(
                    self._engine._executor, self._engine.generate_rows, [item[0] for item in live], params,
                    return_logprob, [item[3] for item in live], [item[1].max_new_tokens for item in live]),
                    return_exceptions=True)
                for k, item in enumerate(live):
                    if item[4].done():
                        continue
                    if isinstance(outcome, BaseException):
                        item[4].set_exception(outcome)
                    else:
                        item[4].set_result(outcome[k])
