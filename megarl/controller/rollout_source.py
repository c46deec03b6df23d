"""Where a step's scored trajectories come from: generated when the step asks (``trainer.mode=sync``), or taken
from a producer that generates whole prompt groups ahead within a staleness bound (``one_step_off``,
``fully_async``).

Both are a :class:`RolloutSource`; the trainer's step reads the same on either::

    batch = rollout.take(step, metrics, timing)        # scored: token_level_scores and the reward's extras
    with rollout.weight_update(step) as flush: ...     # around the weight sync; flush: may the engines flush
    rollout.finish_step(metrics, step_seconds)         # the source's own step metrics (idle shares)

and for checkpoints ``rollout.state()`` (the groups generated ahead; None in sync mode).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from megarl.algo.dapo import DynamicSamplingBuffer
from megarl.config.schema import RunConfig
from megarl.controller.metrics import sample_staleness, staleness_metrics, timer
from megarl.data.batch import Batch
from megarl.data.loader import PromptLoader
from megarl.rollout.buffer import GroupStatus, RolloutBuffer
from megarl.rollout.manager import RolloutManager
from megarl.rollout.producer import RolloutProducer
from megarl.seeds import SEED_STREAM_ASYNC_ROLLOUT, SEED_STREAM_ROLLOUT, derive_seed

Score = Callable[[Batch], Batch]
"""A rollout batch scored in place (:meth:`megarl.controller.reward_stage.RewardStage.score_rollout`):
``token_level_scores``, the per-row columns (:data:`~megarl.algo.dapo.REWARD_EXTRA`), unscored rows out of ``response_mask``."""


class RolloutSource(Protocol):
    """A step's scored trajectories (module docstring)."""

    histograms: dict[str, Any]
    """Per-sample values of the last step for TensorBoard histograms (taken by the trainer)."""

    def take(self, step: int, metrics: dict[str, float], timing: dict[str, float]) -> Batch: ...

    def weight_update(self, version: int) -> contextlib.AbstractContextManager[bool]: ...

    def finish_step(self, metrics: dict[str, float], step_seconds: float) -> None: ...

    def state(self) -> Any: ...

    def close(self) -> None: ...


class SyncRollout:
    """Generate and score the loader's next batch when the step asks; under ``algorithm.filter_groups`` (DAPO)
    more batches, seeded by their number within the step, until ``data.train_batch_size`` groups with signal
    are kept."""

    def __init__(self, cfg: RunConfig, loader: PromptLoader, manager: RolloutManager, score: Score) -> None:
        self.cfg, self.loader, self.manager, self.score = cfg, loader, manager, score
        self.histograms: dict[str, Any] = {}

    def take(self, step: int, metrics: dict[str, float], timing: dict[str, float]) -> Batch:
        cfg = self.cfg
        B, filtering = cfg.data.train_batch_size, cfg.algorithm.filter_groups
        sampler = DynamicSamplingBuffer(B, filtering.metric, filtering.max_num_gen_batches)
        while True:
            number = sampler.num_gen_batches
            prompts = self.loader.next()
            prompts.non_tensors["uid"] = [f"{step}-{number * B + i}" for i in range(len(prompts))]
            seed = derive_seed(cfg.rollout_seed, SEED_STREAM_ROLLOUT, step, *([number] if number else []))
            with timer("gen", timing):
                batch = self.manager.generate(prompts, seed=seed)
            with timer("reward", timing):
                batch = self.score(batch)
            if not filtering.enable:
                return batch
            sampler.add(batch)
            if sampler.ready:
                metrics["dapo/gen_batches"] = float(sampler.num_gen_batches)
                metrics["dapo/groups_filtered"] = float(sampler.num_groups_dropped)
                return sampler.take()

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[bool]:
        """Nothing runs in the engines during a synchronous run's sync: their caches may be flushed."""
        yield True

    def finish_step(self, metrics: dict[str, float], step_seconds: float) -> None:
        pass

    def state(self) -> None:
        return None

    def close(self) -> None:
        pass


class AsyncRollout:
    """Whole prompt groups generated and scored ahead by a :class:`RolloutProducer` (its own manager over the same
    engines), from the step after ``global_step`` on, within ``async_training.max_staleness`` weight versions.

    A resumed run passes the checkpoint's buffer (``buffer_state``): the groups generated and not yet trained
    are restored and those that were generating are issued again with the seeds they had, so its steps train
    the prompts an uninterrupted run trains."""

    def __init__(self, cfg: RunConfig, loader: PromptLoader, train_set, manager: RolloutManager, score: Score, *,
                 global_step: int, buffer_state: Any = None, console=print) -> None:
        self.cfg, self.loader, self.global_step = cfg, loader, global_step
        settings, B = cfg.async_training, cfg.data.train_batch_size
        filtering = cfg.algorithm.filter_groups
        buffer = RolloutBuffer(groups_per_step=B, max_staleness=settings.max_staleness,
                               stale_policy=settings.stale_policy,
                               filter_metric=filtering.metric if filtering.enable else None,
                               max_filtered_batches=filtering.max_num_gen_batches)
        self.again: list = []
        """Groups that were generating when the resumed checkpoint was saved (issued again first)."""
        if buffer_state is not None:
            self.again = buffer.load_state_dict(*buffer_state)
            done = sum(r.status is GroupStatus.DONE for r in buffer.records.values())
            console(f"rollout buffer restored: {done} generated groups not yet trained, {len(self.again)} "
                    f"generating at the save (generated again with their seeds)")
        else:  # a fresh run, or a checkpoint of a synchronous one: groups from the loader's position on
            buffer.head = buffer.next_index = buffer.kept_or_pending = loader.position * B

        def prompts_of(group: int) -> Batch:
            number, row = divmod(group, B)
            index = loader.rows_of(number)[row]
            prompt = train_set.collate([train_set[index]])
            prompt.non_tensors["uid"] = [f"{number + 1}-{row}"]  # the synchronous run's uid
            return prompt

        self.producer = RolloutProducer(manager, buffer, prompts_of=prompts_of, score=score,
                                        base_seed=derive_seed(cfg.rollout_seed, SEED_STREAM_ASYNC_ROLLOUT),
                                        max_inflight=settings.max_inflight_groups or B * (settings.max_staleness + 1),
                                        partial_rollout=settings.partial_rollout, pause_mode=settings.pause_mode)
        self.histograms: dict[str, Any] = {}

    def take(self, step: int, metrics: dict[str, float], timing: dict[str, float]) -> Batch:
        if not self.producer.started:
            self.producer.start(step - 1, self.again)
        with timer("gen", timing):
            batch = self.producer.take(step, timeout_s=self.cfg.trainer.worker_timeout_s)
        metrics["async/trainer_wait_s"] = timing["gen"]
        self.loader.seek(-(-self.producer.consumed // self.cfg.data.train_batch_size))  # batches begun: the epoch
        metrics.update(staleness_metrics(batch, step, self.producer))
        if "rollout_weight_versions" in batch:
            self.histograms["async/staleness"] = sample_staleness(batch, step)
        return batch

    def weight_update(self, version: int) -> contextlib.AbstractContextManager[bool]:
        """Drain or pause the producer's requests around the sync (``async_training.partial_rollout``)."""
        return self.producer.weight_update(version)

    def finish_step(self, metrics: dict[str, float], step_seconds: float) -> None:
        """The idle shares of the step: the trainer waiting for groups, no group generating."""
        metrics["async/trainer_idle_frac"] = min(1.0, metrics["async/trainer_wait_s"] / step_seconds)
        metrics["async/engine_idle_frac"] = max(0.0, 1.0 - self.producer.take_busy() / step_seconds)

    def state(self) -> Any:
        """The groups generated ahead, and those generating (issued again at resume)."""
        return self.producer.state()

    def close(self) -> None:
        self.producer.stop()
        self.producer.manager.close()
