"""Megatron -> HF streaming export, in size-bounded buckets (collective over the actor's ranks).

Two paths, both collective (every rank of the model calls them and receives every bucket):

- :meth:`WeightExporter.iter_full`: full HF tensors. Pipeline stages take turns in HF order;
  the owning stage gathers each parameter's TP shards, undoes the fusion, and writes the HF
  tensors into one flat bucket buffer, which is broadcast over each pipeline group.
- :meth:`WeightExporter.iter_shards`: the TP-matched path. Each rank yields the HF-layout
  slices that inference TP rank ``tp_rank`` of an engine with the same TP holds (see
  ``megarl.convert.layout``): no all-gather, only the pipeline broadcast.

Every rank computes the same plan from the config, so bucket boundaries and buffer sizes
agree without exchanging metadata. Peak extra memory is about one bucket plus one gathered
tensor; a tensor larger than the bucket travels alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.convert.hf_io import expected_shapes
from megarl.convert.layout import ModelSizes, hf_split_dim, unfuse
from megarl.convert.plan import Unit, build_plan, buckets, local_parameters

NamedTensors = list[tuple[str, torch.Tensor]]


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

    @property
    def total_bytes(self) -> int:
        """Bytes of all HF tensors at the export dtype."""
        return sum(self._full_bytes(u) for u in self.units)

    def _full_bytes(self, unit: Unit) -> int:
        return sum(_numel(s) for s in unit.hf_shapes) * self._element_size

    def _shard_bytes(self, unit: Unit) -> int:
        return sum(_numel(s) for s in unit.shard_shapes(self.sizes, self.groups.tp_rank, self.dims.tp)) * self._element_size

    # ---------------------------------------------------------------------------- full
    def iter_full(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Full HF tensors, in HF order, in buckets of at most ``bucket_bytes``."""
        for bucket in buckets(self.units, self._full_bytes, bucket_bytes):
            shapes = [s for u in bucket for s in u.hf_shapes]
            names = [n for u in bucket for n in u.hf_names]
            owner = bucket[0].pp_rank == self.groups.pp_rank
            tensors = self._fill(shapes, (t for u in bucket for t in self._gather(u)) if owner else None)
            self._broadcast(tensors, bucket[0].pp_rank)
            yield list(zip(names, self._views(tensors, shapes)))

    def _gather(self, unit: Unit) -> list[torch.Tensor]:
        shard = self.params[unit.megatron_name].detach()
        tp = self.dims.tp
        if tp == 1:
            return unfuse(unit.rule, shard, self.sizes, 0, 1)
        gathered = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(gathered, shard.contiguous(), group=self.groups.tp)
        per_rank = [unfuse(unit.rule, s, self.sizes, r, tp) for r, s in enumerate(gathered)]
        dim = hf_split_dim(unit.rule)
        if dim is None:
            return per_rank[0]
        return [torch.cat([parts[k] for parts in per_rank], dim=dim) for k in range(len(unit.hf_names))]

    # --------------------------------------------------------------------------- shards
    def iter_shards(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """This TP rank's HF-layout slices (what the engine's TP rank holds), no TP gather."""
        tp_rank, tp = self.groups.tp_rank, self.dims.tp
        for bucket in buckets(self.units, self._shard_bytes, bucket_bytes):
            shapes = [s for u in bucket for s in u.shard_shapes(self.sizes, tp_rank, tp)]
            names = [n for u in bucket for n in u.hf_names]
            owner = bucket[0].pp_rank == self.groups.pp_rank
            parts = (
                t for u in bucket for t in unfuse(u.rule, self.params[u.megatron_name].detach(), self.sizes, tp_rank, tp)
            )
            tensors = self._fill(shapes, parts if owner else None)
            self._broadcast(tensors, bucket[0].pp_rank)
            yield list(zip(names, self._views(tensors, shapes)))

    # ---------------------------------------------------------------------------- common
    def _fill(self, shapes, parts) -> torch.Tensor:
        """A flat buffer for the bucket, filled from ``parts`` on the owning stage."""
        device = next(iter(self.params.values())).device
        buffer = torch.empty(sum(_numel(s) for s in shapes), dtype=self.dtype, device=device)
        if parts is not None:
            for view, part in zip(self._views(buffer, shapes), parts, strict=True):
                view.copy_(part)
        return buffer

    def _broadcast(self, buffer: torch.Tensor, owner_pp_rank: int) -> None:
        if self.dims.pp > 1:
            src = dist.get_global_rank(self.groups.pp, owner_pp_rank)
            dist.broadcast(buffer, src=src, group=self.groups.pp)

    @staticmethod
    def _views(buffer: torch.Tensor, shapes) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in shapes:
            n = _numel(shape)
            out.append(buffer[offset : offset + n].view(shape))
            offset += n
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
