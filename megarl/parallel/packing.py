"""Model inputs for one micro-batch, packed (THD) or padded, split over context-parallel ranks, and the way back.

RL micro-batches arrive as ``[B, S]`` rows: left-padded prompt, then right-padded response, each row's tokens
contiguous (:func:`left_align` checks it). Two layouts reach the model:

- **packed** (:func:`prepare_packed`, THD): the rows' real tokens end to end in one sequence ``[1, T]``, each row
  a *segment* padded to ``seg_align`` tokens, with Megatron's ``PackedSeqParams`` (``cu_seqlens`` of the real
  and of the padded segment lengths, ``max_seqlen`` = the longest padded segment: RoPE then numbers positions
  within each segment). ``T`` is padded to ``total_align`` (sequence and context parallelism divide it) and,
  with pipeline stages, to the call's largest pack (one activation shape per call); the padding goes to the
  last segment. No compute is spent on padding rows, and attention runs per segment.
- **padded** (:func:`prepare_padded`, BSHD): rows rotated so each starts at column 0 (positions exact; causal
  attention ignores the right padding), ``S`` padded to ``total_align``.

Context parallelism splits the sequence dimension ``2·cp`` ways in Megatron's *zigzag* order
(:func:`zigzag_index`): CP rank ``r`` keeps chunks ``r`` and ``2·cp−1−r`` of the padded row (padded) or of every
segment (packed; TransformerEngine's THD convention), which balances causal attention's work. Labels (the next
token) are taken before the split. :meth:`Prepared.restore` gathers a per-token output over the CP group
(Megatron's ``gather_from_sequence_parallel_region`` with ``tensor_parallel_output_grad=False``: the backward
keeps each rank's own tokens' gradient, no reduction), undoes the zigzag and the packing, and returns the
caller's ``[B, S]``. Each CP rank so computes the full rows' loss and back-propagates only through its own
tokens; Megatron's DDP sums the ranks' gradients over data × context parallel ranks into the full gradient.

Legend: B rows, S columns, T packed tokens (global), t = T / cp (this rank's).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch


def round_up(n: int, k: int) -> int:
    """The smallest multiple of ``k`` that is at least ``n``."""
    return -(-n // k) * k


def pack_alignment(*, cp: int, tp: int, sequence_parallel: bool) -> tuple[int, int]:
    """``(segment alignment, total alignment)``: every packed segment a multiple of ``2·cp`` (with CP), the whole
    pack (or a padded row) a multiple of that and of ``cp · tp`` (the sequence is split over CP ranks, and
    over TP ranks under sequence parallelism)."""
    seg = 2 * cp if cp > 1 else 1
    split = cp * (tp if sequence_parallel else 1)
    return seg, math.lcm(seg, split)


def _zigzag_ranges(lengths: Sequence[int], cp: int, rank: int, *, within: bool = False) -> list[range]:
    """The ranges of :func:`zigzag_index` (``within``: positions within each sequence instead of the stream).
    Index building stays in Python ranges: one tensor per pack, not a few operations per sequence."""
    ranges, offset = [], 0
    for length in lengths:
        base = 0 if within else offset
        if cp == 1:
            ranges.append(range(base, base + length))
        else:
            if length % (2 * cp):
                raise ValueError(f"a sequence of {length} tokens cannot be split 2*cp={2 * cp} ways: pad it to a "
                                 "multiple")
            chunk = length // (2 * cp)
            ranges.append(range(base + rank * chunk, base + (rank + 1) * chunk))
            ranges.append(range(base + (2 * cp - 1 - rank) * chunk, base + (2 * cp - rank) * chunk))
        offset += length
    return ranges


def _tensor(ranges) -> torch.Tensor:
    return torch.tensor(list(itertools.chain.from_iterable(ranges)), dtype=torch.long)


@functools.lru_cache(maxsize=256)
def _zigzag(lengths: tuple[int, ...], cp: int, rank: int) -> torch.Tensor:
    if cp == 1:
        return torch.arange(sum(lengths))
    return _tensor(_zigzag_ranges(lengths, cp, rank))


def zigzag_index(lengths: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Indices (into a stream of sequences of ``lengths`` tokens, end to end) that CP rank ``rank`` of ``cp``
    keeps: of each sequence, chunks ``rank`` and ``2·cp−1−rank`` of ``2·cp`` equal chunks, sequence by sequence.
    One sequence: Megatron's ``get_batch_on_this_cp_rank``; several: TransformerEngine's THD partitioning."""
    return _zigzag(tuple(int(n) for n in lengths), int(cp), int(rank))


def zigzag_positions(lengths: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """The positions within its sequence of each token :func:`zigzag_index` keeps."""
    return _tensor(_zigzag_ranges([int(n) for n in lengths], int(cp), int(rank), within=True))


@functools.lru_cache(maxsize=256)
def _inverse(lengths: tuple[int, ...], cp: int) -> torch.Tensor:
    order = torch.cat([_zigzag(lengths, cp, r) for r in range(cp)])
    return torch.argsort(order)


def cp_inverse(lengths: Sequence[int], cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The index that puts the CP ranks' tokens, gathered rank after rank, back in stream order (on ``device``:
    copied there once per layout, not per call)."""
    if device is None or torch.device(device).type == "cpu":
        return _inverse(tuple(int(n) for n in lengths), int(cp))
    return _inverse_on(tuple(int(n) for n in lengths), int(cp), torch.device(device))


@functools.lru_cache(maxsize=64)
def _inverse_on(lengths: tuple[int, ...], cp: int, device: torch.device) -> torch.Tensor:
    return _inverse(lengths, cp).to(device)


_HOST_BOUNDS = "_megarl_host_bounds"


def record_host_bounds(cu_seqlens: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """Keep the host's copy of ``cu_seqlens`` (a device tensor of ``PackedSeqParams``) on the tensor, for
    :func:`host_bounds`; returns the tensor."""
    setattr(cu_seqlens, _HOST_BOUNDS, tuple(int(b) for b in bounds))
    return cu_seqlens


def host_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` as host integers: the copy :func:`prepare_packed` recorded, else read from the tensor (on a
    GPU a device-to-host copy, which waits for every kernel queued before it: done once per layer for RoPE and
    attention, it idles the GPU while the host queues each layer's kernels)."""
    bounds = getattr(cu_seqlens, _HOST_BOUNDS, None)
    return bounds if bounds is not None else tuple(int(b) for b in cu_seqlens.tolist())


# What one call of the CPU core attention costs in attention scores of one head (its fixed per-operation cost
# against the per-score one). Chosen with tools/bench_packing.py on 2 CPU cores: packs of 8-32 rows of 15-35
# tokens on the tiny model (hidden 64) ran 0.74-0.89x padded at 0 (a call per row), 0.93-1.11x at 40 000, and
# the 16-512-token rows (hidden 256) did not slow down.
CALL_COST_SCORES = 40_000


@dataclasses.dataclass(frozen=True)
class SegmentBatch:
    """Segments of a pack that run attention as one batch (:func:`segment_batches`), each padded at its end to the
    first (longest) one's length. ``segments``: their indices in the pack. ``query_positions`` ``[n, Lq]``: the
    position within its segment of each of this CP rank's queries (padding rows: the segment length, which
    masks nothing); ``None`` when ``cp == 1`` (plain causal attention)."""

    segments: tuple[int, ...]
    query_positions: torch.Tensor | None
    output_index: torch.Tensor
    """This rank's tokens of the segments, segment after segment, as rows of the ``[n·Lq]`` (column-major)
    output."""


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """:func:`segment_batches`: the ``batches``, and ``restore``, which puts their outputs (this rank's tokens of
    each batch's segments, segment after segment, batch after batch) back in stream order."""

    batches: tuple[SegmentBatch, ...]
    restore: torch.Tensor


@functools.lru_cache(maxsize=64)
def _segment_batches(lengths: tuple[int, ...], heads: int, cp: int, rank: int, device: torch.device) -> SegmentPlan:
    plan = _segment_batches_on_host(lengths, heads, cp, rank)
    if device.type == "cpu":
        return plan
    batches = tuple(dataclasses.replace(
        batch, output_index=batch.output_index.to(device),
        query_positions=None if batch.query_positions is None else batch.query_positions.to(device))
        for batch in plan.batches)
    return SegmentPlan(batches, plan.restore.to(device))


@functools.lru_cache(maxsize=64)
def _segment_batches_on_host(lengths: tuple[int, ...], heads: int, cp: int, rank: int) -> SegmentPlan:
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:  # longest first: a segment joins the open batch while its padding costs less than a call
        if groups and heads * (lengths[groups[-1][0]] ** 2 - lengths[i] ** 2) // cp <= CALL_COST_SCORES:
            groups[-1].append(i)
        else:
            groups.append([i])
    batches = []
    for group in groups:
        width = lengths[group[0]]
        positions = None
        if cp > 1:  # padding rows at the segment's length: they mask no key
            rows = []
            for i in group:
                row = list(itertools.chain.from_iterable(_zigzag_ranges([lengths[i]], cp, rank, within=True)))
                rows.append(row + [width] * (width // cp - len(row)))
            positions = torch.tensor(rows, dtype=torch.long)
        output_index = _tensor(range(column * (width // cp), column * (width // cp) + lengths[i] // cp)
                               for column, i in enumerate(group))
        batches.append(SegmentBatch(tuple(group), positions, output_index))
    starts = [0, *itertools.accumulate(n // cp for n in lengths)]
    order = _tensor(range(starts[i], starts[i + 1]) for group in groups for i in group)
    return SegmentPlan(tuple(batches), torch.argsort(order))


def segment_batches(lengths: Sequence[int], *, heads: int, cp: int = 1, rank: int = 0,
                    device: torch.device | str = "cpu") -> SegmentPlan:
    """The segments of a pack (padded ``lengths``; this CP rank holds ``length/cp`` tokens of each, in zigzag
    order) grouped into batches for attention. Many short segments then cost a few batched calls instead of one
    call each (a call costs about ``CALL_COST_SCORES`` scores of one head on CPU), and a long segment still runs
    alone. Longest first; the padding sits at the end of each segment, where causal attention never reaches it
    from a real query. The plan's tensors are on ``device`` (the attention's; cached per layout and device, so a
    GPU copies each layout's plan once, not once per layer)."""
    return _segment_batches(tuple(int(n) for n in lengths), int(heads), int(cp), int(rank), torch.device(device))


def gather_cp(x_bt: torch.Tensor, lengths: Sequence[int], cp: int, group) -> torch.Tensor:
    """The full ``[b, T]`` from every CP rank's ``[b, t]`` (their :func:`zigzag_index` tokens), in stream order.
    Backward: each rank keeps the gradient of its own tokens (no reduction). Identity when ``cp == 1``."""
    if cp == 1:
        return x_bt
    if x_bt.dim() != 2:
        raise ValueError(f"gather_cp takes [b, t] per-token values, got shape {tuple(x_bt.shape)}")
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    gathered = gather_from_sequence_parallel_region(x_bt.transpose(0, 1).contiguous(),
                                                    tensor_parallel_output_grad=False, group=group)
    inverse = cp_inverse(lengths, cp, x_bt.device)
    return gathered.index_select(0, inverse).transpose(0, 1)


@dataclasses.dataclass
class Prepared:
    """One micro-batch's model inputs on this rank, and how its per-token outputs go back to the caller's layout."""

    input_ids: torch.Tensor
    """``[b, t]``: the model's input (packed: ``[1, T/cp]``; padded: ``[B', S'/cp]``)."""
    position_ids: torch.Tensor
    """``[b, t]``: each token's position in its row (Megatron's RoPE numbers positions itself; kept for clarity); a
    multimodal model's ``[3, b, t]`` (:data:`megarl.parallel.pipeline.MROPE_POSITIONS`)."""
    labels: torch.Tensor
    """``[b, t]``: the next token of each input token in its row (taken before the CP split)."""
    packed_seq_params: Any
    """Megatron's ``PackedSeqParams`` (packed), else None."""
    seq_length: int
    """The global sequence length of this micro-batch (``T`` or ``S'``): the pipeline schedule's ``seq_length``."""
    micro_batch_size: int
    """Rows the model sees (1 when packed)."""
    rows: int
    columns: int
    lengths: tuple[int, ...]
    """The sequences the CP split cuts (packed: the padded segments; padded: one ``S'``)."""
    cp: int
    cp_group: Any
    mask: torch.Tensor | None = None
    """Packed: the caller's attention mask ``[B, S]`` (bool)."""
    token_index: torch.Tensor | None = None
    """Packed: each real token's place in the pack, in the row-major order of ``mask``."""
    align_index: torch.Tensor | None = None
    """Padded: the row rotation (:func:`left_align`) of the padded ``[B', S']``."""
    keep: torch.Tensor | None = None
    """The columns of the (packed or padded) sequence this CP rank holds (:func:`zigzag_index`)."""

    def to_model(self, x_BS: torch.Tensor, fill: torch.Tensor | float | int) -> torch.Tensor:
        """A per-token input ``[B, S, ...]`` in the caller's layout as this rank's model layout ``[b, t, ...]``
        (packed or rotated, padded, CP-split as ``input_ids``); positions holding no caller token get ``fill``
        (a scalar, or a tensor of the trailing shape)."""
        trailing = x_BS.shape[2:]
        if self.token_index is not None:
            out = torch.empty((self.seq_length, *trailing), dtype=x_BS.dtype, device=x_BS.device)
            out[:] = fill
            out[self.token_index] = x_BS[self.mask]
            return out[self.keep][None]
        rows, columns = self.align_index.shape
        out = torch.empty((rows, columns, *trailing), dtype=x_BS.dtype, device=x_BS.device)
        out[:] = fill
        out[: self.rows, : self.columns] = x_BS
        index = self.align_index.view(rows, columns, *([1] * len(trailing))).expand_as(out)
        return torch.gather(out, 1, index)[:, self.keep]

    def restore(self, x_bt: torch.Tensor) -> torch.Tensor:
        """A per-token output ``[b, t, ...]`` of this rank (log-probs, values; logits when ``cp == 1``) as the
        caller's ``[B, S, ...]`` (gathered over CP ranks; zeros where the caller has padding). Differentiable."""
        full = gather_cp(x_bt, self.lengths, self.cp, self.cp_group)
        if self.token_index is not None:
            rows, columns = self.mask.nonzero(as_tuple=True)
            out = full.new_zeros(self.rows, self.columns, *full.shape[2:])
            return out.index_put((rows, columns), full[0].index_select(0, self.token_index))
        index = self.align_index.view(*self.align_index.shape, *([1] * (full.dim() - 2))).expand_as(full)
        return torch.zeros_like(full).scatter(1, index, full)[: self.rows, : self.columns]


def left_align(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Gather indices that move each row's contiguous tokens to the front.

    Raises ``ValueError`` when a row's tokens are not contiguous (padding in the middle).
    """
    mask = attention_mask_BS.bool()
    B, S = mask.shape
    num_tokens_B = mask.sum(dim=1)
    first_B = torch.where(num_tokens_B > 0, mask.int().argmax(dim=1), torch.zeros_like(num_tokens_B))
    positions_S = torch.arange(S, device=mask.device)
    expected = (positions_S >= first_B[:, None]) & (positions_S < (first_B + num_tokens_B)[:, None])
    if not torch.equal(expected, mask):
        bad = (expected != mask).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask rows {bad[:8]} have padding between tokens; each row must be "
            "[left padding, tokens, right padding]"
        )
    return (positions_S[None, :] + first_B[:, None]) % S


def token_mask(micro_batch: dict) -> torch.Tensor:
    """``[B, S]`` bool: the micro-batch's tokens (its ``attention_mask``; all of ``input_ids`` without one)."""
    mask = micro_batch.get("attention_mask")
    return torch.ones_like(micro_batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool()


def packed_length(micro_batch: dict, seg_align: int, total_align: int) -> int:
    """``T`` of :func:`prepare_packed` for this micro-batch (without ``pad_to``)."""
    lengths = [round_up(int(n), seg_align) for n in token_mask(micro_batch).sum(dim=1).tolist() if n > 0]
    return round_up(max(sum(lengths), 1), total_align)


def prepare_packed(micro_batch: dict, *, seg_align: int = 1, total_align: int = 1, pad_to: int | None = None,
                   cp: int = 1, cp_rank: int = 0, cp_group=None) -> Prepared:
    """The micro-batch's rows packed into one THD sequence (see the module docstring); rows without tokens take
    no place. ``pad_to``: the pack's length at least (a multiple of ``total_align``; with pipeline stages, the
    largest pack of the call)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    input_ids = micro_batch["input_ids"]
    mask = token_mask(micro_batch)
    left_align(mask)  # raises on padding between a row's tokens
    real = [int(n) for n in mask.sum(dim=1).tolist()]
    kept = [n for n in real if n > 0]
    if not kept:
        raise ValueError("prepare_packed: the micro-batch has no tokens (every attention_mask row is empty)")
    padded = [round_up(n, seg_align) for n in kept]
    total = round_up(sum(padded), total_align)
    if pad_to is not None:
        if pad_to % total_align:
            raise ValueError(f"prepare_packed: pad_to={pad_to} is not a multiple of the alignment {total_align}")
        total = max(total, pad_to)
    padded[-1] += total - sum(padded)  # the tail pads the last segment (causal: its tokens never see it)
    starts = torch.tensor([0, *padded]).cumsum(0)
    token_index = _tensor(range(int(s), int(s) + n) for s, n in zip(starts[:-1].tolist(), kept))
    ids = input_ids.new_zeros(total)
    ids[token_index] = input_ids[mask]
    labels = torch.roll(ids, shifts=-1)
    segment = torch.repeat_interleave(torch.arange(len(padded)), torch.tensor(padded))
    positions = torch.arange(total) - starts[segment]
    keep = zigzag_index(padded, cp, cp_rank)
    cu_real = torch.tensor([0, *kept]).cumsum(0).to(torch.int32)
    cu_padded = starts.to(torch.int32)
    device = input_ids.device
    # Queries and keys share their bounds (self-attention): one device copy each, its host copy recorded.
    real, padded_bounds = (record_host_bounds(cu.to(device), cu.tolist()) for cu in (cu_real, cu_padded))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded_bounds,
                             cu_seqlens_kv_padded=padded_bounds, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    keep = keep.to(device)
    return Prepared(input_ids=ids[keep][None], position_ids=positions.to(device)[keep][None],
                    labels=labels[keep][None], packed_seq_params=params, seq_length=total, micro_batch_size=1,
                    rows=input_ids.shape[0], columns=input_ids.shape[1], lengths=tuple(padded), cp=cp,
                    cp_group=cp_group, mask=mask, token_index=token_index.to(device), keep=keep)


def prepare_padded(micro_batch: dict, *, shape: tuple[int, int] | None = None, total_align: int = 1, cp: int = 1,
                   cp_rank: int = 0, cp_group=None) -> Prepared:
    """The micro-batch's rows rotated to start at column 0, padded (rows and columns) to ``shape`` and the
    columns to a multiple of ``total_align``, then split over CP ranks (see the module docstring)."""
    input_ids = micro_batch["input_ids"]
    mask = token_mask(micro_batch).to(input_ids.dtype)
    rows, columns = input_ids.shape
    target_rows, target_columns = shape if shape is not None else (rows, columns)
    target_columns = round_up(target_columns, total_align)
    if (target_rows, target_columns) != (rows, columns):
        pad = (0, target_columns - columns, 0, target_rows - rows)
        input_ids = torch.nn.functional.pad(input_ids, pad)
        mask = torch.nn.functional.pad(mask, pad)
    align_index = left_align(mask)
    aligned = torch.gather(input_ids, 1, align_index)
    labels = torch.roll(aligned, shifts=-1, dims=1)
    keep = zigzag_index([target_columns], cp, cp_rank).to(input_ids.device)
    positions = keep.expand(target_rows, -1)
    return Prepared(input_ids=aligned[:, keep], position_ids=positions, labels=labels[:, keep],
                    packed_seq_params=None, seq_length=target_columns, micro_batch_size=target_rows, rows=rows,
                    columns=columns, lengths=(target_columns,), cp=cp, cp_group=cp_group, align_index=align_index,
                    keep=keep)
