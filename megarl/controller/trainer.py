"""The single controller: places the workers, then runs the PPO/GRPO step loop (seeds-digest §1.3).

``Trainer(cfg).fit()`` on the driver. Per step, in the digest's order::

    prompts -> rollout (engines) -> uid/repeat/union -> balance -> reward -> old log-probs (actor)
    -> reference log-probs -> values (critic) -> KL in reward -> advantages (driver)
    -> critic update -> actor update -> weight sync into the engines (verified) -> dumps
    -> validation -> checkpoint -> metrics

Everything that touches model weights runs in Ray workers; the driver holds the data, the
rewards, the advantages and the bookkeeping. Sampling is seeded by the step (training) or by
the validation round, and the data order by the epoch, so a resumed run repeats what the
uninterrupted run would have done.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from megarl.config.schema import RunConfig
from megarl.controller.metrics import data_metrics, throughput_metrics, timer, timing_metrics
from megarl.controller.tracking import Tracking, dump_generations
from megarl.data.batch import Batch

logger = logging.getLogger("megarl.train")

ACTOR_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "loss_mask_response", "old_log_probs",
              "advantages", "ref_log_prob", "rollout_log_probs")
CRITIC_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "loss_mask_response", "values", "returns")


def _seed(*parts: int) -> int:
    from megarl.rollout.hf_engine import derive_row_seed

    seed = parts[0]
    for part in parts[1:]:
        seed = derive_row_seed(seed, part)
    return seed


class PromptLoader:
    """Batches of prompts in a seeded order per epoch; its position is part of a checkpoint."""

    def __init__(self, dataset, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True):
        if len(dataset) < batch_size and drop_last:
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the {len(dataset)} training prompts; "
                             f"lower data.train_batch_size or add data")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last = drop_last
        self.epoch, self.index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def next(self) -> Batch:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        rows = self._order(self.epoch)[self.index * self.batch_size:(self.index + 1) * self.batch_size]
        self.index += 1
        return self.dataset.collate([self.dataset[i] for i in rows])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class Trainer:
    """PPO/GRPO on Megatron workers and rollout engines placed by Ray (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, console=print):
        from megarl.config.validate import validate

        validate(cfg)
        self.cfg = cfg
        self.console = console
        self.run_dir = Path(cfg.trainer.default_local_dir).expanduser() / cfg.trainer.project_name / \
            cfg.trainer.experiment_name
        self.log_dir = Path(cfg.trainer.log_dir).expanduser() / cfg.trainer.project_name / cfg.trainer.experiment_name
        self.global_step = 0
        self.history: list[tuple[int, dict[str, float]]] = []
        """(step, metrics) of every step this trainer ran."""
        self.use_critic = cfg.critic.enable
        self.use_ref = cfg.needs_ref
        self._groups: list = []
        self._pools: dict = {}
        self._started_ray = False

    # ================================================================================ set-up
    def _prepare_model(self) -> None:
        """Resolve the policy's HF directory (building the tiny SFT warm start when asked)."""
        model = self.cfg.actor_rollout_ref.model
        self.model_path = str(Path(model.path).expanduser())
        if model.init == "tiny_sft":
            from megarl.data.synthetic import ensure_addition_data
            from megarl.models.tiny_sft import ensure_tiny_sft

            train = [Path(f).expanduser() for f in self.cfg.data.train_files]
            val = [Path(f).expanduser() for f in self.cfg.data.val_files]
            if not all(p.exists() for p in train + val):
                ensure_addition_data(train[0].parent)
            kwargs = {}
            if getattr(model, "sft_batch_size", None):
                kwargs["batch_size"] = model.sft_batch_size
            ensure_tiny_sft(self.model_path, [str(p) for p in train], steps=model.sft_steps, lr=model.sft_lr,
                            seed=self.cfg.trainer.seed, stop_reward=model.sft_stop_reward, **kwargs)
        elif not Path(self.model_path).is_dir():
            raise ValueError(f"actor_rollout_ref.model.path={model.path!r} is not a directory; give an HF model "
                             f"directory (convert hub checkpoints with megarl-convert) or use model.init=tiny_sft")
        self.tokenizer_path = str(Path(model.tokenizer_path or self.model_path).expanduser())

    def _prepare_data(self) -> None:
        from transformers import AutoTokenizer

        from megarl.data.dataset import PromptDataset
        from megarl.reward import RewardManager

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        kwargs = cfg.data.dataset_kwargs()
        if cfg.actor_rollout_ref.rollout.multi_turn.enable:
            kwargs["return_raw_chat"] = True
        self.train_set = PromptDataset(cfg.data.train_files, self.tokenizer, **kwargs)
        self.val_set = PromptDataset(cfg.data.val_files, self.tokenizer, **kwargs) if cfg.data.val_files else None
        for name, ds in (("train", self.train_set), ("val", self.val_set)):
            if ds is not None and ds.num_filtered_overlong:
                self.console(f"{name} data: {ds.num_filtered_overlong} of {ds.num_rows_read} prompts were longer than "
                             f"data.max_prompt_length={cfg.data.max_prompt_length} and were dropped")
        self.loader = PromptLoader(self.train_set, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=cfg.trainer.seed)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * self.loader.batches_per_epoch
        reward = cfg.reward_model
        custom = reward.custom_reward_function

        def manager(num_examine: int) -> RewardManager:
            return RewardManager(self.tokenizer, compute_score=custom.spec(), reward_kwargs=custom.reward_kwargs or None,
                                 scorer_kwargs=reward.scorer_kwargs, num_examine=num_examine)

        self.reward_fn = manager(reward.num_examine)
        self.val_reward_fn = manager(1)  # verl logs one decoded sample per data source in validation

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        trainer = self.cfg.trainer
        env = {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env})
        elif trainer.device == "cpu":
            ray.init(num_cpus=max(trainer.n_cpu_ranks, os.cpu_count() or 1), num_gpus=0, include_dashboard=False,
                     runtime_env={"env_vars": env}, logging_level=logging.WARNING, log_to_driver=True)
        else:
            ray.init(runtime_env={"env_vars": env}, include_dashboard=False, logging_level=logging.WARNING)
        self._started_ray = True

    def _place_workers(self) -> None:
        from megarl.config.validate import data_parallel_size
        from megarl.controller.placement import create_pools, engine_replica, make_placement
        from megarl.workers.group import WorkerGroup
        from megarl.workers.megatron_workers import ActorWorker
        from megarl.workers.rollout_worker import RemoteEngine, RolloutWorker

        cfg, trainer = self.cfg, self.cfg.trainer
        arr = cfg.actor_rollout_ref
        cpu = trainer.device == "cpu"
        nodes = [trainer.n_cpu_ranks] if cpu else [trainer.n_gpus_per_node] * trainer.nnodes
        actor_dims = arr.actor.parallel.to_dims()
        critic_dims = cfg.critic.parallel.to_dims() if self.use_critic else None
        engine_tp = 1 if arr.rollout.name == "hf" else (arr.rollout.tensor_model_parallel_size or actor_dims.tp)
        separate = not arr.hybrid_engine  # disaggregated: the engines get their own pool
        self.plan = make_placement(nodes=nodes, actor=actor_dims, critic=critic_dims, engine_tp=engine_tp,
                                   engine_layout=arr.rollout.engine_layout,
                                   rollout_nodes=list(arr.rollout.pool_nodes) if separate else None)
        self._pools = create_pools(self.plan, use_gpu=not cpu, cpus_per_bundle=1.0)
        pool = self._pools["global"]
        colocated = (1 if separate else 2) + (1 if self.use_critic else 0)  # actor(+ref), engines, critic
        share = 1.0 / colocated
        gpu = None if cpu else share
        timeout = 1800.0
        self.actor_wg = WorkerGroup(ActorWorker, pool, role="actor", num_cpus=share, num_gpus=gpu or 0.0,
                                    timeout_s=timeout)
        self._groups.append(self.actor_wg)
        dtype = arr.model.dtype
        optim = dataclasses.asdict(arr.actor.optim)
        if optim.get("decay_style") != "constant" and not optim.get("decay_steps"):
            optim["decay_steps"] = self.total_steps
        actor = arr.actor
        ppo_mini = actor.ppo_mini_batch_size * arr.rollout.n
        ppo = dict(ppo_mini_batch_size=ppo_mini, ppo_micro_batch_size_per_gpu=actor.ppo_micro_batch_size_per_gpu,
                   ppo_epochs=actor.ppo_epochs, clip_ratio_low=actor.clip_ratio_low,
                   clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c,
                   loss_agg_mode=actor.loss_agg_mode, entropy_coeff=actor.entropy_coeff,
                   use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
                   policy_loss_mode=actor.policy_loss_mode, tis_cap=actor.tis_cap, tis_level=actor.tis_level,
                   shuffle=actor.shuffle, use_dynamic_bsz=actor.use_dynamic_bsz,
                   ppo_max_token_len_per_gpu=actor.ppo_max_token_len_per_gpu)
        parallel = dataclasses.asdict(actor.parallel)
        self.actor_wg.call_all("init_model", model_path=self.model_path, parallel=parallel, optim=optim, ppo=ppo,
                               dtype=dtype, seed=trainer.seed, transformer=_transformer_overrides(actor, actor.parallel),
                               log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu or 16,
                               log_prob_max_token_len=(arr.rollout.log_prob_max_token_len_per_gpu
                                                       if arr.rollout.log_prob_use_dynamic_bsz else None))
        self.actor_wg.refresh_coordinates()
        if self.use_ref:
            self.actor_wg.call_all("init_ref", model_path=self.model_path, dtype=dtype, seed=trainer.seed,
                                   transformer=_transformer_overrides(None, actor.parallel),
                                   micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu or 16,
                                   max_token_len=(arr.ref.log_prob_max_token_len_per_gpu
                                                  if arr.ref.log_prob_use_dynamic_bsz else None))
        if self.use_critic:
            from megarl.workers.megatron_workers import CriticWorker

            self.critic_wg = WorkerGroup(CriticWorker, pool, role="critic", num_cpus=share, num_gpus=gpu or 0.0,
                                         timeout_s=timeout)
            self._groups.append(self.critic_wg)
            critic = cfg.critic
            self.critic_wg.call_all(
                "init_model", model_path=str(Path(critic.model_path or self.model_path).expanduser()),
                parallel=dataclasses.asdict(critic.parallel), optim=dataclasses.asdict(critic.optim),
                ppo=dict(ppo_mini_batch_size=critic.ppo_mini_batch_size * arr.rollout.n,
                         ppo_micro_batch_size_per_gpu=critic.ppo_micro_batch_size_per_gpu,
                         forward_micro_batch_size_per_gpu=critic.forward_micro_batch_size_per_gpu,
                         ppo_epochs=critic.ppo_epochs, cliprange_value=critic.cliprange_value,
                         loss_agg_mode=critic.loss_agg_mode, use_dynamic_bsz=critic.use_dynamic_bsz,
                         ppo_max_token_len_per_gpu=critic.ppo_max_token_len_per_gpu),
                dtype=dtype, seed=trainer.seed, transformer=_transformer_overrides(None, critic.parallel))
            self.critic_wg.refresh_coordinates()
        # Rollout engines: one worker per engine placement, on the first bundle it serves.
        engines = self.plan.engines
        rollout_pool = self._pools["rollout"] if separate else pool
        rollout_share = 1.0 if separate else share
        self.rollout_wg = WorkerGroup(RolloutWorker, rollout_pool, role="rollout",
                                      bundles=[e.bundles[0] for e in engines], num_cpus=rollout_share,
                                      num_gpus=0.0 if cpu else rollout_share, timeout_s=timeout)
        self._groups.append(self.rollout_wg)
        rollout = arr.rollout
        self.rollout_wg.call_ranks(
            [((), dict(name=rollout.name, model_path=self.model_path, dtype=rollout.dtype,
                       seed=_seed(trainer.seed, 7, i), tp_size=engine_tp or 1,
                       gpu_memory_utilization=rollout.gpu_memory_utilization, device=trainer.device))
             for i in range(len(engines))], "init_engine")
        self.engines = [RemoteEngine(h, replica=i) for i, h in enumerate(self.rollout_wg.actors)]
        dp = data_parallel_size(cfg, actor.parallel)
        self.actor_dp = dp
        # TP-matched engines serve the replica on whose GPUs they sit; others are dealt round-robin.
        owner = [engine_replica(e, dp) for e in engines]
        self.engines_by_replica = [[h for h, d in zip(self.rollout_wg.actors, owner) if d == replica]
                                   for replica in range(dp)]
        self.weight_names = self.actor_wg.call_rank(0, "weight_names")
        self._build_rollout_manager()

    def _build_rollout_manager(self) -> None:
        from megarl.rollout.manager import RolloutManager

        cfg = self.cfg
        rollout = cfg.actor_rollout_ref.rollout
        config = dataclasses.replace(cfg.rollout_config(),
                                     seed=rollout.seed if rollout.seed is not None else cfg.trainer.seed)
        tools = interactions = agent_cfg = None
        if rollout.multi_turn.enable:
            from megarl.rollout.interaction import load_interactions
            from megarl.rollout.tools.registry import load_tools

            agent_cfg = dataclasses.replace(cfg.agent_loop_config(), seed=config.seed)
            tools = load_tools(rollout.multi_turn.tool_config_path) if rollout.multi_turn.tool_config_path else None
            interactions = (load_interactions(rollout.multi_turn.interaction_config_path)
                            if rollout.multi_turn.interaction_config_path else None)
        self.rollout_manager = RolloutManager(self.engines, self.tokenizer, config, agent_loop_config=agent_cfg,
                                              tools=tools, interactions=interactions)

    def setup(self) -> None:
        """Everything before the first step: model, data, Ray, workers, resume, first weight sync."""
        from megarl.controller.checkpoint import CheckpointManager
        from megarl.algo.kl import build_kl_controller

        from megarl.controller.plan import preflight

        self._prepare_model()
        # GPU runs: the same memory/placement pre-flight as megarl-plan, before anything is placed.
        self.preflight_plan = preflight(self.cfg)
        self._prepare_data()
        self._init_ray()
        self._place_workers()
        kl = self.cfg.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(type=kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl,
                                           horizon=kl.horizon)
        self.checkpoints = CheckpointManager(self.run_dir, max_to_keep=self.cfg.trainer.max_actor_ckpt_to_keep)
        self.checkpoints.clean_stale()
        self._maybe_resume()
        self.tracker = Tracking(self.cfg.trainer.logger, self.log_dir, console=self.console)
        self._sync_weights(self.global_step)  # the engines start from the trainer's (possibly resumed) weights
        self._offload("actor")
        if self.use_critic:
            self._offload("critic")

    # ================================================================================ resume
    def _trainer_state(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(), "recipe": self.cfg.recipe}

    def _maybe_resume(self) -> None:
        from megarl.controller.checkpoint import load_trainer_state, resolve_resume

        trainer = self.cfg.trainer
        path = resolve_resume(self.run_dir, trainer.resume_mode, trainer.resume_from_path)
        if path is None:
            return
        state = load_trainer_state(path)
        self.actor_wg.call_all("load_checkpoint", str(path / "actor"))
        if self.use_critic:
            self.critic_wg.call_all("load_checkpoint", str(path / "critic"))
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.console(f"resumed from {path} at step {self.global_step}")

    def save_checkpoint(self) -> Path:
        """A checkpoint of the current step: actor (and critic) with optimizer and RNG, trainer state."""
        tmp = self.checkpoints.begin(self.global_step)
        self.actor_wg.call_all("save_checkpoint", str(tmp / "actor"))
        if self.use_critic:
            self.critic_wg.call_all("save_checkpoint", str(tmp / "critic"))
        if self.cfg.trainer.export_hf:
            self.actor_wg.call_all("export_hf", str(tmp / "actor_hf"))
        return self.checkpoints.commit(self.global_step, tmp, self._trainer_state())

    # ================================================================================ stages
    # ------------------------------------------------------------------ memory between phases
    def _release_engines(self) -> None:
        """Colocated engines give their memory (KV cache, weights) to training after generating."""
        rollout = self.cfg.actor_rollout_ref.rollout
        if self.cfg.actor_rollout_ref.hybrid_engine and rollout.free_cache_engine:
            self.rollout_wg.call_all("release_memory_occupation")

    def _resume_engines(self) -> None:
        rollout = self.cfg.actor_rollout_ref.rollout
        if self.cfg.actor_rollout_ref.hybrid_engine and rollout.free_cache_engine:
            self.rollout_wg.call_all("resume_memory_occupation")

    def _offload_flags(self, role: str) -> dict[str, bool]:
        section = self.cfg.critic if role == "critic" else self.cfg.actor_rollout_ref.actor
        return {"params": section.param_offload, "grads": section.grad_offload, "optimizer": section.optimizer_offload}

    def _offload(self, role: str) -> None:
        """Move a role's weights/gradients/optimizer states to host memory (``<role>.*_offload``; GPU only)."""
        flags = self._offload_flags(role)
        if any(flags.values()):
            (self.critic_wg if role == "critic" else self.actor_wg).call_all("offload", **flags)

    def _onload(self, role: str) -> None:
        if any(self._offload_flags(role).values()):
            (self.critic_wg if role == "critic" else self.actor_wg).call_all("onload")

    def _sync_weights(self, step: int) -> dict[str, float]:
        """Stream the actor's weights into the engines (resumed first) and verify them."""
        from megarl.workers.megatron_workers import verify_sample

        self._resume_engines()
        names = verify_sample(self.weight_names, self.cfg.actor_rollout_ref.rollout.verify_weights, step)
        stats = [s for s in self.actor_wg.call_all(
            "sync_weights", self.engines_by_replica, bucket_bytes=self.cfg.actor_rollout_ref.rollout.bucket_mb << 20,
            engine_dtype=self.cfg.actor_rollout_ref.rollout.dtype, verify_names=names) if s]
        if not stats:
            return {}
        metrics = {k: sum(s[k] for s in stats) for k in ("weight_sync/bytes", "weight_sync/verified_engines",
                                                          "weight_sync/engines")}
        metrics["weight_sync/seconds"] = max(s["weight_sync/seconds"] for s in stats)
        metrics["weight_sync/verified_tensors"] = stats[0]["weight_sync/verified_tensors"]
        metrics["weight_sync/gbps"] = metrics["weight_sync/bytes"] / max(metrics["weight_sync/seconds"], 1e-9) / 1e9
        return metrics

    def _balance(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        from megarl.data.balance import balance_stats, balanced_partitions

        lengths = batch["attention_mask"].sum(-1).tolist()
        parts = balanced_partitions(lengths, self.actor_dp)
        metrics.update(balance_stats(lengths, parts))
        return batch.reorder([i for part in parts for i in part])

    def _mask_key(self) -> str:
        return "loss_mask_response" if self.cfg.actor_rollout_ref.rollout.multi_turn.enable else "response_mask"

    def _select(self, batch: Batch, keys) -> Batch:
        present = [k for k in keys if k in batch]
        out = batch.select(*present)
        out.meta = {"mask_key": self._mask_key()}
        return out

    def train_step(self) -> dict[str, float]:
        """One PPO/GRPO iteration (the digest's stages); returns its metrics."""
        from megarl.algo import advantages as adv
        from megarl.algo.kl import apply_kl_penalty
        from megarl.algo.mismatch import mismatch_metrics

        cfg = self.cfg
        arr, algo = cfg.actor_rollout_ref, cfg.algorithm
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        step = self.global_step + 1
        temperature = arr.rollout.temperature or 1.0
        with timer("step", timing):
            prompts = self.loader.next()
            prompts.non_tensors["uid"] = [f"{step}-{i}" for i in range(len(prompts))]
            with timer("gen", timing):
                batch = self.rollout_manager.generate(prompts, seed=_seed(cfg.trainer.seed, 1, step))
            self._release_engines()
            metrics.update(self._rollout_metrics(batch, step))
            self._onload("actor")
            if cfg.actor_rollout_ref.rollout.multi_turn.enable:
                R = batch["responses"].shape[1]
                batch["loss_mask_response"] = batch["loss_mask"][:, -R:]
            if cfg.trainer.balance_batch:
                batch = self._balance(batch, metrics)
            with timer("reward", timing):
                scores, extra = self.reward_fn(batch)
                batch["token_level_scores"] = scores
            with timer("old_log_prob", timing):
                batch = batch.union(self.actor_wg.call_dp("compute_log_prob", self._select(batch, ACTOR_KEYS),
                                                          temperature=temperature))
            mask_key = self._mask_key()
            if "rollout_log_probs" in batch:
                metrics.update(mismatch_metrics(batch["rollout_log_probs"], batch["old_log_probs"], batch[mask_key]))
            if self.use_ref:
                with timer("ref", timing):
                    batch = batch.union(self.actor_wg.call_dp("compute_ref_log_prob", self._select(batch, ACTOR_KEYS),
                                                              temperature=temperature))
            if self.use_critic:
                self._onload("critic")
                with timer("values", timing):
                    batch = batch.union(self.critic_wg.call_dp("compute_values", self._select(batch, CRITIC_KEYS)))
            with timer("adv", timing):
                if algo.use_kl_in_reward:
                    metrics.update(apply_kl_penalty(batch, self.kl_ctrl, algo.kl_penalty, mask_key=mask_key))
                else:
                    batch["token_level_rewards"] = batch["token_level_scores"]
                adv.compute(algo.adv_estimator, batch, gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten,
                            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
                            multi_turn=arr.rollout.multi_turn.enable)
            if self.use_critic:
                with timer("update_critic", timing):
                    outs = self.critic_wg.call_dp("update_critic", self._select(batch, CRITIC_KEYS))
                    metrics.update(_mean_dicts(outs))
                self._offload("critic")
            if cfg.trainer.critic_warmup <= self.global_step:
                with timer("update_actor", timing):
                    outs = self.actor_wg.call_dp("update_actor", self._select(batch, ACTOR_KEYS),
                                                 temperature=temperature, seed=step)
                    metrics.update(_mean_dicts(outs))
                with timer("sync_weights", timing):
                    metrics.update(self._sync_weights(step))
            else:
                self._resume_engines()
            self._offload("actor")
            if cfg.trainer.rollout_data_dir:
                with timer("dump_rollout_generations", timing):
                    self._dump(batch, extra, step)
        self.global_step = step
        metrics.update(data_metrics(batch, use_critic=self.use_critic, mask_key=mask_key))
        for key in ("acc",):
            if key in extra and all(v is not None for v in extra[key]):
                metrics[f"critic/{key}/mean"] = sum(float(v) for v in extra[key]) / len(extra[key])
        num_tokens = int(batch["attention_mask"].sum())
        metrics.update(timing_metrics(timing, num_tokens=num_tokens,
                                      num_response_tokens=int(batch["response_mask"].sum())))
        metrics.update(throughput_metrics(timing, num_tokens=num_tokens, num_ranks=self.cfg.trainer.world_size))
        metrics.update(self._overhead(timing))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def _rollout_metrics(self, batch: Batch, step: int) -> dict[str, float]:
        """Finish reasons of the step's trajectories; aborted ones (failed requests) are counted and reported."""
        if "finish_reason" not in batch:
            return {}
        reasons = [str(r) for r in batch["finish_reason"]]
        metrics = {f"rollout/finish_{kind}_frac": reasons.count(kind) / len(reasons)
                   for kind in sorted(set(reasons))}
        aborted = reasons.count("abort")
        if aborted:
            self.console(f"step {step}: {aborted} of {len(reasons)} rollouts failed (finish reason 'abort'; the "
                         f"rollout log says why); they train with an all-zero loss mask")
        return metrics

    def _overhead(self, timing: dict[str, float]) -> dict[str, float]:
        """Worker compute per role (the busiest rank) and the rest of the step: the controller's overhead."""
        metrics = {}
        for group in self._groups:
            metrics[f"perf/busy_s/{group.role}"] = max(group.call_all("take_busy"))
        busy = sum(metrics.values())
        step = timing["step"]
        metrics["perf/controller_overhead_s"] = max(step - busy, 0.0)
        metrics["perf/controller_overhead_frac"] = metrics["perf/controller_overhead_s"] / max(step, 1e-9)
        return metrics

    def _dump(self, batch: Batch, extra: dict[str, list], step: int) -> None:
        decode = self.tokenizer.batch_decode
        prompts = decode(batch["prompts"].tolist(), skip_special_tokens=True)
        responses = decode([r[: int(m.sum())] for r, m in zip(batch["responses"].tolist(), batch["response_mask"])],
                           skip_special_tokens=True)
        scores = batch["token_level_scores"].sum(-1).tolist()
        dump_generations(self.cfg.trainer.rollout_data_dir, step, prompts=prompts, responses=responses, scores=scores,
                         extra={**extra, "uid": list(batch["uid"])})

    def validate(self) -> dict[str, float]:
        """Generate for the validation prompts (``val_kwargs`` sampling) and score them."""
        if self.val_set is None:
            return {}
        size = self.cfg.data.val_batch_size or len(self.val_set)
        scores: dict[str, list[float]] = {}
        for round_, start in enumerate(range(0, len(self.val_set), size)):
            prompts = self.val_set.collate([self.val_set[i] for i in range(start, min(start + size, len(self.val_set)))])
            out = self.rollout_manager.generate(prompts, validate=True,
                                               seed=_seed(self.cfg.trainer.seed, 2, self.global_step, round_))
            token_scores, _ = self.val_reward_fn(out)
            for source, score in zip(out["data_source"], token_scores.sum(-1).tolist()):
                scores.setdefault(str(source), []).append(score)
        metrics = {f"val/{source}/reward/mean": sum(v) / len(v) for source, v in scores.items()}
        every = [s for v in scores.values() for s in v]
        metrics["val/reward/mean"] = sum(every) / len(every)
        return metrics

    # ================================================================================ the loop
    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``; returns the last step's metrics (with the final validation)."""
        from tqdm import tqdm

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
                self.history.append((step, metrics))
                bar.update(1)
                bar.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
                last = metrics
            bar.close()
        finally:
            self.tracker.close()
        return last

    def shutdown(self) -> None:
        """Kill the workers and give the resources back (and stop Ray if this trainer started it)."""
        import ray

        for group in self._groups:
            group.shutdown()
        self._groups = []
        for pool in self._pools.values():
            pool.remove()
        self._pools = {}
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _transformer_overrides(section, parallel) -> dict[str, Any]:
    """Megatron TransformerConfig fields of a role: sequence parallelism and activation recomputation."""
    out: dict[str, Any] = {}
    if parallel.sequence_parallel:
        out["sequence_parallel"] = True
    granularity = getattr(section, "recompute_granularity", None)
    if granularity:
        out["recompute_granularity"] = granularity
        if granularity == "full":
            out["recompute_method"] = "uniform"
            out["recompute_num_layers"] = section.recompute_num_layers
    return out


def _mean_dicts(outputs) -> dict[str, float]:
    """Average the metric dicts of the DP replicas (``None`` entries skipped)."""
    dicts = [o for o in (outputs if isinstance(outputs, list) else [outputs]) if o]
    if not dicts:
        return {}
    keys = dicts[0].keys()
    return {k: sum(float(d[k]) for d in dicts) / len(dicts) for k in keys}
