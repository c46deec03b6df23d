"""A rollout engine that replays scripted assistant turns, for agent-loop tests.

:class:`ScriptedEngine` implements the :class:`~megarl.engines.engine.RolloutEngine` protocol.
Each script is a list of :class:`Turn` keyed by a text that identifies the conversation (for
example the user's question); on every call the engine decodes the prompt ids, picks the
script whose key appears in it, and answers with the turn whose number is the count of
assistant turns already in the prompt. A turn's text is tokenised with the real tokenizer and
ends with EOS; ``max_new_tokens`` cuts it (finish ``length``) and configured stop ids end it
early, as a real engine would. Log-probs are fake but deterministic: ``-0.01 * (k + 1)`` for
the k-th output token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from megarl.engines.engine import FinishReason, GenerateOutput, SamplingParams


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """The project's tiny BPE tokenizer with the Qwen2.5-style template (built once per process)."""
    from megarl.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


class Together:
    """A rendezvous that shows callers run concurrently, on a machine of any speed: :meth:`arrive` returns once
    ``count`` callers are inside at once. Callers run one after another never get there: the first fails after
    ``guard_s`` (a guard against a hang, never a measure of speed)."""

    def __init__(self, count: int, guard_s: float = 60.0) -> None:
        self.count, self.guard_s, self.arrived = count, guard_s, 0

    async def arrive(self) -> None:
        import time

        self.arrived += 1
        deadline = time.monotonic() + self.guard_s
        while self.arrived < self.count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.arrived} of {self.count} callers were inside at once after "
                                     f"{self.guard_s:.0f} s: they do not run concurrently")
            await asyncio.sleep(0.001)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One scripted assistant turn."""

    text: str = ""
    """What the model writes (EOS is appended unless ``ids`` is given)."""
    ids: tuple[int, ...] | None = None
    """Exact output ids instead of ``text`` (e.g. a non-canonical tokenisation)."""
    abort: bool = False
    """Answer with finish reason ``abort`` and no tokens."""
    delay_s: float = 0.0
    """Seconds to wait (asynchronously) before answering."""
    together: Together | None = None
    """Answer only once this rendezvous is full (concurrent calls), before ``delay_s``."""


def fake_logprobs(num_tokens: int) -> list[float]:
    """The log-probs the scripted engine reports for ``num_tokens`` output tokens."""
    return [-0.01 * (k + 1) for k in range(num_tokens)]


class ScriptedEngine:
    """Replays scripts; records every call as ``(input_ids, sampling_params)`` in :attr:`calls`."""

    def __init__(self, tokenizer: Any, scripts: Mapping[str, Sequence[Turn | str]]) -> None:
        self.tokenizer = tokenizer
        self.scripts = {key: [turn if isinstance(turn, Turn) else Turn(turn) for turn in turns]
                        for key, turns in scripts.items()}
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.images: list[list[str] | None] = []
        """Per :meth:`async_generate` call: the images it was given (None: none)."""
        self.in_weight_update = False

    def _turn(self, input_ids: Sequence[int]) -> Turn:
        text = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)
        keys = [key for key in self.scripts if key in text]
        if len(keys) != 1:
            raise ValueError(f"prompt matches scripts {keys}; expected exactly one of {list(self.scripts)}")
        number = text.count("<|im_start|>assistant") - 1
        script = self.scripts[keys[0]]
        if number >= len(script):
            raise ValueError(f"script {keys[0]!r} has {len(script)} turns; turn {number + 1} was requested")
        return script[number]

    def _answer(self, turn: Turn, sampling_params: SamplingParams, return_logprob: bool) -> GenerateOutput:
        if turn.abort:
            return GenerateOutput([], FinishReason.ABORT, [] if return_logprob else None)
        ids = list(turn.ids) if turn.ids is not None else (
            self.tokenizer.encode(turn.text, add_special_tokens=False) + [self.tokenizer.eos_token_id])
        finish = FinishReason.STOP
        for position, token in enumerate(ids):
            if token in sampling_params.stop_token_ids:
                ids = ids[:position + 1]
                break
        if len(ids) > sampling_params.max_new_tokens:
            ids, finish = ids[:sampling_params.max_new_tokens], FinishReason.LENGTH
        return GenerateOutput(ids, finish, fake_logprobs(len(ids)) if return_logprob else None)

    async def async_generate(self, input_ids: Sequence[int], sampling_params: SamplingParams,
                             return_logprob: bool = False, image_data: Sequence[str] | None = None) -> GenerateOutput:
        """The scripted turn for this conversation (``image_data``: recorded in :attr:`images`)."""
        assert not self.in_weight_update, "generate during a weight update"
        self.calls.append((list(input_ids), sampling_params))
        self.images.append(None if image_data is None else list(image_data))
        turn = self._turn(input_ids)
        if turn.together is not None:
            await turn.together.arrive()
        if turn.delay_s:
            await asyncio.sleep(turn.delay_s)
        return self._answer(turn, sampling_params, return_logprob)

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams,
                 return_logprob: bool = False) -> list[GenerateOutput]:
        """The scripted turn of every sequence (delays ignored)."""
        self.calls.extend((list(ids), sampling_params) for ids in input_ids)
        return [self._answer(self._turn(ids), sampling_params, return_logprob) for ids in input_ids]

    def begin_weight_update(self) -> None:
        self.in_weight_update = True

    def update_weights_from_tensor(self, named_tensors) -> None:
        assert self.in_weight_update, "update_weights_from_tensor outside a weight-update session"

    def end_weight_update(self) -> None:
        self.in_weight_update = False

    def release_memory_occupation(self) -> None:
        pass

    def resume_memory_occupation(self) -> None:
        pass

    def flush_cache(self) -> None:
        pass
