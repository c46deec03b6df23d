"""Every random stream of a megarl run and the seed it draws from, in one place.

A run has two base seeds: ``trainer.seed`` (model building, data order, the workers' shuffles, the warm
start) and the rollout seed (``RunConfig.rollout_seed``: ``actor_rollout_ref.rollout.seed``, else
``trainer.seed``). Every stream below derives from one of them by a function of this module, so two runs
with the same seeds and config draw the same numbers, and no two streams share one.

==========================  ==========================================================  ======================
stream                      seed                                                        used by
==========================  ==========================================================  ======================
Megatron init, dropout      :func:`stage_seed` ``(trainer.seed, pp_rank)``; Megatron's   ``parallel.groups``
                            tracker adds its own TP offsets
critic's value head         ``trainer.seed``                                            ``models.value_head``
prompt order per epoch      :func:`data_order_seed` ``(trainer.seed, epoch)``           ``data.loader``
mini-batch order            :func:`mini_batch_order_seed` ``(step, epoch)``             ``workers.micro``
training step's rollout     ``derive_seed(rollout seed, SEED_STREAM_ROLLOUT, step)``    ``controller``
validation round            ``derive_seed(rollout seed, SEED_STREAM_VALIDATION, step,   ``controller``
                            round)``
validation bootstrap        ``derive_seed(rollout seed,                                 ``controller``
                            SEED_STREAM_VALIDATION_BOOTSTRAP, step)``
async prompt group          ``derive_seed(derive_seed(rollout seed,                     ``rollout.producer``
                            SEED_STREAM_ASYNC_ROLLOUT), group, attempt)``
generation-only round       ``derive_seed(rollout seed, SEED_STREAM_GENERATION, round)`` ``controller.generate``
engine ``i``'s generator    ``derive_seed(rollout seed, SEED_STREAM_ENGINE, i)``        ``controller.build``
judge engine ``i``          ``derive_seed(rollout seed, SEED_STREAM_JUDGE_ENGINE, i)``  ``controller.build``
a judge's answer on a row   ``derive_seed(rollout seed, SEED_STREAM_JUDGE, row key)``   ``controller.judge``
row ``i`` of a request      :func:`derive_row_seed` ``(request seed, i)``               rollout manager, CPU
                                                                                        engine
multi-turn turn             :func:`turn_seed` ``(call seed, row, sample, turn)``        ``rollout.agent_loop``
warm start: SFT, probe      ``trainer.seed``; :func:`sft_probe_seed` ``(seed, step)``   ``warmstart.sft``
==========================  ==========================================================  ======================

Seeds go to megarl's CPU engine only: SGLang applies one request's ``sampling_seed`` to every row of it (and only
with deterministic inference), so SGLang engines sample from their own generators (``--random-seed``); see
:mod:`megarl.rollout.manager`.
"""

from __future__ import annotations

import hashlib

MAX_SEED = 2**63 - 1
"""Seeds are non-negative 63-bit integers (what ``torch.Generator.manual_seed`` and SGLang accept)."""

SEED_STREAM_ROLLOUT = 1
"""``derive_seed(rollout seed, SEED_STREAM_ROLLOUT, step)`` seeds a training step's generation."""
SEED_STREAM_VALIDATION = 2
"""``derive_seed(rollout seed, SEED_STREAM_VALIDATION, step, round)`` seeds a validation round."""
SEED_STREAM_ASYNC_ROLLOUT = 3
"""``derive_seed(derive_seed(rollout seed, SEED_STREAM_ASYNC_ROLLOUT), group, attempt)`` seeds a prompt group of
asynchronous training (:mod:`megarl.rollout.producer`)."""
SEED_STREAM_VALIDATION_BOOTSTRAP = 4
"""``derive_seed(rollout seed, SEED_STREAM_VALIDATION_BOOTSTRAP, step)`` seeds the resampling behind a validation's
``best@k`` / ``worst@k`` / ``maj@k`` metrics."""
SEED_STREAM_GENERATION = 5
"""``derive_seed(rollout seed, SEED_STREAM_GENERATION, round)`` seeds a round of ``megarl-generate``."""
SEED_STREAM_ENGINE = 7
"""``derive_seed(rollout seed, SEED_STREAM_ENGINE, i)`` seeds engine ``i``'s own generator."""
SEED_STREAM_JUDGE_ENGINE = 8
"""``derive_seed(rollout seed, SEED_STREAM_JUDGE_ENGINE, i)`` seeds a generative judge's engine ``i``."""
SEED_STREAM_JUDGE = 9
"""``derive_seed(rollout seed, SEED_STREAM_JUDGE, crc32(row uid, sample))`` seeds the judge's answer about a row."""


def derive_row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s sampling stream in a call seeded with ``seed`` (a stable hash)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(row)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


def derive_seed(seed: int, *parts: int) -> int:
    """A seed for a named stream of ``seed`` (e.g. ``(rollout seed, stream, step)``): :func:`derive_row_seed`
    applied part by part, so every tuple of parts gets its own reproducible seed."""
    for part in parts:
        seed = derive_row_seed(seed, part)
    return seed


def turn_seed(seed: int, row: int, sample: int, turn: int) -> int:
    """The seed of one assistant turn of a multi-turn rollout: per (call seed, prompt row, sample, turn)."""
    return hash((seed, row, sample, turn)) & 0x7FFFFFFF  # a tuple of ints hashes the same in every process


def stage_seed(seed: int, pp_rank: int) -> int:
    """The Python, NumPy, torch and Megatron generators' seed on pipeline stage ``pp_rank`` (Megatron's rule)."""
    return seed + 100 * pp_rank


def data_order_seed(seed: int, epoch: int) -> int:
    """The prompt order's generator in ``epoch``."""
    return seed * 1_000_003 + epoch


def mini_batch_order_seed(seed: int, epoch: int) -> int:
    """The shuffle of a PPO update's trajectories into mini-batches in its ``epoch`` (``seed``: the step)."""
    return seed * 1000 + epoch


def sft_probe_seed(seed: int, step: int) -> int:
    """The warm start's reward probe at SFT step ``step``."""
    return seed * 1_000_003 + step
