"""The single controller: the PPO/GRPO step loop (docs/design.md, 'One step') over roles built by ``controller.build``.

``Trainer(cfg).fit()`` on the driver. :meth:`Trainer.train_step` is the step, one named phase per line:
generate (or take from the asynchronous producer) and score, release the engines' memory, check the
rollouts, balance, old log-probs, reference, the reward stage (:mod:`megarl.controller.reward_stage`), values,
advantages, critic update, actor update, weight sync, memory moves; then validation, checkpoint and metrics
(:meth:`Trainer.fit`).

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
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

from megarl.algo import advantages
from megarl.algo.kl import build_kl_controller
from megarl.algo.mismatch import mismatch_metrics, routing_metrics
from megarl.config.schema import RunConfig
from megarl.controller import role_memory
from megarl.controller.build import (
    RayConnection,
    Roles,
    build_datasets,
    build_reward_managers,
    build_roles,
    build_rollout_manager,
    init_ray,
    load_agent_plugins,
)
from megarl.controller.correction import correct_rollouts
from megarl.controller.engine_memory import TRAINING_TAGS, EngineMemory
from megarl.controller.generate import decode_responses
from megarl.controller.interrupts import interrupts_deferred
from megarl.controller.judge import build_judge
from megarl.controller.metrics import (
    ValidationRows,
    check_failed_rollouts,
    data_metrics,
    mean_dicts,
    rollout_metrics,
    sample_versions,
    throughput_metrics,
    timer,
    timing_metrics,
)
from megarl.controller.progress import Phases, run_summary
from megarl.controller.reward_stage import RewardStage, StageInputs, add_advantage_terms, extend_columns
from megarl.controller.rollout_source import AsyncRollout, RolloutSource, SyncRollout
from megarl.controller.run_checkpoints import CheckpointManager, RunLock, load_trainer_state, resolve_resume
from megarl.controller.run_inputs import (
    check_policy_support,
    check_resume_layout,
    check_run_inputs,
    prepare_policy,
    routing_shape,
)
from megarl.controller.tracking import Tracking, dump_generations, run_log_dir
from megarl.data.balance import balance_stats, balanced_partitions
from megarl.data.batch import Batch
from megarl.data.loader import PromptLoader
from megarl.parallel.shared_memory import SHARED_MEMORY_DIR, remove_shared_memory
from megarl.plan.preflight import preflight
from megarl.rollout.buffer import load_state, save_state
from megarl.rollout.manager import RolloutManager
from megarl.seeds import SEED_STREAM_VALIDATION, SEED_STREAM_VALIDATION_BOOTSTRAP, derive_seed
from megarl.sync import merge_stats, verify_sample
from megarl.workers.base import Worker
from megarl.workers.megatron_workers import ActorWorker, CriticWorker

logger = logging.getLogger("megarl.train")


class RunInputError(ValueError):
    """Something the config names outside itself (model or data files, the resume path, the machine) is wrong;
    raised before anything is placed, with the key to change."""

ACTOR_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages",
              "ref_log_prob", "rollout_log_probs", "rollout_routed_experts", "rollout_is_weights", "multi_modal_inputs")
CRITIC_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "values", "returns", "multi_modal_inputs")
"""The columns each role's workers receive; ``response_mask`` (the tokens that train, as the rollout emits it) is
the one loss mask of every role."""


class Trainer:
    """PPO/GRPO on Megatron workers and rollout engines placed by Ray (see the module docstring).

    ``cfg`` comes from :func:`megarl.config.load_config`, which has validated it.
    """

    def __init__(self, cfg: RunConfig, *, console=print):
        self.cfg = cfg
        self._console, self._bar = console, None
        self.phases = Phases(self.console)
        """Start-up phases and checkpoint saves, printed as they start and end; their durations."""
        trainer = cfg.trainer
        self.run_dir = cfg.run_dir
        self.log_dir = run_log_dir(trainer)
        self.global_step = 0
        self.history: list[tuple[int, dict[str, float]]] = []
        """(step, metrics) of every step this trainer ran."""
        self.validations: list[tuple[int, dict[str, float]]] = []
        """(step, metrics) of every validation this trainer ran, the one before training included."""
        self._said_unverified = False  # the warning that the engines cannot be verified: once a run
        self.use_critic = cfg.critic.enable
        self.use_ref = cfg.needs_ref
        self.roles: Roles | None = None
        """The placed workers, engines and router (:func:`megarl.controller.build.build_roles`)."""
        self.rollout_manager: RolloutManager | None = None
        """Generation for validation (and for the synchronous rollout)."""
        self.reward: RewardStage | None = None
        """A row's reward (:mod:`megarl.controller.reward_stage`); ``val_reward``: validation's (its rollout-time
        sources)."""
        self.val_reward: RewardStage | None = None
        self.rollout: RolloutSource | None = None
        """Where each step's scored trajectories come from (:mod:`megarl.controller.rollout_source`)."""
        self.engine_memory: EngineMemory | None = None
        self.tracker: Tracking | None = None
        self._ray: RayConnection | None = None
        self.setup_s = 0.0
        """Seconds from the start of :meth:`fit` to the first step."""
        self.last_checkpoint: Path | None = None
        """The checkpoint this run saved last."""
        self._shut_down = False
        self._run_lock: RunLock | None = None

    def console(self, text: str) -> None:
        """A line for the person running the training: above the progress bar while it shows (``tqdm.write``, so
        the two never tear), else to the ``console`` the trainer was given."""
        if self._bar is not None and not self._bar.disable and self._console is print:
            tqdm.write(text)
        else:
            self._console(text)

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
            with self.phases("checking the run's inputs" + (" and the tiny warm start" if
                                                            cfg.actor_rollout_ref.model.init == "tiny_sft" else "")):
                check_run_inputs(cfg)
                self._resume_from = resolve_resume(self.run_dir, cfg.trainer.resume_mode,
                                                   cfg.trainer.resume_from_path)
                check_resume_layout(cfg, self._resume_from)
                prepare_policy(cfg)
                check_policy_support(cfg)
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
            self.rules, self.val_rules = build_reward_managers(cfg, self.tokenizer, self.train_set, self.val_set)
        except (ValueError, FileNotFoundError) as error:
            raise RunInputError(str(error)) from error
        self.loader = PromptLoader(self.train_set, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=cfg.trainer.seed)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * self.loader.batches_per_epoch
        removed = remove_shared_memory()  # buffers of dead processes: a run killed before it could unlink them
        if removed:
            self.console(f"removed {removed} shared-memory files in {SHARED_MEMORY_DIR} left by processes that no "
                         f"longer run (a killed run's weight-sync buffers)")
        # Before Ray and its reaper: a tracker's own process (wandb's service) is the driver's, ended at its exit,
        # not one of the run's processes the reaper ends at shutdown (before wandb's exit hook has spoken to it).
        self.tracker = Tracking.for_run(cfg, console=self.console)
        with interrupts_deferred("Ray has started"), self.phases("starting Ray"):  # then shutdown() stops it
            self._ray = init_ray(cfg, console=self.console)
        self.roles = build_roles(cfg, self.log_dir / "servers", phase=self.phases)
        arr = cfg.actor_rollout_ref
        self.engine_memory = EngineMemory(self.roles.engines,
                                          enabled=arr.hybrid_engine and arr.rollout.free_cache_engine,
                                          sync_rewrites_weights=not cfg.lora_syncs_adapters)
        self.rollout_manager = build_rollout_manager(cfg, self.roles.generator, self.roles.engines, self.tokenizer,
                                                     self.plugins, self.routing_shape)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(type=kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl,
                                           horizon=kl.horizon)
        self.checkpoints = CheckpointManager(self.run_dir, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep)
        self.checkpoints.clean_stale()
        buffer_state = self._maybe_resume()
        # The engines start from the trainer's (possibly resumed) weights; nothing generates yet: caches may flush.
        with self.phases("first weight sync"):  # the roles' state left the GPU before the engines started
            self._onload("actor")
            self._sync_weights(self.global_step, contextlib.nullcontext(True))
        judge = build_judge(cfg, self.roles.judge.generator) if self.roles.judge is not None else None
        self.reward = RewardStage.for_run(cfg, StageInputs(self.tokenizer, self.rules, judge, kl_ctrl=self.kl_ctrl),
                                          console=self.console)
        self.val_reward = RewardStage.for_run(cfg, StageInputs(self.tokenizer, self.val_rules, judge), validation=True)
        scorer = self.reward.score_rollout
        if cfg.trainer.mode == "sync":
            self.rollout = SyncRollout(cfg, self.loader, self.rollout_manager, scorer)
        else:  # its producer generates with the weights just synced
            manager = build_rollout_manager(cfg, self.roles.generator, self.roles.engines, self.tokenizer,
                                            self.plugins, self.routing_shape)
            self.rollout = AsyncRollout(cfg, self.loader, self.train_set, manager, scorer,
                                        global_step=self.global_step, buffer_state=buffer_state,
                                        console=self.console)
        self._offload("actor")  # onloaded for the first sync; the critic has stayed offloaded since build_roles

    # ================================================================================ resume
    def _trainer_state(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(), "recipe": self.cfg.recipe}

    def _maybe_resume(self) -> Any:
        """Load the checkpoint to resume from, if any; the rollout buffer it holds (asynchronous runs), else None."""
        path = self._resume_from
        if path is None:
            return None
        state = load_trainer_state(path)
        self.roles.actor.call_all(ActorWorker.load_checkpoint, str(path / "actor"))
        if self.use_critic:
            self.roles.group("critic").call_all(CriticWorker.load_checkpoint, str(path / "critic"))
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        buffer_state = None
        if (path / "rollout_buffer").is_dir():
            if self.cfg.trainer.mode == "sync":
                self.console(f"{path / 'rollout_buffer'}: the groups generated ahead by the asynchronous run are "
                             f"not used by trainer.mode=sync (the run continues from the loader's position)")
            else:
                buffer_state = load_state(path / "rollout_buffer")
        self.console(f"resumed from {path} at step {self.global_step}")
        return buffer_state

    def save_checkpoint(self) -> Path:
        """A checkpoint of the current step: actor (and critic) with optimizer and RNG, trainer state."""
        self.checkpoints.check_space(self.global_step)
        tmp = self.checkpoints.begin(self.global_step)
        try:
            self.roles.actor.call_all(ActorWorker.save_checkpoint, str(tmp / "actor"))
            if self.use_critic:
                self.roles.group("critic").call_all(CriticWorker.save_checkpoint, str(tmp / "critic"))
            if self.cfg.trainer.export_hf:
                self.roles.actor.call_all(ActorWorker.export_hf, str(tmp / "actor_hf"))
            buffer = self.rollout.state()
            if buffer is not None:  # the groups generated ahead, and those generating (issued again at resume)
                save_state(tmp / "rollout_buffer", buffer)
            return self.checkpoints.commit(self.global_step, tmp, self._trainer_state())
        except Exception as error:
            raise self.checkpoints.save_failed(self.global_step, tmp, error) from error

    # ================================================================================ stages
    # ------------------------------------------------------------------ memory between phases
    def _offload(self, role: str, *, params: bool = True, state: bool = True) -> None:
        """Move a role's weights/gradients/optimizer states to host memory (``<role>.*_offload``; GPU only)."""
        role_memory.offload(self.cfg, self._group_of(role), role, params=params, state=state)

    def _onload(self, role: str) -> None:
        role_memory.onload(self.cfg, self._group_of(role), role)

    @contextlib.contextmanager
    def _onloaded(self, role: str):
        """A role's weights on the GPU for the ``with`` block, back to the host after (its ``param_offload``)."""
        self._onload(role)
        try:
            yield
        finally:
            self._offload(role)

    def _group_of(self, role: str):
        return self.roles.group(role)

    # ================================================================================ the step
    def train_step(self) -> dict[str, float]:
        """One PPO/GRPO iteration, a named phase per line; returns its metrics."""
        step = self.global_step + 1
        syncs = self.cfg.trainer.critic_warmup <= self.global_step  # the actor trains, then its weights go out
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        with timer("step", timing):
            batch = self.rollout.take(step, metrics, timing)  # generated (or taken) and scored
            self.engine_memory.release(weights=syncs)
            metrics |= self._check_rollouts(batch, step)
            self._onload("actor")
            batch = self._balance(batch, metrics)
            batch = self._old_log_probs(batch, metrics, timing)
            batch = self._reference(batch, timing)
            batch, extra, rewarded = self.reward.score_step(batch, f"step {step}", timing, roles=self.roles,
                                                            around=self._onloaded)
            metrics |= rewarded
            batch = self._values(batch, timing)
            with timer("adv", timing):
                self._advantages(batch)
            metrics |= self._update_critic(batch, step, timing)
            if syncs:
                metrics |= self._update_actor(batch, step, timing)
                self._offload("actor", params=False)  # the update's state leaves before the engines' weights return
                with timer("update_weights", timing):  # verl's name
                    metrics |= self._sync_weights(step, self.rollout.weight_update(step))
                self._offload("actor", state=False)
            else:  # critic warm-up: the engines kept their weights (nothing to sync)
                self.engine_memory.resume(TRAINING_TAGS)
                self._offload("actor")
            if self.cfg.trainer.rollout_data_dir:
                with timer("dump_rollout_generations", timing):
                    self._dump(batch, extra, step)
        self.global_step = step
        metrics |= self._step_metrics(batch, extra, timing)
        self.rollout.finish_step(metrics, timing["step"])
        return metrics

    # ------------------------------------------------------------------ the step's phases
    def _check_rollouts(self, batch: Batch, step: int) -> dict[str, float]:
        """Finish reasons and multi-turn counters of the step's trajectories; failed ones are counted and
        reported, and too many of them stop the run (``rollout.max_failed_frac``)."""
        failed = check_failed_rollouts(batch, self.cfg.actor_rollout_ref.rollout.max_failed_frac, f"step {step}")
        if failed:
            self.console(f"step {step}: {failed} of {len(batch)} rollouts failed (finish reason 'abort'; the "
                         f"rollout log says why); they train with an all-zero loss mask")
        return rollout_metrics(batch)

    def _balance(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        """Rows reordered so every DP rank gets a similar token count (``trainer.balance_batch``)."""
        if not self.cfg.trainer.balance_batch:
            return batch
        lengths = batch["attention_mask"].sum(-1).tolist()
        parts = balanced_partitions(lengths, self.roles.actor.dp_size)
        metrics.update(balance_stats(lengths, parts))
        return batch.reorder([i for part in parts for i in part])

    def _select(self, batch: Batch, keys) -> Batch:
        """The columns a role needs; meta: the rollout's sampling temperature."""
        out = batch.select(*[k for k in keys if k in batch])
        out.meta = {"temperature": batch.meta["temperature"]}
        return out

    def _old_log_probs(self, batch: Batch, metrics: dict[str, float], timing: dict[str, float]) -> Batch:
        """The actor's log-probs of the rollout's tokens at the rollout's temperature (the batch's meta), how far they
        are from the engines' (``mismatch/*``) and the correction of that gap (``rollout_corr/*``), and how the routers
        agree with the engines' (``moe/*``)."""
        with timer("old_log_prob", timing):
            batch = batch.union(self.roles.actor.call_dp(ActorWorker.compute_log_prob, self._select(batch, ACTOR_KEYS),
                                                         temperature=batch.meta["temperature"]))
        if "rollout_log_probs" in batch:
            metrics.update(mismatch_metrics(batch["rollout_log_probs"], batch["old_log_probs"],
                                            batch["response_mask"]))
            metrics.update(correct_rollouts(self.cfg.algorithm.rollout_correction, batch))
        if "routing_counts" in batch:
            metrics.update(routing_metrics(batch.pop("routing_counts")["routing_counts"]))
        return batch

    def _reference(self, batch: Batch, timing: dict[str, float]) -> Batch:
        """The reference model's log-probs (``ref_log_prob``), when a KL needs them."""
        if not self.use_ref:
            return batch
        with timer("ref", timing):
            return batch.union(self.roles.actor.call_dp(ActorWorker.compute_ref_log_prob,
                                                        self._select(batch, ACTOR_KEYS),
                                                        temperature=batch.meta["temperature"]))

    def _values(self, batch: Batch, timing: dict[str, float]) -> Batch:
        """The critic's values of the response tokens (PPO with GAE)."""
        if not self.use_critic:
            return batch
        self._onload("critic")
        with timer("values", timing):
            return batch.union(self.roles.group("critic").call_dp(CriticWorker.compute_values,
                                                         self._select(batch, CRITIC_KEYS)))

    def _advantages(self, batch: Batch) -> None:
        """``advantages`` and ``returns`` of the reward stage's ``token_level_rewards``, with its ``advantage``
        sources' terms (the teacher's ``teacher.signal=advantage``) added."""
        algo = self.cfg.algorithm
        advantages.compute(algo.adv_estimator, batch, gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten,
                           norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)
        add_advantage_terms(batch)

    def _update_critic(self, batch: Batch, step: int, timing: dict[str, float]) -> dict[str, float]:
        """The critic's PPO epochs toward the returns; its memory goes to the host after (``critic.*_offload``)."""
        if not self.use_critic:
            return {}
        with timer("update_critic", timing):
            outs = self.roles.group("critic").call_dp(CriticWorker.update_critic, self._select(batch, CRITIC_KEYS), seed=step)
        self._offload("critic")
        return mean_dicts(outs)

    def _update_actor(self, batch: Batch, step: int, timing: dict[str, float]) -> dict[str, float]:
        """The actor's PPO epochs × mini-batches (one optimizer step each)."""
        with timer("update_actor", timing):
            return mean_dicts(self.roles.actor.call_dp(ActorWorker.update_actor, self._select(batch, ACTOR_KEYS),
                                                       temperature=batch.meta["temperature"], seed=step))

    def _sync_weights(self, step: int, engines_quiet: contextlib.AbstractContextManager[bool]) -> dict[str, float]:
        """Stream the actor's weights into the engines as version ``step`` (their weights resumed first, the rest
        of their memory after) and verify a sample of them. ``engines_quiet`` holds the rollout's requests off for
        the sync (:meth:`RolloutSource.weight_update`) and says whether the engines may flush their caches."""
        rollout = self.cfg.actor_rollout_ref.rollout
        self.engine_memory.resume(["weights"])
        names = verify_sample(self.roles.weight_names, rollout.verify_weights, step)
        with engines_quiet as flush:
            stats = [s for s in self.roles.actor.call_all(
                ActorWorker.sync_weights, self.roles.engine_targets,
                transport="adapters" if self.cfg.lora_syncs_adapters else self.roles.weight_transport,
                bucket_bytes=rollout.bucket_mb << 20, engine_dtype=rollout.dtype, verify_names=names,
                weight_version=str(step), flush_cache=flush, quantization=rollout.quantization) if s]
        self.engine_memory.resume(TRAINING_TAGS)
        merged = merge_stats(stats)
        unverified = merged.get("weight_sync/engines", 0) - merged.get("weight_sync/verified_engines", 0)
        if names and unverified and not self._said_unverified:
            self._said_unverified = True
            logger.warning("weight sync: %d of %d engines cannot be verified: they answer /get_weights_by_name with "
                           "an error or nothing whole (SGLang reads weights back from Llama-class models only, and "
                           "at TP > 1 only their gathered and replicated tensors); the engines' log-probs against "
                           "the trainer's (mismatch/abs_logp_diff_*) are the check of this run's syncs",
                           unverified, merged["weight_sync/engines"])
        return merged

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

    def _overhead(self, timing: dict[str, float]) -> dict[str, float]:
        """Worker compute per role (the busiest rank) and the rest of the step: the controller's overhead."""
        metrics = {}
        for group in self.roles.groups:
            if group is not self.roles.rollout:  # engine servers are separate processes: timed by the manager
                metrics[f"perf/busy_s/{group.role}"] = max(group.call_all(Worker.take_busy))
        metrics["perf/busy_s/rollout"] = self.rollout_manager.take_busy()
        busy = sum(metrics.values())
        step = timing["step"]
        metrics["perf/controller_overhead_s"] = max(step - busy, 0.0)
        metrics["perf/controller_overhead_frac"] = metrics["perf/controller_overhead_s"] / max(step, 1e-9)
        return metrics

    def _decode(self, batch: Batch) -> tuple[list[str], list[str], list[float]]:
        """Prompts, responses (their every token, tool outputs included) and sequence scores of ``batch``, decoded."""
        prompts = self.tokenizer.batch_decode(batch["prompts"].tolist(), skip_special_tokens=True)
        return prompts, decode_responses(batch, self.tokenizer), batch["token_level_scores"].sum(-1).tolist()

    def _dump(self, batch: Batch, extra: dict[str, list], step: int) -> None:
        prompts, responses, scores = self._decode(batch)
        columns = {**extra, "uid": list(batch["uid"])}
        if "rollout_weight_versions" in batch:  # the weight versions that sampled each trajectory (oldest, newest)
            oldest, newest, _ = sample_versions(batch)
            columns["weight_versions"] = [[a, b] for a, b in zip(oldest.tolist(), newest.tolist())]
        dump_generations(self.cfg.trainer.rollout_data_dir, step, prompts=prompts, responses=responses, scores=scores,
                         extra=columns)

    def validate(self) -> dict[str, float]:
        """Generate ``val_kwargs.n`` samples for each validation prompt (``val_kwargs`` sampling), score them and
        report verl's validation metrics (:func:`~megarl.controller.metrics.validation_metrics`); the first
        ``trainer.log_val_generations`` samples are logged."""
        if self.val_set is None:
            return {}
        size = self.cfg.data.val_batch_size or len(self.val_set)
        n = self.cfg.actor_rollout_ref.rollout.val_kwargs.n
        wanted = self.cfg.trainer.log_val_generations
        rows = ValidationRows(self.val_reward.unscored_keys)
        columns: dict[str, list] = {}
        samples: list[dict[str, Any]] = []
        for round_, start in enumerate(range(0, len(self.val_set), size)):
            prompts = self.val_set.collate([self.val_set[i] for i in range(start, min(start + size, len(self.val_set)))])
            out = self.rollout_manager.generate(
                prompts, validate=True,
                seed=derive_seed(self.cfg.rollout_seed, SEED_STREAM_VALIDATION, self.global_step, round_))
            check_failed_rollouts(out, self.cfg.actor_rollout_ref.rollout.max_failed_frac,
                                  f"validation at step {self.global_step}, round {round_}")
            token_scores, extra = self.val_reward.rollout_scores(out)
            extend_columns(columns, extra, len(out))
            rows.add(out["data_source"], token_scores.sum(-1).tolist(), extra, first_group=start, n=n)
            if len(samples) < wanted:
                out["token_level_scores"] = token_scores
                texts = zip(*self._decode(out.reorder(list(range(min(wanted - len(samples), len(out)))))))
                samples += [{"input": p, "output": r, "score": s} for p, r, s in texts]
        if samples:
            self.tracker.log_generations(samples, self.global_step)
        counts = self.val_reward.failure_metrics(columns, f"validation at step {self.global_step}", validation=True)
        return counts | rows.metrics(seed=derive_seed(self.cfg.rollout_seed, SEED_STREAM_VALIDATION_BOOTSTRAP,
                                                      self.global_step), count_errors=bool(rows.unscored_keys))

    # ================================================================================ the loop
    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``; returns the last step's metrics (with the final validation)."""
        trainer = self.cfg.trainer
        last: dict[str, float] = {}
        failed = True  # until the loop ends: the hosted trackers' runs then end as failed
        try:
            start = time.perf_counter()
            self.setup()
            self.setup_s = time.perf_counter() - start
            if self.val_set is not None and (trainer.val_before_train or trainer.val_only):
                with timer("testing", timing := {}):
                    val = self.validate()
                self.tracker.log({**val, "timing_s/testing": timing["testing"]}, step=self.global_step)
                self.validations.append((self.global_step, val))
                if trainer.val_only:
                    failed = False
                    return val
            self._bar = tqdm(total=self.total_steps, initial=self.global_step, desc="training", unit="step",
                             dynamic_ncols=True, disable=None)
            while self.global_step < self.total_steps:
                last = self._step_and_bookkeeping()
                self._bar.update(1)
                self._bar.set_postfix(score=f"{last.get('critic/score/mean', float('nan')):.3f}")
            self._bar.close()
            self._bar = None
            failed = False
        finally:
            if self.tracker is not None:
                self.tracker.close(failed=failed)
        return last

    def _step_and_bookkeeping(self) -> dict[str, float]:
        """One step, then validation and checkpoint when due; the metrics are logged and kept in ``history``."""
        trainer = self.cfg.trainer
        metrics = self.train_step()
        step, is_last = self.global_step, self.global_step >= self.total_steps
        if self.val_set is not None and trainer.test_freq > 0 and (is_last or step % trainer.test_freq == 0):
            with timer("testing", timing := {}):
                val = self.validate()
            self.validations.append((step, val))
            metrics.update(val)
            metrics["timing_s/testing"] = timing["testing"]
        if trainer.save_freq > 0 and (is_last or step % trainer.save_freq == 0):
            start = time.perf_counter()
            metrics["checkpoint/path_step"] = float(step)
            with self.phases(f"saving the checkpoint of step {step}"):
                self.last_checkpoint = self.save_checkpoint()
            metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
        bad = sorted(k for k, v in metrics.items() if not math.isfinite(v) and "grad_norm" not in k)
        if bad:
            logger.warning("step %d: non-finite metrics %s", step, bad)
        self.tracker.log(metrics, step=step)
        self.tracker.log_histograms(self.rollout.histograms, step=step)
        self.rollout.histograms.clear()
        self.history.append((step, metrics))
        return metrics

    def summary(self) -> list[str]:
        """The lines ``megarl-train`` prints when the run ends (:func:`megarl.controller.progress.run_summary`)."""
        export = None
        if self.last_checkpoint is not None:
            export = (f"megarl-convert mcore-to-hf --mcore {self.last_checkpoint} "
                      f"--out {self.run_dir}_hf/{self.last_checkpoint.name}")
        return run_summary(self.history, self.validations, setup_s=self.setup_s, log_dir=self.log_dir,
                           checkpoint=self.last_checkpoint, export_command=export)

    def shutdown(self) -> None:
        """Kill the workers and give the resources back (and stop Ray if this trainer started it)."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.tracker is not None:  # closed by fit; open here when setup() was called on its own
            self.tracker.close()
        if self.rollout is not None:
            self.rollout.close()
        if self.rollout_manager is not None:
            self.rollout_manager.close()
        if self.roles is not None:  # the object stays for inspection (names, plan, transport)
            self.roles.shutdown()
        if self._ray is not None:
            self._ray.shutdown()
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None
