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
from megarl.config.schema import RunConfig
from megarl.controller import role_memory
from megarl.controller.fleet import (
    EngineFleet,
    EngineSet,
    engine_gpus_of,
    judge_engines,
    policy_engines,
    start_fleet_servers,
    stop_engine_servers,
    worker_group,
)
from megarl.controller.progress import no_phases
from megarl.data.dataset import PromptDataset
from megarl.engines import event_loop
from megarl.engines.client import EngineAddress, EngineClient
from megarl.engines.lora_wire import ADAPTER_NAME
from megarl.engines.server_process import ServerProcess
from megarl.parallel.net import RAY_LOOPBACK_VARIABLE
from megarl.parallel.reaper import Reaper, start_reaper
from megarl.parallel.shared_memory import remove_shared_memory
from megarl.plan.placement import JUDGE_POOL, PlacementPlan, create_pools, engine_replica, placement_for
from megarl.reward import RewardManager
from megarl.reward.manager import OverlongPenalty
from megarl.rollout.interaction import BaseInteraction, load_interactions
from megarl.rollout.manager import RolloutManager
from megarl.rollout.tools.base import BaseTool
from megarl.rollout.tools.registry import load_tools
from megarl.sync import resolve_transport
from megarl.workers.group import WorkerGroup
from megarl.workers.megatron_workers import ActorWorker
from megarl.workers.roles import RoleSpec, enabled_roles


@dataclasses.dataclass
class Roles:
    """The running workers of a run and how they are wired."""

    plan: PlacementPlan
    """Where every role sits (``megarl.plan.placement``)."""
    pools: dict
    """Ray placement groups by pool name (``global``, and ``rollout`` when disaggregated)."""
    training: dict[str, WorkerGroup]
    """The Megatron roles' ranks by role name (``megarl.workers.roles``: actor, critic, teacher, reward_model), those
    the run enables; empty when generating only."""
    fleet: EngineFleet
    """The policy's rollout engines: their owners, a client per engine, sglang-router and its client."""
    engine_targets: list[EngineAddress]
    """Every engine with who feeds it weights (its actor DP replica; the actor ranks on its GPUs)."""
    weight_transport: str
    """The weight sync's transport (``tensor`` or ``distributed``: :mod:`megarl.sync`)."""
    weight_names: list[str]
    """Every HF tensor name of the policy, in export order."""
    judge: EngineFleet | None
    """A generative judge's engines and router (``reward_model.judge``), else None."""
    loop: event_loop.EventLoopThread
    """The driver's one event loop (held from :func:`build_roles` to :meth:`shutdown`): the clients' sessions, the
    rollout manager's generation and the producer run on it."""

    @property
    def actor(self) -> WorkerGroup | None:
        """The policy's ranks (the reference lives in the same processes); None when generating only."""
        return self.training.get("actor")

    def group(self, role: str) -> WorkerGroup:
        """The ranks of Megatron role ``role`` (a :data:`~megarl.workers.roles.ROLE_SPECS` name the run enables)."""
        if role not in self.training:
            raise KeyError(f"the run has no {role!r} role; it runs {sorted(self.training)}")
        return self.training[role]

    @property
    def rollout(self) -> WorkerGroup:
        """One worker per rollout engine server, owning its process."""
        return self.fleet.group

    @property
    def engines(self) -> list[EngineClient]:
        """A client per rollout engine."""
        return self.fleet.engines

    @property
    def router(self) -> ServerProcess:
        """sglang-router over the rollout engines: generation goes through it."""
        return self.fleet.router

    @property
    def generator(self) -> EngineClient:
        """The router's client."""
        return self.fleet.generator

    @property
    def fleets(self) -> list[EngineFleet]:
        """The policy's engines, then the judge's."""
        return [self.fleet, *([self.judge] if self.judge is not None else [])]

    @property
    def groups(self) -> list[WorkerGroup]:
        """Every worker group, in the order they were built."""
        return [*self.training.values(), *(fleet.group for fleet in self.fleets)]

    def shutdown(self) -> None:
        """Close the clients' sessions and let go of the driver's event loop (the last holder stops it and joins its
        thread), stop the router and the engine servers, kill every worker and give the pools' resources back; the
        shared-memory bucket buffers the killed workers held are unlinked on every node (this one here, the
        others by a task pinned to each)."""
        for fleet in self.fleets:
            fleet.close_clients()
        event_loop.release()
        for fleet in self.fleets:
            fleet.stop()
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
    fleets: list[EngineFleet] = []
    loop = event_loop.hold()  # the driver's one event loop, until Roles.shutdown
    starting = None
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
        # Training with adapters synced alone: every request names the run's adapter (loaded at the first sync).
        lora_name = ADAPTER_NAME if training and cfg.lora_syncs_adapters else None
        start_servers = functools.partial(
            _start_servers, cfg, policy_set, pools["rollout"] if separate else pools["global"],
            1.0 if separate else 1.0 / colocated, probed, log_dir, admin_key, phase)
        if training and (separate or cfg.trainer.device == "cpu"):
            starting = _in_background(start_servers)
        groups = _build_training_roles(cfg, plan, pools, colocated, built, phase) if training else {}
        servers = starting.result() if starting is not None else start_servers()
        starting = None
        fleets.append(EngineFleet.around(policy_set, *servers, log_dir, admin_key=admin_key, lora_name=lora_name,
                                         phase=phase))
        if judge_set is not None:
            judge = _start_servers(cfg, judge_set, pools[JUDGE_POOL], 1.0, probed, log_dir, admin_key, phase)
            fleets.append(EngineFleet.around(judge_set, *judge, log_dir, admin_key=admin_key, phase=phase))
        targets, names = [], []
        if training:
            targets = engine_targets(plan, fleets[0].addresses,
                                     data_parallel_size(cfg, cfg.actor_rollout_ref.actor.parallel))
            names = groups["actor"].call_rank(0, ActorWorker.weight_names)
    except BaseException:
        _stop_started(starting, fleets, built, pools)
        raise
    return Roles(plan=plan, pools=pools, training=groups, fleet=fleets[0], engine_targets=targets,
                 weight_transport=resolve_transport(cfg.actor_rollout_ref.rollout.weight_transport,
                                                    colocated=plan.colocated, device=cfg.trainer.device),
                 weight_names=names, loop=loop, judge=fleets[1] if judge_set is not None else None)


def _colocated_roles(cfg: RunConfig, separate: bool) -> int:
    """How many roles share each bundle of the training pool: the Megatron roles the run enables and the engines
    unless they are on a pool of their own."""
    return len(enabled_roles(cfg)) + (0 if separate else 1)


def _build_training_roles(cfg: RunConfig, plan: PlacementPlan, pools: dict, colocated: int,
                          built: list[WorkerGroup], phase) -> dict[str, WorkerGroup]:
    """Build every Megatron role ``cfg`` enables (:func:`~megarl.workers.roles.enabled_roles`), each appended to
    ``built`` as it is ready (stopped by the caller on failure), then move their memory to the host by their
    offload flags (SGLang sizes its KV pool beside what stays on the GPUs; the trainer onloads)."""
    groups: dict[str, WorkerGroup] = {}
    for spec in enabled_roles(cfg):
        with phase(spec.title(cfg, plan.role(spec.name).world_size)):
            groups[spec.name] = build_role(cfg, spec, pools["global"], 1.0 / colocated)
        built.append(groups[spec.name])
    for role, group in groups.items():
        role_memory.offload(cfg, group, role)
    return groups


def build_role(cfg: RunConfig, spec: RoleSpec, pool, share: float) -> WorkerGroup:
    """Role ``spec``'s ranks on ``pool`` (``share`` of each bundle), built by its worker calls (each given the run's
    seed; the ranks' coordinates read after the first); on failure its workers are killed."""
    worker_cls = spec.worker_class()
    group = worker_group(cfg, worker_cls, pool, share, role=spec.name)
    try:
        for index, (method, kwargs) in enumerate(spec.calls(cfg)):
            group.call_all(getattr(worker_cls, method), seed=cfg.trainer.seed, **kwargs)
            if index == 0:
                group.refresh_coordinates()
    except BaseException:
        group.shutdown()
        raise
    return group


def _start_servers(cfg: RunConfig, engine_set: EngineSet, pool, share: float, probed: dict | None, log_dir,
                   admin_key: str, phase) -> tuple[WorkerGroup, list[EngineAddress]]:
    """``engine_set``'s engine servers started and healthy (any thread: their processes belong to Ray workers)."""
    gpus = engine_gpus_of(engine_set.engines, probed) if engine_set.rollout.name == "sglang" else None
    return start_fleet_servers(cfg, engine_set, pool, share, gpus, log_dir, admin_key=admin_key, phase=phase)


def _in_background(call: Callable[[], Any]) -> concurrent.futures.Future:
    """``call()`` on a thread of its own; its result (or its error) in the future."""
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-start")
    try:
        return executor.submit(call)
    finally:
        executor.shutdown(wait=False)


def _stop_started(starting: concurrent.futures.Future | None, fleets: list[EngineFleet], built: list[WorkerGroup],
                  pools: dict) -> None:
    """Stop what a failed :func:`build_roles` started: the policy's servers still starting (once their start ends:
    it cannot be cut short), every fleet started (router, servers), every group built, the pools; let go of the
    driver's event loop."""
    if starting is not None:
        try:
            group, _ = starting.result()
        except BaseException:  # noqa: BLE001 - a failed start stopped its own servers; the first error is raised
            pass
        else:
            stop_engine_servers(group)
            built.append(group)
    for fleet in fleets:
        fleet.close_clients()
        fleet.stop()
        built.append(fleet.group)
    for group in built:
        group.shutdown()
    for pool in pools.values():
        pool.remove()
    event_loop.release()


def engine_targets(plan: PlacementPlan, addresses: list[EngineAddress], dp: int) -> list[EngineAddress]:
    """``addresses`` with who feeds each engine: its actor DP replica (TP-matched engines the one on whose GPUs
    they sit, others dealt round-robin) and, colocated, the actor ranks on its GPUs in engine TP order."""
    actor_bundles = plan.role("actor").bundles
    out = []
    for address, engine in zip(addresses, plan.engines, strict=True):
        hosts = tuple(actor_bundles.index(b) for b in engine.bundles) if plan.colocated else ()
        out.append(dataclasses.replace(address, replica=engine_replica(engine, dp), host_ranks=hosts))
    return out


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
