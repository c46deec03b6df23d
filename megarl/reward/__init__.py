"""Rewards: rule scorers by ``data_source``, custom reward functions by path, the reward manager.

- :class:`RewardManager` ``(batch) -> (token_level_scores [B, T], extra_info {key: [per row]})``.
- :class:`ScorerRegistry`: ``data_source`` -> scorer; starts with verl's table (:data:`BUILTIN_SCORERS`):
  ``"openai/gsm8k"`` (:mod:`megarl.reward.gsm8k`), MATH (:mod:`megarl.reward.hendrycks_math`), DAPO math and
  ``aime*`` (:mod:`megarl.reward.math_dapo`), NuminaMath (:mod:`megarl.reward.prime_math`), Geometry3K
  (:mod:`megarl.reward.geometry`), Search-R1 QA (:mod:`megarl.reward.search_qa`), and megarl's ``"addition"``
  (:mod:`megarl.reward.addition`). Math-verify checks: :mod:`megarl.reward.verified_math`.
- :func:`load_function`: a custom function from ``"module_or_path:function"``.
"""

from megarl.reward import addition, geometry, gsm8k, hendrycks_math, math_dapo, prime_math, search_qa, verified_math
from megarl.reward.manager import RewardManager, last_valid_positions
from megarl.reward.registry import BUILTIN_SCORERS, ScorerRegistry, default_compute_score, load_function

__all__ = [
    "BUILTIN_SCORERS",
    "RewardManager",
    "ScorerRegistry",
    "addition",
    "default_compute_score",
    "geometry",
    "gsm8k",
    "hendrycks_math",
    "last_valid_positions",
    "load_function",
    "math_dapo",
    "prime_math",
    "search_qa",
    "verified_math",
]
