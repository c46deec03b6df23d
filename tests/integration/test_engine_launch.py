"""SGLang engine servers started as a run starts them, on two Ray nodes of 8 fake GPUs each (items 1
and 5): probe → GPUs per engine → launch command per node → the owning worker's process.

``ray.cluster_utils.Cluster`` runs two raylets here (two Ray nodes, one IP), each with ``num_gpus=8``. SGLang
cannot serve on this machine, so ``sglang.launch_server`` is replaced by a stand-in
(tests/standins/sglang_standin.py) that records its argv, parent and environment and answers ``/health``;
the argv is then parsed by the pinned sglang's own ``ServerArgs`` parser. Everything else is the run's code:
``engine_gpus_of`` (the probe), ``start_engine_servers`` (workers per engine node, ports, launch commands,
``EngineServerWorker.start_server``) and ``stop_engine_servers``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.controller.fleet import (
    engine_gpus_of,
    engine_server_slots,
    policy_engines,
    start_engine_servers,
    stop_engine_servers,
)
from megarl.engines.client import EngineAddress
from megarl.plan import engine_gpus as engine_gpus_module
from megarl.plan.engine_gpus import probe_bundle_gpus
from megarl.plan.placement import create_pools, placement_for
from megarl.workers.base import Worker
from megarl.workers.engine_server import EngineServerWorker

STANDINS = Path(__file__).resolve().parents[1] / "standins"
ROLLOUT = "actor_rollout_ref.rollout"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    records = tmp_path_factory.mktemp("standin")
    # The raylets (and so the workers and their servers) inherit the driver's environment.
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(STANDINS), os.environ.get("PYTHONPATH")])),
           "MEGARL_STANDIN_DIR": str(records), "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 8, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=8, num_gpus=8)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield ray, records
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def config(engine_tp: int, actor_tp: int):
    return load_config(["recipe=tiny_cpu_grpo", "trainer.device=cuda", "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                        f"{ROLLOUT}.name=sglang", f"{ROLLOUT}.tensor_model_parallel_size={engine_tp}",
                        f"actor_rollout_ref.actor.parallel.tp={actor_tp}", f"{ROLLOUT}.engine_startup_timeout_s=60",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"])


def server_args_parser() -> argparse.ArgumentParser:
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as error:  # noqa: BLE001 - an sglang whose import needs GPU-only packages
        pytest.skip(f"sglang.srt.server_args does not import here: {error}")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_probe_maps_tp1_and_tp4_engines_on_both_nodes(two_nodes):
    """16 TP=1 engines (8 per node) and 4 TP=4 engines (2 per node): each sees exactly its GPUs, base_gpu_id 0."""
    ray, _ = two_nodes
    node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    for engine_tp, actor_tp, visible in ((1, 1, [str(g) for g in range(8)] * 2),
                                         (4, 4, ["0,1,2,3", "4,5,6,7"] * 2)):
        plan = placement_for(config(engine_tp, actor_tp))
        pools = create_pools(plan, use_gpu=True, cpus_per_bundle=1.0)
        try:
            gpus = engine_gpus_of(plan.engines, probe_bundle_gpus(pools))
        finally:
            for pool in pools.values():
                pool.remove()
        assert [e.nodes[0].cuda_visible_devices for e in gpus] == visible
        assert {(e.tp, e.nnodes, e.base_gpu_id, e.gpu_id_step, e.dist_init_addr) for e in gpus} == \
            {(engine_tp, 1, 0, 1, None)}
        half = len(gpus) // 2
        first, second = {e.nodes[0].node_id for e in gpus[:half]}, {e.nodes[0].node_id for e in gpus[half:]}
        assert len(first) == len(second) == 1 and first != second and first | second <= set(node_ids)


@pytest.mark.parametrize("engine_tp,actor_tp", [(16, 4), (8, 8)], ids=["tp16_over_two_nodes", "tp8_per_node"])
def test_engine_servers_start_with_exactly_their_gpus(two_nodes, tmp_path, monkeypatch, engine_tp, actor_tp):
    """TP=16: one engine, a server on each node (node_rank 0 and 1, one dist_init_addr on node 0, each
    seeing that node's 8 GPUs in TP order); TP=8: two engines, one per node. Each server is the child of the
    worker on its node's first bundle, without the allocator setting the memory saver cannot run with; none
    outlives stop_engine_servers."""
    _, records = two_nodes
    parser = server_args_parser()
    monkeypatch.setattr(engine_gpus_module, "SGLANG_LAUNCH_MODULE", "sglang_standin")
    for old in records.glob("*.json"):
        old.unlink()
    cfg = config(engine_tp, actor_tp)
    plan = placement_for(cfg)
    pools = create_pools(plan, use_gpu=True, cpus_per_bundle=1.0)
    try:
        gpus = engine_gpus_of(plan.engines, probe_bundle_gpus(pools))
        slots = engine_server_slots(plan.engines, gpus)
        group, addresses = start_engine_servers(cfg, policy_engines(cfg, plan), pools["global"], 0.5, gpus, tmp_path)
        try:
            infos = group.call_all(Worker.node_info)
            pids = group.call_all(EngineServerWorker.server_pid)
        finally:
            stop_engine_servers(group)
            group.shutdown()
    finally:
        for pool in pools.values():
            pool.remove()
    runs = [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]
    by_pid = {run["pid"]: run for run in runs}
    assert sorted(by_pid) == sorted(pids) and len(runs) == 2
    parsed = [parser.parse_known_args(by_pid[pid]["argv"]) for pid in pids]
    assert all(unknown == [] for _, unknown in parsed)
    args = [ns for ns, _ in parsed]
    assert len({info["node_id"] for info in infos}) == 2  # the two servers run on the two Ray nodes
    for slot, info, pid, ns in zip(slots, infos, pids, args, strict=True):
        run = by_pid[pid]
        assert run["ppid"] == info["pid"]  # the worker on the node's first bundle owns the server
        assert info["gpu_ids"] == ["0"]  # ... bundle 0 of its node's placement group
        assert run["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert "PYTORCH_CUDA_ALLOC_CONF" not in run["env"]  # removed for --enable-memory-saver
        assert (ns.tp_size, ns.base_gpu_id, ns.gpu_id_step, ns.host) == (engine_tp, 0, 1, info["ip"])
        assert ns.enable_memory_saver and ns.skip_server_warmup
    head = args[0]
    if engine_tp == 16:
        assert [(s.engine, s.node_rank) for s in slots] == [(0, 0), (0, 1)]
        assert [(ns.nnodes, ns.node_rank) for ns in args] == [(2, 0), (2, 1)]
        host, port = head.dist_init_addr.rsplit(":", 1)
        assert args[1].dist_init_addr == head.dist_init_addr and host == infos[0]["ip"]
        assert int(port) not in (head.port, args[1].port)
        assert addresses == [EngineAddress(0, f"http://{head.host}:{head.port}", 16)]
        assert (tmp_path / "engine_0.log").exists() and (tmp_path / "engine_0_node1.log").exists()
    else:
        assert [(s.engine, s.node_rank) for s in slots] == [(0, 0), (1, 0)]
        assert [(ns.nnodes, ns.node_rank, ns.dist_init_addr) for ns in args] == [(1, 0, None)] * 2
        assert addresses == [EngineAddress(i, f"http://{ns.host}:{ns.port}", 8) for i, ns in enumerate(args)]
        assert args[0].random_seed != args[1].random_seed
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
