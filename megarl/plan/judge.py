"""A generative judge's engines in the plan (``reward_model.judge``): what each GPU of the judge's own pool holds.

An SGLang judge engine of TP ``t`` holds its weights' TP shard (vocabulary padded as SGLang pads it) and sizes its
KV cache when it starts: ``gpu_memory_utilization × GPU − CUDA context − weights``. That cache must hold at least one
judge request (``rollout.prompt_length + rollout.response_length`` tokens); ``max_concurrency`` requests at once
fit when it holds that many. megarl's ``hf`` engine (one process, one GPU) holds the whole model and the cache of
its share of the requests in flight. Nothing else runs on the pool, so this is each judge GPU's whole plan.
"""

from __future__ import annotations

import dataclasses
import math

from megarl.config.schema import RunConfig
from megarl.models.sizes import Architecture
from megarl.plan.memory import DTYPE_BYTES

KEY = "reward_model.judge"


@dataclasses.dataclass(frozen=True)
class JudgePlan:
    """Each judge GPU's memory (bytes) and what its engine's KV cache holds."""

    model: Architecture
    engine: str
    """``sglang`` or ``hf``."""
    num_engines: int
    tp: int
    gpu_memory: int
    context: int
    weights: int
    kv_cache: int
    """Bytes of KV cache per GPU (below 0 when nothing is left for it)."""
    kv_tokens: int
    request_tokens: int
    """One judge request at its longest: ``prompt_length + response_length``."""
    max_concurrency: int
    gpu_memory_fraction: float
    """``rollout.gpu_memory_utilization``."""

    @property
    def peak(self) -> int:
        return self.context + self.weights + max(self.kv_cache, 0)

    @property
    def concurrent_fit(self) -> int:
        """Judge requests at their longest that the engines' caches hold at once."""
        return self.num_engines * (self.kv_tokens // self.request_tokens)

    def lines(self) -> list[str]:
        cache = f"{_gib(self.kv_cache)} GiB KV cache ({self.kv_tokens:,} tokens)" if self.kv_cache > 0 else \
            "no room for a KV cache"
        return [f"judge ({self.model.name}, {self.model.num_params / 1e9:.2f} B parameters): {self.num_engines} "
                f"{self.engine} engine(s) of TP {self.tp} on pool judge; per GPU {_gib(self.weights)} GiB weights, "
                f"{cache}, {_gib(self.context)} GiB context: {_gib(self.peak)} of {_gib(self.gpu_memory)} GiB; "
                f"{self.concurrent_fit:,} requests of {self.request_tokens:,} tokens at once "
                f"({KEY}.max_concurrency={self.max_concurrency})"]

    def problems(self) -> list[str]:
        """Why the judge's engines do not fit (empty when they do), naming the settings that would help."""
        r = f"{KEY}.rollout"
        if self.peak > self.gpu_memory:
            return [f"the judge's {self.engine} engines need {_gib(self.peak)} GiB per GPU (weights "
                    f"{_gib(self.weights)} GiB), more than {_gib(self.gpu_memory)} GiB: raise "
                    f"{r}.tensor_model_parallel_size or judge with a smaller model ({KEY}.model.path)"]
        if self.kv_tokens < self.request_tokens:
            return [f"the judge's {self.engine} engines would hold {max(self.kv_tokens, 0):,} tokens of KV cache per "
                    f"engine, less than one {self.request_tokens:,}-token judge request ({r}.prompt_length + "
                    f"{r}.response_length): raise {r}.gpu_memory_utilization (now {self.gpu_memory_fraction}), raise "
                    f"{r}.tensor_model_parallel_size, or shorten the judge's prompt and answer"]
        return []


def plan_judge(cfg: RunConfig, model: Architecture, gpu_memory: int, context: int) -> JudgePlan:
    """The judge's plan for ``cfg`` (``reward_model.judge.enable``) on GPUs of ``gpu_memory`` bytes, each engine
    process taking ``context`` bytes for its CUDA context."""
    from megarl.models.family import sglang_padded_vocab

    judge = cfg.reward_model.judge
    r = judge.rollout
    tp = judge.engine_tp
    engines = sum(judge.pool_nodes) // tp
    dtype = DTYPE_BYTES[r.dtype]
    request = r.prompt_length + r.response_length
    if r.name == "sglang":
        weights = model.rank_params(tp=tp, padded_vocab=sglang_padded_vocab(model.vocab, tp)) * dtype
        kv = int(r.gpu_memory_utilization * gpu_memory) - context - weights
        per_token = model.kv_bytes_per_token(tp, dtype)
    else:  # megarl's hf engine: the whole model, the cache of its share of the requests in flight
        weights = model.num_params * dtype
        per_token = model.kv_bytes_per_token(1, dtype)
        kv = math.ceil(judge.max_concurrency / engines) * request * per_token
    return JudgePlan(model=model, engine=r.name, num_engines=engines, tp=tp, gpu_memory=gpu_memory, context=context,
                     weights=weights, kv_cache=kv, kv_tokens=max(kv, 0) // per_token, request_tokens=request,
                     max_concurrency=judge.max_concurrency, gpu_memory_fraction=r.gpu_memory_utilization)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}"
