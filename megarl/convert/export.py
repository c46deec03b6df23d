"""Megatron -> HF streaming export, in size-bounded buckets (collective over the actor's ranks).

Two paths, both collective (every rank of the model calls them and receives every bucket):

- :meth:`WeightExporter.iter_full`: full HF tensors. Pipeline stages take turns in HF order;
  the owning stage gathers each parameter's TP shards, undoes the fusion, and writes the HF
  tensors into one flat bucket buffer, which is broadcast over each pipeline group.
- :meth:`WeightExporter.iter_shards`: the TP-matched path. Each rank yields the HF-layout
  slices that inference TP rank ``tp_rank`` of an engine with the same TP holds (see
  ``megarl.convert.layout``): no all-gather, only the pipeline broadcast.

Mixture-of-experts models under expert parallelism: a bucket of experts is filled by the ranks holding them
(their expert-tensor-parallel group gathers the shards) and broadcast over the expert-parallel group to the
ranks of the stage that need it; then it crosses stages as any bucket.

Every rank computes the same plan from the config, so bucket boundaries and buffer sizes
agree without exchanging metadata. Gathers land in one reusable scratch buffer and are
written straight into the bucket (no concatenation copies), and buckets reuse one buffer by
default: peak extra memory is the largest bucket plus the largest gathered parameter. A
tensor larger than ``bucket_bytes`` travels alone, in a bucket of its own size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megarl.convert.hf_io import expected_shapes
from megarl.convert.layout import ModelSizes, hf_slices, hf_split_dim, unfuse_into
from megarl.convert.param_map import (
    Unit,
    buckets,
    build_plan,
    local_parameters,
    rank_buckets,
    ring_lengths,
    stripe_numel,
)
from megarl.models.lora import adapted_weights, merged_weight
from megarl.models.weights import Fuse
from megarl.parallel.cpu_support import all_gather_into_tensor as _all_gather
from megarl.parallel.cpu_support import plain_torch

NamedTensors = list[tuple[str, torch.Tensor]]
COALESCE_BYTES = 8 << 20
"""TP-split parameters smaller than this are all-gathered several at a time (their full sizes together under
it): one collective per run of small tensors instead of one each; the gather scratch stays below it or the
largest parameter."""


class WeightExporter:
    """Plans once per model; iterates HF tensors as often as weights change."""

    def __init__(self, model_chunks, family, hf_config, groups, *, dtype: torch.dtype | None = None):
        self.groups = groups
        self.dims = groups.dims
        self.family, self.hf_config = family, hf_config
        chunk = model_chunks[0].module if hasattr(model_chunks[0], "module") else model_chunks[0]
        config = chunk.config
        self.dtype = dtype or config.params_dtype
        self.sizes = ModelSizes.from_config(family, hf_config, self.dims.tp)
        self.units = build_plan(family, hf_config, self.dims, config, expected_shapes(hf_config))
        self.params = local_parameters(model_chunks, family.weight_rules(hf_config))
        self.adapted = adapted_weights(model_chunks)
        """This rank's LoRA-adapted layers by their weight's global name: exported merged (:meth:`_shard`)."""
        self._model = (model_chunks, family, hf_config)
        # The TP rank of each member of this rank's expert-parallel group (who needs an expert bucket).
        self._ep_tp_ranks = list(self.groups.ep_tp_ranks) if self.dims.ep > 1 else [self.groups.tp_rank]
        self._element_size = torch.empty((), dtype=self.dtype).element_size()
        self._gather_buffer: torch.Tensor | None = None
        self._kept_ring: list[torch.Tensor] | None = None

    def adapters(self) -> list[tuple[str, torch.Tensor]]:
        """The LoRA adapters of the whole model in PEFT's layout (:func:`megarl.convert.lora.adapter_tensors`), in
        the export dtype, sorted by name, on every rank: each stage's gathered over its TP group, then the stages'
        over the pipeline group (a collective over both)."""
        import torch.distributed as dist

        from megarl.convert.lora import adapter_tensors

        tensors = {n: t.to(self.dtype) for n, t in adapter_tensors(*self._model).items()}
        if self.dims.pp > 1:
            device = self.params[next(iter(self.params))].device if self.params else torch.device("cpu")
            stages: list = [None] * self.dims.pp
            dist.all_gather_object(stages, {n: t.cpu() for n, t in tensors.items()}, group=self.groups.pp)
            tensors = {n: t.to(device) for stage in stages for n, t in stage.items()}
        return sorted(tensors.items())

    def _shard(self, name: str) -> torch.Tensor:
        """This rank's shard of Megatron parameter ``name`` as exported: a LoRA-adapted weight merged with its
        adapter (``W + alpha / rank · B A``, :func:`megarl.models.lora.merged_weight`)."""
        layer = self.adapted.get(name)
        if layer is None:
            return self.params[name].detach()
        return merged_weight(layer)

    @property
    def total_bytes(self) -> int:
        """Bytes of all HF tensors at the export dtype."""
        return sum(self._full_bytes(u) for u in self.units)

    def _full_bytes(self, unit: Unit) -> int:
        return sum(_numel(s) for s in unit.hf_shapes) * self._unit_element_size(unit)

    def _shard_bytes(self, unit: Unit) -> int:
        shapes = unit.shard_shapes(self.sizes, self.groups.tp_rank, self.dims.tp)
        return sum(_numel(s) for s in shapes) * self._unit_element_size(unit)

    def _fp32(self, unit: Unit) -> bool:
        """A unit exported in fp32 within buckets of a narrower export dtype (its rule's ``keep_fp32``)."""
        return unit.rule.keep_fp32 and self._element_size < 4

    def _unit_element_size(self, unit: Unit) -> int:
        return 4 if self._fp32(unit) else self._element_size

    def _unit_views(self, buffer: torch.Tensor, bucket: list[Unit], shapes_of=lambda unit: unit.hf_shapes
                    ) -> tuple[list[torch.Tensor], NamedTensors]:
        """Views of a bucket's flat ``buffer`` for its units' HF tensors, in unit order, and the (name, view) pairs
        in memory order. Units kept in fp32 (:meth:`_fp32`) lie first, as fp32 views of the export dtype's
        elements: every offset stays a multiple of its dtype's size, the layout SGLang's ``FlattenedTensorBucket``
        computes for a receive bucket of these names, dtypes and shapes in this order."""
        first = [k for k, unit in enumerate(bucket) if self._fp32(unit)]
        order = first + [k for k, unit in enumerate(bucket) if not self._fp32(unit)]
        per_unit: list[list[torch.Tensor]] = [[] for _ in bucket]
        offset = 0
        for k in order:
            for shape in shapes_of(bucket[k]):
                numel = _numel(shape)
                if self._fp32(bucket[k]):
                    slots = numel * 4 // self._element_size
                    per_unit[k].append(buffer[offset:offset + slots].view(torch.float32).view(shape))
                else:
                    slots = numel
                    per_unit[k].append(buffer[offset:offset + slots].view(shape))
                offset += slots
        if offset != buffer.numel():
            raise ValueError(f"a flat buffer of {buffer.numel()} elements does not hold a bucket of {offset}")
        memory = [pair for k in order for pair in zip(bucket[k].hf_names, per_unit[k], strict=True)]
        return [view for views in per_unit for view in views], memory

    def _split(self, unit: Unit) -> tuple[object, int, int]:
        """The group a unit's shards are gathered over, its size and this rank's place in it: expert-tensor
        parallelism for experts, tensor parallelism for everything else."""
        if unit.expert is not None:
            return self.groups.expt_tp, self.dims.expert_tp, self.groups.etp_rank
        return self.groups.tp, self.dims.tp, self.groups.tp_rank

    # ---------------------------------------------------------------------------- full
    def iter_full(self, bucket_bytes: int, *, reuse_buffer: bool = True) -> Iterator[NamedTensors]:
        """Full HF tensors, in HF order, in buckets of at most ``bucket_bytes``, on every rank.

        With ``reuse_buffer`` (the default) every bucket is a view into one buffer: its
        tensors are valid until the next bucket is requested, so copy what you keep.
        """
        for bucket in self.iter_buckets(bucket_bytes, num_buffers=1 if reuse_buffer else 0):
            yield bucket.named()

    def iter_buckets(self, bucket_bytes: int, *, num_buffers: int = 1, to_pp_ranks: Iterable[int] | None = None,
                     tp_ranks: Iterable[int] | None = None, shared_memory: bool = False) -> Iterator[Bucket]:
        """Full HF tensors in buckets of at most ``bucket_bytes`` (one flat buffer each, at the export dtype).

        ``to_pp_ranks``: the pipeline stages (of this rank's pipeline group) that need every bucket besides its
        owner; ``None``: all of them. A rank yields the buckets its stage owns or receives; a bucket crosses
        stages in ``tp`` stripes (:meth:`_deliver`: one broadcast when every stage receives, point to point
        otherwise, then an all-gather over the receiving stage's TP group); with no receiving stage it stays on
        its owner. All ranks of the model must call this with the same arguments.

        ``tp_ranks``: the TP ranks that need the buckets (``None``: all); the others take part in the TP
        all-gathers only (no bucket buffer, no copies) and yield nothing. Only without receiving stages
        (``to_pp_ranks=()``, or ``pp == 1``): a bucket crosses stages in stripes from every TP rank.

        ``num_buffers``: buckets take turns in that many buffers (bucket ``i`` in buffer ``i mod n``): a
        bucket stays valid while the next ``n - 1`` are produced (2: double buffering, a consumer may hold
        one bucket while the next is filled); 0 allocates every bucket afresh. ``shared_memory``: CPU buffers
        in shared memory (their handles pass to another process without a copy; CUDA buffers need nothing).
        Shared-memory buffers are kept for the next export (until :meth:`release_buffers`), as CUDA's caching
        allocator keeps freed blocks: creating shared memory costs ~0.5 ms per MiB here (reserved, zeroed, and
        given back when freed), and an engine reopens a handle it still holds for nothing.
        """
        if num_buffers < 0:
            raise ValueError(f"num_buffers must be >= 0, got {num_buffers}")
        my_stage, tp = self.groups.pp_rank, self.dims.tp
        receivers = None if to_pp_ranks is None else frozenset(to_pp_ranks)
        if tp_ranks is not None and self.dims.pp > 1 and receivers != frozenset():
            raise ValueError("iter_buckets: tp_ranks needs to_pp_ranks=() with pipeline stages (a bucket crosses "
                             "stages in stripes from every TP rank)")
        groups = buckets(self.units, self._full_bytes, bucket_bytes)
        sizes = [sum(self._full_bytes(u) for u in bucket) // self._element_size for bucket in groups]
        # What this rank holds; an expert bucket crosses the expert-parallel group when a member of this rank's
        # group needs it. Buffers hold a multiple of tp elements: a bucket crosses stages in tp stripes (_deliver).
        mine = rank_buckets(sizes, [b[0].pp_rank for b in groups], [b[0].ep_owner is not None for b in groups],
                            stage=my_stage, tp=tp, tp_rank=self.groups.tp_rank, num_buffers=num_buffers,
                            to_pp_ranks=receivers, tp_ranks=tp_ranks, ep_tp_ranks=self._ep_tp_ranks)
        buffers = self._ring([stripe_numel(sizes[i], tp) for i in mine.held], num_buffers, shared_memory)
        try:
            yield from self._fill(groups, sizes, set(mine.held), set(mine.passed), buffers, receivers)
        finally:
            self._gather_buffer = None  # the gather scratch lives only as long as an export

    def _fill(self, groups, sizes, held_set, passed_set, buffers, receivers) -> Iterator[Bucket]:
        pp, my_stage = self.dims.pp, self.groups.pp_rank
        for i, bucket in enumerate(groups):
            owner, ep_owner = bucket[0].pp_rank, bucket[0].ep_owner
            experts_here = ep_owner is None or ep_owner == self.groups.ep_rank  # this rank holds the bucket's units
            if i not in held_set:
                if owner == my_stage:
                    with plain_torch():
                        if i in passed_set:  # an expert bucket another member of the EP group needs
                            self._ep_deliver(self._ep_scratch(sizes[i]), bucket, sizes[i])
                        elif experts_here:  # a TP rank that needs no bucket: the all-gathers only
                            self._gather_bucket(bucket, None)
                continue
            padded = next(buffers)
            buffer = padded[: sizes[i]]
            with plain_torch():  # (not across the yield: the consumer runs with the thread's usual torch)
                views, memory = self._unit_views(buffer, bucket)
                if owner == my_stage and ep_owner is not None:
                    self._ep_deliver(buffer, bucket, sizes[i], views)
                elif owner == my_stage:
                    self._gather_bucket(bucket, views)
                if pp > 1:
                    others = [s for s in range(pp) if s != owner and (receivers is None or s in receivers)]
                    self._deliver(padded, owner, others)
            yield Bucket([n for n, _ in memory], [v for _, v in memory], buffer, owner)

    def _ep_deliver(self, buffer: torch.Tensor, bucket: list[Unit], numel: int,
                    views: list[torch.Tensor] | None = None) -> None:
        """An expert bucket on its stage: the expert-parallel rank holding its experts fills ``buffer`` (its
        expert-tensor-parallel group gathers the shards) and broadcasts it over the expert-parallel group."""
        if bucket[0].ep_owner == self.groups.ep_rank:
            if views is None:
                views, _ = self._unit_views(buffer, bucket)
            self._gather_bucket(bucket, views)
        src = dist.get_global_rank(self.groups.ep, bucket[0].ep_owner)
        dist.broadcast(buffer[:numel], src=src, group=self.groups.ep)

    def _ep_scratch(self, numel: int) -> torch.Tensor:
        """A buffer for an expert bucket this rank passes on or receives without yielding it."""
        device = next(iter(self.params.values())).device
        return torch.empty(numel, dtype=self.dtype, device=device)

    def gather_ops(self, bucket: list[Unit]) -> list[tuple[str, list[Unit]]]:
        """How the owner stage fills ``bucket``, in order: ``("copy", [unit])`` (a whole tensor is here),
        ``("in_place", [unit])`` (vocabulary rows all-gathered straight into the bucket) or ``("gather", units)``
        (one all-gather of the units' shards through the scratch buffer: consecutive small ones, together under
        :data:`COALESCE_BYTES`, share one). Every TP rank of the stage gets the same ops (they depend on shapes
        only), so the collectives match."""
        ops: list[tuple[str, list[Unit]]] = []
        pending: list[Unit] = []
        pending_bytes = 0
        for unit in bucket:
            shard = self.params[unit.megatron_name]
            size = self._split(unit)[1]
            nbytes = shard.numel() * shard.element_size() * size
            if size == 1 or hf_split_dim(unit.rule) is None:
                ops.append(("copy", [unit]))
            elif self._in_place(unit, shard):
                ops.append(("in_place", [unit]))
            elif nbytes >= COALESCE_BYTES:
                ops.append(("gather", [unit]))
            else:  # small: joins the pending run (the other ops of the bucket do not interrupt it)
                if pending and (pending_bytes + nbytes > COALESCE_BYTES
                                or self.params[pending[0].megatron_name].dtype != shard.dtype):
                    ops.append(("gather", pending))
                    pending, pending_bytes = [], 0
                pending.append(unit)
                pending_bytes += nbytes
        if pending:
            ops.append(("gather", pending))
        return ops

    def _gather_bucket(self, bucket: list[Unit], views: list[torch.Tensor] | None) -> None:
        """Write the HF tensors of ``bucket``'s units into ``views`` by :meth:`gather_ops` (``None``: this rank
        takes part in the all-gathers only)."""
        where, start = {}, 0
        for unit in bucket:
            where[id(unit)] = None if views is None else views[start : start + len(unit.hf_names)]
            start += len(unit.hf_names)
        for kind, units in self.gather_ops(bucket):
            out = where[id(units[0])]
            group, tp, rank = self._split(units[0])
            if kind == "copy":
                if out is not None:
                    unit, targets = units[0], out
                    if unit.rule.rows:  # a whole tensor, but one whose rows the shard holds in another order
                        targets = [where.apply(full) for where, full in
                                   zip(hf_slices(unit.rule, unit.hf_shapes, self.sizes, rank, tp), out, strict=True)]
                    unfuse_into(unit.rule, self._shard(unit.megatron_name), self.sizes, rank, tp, targets)
            elif kind == "in_place":
                shard = self._shard(units[0].megatron_name)
                target = out[0] if out is not None else self._scratch(tp * shard.numel(), shard).view(tp, -1)
                _all_gather(target, shard.contiguous(), group=group)
            else:
                self._gather_many([(unit, where[id(unit)]) for unit in units])

    def _in_place(self, unit: Unit, shard: torch.Tensor) -> bool:
        """Row blocks in rank order that are the HF tensor itself (an unpadded vocabulary, exported in the
        parameters' dtype): all-gathered straight into the bucket."""
        return (hf_split_dim(unit.rule) == 0 and unit.rule.fuse is Fuse.NONE and len(unit.hf_shapes) == 1
                and not unit.rule.rows
                and unit.hf_shapes[0][0] == self._split(unit)[1] * shard.shape[0] and self.dtype == shard.dtype)

    def _gather_many(self, units: list[tuple[Unit, list[torch.Tensor]]]) -> None:
        """One all-gather of several units' shards (each rank's shards end to end in its block of the scratch),
        then each rank's shard of each unit unfused into the HF tensors."""
        group, tp, my_rank = self._split(units[0][0])  # (a run never mixes experts and other tensors)
        shards = [self._shard(unit.megatron_name) for unit, _ in units]
        width = sum(shard.numel() for shard in shards)
        blocks = self._scratch(tp * width, shards[0]).view(tp, width)
        offset = 0
        for shard in shards:
            blocks[my_rank, offset : offset + shard.numel()].copy_(shard.reshape(-1))
            offset += shard.numel()
        _all_gather(blocks, blocks[my_rank], group=group)
        offset = 0
        for (unit, out), shard in zip(units, shards):
            if out is None:  # (a rank that needs no bucket)
                break
            for r in range(tp):
                gathered = blocks[r, offset : offset + shard.numel()].view(shard.shape)
                targets = [piece.apply(full) for piece, full in
                           zip(hf_slices(unit.rule, unit.hf_shapes, self.sizes, r, tp), out, strict=True)]
                unfuse_into(unit.rule, gathered, self.sizes, r, tp, targets)
            offset += shard.numel()

    def _scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable flat buffer for gathers (grows to the largest gathered parameter)."""
        buffer = self._gather_buffer
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype:
            self._gather_buffer = None  # free the old one before allocating the larger one
            self._gather_buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._gather_buffer[:numel]

    # --------------------------------------------------------------------------- shards
    def iter_shards(self, bucket_bytes: int, *, reuse_buffer: bool = True) -> Iterator[NamedTensors]:
        """This TP rank's HF-layout slices (what the engine's TP rank holds), no TP gather.

        Buffer reuse as in :meth:`iter_full`.
        """
        tp_rank, tp = self.groups.tp_rank, self.dims.tp
        if any(u.expert is not None for u in self.units):
            raise ValueError("iter_shards: TP-matched shards of a mixture-of-experts model are not exported (experts "
                             "travel whole, by iter_buckets); use rollout.weight_transport with full buckets")
        if any(u.rule.rows for u in self.units):
            raise ValueError("iter_shards: a rank's slice of a tensor whose rows are pieces (Gated DeltaNet's) is not "
                             "one HF slice an engine rank could load by name; use rollout.weight_transport with full "
                             "buckets")
        groups = buckets(self.units, self._shard_bytes, bucket_bytes)
        for bucket, buffer in zip(groups, self._buffers(groups, self._shard_bytes, reuse_buffer)):
            views, memory = self._unit_views(buffer, bucket, lambda u: u.shard_shapes(self.sizes, tp_rank, tp))
            if bucket[0].pp_rank == self.groups.pp_rank:
                start = 0
                for u in bucket:
                    unfuse_into(u.rule, self._shard(u.megatron_name), self.sizes, tp_rank, tp,
                                views[start : start + len(u.hf_names)])
                    start += len(u.hf_names)
            self._broadcast(buffer, bucket[0].pp_rank)
            yield memory

    # ---------------------------------------------------------------------------- common
    def _buffers(self, groups: list[list[Unit]], unit_bytes, reuse: bool) -> Iterator[torch.Tensor]:
        """One flat buffer per bucket: a view of one reused allocation, or a fresh one."""
        sizes = [sum(unit_bytes(u) for u in bucket) // self._element_size for bucket in groups]
        return self._ring(sizes, 1 if reuse else 0, False)

    def _ring(self, sizes: list[int], count: int, shared_memory: bool) -> Iterator[torch.Tensor]:
        """Flat buffers of ``sizes`` elements, in turn views of ``count`` allocations (each as large as the
        largest bucket it holds); ``count=0``: a fresh allocation each."""
        device = next(iter(self.params.values())).device

        def allocate(numel: int) -> torch.Tensor:
            return empty_buffer(numel, self.dtype, device, shared_memory=shared_memory)

        if count == 0:
            for numel in sizes:
                yield allocate(numel)
            return
        lengths = ring_lengths(sizes, count)
        if not (shared_memory and device.type == "cpu"):
            ring = [allocate(n) for n in lengths]
        else:  # kept for the next export (see iter_buckets)
            ring = self._kept_ring
            if ring is None or len(ring) != count or any(b.numel() < n for b, n in zip(ring, lengths)):
                self._kept_ring = ring = None  # free the old ring before allocating the new one
                ring = self._kept_ring = [allocate(n) for n in lengths]
        for i, numel in enumerate(sizes):
            yield ring[i % count][:numel]

    def release_buffers(self) -> None:
        """Free the shared-memory bucket buffers kept for the next export (see :meth:`iter_buckets`)."""
        self._kept_ring = None

    def _broadcast(self, buffer: torch.Tensor, owner_pp_rank: int) -> None:
        if self.dims.pp > 1:
            src = dist.get_global_rank(self.groups.pp, owner_pp_rank)
            dist.broadcast(buffer, src=src, group=self.groups.pp)

    def _deliver(self, padded: torch.Tensor, owner_pp_rank: int, stages: list[int]) -> None:
        """The owner stage's full bucket (``padded``: its buffer, a multiple of tp elements) to the ``stages`` of
        the pipeline group that need it, in stripes: TP rank ``t`` of the owner sends only the ``t``-th of ``tp``
        equal stripes to TP rank ``t`` of each receiving stage (by one broadcast when every other stage
        receives, else point to point), and each receiving stage all-gathers the stripes over its TP group. A
        pipeline link between nodes carries ``1/tp`` of the bucket per GPU; the rest moves inside the node."""
        if not stages:
            return
        tp, my_stage, pp_group = self.dims.tp, self.groups.pp_rank, self.groups.pp
        width = padded.numel() // tp
        stripe = padded[self.groups.tp_rank * width : (self.groups.tp_rank + 1) * width]
        src = dist.get_global_rank(pp_group, owner_pp_rank)
        if len(stages) == self.dims.pp - 1:
            dist.broadcast(stripe, src=src, group=pp_group)
        elif my_stage == owner_pp_rank:
            for stage in stages:
                dist.send(stripe, dst=dist.get_global_rank(pp_group, stage), group=pp_group)
        elif my_stage in stages:
            dist.recv(stripe, src=src, group=pp_group)
        if tp > 1 and my_stage in stages:
            _all_gather(padded, stripe, group=self.groups.tp)  # in place: stripe t is already at its offset


@dataclasses.dataclass
class Bucket:
    """One bucket of full HF tensors: ``tensors[k]`` (named ``names[k]``) are consecutive views of ``flat``,
    produced by pipeline stage ``owner_pp_rank``."""

    names: list[str]
    tensors: list[torch.Tensor]
    flat: torch.Tensor
    owner_pp_rank: int

    def named(self) -> NamedTensors:
        return list(zip(self.names, self.tensors))

    @classmethod
    def pack(cls, named: NamedTensors, *, shared_memory: bool = False) -> Bucket:
        """A bucket holding copies of ``named`` (tensors of one dtype, on one device), e.g. to send tensors that
        do not come from an exporter; ``shared_memory``: a CPU buffer in shared memory."""
        if not named:
            raise ValueError("a bucket needs at least one (name, tensor) pair")
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) > 1:
            raise ValueError(f"a bucket holds one dtype (the engines'); got {sorted(map(str, dtypes))}: cast first")
        flat = empty_buffer(sum(t.numel() for _, t in named), named[0][1].dtype, named[0][1].device,
                            shared_memory=shared_memory)
        views = split_flat(flat, [t.shape for _, t in named])
        for view, (_, tensor) in zip(views, named):
            view.copy_(tensor)
        return cls([n for n, _ in named], views, flat, 0)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def empty_buffer(numel: int, dtype: torch.dtype, device, *, shared_memory: bool = False) -> torch.Tensor:
    """A flat uninitialised buffer; with ``shared_memory`` a CPU one is created in shared memory that any process
    of the machine can open by file name (torch's ``file_system`` sharing strategy, set here: the default
    strategy's file descriptors reach only the sender's own children). Created there directly: moving a buffer
    in (``share_memory_``) copies it, ~20x slower. CUDA buffers need nothing (their IPC handles just work)."""
    device = torch.device(device)
    if not shared_memory or device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    from torch import multiprocessing

    multiprocessing.set_sharing_strategy("file_system")
    element = torch.empty((), dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(numel * element)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))


def split_flat(buffer: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of a flat ``buffer`` with ``shapes``, in order (the inverse of concatenating flattened tensors)."""
    out, offset = [], 0
    for shape in shapes:
        n = _numel(shape)
        out.append(buffer[offset : offset + n].view(shape))
        offset += n
    if offset != buffer.numel():
        raise ValueError(f"a flat buffer of {buffer.numel()} elements does not hold shapes totalling {offset}")
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def iter_hf_weights(model_chunks, family, hf_config, groups, bucket_bytes: int, *, dtype=None) -> Iterator[NamedTensors]:
    """Full HF-named, HF-layout tensors in buckets (collective: every rank of the model calls it)."""
    return WeightExporter(model_chunks, family, hf_config, groups, dtype=dtype).iter_full(bucket_bytes)


def iter_hf_shards(model_chunks, family, hf_config, groups, bucket_bytes: int, *, dtype=None) -> Iterator[NamedTensors]:
    """The TP-matched path: this TP rank's HF-layout slices in buckets (collective)."""
    return WeightExporter(model_chunks, family, hf_config, groups, dtype=dtype).iter_shards(bucket_bytes)
