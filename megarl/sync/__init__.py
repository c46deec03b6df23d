"""Weight sync: moving the actor's weights into the rollout engines after each update.

One module per transport behind :class:`~megarl.sync.base.WeightTransport`, on the engine servers' HTTP API
(SGLang's routes; megarl's CPU engine server implements the same):

- :mod:`megarl.sync.tensor` (``tensor``): colocated engines open handles to the actor ranks' own bucket
  buffers (CUDA IPC on GPU, shared memory on CPU), one payload per engine TP rank; no tensor bytes travel.
- :mod:`megarl.sync.distributed` (``distributed``): engines on their own GPUs receive each bucket by one
  broadcast from the pipeline stage that built it (NCCL on GPU, gloo on CPU).

- :mod:`megarl.sync.adapters` (``adapters``): a LoRA run's adapters alone, into engines serving LoRA
  (``actor_rollout_ref.rollout.lora_sync=adapters``), by SGLang's ``/load_lora_adapter_from_tensors``.

``actor_rollout_ref.rollout.weight_transport``: ``auto`` picks ``tensor`` for colocated engines
(``hybrid_engine=true``) and ``distributed`` for disaggregated ones. The buckets come from the converter's
streaming export (:meth:`megarl.convert.export.WeightExporter.iter_buckets`). A transport's class says what it
asks of the export (:meth:`~megarl.sync.base.WeightTransport.export_args`: the bucket size, the buffers its buckets
take turns in, the ranks that hold them) and reports what a sync allocates from the same values
(:meth:`~megarl.sync.base.WeightTransport.plan_buffers`), which the planner (:mod:`megarl.plan.weight_sync`) prints.
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.config.rollout import resolve_transport
from megarl.engines.client import EngineAddress
from megarl.sync.base import TRANSPORTS, RankLayout, SyncBuffers, WeightTransport, merge_stats, verify_sample

__all__ = ["TRANSPORTS", "RankLayout", "SyncBuffers", "WeightTransport", "make_transport", "merge_stats",
           "resolve_transport", "transport_class", "verify_sample"]


def transport_class(name: str) -> type[WeightTransport]:
    """The class of transport ``name`` (resolved: ``tensor`` or ``distributed``)."""
    if name == "tensor":
        from megarl.sync.tensor import TensorTransport

        return TensorTransport
    if name == "distributed":
        from megarl.sync.distributed import DistributedTransport

        return DistributedTransport
    if name == "adapters":
        from megarl.sync.adapters import AdapterSync

        return AdapterSync
    raise ValueError(f"unknown weight transport {name!r}; one of {TRANSPORTS}")


def make_transport(name: str, groups, engines: Sequence[EngineAddress], *, device: str,
                   lora_config: dict | None = None, quantization: str | None = None) -> WeightTransport:
    """Transport ``name`` (resolved: ``tensor`` or ``distributed``; ``adapters``: a LoRA run's adapters alone, PEFT's
    ``lora_config``) for this actor rank; ``quantization`` (``fp8``): its buckets go out block-FP8; collective."""
    cls = transport_class(name)
    if cls.name == "adapters":
        return cls(groups, engines, config=lora_config)
    if cls.name == "distributed":
        transport = cls(groups, engines, backend="nccl" if device == "cuda" else "gloo")
    else:
        transport = cls(groups, engines)
    transport.quantization = quantization
    return transport
