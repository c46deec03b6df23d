"""DAPO extras: dynamic sampling (drop groups without signal, refill) and overlong reward shaping.

Dynamic sampling (Yu et al. 2025, "DAPO"): a prompt whose n samples all got the same reward
has zero GRPO advantage everywhere, so it only dilutes the batch. :func:`filter_groups`
drops such groups (grouped by ``uid``, vectorised) and reports how many it dropped;
:class:`DynamicSamplingBuffer` lets the controller generate more batches and collect kept
groups until it has ``num_prompts`` of them, then hands back exactly that many.

Overlong reward shaping: a response longer than ``max_response_length - overlong_buffer_len``
gets a penalty growing linearly to ``-penalty_factor`` at ``max_response_length``, added to its
score on its last valid token (:func:`apply_overlong_penalty`).

The batch functions take a :class:`megarl.data.Batch` (anything with its ``reorder``/``concat``).
Shape legend: ``B`` rows (trajectories), ``T`` response tokens, ``G`` groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megarl.algo.groups import group_count, group_index, group_max, group_min

REWARD_EXTRA = "reward_extra"
"""The batch field of scored rollouts holding, per row, the reward function's extra values (a dict)."""


def sequence_metric(batch, metric: str) -> torch.Tensor:
    """One number per row to group on: ``seq_final_reward`` (sum of ``token_level_rewards``; before the rewards
    exist, that of ``token_level_scores``: filtering runs without the in-reward KL), ``seq_reward`` (sum of
    ``token_level_scores``), any 1-D numeric field, or a value of the reward function's per-row extras
    (:data:`REWARD_EXTRA`, e.g. ``acc``)."""
    if metric == "seq_final_reward" and "token_level_rewards" in batch:
        return batch["token_level_rewards"].sum(dim=-1)
    if metric in ("seq_final_reward", "seq_reward"):
        return batch["token_level_scores"].sum(dim=-1)
    if metric in batch:
        values = batch[metric]
    elif REWARD_EXTRA in batch and all(metric in row for row in batch[REWARD_EXTRA]):
        values = [row[metric] for row in batch[REWARD_EXTRA]]
    else:
        extras = sorted({key for row in batch[REWARD_EXTRA] for key in row}) if REWARD_EXTRA in batch else []
        raise KeyError(f"algorithm.filter_groups.metric {metric!r} is neither a batch field nor returned by the "
                       f"reward function for every row (it returns {extras}); use seq_final_reward, seq_reward or "
                       f"one of those")
    if isinstance(values, torch.Tensor):
        values_B = values
    else:
        try:
            values_B = torch.as_tensor(np.asarray(values, dtype=np.float64))
        except (TypeError, ValueError) as error:
            raise ValueError(f"algorithm.filter_groups.metric {metric!r} must be a number per row: {error}") from error
    if values_B.dim() != 1:
        raise ValueError(f"algorithm.filter_groups.metric {metric!r} must have one number per row, "
                         f"got shape {tuple(values_B.shape)}")
    return values_B


def keep_groups_mask(metric_B: torch.Tensor, uid: Any) -> tuple[torch.Tensor, dict[str, int]]:
    """Which rows belong to a group whose metric is not all equal (a group of one is kept).

    Returns the boolean row mask and ``num_groups``, ``num_groups_kept``, ``num_groups_dropped``.
    """
    if len(uid) != len(metric_B):
        raise ValueError(f"`uid` has {len(uid)} entries but the batch has {len(metric_B)} rows")
    group_B, num_groups = group_index(uid)
    group_B = group_B.to(metric_B.device)
    spread_G = group_max(metric_B, group_B, num_groups) != group_min(metric_B, group_B, num_groups)
    keep_G = spread_G | (group_count(group_B, num_groups) == 1)
    num_kept = int(keep_G.sum())
    info = {"num_groups": num_groups, "num_groups_kept": num_kept, "num_groups_dropped": num_groups - num_kept}
    return keep_G[group_B], info


def filter_groups(batch, metric: str = "seq_final_reward"):
    """The rows of ``batch`` whose ``uid`` group has a non-constant ``metric``, and the counts.

    Returns ``(kept_batch, info)`` with ``info`` as :func:`keep_groups_mask`; row order is kept.
    """
    keep_B, info = keep_groups_mask(sequence_metric(batch, metric), batch["uid"])
    return batch.reorder(torch.nonzero(keep_B.cpu(), as_tuple=True)[0]), info


def _first_groups(uid: Any, num_groups: int) -> torch.Tensor:
    """Indices of the rows of the first ``num_groups`` distinct uids, by first appearance."""
    uid_B = uid.cpu().numpy() if isinstance(uid, torch.Tensor) else np.asarray(uid)
    _, first_row_G, group_B = np.unique(uid_B, return_index=True, return_inverse=True)
    appearance_rank_G = np.argsort(np.argsort(first_row_G))
    return torch.from_numpy(np.nonzero(appearance_rank_G[group_B.reshape(-1)] < num_groups)[0])


class DynamicSamplingBuffer:
    """Collects filtered generation batches until ``num_prompts`` groups with signal are gathered.

    Usage in the controller: ``while not buffer.ready: buffer.add(generate_and_score())``, then
    ``batch = buffer.take()``. ``max_num_gen_batches`` (``algorithm.filter_groups.max_num_gen_batches``)
    bounds the number of generation batches per step; 0 means no bound.
    """

    def __init__(self, num_prompts: int, metric: str = "seq_final_reward", max_num_gen_batches: int = 0) -> None:
        if num_prompts < 1:
            raise ValueError(f"data.train_batch_size must be >= 1 for dynamic sampling, got {num_prompts}")
        if max_num_gen_batches < 0:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches must be >= 0, got {max_num_gen_batches}")
        self.num_prompts = num_prompts
        self.metric = metric
        self.max_num_gen_batches = max_num_gen_batches
        self._kept: list = []
        self._uids: set = set()
        self.num_gen_batches = 0
        self.num_groups_dropped = 0

    @property
    def num_kept_prompts(self) -> int:
        """Groups with signal collected so far."""
        return len(self._uids)

    @property
    def ready(self) -> bool:
        """Whether enough groups are collected for :meth:`take`."""
        return self.num_kept_prompts >= self.num_prompts

    def add(self, batch) -> dict[str, int]:
        """Filter one generation batch and keep its groups with signal; returns the filter's counts."""
        if self.max_num_gen_batches and self.num_gen_batches >= self.max_num_gen_batches:
            raise ValueError(f"dynamic sampling generated {self.num_gen_batches} batches and kept only "
                             f"{self.num_kept_prompts} of {self.num_prompts} prompts; the data may be too easy or too "
                             f"hard. Raise algorithm.filter_groups.max_num_gen_batches (0 = no bound)")
        kept, info = filter_groups(batch, self.metric)
        self.num_gen_batches += 1
        self.num_groups_dropped += info["num_groups_dropped"]
        if len(kept):
            self._kept.append(kept)
            self._uids.update(np.asarray(kept["uid"]).tolist())
        return info

    def take(self):
        """The first ``num_prompts`` kept groups as one batch (extra groups are discarded); resets the buffer.

        The batch's meta gets ``num_gen_batches`` and ``num_groups_dropped`` for this step.
        """
        if not self.ready:
            raise ValueError(f"dynamic sampling buffer holds {self.num_kept_prompts} of {self.num_prompts} prompts; "
                             f"add more generation batches before take()")
        batch = type(self._kept[0]).concat(self._kept)
        batch = batch.reorder(_first_groups(batch["uid"], self.num_prompts))
        batch.meta["num_gen_batches"] = self.num_gen_batches
        batch.meta["num_groups_dropped"] = self.num_groups_dropped
        self._kept, self._uids = [], set()
        self.num_gen_batches = self.num_groups_dropped = 0
        return batch


def overlong_penalty(response_length_B: torch.Tensor, max_response_length: int, overlong_buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment per row: 0 up to ``max - buffer`` tokens, then down to ``-penalty_factor``.

    ``penalty = min(0, -(length - (max_response_length - overlong_buffer_len)) / overlong_buffer_len * factor)``.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(f"reward_model.overlong_buffer.len must be in (0, data.max_response_length="
                         f"{max_response_length}], got {overlong_buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"reward_model.overlong_buffer.penalty_factor must be >= 0, got {penalty_factor}")
    exceed_B = response_length_B.float() - (max_response_length - overlong_buffer_len)
    return torch.clamp(-exceed_B / overlong_buffer_len * penalty_factor, max=0.0)


def apply_overlong_penalty(token_level_scores_BT: torch.Tensor, response_mask_BT: torch.Tensor,
                           max_response_length: int, overlong_buffer_len: int, penalty_factor: float = 1.0,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add :func:`overlong_penalty` to each row's score on its last valid token.

    The length counts every response token (pass ``attention_mask[:, -R:]``, not ``response_mask``, which is 0
    on multi-turn tool outputs: they use up the length budget too). Returns new scores and the penalties [B].
    """
    length_B = response_mask_BT.bool().sum(dim=-1)
    penalty_B = overlong_penalty(length_B, max_response_length, overlong_buffer_len, penalty_factor)
    positions_T = torch.arange(1, response_mask_BT.shape[-1] + 1, device=response_mask_BT.device)
    last_B = (response_mask_BT.bool() * positions_T).argmax(dim=-1)
    scores_BT = token_level_scores_BT.clone()
    scores_BT[torch.arange(len(last_B), device=last_B.device), last_B] += penalty_B.to(scores_BT.dtype)
    return scores_BT, penalty_B
