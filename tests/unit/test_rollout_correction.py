"""Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection against
the rollout/training mismatch, hand-computed on small batches; the settings and their refusals; the batch the step
hands the actor."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.rollout_correction import is_weights, kept_gap, offpolicy_metrics, parse_rs, rejection_mask
from megarl.config import load_config

# Two rows of three tokens; row 1's last token is padding. log r = old - rollout.
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.1, -1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
LOG_R = torch.tensor([[0.5, -1.0, 0.0], [-0.8, 0.1, 0.0]])


def test_token_and_sequence_weights_are_the_truncated_ratios():
    weights, metrics = is_weights(OLD, ROLLOUT, MASK, level="token", threshold=1.5)
    expected = torch.exp(LOG_R).clamp(max=1.5) * MASK
    assert torch.allclose(weights, expected)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # e^0.5 = 1.65 > 1.5
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(2 / 5)  # e^-1, e^-0.8 < 1/1.5
    assert metrics["rollout_is_max"] == pytest.approx(1.5) and metrics["rollout_is_min"] == pytest.approx(math.exp(-1))
    values = expected[MASK.bool()]
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(float(values.sum() ** 2 / (values.pow(2).sum() * 5)))
    weights, _ = is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=2.0)
    row0, row1 = math.exp(-0.5), math.exp(-0.7)  # the products of the rows' ratios
    assert torch.allclose(weights, torch.tensor([[row0] * 3, [row1, row1, 0.0]]))
    normalised, metrics = is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=2.0, batch_normalize=True)
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(2 / (row0 + row1))
    assert float(normalised[:, 0].mean()) == pytest.approx(1.0)


def test_rejection_by_token_and_by_sequence():
    # IcePop's token mask: keep log(π_rollout/π_old) = -log r within [log 0.5, log 2] = ±0.69: drops k1 = 1.0, 0.8.
    keep, metrics = rejection_mask(OLD, ROLLOUT, MASK, parse_rs("token_k1", "0.5_2"))
    assert keep.tolist() == [[1, 0, 1], [0, 1, 0]]
    assert metrics["rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    # Geometric mean ratio: mean k1 of row 0 is (−0.5 + 1 + 0) / 3 = 0.17, of row 1 (0.8 − 0.1) / 2 = 0.35 > log 1.3.
    keep, _ = rejection_mask(OLD, ROLLOUT, MASK, parse_rs("seq_mean_k1", 1.3))
    assert keep.tolist() == [[1, 1, 1], [0, 0, 0]]
    # k3 per token: r - 1 - log r; its sum over row 0 is 0.149 + 0.368 + 0 = 0.52, row 1: 0.249 + 0.005.
    k3 = torch.exp(LOG_R) - 1 - LOG_R
    keep, metrics = rejection_mask(OLD, ROLLOUT, MASK, parse_rs("seq_sum_k3,token_k3", "0.4,0.3"))
    assert keep.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert float(k3[0].sum()) > 0.4 >= float(k3[1, :2].sum())
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    keep, _ = rejection_mask(OLD, ROLLOUT, MASK, parse_rs("seq_max_k2", 0.4))  # ½ (log r)²: 0.5 in row 0, 0.32 in 1
    assert keep.tolist() == [[0, 0, 0], [1, 1, 0]]


def test_the_gap_is_measured_before_and_after():
    metrics = offpolicy_metrics(OLD, ROLLOUT, MASK)
    valid = LOG_R[MASK.bool()]
    assert metrics["kl"] == pytest.approx(float((-valid).mean()))
    assert metrics["k3_kl"] == pytest.approx(float((valid.exp() - 1 - valid).mean()))
    assert metrics["chi2_token"] == pytest.approx(float(valid.exp().pow(2).mean() - 1))
    training = [-(OLD[0].sum() / 3), -(OLD[1, :2].sum() / 2)]
    rollout = [-(ROLLOUT[0].sum() / 3), -(ROLLOUT[1, :2].sum() / 2)]
    assert metrics["log_ppl_diff"] == pytest.approx(float(sum(r - t for r, t in zip(rollout, training)) / 2))
    keep, _ = rejection_mask(OLD, ROLLOUT, MASK, parse_rs("token_k1", "0.5_2"))
    after = kept_gap(OLD, ROLLOUT, MASK * keep, None)
    kept = LOG_R[(MASK * keep).bool()]
    assert after["kept_kl"] == pytest.approx(float((-kept).mean()))
    assert abs(after["kept_kl"]) < abs(metrics["kl"])  # the rejected outlier was most of the gap


def test_thresholds_parse_as_verl_writes_them():
    assert parse_rs("token_k1", 2.0) == [("token_k1", 0.5, 2.0)]
    assert parse_rs("token_k1,seq_sum_k3", "0.8_1.5,3") == [("token_k1", 0.8, 1.5), ("seq_sum_k3", None, 3.0)]
    assert parse_rs(None, None) == []
    with pytest.raises(ValueError, match="k1 options take 'lower_upper'"):
        parse_rs("token_k3", "0.5_2.0")
    with pytest.raises(ValueError, match="lower <= upper"):
        parse_rs("token_k1", "3_2")
    with pytest.raises(ValueError, match="one threshold for all of rollout_rs or one per option"):
        parse_rs("token_k1,token_k2", "2,3,4")


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"],
     "set actor_rollout_ref.rollout.calculate_log_probs=True"),
    (["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.actor.tis_cap=2"],
     "both weigh the loss by the same ratio"),
    (["algorithm.rollout_correction.rollout_rs=token_k1"], "needs algorithm.rollout_correction.rollout_rs_threshold"),
    (["algorithm.rollout_correction.rollout_rs=token_k7", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     r"rollout_rs names \['token_k7'\]"),
    (["algorithm.rollout_correction.rollout_is=tokens"], "rollout_is='tokens' is unknown"),
])
def test_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(Exception, match=message):
        load_config(["recipe=tiny_cpu_grpo", *overrides])


def test_the_step_masks_the_rejected_tokens_and_hands_the_weights_to_the_actor():
    from megarl.controller.correction import correct_rollouts
    from megarl.data.batch import Batch

    cfg = load_config(["recipe=tiny_cpu_grpo", "algorithm.rollout_correction.rollout_is=token",
                       "algorithm.rollout_correction.rollout_rs=token_k1",
                       "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"])
    batch = Batch({"old_log_probs": OLD, "rollout_log_probs": ROLLOUT, "response_mask": MASK.clone()})
    metrics = correct_rollouts(cfg.algorithm.rollout_correction, batch)
    assert batch["response_mask"].tolist() == [[1, 0, 1], [0, 1, 0]]
    assert torch.allclose(batch["rollout_is_weights"], torch.exp(LOG_R).clamp(max=2.0) * batch["response_mask"])
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["rollout_corr/kl"] == pytest.approx(offpolicy_metrics(OLD, ROLLOUT, MASK)["kl"])
    assert "rollout_corr/kept_kl" in metrics and "rollout_corr/rollout_is_mean" in metrics
    assert correct_rollouts(load_config(["recipe=tiny_cpu_grpo"]).algorithm.rollout_correction, batch) == {}
