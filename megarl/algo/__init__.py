"""RL numerics in pure torch: advantages, policy/value/KL losses and their aggregation, KL
controllers, rollout/training mismatch correction and DAPO extras.

Nothing here knows about models, parallelism or workers; batches are duck-typed (anything
with ``batch["key"]`` access, such as :class:`megarl.data.Batch`).

- :mod:`megarl.algo.advantages`: ``compute(name, batch, **cfg)`` and the estimators.
- :mod:`megarl.algo.losses`: ``policy_loss``, ``value_loss``, ``agg_loss``, ``agg_norm``, ``kl_penalty``.
- :mod:`megarl.algo.kl`: KL estimators, fixed/adaptive KL controllers, KL penalty in the reward.
- :mod:`megarl.algo.mismatch`: rollout vs training log-prob metrics, truncated importance sampling.
- :mod:`megarl.algo.dapo`: dynamic sampling filter and buffer, overlong reward shaping.
- :mod:`megarl.algo.groups`, :mod:`megarl.algo.masked`: vectorised uid grouping, masked statistics.
"""

from megarl.algo import advantages, dapo, groups, kl, losses, masked, mismatch

__all__ = ["advantages", "dapo", "groups", "kl", "losses", "masked", "mismatch"]
