"""Megatron -> HF streaming export, in size-bounded buckets (collective over the actor's ranks).

Two paths, both collective (every rank of the model calls them and receives every bucket):

- :meth:`WeightExporter.iter_full`: full HF tensors. Pipeline stages take turns in HF order;
  the owning stage gathers each parameter's TP shards, undoes the fusion, and writes the HF
  tensors into one flat bucket buffer, which is broadcast over each pipeline group.
- :meth:`WeightExporter.iter_shards`: the TP-matched path. Each rank yields the HF-layout
  slices that inference TP rank ``tp_rank`` of an engine with the same TP holds (see
  ``megarl.convert.layout``): no all-gather, only the pipeline broadcast.

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
from megarl.convert.layout import ModelSizes, hf_split_dim, unfuse
from megarl.convert.param_map import Unit, buckets, build_plan, local_parameters
from megarl.models.weights import Fuse

NamedTensors = list[tuple[str, torch.Tensor]]

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); torch < 2.13 has only it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class WeightExporter:
    """Plans once per model; iterates HF tensors as often as weights change."""

    def __init__(self, model_chunks, family, hf_config, groups, *, dtype: torch.dtype | None = None):
        self.groups = groups
        self.dims = groups.dims
        chunk = model_chunks[0].module if hasattr(model_chunks[0], "module") else model_chunks[0]
        config = chunk.config
        self.dtype = dtype or config.params_dtype
        self.sizes = ModelSizes.from_config(family, hf_config, self.dims.tp)
        self.units = build_plan(family, hf_config, self.dims, config, expected_shapes(hf_config))
        self.params = local_parameters(model_chunks, family.weight_rules(hf_config))
        self._element_size = torch.empty((), dtype=self.dtype).element_size()
        self._gather_buffer: torch.Tensor | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes of all HF tensors at the export dtype."""
        return sum(self._full_bytes(u) for u in self.units)

    def _full_bytes(self, unit: Unit) -> int:
        return sum(_numel(s) for s in unit.hf_shapes) * self._element_size

    def _shard_bytes(self, unit: Unit) -> int:
        return sum(_numel(s) for s in unit.shard_shapes(self.sizes, self.groups.tp_rank, self.dims.tp)) * self._element_size

    # ---------------------------------------------------------------------------- full
    def iter_full(self, bucket_bytes: int, *, reuse_buffer: bool = True) -> Iterator[NamedTensors]:
        """Full HF tensors, in HF order, in buckets of at most ``bucket_bytes``, on every rank.

        With ``reuse_buffer`` (the default) every bucket is a view into one buffer: its
        tensors are valid until the next bucket is requested, so copy what you keep.
        """
        for bucket in self.iter_buckets(bucket_bytes, num_buffers=1 if reuse_buffer else 0):
            yield bucket.named()

    def iter_buckets(self, bucket_bytes: int, *, num_buffers: int = 1, to_pp_ranks: Iterable[int] | None = None,
                     shared_memory: bool = False) -> Iterator[Bucket]:
        """Full HF tensors in buckets of at most ``bucket_bytes`` (one flat buffer each, at the export dtype).

        ``to_pp_ranks``: the pipeline stages (of this rank's pipeline group) that need every bucket besides its
        owner; ``None``: all of them. A rank yields the buckets its stage owns or receives; a bucket crosses
        stages in ``tp`` stripes (:meth:`_deliver`: one broadcast when every stage receives, point to point
        otherwise, then an all-gather over the receiving stage's TP group); with no receiving stage it stays on
        its owner. All ranks of the model must call this with the same arguments.

        ``num_buffers``: buckets take turns in that many buffers (bucket ``i`` in buffer ``i mod n``): a
        bucket stays valid while the next ``n - 1`` are produced (2: double buffering, a consumer may hold
        one bucket while the next is filled); 0 allocates every bucket afresh. ``shared_memory``: CPU buffers
        in shared memory (their handles pass to another process without a copy; CUDA buffers need nothing).
        """
        if num_buffers < 0:
            raise ValueError(f"num_buffers must be >= 0, got {num_buffers}")
        pp, my_stage, tp = self.dims.pp, self.groups.pp_rank, self.dims.tp
        receivers = None if to_pp_ranks is None else frozenset(to_pp_ranks)
        groups = buckets(self.units, self._full_bytes, bucket_bytes)
        sizes = [sum(self._full_bytes(u) for u in bucket) // self._element_size for bucket in groups]
        held = [i for i, bucket in enumerate(groups)
                if receivers is None or bucket[0].pp_rank == my_stage or my_stage in receivers]
        # Buffers hold a multiple of tp elements: a bucket crosses stages in tp stripes (see _deliver).
        buffers = self._ring([-(-sizes[i] // tp) * tp for i in held], num_buffers, shared_memory)
        try:
            yield from self._fill(groups, sizes, set(held), buffers, receivers)
        finally:
            self._gather_buffer = None  # the gather scratch lives only as long as an export

    def _fill(self, groups, sizes, held_set, buffers, receivers) -> Iterator[Bucket]:
        pp, my_stage = self.dims.pp, self.groups.pp_rank
        for i, bucket in enumerate(groups):
            owner = bucket[0].pp_rank
            if i not in held_set:
                continue
            padded = next(buffers)
            buffer = padded[: sizes[i]]
            shapes = [s for u in bucket for s in u.hf_shapes]
            views = split_flat(buffer, shapes)
            if owner == my_stage:
                start = 0
                for unit in bucket:
                    self._gather_into(unit, views[start : start + len(unit.hf_names)])
                    start += len(unit.hf_names)
            if pp > 1:
                others = [s for s in range(pp) if s != owner and (receivers is None or s in receivers)]
                self._deliver(padded, owner, others)
            yield Bucket([n for u in bucket for n in u.hf_names], views, buffer, owner)

    def _gather_into(self, unit: Unit, out: list[torch.Tensor]) -> None:
        """All-gather ``unit``'s TP shards and write the HF tensors into ``out`` (no concatenation)."""
        shard = self.params[unit.megatron_name].detach()
        tp = self.dims.tp
        dim = hf_split_dim(unit.rule)
        if tp == 1 or dim is None:  # nothing to gather: the whole tensor is here
            for view, part in zip(out, unfuse(unit.rule, shard, self.sizes, self.groups.tp_rank, tp), strict=True):
                view.copy_(part)
            return
        if dim == 0 and unit.rule.fuse is Fuse.NONE and out[0].shape[0] == tp * shard.shape[0] and out[0].dtype == shard.dtype:
            # Row blocks in rank order are the HF tensor itself (unpadded vocabulary too): gather in place.
            _all_gather(out[0], shard.contiguous(), group=self.groups.tp)
            return
        flat = self._scratch(tp * shard.numel(), shard)
        # Ranks' shards stacked along dim 0 (the layout all_gather_into_tensor writes).
        _all_gather(flat.view(-1, *shard.shape[1:]), shard.contiguous(), group=self.groups.tp)
        gathered = flat.view(tp, *shard.shape)
        offsets = [0] * len(out)
        for r in range(tp):
            for k, part in enumerate(unfuse(unit.rule, gathered[r], self.sizes, r, tp)):
                out[k].narrow(dim, offsets[k], part.shape[dim]).copy_(part)
                offsets[k] += part.shape[dim]

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
        groups = buckets(self.units, self._shard_bytes, bucket_bytes)
        for bucket, buffer in zip(groups, self._buffers(groups, self._shard_bytes, reuse_buffer)):
            shapes = [s for u in bucket for s in u.shard_shapes(self.sizes, tp_rank, tp)]
            views = split_flat(buffer, shapes)
            if bucket[0].pp_rank == self.groups.pp_rank:
                parts = [
                    t for u in bucket for t in unfuse(u.rule, self.params[u.megatron_name].detach(), self.sizes, tp_rank, tp)
                ]
                for view, part in zip(views, parts, strict=True):
                    view.copy_(part)
            self._broadcast(buffer, bucket[0].pp_rank)
            names = [n for u in bucket for n in u.hf_names]
            yield list(zip(names, views))

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
            buffer = torch.empty(numel, dtype=self.dtype, device=device)
            return _shared(buffer) if shared_memory else buffer

        if count == 0:
            for numel in sizes:
                yield allocate(numel)
            return
        ring = [allocate(max(sizes[k::count], default=0)) for k in range(count)]
        for i, numel in enumerate(sizes):
            yield ring[i % count][:numel]

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
        flat = torch.empty(sum(t.numel() for _, t in named), dtype=named[0][1].dtype, device=named[0][1].device)
        if shared_memory:
            _shared(flat)
        views = split_flat(flat, [t.shape for _, t in named])
        for view, (_, tensor) in zip(views, named):
            view.copy_(tensor)
        return cls([n for n, _ in named], views, flat, 0)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def _shared(buffer: torch.Tensor) -> torch.Tensor:
    """A CPU ``buffer`` moved into shared memory that any process of the machine can open by file name (torch's
    ``file_system`` sharing strategy, set here: the default strategy's file descriptors reach only the sender's own
    children); CUDA buffers are returned as they are (their IPC handles need nothing)."""
    if buffer.device.type != "cpu":
        return buffer
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    return buffer.share_memory_()


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
