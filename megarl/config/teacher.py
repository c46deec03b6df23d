"""A teacher for on-policy distillation (``teacher.*``): another model, with its own Megatron layout, that scores the
student's sampled tokens with its log-probs (:class:`megarl.workers.megatron_workers.TeacherWorker`).

The signal is the per-token reverse KL estimate ``log π_student(y_t) − log π_teacher(y_t)`` on the sampled tokens
(the student's recomputed ``old_log_probs``), weighted by ``kl_coef`` (slime's ``--opd-kl-coef``) and applied as
``signal`` says: ``advantage`` subtracts it from every token's advantage after the estimator (slime's OPD; with the
task reward at zero, Thinking Machines' on-policy distillation), ``reward`` adds its negative to the token-level
rewards before the estimator (as the in-reward KL does with the reference)."""

from __future__ import annotations

import dataclasses

from megarl.config.common import check_choice, check_micro_batches, check_positive
from megarl.config.megatron import MegatronConfig
from megarl.config.model import ScoringModelConfig
from megarl.config.parallel import ParallelDims

SIGNALS = ("advantage", "reward")
"""``teacher.signal``: where the distillation signal enters."""


@dataclasses.dataclass(kw_only=True)
class TeacherConfig:
    """The teacher (``teacher.*``); off unless ``enable``."""

    enable: bool = False
    """Score the student's samples with the teacher's log-probs (on-policy distillation)."""
    model: ScoringModelConfig = dataclasses.field(default_factory=ScoringModelConfig)
    """The teacher's model (``teacher.model.path``: any family megarl loads; ``init=tiny_sft`` builds the tiny warm
    start there, as for the policy); its tokenizer must be the student's."""
    kl_coef: float = 1.0
    """Weight of the per-token reverse KL (slime's ``--opd-kl-coef``)."""
    signal: str = "advantage"
    """``advantage`` (subtracted from each token's advantage after the estimator) or ``reward`` (added, negated, to
    the token-level rewards before it)."""
    log_prob_micro_batch_size_per_gpu: int | None = 16
    """Trajectories per forward on one rank; ignored with ``log_prob_use_dynamic_bsz``."""
    log_prob_use_dynamic_bsz: bool = False
    """Pack forward micro-batches by token count (``log_prob_max_token_len_per_gpu``)."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one forward micro-batch on one rank, with ``log_prob_use_dynamic_bsz``."""
    parallel: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    """Megatron layout of the teacher (its own; ``dp`` is what the world leaves)."""
    param_offload: bool = False
    """Keep the teacher's weights in host memory between its forwards (GPU only)."""
    megatron: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)
    """Megatron's ``TransformerConfig`` fields passed through (``megatron.override_transformer_config.*``)."""

    def __post_init__(self) -> None:
        check_choice("teacher.signal", self.signal, SIGNALS)
        check_positive("teacher.kl_coef", self.kl_coef)
        check_micro_batches("teacher.log_prob", self.log_prob_micro_batch_size_per_gpu, self.log_prob_use_dynamic_bsz,
                            self.log_prob_max_token_len_per_gpu)
        if self.enable and not self.model.path:
            raise ValueError("teacher.enable=true needs teacher.model.path: the teacher's HF directory")
