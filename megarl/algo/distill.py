"""On-policy distillation: the teacher's signal on the student's sampled tokens.

With ``d_t = log π_student(y_t) − log π_teacher(y_t)`` on the response tokens (the single-sample estimate of the
per-token reverse KL, ``KL(π_student ‖ π_teacher)``; the student's log-probs are the recomputed ``old_log_probs``),
weighted by ``coef``:

- ``advantage``: ``A_t ← A_t − coef · d_t`` after the advantage estimator (slime's OPD; with zero task reward it is
  on-policy distillation with the reverse KL as each token's advantage);
- ``reward``: ``r_t ← r_t − coef · d_t`` on the token-level rewards before the estimator (as the in-reward KL
  penalty does with the reference).

Metrics: ``teacher/reverse_kl`` (mean over response tokens), ``teacher/reverse_kl_seq`` (its sum over each
response, mean over responses) and ``teacher/abs_log_ratio_max`` (the largest ``|d_t|``: 0 up to rounding for a
teacher with the student's weights, whatever the two layouts).

Shape legend: ``B`` rows (trajectories), ``T`` response tokens.
"""

from __future__ import annotations

import torch

from megarl.algo.masked import masked_mean


def reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
               response_mask: torch.Tensor) -> torch.Tensor:
    """``d_t`` [B, T]: the student's log-prob of each sampled token less the teacher's; 0 outside the responses."""
    return (student_log_probs - teacher_log_probs) * response_mask


def apply_to_rewards(token_level_rewards: torch.Tensor, kl: torch.Tensor, coef: float) -> torch.Tensor:
    """``reward`` signal: the token-level rewards less ``coef`` times the reverse KL [B, T]."""
    return token_level_rewards - coef * kl


def apply_to_advantages(advantages: torch.Tensor, kl: torch.Tensor, coef: float,
                        response_mask: torch.Tensor) -> torch.Tensor:
    """``advantage`` signal: each token's advantage less ``coef`` times its reverse KL [B, T] (0 outside the
    responses, as the estimators leave them)."""
    return (advantages - coef * kl) * response_mask


def distill_metrics(kl: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """The reverse KL per token (mean over response tokens) and per sequence (summed over each response), and the
    largest per-token log-ratio."""
    rows = response_mask.sum(-1) > 0
    per_sequence = kl.sum(-1)[rows]
    return {"teacher/reverse_kl": float(masked_mean(kl, response_mask)),
            "teacher/reverse_kl_seq": float(per_sequence.mean()) if per_sequence.numel() else 0.0,
            "teacher/abs_log_ratio_max": float((kl.abs() * response_mask).max()) if kl.numel() else 0.0}
