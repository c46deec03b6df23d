"""Engine servers' GPUs (megarl.plan.engine_gpus): the pure mapping, the sglang launch command, and the
Ray probe on fake GPUs.

Layouts: 8 TP=1 engines per node, 2 TP=4, 1 TP=8, and a TP=16 engine over two nodes,
with hand-written expectations. The Ray tests run one local Ray node with 8 fake GPUs
(``ray.init(num_gpus=8)``); a single Ray node cannot host a two-node engine, so the TP=16 case feeds
the pure mapping a hand-made probe result of two 8-GPU nodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from megarl.config.lora import LoraSpec
from megarl.config.model import ModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.parallel import ParallelDims
from megarl.plan.engine_gpus import (
    BundleGpu,
    EngineGpus,
    engine_gpus,
    planned_bundle_gpus,
    probe_bundle_gpus,
    sglang_launch_command,
)
from megarl.plan.placement import EnginePlacement, ResourcePool, make_placement

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def probe(pool: str, *nodes: tuple[str, str, list]) -> dict[tuple[str, int], BundleGpu]:
    """A probe result: ``nodes`` = (node id, IP, GPU ids of that node's bundles in bundle order), node by node."""
    out, bundle = {}, 0
    for node_id, ip, gpu_ids in nodes:
        for gpu in gpu_ids:
            out[pool, bundle] = BundleGpu(pool, bundle, node_id, ip, gpu)
            bundle += 1
    return out


NODE_A = ("node-a", "10.0.0.1", list(range(8)))
NODE_B = ("node-b", "10.0.0.2", list(range(8)))


def visible(mapped: list[EngineGpus]) -> list[list[str]]:
    return [[n.cuda_visible_devices for n in e.nodes] for e in mapped]


# ------------------------------------------------------------------------------ the pure mapping


def test_eight_tp1_engines_per_node():
    plan = make_placement(nodes=[8, 8], actor=ParallelDims(tp=1))
    mapped = engine_gpus(plan.engines, probe("global", NODE_A, NODE_B))
    assert len(mapped) == 16
    assert visible(mapped) == [[str(g)] for g in range(8)] * 2
    assert [e.nodes[0].node_ip for e in mapped] == ["10.0.0.1"] * 8 + ["10.0.0.2"] * 8
    for e in mapped:
        assert (e.tp, e.nnodes, e.base_gpu_id, e.gpu_id_step, e.dist_init_addr) == (1, 1, 0, 1, None)
        assert e.nodes[0].node_rank == 0 and e.nodes[0].tp_ranks == (0,)
    assert mapped[9].env() == {"CUDA_VISIBLE_DEVICES": "1"}
    assert mapped[9].nodes[0].bundles == (9,)


def test_two_tp4_engines():
    plan = make_placement(nodes=[8], actor=ParallelDims(tp=4))
    mapped = engine_gpus(plan.engines, probe("global", NODE_A))
    assert visible(mapped) == [["0,1,2,3"], ["4,5,6,7"]]
    assert [e.nodes[0].gpu_ids for e in mapped] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [(e.tp, e.nnodes, e.base_gpu_id, e.gpu_id_step, e.dist_init_addr) for e in mapped] == \
        [(4, 1, 0, 1, None)] * 2


def test_one_tp8_engine():
    plan = make_placement(nodes=[8], actor=ParallelDims(tp=8))
    (mapped,) = engine_gpus(plan.engines, probe("global", NODE_A))
    assert visible([mapped]) == [["0,1,2,3,4,5,6,7"]]
    assert (mapped.tp, mapped.nnodes, mapped.base_gpu_id, mapped.dist_init_addr) == (8, 1, 0, None)
    assert mapped.nodes[0].tp_ranks == tuple(range(8))


def tp16_engine(index: int = 0) -> EnginePlacement:
    """The plan's TP=16 engine over two 8-GPU nodes (bundles 0-15), renumbered ``index``."""
    (engine,) = make_placement(nodes=[8, 8], actor=ParallelDims(tp=8), engine_tp=16).engines
    assert (engine.bundles, engine.nodes) == (tuple(range(16)), (0, 1))
    return dataclasses.replace(engine, index=index)


def test_tp16_engine_over_two_nodes():
    (mapped,) = engine_gpus([tp16_engine()], probe("global", NODE_A, NODE_B))
    assert (mapped.tp, mapped.nnodes, mapped.base_gpu_id, mapped.gpu_id_step) == (16, 2, 0, 1)
    assert mapped.dist_init_addr == "10.0.0.1:20000"
    head, second = mapped.nodes
    assert (head.node_rank, head.node_ip, head.cuda_visible_devices, head.tp_ranks, head.bundles) == \
        (0, "10.0.0.1", "0,1,2,3,4,5,6,7", tuple(range(8)), tuple(range(8)))
    assert (second.node_rank, second.node_ip, second.cuda_visible_devices, second.tp_ranks, second.bundles) == \
        (1, "10.0.0.2", "0,1,2,3,4,5,6,7", tuple(range(8, 16)), tuple(range(8, 16)))
    assert mapped.env(1) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    # Engine 3's default port keeps clear of engine 0's (and of the 7 ports DP attention adds); a chosen port.
    assert engine_gpus([tp16_engine(3)], probe("global", NODE_A, NODE_B))[0].dist_init_addr == "10.0.0.1:20048"
    assert mapped.with_dist_init_port(31234).dist_init_addr == "10.0.0.1:31234"
    v6 = probe("global", ("a", "fd00::1", list(range(8))), ("b", "fd00::2", list(range(8))))
    assert engine_gpus([tp16_engine()], v6)[0].dist_init_addr == "[fd00::1]:20000"
    with pytest.raises(ValueError, match="node_rank must be in 0..1"):
        mapped.env(2)


def test_non_consecutive_gpu_ids_are_listed_in_tp_order_with_base_0():
    """Ray gave the bundles GPUs 3, 1, 6, 0: the server sees exactly those, in TP order, and starts at ordinal 0
    (a base_gpu_id into the node's GPUs could not express this)."""
    plan = make_placement(nodes=[4], actor=ParallelDims(tp=4))
    (mapped,) = engine_gpus(plan.engines, probe("global", ("n", "10.0.0.9", [3, 1, 6, 0])))
    assert mapped.nodes[0].gpu_ids == (3, 1, 6, 0)
    assert mapped.env() == {"CUDA_VISIBLE_DEVICES": "3,1,6,0"}
    assert (mapped.base_gpu_id, mapped.gpu_id_step) == (0, 1)
    # UUID-named GPUs (a node started with CUDA_VISIBLE_DEVICES=GPU-...) pass through the same way.
    (uuids,) = engine_gpus(plan.engines, probe("global", ("n", "10.0.0.9", ["GPU-b", "GPU-a", "GPU-d", "GPU-c"])))
    assert uuids.env() == {"CUDA_VISIBLE_DEVICES": "GPU-b,GPU-a,GPU-d,GPU-c"}


def test_disaggregated_pool_is_mapped_from_its_own_bundles():
    plan = make_placement(nodes=[8], actor=ParallelDims(tp=2), rollout_nodes=[4], engine_tp=4)
    mapped = engine_gpus(plan.engines, probe("rollout", ("r", "10.0.1.1", [4, 5, 6, 7])))
    assert [(e.pool, e.nodes[0].cuda_visible_devices) for e in mapped] == [("rollout", "4,5,6,7")]


def test_layouts_sglang_cannot_run_are_refused_naming_the_setting():
    # A TP=12 engine over nodes of 8 and 4 GPUs: SGLang splits tp_size evenly over nnodes.
    uneven = EnginePlacement(0, "global", tuple(range(12)), (0, 1), False)
    with pytest.raises(ValueError, match=rf"spans 2 nodes holding \[8, 4\].*{TP_KEY}.*n_gpus_per_node"):
        engine_gpus([uneven], probe("global", NODE_A, ("node-b", "10.0.0.2", [0, 1, 2, 3])))
    # Bundles alternating between nodes: a node's ranks would not be consecutive.
    alternating = {("global", b): BundleGpu("global", b, "ab"[b % 2], "10.0.0.1", b // 2) for b in range(4)}
    with pytest.raises(ValueError, match=rf"leave a node and come back .*rank 1: b.*{TP_KEY}"):
        engine_gpus([EnginePlacement(0, "global", (0, 1, 2, 3), (0,), False)], alternating)
    # Two ranks on one GPU.
    with pytest.raises(ValueError, match=r"share GPUs \[0, 0\]"):
        engine_gpus([EnginePlacement(0, "global", (0, 1), (0,), False)], probe("global", ("n", "ip", [0, 0])))
    with pytest.raises(ValueError, match="pool 'rollout' bundle 0 is not in the probe result"):
        engine_gpus([EnginePlacement(0, "rollout", (0,), (0,), False)], probe("global", NODE_A))


def test_planned_bundle_gpus_follow_the_pool_layout():
    plan = make_placement(nodes=[8, 8], actor=ParallelDims(tp=4), rollout_nodes=[4], engine_tp=2)
    planned = planned_bundle_gpus(plan)
    assert planned["global", 13] == BundleGpu("global", 13, "1", "<node 1 IP>", 5)
    assert planned["rollout", 3] == BundleGpu("rollout", 3, "rollout 0", "<node rollout 0 IP>", 3)
    mapped = engine_gpus(plan.engines, planned)
    assert [e.describe() for e in mapped] == [
        "engine 0: node rollout 0 GPUs [0, 1] (CUDA_VISIBLE_DEVICES=0,1, base_gpu_id 0)",
        "engine 1: node rollout 0 GPUs [2, 3] (CUDA_VISIBLE_DEVICES=2,3, base_gpu_id 0)"]
    (two_nodes,) = engine_gpus([tp16_engine()], probe("global", NODE_A, NODE_B))
    assert two_nodes.describe() == (
        "engine 0: node node-a GPUs [0, 1, 2, 3, 4, 5, 6, 7] (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7, base_gpu_id 0, "
        "node_rank 0) + node node-b GPUs [0, 1, 2, 3, 4, 5, 6, 7] (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7, "
        "base_gpu_id 0, node_rank 1); nnodes 2, dist_init_addr 10.0.0.1:20000")


# ------------------------------------------------------------------------------ the launch command

ROLLOUT = RolloutConfig(name="sglang", gpu_memory_utilization=0.6, dtype="bfloat16", enforce_eager=True,
                        free_cache_engine=True)
MODEL = ModelConfig(path="/models/qwen")


def command(gpus: EngineGpus, node_rank: int = 0, **kw):
    return sglang_launch_command(gpus, rollout=kw.pop("rollout", ROLLOUT), model=kw.pop("model", MODEL),
                                 port=kw.pop("port", 30000), seed=kw.pop("seed", 7), node_rank=node_rank, **kw)


def test_launch_command_of_a_tp4_engine():
    plan = make_placement(nodes=[8], actor=ParallelDims(tp=4))
    second = engine_gpus(plan.engines, probe("global", NODE_A))[1]
    cmd = command(second, port=30097)
    assert cmd.argv == (
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--tp-size", "4",
        "--base-gpu-id", "0", "--gpu-id-step", "1", "--mem-fraction-static", "0.6", "--dtype", "bfloat16",
        "--random-seed", "7", "--host", "10.0.0.1", "--port", "30097", "--skip-server-warmup",
        "--disable-cuda-graph", "--enable-memory-saver")
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    # The owning actor's own CUDA_VISIBLE_DEVICES (one GPU) is replaced; expandable segments go (memory saver).
    environ = cmd.environ({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "4",
                           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert environ == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}


def test_launch_commands_of_tp1_tp8_and_options():
    tp1 = engine_gpus(make_placement(nodes=[8], actor=ParallelDims(tp=1)).engines, probe("global", NODE_A))
    cmd = command(tp1[5], host="0.0.0.0", context_length=3072, extra_args=["--log-level", "error"],
                  rollout=RolloutConfig(name="sglang", enforce_eager=False, free_cache_engine=False, dtype="float16"),
                  model=ModelConfig(path="/m", tokenizer_path="/t", trust_remote_code=True))
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "5"} and cmd.unset_env == ()
    argv = list(cmd.argv)
    assert argv[argv.index("--tp-size") + 1] == "1" and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--dtype") + 1] == "float16"
    assert "--disable-cuda-graph" not in argv and "--enable-memory-saver" not in argv and "--nnodes" not in argv
    assert argv[-7:] == ["--tokenizer-path", "/t", "--trust-remote-code", "--context-length", "3072",
                         "--log-level", "error"]
    (tp8,) = engine_gpus(make_placement(nodes=[8], actor=ParallelDims(tp=8)).engines, probe("global", NODE_A))
    cmd = command(tp8)
    assert cmd.argv[cmd.argv.index("--tp-size") + 1] == "8" and cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    with pytest.raises(ValueError, match="port must be in 1..65535"):
        command(tp8, port=70000)
    # Seeded sampling would give every sample of a batched request (a GRPO group) one seed: identical samples.
    with pytest.raises(ValueError, match="--enable-deterministic-inference makes SGLang sample every row"):
        command(tp8, extra_args=["--enable-deterministic-inference"])


def test_launch_commands_of_a_tp16_engine_on_both_nodes():
    (gpus,) = engine_gpus([tp16_engine()], probe("global", NODE_A, NODE_B))
    head, second = command(gpus, 0), command(gpus, 1)
    assert head.argv[-6:] == ("--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.1:20000")
    assert second.argv[-6:] == ("--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:20000")
    assert second.argv[second.argv.index("--host") + 1] == "10.0.0.2"
    assert head.argv[head.argv.index("--tp-size") + 1] == "16"
    assert head.env == second.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def all_commands() -> list[tuple[str, ...]]:
    """One command of every shape above, every optional flag included."""
    full = dict(rollout=ROLLOUT, model=ModelConfig(path="/m", tokenizer_path="/t", trust_remote_code=True),
                context_length=2048, return_routed_experts=True, lora=LoraSpec(rank=16, alpha=32.0))
    cmds = []
    for tp, nodes in ((1, [8]), (4, [8]), (8, [8])):
        for gpus in engine_gpus(make_placement(nodes=nodes, actor=ParallelDims(tp=tp)).engines,
                                probe("global", NODE_A)):
            cmds.append(command(gpus, **full).argv)
    (tp16,) = engine_gpus([tp16_engine()], probe("global", NODE_A, NODE_B))
    cmds += [command(tp16, 0, **full).argv, command(tp16, 1, **full).argv]
    return cmds


def _sglang_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang (the gpu extra) is not installed")
    return Path(spec.origin).parent


EMITTED_FIELDS = {
    "--model-path": "model_path", "--tokenizer-path": "tokenizer_path", "--tp-size": "tp_size",
    "--base-gpu-id": "base_gpu_id", "--gpu-id-step": "gpu_id_step", "--mem-fraction-static": "mem_fraction_static",
    "--dtype": "dtype", "--random-seed": "random_seed", "--host": "host", "--port": "port",
    "--skip-server-warmup": "skip_server_warmup", "--trust-remote-code": "trust_remote_code",
    "--disable-cuda-graph": "disable_cuda_graph", "--enable-memory-saver": "enable_memory_saver",
    "--context-length": "context_length", "--nnodes": "nnodes", "--node-rank": "node_rank",
    "--dist-init-addr": "dist_init_addr", "--enable-return-routed-experts": "enable_return_routed_experts",
    "--enable-lora": "enable_lora", "--max-lora-rank": "max_lora_rank", "--max-loras-per-batch": "max_loras_per_batch",
    "--lora-target-modules": "lora_target_modules"}
"""Every flag :func:`sglang_launch_command` can emit -> the ``ServerArgs`` field it is meant to set."""


def emitted_flags(argv: tuple[str, ...]) -> set[str]:
    return {a for a in argv[3:] if a.startswith("--")}


def test_every_emitted_flag_is_a_flag_of_the_pinned_sglang():
    """Against the flag list read from the installed sglang's source (tests.sglang_source, with ``ast``)."""
    root = _sglang_dir()
    sglang_source = pytest.importorskip("tests.sglang_source")
    flags = sglang_source.launch_server_flags()
    emitted = set().union(*(emitted_flags(argv) for argv in all_commands()))
    assert emitted == set(EMITTED_FIELDS)  # all_commands() shows every flag the function can emit
    assert {flag: flags.get(flag) for flag in sorted(emitted)} == EMITTED_FIELDS
    assert (root / "launch_server.py").is_file()  # python -m sglang.launch_server


def test_sglang_parses_the_commands_into_the_intended_server_args():
    """The real parser of the pinned sglang (importable without a GPU here) reads back every value."""
    _sglang_dir()
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as error:  # pragma: no cover - an sglang whose import needs GPU-only packages
        pytest.skip(f"sglang.srt.server_args does not import here: {error}")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = []
    for argv in all_commands():
        ns, unknown = parser.parse_known_args(list(argv[3:]))
        assert unknown == [], argv
        parsed.append(ns)
    tp16_head, tp16_second = parsed[-2:]
    assert (tp16_second.tp_size, tp16_second.nnodes, tp16_second.node_rank, tp16_second.dist_init_addr) == \
        (16, 2, 1, "10.0.0.1:20000")
    assert (tp16_head.base_gpu_id, tp16_head.gpu_id_step, tp16_head.mem_fraction_static, tp16_head.random_seed,
            tp16_head.port, tp16_head.dtype, tp16_head.context_length) == (0, 1, 0.6, 7, 30000, "bfloat16", 2048)
    assert tp16_head.disable_cuda_graph and tp16_head.enable_memory_saver and tp16_head.skip_server_warmup
    assert tp16_head.trust_remote_code and tp16_head.model_path == "/m" and tp16_head.tokenizer_path == "/t"
    assert tp16_head.enable_lora and (tp16_head.max_lora_rank, tp16_head.max_loras_per_batch) == (16, 1)
    assert sorted(tp16_head.lora_target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                     "up_proj", "v_proj"]
    assert [ns.tp_size for ns in parsed] == [1] * 8 + [4] * 2 + [8] + [16] * 2


# ------------------------------------------------------------------------------ Ray, 8 fake GPUs


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=8, num_gpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}})
    yield ray
    ray.shutdown()


def test_probe_reads_the_gpu_each_bundle_got_and_maps_the_engines(ray_cluster):
    """On a fresh Ray node a pool of 8 gets GPU b for bundle b (ray 2.60: ``ray.get_gpu_ids()`` is ``[b]`` as an
    int, and ``CUDA_VISIBLE_DEVICES`` is ``"b"``); the engines of TP 1, 4 and 8 get those GPUs in TP order."""
    ray = ray_cluster
    pool = ResourcePool("global", [8]).create(timeout_s=30)
    try:
        found = probe_bundle_gpus({"global": pool}, timeout_s=30)
        assert [found["global", b].gpu_id for b in range(8)] == list(range(8))
        assert {found["global", b].node_id for b in range(8)} == {ray.get_runtime_context().get_node_id()}
        assert {found["global", b].node_ip for b in range(8)} == {ray.util.get_node_ip_address()}

        @ray.remote(num_cpus=0, num_gpus=0.5)
        def seen():
            return ray.get_gpu_ids(), os.environ["CUDA_VISIBLE_DEVICES"]

        # What a worker placed on bundle 6 sees is the probed id.
        assert ray.get(seen.options(scheduling_strategy=pool.scheduling_strategy(6)).remote()) == ([6], "6")
        expected = {1: [[str(g)] for g in range(8)], 4: [["0,1,2,3"], ["4,5,6,7"]], 8: [["0,1,2,3,4,5,6,7"]]}
        for tp, want in expected.items():
            mapped = engine_gpus(make_placement(nodes=[8], actor=ParallelDims(tp=tp)).engines, found)
            assert visible(mapped) == want
            assert {(e.base_gpu_id, e.gpu_id_step, e.nnodes, e.dist_init_addr) for e in mapped} == {(0, 1, 1, None)}
    finally:
        pool.remove()


def test_probe_on_a_fragmented_node_finds_non_consecutive_gpus(ray_cluster):
    """After a group is removed, a new pool gets the freed GPUs 0, 1 and then 4, 5: a TP=4 engine there sees
    exactly ``0,1,4,5`` with base_gpu_id 0. A probe cannot run on a bundle whose GPU a worker holds whole."""
    ray = ray_cluster
    from ray.util.placement_group import placement_group, remove_placement_group

    first = placement_group([{"GPU": 1}] * 2, strategy="STRICT_PACK")
    ray.get(first.ready(), timeout=30)  # first GPUs 0, 1, then second 2, 3 (created together, either may be first)
    second = placement_group([{"GPU": 1}] * 2, strategy="STRICT_PACK")
    ray.get(second.ready(), timeout=30)
    remove_placement_group(first)
    pool = ResourcePool("global", [4], cpus_per_bundle=0.5).create(timeout_s=30)
    try:
        found = probe_bundle_gpus([pool], timeout_s=30)
        ids = [found["global", b].gpu_id for b in range(4)]
        assert sorted(ids) == [0, 1, 4, 5]
        (mapped,) = engine_gpus(make_placement(nodes=[4], actor=ParallelDims(tp=4)).engines, found)
        assert mapped.env() == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
        assert (mapped.base_gpu_id, mapped.gpu_id_step) == (0, 1)

        @ray.remote(num_cpus=0, num_gpus=1)
        class Holder:
            def ready(self):
                return True

        holder = Holder.options(scheduling_strategy=pool.scheduling_strategy(2)).remote()
        ray.get(holder.ready.remote(), timeout=30)
        with pytest.raises(TimeoutError, match="probe right after create_pools"):
            probe_bundle_gpus([pool], timeout_s=2)
        ray.kill(holder)
    finally:
        pool.remove()
        remove_placement_group(second)


def test_probe_refuses_cpu_only_pools():
    with pytest.raises(ValueError, match="'cpu' has CPU-only bundles"):
        probe_bundle_gpus([ResourcePool("cpu", [2], use_gpu=False)])


def test_each_hf_engine_of_a_node_serves_on_its_own_gpu(tmp_path, monkeypatch):
    """rollout.name=hf on CUDA: the server of the worker at local rank k runs on cuda:k (the group sets
    CUDA_VISIBLE_DEVICES to the node's GPUs of the group in local-rank order), not every engine on cuda:0."""
    from megarl.workers import engine_server

    started = []

    class Recorder:
        def __init__(self, argv, **kwargs):
            started.append(list(argv))

        def start(self):
            pass

        def wait_healthy(self, timeout_s):
            pass

    monkeypatch.setattr(engine_server, "ServerProcess", Recorder)
    devices = []
    for local_rank in range(3):
        worker = engine_server.EngineServerWorker()
        worker.local_rank = local_rank
        worker.start_server(engine=local_rank, rollout=RolloutConfig(name="hf"), model=ModelConfig(path=str(tmp_path)),
                            seed=0, device="cuda", log_dir=str(tmp_path))
        argv = started[-1]
        devices.append(argv[argv.index("--device") + 1])
    assert devices == ["cuda:0", "cuda:1", "cuda:2"]
    worker.start_server(engine=0, rollout=RolloutConfig(name="hf"), model=ModelConfig(path=str(tmp_path)), seed=0,
                        device="cpu", log_dir=str(tmp_path))
    assert started[-1][started[-1].index("--device") + 1] == "cpu"
