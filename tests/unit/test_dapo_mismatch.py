"""DAPO dynamic sampling and overlong shaping; rollout/training mismatch metrics and TIS (hand-computed)."""

import math

import pytest
import torch

from megarl.algo import dapo, mismatch
from megarl.algo.losses import policy_loss
from megarl.data import Batch

T = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


def scored_batch(uid, scores) -> Batch:
    """One row per uid entry, its score on the last of 2 tokens."""
    rewards = torch.zeros(len(uid), 2)
    rewards[:, -1] = T(scores)
    return Batch.from_dict({"token_level_rewards": rewards, "token_level_scores": rewards.clone(),
                            "response_mask": torch.ones(len(uid), 2), "uid": list(uid),
                            "acc": [float(s > 0) for s in scores]}, meta={"step": 1})


# ------------------------------------------------------------------------------------------ dynamic sampling


def test_filter_drops_groups_with_equal_rewards():
    # a: 1, 0 -> kept; b: 1, 1 -> dropped; c: one sample -> kept; d: 0.5, 0.5 -> dropped.
    batch = scored_batch(["a", "a", "b", "b", "c", "d", "d"], [1, 0, 1, 1, 0, 0.5, 0.5])
    kept, info = dapo.filter_groups(batch)
    assert list(kept["uid"]) == ["a", "a", "c"]
    assert info == {"num_groups": 4, "num_groups_kept": 2, "num_groups_dropped": 2}
    assert kept.meta == {"step": 1}
    # On a per-row non-tensor metric: acc = [1, 0, 1, 1, 0, 1, 1] -> only a varies; c is single.
    kept, info = dapo.filter_groups(batch, metric="acc")
    assert list(kept["uid"]) == ["a", "a", "c"] and info["num_groups_dropped"] == 2
    with pytest.raises(KeyError, match="filter_groups.metric 'accuracy'"):
        dapo.filter_groups(batch, metric="accuracy")


def test_filter_metrics_of_scored_rollouts_before_the_rewards_exist():
    """At scoring time (the in-reward KL is off under filtering) seq_final_reward is the score; a metric the reward
    function returns comes from each row's extras; an unknown one names what the function returns."""
    batch = scored_batch(["a", "a", "b", "b"], [1, 0, 1, 1]).select("token_level_scores", "response_mask", "uid")
    batch[dapo.REWARD_EXTRA] = [{"acc": 1.0, "format": 1}, {"acc": 1.0, "format": 0}, {"acc": 0.0, "format": 1},
                                {"acc": 1.0, "format": 1}]
    close(dapo.sequence_metric(batch, "seq_final_reward"), [1, 0, 1, 1])
    assert list(dapo.filter_groups(batch, "seq_final_reward")[0]["uid"]) == ["a", "a"]
    assert list(dapo.filter_groups(batch, "acc")[0]["uid"]) == ["b", "b"]
    assert list(dapo.filter_groups(batch, "format")[0]["uid"]) == ["a", "a"]
    with pytest.raises(KeyError, match=r"'pass' is neither a batch field nor returned by the reward function for "
                                       r"every row \(it returns \['acc', 'format'\]\)"):
        dapo.sequence_metric(batch, "pass")


def test_filtering_refuses_the_in_reward_kl():
    from megarl.config.algorithm import AlgorithmConfig, FilterGroupsConfig

    with pytest.raises(ValueError, match="filter_groups.enable=true with algorithm.use_kl_in_reward=true"):
        AlgorithmConfig(use_kl_in_reward=True, filter_groups=FilterGroupsConfig(enable=True))
    with pytest.raises(ValueError, match="max_num_gen_batches must be >= 0"):
        FilterGroupsConfig(max_num_gen_batches=-1)


def test_buffer_refills_until_enough_prompts_then_trims():
    buffer = dapo.DynamicSamplingBuffer(num_prompts=3)
    info = buffer.add(scored_batch(["a", "a", "b", "b"], [1, 0, 1, 1]))  # keeps a
    assert info["num_groups_dropped"] == 1 and not buffer.ready and buffer.num_kept_prompts == 1
    with pytest.raises(ValueError, match="holds 1 of 3 prompts"):
        buffer.take()
    buffer.add(scored_batch(["c", "c", "d", "d", "e", "e"], [0, 1, 2, 0, 1, 3]))  # keeps c, d, e
    assert buffer.ready and buffer.num_kept_prompts == 4
    batch = buffer.take()
    assert list(batch["uid"]) == ["a", "a", "c", "c", "d", "d"]  # the first 3 groups; e is discarded
    assert batch.meta["num_gen_batches"] == 2 and batch.meta["num_groups_dropped"] == 1
    assert buffer.num_kept_prompts == 0 and buffer.num_gen_batches == 0


def test_buffer_bounds_generation_batches():
    buffer = dapo.DynamicSamplingBuffer(num_prompts=2, max_num_gen_batches=1)
    buffer.add(scored_batch(["a", "a"], [1, 1]))
    with pytest.raises(ValueError, match="max_num_gen_batches"):
        buffer.add(scored_batch(["b", "b"], [1, 0]))


def test_overlong_penalty_hand_case():
    # max 10, buffer 4 -> free up to 6 tokens; length 8 -> -(8-6)/4 = -0.5; length 10 -> -1.
    close(dapo.overlong_penalty(T([5, 6, 8, 10]), 10, 4), [0.0, 0.0, -0.5, -1.0])
    close(dapo.overlong_penalty(T([5, 6, 8, 10]), 10, 4, penalty_factor=2.0), [0.0, 0.0, -1.0, -2.0])
    with pytest.raises(ValueError, match="overlong_buffer.len must be in"):
        dapo.overlong_penalty(T([1]), 10, 11)
    with pytest.raises(ValueError, match="penalty_factor must be >= 0"):
        dapo.overlong_penalty(T([1]), 10, 4, penalty_factor=-1.0)


def test_apply_overlong_penalty_on_the_last_valid_token():
    # max 4, buffer 2 -> free up to 2. Row 0: length 4 -> -1 on token 3. Row 1: length 3 -> -0.5 on
    # token 2 (its score 1 there becomes 0.5). Row 2: length 1 -> no penalty. A tool token (mask 0 in
    # the loss mask) still counts: the length is taken from response_mask.
    scores = T([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    response_mask = T([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    shaped, penalty = dapo.apply_overlong_penalty(scores, response_mask, 4, 2)
    close(penalty, [-1.0, -0.5, 0.0])
    close(shaped, [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert scores[0, 3] == 1.0  # input untouched


# ------------------------------------------------------------------------------------------ mismatch


def test_mismatch_metrics_hand_case():
    # Token 0: rollout p 0.5, training p 0.4; token 1: both 0.25; token 2 masked garbage.
    # |d log p| = ln 1.25 = 0.2231436 and 0 -> mean 0.1115718, max 0.2231436
    # |d p| = 0.1 and 0 -> mean 0.05, max 0.1
    # k1 = mean(rollout - old) = 0.1115718
    # k3: x = old - rollout = ln 0.8 -> 0.8 - ln 0.8 - 1 = 0.8 + 0.2231436 - 1 = 0.0231436 -> mean 0.0115718
    rollout = T([[math.log(0.5), math.log(0.25), 0.0]])
    old = T([[math.log(0.4), math.log(0.25), -20.0]])
    metrics = mismatch.mismatch_metrics(rollout, old, T([[1, 1, 0]]))
    expected = {"abs_logp_diff_mean": 0.1115718, "abs_logp_diff_max": 0.2231436, "abs_prob_diff_mean": 0.05,
                "abs_prob_diff_max": 0.1, "k1_kl": 0.1115718, "k3_kl": 0.0115718}
    for key, value in expected.items():
        assert math.isclose(metrics[f"mismatch/{key}"], value, abs_tol=1e-6), key
    assert mismatch.mismatch_metrics(rollout, old, torch.zeros(1, 3))["mismatch/abs_logp_diff_max"] == 0.0


def test_tis_weights_token_and_sequence():
    # Row 0: pi_old/pi_rollout = 0.8, 3, 1 -> token weights 0.8, 2 (cap 2), 1; product 2.4 -> 2 on all.
    # Row 1: ratios 0.5, 1.5, third token masked -> tokens 0.5, 1.5, 0; product 0.75 on valid tokens.
    rollout = torch.zeros(2, 3)
    old = torch.log(T([[0.8, 3.0, 1.0], [0.5, 1.5, 100.0]]))
    mask = T([[1, 1, 1], [1, 1, 0]])
    weights, metrics = mismatch.tis_weights(old, rollout, mask, cap=2.0)
    close(weights, [[0.8, 2.0, 1.0], [0.5, 1.5, 0.0]])
    # mean over 5 valid tokens: (0.8 + 2 + 1 + 0.5 + 1.5)/5 = 1.16; 1 of 5 capped.
    assert math.isclose(metrics["tis/weight_mean"], 1.16, abs_tol=1e-6)
    assert math.isclose(metrics["tis/capped_frac"], 0.2, abs_tol=1e-6)
    weights, _ = mismatch.tis_weights(old, rollout, mask, cap=2.0, level="sequence")
    close(weights, [[2.0, 2.0, 2.0], [0.75, 0.75, 0.0]])
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        mismatch.tis_weights(old, rollout, mask, cap=0.0)
    with pytest.raises(ValueError, match="tis_level 'row'"):
        mismatch.tis_weights(old, rollout, mask, level="row")


def test_tis_weights_feed_the_policy_loss_without_gradient():
    # A = 1, ratio 1 on both tokens -> -1 each; TIS weights 0.8 and 2 -> (-0.8 - 2)/2 = -1.4.
    logp = torch.zeros(1, 2, requires_grad=True)
    weights, _ = mismatch.tis_weights(logp.detach() + torch.log(T([[0.8, 3.0]])), torch.zeros(1, 2),
                                      torch.ones(1, 2))
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), is_weights_BT=weights)
    close(loss, -1.4)
    loss.backward()
    close(logp.grad, [[-0.4, -1.0]])  # d(-w * ratio)/d logp / 2 = -w/2


def test_routing_metrics_are_fractions_of_the_compared_routings():
    """Per-row counts (differing in the pass, differing by the routers' own choice, compared) -> fractions."""
    counts = torch.tensor([[0.0, 3.0, 10.0], [0.0, 1.0, 6.0], [0.0, 0.0, 0.0]])
    assert mismatch.routing_metrics(counts) == {"moe/routing_mismatch": 0.0, "moe/router_natural_mismatch": 0.25,
                                                "moe/routing_decisions": 16.0}
    assert mismatch.routing_metrics(torch.zeros(2, 3)) == {"moe/routing_decisions": 0.0}
