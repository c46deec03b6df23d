"""Advantage estimators against hand-computed cases, plus hypothesis properties.

Expected numbers are worked out by hand in the comments; none is recomputed with the code
under test.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algo import advantages as adv
from megarl.algo.groups import group_index, group_mean_std
from megarl.data import Batch

T = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------ GAE


def test_gae_hand_case_one_row():
    # gamma=0.9, lam=0.8, V=[0.5, 0.4, 0.2], r=[0, 0, 1]:
    # t2: delta = 1 - 0.2 = 0.8;               A2 = 0.8
    # t1: delta = 0.9*0.2 - 0.4 = -0.22;       A1 = -0.22 + 0.72*0.8 = 0.356
    # t0: delta = 0.9*0.4 - 0.5 = -0.14;       A0 = -0.14 + 0.72*0.356 = 0.11632
    # returns = A + V = [0.61632, 0.756, 1.0]
    a, r = adv.gae_advantage(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.2]]), T([[1, 1, 1]]), gamma=0.9, lam=0.8,
                             whiten=False)
    close(a, [[0.11632, 0.356, 0.8]])
    close(r, [[0.61632, 0.756, 1.0]])


def test_gae_seeds_worked_example():
    # A worked example: gamma=1, lam=0.95; delta5 = 0.999 - 0.95 = 0.049, A5 = 0.049;
    # delta4 = -0.003 + 0.95 - 0.92 = 0.027, A4 = 0.027 + 0.95*0.049 = 0.07355.
    values = T([[0.82, 0.85, 0.88, 0.90, 0.92, 0.95]], dtype=torch.float64)
    rewards = T([[-0.003, -0.002, -0.003, -0.002, -0.003, 0.999]], dtype=torch.float64)
    a, _ = adv.gae_advantage(rewards, values, torch.ones(1, 6), gamma=1.0, lam=0.95, whiten=False)
    close(a[0, 4:], [0.07355, 0.049])


def test_gae_skips_masked_tool_tokens():
    # mask [1, 0, 1] (token 1 is tool output): its value 9.0 is ignored and its reward 0.3 is
    # credited to token 0. gamma=0.9, lam=0.8, V=[0.5, 9, 0.2], r=[0, 0.3, 1]:
    # t2: A2 = 1 - 0.2 = 0.8
    # t0: delta = (0 + 0.3) + 0.9*0.2 - 0.5 = -0.02; A0 = -0.02 + 0.72*0.8 = 0.556
    # returns = [0.556 + 0.5, 0, 0.8 + 0.2] = [1.056, 0, 1.0]
    a, r = adv.gae_advantage(T([[0.0, 0.3, 1.0]]), T([[0.5, 9.0, 0.2]]), T([[1, 0, 1]]), gamma=0.9, lam=0.8,
                             whiten=False)
    close(a, [[0.556, 0.0, 0.8]])
    close(r, [[1.056, 0.0, 1.0]])


def test_gae_whitening_over_valid_tokens():
    # gamma=lam=1, V=0, r=[[0, 1], [0, 3 (masked pad)]] with masks [[1,1],[1,0]]:
    # raw A = reward-to-go = [[1, 1], [3, .]] (the pad reward is carried to token 0).
    # Valid values 1, 1, 3: mean 5/3, unbiased var ((2/3)^2*2 + (4/3)^2)/2 = (8/9 + 16/9)/2 = 4/3,
    # std = 1.1547005; whitened = [-0.5773503, -0.5773503, 1.1547005].
    a, r = adv.gae_advantage(T([[0.0, 1.0], [0.0, 3.0]]), torch.zeros(2, 2), T([[1, 1], [1, 0]]))
    close(a, [[-0.5773503, -0.5773503], [1.1547005, 0.0]])
    close(r, [[1.0, 1.0], [3.0, 0.0]])


# ------------------------------------------------------------------------------------------ GRPO family

# Rows (uid, reward row, mask) used by several outcome estimators. Scores (row sums):
# a: rows 0, 2, 5 -> 1, 0, 0.5;  b: rows 1, 4 -> 2, 0;  c: row 3 -> 3 (a group of one).
UID = ["a", "b", "a", "c", "b", "a"]
REWARDS = T([[0, 0, 1], [0, 2, 0], [0, 0, 0], [0, 0, 3], [0, 0, 0], [0.5, 0, 0]], dtype=torch.float64)
MASK = T([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]])


def per_row(values):
    """Expected [B, T] advantages: one value per row on its valid tokens."""
    return torch.as_tensor(values, dtype=torch.float64).unsqueeze(-1) * MASK


def test_grpo_hand_case():
    # a: mean 0.5, deviations .5, -.5, 0 -> unbiased var 0.5/2 = 0.25, std 0.5
    #    -> 0.5/(0.5 + 1e-6) = 0.999998, -0.999998, 0
    # b: mean 1, deviations 1, -1 -> var 2/1 = 2, std 1.41421356 -> 1/(1.41421356 + 1e-6) = 0.70710628
    # c: one sample -> mean 0, std 1 -> 3/(1 + 1e-6) = 2.999997
    a, r = adv.grpo_outcome_advantage(REWARDS, MASK, UID)
    close(a, per_row([0.999998, 0.70710628, -0.999998, 2.999997, -0.70710628, 0.0]))
    assert torch.equal(a, r)


def test_dr_grpo_skips_the_std():
    # norm_adv_by_std_in_grpo=False: score - group mean only.
    a, _ = adv.grpo_outcome_advantage(REWARDS, MASK, UID, norm_adv_by_std_in_grpo=False)
    close(a, per_row([0.5, 1.0, -0.5, 3.0, -1.0, 0.0]))


def test_grpo_accepts_integer_uid_tensor():
    a, _ = adv.grpo_outcome_advantage(REWARDS, MASK, T([7, 8, 7, 9, 8, 7]), norm_adv_by_std_in_grpo=False)
    close(a, per_row([0.5, 1.0, -0.5, 3.0, -1.0, 0.0]))


def test_grpo_passk_hand_case():
    # Without the singleton c. a: best is row 0 (1), second best 0.5 -> 0.5 / (std 0.5 + 1e-6) = 0.999998.
    # b: best is row 1 (2), second 0 -> 2 / (1.41421356 + 1e-6) = 1.41421256. Others get 0.
    keep = [0, 1, 2, 4, 5]
    a, _ = adv.grpo_passk_advantage(REWARDS[keep], MASK[keep], [UID[i] for i in keep])
    close(a, T([0.999998, 1.41421256, 0, 0, 0], dtype=torch.float64).unsqueeze(-1) * MASK[keep])
    # No std: 0.5 and 2. A tie for the best (1, 1) gives the first row 1 - 1 = 0.
    a, _ = adv.grpo_passk_advantage(REWARDS[keep], MASK[keep], [UID[i] for i in keep],
                                    norm_adv_by_std_in_grpo=False)
    close(a, T([0.5, 2.0, 0, 0, 0], dtype=torch.float64).unsqueeze(-1) * MASK[keep])
    tie, _ = adv.grpo_passk_advantage(T([[1.0], [1.0]]), T([[1], [1]]), ["x", "x"])
    close(tie, [[0.0], [0.0]])
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        adv.grpo_passk_advantage(REWARDS, MASK, UID)


def test_rloo_hand_case():
    # a: 1 - (0 + 0.5)/2 = 0.75;  0 - (1 + 0.5)/2 = -0.75;  0.5 - (1 + 0)/2 = 0
    # b: 2 - 0 = 2;  0 - 2 = -2.   c (one sample): keeps its score 3.
    a, _ = adv.rloo_advantage(REWARDS, MASK, UID)
    close(a, per_row([0.75, 2.0, -0.75, 3.0, -2.0, 0.0]))


def test_opo_hand_case():
    # Group x: lengths 1 and 3, scores 1 and 0 -> baseline (1*1 + 3*0)/(1 + 3) = 0.25 -> 0.75, -0.25.
    # Group y: one sample -> baseline 0 -> 2.
    rewards = T([[1.0, 0, 0], [0, 0, 0], [0, 2.0, 0]])
    mask = T([[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    a, _ = adv.opo_advantage(rewards, mask, ["x", "x", "y"])
    close(a, [[0.75, 0, 0], [-0.25, -0.25, -0.25], [2.0, 2.0, 0]])


def test_reinforce_plus_plus_hand_case():
    # gamma=0.5, r=[0, 0.5, 1]: returns t2 = 1, t1 = 0.5 + 0.5*1 = 1, t0 = 0 + 0.5*1 = 0.5.
    # Whitened over 3 tokens: mean 2.5/3 = 0.8333333, deviations -1/3, 1/6, 1/6,
    # unbiased var (1/9 + 1/36 + 1/36)/2 = 1/12, std 0.2886751 -> -1.1547005, 0.5773503, 0.5773503.
    a, r = adv.reinforce_plus_plus_advantage(T([[0.0, 0.5, 1.0]]), T([[1, 1, 1]]), gamma=0.5)
    close(r, [[0.5, 1.0, 1.0]])
    close(a, [[-1.1547005, 0.5773503, 0.5773503]], atol=1e-5)
    # A tool token in the middle takes no time step: t0 = 0 + 0.5 (carried) + 0.5*1 = 1.
    _, r = adv.reinforce_plus_plus_advantage(T([[0.0, 0.5, 1.0]]), T([[1, 0, 1]]), gamma=0.5)
    close(r, [[1.0, 0.0, 1.0]])


def test_reinforce_plus_plus_baseline_hand_case():
    # uid [a, a, b], scores [1, 0, 2]; a: mean 0.5 -> 0.5, -0.5; b (one sample): mean 0 -> 2.
    # Token values on the valid tokens: 0.5, 0.5 | -0.5 | 2, 2. Mean 4.5/5 = 0.9; deviations
    # -0.4, -0.4, -1.4, 1.1, 1.1; squares sum 4.7; unbiased var 4.7/4 = 1.175, std 1.0839742.
    # Whitened: -0.3690125, -1.2915437, 1.0147844.
    rewards = T([[0, 1.0], [0, 0], [2.0, 0]])
    mask = T([[1, 1], [1, 0], [1, 1]])
    a, _ = adv.reinforce_plus_plus_baseline_advantage(rewards, mask, ["a", "a", "b"])
    close(a, [[-0.3690125, -0.3690125], [-1.2915437, 0.0], [1.0147844, 1.0147844]], atol=1e-5)


def test_remax_hand_case():
    # Reward-to-go minus the greedy baseline: row 0: 1 - 0.25 = 0.75 everywhere;
    # row 1: reward 1 on token 1, baseline 1 -> 0 on both valid tokens; returns [1, 1, 0].
    a, r = adv.remax_advantage(T([[0, 0, 1.0], [0, 1.0, 0]]), T([[1, 1, 1], [1, 1, 0]]), T([0.25, 1.0]))
    close(a, [[0.75, 0.75, 0.75], [0.0, 0.0, 0.0]])
    close(r, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match="one value per row"):
        adv.remax_advantage(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))


# ------------------------------------------------------------------------------------------ compute()


def outcome_batch() -> Batch:
    return Batch.from_dict({"token_level_rewards": REWARDS, "response_mask": MASK, "uid": UID,
                            "values": torch.zeros(6, 3, dtype=torch.float64),
                            "reward_baselines": torch.zeros(6, dtype=torch.float64)})


def test_compute_stores_advantages_and_returns():
    batch = adv.compute("grpo", outcome_batch(), norm_adv_by_std_in_grpo=False, gamma=0.99)
    close(batch["advantages"], per_row([0.5, 1.0, -0.5, 3.0, -1.0, 0.0]))
    assert torch.equal(batch["returns"], batch["advantages"])
    for name in adv.ESTIMATORS:
        if name != "grpo_passk":  # needs two samples per uid
            batch = adv.compute(name, outcome_batch())
            assert batch["advantages"].shape == (6, 3) and bool((batch["advantages"][MASK == 0] == 0).all())
    assert adv.uses_critic("gae") and not adv.uses_critic("grpo")


def test_compute_honours_the_one_loss_mask():
    """``response_mask`` is the tokens that train; a multi-turn rollout's is 0 on tool output (token 1 of row 0)."""
    batch = outcome_batch()
    batch["response_mask"] = MASK.clone()
    batch["response_mask"][0, 1] = 0
    adv.compute("grpo", batch, norm_adv_by_std_in_grpo=False)
    close(batch["advantages"][0], [0.5, 0.0, 0.5])
    batch.pop("response_mask")
    with pytest.raises(KeyError, match="need the batch field 'response_mask'"):
        adv.compute("grpo", batch)
    with pytest.raises(ValueError, match=r"unknown advantage settings \['multi_turn'\]"):
        adv.compute("grpo", outcome_batch(), multi_turn=True)


def test_compute_errors_name_the_setting_or_field():
    with pytest.raises(ValueError, match="algorithm.adv_estimator 'ppo'.*'gae'"):
        adv.compute("ppo", outcome_batch())
    with pytest.raises(ValueError, match="unknown advantage settings \\['lamda'\\]"):
        adv.compute("gae", outcome_batch(), lamda=0.9)
    batch = outcome_batch()
    batch.pop("values")
    with pytest.raises(KeyError, match="'gae' needs the batch field 'values'"):
        adv.compute("gae", batch)
    with pytest.raises(ValueError, match="`uid` has 2 entries but the batch has 6 rows"):
        adv.grpo_outcome_advantage(REWARDS, MASK, ["a", "b"])


def test_group_stats_vectorised_on_many_rows():
    # 20k rows in 5k groups of 4 with scores 0, 1, 2, 3 per group: mean 1.5, std sqrt(5/3) = 1.2909944.
    uid = np.repeat(np.arange(5000), 4)
    scores = torch.arange(4, dtype=torch.float64).repeat(5000)
    group_B, num_groups = group_index(uid.astype(str).astype(object))
    mean_G, std_G = group_mean_std(scores, group_B, num_groups)
    assert num_groups == 5000
    close(mean_G, torch.full((5000,), 1.5))
    close(std_G, torch.full((5000,), 1.2909944))


# ------------------------------------------------------------------------------------------ properties


@st.composite
def grouped_scores(draw):
    sizes = draw(st.lists(st.integers(min_value=2, max_value=6), min_size=1, max_size=6))
    uid = [g for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(list(range(len(uid)))))
    scores = draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=len(uid), max_size=len(uid)))
    return [uid[i] for i in order], scores


@settings(max_examples=40, deadline=None)
@given(grouped_scores(), st.booleans())
def test_grpo_advantages_have_zero_mean_per_group(case, norm_by_std):
    uid, scores = case
    rewards = torch.zeros(len(uid), 4, dtype=torch.float64)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float64)
    a, _ = adv.grpo_outcome_advantage(rewards, torch.ones(len(uid), 4), uid, norm_adv_by_std_in_grpo=norm_by_std)
    for group in set(uid):
        rows = [i for i, u in enumerate(uid) if u == group]
        assert abs(float(a[rows, 0].mean())) < 1e-6


@st.composite
def masked_trajectories(draw):
    num_rows = draw(st.integers(1, 4))
    num_tokens = draw(st.integers(1, 7))
    floats = st.floats(-3, 3, allow_nan=False)
    rewards = draw(st.lists(floats, min_size=num_rows * num_tokens, max_size=num_rows * num_tokens))
    values = draw(st.lists(floats, min_size=num_rows * num_tokens, max_size=num_rows * num_tokens))
    mask = draw(st.lists(st.integers(0, 1), min_size=num_rows * num_tokens, max_size=num_rows * num_tokens))
    shape = (num_rows, num_tokens)
    return (torch.tensor(rewards, dtype=torch.float64).reshape(shape),
            torch.tensor(values, dtype=torch.float64).reshape(shape), torch.tensor(mask).reshape(shape))


@settings(max_examples=50, deadline=None)
@given(masked_trajectories())
def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value(case):
    rewards, values, mask = case
    a, r = adv.gae_advantage(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    valid = mask.bool()
    torch.testing.assert_close(a[valid], (reward_to_go - values)[valid], atol=1e-9, rtol=0)
    torch.testing.assert_close(r[valid], reward_to_go[valid], atol=1e-9, rtol=0)
    assert bool((a[~valid] == 0).all()) and bool((r[~valid] == 0).all())


@settings(max_examples=50, deadline=None)
@given(masked_trajectories(), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_values_under_a_zero_mask_change_nothing(case, gamma, lam, seed):
    rewards, values, mask = case
    noise = torch.randn(values.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 100
    changed = torch.where(mask.bool(), values, noise)
    for whiten in (False, True):
        expected = adv.gae_advantage(rewards, values, mask, gamma=gamma, lam=lam, whiten=whiten)
        actual = adv.gae_advantage(rewards, changed, mask, gamma=gamma, lam=lam, whiten=whiten)
        torch.testing.assert_close(actual, expected, atol=1e-9, rtol=0)
    # Outcome estimators: nothing but the mask's own zeros changes when the mask gains holes.
    uid = list(range(len(rewards)))
    a, _ = adv.grpo_outcome_advantage(rewards, mask, uid)
    full, _ = adv.grpo_outcome_advantage(rewards, torch.ones_like(mask), uid)
    torch.testing.assert_close(a, torch.where(mask.bool(), full, torch.zeros_like(full)))
