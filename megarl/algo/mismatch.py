"""Rollout/training mismatch: how far the engine's log-probs are from the trainer's, and a correction.

The rollout engine samples with its own kernels (and often lower precision), so the
behaviour policy it actually ran, with log-probs ``rollout_log_probs``, differs slightly from
the one the trainer recomputes as ``old_log_probs``. PPO's ratio is
taken against ``old_log_probs``; the samples, however, came from the engine. Two tools:

- :func:`mismatch_metrics`: diagnostics between the two (mean and max of ``|delta log p|`` and
  ``|delta p|``, and the k1/k3 estimates of KL(rollout || training)).
- :func:`tis_weights`: truncated importance sampling (TIS), the weight
  ``min(pi_old / pi_rollout, cap)`` per token (or per sequence) that re-weights the policy
  loss towards the training engine's behaviour policy (``policy_loss(is_weights_BT=...)``).

Shape legend: ``B`` rows (trajectories), ``T`` response tokens.
"""

from __future__ import annotations

import math

import torch

from megarl.algo.kl import kl_penalty
from megarl.algo.masked import masked_mean, masked_sum

TIS_LEVELS = ("token", "sequence")


def _masked_max(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Maximum over valid entries; 0 when there are none."""
    valid_BT = mask_BT.bool()
    if not bool(valid_BT.any()):
        return torch.zeros((), dtype=x_BT.dtype, device=x_BT.device)
    return x_BT[valid_BT].max()


@torch.no_grad()
def mismatch_metrics(rollout_logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                     ) -> dict[str, float]:
    """Differences between the rollout engine's and the trainer's log-probs of the sampled tokens.

    Keys (prefix ``mismatch/``): ``abs_logp_diff_mean``/``_max``, ``abs_prob_diff_mean``/``_max``,
    ``k1_kl`` and ``k3_kl`` (estimates of KL(rollout || training) from the rollout's own samples).
    All over valid tokens only.
    """
    rollout_logp_BT, old_logp_BT = rollout_logp_BT.float(), old_logp_BT.float()
    abs_logp_BT = (rollout_logp_BT - old_logp_BT).abs()
    abs_prob_BT = (rollout_logp_BT.exp() - old_logp_BT.exp()).abs()
    return {
        "mismatch/abs_logp_diff_mean": float(masked_mean(abs_logp_BT, mask_BT)),
        "mismatch/abs_logp_diff_max": float(_masked_max(abs_logp_BT, mask_BT)),
        "mismatch/abs_prob_diff_mean": float(masked_mean(abs_prob_BT, mask_BT)),
        "mismatch/abs_prob_diff_max": float(_masked_max(abs_prob_BT, mask_BT)),
        "mismatch/k1_kl": float(masked_mean(kl_penalty(rollout_logp_BT, old_logp_BT, "k1"), mask_BT)),
        "mismatch/k3_kl": float(masked_mean(kl_penalty(rollout_logp_BT, old_logp_BT, "k3"), mask_BT)),
    }


@torch.no_grad()
def tis_weights(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                cap: float = 2.0, level: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(pi_old / pi_rollout, cap)``, 0 on masked tokens; [B, T].

    ``level="token"`` weighs each token by its own ratio; ``level="sequence"`` uses the product
    of the ratios over the row's valid tokens, broadcast to them. ``cap`` is the truncation
    (``actor.tis_cap``). Returns the weights (no gradient) and the metrics ``tis/weight_mean``
    and ``tis/capped_frac`` over valid tokens.
    """
    if cap <= 0:
        raise ValueError(f"actor.tis_cap must be > 0, got {cap}")
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown actor.tis_level {level!r}; use one of {TIS_LEVELS}")
    log_ratio_BT = old_logp_BT - rollout_logp_BT
    if level == "sequence":
        log_ratio_BT = masked_sum(log_ratio_BT, mask_BT, dim=-1).unsqueeze(-1).expand_as(old_logp_BT)
    # Truncate in log space so that exp never overflows.
    capped_BT = log_ratio_BT >= math.log(cap)
    weights_BT = torch.exp(torch.clamp(log_ratio_BT, max=math.log(cap)))
    weights_BT = torch.where(mask_BT.bool(), weights_BT, torch.zeros_like(weights_BT))
    metrics = {"tis/weight_mean": float(masked_mean(weights_BT, mask_BT)),
               "tis/capped_frac": float(masked_mean(capped_BT.float(), mask_BT))}
    return weights_BT, metrics


def routing_metrics(counts_N3: torch.Tensor) -> dict[str, float]:
    """Routing replay's numbers from per-row counts ``[N, 3]`` (routings of the training pass that differ from the
    rollout's, those the training routers would choose differently by themselves, all compared; each a (token,
    MoE layer) pair): ``moe/routing_mismatch`` and ``moe/router_natural_mismatch`` (fractions of the compared
    pairs) and ``moe/routing_decisions``."""
    mismatch, natural, decisions = (float(x) for x in counts_N3.double().sum(dim=0))
    if decisions <= 0:
        return {"moe/routing_decisions": 0.0}
    return {"moe/routing_mismatch": mismatch / decisions, "moe/router_natural_mismatch": natural / decisions,
            "moe/routing_decisions": decisions}
