"""The tiny recipe's warm start: synthetic 2-digit addition data (:mod:`megarl.warmstart.addition_data`)
and a short SFT of the tiny model until its sampled reward reaches a target, cached on disk
(:mod:`megarl.warmstart.sft`). The trainer calls both for ``actor_rollout_ref.model.init=tiny_sft``.
"""

from megarl.warmstart.addition_data import ensure_addition_data, make_addition_rows, write_addition_data
from megarl.warmstart.sft import ensure_tiny_sft, tiny_sft_accuracy

__all__ = ["ensure_addition_data", "ensure_tiny_sft", "make_addition_rows", "tiny_sft_accuracy", "write_addition_data"]
