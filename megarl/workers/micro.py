"""Micro-batches of an RL batch: a fixed row count or a token budget, trimmed of shared padding.

Rows are ``[left-padded prompt ‖ right-padded response]`` of width ``P + R``. A micro-batch
only needs the columns where at least one of its rows has a token: its longest prompt ``p``
and its longest response ``r``. Sequence fields (width ``P + R``) keep columns
``P - p .. P + r``; response fields (width ``R``) keep ``:r``. Positions and log-probs do not
change (the pipeline computes positions from the mask), only the wasted columns go.

With a token budget (``use_dynamic_bsz``), consecutive rows are grouped while their cost stays within
``max_tokens`` (a row longer than the budget goes alone), so micro-batches of short responses carry more
rows. The cost is what the model computes: padded, ``rows × (p + r)``; packed (THD), the rows' real tokens,
each row rounded up to the pack's segment alignment. The budget is per GPU: with context parallelism a
micro-batch's sequence is split over ``cp`` GPUs, so it may hold ``cp ×`` the budget. Losses are normalised
by the whole mini-batch's count, so the split never changes a gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from megarl.data.batch import Batch
from megarl.parallel.pipeline import MULTIMODAL_INPUTS
from megarl.seeds import mini_batch_order_seed


def _widths(batch: Batch) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """``P``, ``R`` and each row's prompt and response token counts."""
    R = batch["responses"].shape[1] if "responses" in batch else batch["response_mask"].shape[1]
    mask_NS = batch["attention_mask"]
    P = mask_NS.shape[1] - R
    return P, R, mask_NS[:, :P].sum(-1), mask_NS[:, P:].sum(-1)


def plan(batch: Batch, *, size: int | None = None, max_tokens: int | None = None,
         multiple_of: int = 1, packed_align: int | None = None, cp: int = 1) -> list[tuple[int, int, int, int]]:
    """``(start, end, p, r)`` per micro-batch: rows ``start:end`` trimmed to prompt ``p``, response ``r``.

    Exactly one of ``size`` (rows per micro-batch) and ``max_tokens`` (tokens per GPU and
    micro-batch) is given. ``packed_align``: the model packs micro-batches (each row's tokens
    rounded up to this), else pads them; ``cp``: the context-parallel GPUs a sequence is split
    over (see the module docstring). ``multiple_of``: the number of micro-batches is raised to a
    multiple of it (interleaved pipelines need a multiple of ``pp``) by splitting the
    largest ones, when there are enough rows.
    """
    if (size is None) == (max_tokens is None):
        raise ValueError("micro-batches need exactly one of a row count or a token budget")
    P, R, prompt_N, response_N = _widths(batch)
    rows = len(batch)
    bounds: list[tuple[int, int]] = []
    if size is not None:
        if size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {size}")
        bounds = [(i, min(i + size, rows)) for i in range(0, rows, size)]
    else:
        if max_tokens < 1:
            raise ValueError(f"max_token_len_per_gpu must be >= 1, got {max_tokens}")
        budget = max_tokens * cp
        start, p, r, used = 0, 0, 0, 0
        for i in range(rows):
            np_, nr = max(p, int(prompt_N[i])), max(r, int(response_N[i]), 1)
            own = -(-(int(prompt_N[i]) + max(int(response_N[i]), 1)) // packed_align) * packed_align \
                if packed_align else 0
            cost = used + own if packed_align else (i - start + 1) * (np_ + nr)
            if i > start and cost > budget:
                bounds.append((start, i))
                start, np_, nr, cost = i, int(prompt_N[i]), max(int(response_N[i]), 1), own
            p, r, used = np_, nr, cost
        if rows:
            bounds.append((start, rows))
    while multiple_of > 1 and len(bounds) % multiple_of and any(e - s > 1 for s, e in bounds):
        k = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
        s, e = bounds[k]
        bounds[k:k + 1] = [(s, (s + e) // 2), ((s + e) // 2, e)]
    out = []
    for s, e in bounds:
        p = max(int(prompt_N[s:e].max()), 0)
        r = max(int(response_N[s:e].max()), 1)
        out.append((s, e, min(p, P), min(r, R)))
    return out


def take(batch: Batch, keys: Sequence[str], start: int, end: int, p: int, r: int) -> dict[str, torch.Tensor]:
    """The trimmed tensors of ``keys`` for rows ``start:end`` (see the module docstring)."""
    P, R, _, _ = _widths(batch)
    out = {}
    for key in keys:
        x = batch[key][start:end]
        if not torch.is_tensor(x):  # per-row objects (a vision-language model's images)
            out[key] = list(x)
            continue
        if x.dim() >= 2 and x.shape[1] == P + R:
            x = x[:, P - p:P + r]
        elif x.dim() >= 2 and x.shape[1] == R:
            x = x[:, :r]
        out[key] = x
    return out


def micro_batches(batch: Batch, keys: Sequence[str], *, size: int | None = None, max_tokens: int | None = None,
                  multiple_of: int = 1, packed_align: int | None = None,
                  cp: int = 1) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """The micro-batches (trimmed dicts of ``keys``, and a vision-language batch's per-row vision inputs) and each
    one's response width ``r`` (:func:`plan`)."""
    if MULTIMODAL_INPUTS in batch and MULTIMODAL_INPUTS not in keys:
        keys = [*keys, MULTIMODAL_INPUTS]
    parts = plan(batch, size=size, max_tokens=max_tokens, multiple_of=multiple_of, packed_align=packed_align, cp=cp)
    return [take(batch, keys, *part) for part in parts], [part[3] for part in parts]


def pad_responses(pieces: Sequence[torch.Tensor], R: int) -> torch.Tensor:
    """Concatenate [B_i, r_i] pieces into [sum B_i, R], zero beyond each piece's width."""
    out = []
    for piece in pieces:
        if piece.shape[1] < R:
            piece = torch.nn.functional.pad(piece, (0, R - piece.shape[1]))
        out.append(piece)
    return torch.cat(out)


def mini_batches(batch: Batch, *, role: str, mini_batch_rows: int, dp: int, epochs: int, shuffle: bool,
                 seed: int) -> Iterator[Batch]:
    """This DP rank's mini-batches for ``epochs`` PPO epochs: ``mini_batch_rows / dp`` rows each (one optimizer
    step each), the rows reshuffled every epoch with ``shuffle`` (seeded by ``seed`` and the epoch, so every
    rank of a DP replica draws the same order).

    ``role`` (``actor`` / ``critic``) names the setting a batch that does not split evenly comes from.
    """
    setting = f"{role}.ppo_mini_batch_size × rollout.n = {mini_batch_rows}"
    if mini_batch_rows % dp:
        raise ValueError(f"{setting} trajectories do not split over the {role}'s data-parallel size {dp}")
    local_mini = mini_batch_rows // dp
    if len(batch) % local_mini:
        raise ValueError(f"{len(batch)} rows on this DP rank do not split into mini-batches of {local_mini} "
                         f"({setting} over dp={dp})")
    for epoch in range(epochs):
        shuffled = batch
        if shuffle:
            generator = torch.Generator().manual_seed(mini_batch_order_seed(seed, epoch))
            shuffled = batch.reorder(torch.randperm(len(batch), generator=generator))
        yield from shuffled.split(local_mini)
