"""Sequence-length balancing across data-parallel ranks.

Before dispatch the controller reorders the trajectories so that, when the batch is cut into
``k`` equal contiguous chunks (one per DP rank), every chunk carries a similar number of
tokens. The partition keeps the chunks equal in rows (Megatron needs the same number of
micro-batches on every rank) and balances their token sums with the largest-first greedy
rule under an equal-size constraint (each partition takes rows until it is full).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_partitions(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Split row indices into ``k`` partitions of ``len(lengths) / k`` rows with similar length sums.

    Rows are taken longest first and each goes to the open partition with the smallest sum
    (ties: lowest index). Within a partition the original row order is kept, so GRPO groups
    stay readable in dumps. ``len(lengths)`` must be a multiple of ``k``.
    """
    if k < 1:
        raise ValueError(f"balanced_partitions needs k >= 1, got {k}")
    if len(lengths) % k:
        raise ValueError(f"{len(lengths)} rows do not split into {k} equal partitions (data-parallel ranks)")
    size = len(lengths) // k
    heap = [(0, p) for p in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    for i in order:
        total, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < size:
            heapq.heappush(heap, (total + int(lengths[i]), p))
    return [sorted(part) for part in parts]


def balance_stats(lengths: Sequence[int], parts: Sequence[Sequence[int]], prefix: str = "global_seqlen") -> dict:
    """min/max/mean/diff of per-partition token sums (the ``global_seqlen/*`` metrics)."""
    sums = [sum(int(lengths[i]) for i in part) for part in parts]
    return {f"{prefix}/min": float(min(sums)), f"{prefix}/max": float(max(sums)),
            f"{prefix}/mean": sum(sums) / len(sums), f"{prefix}/diff": float(max(sums) - min(sums))}
