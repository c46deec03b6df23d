"""Weight sync of a LoRA run's adapters alone (``actor_rollout_ref.rollout.lora_sync=adapters``).

The engines serve the base model they loaded (the HF model the actor's frozen base came from) with LoRA on
(SGLang's ``--enable-lora``); every generation request names the run's adapter (:data:`ADAPTER_NAME`). A sync
replaces that adapter:

1. every actor rank gathers the whole adapter in PEFT's layout (:func:`megarl.convert.lora.adapter_tensors`: each
   stage's layers all-gathered over its TP group; then the stages' over the pipeline group), cast to the engines'
   dtype;
2. each engine's *sender* posts ``/unload_lora_adapter`` (no request runs during a sync: the rollout holds them
   off) then ``/load_lora_adapter_from_tensors`` with one payload per engine TP rank and every tensor's sha256
   (``expected_checksums``, which every engine rank checks: a wrong byte fails the load), then
   ``/update_weight_version`` so the tokens sampled next carry the new version. A colocated engine's sender is
   the actor rank on its first GPU; each engine TP rank's payload is a handle to the adapters packed by the actor rank
   on that rank's own GPU (every actor rank holds them whole; CUDA IPC on GPU, shared memory on CPU:
   :func:`megarl.sync.base.flattened_payload`), gathered over the engine's host ranks as the ``tensor`` transport
   gathers its handles, so no engine rank maps another GPU's memory (a CUDA context on it for good). A disaggregated
   engine's sender is its DP replica's first rank, whose payloads carry the bytes (pickled by value: the engine may
   be on another node).

The statistics are the weight-sync metrics of the other transports (:func:`megarl.sync.base.merge_stats`); every
tensor of every engine is verified (its checksum) on every sync.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from megarl.convert.export import Bucket
from megarl.engines.client import EngineAddress, EngineClient, EngineError, gather_sync
from megarl.engines.lora_wire import ADAPTER_NAME, checksums
from megarl.sync.base import WeightTransport, all_gather_handles, flattened_payload, host_group


class AdapterSync(WeightTransport):
    """See the module docstring; built by every actor rank with the same engines. ``config``: PEFT's
    ``adapter_config.json`` of the run's adapters (:meth:`megarl.config.lora.LoraSpec.peft_config`)."""

    name = "adapters"

    def __init__(self, groups, engines: Sequence[EngineAddress], *, config: dict[str, Any]) -> None:
        super().__init__(groups, engines)
        self.config = config
        rank = dist.get_rank()
        lead = groups.tp_rank == 0 and groups.cp_rank == 0 and groups.pp_rank == 0
        self.hosted, self.group = host_group(self.engines, rank)
        """The colocated engine with a rank on this rank's GPU, and the gloo group of its host ranks (None: one)."""
        self.remote = [e for e in self.engines if not e.host_ranks and lead and e.replica == groups.dp_rank]
        """Disaggregated engines this rank's DP replica feeds (it is the replica's first rank): the bytes."""

    def _sync(self, exporter, *, bucket_bytes: int, version: str | None,
              verify_names: Sequence[str] = (), flush_cache: bool = True) -> dict[str, Any] | None:
        start = time.perf_counter()
        named = exporter.adapters()  # collective: every rank takes part
        sender = self.hosted is not None and self.hosted.host_ranks[0] == dist.get_rank()
        if self.hosted is not None:  # each engine rank opens the adapters packed on its own GPU
            bucket = Bucket.pack(named, shared_memory=True)
            payload = flattened_payload(bucket)
            handles = [payload] if self.group is None else all_gather_handles(payload, self.group, self.hosted.host_ranks)
        if not (sender or self.remote):
            if self.group is not None:
                dist.barrier(group=self.group)  # the sender's load has opened this rank's buffer
            return None
        sums = checksums(dict(named))
        loads = [self._load(self.hosted, handles, sums, version)] if sender else []
        if self.remote:
            data = flattened_payload(Bucket.pack([(n, t.cpu()) for n, t in named]), by_value=True)
            loads += [self._load(e, [data] * e.tp, sums, version) for e in self.remote]
        try:
            gather_sync(loads)
        finally:
            if sender and self.group is not None:
                dist.barrier(group=self.group)
        seconds = time.perf_counter() - start
        engines = len(loads)
        delivered = sum(t.numel() * t.element_size() for _, t in named) * engines
        return {"weight_sync/seconds": seconds, "weight_sync/bytes": float(delivered),
                "weight_sync/buckets": float(engines), "verified_checks": len(named) * engines,
                "unverified_checks": 0, "weight_sync/engines": float(engines),
                "weight_sync/gbps": delivered / max(seconds, 1e-9) / 1e9, "unverifiable": []}

    async def _load(self, engine: EngineAddress, payloads: list[bytes], sums: dict[str, str],
                    version: str | None) -> None:
        """Replace the engine's adapter (unload, load, checked by every engine rank) and set its weight version."""
        client: EngineClient = self.client(engine)
        try:
            await client.unload_lora_adapter(ADAPTER_NAME)
        except EngineError as error:  # the first sync finds none loaded
            if error.status != 400 or "does not exist" not in str(error):
                raise
        await client.load_lora_adapter_from_tensors(ADAPTER_NAME, self.config, payloads, checksums=sums)
        if version is not None:
            await client.update_weight_version(version)
