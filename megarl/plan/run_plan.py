"""The figures of a run's pre-flight plan, as data: what :mod:`megarl.plan.report` formats and
:mod:`megarl.plan.preflight` computes and checks."""

from __future__ import annotations

import dataclasses

from megarl.config.schema import RunConfig
from megarl.models.sizes import Architecture
from megarl.plan.all_to_all import AllToAllPlan
from megarl.plan.judge import JudgePlan
from megarl.plan.memory import GpuPlan
from megarl.plan.placement import PlacementPlan
from megarl.plan.weight_sync import SyncPlan

TOKEN_ID_BYTES = 8
"""A token id on the driver (int64, as the rollout's batches hold them)."""


@dataclasses.dataclass(frozen=True)
class PlanFigures:
    """The figures of a run's pre-flight plan: placement, memory per kind of GPU, weight-sync volume (their text:
    :mod:`megarl.plan.report`; the checks: :class:`megarl.plan.preflight.RunPlan`)."""

    cfg: RunConfig
    model: Architecture
    critic_model: Architecture | None
    placement: PlacementPlan
    gpu_memory_bytes: int
    gpus: tuple[GpuPlan, ...]
    sync: SyncPlan
    max_seq: int
    all_to_all: AllToAllPlan | None = None
    """The actor's expert-parallel all-to-all per step (None: a dense model)."""
    host_memory_bytes: int = 0
    """The driver machine's memory (``trainer.host_memory_gb``)."""
    host_optimizer_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    """Node -> optimizer state Megatron's hybrid optimizer keeps in its host memory (``optimizer_cpu_offload``)."""
    scorers: dict[str, Architecture] = dataclasses.field(default_factory=dict)
    """The scoring models' sizes by role: ``teacher`` (``teacher.enable``), ``reward_model``
    (``reward_model.enable``)."""
    judge: JudgePlan | None = None
    """A generative judge's engines on their own pool (``reward_model.judge.enable``)."""

    @property
    def teacher_model(self) -> Architecture | None:
        return self.scorers.get("teacher")

    @property
    def trajectories(self) -> int:
        """Trajectories per step: ``data.train_batch_size`` prompts × ``rollout.n`` samples."""
        return self.cfg.data.train_batch_size * self.cfg.actor_rollout_ref.rollout.n

    @property
    def batch_bytes_at_least(self) -> int:
        """A lower bound of a step's batch on the driver: its token ids alone (int64, up to ``max_seq`` each); the
        masks, log-probs, advantages and the rest come on top."""
        return self.trajectories * self.max_seq * TOKEN_ID_BYTES

    @property
    def worst(self) -> GpuPlan:
        """The kind of GPU with the highest phase peak."""
        return max(self.gpus, key=lambda g: g.peak)
