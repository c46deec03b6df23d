"""The Megatron roles as Ray workers: actor (with the reference policy), critic, teacher and reward model.

Each rank of a role is one :class:`ActorWorker` / :class:`CriticWorker` / :class:`TeacherWorker` /
:class:`RewardModelWorker` process; the frozen
reference policy lives in the actor's processes (same layout, same ranks: verl's hybrid
worker), so it costs no extra processes or process groups. A worker builds a
:class:`ShardedModel` for its role from the run's typed config sections (``init_model``,
which receive them over Ray as they are) and exposes the role's few plain methods; the controller calls them on every rank through a
``WorkerGroup`` (``call_dp`` splits a batch by DP rank and gathers the outputs of each
replica's collect rank). Outputs of the other ranks are ``None``.

Weight sync (:meth:`ActorWorker.sync_weights`) runs on every actor rank (the export is a
collective) through a transport of :mod:`megarl.sync`; the ranks that feed an engine verify,
after the session, that it holds bit-identical tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.config.actor import ActorConfig, RefConfig
from megarl.config.algorithm import RewardConfig
from megarl.config.critic import CriticConfig
from megarl.config.model import ModelConfig, ModelSource, OptimConfig
from megarl.config.parallel import Coordinates, ParallelDims
from megarl.config.rollout import RolloutConfig
from megarl.config.teacher import TeacherConfig
from megarl.data.batch import Batch
from megarl.engines.client import EngineAddress
from megarl.workers.actor import ActorRole, LogProbRole
from megarl.workers.base import Worker, busy
from megarl.workers.critic import CriticRole, RewardModelRole
from megarl.workers.model_build import ModelBuild
from megarl.workers.model_checkpoint import export_hf, load_model, save_model
from megarl.workers.sharded_model import ShardedModel


def torch_dtype(name: str) -> torch.dtype:
    """``torch.<name>`` for a config dtype name (``float32``, ``bfloat16``, ``float16``; checked by the config)."""
    return getattr(torch, name)


def _build_sharded(model: ModelSource, dims: ParallelDims, *, path: str | None = None, optim: OptimConfig | None = None,
                  seed: int, groups=None, **fields) -> ShardedModel:
    """A role's :class:`ShardedModel` from the run's model section (``path`` overrides its directory) and the
    role's :class:`ModelBuild` ``fields``."""
    fields.setdefault("packed", model.use_remove_padding)
    build = ModelBuild(params_dtype=torch_dtype(model.dtype), seed=seed, trust_remote_code=model.trust_remote_code,
                       **fields)
    return ShardedModel(path or model.local_path, dims, build, optim=optim, groups=groups)


def _log_prob_batches(section: RefConfig | RolloutConfig | TeacherConfig) -> dict[str, int | None]:
    """Forward-only micro-batches of a section's ``log_prob_*`` settings: rows, or a token budget."""
    budget = section.log_prob_max_token_len_per_gpu if section.log_prob_use_dynamic_bsz else None
    return {"micro_batch_size": section.log_prob_micro_batch_size_per_gpu, "max_token_len": budget}


def step_metrics(results, prefix: str) -> dict[str, float]:
    """Mean over optimizer steps of a role's :class:`StepResult` list, as ``<prefix>/<name>`` metrics.

    ``<prefix>/grad_norm`` and ``<prefix>/lr`` come from the steps; ``<prefix>/skipped_steps``
    counts steps whose loss or gradient was not finite (their update was skipped).
    """
    if not results:
        return {}
    sums: dict[str, float] = {}
    for result in results:
        for key, value in result.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    metrics = {f"{prefix}/{k}": v / len(results) for k, v in sums.items()}
    applied = [r for r in results if r.applied]
    metrics[f"{prefix}/grad_norm"] = (sum(r.grad_norm for r in applied) / len(applied)) if applied else float("nan")
    metrics[f"{prefix}/lr"] = results[-1].lr
    metrics[f"{prefix}/loss"] = sum(r.loss for r in results) / len(results)
    metrics[f"{prefix}/skipped_steps"] = float(len(results) - len(applied))
    return metrics


class _MegatronWorker(Worker):
    """Common parts: the role's sharded model, coordinates, checkpoints."""

    env_vars = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    """Megatron's tensor-parallel layers launch their asynchronous all-gather / reduce-scatter before the gradient
    computation they overlap and rely on one hardware queue to keep that order (``tensor_parallel/layers.py``: "we
    rely on CUDA_DEVICE_MAX_CONNECTIONS=1"); the Megatron ranks' processes alone get it (an SGLang engine's keep
    CUDA's default)."""

    sharded = None
    """This rank's :class:`ShardedModel` of the role."""

    def _init(self, sharded: ShardedModel) -> Coordinates:
        self.sharded = sharded
        self.groups = sharded.groups
        return self.coordinates()

    @busy
    def save_checkpoint(self, directory: str, *, with_optimizer: bool = True) -> None:
        save_model(self.sharded, directory, with_optimizer=with_optimizer)

    @busy
    def load_checkpoint(self, directory: str, *, with_optimizer: bool = True, load_rng: bool = True) -> None:
        load_model(self.sharded, directory, with_optimizer=with_optimizer, load_rng=load_rng)

    @busy
    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True,
                ref_params: bool = False) -> None:
        """Free GPU memory between phases (see :meth:`ShardedModel.offload`); ``ref_params``: the reference's too."""
        self.sharded.offload(params=params, grads=grads, optimizer=optimizer)
        ref = getattr(self, "ref", None)
        if ref is not None and ref_params and ref.model is not self.sharded:
            ref.model.offload(params=True)

    @busy
    def onload(self) -> None:
        self.sharded.onload()
        ref = getattr(self, "ref", None)
        if ref is not None and ref.model is not self.sharded:
            ref.model.onload()

    @busy
    def export_hf(self, directory: str) -> None:
        export_hf(self.sharded, directory)


class ActorWorker(_MegatronWorker):
    """The policy: recomputed log-probs, the PPO update and weight sync into the engines."""

    role = "actor"

    def init_model(self, *, model: ModelConfig, actor: ActorConfig, rollout: RolloutConfig, seed: int) -> Coordinates:
        """Build the policy from the run's sections (the log-prob recompute's micro-batches are ``rollout``'s)."""
        sharded = _build_sharded(model, actor.parallel, optim=actor.optim, seed=seed,
                               recompute_granularity=actor.recompute_granularity,
                               recompute_num_layers=actor.recompute_num_layers,
                               router_replay=actor.router_replay.replay, moe_aux_loss_coeff=actor.moe_aux_loss_coeff,
                               moe_z_loss_coeff=actor.moe_z_loss_coeff,
                               moe_load_balancing_type=actor.moe_load_balancing_type,
                               megatron_overrides=actor.megatron.override_transformer_config,
                               lora=model.lora_spec)
        coords = self._init(sharded)
        self.actor = ActorRole(sharded, actor, rollout_n=rollout.n, **_log_prob_batches(rollout))
        return coords

    def init_ref(self, *, model: ModelConfig, ref: RefConfig, seed: int) -> None:
        """Build the frozen reference policy in this process, on the actor's layout and groups.

        Like verl's hybrid worker, the reference shares the actor's ranks (colocated, same
        shards): a second Megatron model on the same process groups, never trained. With LoRA it is the actor's
        own model with its adapters off.
        """
        if self.sharded.lora is not None:  # the actor with its adapters off: no second model
            self.ref = LogProbRole(self.sharded, adapters_off=True, **_log_prob_batches(ref))
            return
        replay = self.actor.config.router_replay.replay
        sharded = _build_sharded(model, self.sharded.groups.dims, seed=seed, groups=self.sharded.groups,
                                 router_replay=replay,
                                 megatron_overrides=self.actor.config.megatron.override_transformer_config)
        self.ref = LogProbRole(sharded, **_log_prob_batches(ref))

    def reference_model(self) -> str | None:
        """What the reference computes with in this process: ``"actor"`` (the actor's own model, its LoRA adapters
        off: no second model held), ``"own"`` (a second Megatron model), None (no reference)."""
        ref = getattr(self, "ref", None)
        return None if ref is None else "actor" if ref.model is self.sharded else "own"

    @busy
    def compute_ref_log_prob(self, batch: Batch, *, temperature: float = 1.0) -> Batch | None:
        """``ref_log_prob`` [N, R] under the reference policy (replaying the rollout's routing with
        ``actor.router_replay.mode=replay``)."""
        out = self.ref.compute_log_prob(batch, temperature=temperature,
                                        replay_routing=self.actor.config.router_replay.replay)
        return None if out is None else Batch(tensors={"ref_log_prob": out["log_probs"]})

    @busy
    def compute_log_prob(self, batch: Batch, *, temperature: float = 1.0) -> Batch | None:
        """``old_log_probs`` and ``entropys`` [N, R] of the behaviour policy (before any update); with
        ``actor.router_replay`` on, ``routing_counts`` [N, 3] (the rollout's routing replayed or compared)."""
        replay = self.actor.config.router_replay
        out = self.actor.compute_log_prob(batch, temperature=temperature, with_entropy=True,
                                          replay_routing=replay.replay, measure_routing=replay.enabled)
        if out is None:
            return None
        tensors = {"old_log_probs": out["log_probs"], "entropys": out["entropy"]}
        if "routing_counts" in out:
            tensors["routing_counts"] = out["routing_counts"]
        return Batch(tensors=tensors)

    @busy
    def update_actor(self, batch: Batch, *, temperature: float = 1.0, seed: int = 0) -> dict[str, float] | None:
        """PPO epochs × mini-batches; the step-averaged ``actor/*`` metrics on the collect rank."""
        start = time.perf_counter()
        results = self.actor.update(batch, temperature=temperature, seed=seed)
        metrics = step_metrics(results, "actor")
        metrics["perf/update_actor_worker_s"] = time.perf_counter() - start
        return metrics if self.coordinates().is_collect_rank else None

    # ---------------------------------------------------------------------------- weight sync
    def weight_names(self) -> list[str]:
        """Every HF tensor name the export yields, in export order."""
        return [name for unit in self.sharded.exporter().units for name in unit.hf_names]

    @busy
    def sync_weights(self, engines: Sequence[EngineAddress], *, transport: str, bucket_bytes: int, engine_dtype: str,
                     verify_names: Sequence[str] = (), weight_version: str | None = None,
                     flush_cache: bool = True, quantization: str | None = None) -> dict[str, Any] | None:
        """Stream the weights into the engine servers with weight transport ``transport`` (``tensor`` or
        ``distributed``: :mod:`megarl.sync`; ``adapters``: a LoRA run's adapters alone), a collective over the actor's
        ranks.

        Buckets of full HF tensors in the engines' dtype (:meth:`WeightExporter.iter_buckets`) go to every
        engine of ``engines`` inside a ``/begin_weight_update`` ... ``/end_weight_update`` session, tagged
        ``weight_version``; the engines' caches are flushed unless ``flush_cache`` is false (SGLang refuses a flush
        while requests are held in place by ``/pause_generation``). ``verify_names``: tensors read back with
        ``/get_weights_by_name`` and compared, value for value, with what was sent; a difference raises naming
        the engine and the tensors. ``quantization`` (``fp8``): the engines serve block FP8, the buckets go out
        quantized (their scales verified with the weights). Returns the statistics of the ranks that sent (``None`` elsewhere; merge them
        with :func:`megarl.sync.merge_stats`). The transport is built on the first call (and again when the
        engines or the transport change) and kept: its process groups and connections serve every sync.
        """
        from megarl.sync import make_transport

        key = (transport, tuple(engines), quantization)
        if getattr(self, "_transport_key", None) != key:
            if getattr(self, "_transport", None) is not None:
                self._transport.close()
                self.sharded.release_export_buffers()  # the old transport's buckets
            device = next(self.sharded.module_chunks[0].parameters()).device.type
            lora = self.sharded.lora.peft_config(self.sharded.hf_dir) if transport == "adapters" else None
            self._transport = make_transport(transport, self.sharded.groups, engines, device=device,
                                             lora_config=lora, quantization=quantization)
            self._transport_key = key
        exporter = self.sharded.exporter(torch_dtype(engine_dtype))
        return self._transport.sync(exporter, bucket_bytes=bucket_bytes, version=weight_version,
                                    verify_names=verify_names, flush_cache=flush_cache)


class CriticWorker(_MegatronWorker):
    """The value model: ``values`` of the responses and the clipped value-loss update."""

    role = "critic"

    def init_model(self, *, model: ModelConfig, critic: CriticConfig, rollout_n: int, seed: int) -> Coordinates:
        """Build the value model: ``critic.model_path`` (else the policy's directory) with a value head."""
        path = str(Path(critic.model_path).expanduser()) if critic.model_path else None
        sharded = _build_sharded(model, critic.parallel, path=path, optim=critic.optim, seed=seed, value_head=True,
                                 packed=critic.use_remove_padding,
                                 megatron_overrides=critic.megatron.override_transformer_config)
        coords = self._init(sharded)
        self.critic = CriticRole(sharded, critic, rollout_n=rollout_n)
        return coords

    @busy
    def compute_values(self, batch: Batch) -> Batch | None:
        out = self.critic.compute_values(batch)
        return None if out is None else Batch(tensors={"values": out["values"]})

    @busy
    def update_critic(self, batch: Batch, *, seed: int = 0) -> dict[str, float] | None:
        metrics = step_metrics(self.critic.update(batch, seed=seed), "critic")
        return metrics if self.coordinates().is_collect_rank else None


class TeacherWorker(_MegatronWorker):
    """The teacher of on-policy distillation: its log-probs of the student's sampled tokens, on its own model and
    Megatron layout (``teacher.*``); never trained."""

    role = "teacher"

    def init_model(self, *, teacher: TeacherConfig, seed: int) -> Coordinates:
        sharded = _build_sharded(teacher.model, teacher.parallel, seed=seed,
                                 megatron_overrides=teacher.megatron.override_transformer_config)
        coords = self._init(sharded)
        self.teacher = LogProbRole(sharded, **_log_prob_batches(teacher))
        return coords

    @busy
    def compute_teacher_log_prob(self, batch: Batch, *, temperature: float = 1.0) -> Batch | None:
        """``teacher_log_prob`` [N, R]: the teacher's log-probs of the response tokens (at the rollout's
        temperature, as the student's ``old_log_probs``)."""
        out = self.teacher.compute_log_prob(batch, temperature=temperature)
        return None if out is None else Batch(tensors={"teacher_log_prob": out["log_probs"]})


class RewardModelWorker(_MegatronWorker):
    """A reward model (``reward_model.enable``): one score per response from an HF sequence-classification checkpoint,
    on its own model and Megatron layout; never trained."""

    role = "reward_model"

    def init_model(self, *, reward_model: RewardConfig, seed: int) -> Coordinates:
        sharded = _build_sharded(reward_model.model, reward_model.parallel, seed=seed, value_head=True, score_head=True,
                                 megatron_overrides=reward_model.megatron.override_transformer_config)
        coords = self._init(sharded)
        self.scorer = RewardModelRole(sharded, reward_model)
        return coords

    @busy
    def compute_rm_score(self, batch: Batch) -> Batch | None:
        """``rm_scores`` [N]: the reward model's score of each response."""
        out = self.scorer.compute_scores(batch)
        return None if out is None else Batch(tensors=out)
