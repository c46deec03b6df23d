"""Actor and critic losses: PPO/GSPO policy loss with entropy and KL terms, clipped value loss, aggregation.

Aggregation (``loss_agg_mode``) turns a [B, T] per-token loss
into a scalar. Every mode is written as ``numerator / global_norm``, where the numerator is a
sum over this micro-batch's rows and ``global_norm`` is the normaliser of the **whole
mini-batch** (all micro-batches, all data-parallel ranks):

============================ ======================================= ===============================
mode                         numerator (this micro-batch)            global_norm (whole mini-batch)
============================ ======================================= ===============================
``token-mean``               sum of loss over valid tokens           number of valid tokens
``token-sum``                sum of loss over valid tokens           none (1): the plain global sum
``seq-mean-token-sum``       sum of loss over valid tokens           number of sequences
``seq-mean-token-mean``      sum over rows of each row's token mean  number of sequences
``seq-mean-token-sum-norm``  sum of loss over valid tokens           sequences x max response length
============================ ======================================= ===============================

Because the numerator is additive over rows, the gradient of the mini-batch is exactly the
sum of the gradients of its micro-batches, however the rows are split (fixed micro-batches,
token-budget packing, DP ranks), as long as every piece is given the same ``global_norm``.
:func:`agg_norm` computes it from a mask; it is additive over rows too, so DP ranks sum their
local values with one all-reduce. megarl's Megatron models sum gradients over DP ranks
(``calculate_per_token_loss``; see megarl.parallel.pipeline), so the loss needs no rescaling.
"Sequences" counts rows with at least one valid token, so all-masked padding rows change nothing.

``token-sum`` (verl 0.9's mode of that name) is not normalised at all: the mini-batch loss is the
sum of the per-token losses over every valid token of all micro-batches and DP ranks, so its
scale grows with the batch and the response lengths. verl multiplies each rank's local sum by
the DP size to undo the gradient averaging of DDP/FSDP; megarl's DP reduction already sums, so
the local sum is used as it is. :func:`agg_norm` gives 0 for it (additive, so the all-reduced
value stays 0) and :func:`agg_loss` ignores ``global_norm`` for it.

Shape legend: ``B`` rows (trajectories) of this micro-batch, ``T`` response tokens.
"""

from __future__ import annotations

import torch

from megarl.algo.kl import kl_penalty
from megarl.algo.masked import masked_mean, masked_sum, masked_var

__all__ = ["AGG_MODES", "POLICY_LOSS_MODES", "agg_norm", "agg_loss", "policy_loss", "ppo_clip_losses",
           "gspo_losses", "value_loss", "explained_variance", "kl_penalty"]

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r} (actor.loss_agg_mode / critic.loss_agg_mode); "
                         f"use one of {AGG_MODES}")


def agg_norm(mask_BT: torch.Tensor, mode: str, norm_length: int | None = None) -> float:
    """The normaliser of ``mode`` over the rows of ``mask_BT`` (pass a whole mini-batch's mask).

    Valid tokens for ``token-mean``; sequences with a valid token for the ``seq-mean-*`` modes;
    times ``norm_length`` for ``seq-mean-token-sum-norm``; 0 for ``token-sum``, which has no
    normaliser (:func:`agg_loss` ignores it). ``norm_length`` defaults to
    ``mask_BT.shape[-1]``; pass ``data.max_response_length`` when micro-batches are padded to
    different lengths. Additive over rows: the DP-global value is the sum over ranks.
    """
    _check_mode(mode)
    valid_BT = mask_BT.bool()
    if mode == "token-mean":
        return float(valid_BT.sum())
    if mode == "token-sum":
        return 0.0
    num_seqs = float(valid_BT.any(dim=-1).sum())
    if mode == "seq-mean-token-sum-norm":
        return num_seqs * float(mask_BT.shape[-1] if norm_length is None else norm_length)
    return num_seqs


def agg_loss(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str,
             global_norm: float | torch.Tensor | None = None) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] into a scalar under ``mode`` (see the module docstring).

    ``global_norm`` is the mini-batch normaliser from :func:`agg_norm` (summed over DP ranks);
    ``None`` uses this micro-batch's own, which makes the result the plain mean of this piece
    (right for metrics, not for gradients accumulated over several pieces). A normaliser
    below 1 (a mini-batch without valid tokens) is treated as 1, so the loss is 0, not NaN.
    ``token-sum`` returns the plain masked sum whatever ``global_norm`` is.
    """
    _check_mode(mode)
    if global_norm is None:
        global_norm = agg_norm(mask_BT, mode)
    elif not isinstance(global_norm, torch.Tensor) and global_norm < 0:
        raise ValueError(f"global_norm must be >= 0 (a token or sequence count from agg_norm), got {global_norm}")
    if mode == "seq-mean-token-mean":
        numerator = masked_mean(loss_BT, mask_BT, dim=-1).sum()
    else:
        numerator = masked_sum(loss_BT, mask_BT)
    if mode == "token-sum":
        return numerator
    denominator = torch.as_tensor(global_norm, dtype=numerator.dtype, device=numerator.device).clamp(min=1)
    return numerator / denominator


def ppo_clip_losses(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_BT: torch.Tensor,
                    mask_BT: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                    clip_ratio_c: float | None = 3.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate with decoupled clip range (DAPO clip-higher) and dual clip.

    ``ratio = exp(logp - old_logp)``; ``l1 = max(-A * ratio, -A * clamp(ratio, 1 - low, 1 + high))``;
    for ``A < 0`` the loss is further capped at ``-A * clip_ratio_c`` (dual clip; ``None`` turns
    it off). Returns the [B, T] losses and the metrics ``pg_clipfrac`` (the clipped term is the
    larger), ``pg_clipfrac_lower`` (the dual clip is active) and ``ppo_kl`` (mean of
    ``old_logp - logp``), all masked token means.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    # Clamp before exp only to keep a wild log-ratio finite; |log ratio| < 20 is never clipped in practice.
    log_ratio_BT = torch.clamp(logp_BT - old_logp_BT, min=-20.0, max=20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses_BT = torch.maximum(unclipped_BT, clipped_BT)
    negative_BT = advantages_BT < 0
    metrics = {"pg_clipfrac": masked_mean((clipped_BT > unclipped_BT).float(), mask_BT),
               "ppo_kl": masked_mean(-log_ratio_BT, mask_BT)}
    if clip_ratio_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=logp_BT.device)
        return losses_BT, metrics
    dual_bound_BT = -advantages_BT * clip_ratio_c
    metrics["pg_clipfrac_lower"] = masked_mean(((losses_BT > dual_bound_BT) & negative_BT).float(), mask_BT)
    losses_BT = torch.where(negative_BT, torch.minimum(losses_BT, dual_bound_BT), losses_BT)
    return losses_BT, metrics


def gspo_losses(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_BT: torch.Tensor,
                mask_BT: torch.Tensor, clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO loss: the importance ratio is the sequence's geometric-mean ratio.

    ``s_i = exp(mean over valid t of (logp - old_logp))``; each token uses the value ``s_i`` with
    gradient ``s_i * grad(logp_t)`` (GSPO-token form), clipped to ``[1 - low, 1 + high]``.
    Use it with ``loss_agg_mode=seq-mean-token-mean``, as in the GSPO paper. Metrics as
    :func:`ppo_clip_losses` (``pg_clipfrac_lower`` is 0: GSPO has no dual clip).
    """
    log_ratio_BT = logp_BT - old_logp_BT
    seq_log_ratio_B = masked_mean(log_ratio_BT, mask_BT, dim=-1)
    # Value log s_i on every token, gradient d logp_t: the detach trick of the GSPO-token objective.
    log_seq_ratio_BT = logp_BT - logp_BT.detach() + seq_log_ratio_B.detach().unsqueeze(-1)
    ratio_BT = torch.exp(torch.clamp(log_seq_ratio_BT, max=10.0))
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    metrics = {"pg_clipfrac": masked_mean((clipped_BT > unclipped_BT).float(), mask_BT),
               "pg_clipfrac_lower": torch.zeros((), device=logp_BT.device),
               "ppo_kl": masked_mean(-log_ratio_BT, mask_BT)}
    return torch.maximum(unclipped_BT, clipped_BT), metrics


def policy_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_BT: torch.Tensor,
                mask_BT: torch.Tensor, *, loss_agg_mode: str = "token-mean",
                global_norm: float | torch.Tensor | None = None, policy_loss_mode: str = "vanilla",
                clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0,
                entropy_BT: torch.Tensor | None = None, entropy_coeff: float = 0.0,
                ref_logp_BT: torch.Tensor | None = None, kl_loss_coef: float = 0.0, kl_loss_type: str = "low_var_kl",
                is_weights_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss for one micro-batch: ``pg_loss - entropy_coeff * entropy + kl_loss_coef * kl``.

    ``mask_BT`` is the loss mask (``response_mask``, or the multi-turn loss mask with tool tokens
    at 0). ``policy_loss_mode`` picks the surrogate: ``vanilla`` (:func:`ppo_clip_losses`) or
    ``gspo`` (:func:`gspo_losses`). ``is_weights_BT`` (optional, detached) multiplies the
    per-token surrogate: the truncated importance weights of :func:`megarl.algo.mismatch.tis_weights`.
    The entropy bonus needs ``entropy_BT`` when ``entropy_coeff != 0``; the KL loss (estimator
    ``kl_loss_type``, added with a plus sign) needs ``ref_logp_BT`` when ``kl_loss_coef != 0``.
    All three terms are aggregated with ``loss_agg_mode`` and ``global_norm`` (see
    :func:`agg_loss`). Returns the scalar loss and detached metrics: ``pg_loss`` (this piece's
    share, so shares add up to the mini-batch value), ``pg_clipfrac``, ``pg_clipfrac_lower``,
    ``ppo_kl``, and ``entropy`` / ``kl_loss`` when given (masked token means of this piece).
    """
    if policy_loss_mode == "vanilla":
        losses_BT, metrics = ppo_clip_losses(logp_BT, old_logp_BT, advantages_BT, mask_BT, clip_ratio_low,
                                             clip_ratio_high, clip_ratio_c)
    elif policy_loss_mode == "gspo":
        losses_BT, metrics = gspo_losses(logp_BT, old_logp_BT, advantages_BT, mask_BT, clip_ratio_low,
                                         clip_ratio_high)
    else:
        raise ValueError(f"unknown actor.policy_loss_mode {policy_loss_mode!r}; use one of {POLICY_LOSS_MODES}")
    if is_weights_BT is not None:
        losses_BT = losses_BT * is_weights_BT.detach()
    loss = agg_loss(losses_BT, mask_BT, loss_agg_mode, global_norm)
    metrics["pg_loss"] = loss.detach()
    if entropy_coeff != 0 and entropy_BT is None:
        raise ValueError("actor.entropy_coeff is non-zero but no entropy was passed; compute the entropy in the "
                         "forward pass or set actor.entropy_coeff=0")
    if entropy_BT is not None:
        metrics["entropy"] = masked_mean(entropy_BT.detach(), mask_BT)
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * agg_loss(entropy_BT, mask_BT, loss_agg_mode, global_norm)
    if kl_loss_coef != 0 and ref_logp_BT is None:
        raise ValueError("actor.kl_loss_coef is non-zero but no ref_log_prob was passed; set actor.use_kl_loss "
                         "so the reference log-probs are computed, or set actor.kl_loss_coef=0")
    if ref_logp_BT is not None:
        kl_BT = kl_penalty(logp_BT, ref_logp_BT, kl_loss_type)
        metrics["kl_loss"] = masked_mean(kl_BT.detach(), mask_BT)
        metrics["kl_coef"] = torch.tensor(float(kl_loss_coef))
        if kl_loss_coef != 0:
            loss = loss + kl_loss_coef * agg_loss(kl_BT, mask_BT, loss_agg_mode, global_norm)
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               mask_BT: torch.Tensor, *, cliprange_value: float | None = 0.5, loss_agg_mode: str = "token-mean",
               global_norm: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss ``0.5 * agg(max((V - R)^2, (V_clip - R)^2))``.

    ``V_clip = old_V + clamp(V - old_V, -cliprange_value, cliprange_value)`` (``critic.cliprange_value``;
    ``None`` turns clipping off). Returns the scalar loss and the metrics ``vf_loss`` (this
    piece's share), ``vf_clipfrac`` (the clipped error is the larger) and ``vpred_mean``.
    """
    unclipped_BT = (values_BT - returns_BT).square()
    if cliprange_value is None:
        losses_BT, clipfrac = unclipped_BT, torch.zeros((), device=values_BT.device)
    else:
        if cliprange_value < 0:
            raise ValueError(f"critic.cliprange_value must be >= 0 (or None to turn clipping off), "
                             f"got {cliprange_value}")
        clipped_values_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -cliprange_value, cliprange_value)
        clipped_BT = (clipped_values_BT - returns_BT).square()
        losses_BT = torch.maximum(unclipped_BT, clipped_BT)
        clipfrac = masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)
    loss = 0.5 * agg_loss(losses_BT, mask_BT, loss_agg_mode, global_norm)
    metrics = {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac.detach(),
               "vpred_mean": masked_mean(values_BT.detach(), mask_BT)}
    return loss, metrics


@torch.no_grad()
def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor,
                       eps: float = 1e-8) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over valid tokens (1 = perfect critic, 0 = constant)."""
    residual_var = masked_var(returns_BT - values_BT, mask_BT, unbiased=False)
    return 1.0 - residual_var / (masked_var(returns_BT, mask_BT, unbiased=False) + eps)
