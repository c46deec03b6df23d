"""Policy, value and aggregation losses: hand-computed cases, mask properties, split invariance.

Expected numbers are worked out by hand in the comments.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algo.losses import AGG_MODES, agg_loss, agg_norm, explained_variance, policy_loss, value_loss

T = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------ aggregation

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 3),                 # (1 + 2 + 4) / 3 valid tokens
    ("token-sum", 7.0),                    # 1 + 2 + 4, no normaliser
    ("seq-mean-token-sum", 3.5),           # (3 + 4) / 2 sequences
    ("seq-mean-token-mean", 2.75),         # (1.5 + 4) / 2 sequences
    ("seq-mean-token-sum-norm", 7 / 6),    # (3 + 4) / (2 sequences * 3 max length)
])
def test_agg_loss_hand_cases(mode, expected):
    close(agg_loss(LOSS, MASK, mode), expected)


def test_agg_norm_and_a_given_global_norm():
    assert agg_norm(MASK, "token-mean") == 3.0
    assert agg_norm(MASK, "seq-mean-token-sum") == 2.0
    assert agg_norm(MASK, "seq-mean-token-mean") == 2.0
    assert agg_norm(MASK, "seq-mean-token-sum-norm") == 6.0
    assert agg_norm(MASK, "seq-mean-token-sum-norm", norm_length=4) == 8.0
    # A row without valid tokens is not a sequence: (1 + 2)/1 for seq-mean-token-sum.
    assert agg_norm(T([[1, 1], [0, 0]]), "seq-mean-token-sum") == 1.0
    close(agg_loss(T([[1.0, 2.0], [3.0, 4.0]]), T([[1, 1], [0, 0]]), "seq-mean-token-sum"), 3.0)
    # With the mini-batch's normaliser: 7 / 10 tokens, (1.5 + 4) / 5 sequences.
    close(agg_loss(LOSS, MASK, "token-mean", global_norm=10), 0.7)
    close(agg_loss(LOSS, MASK, "seq-mean-token-mean", global_norm=T(5.0)), 1.1)
    # No valid token anywhere: 0, not NaN.
    close(agg_loss(LOSS, torch.zeros(2, 3), "token-mean"), 0.0)


def test_token_sum_is_the_global_sum_of_token_losses():
    # No normaliser: agg_norm is 0 (additive, so a DP all-reduce keeps it 0) and agg_loss ignores
    # any global_norm it is given: 1 + 2 + 4 = 7 in every case.
    assert agg_norm(MASK, "token-sum") == 0.0
    close(agg_loss(LOSS, MASK, "token-sum", global_norm=agg_norm(MASK, "token-sum")), 7.0)
    close(agg_loss(LOSS, MASK, "token-sum", global_norm=10), 7.0)
    close(agg_loss(LOSS, torch.zeros(2, 3), "token-sum"), 0.0)
    # A [4, 3] batch: valid tokens 1 2 | 4 | 7 8 9 | (none) -> 31. Micro-batches of 1, 2 and 3+1 rows
    # with the whole batch's norm add up to it; so do two DP ranks whose norms are all-reduced.
    loss = torch.arange(1.0, 13.0).reshape(4, 3)
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    norm = agg_norm(mask, "token-sum")
    close(agg_loss(loss, mask, "token-sum", norm), 31.0)
    for pieces in ([[0], [1], [2], [3]], [[0, 1], [2, 3]], [[3, 0, 2], [1]]):
        close(sum(agg_loss(loss[p], mask[p], "token-sum", norm) for p in pieces), 31.0)
    ranks = [[0, 1], [2, 3]]
    dp_norm = sum(agg_norm(mask[r], "token-sum") for r in ranks)
    assert dp_norm == norm == 0.0
    close(sum(agg_loss(loss[r], mask[r], "token-sum", dp_norm) for r in ranks), 31.0)
    # verl scales each rank's local sum by dp_size because DDP/FSDP average over ranks; the averaged
    # value is the same global sum that megarl's summing DP reduction gets from the plain local sums.
    close(sum(agg_loss(loss[r], mask[r], "token-sum") * len(ranks) for r in ranks) / len(ranks), 31.0)
    # value_loss: 0.5 * the summed squared errors; errors 1 and 2 on valid tokens -> 0.5 * 5 = 2.5.
    values = T([[1.0, 2.0, 9.0]])
    vloss, metrics = value_loss(values, values, torch.zeros(1, 3), T([[1, 1, 0]]), cliprange_value=None,
                                loss_agg_mode="token-sum", global_norm=0.0)
    close(vloss, 2.5)
    close(metrics["vf_loss"], 2.5)


def test_token_sum_policy_gradient_is_the_sum_of_per_token_gradients():
    # Unclipped ratio 1 (logp == old): d(-A * ratio)/d logp = -A on each valid token, unscaled.
    logp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    adv = T([[1.0, -2.0, 5.0], [0.5, 3.0, 4.0]], dtype=torch.float64)
    loss, metrics = policy_loss(logp, logp.detach(), adv, MASK, loss_agg_mode="token-sum", global_norm=0.0)
    close(loss, -(1.0 - 2.0 + 0.5))  # = 0.5
    close(metrics["pg_loss"], 0.5)
    loss.backward()
    close(logp.grad, [[-1.0, 2.0, 0.0], [-0.5, 0.0, 0.0]])


def test_agg_errors_name_the_setting():
    with pytest.raises(ValueError, match="loss_agg_mode 'mean'"):
        agg_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="global_norm must be >= 0"):
        agg_loss(LOSS, MASK, "token-mean", global_norm=-1)


# ------------------------------------------------------------------------------------------ policy loss

# One row, four tokens, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3; a fifth token
# is masked and holds garbage.
#   t0: A=+1, ratio 1.5: -1.5 vs clipped -1.28 -> -1.28 (clipped)
#   t1: A=+1, ratio 0.5: -0.5 vs clipped -0.8  -> -0.5
#   t2: A=-1, ratio 5:    5   vs clipped 1.28  -> 5, above the dual bound -A*c = 3 -> 3 (dual clip)
#   t3: A=-2, ratio 0.5:  1   vs clipped 1.6   -> 1.6 (clipped), below the dual bound 6
# token-mean: (-1.28 - 0.5 + 3 + 1.6)/4 = 2.82/4 = 0.705
# pg_clipfrac = 2/4, pg_clipfrac_lower = 1/4,
# ppo_kl = -mean(ln 1.5, ln 0.5, ln 5, ln 0.5) = -(0.4054651 - 0.6931472 + 1.6094379 - 0.6931472)/4 = -0.1571522
# d loss / d logp: only t1 is unclipped: -A*ratio/4 = -0.125.
RATIOS = [1.5, 0.5, 5.0, 0.5, 1.0]
ADVANTAGES = T([[1.0, 1.0, -1.0, -2.0, 50.0]])
PG_MASK = T([[1, 1, 1, 1, 0]])


def ppo_inputs():
    old = T([[-1.0, -2.0, -3.0, -0.5, -1.0]], dtype=torch.float64)
    logp = (old + torch.log(T(RATIOS, dtype=torch.float64))).clone()
    logp[0, 4] = 30.0  # garbage under the mask
    return logp.requires_grad_(), old


def test_ppo_dual_clip_hand_case():
    logp, old = ppo_inputs()
    loss, metrics = policy_loss(logp, old, ADVANTAGES, PG_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                clip_ratio_c=3.0)
    close(loss, 0.705)
    close(metrics["pg_loss"], 0.705)
    close(metrics["pg_clipfrac"], 0.5)
    close(metrics["pg_clipfrac_lower"], 0.25)
    close(metrics["ppo_kl"], -0.1571522)
    loss.backward()
    close(logp.grad, [[0.0, -0.125, 0.0, 0.0, 0.0]])


def test_ppo_without_dual_clip_and_with_symmetric_clip():
    # clip_ratio_c=None: t2 stays 5 -> (-1.28 - 0.5 + 5 + 1.6)/4 = 1.205.
    logp, old = ppo_inputs()
    loss, metrics = policy_loss(logp, old, ADVANTAGES, PG_MASK, clip_ratio_high=0.28, clip_ratio_c=None)
    close(loss, 1.205)
    close(metrics["pg_clipfrac_lower"], 0.0)
    # clip 0.2 both sides: t0 becomes -1.2 -> (-1.2 - 0.5 + 3 + 1.6)/4 = 0.725.
    loss, _ = policy_loss(logp, old, ADVANTAGES, PG_MASK)
    close(loss, 0.725)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(logp, old, ADVANTAGES, PG_MASK, clip_ratio_c=1.0)


def test_entropy_bonus_and_kl_loss_with_plus_sign():
    # Entropy [1, 2, 3, 4] -> 2.5, coeff 0.01 -> -0.025.
    # k1 KL with logp - ref = [0.1, 0.2, -0.1, 0] -> 0.2/4 = 0.05, coef 0.1 -> +0.005.
    # 0.705 - 0.025 + 0.005 = 0.685.
    logp, old = ppo_inputs()
    entropy = T([[1.0, 2.0, 3.0, 4.0, 99.0]], dtype=torch.float64)
    ref = logp.detach() - T([[0.1, 0.2, -0.1, 0.0, 7.0]], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, ADVANTAGES, PG_MASK, clip_ratio_high=0.28, entropy_BT=entropy,
                                entropy_coeff=0.01, ref_logp_BT=ref, kl_loss_coef=0.1, kl_loss_type="k1")
    close(loss, 0.685)
    close(metrics["entropy"], 2.5)
    close(metrics["kl_loss"], 0.05)
    close(metrics["pg_loss"], 0.705)
    # k1's gradient is +coef/4 per valid token: [0.025, -0.125 + 0.025, 0.025, 0.025, 0].
    loss.backward()
    close(logp.grad, [[0.025, -0.1, 0.025, 0.025, 0.0]])


def test_policy_loss_setting_errors():
    logp, old = ppo_inputs()
    with pytest.raises(ValueError, match="entropy_coeff is non-zero"):
        policy_loss(logp, old, ADVANTAGES, PG_MASK, entropy_coeff=0.01)
    with pytest.raises(ValueError, match="kl_loss_coef is non-zero.*use_kl_loss"):
        policy_loss(logp, old, ADVANTAGES, PG_MASK, kl_loss_coef=0.01)
    with pytest.raises(ValueError, match="policy_loss_mode 'ppo'"):
        policy_loss(logp, old, ADVANTAGES, PG_MASK, policy_loss_mode="ppo")


def test_gspo_sequence_ratio_hand_case():
    # Row 0: logp - old = [0.2, 0.0] -> sequence log-ratio 0.1, s = e^0.1 = 1.1051709; A = +1;
    #   clip 0.05 -> -1.1051709 vs -1.05 -> -1.05 (clipped) on both tokens; no gradient.
    # Row 1: logp - old = [0.01, -0.01] -> s = 1; A = -1 -> 1 vs 1 -> 1 on both tokens.
    # seq-mean-token-mean: ((-1.05 - 1.05)/2 + (1 + 1)/2)/2 = (-1.05 + 1)/2 = -0.025.
    # Gradient of row 1: d(-A * s)/d logp_t = s = 1 (GSPO-token), times 1/2 tokens * 1/2 sequences = 0.25.
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = T([[0.2, 0.0], [0.01, -0.01]], dtype=torch.float64, requires_grad=True)
    advantages = T([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, advantages, torch.ones(2, 2), policy_loss_mode="gspo",
                                clip_ratio_low=0.05, clip_ratio_high=0.05, loss_agg_mode="seq-mean-token-mean")
    close(loss, -0.025)
    close(metrics["pg_clipfrac"], 0.5)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [0.25, 0.25]])


def test_importance_weights_scale_the_surrogate():
    # Tokens with ratio 1 and A = 1 -> -1 each; weights 0.5 and 2 -> (-0.5 - 2)/2 = -1.25.
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), is_weights_BT=T([[0.5, 2.0]]))
    close(loss, -1.25)


# ------------------------------------------------------------------------------------------ value loss


def test_value_loss_hand_case():
    # cliprange 0.2; t3 masked garbage.
    #   t0: V=1, old=0.5, R=2: (1-2)^2 = 1 vs clipped V 0.7: (0.7-2)^2 = 1.69 -> 1.69 (clipped)
    #   t1: V=2, old=2, R=3: 1 vs 1 -> 1
    #   t2: V=0, old=0.5, R=1: 1 vs clipped V 0.3: 0.49 -> 1
    # 0.5 * (1.69 + 1 + 1)/3 = 0.615; vf_clipfrac 1/3; vpred_mean 1.
    # d/dV: t0 clipped -> 0; t1: (2-3)/3 = -1/3; t2: (0-1)/3 = -1/3.
    values = T([[1.0, 2.0, 0.0, 40.0]], dtype=torch.float64, requires_grad=True)
    old = T([[0.5, 2.0, 0.5, -3.0]], dtype=torch.float64)
    returns = T([[2.0, 3.0, 1.0, 9.0]], dtype=torch.float64)
    mask = T([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=0.2)
    close(loss, 0.615)
    close(metrics["vf_clipfrac"], 1 / 3)
    close(metrics["vpred_mean"], 1.0)
    loss.backward()
    close(values.grad, [[0.0, -1 / 3, -1 / 3, 0.0]])
    # Without clipping: 0.5 * (1 + 1 + 1)/3 = 0.5.
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=None)
    close(loss, 0.5)
    close(metrics["vf_clipfrac"], 0.0)


def test_explained_variance_hand_case():
    # returns [1, 2, 3, 4], values [1, 2, 3, 3]: residual [0, 0, 0, 1] has population variance
    # 0.1875; returns have 1.25 -> 1 - 0.1875/1.25 = 0.85. The masked fifth entry is ignored.
    ev = explained_variance(T([[1.0, 2.0, 3.0, 3.0, 0.0]]), T([[1.0, 2.0, 3.0, 4.0, 100.0]]), T([[1, 1, 1, 1, 0]]))
    close(ev, 0.85)


# ------------------------------------------------------------------------------------------ mask property


@st.composite
def loss_case(draw):
    num_rows, num_tokens = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    n = num_rows * num_tokens
    mask = T(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))).reshape(num_rows, num_tokens)
    return mask, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from(AGG_MODES)), draw(st.sampled_from(
        ["vanilla", "gspo"]))


@settings(max_examples=60, deadline=None)
@given(loss_case())
def test_values_under_a_zero_mask_change_no_loss_and_no_gradient(case):
    mask, seed, mode, policy_mode = case
    gen = torch.Generator().manual_seed(seed)
    shape = mask.shape

    def draw(scale=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    inputs = {"logp": draw(0.3) - 1, "old": draw(0.3) - 1, "adv": draw(), "entropy": draw().abs(),
              "ref": draw(0.3) - 1, "values": draw(), "old_values": draw(), "returns": draw()}
    garbage = {k: torch.where(mask.bool(), v, draw(30.0)) for k, v in inputs.items()}

    def run(x):
        logp = x["logp"].clone().requires_grad_()
        values = x["values"].clone().requires_grad_()
        loss, _ = policy_loss(logp, x["old"], x["adv"], mask, loss_agg_mode=mode, policy_loss_mode=policy_mode,
                              entropy_BT=x["entropy"], entropy_coeff=0.01, ref_logp_BT=x["ref"], kl_loss_coef=0.1)
        vloss, _ = value_loss(values, x["old_values"], x["returns"], mask, loss_agg_mode=mode)
        (loss + vloss).backward()
        return loss.detach(), vloss.detach(), logp.grad, values.grad

    changed = run(garbage)
    for expected, actual in zip(run(inputs), changed, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-9, rtol=0)
    _, _, logp_grad, values_grad = changed
    assert bool((logp_grad[~mask.bool()] == 0).all()) and bool((values_grad[~mask.bool()] == 0).all())


# ------------------------------------------------------------------------------------------ invariance

B, R = 8, 6


def invariance_inputs():
    gen = torch.Generator().manual_seed(0)
    lengths = T([6, 1, 4, 0, 2, 6, 5, 3])  # row 3 has no valid token (e.g. a padding row)
    mask = (torch.arange(R) < lengths.unsqueeze(-1)).long()
    mask[0, 2] = mask[5, 1] = mask[5, 2] = 0  # tool-output tokens
    return {
        "logp": (torch.randn(B, R, generator=gen, dtype=torch.float64) * 0.2 - 1.0),
        "old": torch.randn(B, R, generator=gen, dtype=torch.float64) * 0.2 - 1.0,
        "ref": torch.randn(B, R, generator=gen, dtype=torch.float64) * 0.2 - 1.0,
        "adv": torch.randn(B, R, generator=gen, dtype=torch.float64),
        "entropy": torch.rand(B, R, generator=gen, dtype=torch.float64),
        "values": torch.randn(B, R, generator=gen, dtype=torch.float64),
        "old_values": torch.randn(B, R, generator=gen, dtype=torch.float64),
        "returns": torch.randn(B, R, generator=gen, dtype=torch.float64),
        "mask": mask,
    }


def pieces_gradient(x, mode, pieces, global_norm):
    """Sum of the gradients (w.r.t. logp and values) of the losses of row groups ``pieces``."""
    logp = x["logp"].clone().requires_grad_()
    values = x["values"].clone().requires_grad_()
    for rows in pieces:
        rows = torch.as_tensor(rows, dtype=torch.long)
        loss, _ = policy_loss(logp[rows], x["old"][rows], x["adv"][rows], x["mask"][rows], loss_agg_mode=mode,
                              global_norm=global_norm, entropy_BT=x["entropy"][rows], entropy_coeff=0.01,
                              ref_logp_BT=x["ref"][rows], kl_loss_coef=0.1, clip_ratio_high=0.28)
        vloss, _ = value_loss(values[rows], x["old_values"][rows], x["returns"][rows], x["mask"][rows],
                              cliprange_value=0.2, loss_agg_mode=mode, global_norm=global_norm)
        (loss + vloss).backward()
    return torch.cat([logp.grad, values.grad])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradient_is_invariant_to_micro_batches_and_dp_ranks(mode):
    x = invariance_inputs()
    norm = agg_norm(x["mask"], mode)
    whole = pieces_gradient(x, mode, [range(B)], norm)
    assert whole.abs().sum() > 0
    for num_micro in (1, 2, 4):
        micro = [range(i * B // num_micro, (i + 1) * B // num_micro) for i in range(num_micro)]
        torch.testing.assert_close(pieces_gradient(x, mode, micro, norm), whole, atol=1e-6, rtol=0)
    # Two DP ranks with two micro-batches each: each rank only sees its own rows, and the global
    # normaliser is the all-reduced (summed) local one; DP reduction sums the ranks' gradients.
    rank_rows = [list(range(0, 4)), list(range(4, 8))]
    dp_norm = sum(agg_norm(x["mask"][rows], mode) for rows in rank_rows)
    assert dp_norm == norm
    dp_grad = sum(pieces_gradient(x, mode, [rows[:2], rows[2:]], dp_norm) for rows in rank_rows)
    torch.testing.assert_close(dp_grad, whole, atol=1e-6, rtol=0)
    # Token-budget packing: uneven micro-batches of shuffled rows.
    packed = [[6, 0], [3], [7, 1, 4], [5, 2]]
    torch.testing.assert_close(pieces_gradient(x, mode, packed, norm), whole, atol=1e-6, rtol=0)


def test_local_normalisation_would_break_invariance():
    # Guard that the invariance test can fail: normalising each micro-batch by its own token count
    # (global_norm=None) and averaging over micro-batches gives a different gradient.
    x = invariance_inputs()
    whole = pieces_gradient(x, "token-mean", [range(B)], agg_norm(x["mask"], "token-mean"))
    halves = pieces_gradient(x, "token-mean", [range(0, 4), range(4, 8)], None) / 2
    assert (halves - whole).abs().max() > 1e-3


def test_seq_mean_token_sum_norm_uses_the_configured_length():
    # Micro-batches padded to different lengths agree when norm_length is the configured maximum:
    # (1 + 2) / (1 sequence * 4) = 0.75 whether the row is padded to 2 or 4 columns.
    norm_short = agg_norm(T([[1, 1]]), "seq-mean-token-sum-norm", norm_length=4)
    close(agg_loss(T([[1.0, 2.0]]), T([[1, 1]]), "seq-mean-token-sum-norm", norm_short), 0.75)
    close(agg_loss(T([[1.0, 2.0, 0.0, 0.0]]), T([[1, 1, 0, 0]]), "seq-mean-token-sum-norm"), 0.75)
    assert math.isclose(norm_short, 4.0)
