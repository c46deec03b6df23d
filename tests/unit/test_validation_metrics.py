"""verl's validation metrics (megarl.controller.metrics.validation_metrics): names, means over prompts, and the
bootstrap best/worst/majority estimates."""

from __future__ import annotations

import pytest

from megarl.controller.metrics import validation_metrics


def test_one_sample_per_prompt_gives_mean_at_1_per_source_as_verl_names_it():
    metrics = validation_metrics(["gsm8k", "gsm8k", "math"], [0, 1, 2], {"reward": [1.0, 0.0, 0.5]}, seed=0)
    assert metrics == {"val-core/gsm8k/reward/mean@1": 0.5, "val-core/math/reward/mean@1": 0.5}


def test_acc_is_the_core_variable_when_the_reward_reports_it():
    metrics = validation_metrics(["a", "a"], [0, 1], {"reward": [0.2, 0.4], "acc": [1.0, 0.0], "pred": ["3", "4"]},
                                 seed=0)
    assert metrics["val-core/a/acc/mean@1"] == 0.5
    assert metrics["val-aux/a/reward/mean@1"] == pytest.approx(0.3)
    assert not any("pred" in key for key in metrics)


def test_n_samples_give_mean_std_best_worst_and_majority():
    # Prompt 0: 4 samples, 3 right (pred "7"), 1 wrong; prompt 1: all wrong, every pred different.
    sources = ["s"] * 8
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    acc = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    preds = ["7", "7", "8", "7", "1", "2", "3", "4"]
    metrics = validation_metrics(sources, groups, {"reward": acc, "acc": acc, "pred": preds}, seed=3)
    assert metrics["val-core/s/acc/mean@4"] == pytest.approx((0.75 + 0.0) / 2)
    assert metrics["val-aux/s/acc/std@4"] == pytest.approx((0.4330127018922193 + 0.0) / 2)
    # best@4 of prompt 0 is 1 unless all four resamples drew the wrong sample (1/256); prompt 1 is 0.
    assert metrics["val-core/s/acc/best@4/mean"] == pytest.approx((1 - 1 / 256) / 2, abs=0.01)
    assert metrics["val-aux/s/acc/worst@4/mean"] == pytest.approx((1 - (3 / 4) ** 4) * 0 + (3 / 4) ** 4 / 2,
                                                                    abs=0.02)
    # Majority of 4 resamples for prompt 0: "7" wins unless "8" is drawn at least as often (and first on a tie).
    assert 0.35 < metrics["val-core/s/acc/maj@4/mean"] < 0.5
    assert {key for key in metrics if key.startswith("val-core/")} == {  # verl: mean/best/maj at @N
        "val-core/s/acc/mean@4", "val-core/s/acc/best@4/mean", "val-core/s/acc/best@4/std",
        "val-core/s/acc/maj@4/mean", "val-core/s/acc/maj@4/std"}
    assert "val-aux/s/acc/best@2/mean" in metrics  # k = 2, 4 (verl's sizes)
    again = validation_metrics(sources, groups, {"reward": acc, "acc": acc, "pred": preds}, seed=3)
    assert again == metrics  # seeded


def test_majority_vote_takes_the_first_sample_of_the_winning_prediction():
    # One prompt, 2 samples with different preds: a tie in every resample of 2 that draws both; the first-drawn
    # prediction wins, so maj@2 is the value of whichever sample was drawn first: 0.5 on average.
    metrics = validation_metrics(["s", "s"], [0, 0], {"reward": [1.0, 0.0], "pred": ["a", "b"]}, seed=0)
    assert metrics["val-core/s/reward/maj@2/mean"] == pytest.approx(0.5, abs=0.05)
    assert metrics["val-core/s/reward/best@2/mean"] == pytest.approx(0.75, abs=0.05)
