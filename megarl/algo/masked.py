"""Statistics over the valid entries of a tensor, given a 0/1 mask of the same shape.

Masked-out entries never reach the result, whatever they hold (even inf or NaN): they are
replaced by zeros with ``torch.where`` before any arithmetic, so their gradient is zero too.

Shape legend: ``B`` rows (trajectories), ``T`` response tokens; functions here accept any
shape and reduce over every element unless ``dim`` is given.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is non-zero."""
    valid = mask.bool()
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return total.sum() if dim is None else total.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is non-zero; 0 where there are none."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries of ``x`` (Bessel-corrected when ``unbiased``); 0 with < 2 entries."""
    count = mask.bool().sum()
    centred = x - masked_mean(x, mask)
    sum_sq = masked_sum(centred * centred, mask)
    denominator = count - 1 if unbiased else count
    return sum_sq / denominator.clamp(min=1).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the mean and unbiased variance of the valid entries.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Invalid entries
    come out as whatever the formula gives; multiply by the mask if they must be zero.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean
