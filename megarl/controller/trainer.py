"""The single controller: the PPO/GRPO step loop (docs/design.md, 'One step') over roles built by ``controller.build``.

``Trainer(cfg).fit()`` on the driver. Per step, in the digest's order::

    prompts -> rollout (engines) -> uid/repeat/union -> balance -> reward -> old log-probs (actor)
    -> reference log-probs -> values (critic) -> KL in reward -> advantages (driver)
    -> critic update -> actor update -> weight sync into the engines (verified) -> dumps
    -> validation -> checkpoint -> metrics

Everything that touches model weights runs in Ray workers; the driver holds the data, the
rewards, the advantages and the bookkeeping. Sampling is seeded by the step (training) or by
the validation round, and the data order by the epoch, so a resumed run repeats what the
uninterrupted run would have done. The sampling temperature the log-probs are recomputed at is
the one the rollout recorded in the batch's meta (greedy rollouts: 1).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm
from transformers import AutoTokenizer

from megarl.algo import advantages
from megarl.algo.dapo import REWARD_EXTRA, DynamicSamplingBuffer
from megarl.algo.kl import apply_kl_penalty, build_kl_controller
from megarl.algo.mismatch import mismatch_metrics, routing_metrics
from megarl.config.schema import RunConfig
from megarl.controller.build import (
    SEED_STREAM_ASYNC_ROLLOUT,
    SEED_STREAM_ROLLOUT,
    SEED_STREAM_VALIDATION,
    Roles,
    build_datasets,
    build_reward_managers,
    build_roles,
    build_rollout_manager,
    check_resume_layout,
    check_run_inputs,
    init_ray,
    load_agent_plugins,
    prepare_policy,
    routing_shape,
)
from megarl.controller.interrupts import interrupts_deferred
from megarl.controller.metrics import (
    check_failed_rollouts,
    data_metrics,
    mean_dicts,
    rollout_metrics,
    sample_staleness,
    sample_versions,
    staleness_metrics,
    throughput_metrics,
    timer,
    timing_metrics,
)
from megarl.controller.preflight import preflight
from megarl.controller.run_checkpoints import CheckpointManager, RunLock, load_trainer_state, resolve_resume
from megarl.controller.tracking import Tracking, dump_generations
from megarl.data.balance import balance_stats, balanced_partitions
from megarl.data.batch import Batch
from megarl.data.loader import PromptLoader
from megarl.models.sampling import derive_seed
from megarl.rollout.client import gather_sync
from megarl.rollout.buffer import GroupStatus, RolloutBuffer, load_state, save_state
from megarl.rollout.manager import RolloutManager
from megarl.rollout.producer import RolloutProducer
from megarl.reward.manager import reward_columns
from megarl.workers.base import Worker
from megarl.sync import merge_stats, verify_sample
from megarl.workers.megatron_workers import ActorWorker, CriticWorker

logger = logging.getLogger("megarl.train")


class RunInputError(ValueError):
    """Something the config names outside itself (model or data files, the resume path, the machine) is wrong;
    raised before anything is placed, with the key to change."""

ACTOR_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages",
              "ref_log_prob", "rollout_log_probs", "rollout_routed_experts")
CRITIC_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")
"""The columns each role's workers receive; ``response_mask`` (the tokens that train, as the rollout emits it) is
the one loss mask of every role."""


@contextlib.contextmanager
def _flushing():
    """A synchronous run's weight sync: nothing runs in the engines, their caches are flushed."""
    yield True


class Trainer:
    """PPO/GRPO on Megatron workers and rollout engines placed by Ray (see the module docstring).

    ``cfg`` comes from :func:`megarl.config.load_config`, which has validated it.
    """

    def __init__(self, cfg: RunConfig, *, console=print):
        self.cfg = cfg
        self.console = console
        trainer = cfg.trainer
        self.run_dir = Path(trainer.default_local_dir).expanduser() / trainer.project_name / trainer.experiment_name
        self.log_dir = Path(trainer.log_dir).expanduser() / trainer.project_name / trainer.experiment_name
        self.global_step = 0
        self.history: list[tuple[int, dict[str, float]]] = []
        """(step, metrics) of every step this trainer ran."""
        self.use_critic = cfg.critic.enable
        self.use_ref = cfg.needs_ref
        self.roles: Roles | None = None
        self._released_tags: set[str] = set()
        """Memory tags the engines have released (the driver resumes exactly those)."""
        self.rollout_manager: RolloutManager | None = None
        self.producer: RolloutProducer | None = None
        """Generates ahead of the trainer (``trainer.mode`` other than ``sync``)."""
        self._reward_lock = threading.Lock()
        self._histograms: dict[str, Any] = {}
        """Per-sample values of the step for TensorBoard histograms (``async/staleness``)."""
        self._buffer_state = None
        """The rollout buffer of the checkpoint resumed from (asynchronous runs)."""
        self._again: list = []
        """Groups that were generating when that checkpoint was saved (issued again first)."""
        self._started_ray = False
        self._run_lock: RunLock | None = None

    # ================================================================================ set-up
    def setup(self) -> None:
        """Everything before the first step: model, data, Ray, workers, resume, first weight sync."""
        cfg = self.cfg
        # The run owns its checkpoint directory from here on: a second run into it refuses before any work.
        try:
            self._run_lock = RunLock(self.run_dir).acquire()
        except (FileNotFoundError, PermissionError, NotADirectoryError) as error:
            raise RunInputError(f"cannot create the checkpoint directory {self.run_dir} "
                                f"(trainer.default_local_dir): {error}") from error
        # Everything the config names outside itself is checked before a model is built or a worker placed.
        try:
            check_run_inputs(cfg)
            self._resume_from = resolve_resume(self.run_dir, cfg.trainer.resume_mode, cfg.trainer.resume_from_path)
            check_resume_layout(cfg, self._resume_from)
            prepare_policy(cfg)
            self.routing_shape = routing_shape(cfg)
            self.plugins = load_agent_plugins(cfg)
        except ValueError as error:
            raise RunInputError(str(error)) from error
        # GPU runs: the same memory/placement pre-flight as megarl-plan, before anything is placed.
        self.preflight_plan = preflight(cfg)
        model = cfg.actor_rollout_ref.model
        self.tokenizer = AutoTokenizer.from_pretrained(model.local_tokenizer_path,
                                                       trust_remote_code=model.trust_remote_code)
        try:  # the data's rows and the reward functions that score them, before Ray
            self.train_set, self.val_set = build_datasets(cfg, self.tokenizer, self.plugins, console=self.console)
            self.reward_fn, self.val_reward_fn = build_reward_managers(cfg, self.tokenizer, self.train_set,
                                                                       self.val_set)
        except (ValueError, FileNotFoundError) as error:
            raise RunInputError(str(error)) from error
        self.loader = PromptLoader(self.train_set, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=cfg.trainer.seed)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * self.loader.batches_per_epoch
        with interrupts_deferred("Ray has started"):  # then shutdown() stops it
            self._started_ray = init_ray(cfg, console=self.console)
        self.roles = build_roles(cfg, self.log_dir / "servers")
        self.plan, self.engines = self.roles.plan, self.roles.engines
        self.actor_wg, self.critic_wg, self.rollout_wg = self.roles.actor, self.roles.critic, self.roles.rollout
        self.weight_names, self.weight_transport = self.roles.weight_names, self.roles.weight_transport
        self.actor_dp = self.actor_wg.dp_size
        self.rollout_manager = build_rollout_manager(cfg, self.roles.generator, self.engines, self.tokenizer,
                                                     self.plugins, self.routing_shape)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(type=kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl,
                                           horizon=kl.horizon)
        self.checkpoints = CheckpointManager(self.run_dir, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep)
        self.checkpoints.clean_stale()
        self._maybe_resume()
        self.tracker = Tracking(cfg.trainer.logger, self.log_dir, console=self.console)
        self._sync_weights(self.global_step)  # the engines start from the trainer's (possibly resumed) weights
        if cfg.trainer.mode != "sync":
            self.producer = self._build_producer()
        self._offload("actor")
        if self.use_critic:
            self._offload("critic")

    def _build_producer(self) -> RolloutProducer:
        """The asynchronous rollout (megarl.rollout.producer): its own manager over the same engines, groups from
        the step after the (resumed) global step on. A resumed run restores the checkpoint's buffer (the groups
        generated and not yet trained) and issues the groups that were generating again, with the seeds they had,
        so its steps train the prompts an uninterrupted run trains."""
        cfg, settings = self.cfg, self.cfg.async_training
        B = cfg.data.train_batch_size
        filtering = cfg.algorithm.filter_groups
        buffer = RolloutBuffer(groups_per_step=B, max_staleness=settings.max_staleness,
                               stale_policy=settings.stale_policy,
                               filter_metric=filtering.metric if filtering.enable else None,
                               max_filtered_batches=filtering.max_num_gen_batches)
        if self._buffer_state is not None:
            self._again = buffer.load_state_dict(*self._buffer_state)
            done = sum(r.status is GroupStatus.DONE for r in buffer.records.values())
            self.console(f"rollout buffer restored: {done} generated groups not yet trained, {len(self._again)} "
                         f"generating at the save (generated again with their seeds)")
            self._buffer_state = None
        else:  # a fresh run, or a checkpoint of a synchronous one: groups from the loader's position on
            buffer.head = buffer.next_index = buffer.kept_or_pending = self.loader.position * B
        manager = build_rollout_manager(cfg, self.roles.generator, self.engines, self.tokenizer, self.plugins,
                                        self.routing_shape)

        def prompts_of(group: int) -> Batch:
            number, row = divmod(group, B)
            index = self.loader.rows_of(number)[row]
            prompt = self.train_set.collate([self.train_set[index]])
            prompt.non_tensors["uid"] = [f"{number + 1}-{row}"]  # the synchronous run's uid
            return prompt

        return RolloutProducer(manager, buffer, prompts_of=prompts_of, score=self._score,
                               base_seed=derive_seed(cfg.rollout_seed, SEED_STREAM_ASYNC_ROLLOUT),
                               max_inflight=settings.max_inflight_groups or B * (settings.max_staleness + 1),
                               partial_rollout=settings.partial_rollout, pause_mode=settings.pause_mode)

    # ================================================================================ resume
    def _trainer_state(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(), "recipe": self.cfg.recipe}

    def _maybe_resume(self) -> None:
        path = self._resume_from
        if path is None:
            return
        state = load_trainer_state(path)
        self.actor_wg.call_all(ActorWorker.load_checkpoint, str(path / "actor"))
        if self.use_critic:
            self.critic_wg.call_all(CriticWorker.load_checkpoint, str(path / "critic"))
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if (path / "rollout_buffer").is_dir():
            if self.cfg.trainer.mode == "sync":
                self.console(f"{path / 'rollout_buffer'}: the groups generated ahead by the asynchronous run are "
                             f"not used by trainer.mode=sync (the run continues from the loader's position)")
            else:
                self._buffer_state = load_state(path / "rollout_buffer")
        self.console(f"resumed from {path} at step {self.global_step}")

    def save_checkpoint(self) -> Path:
        """A checkpoint of the current step: actor (and critic) with optimizer and RNG, trainer state."""
        tmp = self.checkpoints.begin(self.global_step)
        self.actor_wg.call_all(ActorWorker.save_checkpoint, str(tmp / "actor"))
        if self.use_critic:
            self.critic_wg.call_all(CriticWorker.save_checkpoint, str(tmp / "critic"))
        if self.cfg.trainer.export_hf:
            self.actor_wg.call_all(ActorWorker.export_hf, str(tmp / "actor_hf"))
        if self.producer is not None:  # the groups generated ahead, and those generating (issued again at resume)
            save_state(tmp / "rollout_buffer", self.producer.state())
        return self.checkpoints.commit(self.global_step, tmp, self._trainer_state())

    # ================================================================================ stages
    # ------------------------------------------------------------------ memory between phases
    def _engines_release_memory(self) -> bool:
        rollout = self.cfg.actor_rollout_ref.rollout
        return self.cfg.actor_rollout_ref.hybrid_engine and rollout.free_cache_engine

    def _release_engines(self, *, weights: bool) -> None:
        """Colocated engines give their memory to training after generating: the KV cache and CUDA graphs, and the
        weights too when a weight sync follows before the next generation (released weights hold garbage)."""
        if not self._engines_release_memory():
            return
        tags = ["kv_cache", "cuda_graph", *(["weights"] if weights else [])]
        gather_sync([engine.release_memory_occupation(tags) for engine in self.engines])
        self._released_tags.update(tags)

    def _resume_engines(self, tags: Sequence[str]) -> None:
        """Take back the released memory of ``tags`` (SGLang refuses to resume a tag that was not released):
        ``weights`` before a sync, ``kv_cache`` and ``cuda_graph`` after it."""
        todo = [tag for tag in tags if tag in self._released_tags]
        if todo:
            gather_sync([engine.resume_memory_occupation(todo) for engine in self.engines])
            self._released_tags.difference_update(todo)

    def _offload_flags(self, role: str) -> dict[str, bool]:
        if role == "critic":
            critic = self.cfg.critic
            return {"params": critic.param_offload, "grads": critic.grad_offload,
                    "optimizer": critic.optimizer_offload}
        arr = self.cfg.actor_rollout_ref
        return {"params": arr.actor.param_offload, "grads": arr.actor.grad_offload,
                "optimizer": arr.actor.optimizer_offload, "ref_params": self.use_ref and arr.ref.param_offload}

    def _offload(self, role: str) -> None:
        """Move a role's weights/gradients/optimizer states to host memory (``<role>.*_offload``; GPU only)."""
        flags = self._offload_flags(role)
        if any(flags.values()):
            (self.critic_wg if role == "critic" else self.actor_wg).call_all(ActorWorker.offload, **flags)

    def _onload(self, role: str) -> None:
        if any(self._offload_flags(role).values()):
            (self.critic_wg if role == "critic" else self.actor_wg).call_all(ActorWorker.onload)

    def _sync_weights(self, step: int) -> dict[str, float]:
        """Stream the actor's weights into the engines (resumed first) and verify them."""
        rollout = self.cfg.actor_rollout_ref.rollout
        self._resume_engines(["weights"])
        names = verify_sample(self.weight_names, rollout.verify_weights, step)
        with self.producer.weight_update(step) if self.producer is not None else _flushing() as flush:
            stats = [s for s in self.actor_wg.call_all(
                ActorWorker.sync_weights, self.roles.engine_targets, transport=self.roles.weight_transport,
                bucket_bytes=rollout.bucket_mb << 20, engine_dtype=rollout.dtype, verify_names=names,
                weight_version=str(step), flush_cache=flush) if s]
        self._resume_engines(["kv_cache", "cuda_graph"])
        return merge_stats(stats)

    def _balance(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        lengths = batch["attention_mask"].sum(-1).tolist()
        parts = balanced_partitions(lengths, self.actor_dp)
        metrics.update(balance_stats(lengths, parts))
        return batch.reorder([i for part in parts for i in part])

    def _select(self, batch: Batch, keys) -> Batch:
        """The columns a role needs; meta: the rollout's sampling temperature."""
        out = batch.select(*[k for k in keys if k in batch])
        out.meta = {"temperature": batch.meta["temperature"]}
        return out

    def _experience(self, batch: Batch, metrics: dict[str, float], timing: dict[str, float]) -> Batch:
        """Old log-probs, reference log-probs and values, at the rollout's temperature (the batch's meta)."""
        temperature = batch.meta["temperature"]
        with timer("old_log_prob", timing):
            batch = batch.union(self.actor_wg.call_dp(ActorWorker.compute_log_prob, self._select(batch, ACTOR_KEYS),
                                                      temperature=temperature))
        if "rollout_log_probs" in batch:
            metrics.update(mismatch_metrics(batch["rollout_log_probs"], batch["old_log_probs"],
                                            batch["response_mask"]))
        if "routing_counts" in batch:
            metrics.update(routing_metrics(batch.pop("routing_counts")["routing_counts"]))
        if self.use_ref:
            with timer("ref", timing):
                batch = batch.union(self.actor_wg.call_dp(ActorWorker.compute_ref_log_prob,
                                                          self._select(batch, ACTOR_KEYS), temperature=temperature))
        if self.use_critic:
            self._onload("critic")
            with timer("values", timing):
                batch = batch.union(self.critic_wg.call_dp(CriticWorker.compute_values,
                                                           self._select(batch, CRITIC_KEYS)))
        return batch

    def _advantages(self, batch: Batch, metrics: dict[str, float]) -> None:
        algo = self.cfg.algorithm
        if algo.use_kl_in_reward:
            metrics.update(apply_kl_penalty(batch, self.kl_ctrl, algo.kl_penalty))
        else:
            batch["token_level_rewards"] = batch["token_level_scores"]
        advantages.compute(algo.adv_estimator, batch, gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten,
                           norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)

    def _update(self, batch: Batch, step: int, metrics: dict[str, float], timing: dict[str, float]) -> None:
        """Critic update, then actor update and weight sync (after the critic warm-up)."""
        if self.use_critic:
            with timer("update_critic", timing):
                outs = self.critic_wg.call_dp(CriticWorker.update_critic, self._select(batch, CRITIC_KEYS), seed=step)
                metrics.update(mean_dicts(outs))
            self._offload("critic")
        if self.cfg.trainer.critic_warmup <= self.global_step:
            with timer("update_actor", timing):
                outs = self.actor_wg.call_dp(ActorWorker.update_actor, self._select(batch, ACTOR_KEYS),
                                             temperature=batch.meta["temperature"], seed=step)
                metrics.update(mean_dicts(outs))
            with timer("sync_weights", timing):
                metrics.update(self._sync_weights(step))
        else:  # critic warm-up: the engines kept their weights (nothing to sync)
            self._resume_engines(["kv_cache", "cuda_graph"])
        self._offload("actor")

    def train_step(self) -> dict[str, float]:
        """One PPO/GRPO iteration (the digest's stages); returns its metrics."""
        cfg = self.cfg
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        step = self.global_step + 1
        with timer("step", timing):
            batch = self._rollout(step, metrics, timing)
            self._release_engines(weights=cfg.trainer.critic_warmup <= self.global_step)
            metrics.update(self._rollout_metrics(batch, step))
            self._onload("actor")
            if cfg.trainer.balance_batch:
                batch = self._balance(batch, metrics)
            extra = reward_columns(list(batch.pop(REWARD_EXTRA)[REWARD_EXTRA]))
            metrics.update(self._leave_out_unscored(batch, extra, step))
            batch = self._experience(batch, metrics, timing)
            with timer("adv", timing):
                self._advantages(batch, metrics)
            self._update(batch, step, metrics, timing)
            if cfg.trainer.rollout_data_dir:
                with timer("dump_rollout_generations", timing):
                    self._dump(batch, extra, step)
        self.global_step = step
        metrics.update(self._step_metrics(batch, extra, timing))
        if self.producer is not None:  # idle shares of the step: the trainer waiting for groups, no group generating
            metrics["async/trainer_idle_frac"] = min(1.0, metrics["async/trainer_wait_s"] / timing["step"])
            metrics["async/engine_idle_frac"] = max(0.0, 1.0 - self.producer.take_busy() / timing["step"])
        return metrics

    def _rollout(self, step: int, metrics: dict[str, float], timing: dict[str, float]) -> Batch:
        """Step ``step``'s trajectories, scored: generated now (``sync``), or taken from the asynchronous producer
        (whole groups in prompt order, generated and scored ahead within ``async_training.max_staleness``). With
        ``algorithm.filter_groups`` only groups whose samples differ are kept (DAPO)."""
        cfg = self.cfg
        if self.producer is None:
            return self._generate_sync(step, metrics, timing)
        if step == self.global_step + 1 and not self.producer.started:
            self.producer.start(self.global_step, self._again)
        with timer("gen", timing):
            batch = self.producer.take(step, timeout_s=cfg.trainer.worker_timeout_s)
        metrics["async/trainer_wait_s"] = timing["gen"]
        self.loader.seek(-(-self.producer.consumed // cfg.data.train_batch_size))  # batches begun: the epoch
        metrics.update(staleness_metrics(batch, step, self.producer))
        if "rollout_weight_versions" in batch:
            self._histograms["async/staleness"] = sample_staleness(batch, step)
        return batch

    def _generate_sync(self, step: int, metrics: dict[str, float], timing: dict[str, float]) -> Batch:
        """Generate and score the loader's next batch; under ``algorithm.filter_groups`` more batches (seeded by
        their number within the step) until ``data.train_batch_size`` groups with signal are kept."""
        cfg = self.cfg
        B, filtering = cfg.data.train_batch_size, cfg.algorithm.filter_groups
        sampler = DynamicSamplingBuffer(B, filtering.metric, filtering.max_num_gen_batches)
        while True:
            number = sampler.num_gen_batches
            prompts = self.loader.next()
            prompts.non_tensors["uid"] = [f"{step}-{number * B + i}" for i in range(len(prompts))]
            seed = derive_seed(cfg.rollout_seed, SEED_STREAM_ROLLOUT, step, *([number] if number else []))
            with timer("gen", timing):
                batch = self.rollout_manager.generate(prompts, seed=seed)
            with timer("reward", timing):
                batch = self._score(batch)
            if not filtering.enable:
                return batch
            sampler.add(batch)
            if sampler.ready:
                metrics["dapo/gen_batches"] = float(sampler.num_gen_batches)
                metrics["dapo/groups_filtered"] = float(sampler.num_groups_dropped)
                return sampler.take()

    def _score(self, batch: Batch) -> Batch:
        """``token_level_scores`` and the reward function's per-row extras (:data:`REWARD_EXTRA`) of ``batch``;
        one call at a time (the asynchronous producer scores its groups from several threads)."""
        with self._reward_lock:
            scores, extra = self.reward_fn(batch)
        batch["token_level_scores"] = scores
        batch[REWARD_EXTRA] = [{key: values[i] for key, values in extra.items()} for i in range(len(batch))]
        return batch

    def _step_metrics(self, batch: Batch, extra: dict[str, list], timing: dict[str, float]) -> dict[str, float]:
        metrics = data_metrics(batch, use_critic=self.use_critic)
        if "acc" in extra and all(v is not None for v in extra["acc"]):
            metrics["critic/acc/mean"] = sum(float(v) for v in extra["acc"]) / len(extra["acc"])
        num_tokens = int(batch["attention_mask"].sum())
        metrics.update(timing_metrics(timing, num_tokens=num_tokens,
                                      num_response_tokens=int(batch["response_mask"].sum())))
        metrics.update(throughput_metrics(timing, num_tokens=num_tokens, num_ranks=self.cfg.trainer.world_size))
        metrics.update(self._overhead(timing))
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def _rollout_metrics(self, batch: Batch, step: int) -> dict[str, float]:
        """Finish reasons and multi-turn counters of the step's trajectories; failed ones are counted and
        reported, and too many of them stop the run (``rollout.max_failed_frac``)."""
        failed = check_failed_rollouts(batch, self.cfg.actor_rollout_ref.rollout.max_failed_frac, f"step {step}")
        if failed:
            self.console(f"step {step}: {failed} of {len(batch)} rollouts failed (finish reason 'abort'; the "
                         f"rollout log says why); they train with an all-zero loss mask")
        return rollout_metrics(batch)

    def _leave_out_unscored(self, batch: Batch, extra: dict[str, list], step: int) -> dict[str, float]:
        """Rows the reward function could not score (``reward_model.on_error=skip``) get an all-zero loss mask;
        they are counted (``reward/num_errors``) and the first error is shown."""
        if self.cfg.reward_model.on_error != "skip":
            return {}
        errors = [i for i, error in enumerate(extra.get("reward_error", [])) if error]
        if errors:
            batch["response_mask"][errors] = 0
            self.console(f"step {step}: {len(errors)} of {len(batch)} rows could not be scored and are left out of "
                         f"the update (reward_model.on_error=skip); the first: {extra['reward_error'][errors[0]]}")
        return {"reward/num_errors": float(len(errors))}

    def _overhead(self, timing: dict[str, float]) -> dict[str, float]:
        """Worker compute per role (the busiest rank) and the rest of the step: the controller's overhead."""
        metrics = {}
        for group in self.roles.groups:
            if group is not self.rollout_wg:  # engine servers are separate processes: timed by the manager
                metrics[f"perf/busy_s/{group.role}"] = max(group.call_all(Worker.take_busy))
        metrics["perf/busy_s/rollout"] = self.rollout_manager.take_busy()
        busy = sum(metrics.values())
        step = timing["step"]
        metrics["perf/controller_overhead_s"] = max(step - busy, 0.0)
        metrics["perf/controller_overhead_frac"] = metrics["perf/controller_overhead_s"] / max(step, 1e-9)
        return metrics

    def _decode(self, batch: Batch) -> tuple[list[str], list[str], list[float]]:
        """Prompts, responses (their every token, tool outputs included) and sequence scores of ``batch``, decoded."""
        decode = self.tokenizer.batch_decode
        prompts = decode(batch["prompts"].tolist(), skip_special_tokens=True)
        valid = batch["attention_mask"][:, -batch["responses"].shape[1]:]
        responses = decode([r[: int(m.sum())] for r, m in zip(batch["responses"].tolist(), valid)],
                           skip_special_tokens=True)
        return prompts, responses, batch["token_level_scores"].sum(-1).tolist()

    def _dump(self, batch: Batch, extra: dict[str, list], step: int) -> None:
        prompts, responses, scores = self._decode(batch)
        columns = {**extra, "uid": list(batch["uid"])}
        if "rollout_weight_versions" in batch:  # the weight versions that sampled each trajectory (oldest, newest)
            oldest, newest, _ = sample_versions(batch)
            columns["weight_versions"] = [[a, b] for a, b in zip(oldest.tolist(), newest.tolist())]
        dump_generations(self.cfg.trainer.rollout_data_dir, step, prompts=prompts, responses=responses, scores=scores,
                         extra=columns)

    def validate(self) -> dict[str, float]:
        """Generate for the validation prompts (``val_kwargs`` sampling) and score them; the first
        ``trainer.log_val_generations`` samples are logged."""
        if self.val_set is None:
            return {}
        size = self.cfg.data.val_batch_size or len(self.val_set)
        wanted = self.cfg.trainer.log_val_generations
        scores: dict[str, list[float]] = {}
        samples: list[dict[str, Any]] = []
        num_errors = 0
        for round_, start in enumerate(range(0, len(self.val_set), size)):
            prompts = self.val_set.collate([self.val_set[i] for i in range(start, min(start + size, len(self.val_set)))])
            out = self.rollout_manager.generate(
                prompts, validate=True,
                seed=derive_seed(self.cfg.rollout_seed, SEED_STREAM_VALIDATION, self.global_step, round_))
            check_failed_rollouts(out, self.cfg.actor_rollout_ref.rollout.max_failed_frac,
                                  f"validation at step {self.global_step}, round {round_}")
            token_scores, extra = self.val_reward_fn(out)
            errors = extra.get("reward_error", [None] * len(out))
            for source, score, error in zip(out["data_source"], token_scores.sum(-1).tolist(), errors, strict=True):
                if error:  # reward_model.on_error=skip: counted, left out of the means
                    num_errors += 1
                else:
                    scores.setdefault(str(source), []).append(score)
            if len(samples) < wanted:
                out["token_level_scores"] = token_scores
                texts = zip(*self._decode(out.reorder(list(range(min(wanted - len(samples), len(out)))))))
                samples += [{"input": p, "output": r, "score": s} for p, r, s in texts]
        if samples:
            self.tracker.log_generations(samples, self.global_step)
        metrics = {f"val/{source}/reward/mean": sum(v) / len(v) for source, v in scores.items()}
        every = [s for v in scores.values() for s in v]
        metrics["val/reward/mean"] = sum(every) / len(every) if every else float("nan")
        if self.cfg.reward_model.on_error == "skip":
            metrics["val/reward/num_errors"] = float(num_errors)
        return metrics

    # ================================================================================ the loop
    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``; returns the last step's metrics (with the final validation)."""
        self.setup()
        trainer = self.cfg.trainer
        last: dict[str, float] = {}
        try:
            if self.val_set is not None and (trainer.val_before_train or trainer.val_only):
                with timer("testing", timing := {}):
                    val = self.validate()
                self.tracker.log({**val, "timing_s/testing": timing["testing"]}, step=self.global_step)
                if trainer.val_only:
                    return val
            bar = tqdm(total=self.total_steps, initial=self.global_step, desc="training", unit="step",
                       dynamic_ncols=True, disable=None)
            while self.global_step < self.total_steps:
                last = self._step_and_bookkeeping()
                bar.update(1)
                bar.set_postfix(score=f"{last.get('critic/score/mean', float('nan')):.3f}")
            bar.close()
        finally:
            self.tracker.close()
        return last

    def _step_and_bookkeeping(self) -> dict[str, float]:
        """One step, then validation and checkpoint when due; the metrics are logged and kept in ``history``."""
        trainer = self.cfg.trainer
        metrics = self.train_step()
        step, is_last = self.global_step, self.global_step >= self.total_steps
        if self.val_set is not None and trainer.test_freq > 0 and (is_last or step % trainer.test_freq == 0):
            with timer("testing", timing := {}):
                metrics.update(self.validate())
            metrics["timing_s/testing"] = timing["testing"]
        if trainer.save_freq > 0 and (is_last or step % trainer.save_freq == 0):
            start = time.perf_counter()
            metrics["checkpoint/path_step"] = float(step)
            self.last_checkpoint = self.save_checkpoint()
            metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
        bad = sorted(k for k, v in metrics.items() if not math.isfinite(v) and "grad_norm" not in k)
        if bad:
            logger.warning("step %d: non-finite metrics %s", step, bad)
        self.tracker.log(metrics, step=step)
        self.tracker.log_histograms(self._histograms, step=step)
        self._histograms = {}
        self.history.append((step, metrics))
        return metrics

    def shutdown(self) -> None:
        """Kill the workers and give the resources back (and stop Ray if this trainer started it)."""
        if self.producer is not None:
            self.producer.stop()
            self.producer.manager.close()
            self.producer = None
        if self.rollout_manager is not None:
            self.rollout_manager.close()
            self.rollout_manager = None
        if self.roles is not None:
            for client in [self.roles.generator, *self.roles.engines]:
                client.close_all()
            self.roles.shutdown()
            self.roles = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None
