"""Tensor-parallel layout of each weight rule: which HF slices a rank holds, and (un)fusing them.

Everything here is pure tensor arithmetic on one rank; no communication.

For tensor-parallel rank r of tp, :func:`hf_slices` says which slice of each HF tensor the
rank's Megatron shard is made of. These are exactly the slices that inference rank r of an
SGLang engine with the same TP holds (contiguous head blocks for q/k/v, contiguous rows of
gate and up, contiguous columns for row-parallel layers, SGLang's vocabulary partition).
:func:`fuse` turns those HF slices into the Megatron shard; :func:`unfuse` is its inverse.
A full HF tensor is the concatenation of all ranks' HF slices along :func:`hf_split_dim`.

Legend: nh query heads, ng query groups (key/value heads), hd head dim, V vocabulary,
Vp padded vocabulary, tp tensor-parallel size, r tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.models.weights import Fuse, Split, WeightRule


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """The sizes the transforms need."""

    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    named: dict[str, int] = dataclasses.field(default_factory=dict)
    """Row counts by the names the rules' :class:`~megarl.models.weights.Rows` use (the family's
    :meth:`~megarl.models.family.ModelFamily.named_sizes`)."""

    @classmethod
    def from_config(cls, family, hf_config, tp: int) -> "ModelSizes":
        """Sizes of ``hf_config`` with the vocabulary padded for ``tp`` ranks."""
        heads = int(hf_config.num_attention_heads)
        return cls(
            num_heads=heads,
            num_groups=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
            vocab_size=int(hf_config.vocab_size),
            padded_vocab_size=family.padded_vocab_size(hf_config, tp),
            named=family.named_sizes(hf_config),
        )

    def rank_ranges(self, rows, tp_rank: int, tp: int) -> tuple[tuple[int, int], ...]:
        """The row ranges of a :class:`~megarl.models.weights.Rows` tensor that ``tp_rank`` holds, in the order its
        shard holds them (piece after piece; within a piece, group after group)."""
        sizes = [self.named[p] for p in rows.pieces]
        groups = self.named[rows.groups] if rows.groups else 1
        group_rows, mine = sum(sizes), groups // tp
        out = []
        for index, size in enumerate(sizes):
            offset = sum(sizes[:index])
            if rows.groups:
                out += [(g * group_rows + offset, g * group_rows + offset + size)
                        for g in range(tp_rank * mine, (tp_rank + 1) * mine)]
            else:
                share = size // tp
                out.append((offset + tp_rank * share, offset + (tp_rank + 1) * share))
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class Slice:
    """``tensor.narrow(dim, start, stop - start)``; ``dim=None`` means the whole tensor."""

    dim: int | None
    start: int = 0
    stop: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    """Several ranges of ``dim`` end to end (a tensor of :class:`~megarl.models.weights.Rows`); ``start`` and
    ``stop`` are then the first range's start and the last one's stop."""

    @classmethod
    def of_ranges(cls, dim: int, ranges: tuple[tuple[int, int], ...]) -> "Slice":
        if len(ranges) == 1:
            return cls(dim, *ranges[0])
        return cls(dim, ranges[0][0], ranges[-1][1], ranges=tuple(ranges))

    @property
    def length(self) -> int:
        """How many elements of ``dim`` it takes."""
        return sum(b - a for a, b in self.ranges) if self.ranges else self.stop - self.start

    def apply(self, tensor: torch.Tensor):
        """This slice of ``tensor``: a view, or for several ranges a :class:`Scattered` (views written together)."""
        if self.dim is None:
            return tensor
        if self.ranges:
            return Scattered(self.dim, [tensor.narrow(self.dim, a, b - a) for a, b in self.ranges])
        return tensor.narrow(self.dim, self.start, self.stop - self.start)

    def read(self, read_range) -> torch.Tensor:
        """The slice read by ``read_range(Slice)`` for each of its ranges, end to end."""
        if not self.ranges:
            return read_range(self)
        return torch.cat([read_range(Slice(self.dim, a, b)) for a, b in self.ranges], dim=self.dim)


@dataclasses.dataclass
class Scattered:
    """Views of several ranges of one tensor along ``dim``, written as one tensor of their lengths end to end."""

    dim: int
    views: list[torch.Tensor]

    def copy_(self, source: torch.Tensor) -> "Scattered":
        for view, part in zip(self.views, source.split([v.shape[self.dim] for v in self.views], dim=self.dim),
                              strict=True):
            view.copy_(part)
        return self


def hf_split_dim(rule: WeightRule) -> int | None:
    """The HF dimension along which ranks' slices concatenate (None: replicated)."""
    return {Split.REPLICATED: None, Split.COLUMN: 0, Split.VOCAB: 0, Split.ROW: 1}[rule.split]


def hf_slices(rule: WeightRule, hf_shapes: list[tuple[int, ...]], sizes: ModelSizes, tp_rank: int, tp: int) -> list[Slice]:
    """For each HF tensor of ``rule``, the slice held by tensor-parallel rank ``tp_rank``."""
    grouped = any(rows is not None and rows.groups for rows in rule.rows)  # reordered even whole (Qwen3-Next)
    if rule.split is Split.REPLICATED or tp == 1 and rule.split is not Split.VOCAB and not grouped:
        return [Slice(None) for _ in hf_shapes]
    if rule.split is Split.VOCAB:
        per_rank = sizes.padded_vocab_size // tp
        start = min(tp_rank * per_rank, sizes.vocab_size)
        return [Slice(0, start, min(start + per_rank, sizes.vocab_size)) for _ in hf_shapes]
    dim = hf_split_dim(rule)
    if rule.fuse in (Fuse.QKV, Fuse.GATED_QKV):
        q_rows = sizes.num_heads * sizes.head_dim // tp * (2 if rule.fuse is Fuse.GATED_QKV else 1)
        kv_rows = sizes.num_groups * sizes.head_dim // tp
        return [Slice(0, tp_rank * n, (tp_rank + 1) * n) for n in (q_rows, kv_rows, kv_rows)]
    out = []
    for index, shape in enumerate(hf_shapes):
        rows = rule.rows[index] if rule.rows else None
        if rows is not None:
            out.append(Slice.of_ranges(dim, sizes.rank_ranges(rows, tp_rank, tp)))
            continue
        per_rank = shape[dim] // tp
        out.append(Slice(dim, tp_rank * per_rank, (tp_rank + 1) * per_rank))
    return out


def fuse(rule: WeightRule, hf_parts: list[torch.Tensor], sizes: ModelSizes, tp: int) -> torch.Tensor:
    """The Megatron shard made of this rank's HF slices (vocabulary rows zero-padded)."""
    if rule.fuse is Fuse.QKV:
        groups = sizes.num_groups // tp
        q, k, v = (t.reshape(groups, -1, sizes.head_dim, *t.shape[1:]) for t in hf_parts)
        return torch.cat([q, k, v], dim=1).reshape(-1, *hf_parts[0].shape[1:])
    if rule.fuse is Fuse.GATED_QKV:  # q_proj: per head [query ‖ gate] -> per group [queries ‖ gates ‖ k ‖ v]
        groups = sizes.num_groups // tp
        q, k, v = hf_parts
        heads = q.reshape(groups, -1, 2, sizes.head_dim, *q.shape[1:])
        k, v = (t.reshape(groups, 1, sizes.head_dim, *t.shape[1:]) for t in (k, v))
        return torch.cat([heads[:, :, 0], heads[:, :, 1], k, v], dim=1).reshape(-1, *q.shape[1:])
    if rule.fuse is Fuse.GATE_UP or len(hf_parts) > 1:  # pieces end to end (Rows: already in the shard's order)
        return torch.cat(hf_parts, dim=0)
    (part,) = hf_parts
    if rule.split is Split.VOCAB:
        rows = sizes.padded_vocab_size // tp
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    return part


def unfuse(rule: WeightRule, shard: torch.Tensor, sizes: ModelSizes, tp_rank: int, tp: int) -> list[torch.Tensor]:
    """This rank's HF slices from its Megatron shard (views where possible)."""
    if rule.fuse is Fuse.QKV:
        groups = sizes.num_groups // tp
        per_group = sizes.num_heads // sizes.num_groups
        grouped = shard.reshape(groups, per_group + 2, sizes.head_dim, *shard.shape[1:])
        q = grouped[:, :per_group].reshape(-1, *shard.shape[1:])
        k = grouped[:, per_group].reshape(-1, *shard.shape[1:])
        v = grouped[:, per_group + 1].reshape(-1, *shard.shape[1:])
        return [q, k, v]
    if rule.fuse is Fuse.GATED_QKV:
        groups = sizes.num_groups // tp
        per_group = sizes.num_heads // sizes.num_groups
        grouped = shard.reshape(groups, 2 * per_group + 2, sizes.head_dim, *shard.shape[1:])
        q = torch.stack([grouped[:, :per_group], grouped[:, per_group:2 * per_group]], dim=2)
        return [q.reshape(-1, *shard.shape[1:]), grouped[:, 2 * per_group].reshape(-1, *shard.shape[1:]),
                grouped[:, 2 * per_group + 1].reshape(-1, *shard.shape[1:])]
    if rule.fuse is Fuse.GATE_UP:
        return list(shard.chunk(2, dim=0))
    if rule.rows and len(rule.hf) > 1:  # pieces end to end: each HF tensor's share of rows, in order
        counts = [sum(b - a for a, b in sizes.rank_ranges(rows, tp_rank, tp)) for rows in rule.rows]
        return list(shard.split(counts, dim=0))
    if rule.split is Split.VOCAB:
        rows = sizes.padded_vocab_size // tp
        real = max(0, min(rows, sizes.vocab_size - tp_rank * rows))
        return [shard[:real]]
    return [shard]


def unfuse_into(rule: WeightRule, shard: torch.Tensor, sizes: ModelSizes, tp_rank: int, tp: int,
                targets: list[torch.Tensor]) -> None:
    """Write this rank's HF slices (:func:`unfuse`) into ``targets`` (tensors of their shapes, e.g. the slices
    :func:`hf_slices` names in the full HF tensors), straight from the shard: query, key and value rows go
    through views of both sides instead of a reshaped copy each."""
    if rule.fuse is not Fuse.QKV:
        for target, part in zip(targets, unfuse(rule, shard, sizes, tp_rank, tp), strict=True):
            target.copy_(part)
        return
    groups = sizes.num_groups // tp
    per_group = sizes.num_heads // sizes.num_groups
    rest = tuple(shard.shape[1:])
    grouped = shard.view(groups, per_group + 2, sizes.head_dim, *rest)
    q, k, v = targets
    q.view(groups, per_group, sizes.head_dim, *rest).copy_(grouped[:, :per_group])
    k.view(groups, sizes.head_dim, *rest).copy_(grouped[:, per_group])
    v.view(groups, sizes.head_dim, *rest).copy_(grouped[:, per_group + 1])
