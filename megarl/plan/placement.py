"""Where every role's ranks and every rollout engine run: resource pools and the placement plan.

Two layers:

- **The plan** (pure, no Ray): :func:`make_placement` / :func:`plan_placement` decide which
  bundle of which pool hosts rank r of each role (actor, ref, critic, teacher, rollout, reward_model)
  and which bundles each rollout engine serves on. Tested without Ray.
- **The pools** (Ray): :class:`ResourcePool` reserves the bundles as Ray placement groups and
  hands out a scheduling strategy per bundle; ``megarl.workers.group.WorkerGroup`` spawns
  one rank per bundle on it.

Bundles. One bundle per GPU, ``{"GPU": 1, "CPU": cpus_per_bundle}`` (CPU-only runs:
``{"CPU": cpus_per_bundle}``; tests fake GPUs with ``ray.init(num_gpus=K)`` and keep the GPU
bundles). Bundle ``b`` of a pool is its b-th GPU counted node by node: node 0's GPUs first.

Placement-group strategy. One placement group per node, ``STRICT_PACK``: all GPUs of a
node's group land on one machine, so the plan's "bundles b..b+k are on one node" holds and
TP groups (and TP-matched engines) never straddle a network link. ``PACK`` would be
best-effort and may spill a "node" over two machines when the cluster is fragmented, which
silently puts NCCL tensor-parallel traffic on the network; we would rather wait (and time
out naming the pool) than run that layout.

Rank order. Rank r of a role runs on bundle r of its pool. Megatron orders ranks
``tp-cp-ep-dp-pp`` (TP fastest, PP slowest), so each TP group is ``tp`` consecutive
bundles, on one node when ``tp`` divides the GPUs per node.

Colocated (the default): every role maps to the one pool ``"global"``; actor, ref, critic, teacher
ranks and the rollout engines share the same GPU bundles (each process gets
``1/colocate_count`` of a GPU; engines release their memory while the trainer works).
Disaggregated: the rollout engines get their own pool (``rollout_nodes``), training roles
keep ``"global"``.

TP-matched engines (colocated and ``engine_tp == actor.tp``, the default): an engine serves
on the bundles of one actor TP group, so engine i of DP replica d holds exactly the
weight shards that those actor ranks hold (for their stage) and weight sync is
shard-local. With ``pp > 1`` (or ``cp > 1``) a DP replica has ``pp × cp`` TP groups; we
map onto them with ``engine_layout``:

- ``"per_tp_group"`` (default): one engine on every TP group, i.e. ``pp × cp`` engines per
  replica and ``world / tp`` in all. Every GPU generates during rollout. Each engine holds
  the full model at TP = actor TP (inference weights at 1/tp per GPU, which fit where
  training needed PP for optimizer states and activations); weight sync is shard-local in
  TP and broadcast along the pipeline group for the other stages' layers.
- ``"per_replica"``: one engine per DP replica, on its first TP group (pp_rank 0,
  cp_rank 0); engine i serves on the bundles of DP replica i. The other GPUs of the
  replica do not generate. Use it when full-model inference weights at 1/tp do not fit.

Engines are numbered replica by replica (then pipeline stage, then context rank), so
engines ``i·k .. i·k+k-1`` serve DP replica ``i`` (``k`` engines per replica).
An engine TP different from the actor's, or a separate rollout pool, tiles the rollout
pool's bundles with consecutive groups of ``engine_tp`` (not TP-matched: sync gathers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from megarl.config.parallel import ParallelDims
from megarl.config.rollout import ENGINE_LAYOUTS
from megarl.config.schema import RunConfig
from megarl.workers.roles import SPEC_OF, enabled_roles

ROLES = (*SPEC_OF, "ref", "rollout")
"""Role names known to the plan: the Megatron roles (``megarl.workers.roles``), the reference (the actor's ranks) and
``rollout`` (the engines)."""
GLOBAL_POOL = "global"
ROLLOUT_POOL = "rollout"
JUDGE_POOL = "judge"
"""A generative judge's own pool (``reward_model.judge.pool_nodes``)."""


# ------------------------------------------------------------------------------------ plan


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """A pool's shape: GPUs (bundles) per node. Bundle b is counted node by node."""

    name: str
    nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.nodes or any(not isinstance(n, int) or n < 1 for n in self.nodes):
            raise ValueError(f"pool {self.name!r}: nodes must be a non-empty list of positive GPU counts per node, "
                             f"got {list(self.nodes)}")

    @property
    def size(self) -> int:
        """Bundles (GPUs) in the pool."""
        return sum(self.nodes)

    def locate(self, bundle: int) -> tuple[int, int]:
        """``(node index, bundle index within that node's placement group)`` of pool bundle ``bundle``."""
        if not 0 <= bundle < self.size:
            raise ValueError(f"pool {self.name!r} has bundles 0..{self.size - 1}, got bundle {bundle}")
        for node, count in enumerate(self.nodes):
            if bundle < count:
                return node, bundle
            bundle -= count
        raise AssertionError("unreachable")

    def node_of(self, bundle: int) -> int:
        return self.locate(bundle)[0]


@dataclasses.dataclass(frozen=True)
class RolePlacement:
    """One role's ranks: rank r runs on ``bundles[r]`` of pool ``pool``."""

    role: str
    pool: str
    bundles: tuple[int, ...]
    dims: ParallelDims | None
    """The role's layout bound to its world size (``None`` for rollout)."""

    @property
    def world_size(self) -> int:
        return len(self.bundles)


@dataclasses.dataclass(frozen=True)
class EnginePlacement:
    """One rollout engine: its TP ranks run on ``bundles`` of pool ``pool`` (engine TP rank k on bundles[k])."""

    index: int
    pool: str
    bundles: tuple[int, ...]
    nodes: tuple[int, ...]
    """The pool's nodes holding the engine's bundles, in TP order: one, or whole nodes when its TP
    exceeds a node (a multi-node SGLang engine: ``--nnodes``, node_rank = position here)."""
    tp_matched: bool
    """True when engine TP rank k shares a bundle with actor TP rank k of one actor TP group."""
    dp_rank: int | None = None
    """The actor DP replica whose bundles this engine serves on (TP-matched only)."""
    pp_rank: int | None = None
    cp_rank: int | None = None
    actor_ranks: tuple[int, ...] = ()
    """Actor ranks on the same bundles, engine TP rank order (TP-matched only)."""

    @property
    def tp(self) -> int:
        return len(self.bundles)

    @property
    def node(self) -> int:
        """The engine's first node (the one serving HTTP when it spans several)."""
        return self.nodes[0]


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """Pools, each role's ranks on their bundles, and the rollout engines."""

    pools: dict[str, PoolSpec]
    roles: dict[str, RolePlacement]
    engines: tuple[EnginePlacement, ...]
    engine_layout: str
    judge_engines: tuple[EnginePlacement, ...] = ()
    """A generative judge's engines, on pool ``judge`` (``reward_model.judge``); none without a judge."""

    @property
    def colocated(self) -> bool:
        """True when the rollout engines share their pool with the actor."""
        return self.roles["rollout"].pool == self.roles["actor"].pool

    def colocate_count(self, pool: str) -> int:
        """Role processes sharing each bundle of ``pool`` (every role spans its whole pool)."""
        return sum(1 for placement in self.roles.values() if placement.pool == pool)

    def gpu_fraction(self, role: str) -> float:
        """GPU share of one rank of ``role``: 1 / (roles sharing its bundles)."""
        return 1.0 / self.colocate_count(self.role(role).pool)

    def role(self, role: str) -> RolePlacement:
        if role not in self.roles:
            raise KeyError(f"role {role!r} is not placed; placed roles: {sorted(self.roles)}")
        return self.roles[role]

    def engines_of_replica(self, dp_rank: int) -> list[EnginePlacement]:
        """TP-matched engines serving on the bundles of actor DP replica ``dp_rank``."""
        return [e for e in self.engines if e.dp_rank == dp_rank]

    def describe(self) -> str:
        """Human-readable summary (one line per pool, role and engine group)."""
        lines = [f"pool {p.name}: {p.size} GPUs on {len(p.nodes)} node(s) {list(p.nodes)}" for p in self.pools.values()]
        for placement in self.roles.values():
            dims = placement.dims
            layout = f" tp={dims.tp} pp={dims.pp} cp={dims.cp} dp={dims.dp}" if dims is not None else ""
            lines.append(f"{placement.role}: {placement.world_size} ranks on pool {placement.pool}{layout}")
        matched = "TP-matched" if self.engines and self.engines[0].tp_matched else "not TP-matched"
        lines.append(f"rollout: {len(self.engines)} engines of TP {self.engines[0].tp} ({matched}, "
                     f"layout {self.engine_layout})")
        if self.judge_engines:
            lines.append(f"judge: {len(self.judge_engines)} engines of TP {self.judge_engines[0].tp} on pool "
                         f"{JUDGE_POOL}")
        return "\n".join(lines)


def engine_replica(engine: EnginePlacement, dp: int) -> int:
    """The actor DP replica that streams weights into ``engine``: the one on whose GPUs a TP-matched
    engine sits, else engines are dealt round-robin over the ``dp`` replicas."""
    return engine.dp_rank if engine.tp_matched and engine.dp_rank is not None else engine.index % dp


def megatron_coordinates(rank: int, dims: ParallelDims) -> tuple[int, int, int, int]:
    """``(tp_rank, cp_rank, dp_rank, pp_rank)`` of global ``rank`` in Megatron's ``tp-cp-ep-dp-pp`` order.

    Used only to plan; at run time the workers report their own coordinates.
    """
    tp, cp, dp = dims.tp, dims.cp, dims.dp
    if dp is None:
        raise ValueError("megatron_coordinates needs dims with dp bound (ParallelDims.for_world)")
    return rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def _check_engine_nodes(pool: PoolSpec, bundles: Sequence[int], key: str) -> int:
    """The one node of a TP group of a training role (Megatron's TP stays within a node)."""
    nodes = sorted({pool.node_of(b) for b in bundles})
    if len(nodes) > 1:
        raise ValueError(
            f"{key}={len(bundles)}: a group of {len(bundles)} bundles would span nodes {nodes} of pool {pool.name!r} "
            f"(GPUs per node {list(pool.nodes)}); choose {key} dividing the GPUs per node"
        )
    return nodes[0]


def _engine_nodes(pool: PoolSpec, bundles: Sequence[int], key: str) -> tuple[int, ...]:
    """The nodes of one engine's bundles: one node, or several whole nodes of equal size (SGLang splits an
    engine's TP ranks evenly over ``--nnodes`` nodes, each node running ``tp / nnodes`` of them)."""
    nodes = tuple(dict.fromkeys(pool.node_of(b) for b in bundles))
    if len(nodes) == 1:
        return nodes
    held = [sum(1 for b in bundles if pool.node_of(b) == n) for n in nodes]
    if any(h != pool.nodes[n] for h, n in zip(held, nodes)) or len(set(held)) > 1:
        raise ValueError(
            f"{key}={len(bundles)}: an engine of {len(bundles)} GPUs would hold {held} GPUs of nodes {list(nodes)} of "
            f"pool {pool.name!r} (GPUs per node {list(pool.nodes)}); an engine spanning nodes must take whole nodes "
            f"of equal size: choose {key} dividing the GPUs per node, or a multiple of them on equal nodes"
        )
    return nodes


def plan_placement(
    pools: Mapping[str, Sequence[int]],
    mapping: Mapping[str, str],
    dims: Mapping[str, ParallelDims],
    *,
    engine_tp: int | None = None,
    engine_layout: str = "per_tp_group",
) -> PlacementPlan:
    """The general plan: ``pools`` name → GPUs per node, ``mapping`` role → pool name,
    ``dims`` training role → its parallel layout (dp derived from the pool size).

    ``mapping`` must place ``actor`` and ``rollout``; every training role in ``mapping`` needs
    ``dims``. Each role spans all bundles of its pool.
    """
    specs = {name: PoolSpec(name, tuple(nodes)) for name, nodes in pools.items()}
    for role in ("actor", "rollout"):
        if role not in mapping:
            raise ValueError(f"placement mapping must place role {role!r}; got roles {sorted(mapping)}")
    if engine_layout not in ENGINE_LAYOUTS:
        raise ValueError(f"rollout.engine_layout must be one of {ENGINE_LAYOUTS}, got {engine_layout!r}")
    roles: dict[str, RolePlacement] = {}
    for role, pool_name in mapping.items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} in placement mapping; roles are {ROLES}")
        if pool_name not in specs:
            raise ValueError(f"role {role!r} maps to pool {pool_name!r}, but the pools are {sorted(specs)}")
        pool = specs[pool_name]
        role_dims = None
        if role != "rollout":
            if role not in dims:
                raise ValueError(f"role {role!r} is placed but has no parallel layout ({role}.parallel)")
            try:
                role_dims = dims[role].for_world(pool.size)
            except ValueError as err:
                raise ValueError(f"{role}.parallel on pool {pool_name!r} ({pool.size} GPUs): {err}") from err
            if role_dims.tp > 1:
                for start in range(0, pool.size, role_dims.tp):
                    _check_engine_nodes(pool, range(start, start + role_dims.tp), f"{role}.parallel.tp")
        roles[role] = RolePlacement(role, pool_name, tuple(range(pool.size)), role_dims)

    actor, rollout = roles["actor"], roles["rollout"]
    actor_dims = actor.dims
    assert actor_dims is not None
    engine_tp = actor_dims.tp if engine_tp is None else engine_tp
    if not isinstance(engine_tp, int) or engine_tp < 1:
        raise ValueError(f"rollout.tp must be a positive integer, got {engine_tp!r}")
    rollout_pool = specs[rollout.pool]
    if rollout_pool.size % engine_tp:
        raise ValueError(f"rollout.tp={engine_tp} does not divide the {rollout_pool.size} GPUs of pool "
                         f"{rollout_pool.name!r}: choose rollout.tp dividing {rollout_pool.size}")
    tp_matched = rollout.pool == actor.pool and engine_tp == actor_dims.tp
    engines: list[EnginePlacement] = []
    if tp_matched:
        groups = []
        for start in range(0, rollout_pool.size, engine_tp):
            tp_rank, cp_rank, dp_rank, pp_rank = megatron_coordinates(start, actor_dims)
            assert tp_rank == 0
            if engine_layout == "per_replica" and (pp_rank or cp_rank):
                continue
            groups.append(((dp_rank, pp_rank, cp_rank), tuple(range(start, start + engine_tp))))
        for index, ((dp_rank, pp_rank, cp_rank), ranks) in enumerate(sorted(groups)):
            bundles = tuple(actor.bundles[r] for r in ranks)
            nodes = _engine_nodes(rollout_pool, bundles, "rollout.tp")
            engines.append(EnginePlacement(index, rollout.pool, bundles, nodes, True, dp_rank, pp_rank, cp_rank, ranks))
    else:
        for index, start in enumerate(range(0, rollout_pool.size, engine_tp)):
            bundles = tuple(range(start, start + engine_tp))
            nodes = _engine_nodes(rollout_pool, bundles, "rollout.tp")
            engines.append(EnginePlacement(index, rollout.pool, bundles, nodes, False))
    return PlacementPlan(specs, roles, tuple(engines), engine_layout)


def make_placement(
    *,
    nodes: Sequence[int],
    actor: ParallelDims,
    rollout_nodes: Sequence[int] | None = None,
    engine_tp: int | None = None,
    engine_layout: str = "per_tp_group",
    judge_nodes: Sequence[int] | None = None,
    judge_tp: int = 1,
    **roles: ParallelDims | None,
) -> PlacementPlan:
    """The plan from config-like arguments.

    ``nodes``: GPUs per node of the training pool (``trainer.n_gpus_per_node`` repeated
    ``trainer.nnodes`` times). The other roles given a layout (``ref``, ``critic``, ``teacher``, ``reward_model``:
    :data:`ROLES`) are placed; the actor always is. Colocated by default: every role and the engines share
    pool ``"global"``. With ``rollout_nodes`` the engines get their own pool ``"rollout"``
    (disaggregated). ``engine_tp`` defaults to the actor's TP (TP-matched when colocated). ``judge_nodes``: a
    generative judge's pool ``"judge"``, cut into engines of ``judge_tp``.
    """
    pools: dict[str, Sequence[int]] = {GLOBAL_POOL: list(nodes)}
    mapping = {"actor": GLOBAL_POOL, "rollout": GLOBAL_POOL}
    dims = {"actor": actor}
    for role, role_dims in roles.items():
        if role_dims is not None:
            mapping[role] = GLOBAL_POOL
            dims[role] = role_dims
    if rollout_nodes is not None:
        pools[ROLLOUT_POOL] = list(rollout_nodes)
        mapping["rollout"] = ROLLOUT_POOL
    plan = plan_placement(pools, mapping, dims, engine_tp=engine_tp, engine_layout=engine_layout)
    if judge_nodes is None:
        return plan
    judge = PoolSpec(JUDGE_POOL, tuple(judge_nodes))
    if judge.size % judge_tp:
        raise ValueError(f"reward_model.judge.rollout.tensor_model_parallel_size={judge_tp} does not divide the "
                         f"{judge.size} GPUs of reward_model.judge.pool_nodes={list(judge_nodes)}")
    engines = []
    for index, start in enumerate(range(0, judge.size, judge_tp)):
        bundles = tuple(range(start, start + judge_tp))
        nodes = _engine_nodes(judge, bundles, "reward_model.judge.rollout.tensor_model_parallel_size")
        engines.append(EnginePlacement(index, JUDGE_POOL, bundles, nodes, False))
    return dataclasses.replace(plan, pools={**plan.pools, JUDGE_POOL: judge}, judge_engines=tuple(engines))


# ------------------------------------------------------------------------------------ Ray pools


class ResourcePool:
    """A pool of GPU bundles reserved as Ray placement groups, one ``STRICT_PACK`` group per node.

    ``use_gpu=False`` reserves CPU-only bundles (then workers must ask for no GPU). With Ray's
    fake GPUs (``ray.init(num_gpus=K)``) keep ``use_gpu=True``: the bundles and the workers'
    ``CUDA_VISIBLE_DEVICES`` behave as on a GPU cluster.
    """

    def __init__(self, name: str, nodes: Sequence[int], *, use_gpu: bool = True, cpus_per_bundle: float = 1.0):
        self.spec = PoolSpec(name, tuple(nodes))
        self.use_gpu = use_gpu
        self.cpus_per_bundle = cpus_per_bundle
        self._groups: list = []

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def size(self) -> int:
        return self.spec.size

    def bundle_resources(self) -> dict[str, float]:
        resources = {"CPU": float(self.cpus_per_bundle)}
        if self.use_gpu:
            resources["GPU"] = 1.0
        return resources

    def create(self, *, timeout_s: float = 60.0) -> ResourcePool:
        """Reserve the placement groups and wait until Ray has placed them (error after ``timeout_s``)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if self._groups:
            return self
        groups = [placement_group([self.bundle_resources()] * count, strategy="STRICT_PACK",
                                  name=f"megarl_{self.name}_node{node}")
                  for node, count in enumerate(self.spec.nodes)]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            for group in groups:
                remove_placement_group(group)
            raise TimeoutError(
                f"resource pool {self.name!r}: Ray could not place {len(groups) - len(ready)} of its {len(groups)} "
                f"node groups ({list(self.spec.nodes)} bundles of {self.bundle_resources()}) within {timeout_s:.0f} s; "
                f"cluster resources: {ray.cluster_resources()}"
            )
        self._groups = groups
        return self

    def scheduling_strategy(self, bundle: int):
        """The Ray scheduling strategy that puts an actor on pool bundle ``bundle``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not self._groups:
            raise RuntimeError(f"resource pool {self.name!r} is not created; call create() first")
        node, index = self.spec.locate(bundle)
        return PlacementGroupSchedulingStrategy(placement_group=self._groups[node], placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=True)

    def remove(self) -> None:
        """Give the bundles back to Ray."""
        from ray.util.placement_group import remove_placement_group

        for group in self._groups:
            remove_placement_group(group)
        self._groups = []

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, nodes={list(self.spec.nodes)}, use_gpu={self.use_gpu})"


def placement_for(cfg: RunConfig) -> PlacementPlan:
    """The placement of a run: the training pool (``trainer.*``), the layouts of the Megatron roles it enables
    (:func:`~megarl.workers.roles.enabled_roles`: the actor with the reference, critic, teacher, reward model), the engines (``rollout.engine_layout``; their own pool with ``hybrid_engine=false``)."""
    arr, trainer, judge = cfg.actor_rollout_ref, cfg.trainer, cfg.reward_model.judge
    nodes = [trainer.n_cpu_ranks] if trainer.device == "cpu" else [trainer.n_gpus_per_node] * trainer.nnodes
    roles = {spec.name: spec.parallel(cfg) for spec in enabled_roles(cfg)}
    return make_placement(nodes=nodes, **roles, engine_tp=cfg.engine_tp,
                          engine_layout=arr.rollout.engine_layout,
                          rollout_nodes=None if arr.hybrid_engine else list(arr.rollout.pool_nodes),
                          judge_nodes=list(judge.pool_nodes) if judge.enable else None, judge_tp=judge.engine_tp)


def create_pools(plan: PlacementPlan, *, use_gpu: bool = True, cpus_per_bundle: float = 1.0,
                 timeout_s: float = 60.0) -> dict[str, ResourcePool]:
    """Reserve every pool of ``plan`` on the running Ray cluster."""
    pools: dict[str, ResourcePool] = {}
    try:
        for name, spec in plan.pools.items():
            pools[name] = ResourcePool(name, spec.nodes, use_gpu=use_gpu, cpus_per_bundle=cpus_per_bundle).create(
                timeout_s=timeout_s)
    except Exception:
        for pool in pools.values():
            pool.remove()
        raise
    return pools


def ranges(values: Sequence[int]) -> str:
    """``0-7,16-23`` for sorted integers."""
    values = sorted(values)
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def rank_groups(dims, axis: str) -> list[list[int]]:
    """Ranks of each ``axis`` group (ranks sharing the other coordinates), in rank order."""
    index = {"tp": 0, "cp": 1, "dp": 2, "pp": 3}[axis]
    groups: dict[tuple, list[int]] = {}
    for rank in range(dims.world_size):
        coords = megatron_coordinates(rank, dims)
        groups.setdefault(coords[:index] + coords[index + 1:], []).append(rank)
    return sorted(groups.values())


def expert_groups(dims, axis: str = "ep") -> list[list[int]]:
    """Ranks of each expert-parallel (``ep``), expert-tensor-parallel (``etp``) or expert-data-parallel (``edp``)
    group: a pipeline stage's ``tp × cp × dp`` ranks regrouped in Megatron's expert order, ``etp`` fastest, then
    ``ep``, then expert data parallelism."""
    stage = dims.tp * dims.cp * dims.dp
    etp, ep = dims.expert_tp, dims.ep
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(dims.world_size):
        local = rank % stage
        coords = (local % etp, local // etp % ep, local // (etp * ep))
        key = tuple(c for c, name in zip(coords, ("etp", "ep", "edp")) if name != axis)
        groups.setdefault((rank // stage, *key), []).append(rank)
    return sorted(groups.values())
