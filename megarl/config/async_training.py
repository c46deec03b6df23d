"""Asynchronous training: generation overlaps training (``trainer.mode``, ``async_training.*``; verl's names).

- ``trainer.mode=sync``: each step generates its batch, then trains (megarl's loop).
- ``one_step_off``: step ``k + 1``'s prompts are generated while step ``k`` trains, with the weights of step
  ``k - 1``; every weight sync waits for that generation (verl's one-step off-policy recipe, slime's
  ``train_async``). The samples of step ``k > 1`` are exactly one version old. Fixed settings: staleness 1, no
  partial rollouts.
- ``fully_async``: the engines generate continuously into a buffer of whole prompt groups, at most
  ``max_staleness`` weight versions ahead of the trainer; with ``partial_rollout`` a weight sync pauses the
  engines (``pause_mode``) and the held requests continue with the new weights, each token keeping the version
  that sampled it.

Either way a step trains the prompts a synchronous run would (groups are taken in prompt order), the engines
need their own resources (``actor_rollout_ref.hybrid_engine=false``), and the loss can weight each token by its
behaviour log-prob (``actor.tis_cap``; ``mismatch/*`` metrics report the gap).
"""

from __future__ import annotations

import dataclasses

from megarl.config.common import check_choice

TRAINING_MODES = ("sync", "one_step_off", "fully_async")
PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's ``/pause_generation`` modes."""
STALE_POLICIES = ("drop", "regenerate")


@dataclasses.dataclass(kw_only=True)
class AsyncTrainingConfig:
    """``async_training.*``: the bounds of ``trainer.mode=one_step_off`` / ``fully_async``."""

    max_staleness: int = 1
    """Most weight versions a trained sample's oldest token may lag the trainer's policy (AReaL's
    ``max_head_offpolicyness``, NeMo-RL's ``max_trajectory_age_steps``); 0 is on-policy."""
    stale_policy: str = "drop"
    """A group found past the bound (a resume with a smaller bound): ``drop`` it (counted) or ``regenerate`` it."""
    partial_rollout: bool = False
    """A weight sync pauses the engines' running requests and continues them with the new weights (each token
    keeps its version); false: the sync waits for the requests in flight."""
    pause_mode: str = "retract"
    """How ``partial_rollout`` pauses (SGLang's modes): ``retract`` (the cache is recomputed with the new weights)
    or ``in_place`` (the cache is kept; SGLang then refuses to flush it)."""
    max_inflight_groups: int | None = None
    """Prompt groups generating at once; None: ``data.train_batch_size × (max_staleness + 1)``."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"async_training.max_staleness must be >= 0, got {self.max_staleness}")
        check_choice("async_training.stale_policy", self.stale_policy, STALE_POLICIES)
        check_choice("async_training.pause_mode", self.pause_mode, PAUSE_MODES)
        if self.pause_mode == "abort":
            raise ValueError("async_training.pause_mode=abort ends the held requests; use retract or in_place")
        if self.max_inflight_groups is not None and self.max_inflight_groups < 1:
            raise ValueError(f"async_training.max_inflight_groups must be >= 1 or null, got {self.max_inflight_groups}")
