"""Rollout engines as Ray actors, and the driver-side proxy the rollout manager talks to.

A :class:`RolloutWorker` hosts one engine (``HFEngine`` on CPU or GPU, ``SGLangEngine`` on
GPU) in its own process on the bundles of the actor replica it serves. The driver's
:class:`megarl.rollout.RolloutManager` sees each engine through a :class:`RemoteEngine`,
which implements the engine protocol by calling the worker: the manager's fan-out over
replicas, the agent loop and the sampling seeds work unchanged, whether an engine lives in
the driver (tests) or in a worker (training).

Weight updates do not pass through the driver: the actor's ranks stream their buckets
straight to the workers' ``update_weights_from_tensor`` (see
:meth:`megarl.workers.megatron_workers.ActorWorker.sync_weights`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from megarl.config.model import ModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.rollout.engine import GenerateOutput, NamedTensors, SamplingParams
from megarl.workers.base import Worker, busy


def flatten_bucket(named_tensors: NamedTensors, dtype=None) -> tuple[list[str], list[tuple[int, ...]], Any]:
    """``(names, shapes, flat)``: a bucket as one tensor for Ray (in ``dtype``; default: the bucket's widest).

    A tensor that is a view (the exporter's buckets are views of one buffer) pickles its whole
    base storage, once per tensor; one flat tensor pickles only the bucket's bytes.
    """
    import functools

    import torch

    tensors = [tensor for _, tensor in named_tensors]
    if dtype is None:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    return [name for name, _ in named_tensors], [tuple(t.shape) for t in tensors], flat


SGLANG_BASE_PORT = 30000
"""Port of engine 0's SGLang server (SGLang's own default)."""
SGLANG_PORT_STRIDE = 97
"""Ports between consecutive engines: SGLang opens a few ports above its own (scheduler, detokenizer, NCCL),
so engines on one node must not take neighbouring ports."""


class RolloutWorker(Worker):
    """One rollout engine replica (``rollout.name``: ``hf`` or ``sglang``)."""

    role = "rollout"

    def __init__(self, replica: int = 0):
        self.replica = replica
        self.engine = None

    def init_engine(self, *, rollout: RolloutConfig, model: ModelConfig, tp_size: int = 1, seed: int = 0,
                    device: str = "cpu") -> dict:
        """Build the engine of ``rollout.name`` for the policy ``model``; returns its description.

        ``tp_size``: the engine's GPUs (``sglang``); ``seed``: the engine's own sampling seed (used by
        requests that carry none); ``device``: ``trainer.device``.
        """
        import torch

        if rollout.name == "hf":
            from transformers.utils import logging as hf_logging

            from megarl.rollout.hf_engine import HFEngine

            hf_logging.disable_progress_bar()  # one "Loading weights" bar per engine is noise in the run's log

            if device == "cuda":
                device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
            self.engine = HFEngine(model.local_path, dtype=getattr(torch, rollout.dtype), device=device, seed=seed,
                                   trust_remote_code=model.trust_remote_code)
        elif rollout.name == "sglang":
            from megarl.rollout.sglang_engine import SGLangEngine

            self.engine = SGLangEngine(model.local_path, tp_size=tp_size,
                                       mem_fraction_static=rollout.gpu_memory_utilization, dtype=rollout.dtype,
                                       random_seed=seed, port=SGLANG_BASE_PORT + SGLANG_PORT_STRIDE * self.replica,
                                       trust_remote_code=model.trust_remote_code,
                                       disable_cuda_graph=rollout.enforce_eager)
        else:
            raise ValueError(f"actor_rollout_ref.rollout.name={rollout.name!r} is unknown; use 'hf' or 'sglang'")
        return {"name": rollout.name, "dtype": rollout.dtype, "device": str(device), "replica": self.replica}

    # -------------------------------------------------------------------- the engine protocol
    @busy
    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams,
                 return_logprob: bool = False) -> list[GenerateOutput]:
        return self.engine.generate(input_ids, sampling_params, return_logprob=return_logprob)

    async def async_generate(self, input_ids: Sequence[int], sampling_params: SamplingParams,
                             return_logprob: bool = False) -> GenerateOutput:
        return await self.engine.async_generate(input_ids, sampling_params, return_logprob=return_logprob)

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def update_weights_from_tensor(self, named_tensors: NamedTensors) -> int:
        """Apply one bucket; returns its bytes."""
        self.engine.update_weights_from_tensor(named_tensors)
        return sum(t.numel() * t.element_size() for _, t in named_tensors)

    def update_weights_from_flat(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]], flat) -> int:
        """Apply one bucket sent as one flat tensor plus names and shapes (how the actor streams); its bytes."""
        from megarl.convert.export import split_flat

        self.engine.update_weights_from_tensor(list(zip(names, split_flat(flat, shapes))))
        return flat.numel() * flat.element_size()

    def end_weight_update(self) -> None:
        self.engine.end_weight_update()

    def weight_digests(self, names: Sequence[str]) -> dict[str, str]:
        """Digests of the engine's weights (``{}`` when the engine cannot report them)."""
        digests = getattr(self.engine, "weight_digests", None)
        return {} if digests is None else digests(names)

    def release_memory_occupation(self) -> None:
        self.engine.release_memory_occupation()

    def resume_memory_occupation(self) -> None:
        self.engine.resume_memory_occupation()

    def flush_cache(self) -> None:
        self.engine.flush_cache()


class RemoteEngine:
    """The engine protocol on the driver, forwarded to a :class:`RolloutWorker` actor.

    ``generate`` blocks on the worker (the manager runs replicas in threads) for at most ``timeout_s``
    (``trainer.worker_timeout_s``);
    ``async_generate`` awaits the worker's coroutine, so the agent loop keeps many requests
    in flight per engine. Worker failures surface as Ray errors naming the actor.
    """

    def __init__(self, handle, *, replica: int = 0, timeout_s: float):
        self.handle = handle
        self.replica = replica
        self.timeout_s = timeout_s

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams,
                 return_logprob: bool = False) -> list[GenerateOutput]:
        return self._get(self.handle.generate.remote(list(map(list, input_ids)), sampling_params,
                                                     return_logprob=return_logprob))

    async def async_generate(self, input_ids: Sequence[int], sampling_params: SamplingParams,
                             return_logprob: bool = False) -> GenerateOutput:
        return await self.handle.async_generate.remote(list(input_ids), sampling_params,
                                                       return_logprob=return_logprob)

    def begin_weight_update(self) -> None:
        self._get(self.handle.begin_weight_update.remote())

    def update_weights_from_tensor(self, named_tensors: NamedTensors) -> None:
        self._get(self.handle.update_weights_from_flat.remote(*flatten_bucket(list(named_tensors))))

    def end_weight_update(self) -> None:
        self._get(self.handle.end_weight_update.remote())

    def weight_digests(self, names: Sequence[str]) -> dict[str, str]:
        return self._get(self.handle.weight_digests.remote(list(names)))

    def release_memory_occupation(self) -> None:
        self._get(self.handle.release_memory_occupation.remote())

    def resume_memory_occupation(self) -> None:
        self._get(self.handle.resume_memory_occupation.remote())

    def flush_cache(self) -> None:
        self._get(self.handle.flush_cache.remote())

    def __repr__(self) -> str:
        return f"RemoteEngine(replica={self.replica})"
