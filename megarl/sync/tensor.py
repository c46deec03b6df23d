"""The ``tensor`` transport: colocated engines load the actor's own bucket buffers through handles.

Every actor rank that sits on one of an engine's GPUs (the engine's *host ranks*, in engine TP order) holds
every full HF bucket: its pipeline stage builds the stage's buckets (TP shards all-gathered within the node),
and the buckets of the other stages come to it from their owners in ``tp`` stripes (each TP rank of the owner
sends one stripe to its pipeline peer: by one broadcast when every stage hosts engine ranks, point to point
otherwise; the receiving stage all-gathers the stripes within its node), and not at all to stages that host
no engine rank. Each host rank serialises a handle to its own bucket buffer (:func:`flattened_payload`:
CUDA IPC on GPU, shared memory on CPU), the handles are all-gathered over the engine's host ranks, and the
first host rank (the *driver*) posts one ``/update_weights_from_tensor`` whose payload ``r`` is host rank
``r``'s handle: engine TP rank ``r`` opens the handle of the actor rank on its own GPU. No tensor bytes go
through Ray or HTTP.

Double buffering: buckets take turns in two buffers per rank, each half of ``rollout.bucket_mb`` (the
setting bounds what a rank holds for the sync). The driver waits for the engine's answer on
bucket ``i - 1`` before it joins the handle all-gather of bucket ``i``; every host rank leaves that
all-gather only after the driver joined it, and only then fills bucket ``i + 1`` into the buffer of bucket
``i - 1``. So a buffer is refilled only after the engine finished loading from it, while the engine loads
bucket ``i`` as bucket ``i + 1`` is built.

SGLang's loader (``update_weights_from_tensor`` → ``model.load_weights``) takes full HF tensors on every TP
rank and slices them itself, so TP-matched shards cannot be sent this way: the all-gather stays.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist

from megarl.engines.client import EngineAddress, run_sync, submit
from megarl.sync.base import (
    WeightTransport,
    all_gather_handles,
    close_sessions,
    expected_copy,
    flattened_payload,
    host_group,
    verify_and_report,
)

NUM_BUFFERS = 2
"""Bucket buffers per rank (double buffering: the engine loads one while the next is built)."""


class TensorTransport(WeightTransport):
    """See the module docstring. Built collectively by every actor rank (it creates one process group per engine
    with more than one host rank, all ranks in the same order)."""

    name = "tensor"
    num_buffers = NUM_BUFFERS
    shared_memory = True

    def __init__(self, groups, engines: Sequence[EngineAddress]) -> None:
        super().__init__(groups, engines)
        lacking = [e.name for e in self.engines if not e.host_ranks]
        if lacking:
            raise ValueError(f"weight sync transport 'tensor' needs engines on the actor's GPUs (colocated: "
                             f"actor_rollout_ref.hybrid_engine=true); {', '.join(lacking)} have none: use "
                             f"actor_rollout_ref.rollout.weight_transport=distributed")
        rank = dist.get_rank()
        self.engine, self.group = host_group(self.engines, rank)
        self.driver = self.engine is not None and self.engine.host_ranks[0] == rank
        hosts = {r for e in self.engines for r in e.host_ranks}
        members = dist.get_process_group_ranks(groups.pp) if groups.dims.pp > 1 else [rank]
        self.receivers = self.receiving_stages(members, hosts)

    @classmethod
    def receiving_stages(cls, pipeline_ranks: Sequence[int], hosts: Collection[int]) -> tuple[int, ...]:
        """The stages hosting an engine rank: each of them hands every bucket to its engine."""
        return tuple(stage for stage, member in enumerate(pipeline_ranks) if member in hosts)

    def _sync(self, exporter, *, bucket_bytes: int, version: str | None,
              verify_names: Sequence[str], flush_cache: bool = True) -> dict[str, float] | None:
        engine, client = self.engine, (self.client(self.engine) if self.driver else None)
        wanted = self.verified(verify_names)
        expected: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        if client is not None:
            run_sync(client.begin_weight_update())
        pending: collections.deque[concurrent.futures.Future] = collections.deque()  # requests, oldest first
        sent = buckets = 0
        try:
            for bucket in self.buckets(exporter, bucket_bytes):
                if engine is None:
                    continue  # this rank only built (or passed on) the bucket
                payload = flattened_payload(bucket)
                while len(pending) > self.num_buffers - 2:
                    pending.popleft().result()  # the engine is done with the buffer the next bucket fills
                handles = [payload] if self.group is None else all_gather_handles(payload, self.group, engine.host_ranks)
                if client is not None:
                    expected.update((n, expected_copy(t)) for n, t in bucket.named() if n in wanted)
                    pending.append(submit(client.update_weights_from_tensor(handles, weight_version=version)))
                    sent += bucket.nbytes
                    buckets += 1
            while pending:
                pending.popleft().result()
        finally:
            if pending:  # an error elsewhere: let the requests end before the buffers go
                concurrent.futures.wait(list(pending), timeout=60)
        if client is None:
            return None
        close_sessions(self, [engine], flush_cache=flush_cache)
        return verify_and_report(self, [engine], start=start, bytes_sent=sent, buckets=buckets, expected=expected,
                                 lead=True)
