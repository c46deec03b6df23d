"""The Megatron roles as Ray workers: actor (with the reference policy) and critic.

Each rank of a role is one :class:`ActorWorker` / :class:`CriticWorker` process; the frozen
reference policy lives in the actor's processes (same layout, same ranks: verl's hybrid
worker), so it costs no extra processes or process groups. A worker builds a
:class:`ShardedModel` for its role from the run's typed config sections (``init_model``,
which receive them over Ray as they are) and exposes the role's few plain methods; the controller calls them on every rank through a
``WorkerGroup`` (``call_dp`` splits a batch by DP rank and gathers the outputs of each
replica's collect rank). Outputs of the other ranks are ``None``.

Weight sync (:meth:`ActorWorker.sync_weights`) runs on every actor rank (the export is a
collective); the first rank of each DP replica streams the replica's HF-layout buckets to
its engines and verifies, after the session, that the engines hold bit-identical tensors.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.config.actor import ActorConfig, RefConfig
from megarl.config.critic import CriticConfig
from megarl.config.model import ModelConfig, OptimConfig
from megarl.config.parallel import Coordinates, ParallelDims
from megarl.config.rollout import RolloutConfig
from megarl.data.batch import Batch
from megarl.workers.actor import ActorRole, LogProbRole
from megarl.workers.base import Worker, busy
from megarl.workers.critic import CriticRole
from megarl.workers.model_checkpoint import export_hf, load_model, save_model
from megarl.rollout.client import EngineClient, EngineError, bucket_payloads, gather_sync
from megarl.workers.engine_server import EngineAddress
from megarl.workers.sharded_model import ShardedModel


def torch_dtype(name: str) -> torch.dtype:
    """``torch.<name>`` for a config dtype name (``float32``, ``bfloat16``, ``float16``; checked by the config)."""
    return getattr(torch, name)


def _build_sharded(model: ModelConfig, dims: ParallelDims, *, path: str | None = None, optim: OptimConfig | None = None,
                  seed: int, **kwargs) -> ShardedModel:
    """A role's :class:`ShardedModel` from the run's model section (``path`` overrides its directory)."""
    return ShardedModel(path or model.local_path, dims, optim=optim, params_dtype=torch_dtype(model.dtype),
                          seed=seed, trust_remote_code=model.trust_remote_code, **kwargs)


def _log_prob_batches(section: RefConfig | RolloutConfig) -> dict[str, int | None]:
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
        if ref is not None and ref_params:
            ref.model.offload(params=True)

    @busy
    def onload(self) -> None:
        self.sharded.onload()
        ref = getattr(self, "ref", None)
        if ref is not None:
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
                               recompute_num_layers=actor.recompute_num_layers)
        coords = self._init(sharded)
        self.actor = ActorRole(sharded, actor, rollout_n=rollout.n, **_log_prob_batches(rollout))
        return coords

    def init_ref(self, *, model: ModelConfig, ref: RefConfig, seed: int) -> None:
        """Build the frozen reference policy in this process, on the actor's layout and groups.

        Like verl's hybrid worker, the reference shares the actor's ranks (colocated, same
        shards): a second Megatron model on the same process groups, never trained.
        """
        sharded = _build_sharded(model, self.sharded.groups.dims, seed=seed, groups=self.sharded.groups)
        self.ref = LogProbRole(sharded, **_log_prob_batches(ref))

    @busy
    def compute_ref_log_prob(self, batch: Batch, *, temperature: float = 1.0) -> Batch | None:
        """``ref_log_prob`` [N, R] under the reference policy."""
        out = self.ref.compute_log_prob(batch, temperature=temperature)
        return None if out is None else Batch(tensors={"ref_log_prob": out["log_probs"]})

    @busy
    def compute_log_prob(self, batch: Batch, *, temperature: float = 1.0) -> Batch | None:
        """``old_log_probs`` and ``entropys`` [N, R] of the behaviour policy (before any update)."""
        out = self.actor.compute_log_prob(batch, temperature=temperature, with_entropy=True)
        if out is None:
            return None
        return Batch(tensors={"old_log_probs": out["log_probs"], "entropys": out["entropy"]})

    @busy
    def update_actor(self, batch: Batch, *, temperature: float = 1.0, seed: int = 0) -> dict[str, float] | None:
        """PPO epochs × mini-batches; the step-averaged ``actor/*`` metrics on the collect rank."""
        start = time.perf_counter()
        results = self.actor.update(batch, temperature=temperature, seed=seed,
                                    mask_key=batch.meta.get("mask_key", "response_mask"))
        metrics = step_metrics(results, "actor")
        metrics["perf/update_actor_worker_s"] = time.perf_counter() - start
        return metrics if self.coordinates().is_collect_rank else None

    # ---------------------------------------------------------------------------- weight sync
    def weight_names(self) -> list[str]:
        """Every HF tensor name the export yields, in export order."""
        return [name for unit in self.sharded.exporter().units for name in unit.hf_names]

    @busy
    def sync_weights(self, engines: Sequence[Sequence[EngineAddress]], *, bucket_bytes: int, engine_dtype: str,
                     verify_names: Sequence[str] = (), weight_version: str | None = None) -> dict[str, Any] | None:
        """Stream the weights into the engine servers over SGLang's HTTP API (collective over the actor's ranks).

        ``engines[d]``: the engines served by DP replica ``d``. The replica's first rank (TP 0,
        PP 0, CP 0) sends every full HF bucket (stages take turns, TP shards gathered:
        :meth:`WeightExporter.iter_full`), cast to the engines' dtype, as one
        ``/update_weights_from_tensor`` per engine inside a ``/begin_weight_update`` ...
        ``/end_weight_update`` session (payload: a handle to the flattened bucket per engine TP
        rank, :func:`~megarl.rollout.client.bucket_payloads`), then flushes their caches.
        ``verify_names``: tensors read back with ``/get_weights_by_name`` and compared, value for
        value, with what was sent; a difference raises. An engine that cannot report a weight
        (SGLang 0.5.23 has no ``get_weights_by_name`` for Qwen models) is counted as unverified.
        Returns the sender's statistics (``None`` on other ranks).
        """
        groups = self.sharded.groups
        sender = groups.tp_rank == 0 and groups.pp_rank == 0 and groups.cp_rank == 0
        targets = list(engines[groups.dp_rank]) if sender and groups.dp_rank < len(engines) else []
        clients = [self._engine_client(a) for a in targets]
        wanted = set(verify_names)
        cast = torch_dtype(engine_dtype)
        expected: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        if clients:
            gather_sync([client.begin_weight_update() for client in clients])
        delivered, buckets = 0, 0
        for bucket in self.sharded.exporter().iter_full(bucket_bytes):
            if not clients:
                continue
            named = [(name, tensor.to(cast)) for name, tensor in bucket]
            expected.update((name, tensor.clone()) for name, tensor in named if name in wanted)
            payloads = bucket_payloads(named, [a.tp for a in targets])
            gather_sync([client.update_weights_from_tensor(payload, weight_version=weight_version)
                         for client, payload in zip(clients, payloads, strict=True)])
            delivered += sum(t.numel() * t.element_size() for _, t in named)
            buckets += 1
        if not clients:
            return None
        gather_sync([client.end_weight_update() for client in clients])
        gather_sync([client.flush_cache() for client in clients])
        seconds = time.perf_counter() - start
        verified = sum(gather_sync([_verify(client, expected) for client in clients]))
        return {"weight_sync/seconds": seconds, "weight_sync/bytes": float(delivered * len(targets)),
                "weight_sync/buckets": float(buckets), "weight_sync/verified_tensors": float(len(expected)),
                "weight_sync/verified_engines": float(verified), "weight_sync/engines": float(len(targets)),
                "weight_sync/gbps": delivered * len(targets) / max(seconds, 1e-9) / 1e9}


    def _engine_client(self, address: EngineAddress) -> EngineClient:
        """One client per engine for the worker's life: its keep-alive connections serve every sync."""
        cache = self.__dict__.setdefault("_engine_clients", {})
        if address.url not in cache:
            cache[address.url] = EngineClient(address.url, name=address.name)
        return cache[address.url]


async def _verify(client: EngineClient, expected: dict[str, torch.Tensor]) -> bool:
    """Whether ``client``'s engine reports every weight of ``expected`` (its first rows: all of them) equal to it;
    ``False`` when it cannot report weights; ``RuntimeError`` naming the engine and the tensors that differ."""
    differ = []
    for name, tensor in expected.items():
        rows = tensor.shape[0] if tensor.dim() else 1
        try:
            values = await client.get_weights_by_name(name, truncate_size=rows)
        except EngineError as error:
            if error.status == 400:
                return False
            raise
        if not torch.equal(torch.tensor(values, dtype=torch.float32).reshape(tensor.shape), tensor.float()):
            differ.append(name)
    if differ:
        raise RuntimeError(f"weight sync: {client.name} at {client.url} does not hold the trainer's weights after "
                           f"the update ({len(differ)} tensors differ: {differ[:5]})")
    return True


def verify_sample(names: Sequence[str], count: int, step: int) -> list[str]:
    """``count`` weight names to verify at ``step`` (all when ``count < 0``): a seeded sample plus the last."""
    names = list(names)
    if count < 0 or count >= len(names):
        return names
    if count == 0:
        return []
    picked = random.Random(step).sample(names[:-1], count - 1) if count > 1 else []
    return sorted(set(picked) | {names[-1]}, key=names.index)


class CriticWorker(_MegatronWorker):
    """The value model: ``values`` of the responses and the clipped value-loss update."""

    role = "critic"

    def init_model(self, *, model: ModelConfig, critic: CriticConfig, rollout_n: int, seed: int) -> Coordinates:
        """Build the value model: ``critic.model_path`` (else the policy's directory) with a value head."""
        path = str(Path(critic.model_path).expanduser()) if critic.model_path else None
        sharded = _build_sharded(model, critic.parallel, path=path, optim=critic.optim, seed=seed, value_head=True)
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
