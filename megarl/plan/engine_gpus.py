"""Which GPUs each SGLang engine server gets, and the command that starts it.

Three steps, each usable alone:

1. :func:`probe_bundle_gpus` (Ray): for every bundle of the pools, the node (Ray node id and IP) and
   the GPU id Ray gave that bundle. Call it right after :func:`~megarl.plan.placement.create_pools`,
   before any worker takes its share of the bundles.
2. :func:`engine_gpus` (pure): from that probe and the plan's engines
   (:attr:`~megarl.plan.placement.PlacementPlan.engines`), one :class:`EngineGpus` per engine:
   per node its GPU ids in TP order, the ``CUDA_VISIBLE_DEVICES`` of its server, ``base_gpu_id`` /
   ``gpu_id_step``, and for an engine spanning nodes ``nnodes``, each node's ``node_rank`` and
   ``dist_init_addr``. :func:`planned_bundle_gpus` gives the probe result the plan implies (no Ray),
   which ``megarl-plan`` prints.
3. :func:`sglang_launch_command`: argv and environment of ``python -m sglang.launch_server`` for one
   engine on one of its nodes (the pinned sglang 0.5.23's flags).

Visible devices vs ``base_gpu_id``. SGLang puts TP rank ``r`` of node ``n`` on local ordinal
``base_gpu_id + (r mod tp_per_node) * gpu_id_step`` of the devices its process sees (sglang
``srt/entrypoints/engine.py``, ``_calculate_rank_ranges``). Two ways to land rank r on the GPU of the
engine's bundle r:

- (chosen) the server sees exactly its own GPUs, listed in TP order
  (``CUDA_VISIBLE_DEVICES=g0,g1,..``), with ``base_gpu_id=0`` and ``gpu_id_step=1``: ordinal r is g_r
  whatever ids Ray handed out.
- the server sees the node's GPUs and ``base_gpu_id`` is the engine's first GPU: right only when
  the engine's GPU ids are consecutive and ascending in TP order, which Ray does not promise (a
  ``STRICT_PACK`` group placed after another group was removed gets e.g. GPUs 0, 1, 4, 5: see
  tests/integration/test_engine_gpus.py), and only when the server's process really sees the whole node
  (a Ray actor sees only its own bundle's GPU unless ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``
  is set, as slime does for its engines).

The first is right in every case, keeps an engine's CUDA context off the other engines' GPUs,
and needs nothing from the owning actor's own ``CUDA_VISIBLE_DEVICES``: the server gets the
variable in its environment. Weight tensors sent by CUDA IPC still find their GPU though the
sender numbers devices otherwise: SGLang's ``monkey_patch_torch_reductions``
(``srt/utils/patch_torch.py``) sends the device's UUID instead of its ordinal (the sender must
apply the same patch). The GPU ids are the ones ``ray.get_gpu_ids()`` reports, i.e. values of the
node's own ``CUDA_VISIBLE_DEVICES`` numbering (ints; a node started with GPU UUIDs gives strings,
which work the same way here).

An engine spanning nodes takes the same number of consecutive TP ranks on every node (SGLang
splits ``tp_size`` evenly: ``tp_per_node = tp_size / nnodes``), node_rank 0 first; each node's
server gets its own GPUs as above and ``--nnodes/--node-rank/--dist-init-addr`` (node 0's IP). The
plan (:func:`~megarl.plan.placement.plan_placement`) lets an engine span whole nodes of equal
size only; the run starts one server per node (:func:`megarl.controller.fleet.start_engine_servers`):
node_rank 0 serves SGLang's API, the others their TP ranks and a ``/health`` of their own.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from megarl.config.model import ModelSource
from megarl.config.rollout import EngineConfig
from megarl.plan.placement import GLOBAL_POOL, EnginePlacement, PlacementPlan, ResourcePool

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
NODES_KEYS = "trainer.n_gpus_per_node / actor_rollout_ref.rollout.pool_nodes"
PROBE_GPU_FRACTION = 0.0001
"""GPU share of a probe task: Ray's smallest resource unit, so it fits next to a worker holding
``1 - 1e-4`` of the bundle; it is given back when the task returns."""
DIST_INIT_BASE_PORT = 20000
"""Default ``dist_init_addr`` port of engine 0 (multi-node engines only)."""
DIST_INIT_PORT_STRIDE = 16
"""Ports between consecutive engines' ``dist_init_addr``: with DP attention SGLang also binds the
next 7 ports (``srt/server_args.py``, ``PortArgs.init_new``)."""
SGLANG_LAUNCH_MODULE = "sglang.launch_server"


# ------------------------------------------------------------------------------ the probe


@dataclasses.dataclass(frozen=True)
class BundleGpu:
    """Where one bundle of a pool sits: its Ray node and the GPU id Ray gave it."""

    pool: str
    bundle: int
    node_id: str
    """Ray's node id (hex), or a name such as ``global node 0`` in :func:`planned_bundle_gpus`."""
    node_ip: str
    gpu_id: int | str
    """The bundle's GPU in the node's ``CUDA_VISIBLE_DEVICES`` numbering (``ray.get_gpu_ids()``)."""


BundleGpus = Mapping[tuple[str, int], BundleGpu]
"""``(pool name, bundle) -> BundleGpu``: a probe result."""


def _gpu_id(value) -> int | str:
    text = str(value)
    return int(text) if text.isdigit() else text


def probe_bundle_gpus(pools: Mapping[str, ResourcePool] | Iterable[ResourcePool], *,
                      timeout_s: float = 60.0) -> dict[tuple[str, int], BundleGpu]:
    """Node and GPU id of every bundle of ``pools`` (created :class:`ResourcePool` s), read on Ray.

    One short task per bundle, scheduled on that bundle with ``num_gpus=PROBE_GPU_FRACTION`` and no
    CPU, reads ``ray.get_gpu_ids()`` (the bundle's GPU), the node id and IP, and returns (Ray takes
    the share back then). Run it right after ``create_pools``: once workers hold a bundle's whole GPU
    (shares adding up to 1) a probe cannot be placed and this fails after ``timeout_s``.

    The tasks of one node's placement group run one after the other (each takes the previous one's
    result as an argument) in one reused worker process (``max_calls=0``; Ray's default for GPU tasks
    starts a process per task, and the probe never touches CUDA); the nodes are probed in parallel.
    """
    import ray

    pool_list = list(pools.values()) if isinstance(pools, Mapping) else list(pools)

    def where(_previous=None) -> tuple[str, str, list]:
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                [str(g) for g in ray.get_gpu_ids()])

    remote = ray.remote(max_calls=0)(where)
    keys, refs = [], []
    for pool in pool_list:
        if not pool.use_gpu:
            raise ValueError(f"resource pool {pool.name!r} has CPU-only bundles (use_gpu=False): there are no GPUs "
                             f"to probe; SGLang engines need trainer.device=cuda")
        previous: dict[int, object] = {}
        for bundle in range(pool.size):
            node = pool.spec.node_of(bundle)
            ref = remote.options(num_cpus=0, num_gpus=PROBE_GPU_FRACTION,
                                 scheduling_strategy=pool.scheduling_strategy(bundle)).remote(previous.get(node))
            previous[node] = ref
            keys.append((pool.name, bundle))
            refs.append(ref)
    try:
        results = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise TimeoutError(
            f"probing the GPUs of the bundles of pools {[p.name for p in pool_list]}: Ray did not run a "
            f"{PROBE_GPU_FRACTION}-GPU task on every bundle within {timeout_s:.0f} s; probe right after "
            f"create_pools, before workers take the bundles' GPUs") from None
    probe: dict[tuple[str, int], BundleGpu] = {}
    for (pool_name, bundle), (node_id, node_ip, gpu_ids) in zip(keys, results):
        if len(gpu_ids) != 1:
            raise RuntimeError(f"pool {pool_name!r} bundle {bundle}: a task on it sees GPU ids {gpu_ids}, "
                               f"expected exactly one (bundles are {{'GPU': 1, ...}})")
        probe[pool_name, bundle] = BundleGpu(pool_name, bundle, node_id, node_ip, _gpu_id(gpu_ids[0]))
    return probe


def planned_bundle_gpus(plan: PlacementPlan) -> dict[tuple[str, int], BundleGpu]:
    """The probe result the plan implies, without Ray: bundle ``b`` of a pool on GPU ``b mod n`` of
    node ``b div n`` (``n`` GPUs per node; node by node in general, :meth:`PoolSpec.locate`), which is how
    :class:`ResourcePool` lays bundles out (one ``STRICT_PACK`` group per node) when Ray numbers each
    group's GPUs from 0 in bundle order. Nodes are named by their index in the pool (``0``, ``1``, ..;
    ``rollout 0`` for a pool other than ``global``); their IPs are placeholders (``<node 0 IP>``)."""
    probe: dict[tuple[str, int], BundleGpu] = {}
    for name, spec in plan.pools.items():
        for bundle in range(spec.size):
            node, gpu = spec.locate(bundle)
            node_name = str(node) if name == GLOBAL_POOL else f"{name} {node}"
            probe[name, bundle] = BundleGpu(name, bundle, node_name, f"<node {node_name} IP>", gpu)
    return probe


# ------------------------------------------------------------------------------ the mapping


@dataclasses.dataclass(frozen=True)
class EngineNodeGpus:
    """One node's part of an engine: its TP ranks and their GPUs, in TP order."""

    node_rank: int
    """SGLang's ``--node-rank`` (0: the node that serves HTTP)."""
    node_id: str
    node_ip: str
    bundles: tuple[int, ...]
    gpu_ids: tuple[int | str, ...]
    """GPU ids of the node's TP ranks, in TP order (TP rank ``tp_ranks[k]`` on ``gpu_ids[k]``)."""
    tp_ranks: tuple[int, ...]

    @property
    def cuda_visible_devices(self) -> str:
        """The server's ``CUDA_VISIBLE_DEVICES`` on this node: exactly its GPUs, in TP order."""
        return ",".join(str(g) for g in self.gpu_ids)


@dataclasses.dataclass(frozen=True)
class EngineGpus:
    """Where one engine's TP ranks run, as SGLang's server arguments say it."""

    engine: int
    pool: str
    tp: int
    nodes: tuple[EngineNodeGpus, ...]
    dist_init_addr: str | None = None
    """``<node 0 IP>:<port>`` when the engine spans nodes, else None."""
    base_gpu_id: int = 0
    """Always 0: each server sees exactly its GPUs, in TP order (module docstring)."""
    gpu_id_step: int = 1

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def head_ip(self) -> str:
        return self.nodes[0].node_ip

    def node(self, node_rank: int) -> EngineNodeGpus:
        if not 0 <= node_rank < self.nnodes:
            raise ValueError(f"engine {self.engine} spans {self.nnodes} node(s): node_rank must be in "
                             f"0..{self.nnodes - 1}, got {node_rank}")
        return self.nodes[node_rank]

    def env(self, node_rank: int = 0) -> dict[str, str]:
        """Environment variables the server process on node ``node_rank`` must get."""
        return {"CUDA_VISIBLE_DEVICES": self.node(node_rank).cuda_visible_devices}

    def with_dist_init_port(self, port: int) -> EngineGpus:
        """This engine with ``dist_init_addr`` on ``port`` of its head node (e.g. a port found free there)."""
        if self.nnodes == 1:
            return self
        return dataclasses.replace(self, dist_init_addr=_host_port(self.head_ip, port))

    def describe(self) -> str:
        """``engine i: node n GPUs [..] (CUDA_VISIBLE_DEVICES=.., base_gpu_id 0)``, one node after another."""
        parts = [f"node {n.node_id} GPUs [{', '.join(map(str, n.gpu_ids))}] (CUDA_VISIBLE_DEVICES="
                 f"{n.cuda_visible_devices}, base_gpu_id {self.base_gpu_id}"
                 + (f", node_rank {n.node_rank}" if self.nnodes > 1 else "") + ")" for n in self.nodes]
        tail = f"; nnodes {self.nnodes}, dist_init_addr {self.dist_init_addr}" if self.nnodes > 1 else ""
        return f"engine {self.engine}: " + " + ".join(parts) + tail


def _host_port(host: str, port: int) -> str:
    if not 0 < port < 65536:
        raise ValueError(f"dist_init_addr port must be in 1..65535, got {port}")
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def engine_gpus(engines: Sequence[EnginePlacement], bundle_gpus: BundleGpus, *,
                dist_init_base_port: int = DIST_INIT_BASE_PORT) -> list[EngineGpus]:
    """Per engine, its GPUs on each node in TP order and SGLang's placement arguments.

    ``engines``: the plan's engines (engine TP rank k on ``bundles[k]`` of ``pool``); ``bundle_gpus``:
    :func:`probe_bundle_gpus` (or :func:`planned_bundle_gpus`). An engine spanning nodes gets
    ``dist_init_addr`` = its first node's IP and port ``dist_init_base_port + 16 * engine index``
    (:meth:`EngineGpus.with_dist_init_port` sets another).

    Raises ``ValueError`` naming the setting when SGLang cannot run the layout: an engine's TP ranks on
    one node are not consecutive (its bundles go to a node, leave it and come back), nodes of one engine
    hold different numbers of its ranks, or two of its ranks share a GPU.
    """
    out = []
    for engine in engines:
        where = []
        for bundle in engine.bundles:
            if (engine.pool, bundle) not in bundle_gpus:
                raise ValueError(f"engine {engine.index}: pool {engine.pool!r} bundle {bundle} is not in the probe "
                                 f"result (probe every pool the plan's engines use)")
            where.append(bundle_gpus[engine.pool, bundle])
        runs: list[list[tuple[int, BundleGpu]]] = []
        for rank, info in enumerate(where):
            if runs and runs[-1][-1][1].node_id == info.node_id:
                runs[-1].append((rank, info))
            else:
                runs.append([(rank, info)])
        nodes = [run[0][1].node_id for run in runs]
        if len(set(nodes)) < len(nodes):
            layout = ", ".join(f"rank {r}: {i.node_id}" for r, i in enumerate(where))
            raise ValueError(f"engine {engine.index} (TP {engine.tp}): its TP ranks leave a node and come back "
                             f"({layout}); SGLang needs each node's ranks consecutive. Choose {TP_KEY} dividing "
                             f"the GPUs per node ({NODES_KEYS})")
        sizes = [len(run) for run in runs]
        if len(set(sizes)) > 1:
            raise ValueError(f"engine {engine.index} (TP {engine.tp}) spans {len(runs)} nodes holding {sizes} of its "
                             f"ranks; SGLang splits {TP_KEY} evenly over nodes: give the nodes equal GPU counts "
                             f"({NODES_KEYS}) or choose {TP_KEY} dividing the GPUs per node")
        parts = []
        for node_rank, run in enumerate(runs):
            gpu_ids = tuple(info.gpu_id for _, info in run)
            if len(set(gpu_ids)) < len(gpu_ids):
                raise ValueError(f"engine {engine.index}: ranks {[r for r, _ in run]} on node {run[0][1].node_id} "
                                 f"share GPUs {list(gpu_ids)}; each TP rank needs its own GPU (pool bundles are "
                                 f"{{'GPU': 1}}: check {NODES_KEYS})")
            parts.append(EngineNodeGpus(node_rank, run[0][1].node_id, run[0][1].node_ip,
                                        tuple(info.bundle for _, info in run), gpu_ids, tuple(r for r, _ in run)))
        dist = None
        if len(parts) > 1:
            dist = _host_port(parts[0].node_ip, dist_init_base_port + DIST_INIT_PORT_STRIDE * engine.index)
        out.append(EngineGpus(engine.index, engine.pool, engine.tp, tuple(parts), dist))
    return out


# ------------------------------------------------------------------------------ the command


@dataclasses.dataclass(frozen=True)
class LaunchCommand:
    """A server process to start: ``argv``, plus ``env`` to set and ``unset_env`` to remove from the
    caller's environment (:meth:`environ` merges them)."""

    argv: tuple[str, ...]
    env: dict[str, str]
    unset_env: tuple[str, ...] = ()

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` (e.g. ``os.environ``) with ``env`` set and ``unset_env`` removed."""
        merged = {k: v for k, v in base.items() if k not in self.unset_env}
        merged.update(self.env)
        return merged


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""SGLang's launch flag that makes ``/generate`` answer ``return_routed_experts`` (megarl's CPU server takes it too)."""

DETERMINISTIC_FLAG = "--enable-deterministic-inference"
"""SGLang's launch flag for seeded sampling, which megarl refuses (:func:`sglang_launch_command`)."""

MEMORY_SAVER_UNSET_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Removed from the server's environment with the memory saver: torch_memory_saver does not support
expandable segments, which a Megatron worker's environment may enable (slime removes them too)."""


def sglang_launch_command(gpus: EngineGpus, *, rollout: EngineConfig, model: ModelSource, port: int, seed: int,
                          node_rank: int = 0, host: str | None = None, context_length: int | None = None,
                          return_routed_experts: bool = False, lora: Any = None, python: str = sys.executable,
                          extra_args: Sequence[str] = ()) -> LaunchCommand:
    """``python -m sglang.launch_server`` for engine ``gpus`` on its node ``node_rank`` (sglang 0.5.23 flags).

    - ``--model-path`` (``model.path``; ``--tokenizer-path`` when ``model.tokenizer_path`` is set),
      ``--trust-remote-code`` when ``model.trust_remote_code``;
    - ``--tp-size`` (the engine's bundles), ``--base-gpu-id 0 --gpu-id-step 1`` with ``CUDA_VISIBLE_DEVICES``
      = the node's GPUs of the engine in TP order; ``--nnodes/--node-rank/--dist-init-addr`` when it spans nodes;
    - ``--mem-fraction-static`` = ``rollout.gpu_memory_utilization``, ``--dtype`` = ``rollout.dtype``,
      ``--random-seed`` = ``seed``, ``--host``/``--port`` (host: the node's IP unless given);
    - ``--disable-cuda-graph`` when ``rollout.enforce_eager`` (deprecated in 0.5.23 for
      ``--cuda-graph-backend-{decode,prefill}=disabled`` but still the only CLI entry to the
      ``disable_cuda_graph`` field, which some model code reads directly);
    - ``--enable-memory-saver`` when ``rollout.free_cache_engine``: without it SGLang's
      ``/release_memory_occupation`` frees nothing;
    - ``--context-length`` when ``context_length`` is given (``rollout.max_model_len``, else P + R);
    - ``--enable-return-routed-experts`` with ``return_routed_experts`` (``actor.router_replay`` on: ``/generate``
      answers every token's routed experts);
    - ``--enable-lora --max-lora-rank R --lora-target-modules ...`` with ``lora`` (a
      :class:`~megarl.config.lora.LoraSpec`: the run syncs its adapters alone, ``rollout.lora_sync=adapters``):
      :func:`lora_flags`;
    - ``--skip-server-warmup`` always: the warm-up request would run before the first weight sync,
      and a slow one fails the start (slime skips it too);
    - then ``extra_args`` as given, except ``--enable-deterministic-inference``: with it SGLang samples every row of
      a request from the request's one seed (42 when none is sent), so every sample of a GRPO group would be the
      same (see :mod:`megarl.rollout.manager`).
    """
    if DETERMINISTIC_FLAG in extra_args:
        raise ValueError(f"engine {gpus.engine}: {DETERMINISTIC_FLAG} makes SGLang sample every row of a batched "
                         f"request from one seed (42 unless the request names another): all samples of a prompt would "
                         f"be identical and their advantages 0; megarl does not launch SGLang with it")
    node = gpus.node(node_rank)
    if not 0 < port < 65536:
        raise ValueError(f"engine {gpus.engine}: server port must be in 1..65535, got {port}")
    argv = [python, "-m", SGLANG_LAUNCH_MODULE,
            "--model-path", model.local_path,
            "--tp-size", str(gpus.tp),
            "--base-gpu-id", str(gpus.base_gpu_id),
            "--gpu-id-step", str(gpus.gpu_id_step),
            "--mem-fraction-static", str(rollout.gpu_memory_utilization),
            "--dtype", rollout.dtype,
            "--random-seed", str(int(seed)),
            "--host", host if host is not None else node.node_ip,
            "--port", str(port),
            "--skip-server-warmup"]
    if model.tokenizer_path:
        argv += ["--tokenizer-path", model.local_tokenizer_path]
    if model.trust_remote_code:
        argv.append("--trust-remote-code")
    if rollout.enforce_eager:
        argv.append("--disable-cuda-graph")
    if rollout.free_cache_engine:
        argv.append("--enable-memory-saver")
    if context_length is not None:
        argv += ["--context-length", str(int(context_length))]
    if return_routed_experts:
        argv.append(ROUTED_EXPERTS_FLAG)
    if lora is not None:
        argv += lora_flags(lora)
    if gpus.nnodes > 1:
        argv += ["--nnodes", str(gpus.nnodes), "--node-rank", str(node_rank), "--dist-init-addr",
                 str(gpus.dist_init_addr)]
    argv += list(extra_args)
    return LaunchCommand(tuple(argv), gpus.env(node_rank),
                         MEMORY_SAVER_UNSET_ENV if rollout.free_cache_engine else ())


def lora_flags(lora: Any) -> list[str]:
    """An engine's flags to serve a run's adapters (``lora``: its :class:`~megarl.config.lora.LoraSpec`), SGLang's
    and megarl's CPU server's alike: LoRA on, the adapters' rank, one adapter at a time (SGLang allocates a GPU slot
    per adapter a batch may mix, 8 by default; a run serves one), the modules they touch (PEFT's names)."""
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--max-loras-per-batch", "1",
            "--lora-target-modules", *lora.hf_target_modules]
