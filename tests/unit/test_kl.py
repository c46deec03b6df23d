"""KL estimators, fixed/adaptive KL controllers and the KL penalty in the reward (hand-computed)."""

import math

import pytest
import torch

from megarl.algo import kl
from megarl.algo.losses import kl_penalty
from megarl.data import Batch

T = torch.tensor
LN2 = math.log(2.0)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


def test_kl_estimators_hand_cases():
    # d = logp - ref = [0.2, -0.5, ln 2, -ln 2, 0]
    d = T([0.2, -0.5, LN2, -LN2, 0.0], dtype=torch.float64)
    ref = torch.full_like(d, -1.0)
    logp = ref + d
    close(kl_penalty(logp, ref, "kl"), [0.2, -0.5, LN2, -LN2, 0.0])
    close(kl_penalty(logp, ref, "k1"), [0.2, -0.5, LN2, -LN2, 0.0])
    close(kl_penalty(logp, ref, "abs"), [0.2, 0.5, LN2, LN2, 0.0])
    # 0.5 d^2: 0.02, 0.125, 0.5*0.480453 = 0.2402265
    close(kl_penalty(logp, ref, "mse"), [0.02, 0.125, 0.2402265, 0.2402265, 0.0])
    close(kl_penalty(logp, ref, "k2"), [0.02, 0.125, 0.2402265, 0.2402265, 0.0])
    # k3 = exp(-d) + d - 1: d=0.2: 0.8187308 - 0.8 = 0.0187308; d=-0.5: 1.6487213 - 1.5 = 0.1487213;
    # d=ln2: 0.5 + 0.6931472 - 1 = 0.1931472; d=-ln2: 2 - 0.6931472 - 1 = 0.3068528; d=0: 0.
    expected_k3 = [0.0187308, 0.1487213, 0.1931472, 0.3068528, 0.0]
    close(kl_penalty(logp, ref, "low_var_kl"), expected_k3)
    close(kl_penalty(logp, ref, "k3"), expected_k3)


def test_k3_is_clamped():
    # d = -30: -d clamped to 20 -> e^20 - 21 is huge -> clamped to 10.
    # d = +30: -d clamped to -20 -> e^-20 + 20 - 1 = 19.000000002 -> clamped to 10.
    close(kl_penalty(T([-30.0, 30.0]), T([0.0, 0.0]), "k3"), [10.0, 10.0])


def test_unknown_or_full_kind_is_refused():
    with pytest.raises(ValueError, match="'full' needs the full vocabulary"):
        kl_penalty(T([0.0]), T([0.0]), "full")
    with pytest.raises(ValueError, match="unknown KL kind 'k4'.*kl_loss_type"):
        kl_penalty(T([0.0]), T([0.0]), "k4")


STRAIGHT_THROUGH = ["kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]


def test_every_kind_has_a_straight_through_variant():
    assert set(STRAIGHT_THROUGH) <= set(kl.KL_KINDS)
    assert set(kl.KL_KINDS) == set(kl.BASE_KL_KINDS) | {f"{kind}+" for kind in kl.BASE_KL_KINDS}


@pytest.mark.parametrize("kind", STRAIGHT_THROUGH)
def test_straight_through_kind_has_the_base_value_and_the_k2_gradient(kind):
    gen = torch.Generator().manual_seed(len(kind))
    ref = torch.randn(64, generator=gen, dtype=torch.float64) * 0.5 - 1.0
    logp0 = ref + torch.randn(64, generator=gen, dtype=torch.float64) * 0.7
    logp, ref_g = logp0.clone().requires_grad_(), ref.clone().requires_grad_()
    value = kl_penalty(logp, ref_g, kind)
    base = kl_penalty(logp0, ref, kind[:-1])
    assert torch.equal(value.detach(), base)  # exactly the base kind's value
    value.sum().backward()
    close(logp.grad, logp0 - ref, atol=1e-12)   # d/dlogp of 0.5 * d^2
    close(ref_g.grad, ref - logp0, atol=1e-12)
    # Weighted sum: the gradient is weight * d per token, as for k2 itself.
    weights = torch.rand(64, generator=gen, dtype=torch.float64)
    logp_k2 = logp0.clone().requires_grad_()
    (kl_penalty(logp_k2, ref, "k2") * weights).sum().backward()
    logp_st = logp0.clone().requires_grad_()
    (kl_penalty(logp_st, ref, kind) * weights).sum().backward()
    close(logp_st.grad, logp_k2.grad, atol=1e-12)


def test_straight_through_hand_cases():
    # d = [0.2, -0.5, -30]: k1+ value d, k3+ value [0.0187308, 0.1487213, 10 (clamped)], abs+ |d|;
    # the gradient is d in every case, also where k3's value is clamped (as in verl).
    ref = T([-1.0, -1.0, 0.0], dtype=torch.float64)
    d = T([0.2, -0.5, -30.0], dtype=torch.float64)
    for kind, expected in [("k1+", [0.2, -0.5, -30.0]), ("k3+", [0.0187308, 0.1487213, 10.0]),
                           ("low_var_kl+", [0.0187308, 0.1487213, 10.0]), ("abs+", [0.2, 0.5, 30.0]),
                           ("k2+", [0.02, 0.125, 450.0])]:
        logp = (ref + d).requires_grad_()
        value = kl_penalty(logp, ref, kind)
        close(value.detach(), expected)
        value.sum().backward()
        close(logp.grad, d, atol=1e-12)
    # Plain k3 has a different gradient: 1 - exp(-d) = 0.1812692 at d = 0.2.
    logp = (ref[:1] + d[:1]).requires_grad_()
    kl_penalty(logp, ref[:1], "k3").sum().backward()
    close(logp.grad, [0.1812692])


def test_straight_through_kind_in_the_reward_penalty_and_the_kl_loss():
    # In the reward the value is all that counts: k3+ gives k3's rewards and metrics.
    batch_plain, batch_st = kl_batch(), kl_batch()
    plain = kl.apply_kl_penalty(batch_plain, kl.build_kl_controller("fixed", kl_coef=0.1), kind="k3")
    st = kl.apply_kl_penalty(batch_st, kl.build_kl_controller("fixed", kl_coef=0.1), kind="k3+")
    assert plain == st
    assert torch.equal(batch_plain["token_level_rewards"], batch_st["token_level_rewards"])
    # As the actor's KL loss: same loss value as k3, gradient of the KL term = coef * d / tokens.
    from megarl.algo.losses import policy_loss

    ref = T([[-1.0, -1.2, -0.4]], dtype=torch.float64)
    d = T([[0.2, -0.5, 0.3]], dtype=torch.float64)
    mask = T([[1, 1, 0]])
    zeros = torch.zeros(1, 3, dtype=torch.float64)
    losses = {}
    for kind in ("k3", "k3+"):
        logp = (ref + d).requires_grad_()
        loss, _ = policy_loss(logp, logp.detach(), zeros, mask, ref_logp_BT=ref, kl_loss_coef=0.1,
                              kl_loss_type=kind)
        loss.backward()
        losses[kind] = (loss.detach(), logp.grad)
    close(losses["k3+"][0], losses["k3"][0])
    close(losses["k3+"][0], 0.1 * (0.0187308 + 0.1487213) / 2)
    close(losses["k3+"][1], [[0.1 * 0.2 / 2, 0.1 * -0.5 / 2, 0.0]], atol=1e-12)


def test_unknown_straight_through_kind_is_refused():
    with pytest.raises(ValueError, match=r"unknown KL kind 'k4\+'.*kl_loss_type"):
        kl_penalty(T([0.0]), T([0.0]), "k4+")
    with pytest.raises(ValueError, match=r"unknown KL kind 'full\+'"):
        kl_penalty(T([0.0]), T([0.0]), "full+")
    with pytest.raises(ValueError, match=r"unknown KL kind 'k3\+\+'"):
        kl_penalty(T([0.0]), T([0.0]), "k3++")


def test_fixed_controller():
    ctrl = kl.build_kl_controller("fixed", kl_coef=0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05
    restored = kl.build_kl_controller("fixed", kl_coef=0.9)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == 0.05


def test_adaptive_controller_hand_case_and_checkpoint():
    ctrl = kl.build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=100)
    # kl 0.15: error = clip(0.15/0.1 - 1 = 0.5, -0.2, 0.2) = 0.2 -> 0.1 * (1 + 0.2*10/100) = 0.102
    ctrl.update(current_kl=0.15, n_steps=10)
    assert math.isclose(ctrl.value, 0.102)
    # kl 0.09: error = -0.1 -> 0.102 * (1 - 0.1*50/100) = 0.102 * 0.95 = 0.0969
    ctrl.update(current_kl=0.09, n_steps=50)
    assert math.isclose(ctrl.value, 0.0969)
    resumed = kl.build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=100)
    resumed.load_state_dict(ctrl.state_dict())
    assert math.isclose(resumed.value, 0.0969)
    with pytest.raises(ValueError, match="checkpointed KL controller is 'adaptive'.*'fixed'"):
        kl.build_kl_controller("fixed").load_state_dict(ctrl.state_dict())


def test_controller_settings_are_checked():
    with pytest.raises(ValueError, match="kl_ctrl.type 'pid'"):
        kl.build_kl_controller("pid")
    with pytest.raises(ValueError, match="kl_ctrl.target_kl must be > 0"):
        kl.build_kl_controller("adaptive", target_kl=0.0)
    with pytest.raises(ValueError, match="kl_ctrl.horizon must be > 0"):
        kl.build_kl_controller("adaptive", horizon=0)


def kl_batch() -> Batch:
    # Row 0: kl (k1) = old - ref = [0.1, 0, -0.2]; row 1: [0.5, 0, masked].
    return Batch.from_dict({
        "token_level_scores": T([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]]),
        "old_log_probs": T([[-1.0, -2.0, -0.5], [-1.0, -1.0, -5.0]]),
        "ref_log_prob": T([[-1.1, -2.0, -0.3], [-1.5, -1.0, 0.0]]),
        "response_mask": T([[1, 1, 1], [1, 1, 0]]),
    })


def test_kl_in_reward_hand_case():
    # beta = 0.1: row 0: [0 - 0.01, 0, 1 + 0.02] = [-0.01, 0, 1.02]; row 1: [-0.05, 0.5, 0].
    # current_kl = mean(row means) = mean(-0.1/3, 0.5/2) = (-0.0333333 + 0.25)/2 = 0.1083333.
    batch = kl_batch()
    metrics = kl.apply_kl_penalty(batch, kl.build_kl_controller("fixed", kl_coef=0.1), kind="kl")
    close(batch["token_level_rewards"], [[-0.01, 0.0, 1.02], [-0.05, 0.5, 0.0]])
    assert math.isclose(metrics["critic/kl"], 0.1083333, abs_tol=1e-6)
    assert metrics["critic/kl_coeff"] == 0.1


def test_kl_in_reward_steps_the_adaptive_controller():
    # error = clip(0.1083333/0.05 - 1, -0.2, 0.2) = 0.2 -> 0.1 * (1 + 0.2 * 2/20) = 0.102.
    ctrl = kl.build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=20)
    metrics = kl.apply_kl_penalty(kl_batch(), ctrl, kind="kl")
    assert metrics["critic/kl_coeff"] == 0.1  # the beta used for this batch
    assert math.isclose(ctrl.value, 0.102)
