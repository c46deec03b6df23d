"""Engine fleets: a set of engine servers (SGLang's, or megarl's CPU engine server) behind one sglang-router, with a
client per engine and one for the router. The policy's rollout engines are one fleet, a generative judge's another;
both start, answer and stop the same way (:class:`EngineFleet`).

An engine server is owned by a Ray worker on its bundle (:class:`~megarl.workers.engine_server.EngineServerWorker`,
one per server process: an SGLang engine spanning nodes has one per node); the router runs on the driver's machine.
A fleet knows its engines by index (``EngineFleet.engines[i]`` is engine ``i``, its owner worker ``i`` of
``group`` for one-node engines): what a run needs to replace one later.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import ray

from megarl.config.model import ModelSource
from megarl.config.rollout import EngineConfig
from megarl.config.schema import RunConfig
from megarl.controller.progress import no_phases
from megarl.engines.client import EngineAddress, EngineClient
from megarl.engines.router import start_router
from megarl.engines.server_process import ServerProcess
from megarl.plan.placement import PlacementPlan
from megarl.seeds import SEED_STREAM_ENGINE, SEED_STREAM_JUDGE_ENGINE, derive_seed
from megarl.workers.engine_server import EngineServerWorker
from megarl.workers.group import WorkerGroup


@dataclasses.dataclass
class EngineFleet:
    """Running engine servers behind one router: their owners, a client per engine, the router and its client."""

    engine_set: EngineSet
    """What was started (the engines' placement, settings and model)."""
    group: WorkerGroup
    """The servers' owners (one worker per server process)."""
    addresses: list[EngineAddress]
    """Engine ``i``'s address (its head node's URL, admin key and control timeout)."""
    engines: list[EngineClient]
    """A client per engine (weights, memory, pause calls; naming a failed engine)."""
    router: ServerProcess
    """sglang-router over the engines: generation goes through it."""
    generator: EngineClient
    """The router's client."""

    @classmethod
    def around(cls, engine_set: EngineSet, group: WorkerGroup, addresses: list[EngineAddress],
               log_dir: str | os.PathLike, *, admin_key: str, lora_name: str | None = None, phase=no_phases
               ) -> EngineFleet:
        """The fleet of servers already started (``group``, ``addresses``): sglang-router in front of them and a
        client per engine and for the router. The router is started here, on the calling thread: it is killed when
        the thread that started it ends (``PR_SET_PDEATHSIG``), so that must be the driver's main thread. On
        failure the servers are stopped."""
        policy = engine_set.role == "rollout"
        owner = "" if policy else f"{engine_set.role} "  # the judge's: "judge engine 0", "judge sglang-router"
        try:
            with phase("starting sglang-router" if policy else f"starting the {engine_set.role}'s sglang-router"):
                router = start_router([a.url for a in addresses], policy=engine_set.rollout.router_policy,
                                      log_dir=log_dir, log_name=f"{owner.replace(' ', '_')}router.log",
                                      control_key=admin_key)
        except BaseException:
            stop_engine_servers(group)
            group.shutdown()
            raise
        engines = [EngineClient(a.url, name=f"{owner}{a.name}", admin_key=a.admin_key,
                                control_timeout_s=a.timeout_s, lora_name=lora_name) for a in addresses]
        return cls(engine_set, group, addresses, engines, router,
                   EngineClient(router.url, name=f"{owner}sglang-router", lora_name=lora_name))

    def close_clients(self) -> None:
        """Close the clients' sessions (on the driver's event loop, before it stops)."""
        close_clients([self.generator, *self.engines])

    def stop(self) -> None:
        """Stop the router and the engine servers (the group's workers are killed with the run's)."""
        self.router.stop()
        stop_engine_servers(self.group)


def start_fleet_servers(cfg: RunConfig, engine_set: EngineSet, pool, share: float, gpus: list | None,
                        log_dir: str | os.PathLike, *, admin_key: str, phase=no_phases
                        ) -> tuple[WorkerGroup, list[EngineAddress]]:
    """``engine_set``'s engine servers started and healthy (:func:`start_engine_servers`), announced as a phase. Their
    processes belong to Ray workers, so this may run on any thread of the driver."""
    with phase(f"starting {len(engine_set.engines)} {engine_set.rollout.name} {engine_set.label} server(s)"):
        return start_engine_servers(cfg, engine_set, pool, share, gpus, log_dir, admin_key=admin_key)


def close_clients(clients: list[EngineClient]) -> None:
    """Close the clients' sessions (best effort: shutting down goes on)."""
    for client in clients:
        try:
            client.close_sync()
        except Exception as error:  # noqa: BLE001 - shutting down goes on
            logging.getLogger(__name__).warning("closing %r: %s", client, error)



def stop_engine_servers(group: WorkerGroup) -> None:
    """Stop every engine server of ``group`` (best effort: a dead worker's server died with it)."""
    try:
        group.call_all(EngineServerWorker.stop_server)
    except Exception as error:  # noqa: BLE001 - shutting down: the workers are killed next anyway
        logging.getLogger(__name__).warning("stopping engine servers: %s", error)


def worker_group(cfg: RunConfig, worker_cls, pool, share: float, **kwargs) -> WorkerGroup:
    """A worker group of ``worker_cls`` on ``pool``, each worker taking ``share`` of its bundle's CPU (and GPU)."""
    gpu = 0.0 if cfg.trainer.device == "cpu" else share
    return WorkerGroup(worker_cls, pool, num_cpus=share, num_gpus=gpu, timeout_s=cfg.trainer.worker_timeout_s,
                       timeout_setting="trainer.worker_timeout_s", **kwargs)


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
    group = worker_group(cfg, EngineServerWorker, pool, share, role=engine_set.role, bundles=[s.bundle for s in slots])
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


