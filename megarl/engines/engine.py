"""The rollout engine protocol, mirroring SGLang's RL API, and the types it exchanges.

Engines generate from token ids and receive new weights in place between training steps:

- ``generate`` / ``async_generate``: one output per input sequence (``n`` samples are
  expressed by repeating the inputs), optionally with the log-probability of every sampled
  token under the engine's own numerics.
- Weight updates happen inside a session: ``begin_weight_update()``, then any number of
  ``update_weights_from_tensor(named_tensors)`` calls with HF-named tensors (bucket by
  bucket, in HF layout, or the engine's TP slice on the TP-matched path), then
  ``end_weight_update()``, which flushes the prefix cache. SGLang 0.5.23 requires the
  session; every engine enforces it so that code written on CPU works on GPU.
- ``release_memory_occupation`` / ``resume_memory_occupation`` free and retake accelerator
  memory around training phases (colocated placement); ``flush_cache`` drops cached prefixes.

``HFEngine`` (transformers; the engine inside megarl's CPU engine server) implements it; the
rollout manager and the weight sync reach engines over SGLang's HTTP API
(:class:`megarl.engines.client.EngineClient`), not through this protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from megarl.config.common import check_sampling
from megarl.config.rollout import RolloutConfig


class FinishReason(str, enum.Enum):
    """Why a generation stopped (SGLang's ``meta_info.finish_reason.type``)."""

    STOP = "stop"
    """A stop token (EOS or a configured stop id) was sampled; it is the last output token."""
    LENGTH = "length"
    """``max_new_tokens`` was reached."""
    ABORT = "abort"
    """The engine gave up on the request."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings (names as SGLang's sampling params)."""

    max_new_tokens: int
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop tokens besides the tokenizer's EOS (included in the output when sampled)."""
    ignore_eos: bool = False
    seed: int | None = None
    """Seed for this request's sampling; engines derive per-row streams from it."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling("rollout", self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        """True when sampling is greedy (temperature 0)."""
        return self.temperature == 0


def sampling_params_for(config: RolloutConfig, *, max_new_tokens: int, validate: bool = False,
                        do_sample: bool | None = None, seed: int | None = None) -> SamplingParams:
    """The engine request's sampling from the rollout section: training (``config``'s) or validation
    (``config.val_kwargs``) sampling; greedy (temperature 0) when ``do_sample`` is False (default: the
    section's ``do_sample``)."""
    source = config.val_kwargs if validate else config
    if not (source.do_sample if do_sample is None else do_sample):
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, seed=seed)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=source.temperature, top_p=source.top_p,
                          top_k=source.top_k, seed=seed, ignore_eos=config.ignore_eos and not validate)


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One generated continuation."""

    output_ids: list[int]
    """Generated token ids, including the stop token when the finish reason is STOP."""
    finish_reason: FinishReason
    output_logprobs: list[float] | None = None
    """Per output token, ``log_softmax(logits / temperature)`` at the sampled id, before top-p /
    top-k truncation (temperature 1 when greedy): the quantity the trainer recomputes as
    ``old_log_probs``. None unless requested."""
    weight_version: str | None = None
    """The engine's weight version when the request finished (SGLang's ``meta_info.weight_version``)."""
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    """``(version, start, end)`` spans of the output tokens each version sampled (SGLang's
    ``meta_info.weight_versions``): more than one when the weights changed during the request."""
    routed_experts: Any = dataclasses.field(default=None, compare=False, repr=False)
    """Mixture-of-experts models, when asked (SGLang's ``return_routed_experts``): the experts the engine routed
    each token it computed to, ``[prompt + output tokens - 1, num_layers, top_k]`` int32 (numpy; the last
    output token is never fed back; dense layers hold zeros)."""

    def token_versions(self) -> list[str | None]:
        """The weight version that sampled each output token (``weight_version`` for all without spans)."""
        if self.weight_versions is None:
            return [self.weight_version] * len(self.output_ids)
        return [version for version, start, end in self.weight_versions for _ in range(start, end)]


NamedTensors = Sequence[tuple[str, torch.Tensor]]


class AsyncGenerator(Protocol):
    """What the agent loop needs: one continuation per call (an :class:`~megarl.engines.client.EngineClient`
    of the router or of an engine; a scripted engine in tests). A conversation with images also passes
    ``image_data=`` (its images as base64 data URIs, in order)."""

    async def async_generate(self, input_ids: Sequence[int], sampling_params: SamplingParams,
                             return_logprob: bool = False) -> GenerateOutput:
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """An in-process inference engine with SGLang's RL API shape (``HFEngine``; megarl's CPU server wraps it)."""

    def generate(
        self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams, return_logprob: bool = False
    ) -> list[GenerateOutput]:
        """Generate one continuation per input sequence."""
        ...

    async def async_generate(
        self, input_ids: Sequence[int], sampling_params: SamplingParams, return_logprob: bool = False
    ) -> GenerateOutput:
        """Generate one continuation for one sequence (request-level, multi-turn path)."""
        ...

    def begin_weight_update(self) -> None:
        """Open a weight-update session (generation is refused until it ends)."""
        ...

    def update_weights_from_tensor(self, named_tensors: NamedTensors) -> None:
        """Copy HF-named tensors into the engine's weights, in place (inside a session)."""
        ...

    def end_weight_update(self) -> None:
        """Close the session and flush the cache."""
        ...

    def release_memory_occupation(self) -> None:
        """Free accelerator memory (weights and KV cache) while training runs."""
        ...

    def resume_memory_occupation(self) -> None:
        """Take the memory back before generating."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes (mandatory after weights change)."""
        ...


@contextlib.contextmanager
def weight_update_session(engine: RolloutEngine):
    """``begin_weight_update`` ... ``end_weight_update`` around a block."""
    engine.begin_weight_update()
    try:
        yield engine
    finally:
        engine.end_weight_update()


def update_weights(engine: RolloutEngine, buckets: Iterable[NamedTensors]) -> int:
    """Stream ``buckets`` into ``engine`` in one session; return the bytes delivered."""
    delivered = 0
    with weight_update_session(engine):
        for bucket in buckets:
            engine.update_weights_from_tensor(bucket)
            delivered += sum(t.numel() * t.element_size() for _, t in bucket)
    return delivered
