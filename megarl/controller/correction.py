"""Rollout correction in the training step (``algorithm.rollout_correction``, :mod:`megarl.algo.rollout_correction`):
once the trainer has recomputed the rollout's log-probs, the rejected tokens leave ``response_mask`` (the one loss
mask every role reads) and the importance weights go into the batch as ``rollout_is_weights`` [N, R], which the
actor's policy loss multiplies in."""

from __future__ import annotations

from megarl.algo.rollout_correction import is_weights, kept_gap, offpolicy_metrics, rejection_mask
from megarl.data.batch import Batch


def correct_rollouts(section, batch: Batch) -> dict[str, float]:
    """Apply ``section`` (the ``algorithm.rollout_correction`` config) to ``batch`` in place; its metrics
    (``rollout_corr/*``). Nothing without the engines' log-probs (``rollout_log_probs``) or with the section off."""
    if not section.enabled or "rollout_log_probs" not in batch:
        return {}
    old, rollout, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
    metrics = offpolicy_metrics(old, rollout, mask)
    if section.rollout_rs:
        keep, rejected = rejection_mask(old, rollout, mask, section.rejection)
        metrics |= rejected
        mask = batch["response_mask"] = mask * keep
    weights = None
    if section.rollout_is is not None:
        weights, weighed = is_weights(old, rollout, mask, level=section.rollout_is,
                                      threshold=section.rollout_is_threshold,
                                      batch_normalize=section.rollout_is_batch_normalize)
        metrics |= weighed
        batch["rollout_is_weights"] = weights
    metrics |= kept_gap(old, rollout, mask, weights)
    return {f"rollout_corr/{key}": value for key, value in metrics.items()}
