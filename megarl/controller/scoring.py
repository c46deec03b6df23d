"""The scoring models of a training step: the teacher's log-probs of the student's sampled tokens
(on-policy distillation) and the reward model's score of each response. Each is a role of its own
(:class:`~megarl.workers.megatron_workers.TeacherWorker`, :class:`~megarl.workers.megatron_workers.RewardModelWorker`),
called between the reference and the advantages; the teacher's signal enters around the advantage estimator
(:mod:`megarl.algo.distill`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.algo.distill import apply_to_advantages, apply_to_rewards, distill_metrics, reverse_kl
from megarl.config.schema import RunConfig
from megarl.controller.judge import judge_step_metrics
from megarl.controller.metrics import timer
from megarl.data.batch import Batch
from megarl.reward.manager import combine_model_scores
from megarl.workers.megatron_workers import RewardModelWorker, TeacherWorker

SCORING_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")
"""What a scoring model receives."""


def score_step(cfg: RunConfig, roles, batch: Batch, timing: dict[str, float], *,
          around: Callable[[str], object]) -> tuple[Batch, dict[str, float]]:
    """The teacher's ``teacher_log_prob`` [N, R] added to ``batch``, then the reward model's scores into its
    ``token_level_scores`` as ``reward_model.combine`` says; the metrics (``reward_model/score/*``). ``around(role)``:
    the trainer's onload/offload context of a role."""
    metrics: dict[str, float] = {}
    selected = batch.select(*SCORING_KEYS)
    selected.meta = {"temperature": batch.meta["temperature"]}
    if cfg.teacher.enable:
        with around("teacher"), timer("teacher", timing):
            batch = batch.union(roles.group("teacher").call_dp(TeacherWorker.compute_teacher_log_prob, selected,
                                                      temperature=batch.meta["temperature"]))
    if cfg.reward_model.enable:
        with around("reward_model"), timer("reward_model", timing):
            scores = roles.group("reward_model").call_dp(RewardModelWorker.compute_rm_score, selected)["rm_scores"]
        rm = cfg.reward_model
        metrics |= rule_agreement(batch["token_level_scores"].sum(-1), scores)
        batch["token_level_scores"] = combine_model_scores(batch["token_level_scores"], batch["response_mask"], scores,
                                                           combine=rm.combine, coef=rm.rm_coef)
        metrics |= {"reward_model/score/mean": float(scores.mean()), "reward_model/score/max": float(scores.max()),
                    "reward_model/score/min": float(scores.min())}
    return batch, metrics


def rule_agreement(rule_N: torch.Tensor, scores_N: torch.Tensor) -> dict[str, float]:
    """How the reward model's scores of a step's rows agree with their rule rewards (the rule scorers' sum per
    row, zero where there is none): ``reward_model/rule_score/mean``, and their Pearson correlation
    ``reward_model/rule_corr`` where both vary (a reward model being gamed shows as a falling correlation)."""
    rule, score = rule_N.double(), scores_N.reshape(-1).double()
    out = {"reward_model/rule_score/mean": float(rule.mean())}
    if len(rule) > 1 and float(rule.std()) > 0 and float(score.std()) > 0:
        out["reward_model/rule_corr"] = float(torch.corrcoef(torch.stack([rule, score]))[0, 1])
    return out


class TeacherSignal:
    """The teacher's per-token reverse KL, applied where ``teacher.signal`` says: :meth:`before` the advantage
    estimator (``reward``) and :meth:`after` it (``advantage``); its metrics from :meth:`before`."""

    def __init__(self, cfg: RunConfig, batch: Batch) -> None:
        self.section = cfg.teacher
        self.kl = None
        if self.section.enable:
            self.kl = reverse_kl(batch["old_log_probs"], batch["teacher_log_prob"], batch["response_mask"])

    def before(self, batch: Batch) -> dict[str, float]:
        if self.kl is None:
            return {}
        if self.section.signal == "reward":
            batch["token_level_rewards"] = apply_to_rewards(batch["token_level_rewards"], self.kl, self.section.kl_coef)
        return distill_metrics(self.kl, batch["response_mask"])

    def after(self, batch: Batch) -> None:
        if self.kl is not None and self.section.signal == "advantage":
            batch["advantages"] = apply_to_advantages(batch["advantages"], self.kl, self.section.kl_coef,
                                                      batch["response_mask"])


def leave_out_unscored(cfg: RunConfig, batch: Batch, extra: dict[str, list], where: str, console) -> dict[str, float]:
    """Rows the reward function (``reward_model.on_error=skip``) or the judge could not score get an all-zero loss
    mask; they are counted (``reward/num_errors``, ``judge/*``) and the first error is shown (``console``). Too many
    the judge could not score stop the run (``reward_model.judge.max_failure_share``)."""
    judge = cfg.reward_model.judge
    metrics = judge_step_metrics(extra, judge.max_failure_share, where) if judge.enable else {}
    for key, counted in (("reward_error", cfg.reward_model.on_error == "skip"), ("judge_error", judge.enable)):
        if not counted:
            continue
        errors = [i for i, error in enumerate(extra.get(key, [])) if error]
        if errors:
            batch["response_mask"][errors] = 0
            why = "by the judge and are left out of the update" if key == "judge_error" else \
                "and are left out of the update (reward_model.on_error=skip)"
            console(f"{where}: {len(errors)} of {len(batch)} rows could not be scored {why}; the first: "
                    f"{extra[key][errors[0]]}")
        if key == "reward_error":
            metrics["reward/num_errors"] = float(len(errors))
    return metrics
