"""KL divergence estimators between the policy and the reference, and the in-reward KL penalty.

Per-token estimators of KL(pi || pi_ref) from the log-probs of the sampled tokens, with
``d = logp - ref_logp``:

- ``kl`` / ``k1``: ``d`` (unbiased, high variance, can be negative);
- ``abs``: ``|d|``;
- ``mse`` / ``k2``: ``0.5 * d**2``;
- ``low_var_kl`` / ``k3``: ``exp(-d) + d - 1``, with ``-d`` clamped to [-20, 20] and the
  result clamped to [-10, 10] (non-negative, low variance);
- any of these with a ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``, ``abs+``, ...):
  straight-through, as verl's ``kl_penalty``: the value is the base kind's, the gradient is
  k2's, ``d`` (``0.5*d**2 - (0.5*d**2).detach() + base.detach()``). k1 and k3 estimate the KL
  without bias but their expected gradient is not the KL's; k2's gradient is.
  ``k2+`` / ``mse+`` equal ``k2``.

The KL penalty inside the reward (``algorithm.use_kl_in_reward``, §3.2) subtracts
``beta * kl`` from the token-level scores, where ``beta`` comes from a fixed or an adaptive
controller (``algorithm.kl_ctrl``). Controllers keep their state in ``state_dict`` so a
resumed run continues with the same coefficient.

Shape legend: ``B`` rows (trajectories), ``T`` response tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.algo.masked import masked_mean

BASE_KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = BASE_KL_KINDS + tuple(f"{kind}+" for kind in BASE_KL_KINDS)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference; same shape as ``logp``.

    ``kind`` is one of ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3`` (the
    settings ``algorithm.kl_penalty`` and ``actor.kl_loss_type``), or one of them followed by
    ``+``: the base kind's value with k2's gradient ``logp - ref_logp`` (straight-through). The
    full-vocabulary KL (``full``) needs the whole distributions and is not supported by this estimator.
    """
    if kind.endswith("+") and kind[:-1] in BASE_KL_KINDS:
        forward = _kl_forward(logp, ref_logp, kind[:-1])
        backward = 0.5 * (logp - ref_logp).square()
        return backward - backward.detach() + forward.detach()
    return _kl_forward(logp, ref_logp, kind)


def _kl_forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """The estimator ``kind`` without a ``+`` suffix, value and gradient."""
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        x = torch.clamp(-d, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)
    if kind == "full":
        raise ValueError("KL kind 'full' needs the full vocabulary distributions, which per-token log-probs do "
                         f"not carry; set algorithm.kl_penalty / actor.kl_loss_type to one of {KL_KINDS}")
    raise ValueError(f"unknown KL kind {kind!r} (algorithm.kl_penalty / actor.kl_loss_type); use one of {KL_KINDS}")


@dataclasses.dataclass
class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    kl_coef: float
    """The coefficient beta (``algorithm.kl_ctrl.kl_coef``)."""

    @property
    def value(self) -> float:
        """The current coefficient."""
        return self.kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""
        return {"type": "fixed", "value": self.kl_coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        _check_type(state, "fixed")
        self.kl_coef = float(state["value"])


@dataclasses.dataclass
class AdaptiveKLController:
    """A KL coefficient steered towards a target KL (Ziegler et al. 2019; ``kl_ctrl.type=adaptive``).

    After each step, ``err = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and
    ``value *= 1 + err * n_steps / horizon``.
    """

    kl_coef: float
    """Initial coefficient (``algorithm.kl_ctrl.kl_coef``)."""
    target_kl: float
    """KL the controller steers towards (``algorithm.kl_ctrl.target_kl``)."""
    horizon: float
    """Number of samples over which the coefficient may change by about 20% (``algorithm.kl_ctrl.horizon``)."""

    def __post_init__(self) -> None:
        if self.target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, "
                             f"got {self.target_kl}")
        if self.horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {self.horizon}")
        self.value = float(self.kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after a step that measured ``current_kl`` over ``n_steps`` samples."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""
        return {"type": "adaptive", "value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient from :meth:`state_dict` (the target and horizon stay as configured)."""
        _check_type(state, "adaptive")
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def _check_type(state: dict[str, Any], expected: str) -> None:
    if state.get("type") != expected:
        raise ValueError(f"checkpointed KL controller is {state.get('type')!r} but algorithm.kl_ctrl.type is "
                         f"{expected!r}; resume with the same kl_ctrl.type")


def build_kl_controller(type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1,
                        horizon: float = 10000) -> KLController:
    """The controller named by ``algorithm.kl_ctrl.type`` (``fixed`` or ``adaptive``)."""
    if type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {type!r}; use 'fixed' or 'adaptive'")


def in_reward_kl(batch, kl_ctrl: KLController, kind: str = "kl") -> tuple[torch.Tensor, float, dict[str, float]]:
    """The in-reward KL penalty's per-token KL ``[B, T]`` (0 outside ``response_mask``), the coefficient beta it is
    weighted by this step, and the metrics ``critic/kl`` and ``critic/kl_coeff``; the controller is stepped with the
    batch KL, the mean over rows of each row's masked mean.

    ``batch`` is any mapping-like batch (a :class:`megarl.data.Batch`) holding ``old_log_probs``, ``ref_log_prob`` and
    ``response_mask`` (the tokens that train: tool tokens of multi-turn rollouts stay out of the KL), all [B, T].
    """
    mask_BT = batch["response_mask"]
    kl_BT = kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], kind)
    kl_BT = torch.where(mask_BT.bool(), kl_BT, torch.zeros_like(kl_BT))
    beta = kl_ctrl.value
    current_kl = float(masked_mean(kl_BT, mask_BT, dim=-1).mean()) if len(kl_BT) else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=len(kl_BT))
    return kl_BT, beta, {"critic/kl": current_kl, "critic/kl_coeff": beta}


def apply_kl_penalty(batch, kl_ctrl: KLController, kind: str = "kl") -> dict[str, float]:
    """Set ``batch["token_level_rewards"] = token_level_scores - beta * kl * mask`` and step the controller
    (:func:`in_reward_kl`; ``batch`` also holds ``token_level_scores``); its metrics."""
    kl_BT, beta, metrics = in_reward_kl(batch, kl_ctrl, kind)
    batch["token_level_rewards"] = batch["token_level_scores"] - beta * kl_BT
    return metrics
