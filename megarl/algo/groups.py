"""Grouping rows by ``uid`` (the n samples of one prompt), vectorised.

Rows are mapped to dense group numbers with one ``unique(return_inverse=True)``; per-group
sums, counts and extrema are then ``index_add_`` / ``scatter_reduce`` calls. There is no
Python loop over rows or groups, so the cost does not grow with the number of prompts in
the interpreter.

Shape legend: ``B`` rows, ``G`` groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def group_index(uid: torch.Tensor | np.ndarray | Sequence) -> tuple[torch.Tensor, int]:
    """Dense group number of every row, and the number of groups.

    ``uid`` is a tensor of integer ids or a numpy/list of hashable, mutually comparable ids
    (strings from ``uuid4``, ints). Rows with equal ``uid`` share a group, wherever they sit.
    Returns ``(group_B, num_groups)`` with ``group_B`` a CPU long tensor.
    """
    if isinstance(uid, torch.Tensor):
        if uid.dim() != 1:
            raise ValueError(f"`uid` must be 1-D (one id per row), got shape {tuple(uid.shape)}")
        _, group_B = torch.unique(uid.cpu(), return_inverse=True)
    else:
        uid_B = np.asarray(uid)
        if uid_B.ndim != 1:
            raise ValueError(f"`uid` must be 1-D (one id per row), got shape {uid_B.shape}")
        _, inverse_B = np.unique(uid_B, return_inverse=True)
        group_B = torch.from_numpy(inverse_B.reshape(-1).astype(np.int64))
    num_groups = int(group_B.max()) + 1 if group_B.numel() else 0
    return group_B, num_groups


def group_sum(x_B: torch.Tensor, group_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sum of ``x_B``; shape [G]."""
    return torch.zeros(num_groups, dtype=x_B.dtype, device=x_B.device).index_add_(0, group_B.to(x_B.device), x_B)


def group_count(group_B: torch.Tensor, num_groups: int, device: torch.device | None = None) -> torch.Tensor:
    """Number of rows in each group; shape [G], long."""
    return torch.bincount(group_B, minlength=num_groups).to(device or group_B.device)


def group_mean_std(x_B: torch.Tensor, group_B: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and unbiased (Bessel-corrected) std of ``x_B``; both [G].

    A group of one row gets mean 0 and std 1, so that ``(x - mean) / std`` leaves it as is;
    this is the GRPO convention for prompts sampled once.
    """
    group_B = group_B.to(x_B.device)
    count_G = group_count(group_B, num_groups, x_B.device).to(x_B.dtype)
    mean_G = group_sum(x_B, group_B, num_groups) / count_G.clamp(min=1)
    centred_B = x_B - mean_G[group_B]
    var_G = group_sum(centred_B * centred_B, group_B, num_groups) / (count_G - 1).clamp(min=1)
    single_G = count_G < 2
    mean_G = torch.where(single_G, torch.zeros_like(mean_G), mean_G)
    std_G = torch.where(single_G, torch.ones_like(var_G), var_G.sqrt())
    return mean_G, std_G


def group_max(x_B: torch.Tensor, group_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group maximum of ``x_B``; shape [G] (the dtype's lowest value for a group without rows)."""
    init_G = torch.full((num_groups,), _extreme(x_B.dtype, low=True), dtype=x_B.dtype, device=x_B.device)
    return init_G.scatter_reduce(0, group_B.to(x_B.device), x_B, reduce="amax")


def group_min(x_B: torch.Tensor, group_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group minimum of ``x_B``; shape [G] (the dtype's highest value for a group without rows)."""
    init_G = torch.full((num_groups,), _extreme(x_B.dtype, low=False), dtype=x_B.dtype, device=x_B.device)
    return init_G.scatter_reduce(0, group_B.to(x_B.device), x_B, reduce="amin")


def _extreme(dtype: torch.dtype, low: bool) -> float | int:
    if dtype.is_floating_point:
        return float("-inf") if low else float("inf")
    info = torch.iinfo(dtype)
    return info.min if low else info.max
