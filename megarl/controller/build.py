"""Build a run's parts: the policy's directory, data, rewards, Ray, and the roles (placement → resource pools →
actor with the reference, critic, rollout engines) with the driver's rollout manager.

:func:`build_roles` is the one place that turns the config's typed sections and the placement
plan into running workers; the :class:`~megarl.controller.trainer.Trainer` only drives them.
Each worker receives the sections it needs as they are (``ActorWorker.init_model(model=...,
actor=..., rollout=...)``); nothing is repacked into dicts.

Sharing a bundle: colocated roles (actor with its reference, the engines, the critic) split each
bundle's CPU and GPU evenly (Ray accounting only: they run one phase at a time), so ``k`` colocated
roles take ``1/k`` each. Disaggregated engines (``hybrid_engine=false``) own their pool's bundles.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

import ray

from megarl.config.checks import data_parallel_size
from megarl.config.model import ModelSource
from megarl.config.rollout import EngineConfig
from megarl.config.schema import RunConfig
from megarl.controller import role_memory
from megarl.controller.progress import no_phases
from megarl.data.dataset import PromptDataset
from megarl.parallel.net import RAY_LOOPBACK_VARIABLE
from megarl.parallel.reaper import Reaper, start_reaper
from megarl.parallel.shared_memory import remove_shared_memory
from megarl.plan.placement import JUDGE_POOL, PlacementPlan, create_pools, engine_replica, placement_for
from megarl.reward import RewardManager
from megarl.reward.manager import OverlongPenalty
from megarl.rollout import event_loop
from megarl.rollout.client import EngineAddress, EngineClient
from megarl.rollout.interaction import BaseInteraction, load_interactions
from megarl.rollout.lora_wire import ADAPTER_NAME
from megarl.rollout.manager import RolloutManager
from megarl.rollout.router import start_router
from megarl.rollout.server_process import ServerProcess
from megarl.rollout.tools.base import BaseTool
from megarl.rollout.tools.registry import load_tools
from megarl.seeds import SEED_STREAM_ENGINE, SEED_STREAM_JUDGE_ENGINE, derive_seed
from megarl.sync import resolve_transport
from megarl.workers.engine_server import EngineServerWorker
from megarl.workers.group import WorkerGroup
from megarl.workers.megatron_workers import ActorWorker, CriticWorker, RewardModelWorker, TeacherWorker


@dataclasses.dataclass
class Roles:
    """The running workers of a run and how they are wired."""

    plan: PlacementPlan
    """Where every role sits (``megarl.plan.placement``)."""
    pools: dict
    """Ray placement groups by pool name (``global``, and ``rollout`` when disaggregated)."""
    actor: WorkerGroup | None
    """The policy's ranks (the reference lives in the same processes); None when generating only."""
    critic: WorkerGroup | None
    """The value model's ranks (PPO with GAE), else None."""
    teacher: WorkerGroup | None
    """The teacher's ranks (on-policy distillation), else None."""
    reward_model: WorkerGroup | None
    """The reward model's ranks (``reward_model.enable``), else None."""
    rollout: WorkerGroup
    """One worker per rollout engine, owning the engine's server process."""
    engines: list[EngineClient]
    """A client per engine server (weights, memory, pause calls; naming a failed engine)."""
    router: ServerProcess
    """sglang-router over the engines: generation goes through it."""
    generator: EngineClient
    """The router's client."""
    engine_targets: list[EngineAddress]
    """Every engine with who feeds it weights (its actor DP replica; the actor ranks on its GPUs)."""
    weight_transport: str
    """The weight sync's transport (``tensor`` or ``distributed``: :mod:`megarl.sync`)."""
    weight_names: list[str]
    """Every HF tensor name of the policy, in export order."""
    judge: JudgeServers | None
    """A generative judge's engines and router (``reward_model.judge``), else None."""
    loop: event_loop.EventLoopThread
    """The driver's one event loop (held from :func:`build_roles` to :meth:`shutdown`): the clients' sessions, the
    rollout manager's generation and the producer run on it."""

    @property
    def groups(self) -> list[WorkerGroup]:
        """Every worker group, in the order they were built."""
        return [g for g in (self.actor, self.critic, self.teacher, self.reward_model, self.rollout,
                            self.judge.group if self.judge is not None else None) if g is not None]

    def shutdown(self) -> None:
        """Close the clients' sessions and let go of the driver's event loop (the last holder stops it and joins its
        thread), stop the router and the engine servers, kill every worker and give the pools' resources back; the
        shared-memory bucket buffers the killed workers held are unlinked on every node (this one here, the
        others by a task pinned to each)."""
        judge = [self.judge.generator, *self.judge.engines] if self.judge is not None else []
        close_clients([self.generator, *self.engines, *judge])
        event_loop.release()
        self.router.stop()
        stop_engine_servers(self.rollout)
        if self.judge is not None:
            self.judge.stop()
        by_node: dict[str, list[int]] = {}
        for group in self.groups:
            for info in getattr(group, "node_infos", []):
                by_node.setdefault(info.get("node_id"), []).append(info["pid"])
        for group in self.groups:
            group.shutdown()
        for pool in self.pools.values():
            pool.remove()
        here = ray.get_runtime_context().get_node_id()
        remove_shared_memory(by_node.pop(here, []))
        remove_shared_memory_on_nodes(by_node)


def close_clients(clients: list[EngineClient]) -> None:
    """Close the clients' sessions (best effort: shutting down goes on)."""
    for client in clients:
        try:
            client.close_sync()
        except Exception as error:  # noqa: BLE001 - shutting down goes on
            logging.getLogger(__name__).warning("closing %r: %s", client, error)


def remove_shared_memory_on_nodes(pids_by_node: dict[str, list[int]], timeout_s: float = 60.0) -> int:
    """Unlink the shared-memory files of ``pids_by_node[node]`` on each node, by a task pinned there (no CPU
    asked: the run's pools are gone or full); how many files. A node that does not answer is warned about."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(remove_shared_memory)
    pending = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pids)
               for node, pids in pids_by_node.items() if node is not None and pids}
    removed = 0
    for node, ref in pending.items():
        try:
            removed += ray.get(ref, timeout=timeout_s)
        except Exception as error:  # the node may be gone; its files go with its next run's start
            logging.getLogger(__name__).warning("shared memory of this run's workers on node %s not removed: %s",
                                                node, error)
    return removed


def build_roles(cfg: RunConfig, log_dir: str | os.PathLike, *, phase=no_phases, training: bool = True) -> Roles:
    """Place and start every role of ``cfg`` (Ray must be running): the training workers, one engine server per
    engine (its log in ``log_dir``) and sglang-router in front of them; on failure nothing is left running.
    ``phase`` (a :class:`~megarl.controller.progress.Phases`) announces each part as it starts and ends;
    ``training`` False: the engines and the router only, each engine with its GPUs to itself (generation only).

    The engine servers start while the training roles build when nothing of theirs is measured against the
    training roles' memory (on CPU, or on a pool of their own); on the GPUs the training roles share, the training
    roles build and offload first, and SGLang then sizes its KV pool beside what stays."""
    plan = placement_for(cfg)
    pools = create_pools(plan, use_gpu=cfg.trainer.device != "cpu", cpus_per_bundle=1.0)
    built: list[WorkerGroup] = []
    routers: list[ServerProcess] = []
    loop = event_loop.hold()  # the driver's one event loop, until Roles.shutdown
    engines_started = None
    try:
        policy_set = policy_engines(cfg, plan)
        judge_set = judge_engines(cfg, plan) if cfg.reward_model.judge.enable else None
        probed = None
        if any(s is not None and s.rollout.name == "sglang" for s in (policy_set, judge_set)):
            from megarl.plan.engine_gpus import probe_bundle_gpus

            probed = probe_bundle_gpus(pools)
        separate = not cfg.actor_rollout_ref.hybrid_engine
        colocated = _colocated_roles(cfg, separate) if training else 1
        admin_key = secrets.token_urlsafe(32)  # the run's engine admin key: only the trainer drives the engines
        start_policy_engines = functools.partial(
            _start_policy_engines, cfg, plan, policy_set, pools["rollout"] if separate else pools["global"],
            1.0 if separate else 1.0 / colocated, probed, log_dir, admin_key, phase)
        if training and (separate or cfg.trainer.device == "cpu"):
            engines_started = _in_background(start_policy_engines)
        groups = _build_training_roles(cfg, plan, pools, colocated, built, phase) if training else {}
        rollout, addresses = engines_started.result() if engines_started is not None else start_policy_engines()
        engines_started = None
        built.append(rollout)
        # Training with adapters synced alone: every request names the run's adapter (loaded at the first sync).
        lora_name = ADAPTER_NAME if training and cfg.lora_syncs_adapters else None
        engines = [EngineClient(a.url, name=a.name, admin_key=a.admin_key, control_timeout_s=a.timeout_s,
                                lora_name=lora_name) for a in addresses]
        with phase("starting sglang-router"):
            router = start_router([a.url for a in addresses], policy=cfg.actor_rollout_ref.rollout.router_policy,
                                  log_dir=log_dir, control_key=admin_key)
        routers.append(router)
        judge = None
        if judge_set is not None:
            judge = _start_judge(cfg, judge_set, pools, probed, log_dir, admin_key, built, routers, phase)
        targets, names = [], []
        if training:
            targets = engine_targets(plan, addresses, data_parallel_size(cfg, cfg.actor_rollout_ref.actor.parallel))
            names = groups["actor"].call_rank(0, ActorWorker.weight_names)
    except BaseException:
        _stop_started(engines_started, built, routers, pools)
        raise
    return Roles(plan=plan, pools=pools, actor=groups.get("actor"), critic=groups.get("critic"),
                 teacher=groups.get("teacher"), reward_model=groups.get("reward_model"),
                 rollout=rollout, engines=engines,
                 router=router, generator=EngineClient(router.url, name="sglang-router", lora_name=lora_name),
                 engine_targets=targets,
                 weight_transport=resolve_transport(cfg.actor_rollout_ref.rollout.weight_transport,
                                                    colocated=plan.colocated, device=cfg.trainer.device),
                 weight_names=names, loop=loop,
                 judge=judge)


def _colocated_roles(cfg: RunConfig, separate: bool) -> int:
    """How many roles share each bundle of the training pool: actor(+ref), the engines unless on a pool of their
    own, the critic, the teacher and the reward model when enabled."""
    return (1 if separate else 2) + sum(section.enable for section in (cfg.critic, cfg.teacher, cfg.reward_model))


def _build_training_roles(cfg: RunConfig, plan: PlacementPlan, pools: dict, colocated: int,
                          built: list[WorkerGroup], phase) -> dict[str, WorkerGroup]:
    """Build the actor (with its reference), critic, teacher and reward model that ``cfg`` enables, each appended to
    ``built`` as it is ready (stopped by the caller on failure), then move their memory to the host by their
    offload flags."""
    share = 1.0 / colocated
    groups: dict[str, WorkerGroup] = {}
    lora = cfg.actor_rollout_ref.model.lora_rank
    reference = (" with LoRA (its reference: the adapters off)" if lora else " and its reference") \
        if cfg.needs_ref else (" with LoRA" if lora else "")
    with phase(f"placing the actor{reference} on {plan.role('actor').world_size} rank(s) and building the model"):
        groups["actor"] = _build_actor(cfg, pools["global"], share)
    built.append(groups["actor"])
    if cfg.critic.enable:
        with phase("placing the critic and building its model"):
            groups["critic"] = _build_critic(cfg, pools["global"], share)
        built.append(groups["critic"])
    if cfg.teacher.enable:
        with phase(f"placing the teacher on {plan.role('teacher').world_size} rank(s) and building its model"):
            groups["teacher"] = _build_scorer(cfg, TeacherWorker, "teacher", pools["global"], share,
                                              teacher=cfg.teacher)
        built.append(groups["teacher"])
    if cfg.reward_model.enable:
        with phase(f"placing the reward model on {plan.role('reward_model').world_size} rank(s) and building its "
                   f"model"):
            groups["reward_model"] = _build_scorer(cfg, RewardModelWorker, "reward_model", pools["global"], share,
                                                   reward_model=cfg.reward_model)
        built.append(groups["reward_model"])
    for role, group in groups.items():  # SGLang sizes its KV pool beside what stays on the GPUs (the trainer onloads)
        role_memory.offload(cfg, group, role)
    return groups


def _start_policy_engines(cfg: RunConfig, plan: PlacementPlan, policy_set: EngineSet, pool, share: float,
                          probed: dict | None, log_dir, admin_key: str, phase) -> tuple[WorkerGroup, list]:
    """The policy's engine servers, started and healthy (:func:`start_engine_servers`)."""
    gpus = engine_gpus_of(plan.engines, probed) if policy_set.rollout.name == "sglang" else None
    with phase(f"starting {len(plan.engines)} {cfg.actor_rollout_ref.rollout.name} engine server(s)"):
        return start_engine_servers(cfg, policy_set, pool, share, gpus, log_dir, admin_key=admin_key)


def _in_background(call: Callable[[], Any]) -> concurrent.futures.Future:
    """``call()`` on a thread of its own; its result (or its error) in the future."""
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-start")
    try:
        return executor.submit(call)
    finally:
        executor.shutdown(wait=False)


def _stop_started(engines_started: concurrent.futures.Future | None, built: list[WorkerGroup],
                  routers: list[ServerProcess], pools: dict) -> None:
    """Stop what a failed :func:`build_roles` started: the engine servers still starting (once their start ends:
    it cannot be cut short), the routers, every group built, the pools; let go of the driver's event loop."""
    if engines_started is not None:
        try:
            built.append(engines_started.result()[0])
        except BaseException:  # noqa: BLE001 - a failed start stopped its own servers; the first error is raised
            pass
    for started in routers:
        started.stop()
    for group in built:
        if group.role in ("rollout", "judge"):
            stop_engine_servers(group)
        group.shutdown()
    for pool in pools.values():
        pool.remove()
    event_loop.release()


@dataclasses.dataclass
class JudgeServers:
    """A generative judge's running engines (``reward_model.judge``): their owners, a client per engine and
    sglang-router in front of them."""

    group: WorkerGroup
    engines: list[EngineClient]
    router: ServerProcess
    generator: EngineClient
    """The judge router's client: every judge request goes through it."""

    def stop(self) -> None:
        """Stop the router and the engine servers (the group's workers are killed with the run's)."""
        self.router.stop()
        stop_engine_servers(self.group)


def _start_judge(cfg: RunConfig, judge_set: EngineSet, pools: dict, probed: dict | None, log_dir, admin_key: str,
                 built: list, routers: list, phase) -> JudgeServers:
    """Start the judge's engine servers on its pool and its router; what started is appended to ``built`` and
    ``routers`` (stopped by the caller on failure)."""
    rollout = judge_set.rollout
    gpus = engine_gpus_of(judge_set.engines, probed) if rollout.name == "sglang" else None
    with phase(f"starting {len(judge_set.engines)} {rollout.name} judge engine server(s)"):
        group, addresses = start_engine_servers(cfg, judge_set, pools[JUDGE_POOL], 1.0, gpus, log_dir,
                                                admin_key=admin_key)
    built.append(group)
    with phase("starting the judge's sglang-router"):
        router = start_router([a.url for a in addresses], policy=rollout.router_policy, log_dir=log_dir,
                              log_name="judge_router.log", control_key=admin_key)
    routers.append(router)
    engines = [EngineClient(a.url, name=f"judge {a.name}", admin_key=a.admin_key, control_timeout_s=a.timeout_s)
               for a in addresses]
    return JudgeServers(group, engines, router, EngineClient(router.url, name="judge sglang-router"))


def engine_targets(plan: PlacementPlan, addresses: list[EngineAddress], dp: int) -> list[EngineAddress]:
    """``addresses`` with who feeds each engine: its actor DP replica (TP-matched engines the one on whose GPUs
    they sit, others dealt round-robin) and, colocated, the actor ranks on its GPUs in engine TP order."""
    actor_bundles = plan.role("actor").bundles
    out = []
    for address, engine in zip(addresses, plan.engines, strict=True):
        hosts = tuple(actor_bundles.index(b) for b in engine.bundles) if plan.colocated else ()
        out.append(dataclasses.replace(address, replica=engine_replica(engine, dp), host_ranks=hosts))
    return out


def stop_engine_servers(group: WorkerGroup) -> None:
    """Stop every engine server of ``group`` (best effort: a dead worker's server died with it)."""
    try:
        group.call_all(EngineServerWorker.stop_server)
    except Exception as error:  # noqa: BLE001 - shutting down: the workers are killed next anyway
        logging.getLogger(__name__).warning("stopping engine servers: %s", error)


def _group(cfg: RunConfig, worker_cls, pool, share: float, **kwargs) -> WorkerGroup:
    gpu = 0.0 if cfg.trainer.device == "cpu" else share
    return WorkerGroup(worker_cls, pool, num_cpus=share, num_gpus=gpu, timeout_s=cfg.trainer.worker_timeout_s,
                       timeout_setting="trainer.worker_timeout_s", **kwargs)


def _build_actor(cfg: RunConfig, pool, share: float) -> WorkerGroup:
    arr, seed = cfg.actor_rollout_ref, cfg.trainer.seed
    group = _group(cfg, ActorWorker, pool, share, role="actor")
    try:
        group.call_all(ActorWorker.init_model, model=arr.model, actor=arr.actor, rollout=arr.rollout, seed=seed)
        group.refresh_coordinates()
        if cfg.needs_ref:
            group.call_all(ActorWorker.init_ref, model=arr.model, ref=arr.ref, seed=seed)
    except BaseException:
        group.shutdown()
        raise
    return group


def _build_critic(cfg: RunConfig, pool, share: float) -> WorkerGroup:
    arr = cfg.actor_rollout_ref
    group = _group(cfg, CriticWorker, pool, share, role="critic")
    try:
        group.call_all(CriticWorker.init_model, model=arr.model, critic=cfg.critic, rollout_n=arr.rollout.n,
                       seed=cfg.trainer.seed)
        group.refresh_coordinates()
    except BaseException:
        group.shutdown()
        raise
    return group


def _build_scorer(cfg: RunConfig, worker_cls, role: str, pool, share: float, **section) -> WorkerGroup:
    """A scoring model's ranks (the teacher, the reward model): built from its run section, never trained."""
    group = _group(cfg, worker_cls, pool, share, role=role)
    try:
        group.call_all(worker_cls.init_model, seed=cfg.trainer.seed, **section)
        group.refresh_coordinates()
    except BaseException:
        group.shutdown()
        raise
    return group


def engine_gpus_of(engines, probed: dict) -> list:
    """Per engine of ``engines``, its GPUs on each of its nodes for ``sglang.launch_server``
    (:class:`~megarl.plan.engine_gpus.EngineGpus`), from ``probed`` (:func:`~megarl.plan.engine_gpus.probe_bundle_gpus`
    of the pools, right after ``create_pools``, before any worker holds the bundles' GPUs)."""
    from megarl.plan.engine_gpus import engine_gpus

    return engine_gpus(engines, probed)


@dataclasses.dataclass(frozen=True)
class EngineServerSlot:
    """One engine server process: engine ``engine``'s part on its node ``node_rank``, owned by a worker on
    ``bundle`` (the node's first bundle of the engine)."""

    engine: int
    node_rank: int
    bundle: int


def engine_server_slots(engines, gpus: list | None) -> list[EngineServerSlot]:
    """A server per engine of ``engines`` (megarl's CPU server: one process whatever its TP), or for SGLang one per
    node an engine spans (``gpus``: :func:`engine_gpus_of`), node_rank 0 first."""
    if gpus is None:
        return [EngineServerSlot(e.index, 0, e.bundles[0]) for e in engines]
    return [EngineServerSlot(g.engine, n.node_rank, n.bundles[0]) for g in gpus for n in g.nodes]


@dataclasses.dataclass(frozen=True)
class EngineSet:
    """A set of engine servers behind one router: the policy's rollout engines, or a generative judge's."""

    role: str
    """The worker group's role (``rollout``, ``judge``)."""
    label: str
    """What each engine is called in errors and logs (``engine``, ``judge engine``)."""
    engines: tuple
    """Their :class:`~megarl.plan.placement.EnginePlacement` s."""
    rollout: EngineConfig
    model: ModelSource
    seed_stream: int
    """Engine ``i`` samples from ``derive_seed(rollout seed, seed_stream, i)``."""
    routed_experts: bool = False
    """The engines return every token's routed experts (``actor.router_replay``)."""
    lora: Any = None
    """The run's :class:`~megarl.config.lora.LoraSpec` when the engines serve its adapter."""
    context_length: int | None = None
    """The longest sequence a request may reach (SGLang's ``--context-length``): SGLang sizes its per-request token
    tables by it, by the model's whole context (131,072 for Llama-3.1) without it."""


def policy_engines(cfg: RunConfig, plan: PlacementPlan) -> EngineSet:
    """The policy's rollout engines (serving FP8, ``rollout.quantization=fp8``: from the run's FP8 checkpoint of the
    policy, :func:`megarl.convert.fp8.ensure_engine_checkpoint`)."""
    arr = cfg.actor_rollout_ref
    model = arr.model
    if arr.rollout.quantization == "fp8":
        from megarl.convert.fp8 import engine_checkpoint

        model = dataclasses.replace(model, path=str(engine_checkpoint(model.local_path, cfg.run_dir)))
    return EngineSet("rollout", "engine", plan.engines, arr.rollout, model, SEED_STREAM_ENGINE,
                     routed_experts=arr.actor.router_replay.enabled,
                     lora=arr.model.lora_spec if cfg.lora_syncs_adapters else None,
                     context_length=context_length(model, arr.rollout.max_model_len or sum(cfg.rollout_widths()),
                                                   key="actor_rollout_ref.model.path"))


def judge_engines(cfg: RunConfig, plan: PlacementPlan) -> EngineSet:
    """A generative judge's engines (``reward_model.judge``), on its own pool."""
    judge = cfg.reward_model.judge
    return EngineSet("judge", "judge engine", plan.judge_engines, judge.rollout, judge.model,
                     SEED_STREAM_JUDGE_ENGINE,
                     context_length=context_length(judge.model, judge.rollout.prompt_length
                                                   + judge.rollout.response_length, key="reward_model.judge.model.path"))


def context_length(model: ModelSource, wanted: int, *, key: str) -> int:
    """An engine's ``--context-length``: ``wanted`` (the longest sequence the run asks for), at most the model's own
    context (``max_position_embeddings``; SGLang refuses a longer one, and the engine then refuses the requests that
    would not fit, which the run counts). A model whose config cannot be read here (not yet written, or a hub name
    megarl does not know) gets ``wanted``: the engine checks it against the model when it loads it."""
    from megarl.models.known import resolve_hf_config
    from megarl.models.vision import model_config

    try:
        hf_config, _ = resolve_hf_config(model.local_path, key=key)
    except ValueError:
        return wanted
    limit = getattr(model_config(hf_config), "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted


def start_engine_servers(cfg: RunConfig, engine_set: EngineSet, pool, share: float, gpus: list | None,
                         log_dir: str | os.PathLike, *, admin_key: str | None = None
                         ) -> tuple[WorkerGroup, list[EngineAddress]]:
    """The engine servers' owners (one :class:`EngineServerWorker` per :func:`engine_server_slots` entry, taking
    ``share`` of its bundle) with every server started (concurrently) and healthy; the engines' addresses (an
    engine spanning nodes serves on its node_rank 0). On failure nothing is left running."""
    rollout, model = engine_set.rollout, engine_set.model
    slots = engine_server_slots(engine_set.engines, gpus)
    group = _group(cfg, EngineServerWorker, pool, share, role=engine_set.role, bundles=[s.bundle for s in slots])
    host = "127.0.0.1" if on_this_machine_only() else None  # nothing listens beyond what must reach it
    try:
        seeds = [derive_seed(cfg.rollout_seed, engine_set.seed_stream, i) for i in range(len(engine_set.engines))]
        calls = [{"engine": s.engine, "node_rank": s.node_rank, "tp": engine_set.engines[s.engine].tp} for s in slots]
        # Routing replay: the engines return every token's routed experts (SGLang's flag; megarl's server's too).
        from megarl.plan.engine_gpus import ROUTED_EXPERTS_FLAG, lora_flags

        routed = (ROUTED_EXPERTS_FLAG,) if engine_set.routed_experts else ()
        lora = engine_set.lora  # the engines serve the run's adapter
        context = ("--context-length", str(engine_set.context_length)) if engine_set.context_length else ()
        if gpus is None:
            for call in calls:
                call["extra_args"] = (*routed, *(lora_flags(lora) if lora else ()), *context)
        if gpus is not None:
            from megarl.plan.engine_gpus import sglang_launch_command

            heads = {s.engine: rank for rank, s in enumerate(slots) if s.node_rank == 0}
            # A multi-node engine's first node also picks its --dist-init-addr port.
            where = group.call_ranks([((), {"num_ports": 2 if s.node_rank == 0 and gpus[s.engine].nnodes > 1 else 1,
                                            "host": host})
                                      for s in slots], EngineServerWorker.address)
            for slot, call, (serve_on, ports) in zip(slots, calls, where, strict=True):
                engine = gpus[slot.engine]
                if engine.nnodes > 1:
                    engine = engine.with_dist_init_port(where[heads[slot.engine]][1][1])
                call["launch"] = sglang_launch_command(engine, rollout=rollout, model=model, port=ports[0],
                                                       seed=seeds[slot.engine], node_rank=slot.node_rank,
                                                       host=serve_on, return_routed_experts=bool(routed),
                                                       lora=lora, context_length=engine_set.context_length)
                call["url"] = f"http://{serve_on}:{ports[0]}"
        urls = group.call_ranks([((), dict(rollout=rollout, model=model, seed=seeds[s.engine],
                                          device=cfg.trainer.device, log_dir=str(log_dir), admin_key=admin_key,
                                          host=host, label=engine_set.label, **call))
                                 for s, call in zip(slots, calls)], EngineServerWorker.start_server)
    except BaseException:
        stop_engine_servers(group)
        group.shutdown()
        raise
    head_url = {s.engine: url for s, url in zip(slots, urls) if s.node_rank == 0}
    return group, [EngineAddress(index=e.index, url=head_url[e.index], tp=e.tp, admin_key=admin_key,
                                 timeout_s=rollout.engine_timeout_s) for e in engine_set.engines]


def on_this_machine_only() -> bool:
    """Whether the Ray cluster is this one machine (one live node, the driver's): its engine servers then serve
    on loopback, where only this machine's processes reach them."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    return len(nodes) == 1 and nodes[0]["NodeID"] == ray.get_runtime_context().get_node_id()


@dataclasses.dataclass
class AgentPlugins:
    """The multi-turn tools and interactions (user code the driver's agent loop calls), loaded once."""

    tools: dict[str, BaseTool] | None = None
    interactions: dict[str, BaseInteraction] | None = None

    def tool_schemas(self) -> dict[str, dict]:
        """``{function_name: OpenAI schema}`` of the tools (the prompt-length filter counts them)."""
        return {name: tool.get_openai_tool_schema() for name, tool in (self.tools or {}).items()}


def load_agent_plugins(cfg: RunConfig) -> AgentPlugins:
    """The tools and interactions of ``actor_rollout_ref.rollout.multi_turn`` (none unless it is enabled)."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    plugins = AgentPlugins()
    if multi_turn.enable and multi_turn.tool_config_path:
        plugins.tools = load_tools(multi_turn.tool_config_path)
    if multi_turn.enable and multi_turn.interaction_config_path:
        plugins.interactions = load_interactions(multi_turn.interaction_config_path)
    return plugins


def build_rollout_manager(cfg: RunConfig, generator: EngineClient, engines: list[EngineClient], tokenizer,
                          plugins: AgentPlugins, routing: tuple[int, int] | None = None) -> RolloutManager:
    """The driver's rollout manager: generation through ``generator`` (the router) over ``engines``, with the
    multi-turn tools and interactions; ``routing`` (:func:`routing_shape`): training rollouts carry the engines'
    routed experts."""
    prompt_length, response_length = cfg.rollout_widths()
    return RolloutManager(generator, engines, tokenizer, cfg.actor_rollout_ref.rollout, prompt_length=prompt_length,
                          response_length=response_length, tools=plugins.tools, interactions=plugins.interactions,
                          routing_shape=routing, image_processor=image_processor(cfg, tokenizer))


def image_processor(cfg: RunConfig, tokenizer):
    """The policy's :class:`~megarl.data.images.ImageProcessor` when it is a vision-language model, else None."""
    from megarl.data.images import ImageProcessor
    from megarl.models.hf_config import load_hf_config
    from megarl.models.vision import is_multimodal

    model = cfg.actor_rollout_ref.model
    hf_config = load_hf_config(model.local_path, trust_remote_code=model.trust_remote_code)
    if not is_multimodal(hf_config):
        return None
    return ImageProcessor.from_pretrained(model.local_path, tokenizer, hf_config,
                                          trust_remote_code=model.trust_remote_code)


def build_datasets(cfg: RunConfig, tokenizer, plugins: AgentPlugins | None = None,
                   console=print) -> tuple[PromptDataset, PromptDataset | None]:
    """The training and validation prompt sets (``data.*``); the count of dropped over-long prompts is reported.

    With multi-turn tools, a prompt's length counts the tool schemas the chat template adds to it. A set left
    without any prompt is an error naming its key."""
    kwargs = cfg.data.dataset_kwargs()
    if cfg.actor_rollout_ref.rollout.multi_turn.enable or cfg.reward_model.judge.enable:  # the judge reads the chat
        kwargs["return_raw_chat"] = True
    kwargs["processor"] = image_processor(cfg, tokenizer)
    schemas = plugins.tool_schemas() if plugins is not None else {}
    counted = f" (the {len(schemas)} tool schemas included)" if schemas else ""
    train = PromptDataset(cfg.data.train_files, tokenizer, tool_schemas=schemas, **kwargs)
    val = PromptDataset(cfg.data.val_files, tokenizer, tool_schemas=schemas, **kwargs) if cfg.data.val_files else None
    for key, ds in (("data.train_files", train), ("data.val_files", val)):
        if ds is not None and ds.num_skipped:
            first = ds.skipped[0]
            console(f"{key}: {ds.num_skipped} of {ds.num_rows_read} rows were skipped for their images (the first: "
                    f"{first.reason})")
            if len(ds) == 0:
                raise ValueError(f"no row of {key} is left: every one was skipped for its images ({first.reason})")
        if ds is None or not ds.num_filtered_overlong:
            continue
        if len(ds) == 0:
            shortest = min(p.num_tokens for p in ds.filtered_overlong)
            raise ValueError(f"every one of the {ds.num_rows_read} prompts of {key} is longer than "
                             f"data.max_prompt_length={cfg.data.max_prompt_length}{counted}: the shortest has "
                             f"{shortest} tokens; raise data.max_prompt_length")
        console(f"{key}: {ds.num_filtered_overlong} of {ds.num_rows_read} prompts were longer than "
                f"data.max_prompt_length={cfg.data.max_prompt_length}{counted} and were dropped")
    return train, val


def build_reward_managers(cfg: RunConfig, tokenizer, train_set: PromptDataset,
                          val_set: PromptDataset | None) -> tuple[RewardManager, RewardManager]:
    """Training and validation reward managers (``reward_model.*``); validation logs one sample per source.

    A custom function is loaded and its signature checked here; without one, every ``data_source`` of the data
    must have a registered scorer. Errors name the setting (before anything is placed)."""
    reward = cfg.reward_model
    custom = reward.custom_reward_function
    buffer = reward.overlong_buffer
    overlong = OverlongPenalty(cfg.data.max_response_length, buffer.len, buffer.penalty_factor,
                               buffer.log) if buffer.enable else None

    def manager(num_examine: int) -> RewardManager:
        return RewardManager(tokenizer, compute_score=custom.spec(), reward_kwargs=custom.reward_kwargs or None,
                             scorer_kwargs=reward.scorer_kwargs, num_examine=num_examine, on_error=reward.on_error,
                             timeout_s=reward.timeout_s, overlong=overlong)

    train, val = manager(reward.num_examine), manager(1)  # verl logs one decoded sample per source in validation
    if reward.judge.enable and reward.judge.combine == "replace":  # the judge scores every row: no rule function
        return train, val
    train.check_data_sources(train_set.data_sources(), "data.train_files")
    if val_set is not None:
        val.check_data_sources(val_set.data_sources(), "data.val_files")
    return train, val


@dataclasses.dataclass
class RayConnection:
    """Ray as :func:`init_ray` left it: joined, or started here with a reaper (:mod:`megarl.parallel.reaper`)."""

    reaper: Reaper | None = None
    restore: Callable[[], None] | None = None
    """Puts back what :func:`ray_on_loopback` changed."""

    def shutdown(self) -> None:
        """Leave the cluster (a local one stops); the reaper ends whatever of the local cluster is left."""
        if ray.is_initialized():
            ray.shutdown()
        if self.reaper is not None:
            self.reaper.end_run_processes()  # Ray's agents exit within seconds: the reaper is for real leftovers
            self.reaper.close()
        if self.restore is not None:
            self.restore()


def ray_on_loopback() -> Callable[[], None]:
    """Put the local cluster about to start on loopback: this process's Ray takes 127.0.0.1 as the node's address
    (:data:`megarl.parallel.net.RAY_LOOPBACK_VARIABLE` off, as on macOS and Windows), which it hands every process
    it starts, so all of them listen there. Only the driver's Ray is changed, not the environment: a process that
    inherited the variable could not start a multi-node cluster later (``ray start`` refuses). The user's own
    setting of the variable wins. Returns what puts it back."""
    from ray._private import ray_constants

    if RAY_LOOPBACK_VARIABLE in os.environ:
        return lambda: None
    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False

    def restore() -> None:
        ray_constants.ENABLE_RAY_CLUSTER = previous

    return restore


def init_ray(cfg: RunConfig, console=print) -> RayConnection | None:
    """Join the cluster at ``RAY_ADDRESS`` or start a local one (CPU: a slot per bundle of every pool at least);
    a no-op (None) when Ray is up. The caller shuts the returned connection down at the end of the run. A local
    cluster's processes are the run's: a reaper ends them when the driver ends, ``kill -9`` included.

    A local cluster listens on loopback only (:func:`ray_on_loopback`);
    without token authentication (``RAY_AUTH_MODE`` other than ``token``, which Ray reads when it is imported:
    ``megarl-train`` sets it with a fresh ``RAY_AUTH_TOKEN`` first) any process of this machine can run code in
    the run's cluster, which is warned about. A cluster joined at ``RAY_ADDRESS`` uses its own settings."""
    if ray.is_initialized():
        return None
    trainer = cfg.trainer
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("RAY_ADDRESS"):
        console(f"joining the Ray cluster at {os.environ['RAY_ADDRESS']}")
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env})
        return RayConnection()
    if os.environ.get("RAY_AUTH_MODE") != "token":
        logging.getLogger(__name__).warning("a local Ray cluster without token authentication (RAY_AUTH_MODE=%s): "
                                            "any process that reaches this machine's Ray ports can run code in the "
                                            "run's cluster; megarl-train turns it on unless RAY_AUTH_MODE is set",
                                            os.environ.get("RAY_AUTH_MODE", "unset"))
    connection = RayConnection(start_reaper())  # before Ray starts: its processes inherit the run's tag
    connection.restore = ray_on_loopback()
    try:
        if trainer.device == "cpu":
            # Every pool's bundles (the training ranks, disaggregated engines, a judge's) take one slot each.
            num_cpus = max(sum(pool.size for pool in placement_for(cfg).pools.values()), os.cpu_count() or 1)
            console(f"starting a local Ray cluster ({num_cpus} CPU slots)")
            # address="local": a cluster of the run's own, even where another (a test's, a user's) runs here.
            ray.init(address="local", num_cpus=num_cpus, num_gpus=0, include_dashboard=False,
                     runtime_env={"env_vars": env},
                     logging_level=logging.WARNING, log_to_driver=True)
        else:
            console("starting a local Ray cluster (the machine's GPUs)")
            ray.init(address="local", runtime_env={"env_vars": env}, include_dashboard=False,
                     logging_level=logging.WARNING)
    except BaseException:
        connection.shutdown()
        raise
    return connection
