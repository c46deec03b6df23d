"""Advantage estimators: GAE, GRPO (and pass@k), RLOO, OPO, REINFORCE++ (and its baseline form), ReMax.

Each estimator takes [B, T] response-token tensors and returns ``(advantages_BT, returns_BT)``,
both zero wherever the mask is 0. :func:`compute` runs one by name on a batch and stores
``advantages`` and ``returns`` in it (the controller calls it on the driver).

Conventions shared by all estimators:

- The mask is ``response_mask``: the tokens that train, which the rollout emits (its multi-turn form is 0 on
  tool and interaction tokens). Masked tokens get no advantage, and their values (critic values, log-probs)
  never influence any other token's advantage.
- Outcome estimators (GRPO, RLOO, OPO, REINFORCE++-baseline) score a row by the sum of its
  ``token_level_rewards`` over all T positions: the reward manager puts the score on the last
  token of the response, which may be a masked tool token in a multi-turn episode, and it
  must not be lost.
- Token-level scans (GAE, REINFORCE++, ReMax) treat a masked token as part of the
  environment: it takes no time step, its value is skipped, and a reward found on it is
  credited to the closest valid token on its left (the action that led to it). With no
  masked tokens inside a response this is exactly the textbook recursion.
- Grouping by ``uid`` is vectorised (:mod:`megarl.algo.groups`).

Shape legend: ``B`` rows (trajectories), ``T`` response tokens, ``G`` groups (prompts). The
estimators' parameters are named after the batch fields they receive (``token_level_rewards``,
``values``, ``response_mask``: all [B, T]; ``uid``, ``reward_baselines``: [B]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from megarl.algo.groups import group_count, group_index, group_max, group_mean_std, group_min, group_sum
from megarl.algo.masked import masked_whiten

Uid = Any  # a 1-D tensor, numpy array or list of per-row group ids


def _masked(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BT.bool(), x_BT, torch.zeros((), dtype=x_BT.dtype, device=x_BT.device))


def _check_rows(name: str, uid: Uid, num_rows: int) -> None:
    if len(uid) != num_rows:
        raise ValueError(f"`uid` has {len(uid)} entries but the batch has {num_rows} rows; {name} groups rows by uid")


def _scan(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float,
          lam: float) -> torch.Tensor:
    """Backward GAE recursion over valid tokens; returns unmasked advantages [B, T].

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next valid token (``V = A = 0`` after the last one). Rewards on masked tokens
    are carried left to the next valid token the scan reaches.
    """
    valid_BT = mask_BT.bool()
    zero_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    next_value_B, last_adv_B, carried_B = zero_B, zero_B, zero_B
    adv_per_t = []
    for t in reversed(range(rewards_BT.shape[1])):
        valid_B = valid_BT[:, t]
        reward_B = rewards_BT[:, t] + carried_B
        value_B = torch.where(valid_B, values_BT[:, t], zero_B)
        adv_B = reward_B + gamma * next_value_B - value_B + gamma * lam * last_adv_B
        last_adv_B = torch.where(valid_B, adv_B, last_adv_B)
        next_value_B = torch.where(valid_B, value_B, next_value_B)
        carried_B = torch.where(valid_B, zero_B, reward_B)
        adv_per_t.append(last_adv_B)
    if not adv_per_t:
        return torch.zeros_like(rewards_BT)
    return torch.stack(adv_per_t[::-1], dim=1)


@torch.no_grad()
def gae_advantage(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                  gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (``algorithm.gamma``, ``algorithm.lam``); needs a critic.

    ``returns = A + V`` (before whitening); with ``whiten`` the advantages are shifted and
    scaled to zero mean, unit variance over the valid tokens of the whole batch.
    """
    adv_BT = _scan(token_level_rewards, values, response_mask, gamma, lam)
    returns_BT = _masked(adv_BT + values, response_mask)
    if whiten:
        adv_BT = masked_whiten(adv_BT, response_mask)
    return _masked(adv_BT, response_mask), returns_BT


@torch.no_grad()
def grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Uid,
                           norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - mean_g) / (std_g + epsilon)`` per group of ``uid``, on every valid token.

    ``std_g`` is the unbiased std; a group of one has mean 0 and std 1. With
    ``norm_adv_by_std_in_grpo=False`` the division is skipped (Dr.GRPO). Returns equal advantages.
    """
    _check_rows("GRPO", uid, token_level_rewards.shape[0])
    score_B = token_level_rewards.sum(dim=-1)
    group_B, num_groups = group_index(uid)
    mean_G, std_G = group_mean_std(score_B, group_B, num_groups)
    group_B = group_B.to(score_B.device)
    adv_B = score_B - mean_G[group_B]
    if norm_adv_by_std_in_grpo:
        adv_B = adv_B / (std_G[group_B] + epsilon)
    adv_BT = _masked(adv_B.unsqueeze(-1).expand_as(token_level_rewards), response_mask)
    return adv_BT, adv_BT


@torch.no_grad()
def grpo_passk_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Uid,
                         norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: only the best row of each group learns, with advantage ``max - second max``.

    Divided by ``std_g + epsilon`` when ``norm_adv_by_std_in_grpo``. Ties go to the first row.
    Every group needs at least two rows.
    """
    _check_rows("GRPO pass@k", uid, token_level_rewards.shape[0])
    score_B = token_level_rewards.sum(dim=-1)
    group_B, num_groups = group_index(uid)
    if num_groups and int(group_count(group_B, num_groups).min()) < 2:
        raise ValueError("the grpo_passk estimator needs at least 2 samples per prompt; set rollout.n >= 2")
    group_B = group_B.to(score_B.device)
    row_B = torch.arange(len(score_B), device=score_B.device)
    best_score_G = group_max(score_B, group_B, num_groups)
    candidate_B = torch.where(score_B == best_score_G[group_B], row_B, len(score_B))
    best_row_G = group_min(candidate_B, group_B, num_groups)
    is_best_B = row_B == best_row_G[group_B]
    second_G = group_max(score_B.masked_fill(is_best_B, float("-inf")), group_B, num_groups)
    adv_G = best_score_G - second_G
    if norm_adv_by_std_in_grpo:
        adv_G = adv_G / (group_mean_std(score_B, group_B, num_groups)[1] + epsilon)
    adv_B = torch.where(is_best_B, adv_G[group_B], torch.zeros_like(score_B))
    adv_BT = _masked(adv_B.unsqueeze(-1).expand_as(token_level_rewards), response_mask)
    return adv_BT, adv_BT


@torch.no_grad()
def rloo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Uid,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean score of the other rows of the group (a group of one keeps its score)."""
    _check_rows("RLOO", uid, token_level_rewards.shape[0])
    score_B = token_level_rewards.sum(dim=-1)
    group_B, num_groups = group_index(uid)
    group_B = group_B.to(score_B.device)
    count_B = group_count(group_B, num_groups)[group_B].to(score_B.dtype)
    sum_B = group_sum(score_B, group_B, num_groups)[group_B]
    leave_one_out_B = (sum_B - score_B) / (count_B - 1).clamp(min=1)
    adv_B = torch.where(count_B > 1, score_B - leave_one_out_B, score_B)
    adv_BT = _masked(adv_B.unsqueeze(-1).expand_as(token_level_rewards), response_mask)
    return adv_BT, adv_BT


@torch.no_grad()
def opo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Uid,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: score minus the length-weighted group mean ``sum(len * score) / sum(len)`` (0 for a group of one).

    The length of a row is its number of valid (mask 1) tokens.
    """
    _check_rows("OPO", uid, token_level_rewards.shape[0])
    score_B = token_level_rewards.sum(dim=-1)
    length_B = response_mask.to(score_B.dtype).sum(dim=-1)
    group_B, num_groups = group_index(uid)
    group_B = group_B.to(score_B.device)
    weighted_G = group_sum(length_B * score_B, group_B, num_groups)
    length_G = group_sum(length_B, group_B, num_groups)
    baseline_G = torch.where(group_count(group_B, num_groups) > 1, weighted_G / length_G.clamp(min=1),
                             torch.zeros_like(weighted_G))
    adv_B = score_B - baseline_G[group_B]
    adv_BT = _masked(adv_B.unsqueeze(-1).expand_as(token_level_rewards), response_mask)
    return adv_BT, adv_BT


@torch.no_grad()
def reinforce_plus_plus_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                  gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go as returns, whitened over the batch's valid tokens as advantages."""
    returns_BT = _masked(_scan(token_level_rewards, torch.zeros_like(token_level_rewards), response_mask, gamma,
                               1.0), response_mask)
    return _masked(masked_whiten(returns_BT, response_mask), response_mask), returns_BT


@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                           uid: Uid) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus its group mean, broadcast to tokens, whitened over valid tokens."""
    _check_rows("REINFORCE++-baseline", uid, token_level_rewards.shape[0])
    score_B = token_level_rewards.sum(dim=-1)
    group_B, num_groups = group_index(uid)
    mean_G, _ = group_mean_std(score_B, group_B, num_groups)
    centred_BT = (score_B - mean_G[group_B.to(score_B.device)]).unsqueeze(-1).expand_as(token_level_rewards)
    adv_BT = _masked(masked_whiten(centred_BT, response_mask), response_mask)
    return adv_BT, adv_BT


@torch.no_grad()
def remax_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy rollout's reward ``reward_baselines`` [B]; returns = reward-to-go."""
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"`reward_baselines` must have one value per row, shape "
                         f"{tuple(token_level_rewards.shape[:1])}, got {tuple(reward_baselines.shape)}")
    returns_BT = _masked(_scan(token_level_rewards, torch.zeros_like(token_level_rewards), response_mask, 1.0,
                               1.0), response_mask)
    return _masked(returns_BT - reward_baselines.unsqueeze(-1), response_mask), returns_BT


@dataclasses.dataclass(frozen=True)
class _Estimator:
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fields: tuple[str, ...]  # batch fields passed by name, besides the mask
    options: tuple[str, ...]  # settings passed through from ``compute(**cfg)``


_OUTCOME_FIELDS = ("token_level_rewards", "uid")
_GRPO_OPTIONS = ("norm_adv_by_std_in_grpo", "epsilon")

ESTIMATORS: dict[str, _Estimator] = {
    "gae": _Estimator(gae_advantage, ("token_level_rewards", "values"), ("gamma", "lam", "whiten")),
    "grpo": _Estimator(grpo_outcome_advantage, _OUTCOME_FIELDS, _GRPO_OPTIONS),
    "grpo_passk": _Estimator(grpo_passk_advantage, _OUTCOME_FIELDS, _GRPO_OPTIONS),
    "rloo": _Estimator(rloo_advantage, _OUTCOME_FIELDS, ()),
    "opo": _Estimator(opo_advantage, _OUTCOME_FIELDS, ()),
    "reinforce_plus_plus": _Estimator(reinforce_plus_plus_advantage, ("token_level_rewards",), ("gamma",)),
    "reinforce_plus_plus_baseline": _Estimator(reinforce_plus_plus_baseline_advantage, _OUTCOME_FIELDS, ()),
    "remax": _Estimator(remax_advantage, ("token_level_rewards", "reward_baselines"), ()),
}
"""Estimators by ``algorithm.adv_estimator`` name."""

OPTIONS = ("gamma", "lam", "whiten", "norm_adv_by_std_in_grpo", "epsilon")
"""Settings :func:`compute` accepts; each estimator uses the ones that apply to it."""


GROUP_ESTIMATORS = frozenset(name for name, estimator in ESTIMATORS.items() if "uid" in estimator.fields)
"""Estimators that compare the samples of one prompt (its ``uid`` group) with each other: one sample per prompt,
or identical samples, give every advantage 0."""


def uses_critic(name: str) -> bool:
    """Whether the estimator needs critic ``values`` (only GAE)."""
    _estimator(name)
    return name == "gae"


def _estimator(name: str) -> _Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown algorithm.adv_estimator {name!r}; use one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def compute(name: str, batch, **cfg: Any):
    """Run the estimator ``name`` on ``batch`` and store its ``advantages`` and ``returns`` there.

    ``batch`` is a :class:`megarl.data.Batch` (or any mapping-like object with item assignment)
    holding ``token_level_rewards``, ``response_mask`` and what the estimator needs: ``values``
    (gae), ``uid`` (grpo, grpo_passk, rloo, opo, reinforce_plus_plus_baseline) or
    ``reward_baselines`` (remax). ``cfg`` holds settings from :data:`OPTIONS`: ``gamma``,
    ``lam``, ``whiten`` (gae), ``norm_adv_by_std_in_grpo`` and ``epsilon`` (grpo variants). Settings an
    estimator does not use are ignored.
    Returns ``batch``.
    """
    unknown = sorted(set(cfg) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown advantage settings {unknown}; the settings are {list(OPTIONS)}")
    estimator = _estimator(name)
    inputs = {}
    for key in estimator.fields:
        if key not in batch:
            raise KeyError(f"advantage estimator {name!r} needs the batch field {key!r}, which is missing")
        inputs[key] = batch[key]
    options = {key: cfg[key] for key in estimator.options if key in cfg}
    if "response_mask" not in batch:
        raise KeyError("advantages need the batch field 'response_mask' (the tokens that train), which the rollout "
                       "emits")
    advantages_BT, returns_BT = estimator.fn(response_mask=batch["response_mask"], **inputs, **options)
    batch["advantages"] = advantages_BT
    batch["returns"] = returns_BT
    return batch
