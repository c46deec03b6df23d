"""The ``distributed`` transport: engines on their own GPUs receive each bucket by broadcast from its builder.

Each pipeline stage's first rank (TP 0, CP 0) of every actor DP replica is a *sender*: it builds the full HF
buckets of its stage (TP shards all-gathered within the stage, no pipeline traffic: a stage sends its own
buckets; the stage's other TP ranks join the all-gathers and build no bucket) and owns one weight-update group per stage with the engines its replica feeds
(:attr:`EngineAddress.replica`): the sender is rank 0, engine ``k``'s TP ranks follow it
(``/init_weights_update_group``, once, on the first sync; group ``megarl_weights_dp<d>_pp<p>``). Per bucket
the sender posts ``/update_weights_from_distributed`` (names, dtypes, shapes, ``load_format=
"flattened_bucket"``) to each of its engines and broadcasts the bucket's flat buffer once; every engine TP
rank receives it into a buffer of its own and loads it, while the sender already builds the next bucket in
its buffer (it waits for the engines' answers only before the next broadcast). NCCL on GPU, gloo on CPU
(megarl's CPU engine server implements the receiving side). Stage 0's sender opens the engines' session before any stage sends
and closes it after all have sent (the replica's senders form its pipeline group and meet there). The stages send
one after the other (they meet between stages): an engine never has two groups' broadcasts in flight.

SGLang's loader takes full HF tensors on every rank (``update_weights_from_distributed`` →
``model.load_weights``), so TP-matched shards cannot be sent this way: the stage's TP all-gather stays.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megarl.engines.client import EngineAddress, gather_sync, submit
from megarl.engines.http_api import FLATTENED_BUCKET
from megarl.engines.weight_group import join_group, listening_socket
from megarl.parallel.net import node_ip
from megarl.sync.base import WeightTransport, close_sessions, expected_copy, verify_and_report


class DistributedTransport(WeightTransport):
    """See the module docstring. ``backend``: ``gloo`` (CPU) or ``nccl`` (GPU)."""

    name = "distributed"
    holding_tp_ranks = (0,)  # the senders' TP rank: the stage's other ranks only join the all-gathers
    engines_receive = True

    def __init__(self, groups, engines: Sequence[EngineAddress], *, backend: str = "gloo") -> None:
        super().__init__(groups, engines)
        self.backend = backend
        self.sender = groups.tp_rank == 0 and groups.cp_rank == 0
        self.targets = [e for e in self.engines if e.replica == groups.dp_rank] if self.sender else []
        self.lead = self.sender and groups.pp_rank == 0
        self.group_name = f"megarl_weights_dp{groups.dp_rank}_pp{groups.pp_rank}"
        self.group = None

    def _connect(self) -> None:
        """Form this stage's group with its engines: they join (HTTP, in the background) while this rank hosts
        the rendezvous as rank 0."""
        host = node_ip()
        listen_fd, port = listening_socket(host)  # the store listens on this node's address only
        offsets = list(itertools.accumulate([1] + [e.tp for e in self.targets]))
        world_size = offsets[-1]
        joins = [submit(self.client(e).init_weights_update_group(
            master_address=host, master_port=port, rank_offset=offset, world_size=world_size,
            group_name=self.group_name, backend=self.backend)) for e, offset in zip(self.targets, offsets)]
        self.group = join_group(host, port, 0, world_size, self.group_name, backend=self.backend,
                                listen_fd=listen_fd)
        for future in concurrent.futures.as_completed(joins, timeout=660):
            future.result()  # an engine that failed to join names itself

    def _sync(self, exporter, *, bucket_bytes: int, version: str | None,
              verify_names: Sequence[str], flush_cache: bool = True) -> dict[str, float] | None:
        active = self.sender and bool(self.targets)
        if active and self.group is None:
            self._connect()
        expected: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        if active and self.lead:
            gather_sync([self.client(e).begin_weight_update() for e in self.targets])
        self._meet(active)  # every stage sends only once the sessions are open
        sent = buckets = 0
        # Stage by stage: an SGLang scheduler serves one request at a time and enqueues each broadcast on one
        # stream (the first one of a group also blocks in ncclCommInitRank), so two stages broadcasting on their
        # own groups at once could be taken in opposite orders by two engines: a deadlock. A stage starts once
        # every engine has answered for the last bucket of the stage before it.
        for stage in range(self.groups.dims.pp):
            if stage == self.groups.pp_rank:
                sent, buckets = self._send(exporter, bucket_bytes, version, self.verified(verify_names), expected,
                                           active)
            self._meet(active)  # after the last stage: every stage has sent
        if active and self.lead:
            close_sessions(self, self.targets, flush_cache=flush_cache)
        self._meet(active)  # sessions closed: the tensors are readable
        if not active:
            return None
        return verify_and_report(self, self.targets, start=start, bytes_sent=sent, buckets=buckets,
                                 expected=expected, lead=self.lead)

    def _send(self, exporter, bucket_bytes: int, version: str | None, wanted: set[str],
              expected: dict[str, torch.Tensor], active: bool) -> tuple[int, int]:
        """This stage's buckets (every rank of the stage builds them; an active sender broadcasts each to its
        engines): the bytes and buckets sent, once every engine has answered for the last one."""
        sent = buckets = 0
        loading: list[concurrent.futures.Future] = []  # the engines' answers on the previous bucket
        try:
            for bucket in self.buckets(exporter, bucket_bytes):
                if not active:
                    continue
                _answers(loading)  # the engines loaded the previous bucket: they receive the next
                dtypes = [str(t.dtype).removeprefix("torch.") for t in bucket.tensors]  # FP8 buckets hold several
                loading = [submit(self.client(e).update_weights_from_distributed(
                    bucket.names, dtypes, [list(t.shape) for t in bucket.tensors],
                    group_name=self.group_name, load_format=FLATTENED_BUCKET, weight_version=version))
                    for e in self.targets]
                self.group.broadcast(bucket.flat.view(torch.uint8), 0).wait()
                # The engines hold the bytes now: they load them while the next bucket is built in this buffer.
                expected.update((n, expected_copy(t)) for n, t in bucket.named() if n in wanted)
                sent += bucket.nbytes
                buckets += 1
            _answers(loading)
            loading = []
        finally:
            if loading:  # an error here: let the requests end (an engine's error names it) before leaving
                concurrent.futures.wait(loading, timeout=60)
        return sent, buckets

    def _meet(self, active: bool) -> None:
        """A barrier of the replica's senders (its pipeline group of TP-0, CP-0 ranks)."""
        if active and self.groups.dims.pp > 1:
            dist.barrier(group=self.groups.pp)

    def close(self) -> None:
        if self.group is not None:
            gather_sync([self.client(e).destroy_weights_update_group(self.group_name) for e in self.targets])
            self.group = None
        super().close()


def _answers(replies: list[concurrent.futures.Future]) -> None:
    """Wait for every engine's answer (an engine's error, naming it, is raised)."""
    for reply in concurrent.futures.as_completed(replies, timeout=660):
        reply.result()
