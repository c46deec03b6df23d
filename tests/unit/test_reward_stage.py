"""The reward stage (megarl.controller.reward_stage): sources combined in order under one rule (``add``: the target
plus the weighted values; ``replace``: the weighted values, the replaced rollout source never called), rows a source
could not score out of the loss mask as they are scored and counted in the step, the rewards starting from the final
scores, the advantage terms added after the estimator, and the entries each run and its validation build."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megarl.algo.dapo import REWARD_EXTRA
from megarl.algo.kl import build_kl_controller, kl_penalty
from megarl.config import load_config
from megarl.controller.reward_sources import KLInReward, RuleSource, Signal
from megarl.controller.reward_stage import (
    ADVANTAGE_TERMS,
    REWARD_SOURCES,
    RewardStage,
    StageInputs,
    add_advantage_terms,
    extend_columns,
)
from megarl.reward import RewardManager
from tests.unit.test_dataset import build_tokenizer
from tests.unit.test_rewards import response_batch


class Weighted:
    """A source of the stage's protocol (how a user's own source is written): ``value`` on each response's last
    token; rows in ``unscored`` could not be scored."""

    unscored_note = "by the weighted source"

    def __init__(self, name, *, when="rollout", into="score", combine="add", coef=1.0, value=1.0, unscored=()):
        self.name, self.when, self.into, self.combine = name, when, into, combine
        self.coef, self.value, self.unscored, self.calls = coef, value, set(unscored), 0
        self.unscored_key = f"{name}_error" if unscored else None

    def score(self, batch, step=None):
        self.calls += 1
        mask = batch["response_mask"]
        values = torch.zeros(mask.shape)
        values[torch.arange(len(mask)), mask.sum(-1).clamp(min=1) - 1] = self.value
        extra = {f"{self.name}_error": [f"row {i} refused" if i in self.unscored else None for i in range(len(mask))]} \
            if self.unscored_key else {}
        return Signal(values, coef=self.coef, extra=extra, metrics={f"{self.name}/calls": float(self.calls)})

    def failure_metrics(self, extra, where, validation):
        return {f"{self.name}/num_unscored": float(sum(1 for e in extra.get(self.unscored_key, []) if e))} \
            if self.unscored_key else {}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _batch(tokenizer):
    """Four responses to "1 + 1" of which rows 0 and 2 are right (the ``addition`` scorer: 1.0 or 0.0)."""
    batch = response_batch(tokenizer, ["2", "3", "2", "5"], num_tokens=4, ground_truths=["2"] * 4)
    batch.meta = {"temperature": 1.0}
    return batch


def _step(stage, batch, said=None):
    return stage.score_step(batch, "step 7", {}, roles=None, around=lambda role: contextlib.nullcontext())


def test_rollout_sources_combine_in_order(tokenizer):
    rule = RuleSource(RewardManager(tokenizer))
    judge = Weighted("judge", coef=0.5, value=0.25)
    batch = RewardStage([rule, judge]).score_rollout(_batch(tokenizer))
    last = batch["response_mask"].sum(-1) - 1
    assert batch["token_level_scores"][torch.arange(4), last].tolist() == [1.125, 0.125, 1.125, 0.125]
    assert batch["token_level_scores"].sum().item() == pytest.approx(2.5)
    assert [row["score"] for row in batch[REWARD_EXTRA]] == [1.0, 0.0, 1.0, 0.0]  # the rule's own extras

    replacing = Weighted("judge", combine="replace", value=0.75)
    counting = Weighted("rule")
    stage = RewardStage([counting, replacing])
    assert [s.name for s in stage.sources] == ["judge"] and counting.calls == 0  # nothing reads the replaced rule
    scores, _ = stage.rollout_scores(_batch(tokenizer))
    assert scores.sum().item() == pytest.approx(3.0)


def test_unscored_rows_leave_the_loss_mask_as_scored_and_are_counted_in_the_step(tokenizer):
    def refuse_odd(data_source, solution_str, ground_truth, extra_info):
        if extra_info["index"] % 2:
            raise ValueError("no")
        return 1.0

    rule = RuleSource(RewardManager(tokenizer, compute_score=refuse_odd, on_error="skip"))
    said = []
    stage = RewardStage([rule, Weighted("judge", unscored=[0])], console=said.append)
    batch = stage.score_rollout(_batch(tokenizer))
    assert batch["response_mask"].sum(-1).tolist() == [0, 0, 2, 0]  # row 0: the judge's; rows 1, 3: the rule's
    batch, extra, metrics = _step(stage, batch)
    assert metrics == {"reward/num_errors": 2.0, "judge/num_unscored": 1.0}
    assert extra["judge_error"] == ["row 0 refused", None, None, None] and extra["reward_error"][0] is None
    assert said[0].startswith("step 7: 2 of 4 rows could not be scored and are left out of the update "
                              "(reward_model.on_error=skip); the first: row 1 (prompt index 1, data_source 'addition')")
    assert said[1] == "step 7: 1 of 4 rows could not be scored by the weighted source; the first: row 0 refused"
    assert REWARD_EXTRA not in batch and stage.unscored_keys == ["reward_error", "judge_error"]


def test_step_sources_fill_scores_rewards_and_advantage_terms(tokenizer):
    rule = RuleSource(RewardManager(tokenizer))
    kl_ctrl = build_kl_controller("fixed", kl_coef=0.1)
    model = Weighted("model", when="step", combine="add", coef=2.0, value=0.5)
    teacher = Weighted("teacher", when="step", into="advantage", coef=-0.25, value=1.0)
    stage = RewardStage([rule, model, KLInReward(kl_ctrl, "kl"), teacher])
    batch = stage.score_rollout(_batch(tokenizer))
    rule_scores = batch["token_level_scores"].clone()
    generator = torch.Generator().manual_seed(0)
    batch["old_log_probs"] = -torch.rand(4, 4, generator=generator)
    batch["ref_log_prob"] = -torch.rand(4, 4, generator=generator)
    batch, _, metrics = _step(stage, batch)
    mask = batch["response_mask"]
    last = torch.zeros(4, 4)
    last[torch.arange(4), mask.sum(-1) - 1] = 1.0
    torch.testing.assert_close(batch["token_level_scores"], rule_scores + 2.0 * 0.5 * last)
    kl = kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], "kl") * mask
    torch.testing.assert_close(batch["token_level_rewards"], batch["token_level_scores"] - 0.1 * kl)
    assert metrics["critic/kl_coeff"] == 0.1 and metrics["model/calls"] == 1.0
    torch.testing.assert_close(batch[ADVANTAGE_TERMS], -0.25 * last)
    batch["advantages"] = torch.ones(4, 4) * mask
    add_advantage_terms(batch)
    torch.testing.assert_close(batch["advantages"], (1.0 - 0.25 * last) * mask)
    assert ADVANTAGE_TERMS not in batch

    plain = RewardStage([RuleSource(RewardManager(tokenizer))])
    batch, _, _ = _step(plain, plain.score_rollout(_batch(tokenizer)))
    assert batch["token_level_rewards"] is batch["token_level_scores"] and ADVANTAGE_TERMS not in batch


def test_the_stage_refuses_a_score_source_after_a_reward_source():
    with pytest.raises(ValueError, match="a score source after a reward source"):
        RewardStage([Weighted("kl", when="step", into="reward"), Weighted("model", when="step")])
    with pytest.raises(ValueError, match=r"into='values'"):
        RewardStage([Weighted("odd", into="values")])


def test_each_run_builds_its_entries_and_validation_the_rollout_ones(tokenizer):
    cfg = load_config(["recipe=tiny_cpu_grpo", "algorithm.use_kl_in_reward=true", "teacher.enable=true",
                       "teacher.model.path=/m", "reward_model.enable=true", "reward_model.model.path=/rm"])
    inputs = StageInputs(tokenizer, RewardManager(tokenizer), kl_ctrl=build_kl_controller("fixed", kl_coef=0.1))
    assert [e.name for e in REWARD_SOURCES] == ["rule", "judge", "reward_model", "kl_in_reward", "teacher"]
    stage = RewardStage.for_run(cfg, inputs)
    assert [(s.name, s.when, s.into) for s in stage.sources] == [
        ("rule", "rollout", "score"), ("reward_model", "step", "score"), ("kl_in_reward", "step", "reward"),
        ("teacher", "step", "advantage")]
    assert [s.name for s in RewardStage.for_run(cfg, inputs, validation=True).sources] == ["rule"]


def test_validation_columns_extend_across_rounds():
    columns: dict[str, list] = {}
    extend_columns(columns, {"score": [1.0, 0.0]}, 2)
    extend_columns(columns, {"score": [0.5], "judge_error": ["timeout: t"]}, 1)
    assert columns == {"score": [1.0, 0.0, 0.5], "judge_error": [None, None, "timeout: t"]}
