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

import dataclasses
import logging
import os
import secrets
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from megarl.config.schema import RunConfig
from megarl.config.validate import data_parallel_size
from megarl.controller.placement import PlacementPlan, create_pools, engine_replica, placement_for
from megarl.data.dataset import PromptDataset
from megarl.models.sampling import derive_seed
from megarl.reward import RewardManager
from megarl.convert.export import remove_shared_memory
from megarl.rollout import event_loop
from megarl.rollout.client import EngineAddress, EngineClient
from megarl.rollout.interaction import BaseInteraction, load_interactions
from megarl.rollout.manager import RolloutManager
from megarl.rollout.router import start_router
from megarl.rollout.server_process import ServerProcess
from megarl.rollout.tools.base import BaseTool
from megarl.rollout.tools.registry import load_tools
from megarl.sync import resolve_transport
from megarl.warmstart.addition_data import ADDITION_DATA_DIR, ADDITION_DATA_FILES, ensure_addition_data
from megarl.warmstart.sft import ensure_tiny_sft
from megarl.workers.engine_server import EngineServerWorker
from megarl.workers.group import WorkerGroup
from megarl.workers.megatron_workers import ActorWorker, CriticWorker

SEED_STREAM_ROLLOUT = 1
"""``derive_seed(rollout seed, SEED_STREAM_ROLLOUT, step)`` seeds a training step's generation."""
SEED_STREAM_VALIDATION = 2
"""``derive_seed(rollout seed, SEED_STREAM_VALIDATION, step, round)`` seeds a validation round."""
SEED_STREAM_ASYNC_ROLLOUT = 3
"""``derive_seed(derive_seed(rollout seed, SEED_STREAM_ASYNC_ROLLOUT), group, attempt)`` seeds a prompt group of
asynchronous training (megarl.rollout.producer)."""
SEED_STREAM_ENGINE = 7
"""``derive_seed(rollout seed, SEED_STREAM_ENGINE, i)`` seeds engine ``i``'s own generator."""


@dataclasses.dataclass
class Roles:
    """The running workers of a run and how they are wired."""

    plan: PlacementPlan
    """Where every role sits (``megarl.controller.placement``)."""
    pools: dict
    """Ray placement groups by pool name (``global``, and ``rollout`` when disaggregated)."""
    actor: WorkerGroup
    """The policy's ranks (the reference lives in the same processes)."""
    critic: WorkerGroup | None
    """The value model's ranks (PPO with GAE), else None."""
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
    loop: event_loop.EventLoopThread
    """The driver's one event loop (held from :func:`build_roles` to :meth:`shutdown`): the clients' sessions, the
    rollout manager's generation and the producer run on it."""

    @property
    def groups(self) -> list[WorkerGroup]:
        """Every worker group, in the order they were built."""
        return [g for g in (self.actor, self.critic, self.rollout) if g is not None]

    def shutdown(self) -> None:
        """Close the clients' sessions and let go of the driver's event loop (the last holder stops it and joins its
        thread), stop the router and the engine servers, kill every worker and give the pools' resources back; the
        shared-memory bucket buffers the killed workers of this machine held are unlinked."""
        for client in [self.generator, *self.engines]:
            try:
                client.close_sync()
            except Exception as error:  # noqa: BLE001 - shutting down goes on
                logging.getLogger(__name__).warning("closing %r: %s", client, error)
        event_loop.release()
        self.router.stop()
        stop_engine_servers(self.rollout)
        here = ray.get_runtime_context().get_node_id()
        pids = [info["pid"] for group in self.groups for info in getattr(group, "node_infos", [])
                if info.get("node_id") == here]
        for group in self.groups:
            group.shutdown()
        for pool in self.pools.values():
            pool.remove()
        remove_shared_memory(pids)


def build_roles(cfg: RunConfig, log_dir: str | os.PathLike) -> Roles:
    """Place and start every role of ``cfg`` (Ray must be running): the training workers, one engine server per
    engine (its log in ``log_dir``) and sglang-router in front of them; on failure nothing is left running."""
    plan = placement_for(cfg)
    trainer = cfg.trainer
    pools = create_pools(plan, use_gpu=trainer.device != "cpu", cpus_per_bundle=1.0)
    built: list[WorkerGroup] = []
    router = None
    loop = event_loop.hold()  # the driver's one event loop, until Roles.shutdown
    try:
        gpus = engine_gpus_of(plan, pools) if cfg.actor_rollout_ref.rollout.name == "sglang" else None
        separate = not cfg.actor_rollout_ref.hybrid_engine
        colocated = (1 if separate else 2) + (1 if cfg.critic.enable else 0)  # actor(+ref), engines, critic
        actor = _build_actor(cfg, pools["global"], 1.0 / colocated)
        built.append(actor)
        critic = None
        if cfg.critic.enable:
            critic = _build_critic(cfg, pools["global"], 1.0 / colocated)
            built.append(critic)
        rollout_pool = pools["rollout"] if separate else pools["global"]
        admin_key = secrets.token_urlsafe(32)  # the run's engine admin key: only the trainer drives the engines
        rollout, addresses = start_engine_servers(cfg, plan, rollout_pool, 1.0 if separate else 1.0 / colocated,
                                                  gpus, log_dir, admin_key=admin_key)
        built.append(rollout)
        engines = [EngineClient(a.url, name=a.name, admin_key=a.admin_key, control_timeout_s=a.timeout_s)
                   for a in addresses]
        router = start_router([a.url for a in addresses], policy=cfg.actor_rollout_ref.rollout.router_policy,
                              log_dir=log_dir)
        targets = engine_targets(plan, addresses, data_parallel_size(cfg, cfg.actor_rollout_ref.actor.parallel))
        names = actor.call_rank(0, ActorWorker.weight_names)
    except BaseException:
        if router is not None:
            router.stop()
        for group in built:
            if group.role == "rollout":
                stop_engine_servers(group)
            group.shutdown()
        for pool in pools.values():
            pool.remove()
        event_loop.release()
        raise
    return Roles(plan=plan, pools=pools, actor=actor, critic=critic, rollout=rollout, engines=engines,
                 router=router, generator=EngineClient(router.url, name="sglang-router"), engine_targets=targets,
                 weight_transport=resolve_transport(cfg.actor_rollout_ref.rollout.weight_transport,
                                                    colocated=plan.colocated), weight_names=names, loop=loop)


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
                       **kwargs)


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


def engine_gpus_of(plan: PlacementPlan, pools: dict) -> list:
    """Per engine, its GPUs on each of its nodes for ``sglang.launch_server``
    (:class:`~megarl.controller.engine_gpus.EngineGpus`), probed from Ray: call it right after
    ``create_pools``, before any worker holds the bundles' GPUs."""
    from megarl.controller.engine_gpus import engine_gpus, probe_bundle_gpus

    return engine_gpus(plan.engines, probe_bundle_gpus(pools))


@dataclasses.dataclass(frozen=True)
class EngineServerSlot:
    """One engine server process: engine ``engine``'s part on its node ``node_rank``, owned by a worker on
    ``bundle`` (the node's first bundle of the engine)."""

    engine: int
    node_rank: int
    bundle: int


def engine_server_slots(plan: PlacementPlan, gpus: list | None) -> list[EngineServerSlot]:
    """A server per engine (megarl's CPU server: one process whatever its TP), or for SGLang one per node an
    engine spans (``gpus``: :func:`engine_gpus_of`), node_rank 0 first."""
    if gpus is None:
        return [EngineServerSlot(e.index, 0, e.bundles[0]) for e in plan.engines]
    return [EngineServerSlot(g.engine, n.node_rank, n.bundles[0]) for g in gpus for n in g.nodes]


def start_engine_servers(cfg: RunConfig, plan: PlacementPlan, pool, share: float, gpus: list | None,
                         log_dir: str | os.PathLike, *, admin_key: str | None = None
                         ) -> tuple[WorkerGroup, list[EngineAddress]]:
    """The engine servers' owners (one :class:`EngineServerWorker` per :func:`engine_server_slots` entry, taking
    ``share`` of its bundle) with every server started (concurrently) and healthy; the engines' addresses (an
    engine spanning nodes serves on its node_rank 0). On failure nothing is left running."""
    arr = cfg.actor_rollout_ref
    slots = engine_server_slots(plan, gpus)
    group = _group(cfg, EngineServerWorker, pool, share, role="rollout", bundles=[s.bundle for s in slots])
    host = "127.0.0.1" if on_this_machine_only() else None  # nothing listens beyond what must reach it
    try:
        seeds = [derive_seed(cfg.rollout_seed, SEED_STREAM_ENGINE, i) for i in range(len(plan.engines))]
        calls = [{"engine": s.engine, "node_rank": s.node_rank, "tp": plan.engines[s.engine].tp} for s in slots]
        # Routing replay: the engines return every token's routed experts (SGLang's flag; megarl's server's too).
        from megarl.controller.engine_gpus import ROUTED_EXPERTS_FLAG

        routed = (ROUTED_EXPERTS_FLAG,) if arr.actor.router_replay.enabled else ()
        if gpus is None:
            for call in calls:
                call["extra_args"] = routed
        if gpus is not None:
            from megarl.controller.engine_gpus import sglang_launch_command

            heads = {s.engine: rank for rank, s in enumerate(slots) if s.node_rank == 0}
            # A multi-node engine's first node also picks its --dist-init-addr port.
            where = group.call_ranks([((), {"num_ports": 2 if s.node_rank == 0 and gpus[s.engine].nnodes > 1 else 1,
                                            "host": host})
                                      for s in slots], EngineServerWorker.address)
            for slot, call, (serve_on, ports) in zip(slots, calls, where, strict=True):
                engine = gpus[slot.engine]
                if engine.nnodes > 1:
                    engine = engine.with_dist_init_port(where[heads[slot.engine]][1][1])
                call["launch"] = sglang_launch_command(engine, rollout=arr.rollout, model=arr.model, port=ports[0],
                                                       seed=seeds[slot.engine], node_rank=slot.node_rank,
                                                       host=serve_on, return_routed_experts=bool(routed))
                call["url"] = f"http://{serve_on}:{ports[0]}"
        urls = group.call_ranks([((), dict(rollout=arr.rollout, model=arr.model, seed=seeds[s.engine],
                                          device=cfg.trainer.device, log_dir=str(log_dir), admin_key=admin_key,
                                          host=host, **call))
                                 for s, call in zip(slots, calls)], EngineServerWorker.start_server)
    except BaseException:
        stop_engine_servers(group)
        group.shutdown()
        raise
    head_url = {s.engine: url for s, url in zip(slots, urls) if s.node_rank == 0}
    return group, [EngineAddress(index=e.index, url=head_url[e.index], tp=e.tp, admin_key=admin_key,
                                 timeout_s=arr.rollout.engine_timeout_s) for e in plan.engines]


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
                          routing_shape=routing)


def routing_shape(cfg: RunConfig) -> tuple[int, int] | None:
    """``(num_hidden_layers, top_k)`` of the policy when ``actor.router_replay`` is on (the shape of each token's
    routed experts the engines return), None when off; refuses a dense policy, naming the key."""
    replay = cfg.actor_rollout_ref.actor.router_replay
    if not replay.enabled:
        return None
    from transformers import AutoConfig

    from megarl.models import family_for

    model = cfg.actor_rollout_ref.model
    hf_config = AutoConfig.from_pretrained(model.local_path, trust_remote_code=model.trust_remote_code)
    family = family_for(hf_config)
    if family.moe is None:
        raise ValueError(f"actor_rollout_ref.actor.router_replay.mode={replay.mode} needs a mixture-of-experts policy; "
                         f"actor_rollout_ref.model.path={model.path!r} is a {family.name} model: set the mode to off")
    return int(hf_config.num_hidden_layers), family.moe.topk(hf_config)


def prepare_policy(cfg: RunConfig) -> None:
    """Make sure the policy's HF directory and the data exist, before anything is placed: check a pretrained
    model's directories (and the critic's), refuse missing data files naming the key, and for
    ``model.init=tiny_sft`` write the addition data at its default paths and build the cached SFT warm start."""
    model = cfg.actor_rollout_ref.model
    if model.init != "tiny_sft":
        _check_model_directories(cfg)
    train = _check_data(cfg)
    if model.init == "tiny_sft":
        ensure_tiny_sft(model.local_path, [str(p) for p in train], steps=model.sft_steps, lr=model.sft_lr,
                        seed=cfg.trainer.seed, stop_reward=model.sft_stop_reward, arch=model.tiny_arch)


def _check_model_directories(cfg: RunConfig) -> None:
    model = cfg.actor_rollout_ref.model
    if not Path(model.local_path).is_dir():
        raise ValueError(f"actor_rollout_ref.model.path={model.path!r} is not a directory; give an HF model "
                         f"directory (convert hub checkpoints with megarl-convert) or use model.init=tiny_sft")
    if model.tokenizer_path is None:
        check_model_directory(model.local_path, "actor_rollout_ref.model.path")
    else:
        check_model_directory(model.local_path, "actor_rollout_ref.model.path", parts=("config", "weights"))
        check_model_directory(model.local_tokenizer_path, "actor_rollout_ref.model.tokenizer_path",
                              parts=("tokenizer",))
    if cfg.critic.enable and cfg.critic.model_path is not None:
        check_model_directory(str(Path(cfg.critic.model_path).expanduser()), "critic.model_path",
                              parts=("config", "weights"))


def _check_data(cfg: RunConfig) -> list[Path]:
    """The training files; a missing data file is an error naming its key, except the tiny recipe's own
    default files, which are written (never anywhere else: a typo must not fill with addition problems)."""
    data = cfg.data
    train = [Path(f).expanduser() for f in data.train_files]
    val = [Path(f).expanduser() for f in data.val_files]
    missing = [(key, p) for key, files in (("data.train_files", train), ("data.val_files", val))
               for p in files if not p.is_file()]
    defaults = {(Path(ADDITION_DATA_DIR) / name).resolve() for name in ADDITION_DATA_FILES}
    tiny = cfg.actor_rollout_ref.model.init == "tiny_sft"
    if missing and tiny and all(p.resolve() in defaults for _, p in missing):
        ensure_addition_data(ADDITION_DATA_DIR)
    elif missing:
        key, path = missing[0]
        raise ValueError(f"{key}: {path} does not exist ({len(missing)} missing data file(s)); give existing parquet "
                         f"files (tools/ converts GSM8K; the tiny recipe writes its own only at "
                         f"{ADDITION_DATA_DIR}/{{{','.join(ADDITION_DATA_FILES)}}})")
    for key, files in (("data.train_files", train), ("data.val_files", val)):
        for path in files:
            try:
                columns = pq.read_schema(path).names
            except (OSError, pa.ArrowException) as error:
                raise ValueError(f"{key}: {path} is not a readable parquet file ({error})") from error
            if data.prompt_key not in columns:
                raise ValueError(f"{key}: {path} has no column {data.prompt_key!r} (data.prompt_key) holding the "
                                 f"chat messages; its columns are {columns}")
            missing_columns = [c for c in ("data_source", "reward_model") if c not in columns]
            if missing_columns:
                raise ValueError(f"{key}: {path} has no column(s) {missing_columns}, which pick each row's reward "
                                 f"scorer and hold its ground truth; its columns are {columns}")
    return train


MODEL_FILES = {
    "config": ("config.json",),
    "weights": ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json"),
    "tokenizer": ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json"),
}
"""What an HF model directory must hold, by part: any one of the patterns."""


def check_model_directory(path: str, key: str, *, parts=("config", "weights", "tokenizer")) -> None:
    """Refuse an HF directory that lacks a config, weights or a tokenizer, naming ``key`` and what is missing
    (transformers' own errors for an empty directory name neither the setting nor the file)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{key}={path!r} is not a directory")
    missing = [part for part in parts if not any(any(directory.glob(p)) for p in MODEL_FILES[part])]
    if missing:
        wanted = "; ".join(f"{part}: one of {', '.join(MODEL_FILES[part])}" for part in missing)
        raise ValueError(f"{key}={path!r} has no {' / '.join(missing)} ({wanted}); point {key} at an HF model "
                         f"directory (megarl-convert mcore-to-hf writes one)")


def check_run_inputs(cfg: RunConfig) -> None:
    """What the config names outside itself, checked before anything is placed: the machine has the
    ``trainer.device`` it asks for (a local cluster only; with ``RAY_ADDRESS`` the cluster decides), and
    the multi-turn tool and interaction files exist. Each error names the key."""
    if cfg.trainer.device == "cuda" and not os.environ.get("RAY_ADDRESS") and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but this machine has no usable CUDA GPU and RAY_ADDRESS names no "
                         "cluster: set trainer.device=cpu (with trainer.n_cpu_ranks), or run on GPU machines")
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable:
        for key, path in (("tool_config_path", multi_turn.tool_config_path),
                          ("interaction_config_path", multi_turn.interaction_config_path)):
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"actor_rollout_ref.rollout.multi_turn.{key}={path!r} does not exist")


def check_resume_layout(cfg: RunConfig, checkpoint: Path | None) -> None:
    """Refuse, before Ray, a checkpoint whose actor (or critic) was saved at another layout than the config's:
    its optimizer and RNG states load only at the saved one. The error names both layouts and the keys."""
    from megarl.config.validate import data_parallel_size
    from megarl.workers.model_checkpoint import layout_mismatch, read_model_metadata

    if checkpoint is None:
        return
    roles = [("actor", "actor_rollout_ref.actor.parallel", cfg.actor_rollout_ref.actor.parallel)]
    if cfg.critic.enable:
        roles.append(("critic", "critic.parallel", cfg.critic.parallel))
    for role, key, parallel in roles:
        if not (checkpoint / role).is_dir():
            raise ValueError(f"checkpoint {checkpoint} has no {role}/ directory, and this run trains a {role}; resume "
                             f"from a checkpoint of a run like this one, or start fresh (trainer.resume_mode=disable)")
        dims = parallel.for_world(data_parallel_size(cfg, parallel) * parallel.model_parallel_size)
        mismatch = layout_mismatch(read_model_metadata(checkpoint / role), dims)
        if mismatch is not None:
            raise ValueError(f"checkpoint {checkpoint / role} was {mismatch}: its optimizer and RNG states load only "
                             f"at the saved layout; set {key}.* (tp, pp, vpp, cp, ep, etp) and the world size "
                             f"(trainer.n_gpus_per_node, trainer.nnodes or trainer.n_cpu_ranks) to match it, or "
                             f"start fresh (trainer.resume_mode=disable, or another trainer.experiment_name)")


def build_datasets(cfg: RunConfig, tokenizer, plugins: AgentPlugins | None = None,
                   console=print) -> tuple[PromptDataset, PromptDataset | None]:
    """The training and validation prompt sets (``data.*``); the count of dropped over-long prompts is reported.

    With multi-turn tools, a prompt's length counts the tool schemas the chat template adds to it. A set left
    without any prompt is an error naming its key."""
    kwargs = cfg.data.dataset_kwargs()
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        kwargs["return_raw_chat"] = True
    schemas = plugins.tool_schemas() if plugins is not None else {}
    counted = f" (the {len(schemas)} tool schemas included)" if schemas else ""
    train = PromptDataset(cfg.data.train_files, tokenizer, tool_schemas=schemas, **kwargs)
    val = PromptDataset(cfg.data.val_files, tokenizer, tool_schemas=schemas, **kwargs) if cfg.data.val_files else None
    for key, ds in (("data.train_files", train), ("data.val_files", val)):
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

    def manager(num_examine: int) -> RewardManager:
        return RewardManager(tokenizer, compute_score=custom.spec(), reward_kwargs=custom.reward_kwargs or None,
                             scorer_kwargs=reward.scorer_kwargs, num_examine=num_examine, on_error=reward.on_error,
                             timeout_s=reward.timeout_s)

    train, val = manager(reward.num_examine), manager(1)  # verl logs one decoded sample per source in validation
    train.check_data_sources(train_set.data_sources(), "data.train_files")
    if val_set is not None:
        val.check_data_sources(val_set.data_sources(), "data.val_files")
    return train, val


def init_ray(cfg: RunConfig, console=print) -> bool:
    """Join the cluster at ``RAY_ADDRESS`` or start a local one (CPU: ``trainer.n_cpu_ranks`` slots at least);
    a no-op when Ray is up. Returns True when this call started Ray (the caller then stops it).

    Ray's ports listen on every interface: a local cluster without token authentication (``RAY_AUTH_MODE`` other
    than ``token``, which Ray reads when it is imported: ``megarl-train`` sets it with a fresh ``RAY_AUTH_TOKEN``
    first) lets anyone who reaches them run code in the run's cluster, and is warned about. A cluster joined at
    ``RAY_ADDRESS`` uses its own settings."""
    if ray.is_initialized():
        return False
    trainer = cfg.trainer
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("RAY_ADDRESS"):
        console(f"joining the Ray cluster at {os.environ['RAY_ADDRESS']}")
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env})
        return True
    if os.environ.get("RAY_AUTH_MODE") != "token":
        logging.getLogger(__name__).warning("a local Ray cluster without token authentication (RAY_AUTH_MODE=%s): "
                                            "any process that reaches this machine's Ray ports can run code in the "
                                            "run's cluster; megarl-train turns it on unless RAY_AUTH_MODE is set",
                                            os.environ.get("RAY_AUTH_MODE", "unset"))
    if trainer.device == "cpu":
        num_cpus = max(trainer.n_cpu_ranks, os.cpu_count() or 1)
        console(f"starting a local Ray cluster ({num_cpus} CPU slots)")
        ray.init(num_cpus=num_cpus, num_gpus=0, include_dashboard=False, runtime_env={"env_vars": env},
                 logging_level=logging.WARNING, log_to_driver=True)
    else:
        console("starting a local Ray cluster (the machine's GPUs)")
        ray.init(runtime_env={"env_vars": env}, include_dashboard=False, logging_level=logging.WARNING)
    return True
