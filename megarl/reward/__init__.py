"""Rewards: rule scorers by ``data_source``, custom reward functions by path, the reward manager.

- :class:`RewardManager` ``(batch) -> (token_level_scores [B, T], extra_info {key: [per row]})``.
- :class:`ScorerRegistry`: ``data_source`` -> scorer; starts with ``"openai/gsm8k"``
  (:mod:`megarl.reward.gsm8k`) and ``"addition"`` (:mod:`megarl.reward.addition`).
- :func:`load_function`: a custom function from ``"module_or_path:function"``.
"""

from megarl.reward import addition, gsm8k
from megarl.reward.manager import RewardManager, last_valid_positions
from megarl.reward.registry import BUILTIN_SCORERS, ScorerRegistry, default_compute_score, load_function

__all__ = [
    "BUILTIN_SCORERS",
    "RewardManager",
    "ScorerRegistry",
    "addition",
    "default_compute_score",
    "gsm8k",
    "last_valid_positions",
    "load_function",
]
