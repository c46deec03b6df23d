"""The reward stage's signal sources (:mod:`megarl.controller.reward_stage`), but the judge's
(:class:`megarl.controller.judge.JudgeSource`): the rule function, a scoring model (the reward model), the in-reward
KL penalty and the teacher's reverse KL (on-policy distillation).

A source is an object with ``name``, ``when`` (``rollout``: it scores a trajectory as it is produced; ``step``: it
needs the step's forwards), ``into`` (the target its values enter: ``score``, ``reward`` or ``advantage``),
``combine`` (``add`` or ``replace``), ``unscored_key`` (the per-row column that says why it could not score a row;
None: it scores every row) and two methods: :meth:`score` (a :class:`Signal`) and :meth:`failure_metrics` (its
counts over a step's rows, and its failure policy).

Shape legend: ``B`` rows (trajectories), ``T`` response tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from megarl.algo.distill import distill_metrics, reverse_kl
from megarl.algo.kl import KLController, in_reward_kl
from megarl.controller.metrics import timer
from megarl.data.batch import Batch
from megarl.reward.manager import RewardManager, last_valid_positions
from megarl.workers.roles import RoleSpec

SCORING_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")
"""What a scoring model receives."""


@dataclasses.dataclass
class Signal:
    """What a source says about a batch."""

    values: torch.Tensor
    """Per-token values [B, T] (a sequence score sits on the response's last token)."""
    coef: float = 1.0
    """Their weight in the target (a penalty's is negative)."""
    extra: dict[str, list] = dataclasses.field(default_factory=dict)
    """Per-row columns (``score``, ``acc``, the judge's verdicts, why a row could not be scored...)."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    columns: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Fields the source adds to the batch (the teacher's log-probs)."""


@dataclasses.dataclass
class StepContext:
    """What a step-time source gets besides the batch."""

    roles: Any
    """The run's :class:`~megarl.controller.build.Roles` (the scoring models' ranks)."""
    timing: dict[str, float]
    around: Callable[[str], AbstractContextManager]
    """The trainer's onload/offload context of a role."""
    scores: torch.Tensor
    """``token_level_scores`` so far [B, T] (the sources before this one combined)."""


def scoring_input(batch: Batch) -> Batch:
    """The columns a scoring model receives, with the rollout's sampling temperature."""
    selected = batch.select(*SCORING_KEYS)
    selected.meta = {"temperature": batch.meta["temperature"]}
    return selected


def on_last_token(scores_B: torch.Tensor, response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sequence scores [B] as token values [B, T]: each on its response's last training token (position 0 of a row
    without one), zeros elsewhere, of ``like``'s dtype."""
    values = torch.zeros_like(like)
    values[torch.arange(len(scores_B)), last_valid_positions(response_mask).clamp(min=0)] = scores_B.to(like.dtype)
    return values


class RuleSource:
    """The rule function (``reward_model.custom_reward_function``, else the scorer registered for each row's
    ``data_source``: :class:`~megarl.reward.manager.RewardManager`), on each response's last token. A row it could
    not score (``reward_model.on_error=skip``) has a ``reward_error``."""

    name, when, into, combine = "rule", "rollout", "score", "add"
    unscored_note = "and are left out of the update (reward_model.on_error=skip)"

    def __init__(self, manager: RewardManager) -> None:
        self.manager = manager
        self.unscored_key = "reward_error" if manager.on_error == "skip" else None

    def score(self, batch: Batch, step: StepContext | None = None) -> Signal:
        values, extra = self.manager(batch)
        return Signal(values, extra=extra)

    def failure_metrics(self, extra: Mapping[str, list], where: str, validation: bool) -> dict[str, float]:
        """``reward/num_errors`` of a step (validation counts its errors with every source's: ``val-aux/*``)."""
        if self.unscored_key is None or validation:
            return {}
        return {"reward/num_errors": float(sum(1 for error in extra.get(self.unscored_key, []) if error))}


class ModelScore:
    """A scoring model's score of each response (the reward model: ``RewardModelWorker.compute_rm_score`` on its
    ranks), on its last training token; ``<section>.combine`` ``replace`` (the model's score is the score) or
    ``add`` (``rm_coef`` times it added). Metrics ``<role>/score/{mean,max,min}`` and how it agrees with the scores
    before it (:func:`rule_agreement`)."""

    when, into = "step", "score"
    unscored_key = None

    def __init__(self, spec: RoleSpec, section: Any) -> None:
        self.spec, self.name = spec, spec.name
        self.combine = section.combine
        self.coef = section.rm_coef if section.combine == "add" else 1.0

    def score(self, batch: Batch, step: StepContext) -> Signal:
        with step.around(self.name), timer(self.name, step.timing):
            scores = step.roles.group(self.name).call_dp(self.spec.worker_class().compute_rm_score,
                                                         scoring_input(batch))["rm_scores"]
        metrics = rule_agreement(step.scores.sum(-1), scores, prefix=self.name)
        metrics |= {f"{self.name}/score/mean": float(scores.mean()), f"{self.name}/score/max": float(scores.max()),
                    f"{self.name}/score/min": float(scores.min())}
        return Signal(on_last_token(scores, batch["response_mask"], step.scores), coef=self.coef, metrics=metrics)

    def failure_metrics(self, extra: Mapping[str, list], where: str, validation: bool) -> dict[str, float]:
        return {}


def rule_agreement(rule_N: torch.Tensor, scores_N: torch.Tensor, prefix: str = "reward_model") -> dict[str, float]:
    """How a scoring model's scores of a step's rows agree with the scores before it (the rule function's, the
    judge's: their sum per row): ``<prefix>/rule_score/mean``, and their Pearson correlation ``<prefix>/rule_corr``
    where both vary (a reward model being gamed shows as a falling correlation)."""
    rule, score = rule_N.double(), scores_N.reshape(-1).double()
    out = {f"{prefix}/rule_score/mean": float(rule.mean())}
    if len(rule) > 1 and float(rule.std()) > 0 and float(score.std()) > 0:
        out[f"{prefix}/rule_corr"] = float(torch.corrcoef(torch.stack([rule, score]))[0, 1])
    return out


class KLInReward:
    """The in-reward KL penalty (``algorithm.use_kl_in_reward``): ``−beta`` times the per-token KL of the actor's
    old log-probs to the reference's (``algorithm.kl_penalty``), beta from the run's controller
    (``algorithm.kl_ctrl``, stepped each step); metrics ``critic/kl``, ``critic/kl_coeff``."""

    name, when, into, combine = "kl_in_reward", "step", "reward", "add"
    unscored_key = None

    def __init__(self, kl_ctrl: KLController, kind: str) -> None:
        self.kl_ctrl, self.kind = kl_ctrl, kind

    def score(self, batch: Batch, step: StepContext) -> Signal:
        kl_BT, beta, metrics = in_reward_kl(batch, self.kl_ctrl, self.kind)
        return Signal(kl_BT, coef=-beta, metrics=metrics)

    def failure_metrics(self, extra: Mapping[str, list], where: str, validation: bool) -> dict[str, float]:
        return {}


class TeacherKL:
    """On-policy distillation (:mod:`megarl.algo.distill`): the teacher's log-probs of the sampled tokens
    (``TeacherWorker.compute_teacher_log_prob`` on its ranks, into ``teacher_log_prob``) and ``−teacher.kl_coef``
    times the reverse KL of the student to it, into the rewards or the advantages (``teacher.signal``)."""

    when, combine = "step", "add"
    unscored_key = None

    def __init__(self, spec: RoleSpec, section: Any) -> None:
        self.spec, self.name = spec, spec.name
        self.into = section.signal
        self.coef = -section.kl_coef

    def score(self, batch: Batch, step: StepContext) -> Signal:
        temperature = batch.meta["temperature"]
        with step.around(self.name), timer(self.name, step.timing):
            teacher = step.roles.group(self.name).call_dp(self.spec.worker_class().compute_teacher_log_prob,
                                                          scoring_input(batch), temperature=temperature)
        log_probs = teacher["teacher_log_prob"]
        kl = reverse_kl(batch["old_log_probs"], log_probs, batch["response_mask"])
        return Signal(kl, coef=self.coef, metrics=distill_metrics(kl, batch["response_mask"]),
                      columns={"teacher_log_prob": log_probs})

    def failure_metrics(self, extra: Mapping[str, list], where: str, validation: bool) -> dict[str, float]:
        return {}
