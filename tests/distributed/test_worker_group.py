"""WorkerGroup on a real local Ray cluster with 4 fake GPUs (one Ray session for the module)."""

import os
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402

from megarl.data import Batch  # noqa: E402
from megarl.parallel import ParallelDims  # noqa: E402
from megarl.plan.placement import ResourcePool, make_placement  # noqa: E402
from megarl.workers.base import Worker, busy  # noqa: E402
from megarl.workers.group import WorkerError, WorkerGroup  # noqa: E402

ray = pytest.importorskip("ray")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TPWorker(Worker):
    """Initialises TP=2 on gloo; doubles its DP chunk and records who computed it."""

    role = "actor"

    def __init__(self, tag: str):
        self.tag = tag

    def env(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                "CUDA_VISIBLE_DEVICES")
        return {k: os.environ.get(k) for k in keys} | {"torch_threads": torch.get_num_threads(), "tag": self.tag}

    def setup_tp2(self):
        return self.init_parallel(ParallelDims(tp=2), backend="gloo", timeout_s=60)

    @busy
    def compute(self, batch: Batch, scale: float) -> Batch:
        coord = self.coordinates()
        # A TP all-reduce proves the replica's ranks got the same chunk.
        total = batch["x"].sum().reshape(1)
        torch.distributed.all_reduce(total, group=self.groups.tp)
        assert total.item() == 2 * batch["x"].sum().item()
        n = len(batch)
        return Batch(tensors={"y": batch["x"] * scale, "dp": torch.full((n,), coord.dp_rank),
                              "rank": torch.full((n,), coord.rank)}, non_tensors={"uid": batch["uid"]})

    def slow_barrier(self, seconds: float) -> int:
        time.sleep(seconds)
        torch.distributed.barrier()
        return self.rank


class SideWorker(Worker):
    role = "ref"

    def node_info(self) -> dict:
        return super().node_info() | {"side": True}

    def gpu(self):
        return ray.get_gpu_ids(), os.getpid()

    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    def fail(self) -> None:
        raise ValueError("bad input")


class OtherWorker(Worker):
    """Never spawned: its methods share names with TPWorker's but are other functions."""

    role = "critic"

    def env(self) -> dict:
        return {}

    def compute(self, batch: Batch, scale: float) -> Batch:
        return batch


def ping(self) -> int:
    """A function named like a Worker method, but not one."""
    return -1


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}})
    pool = ResourcePool("global", [4], cpus_per_bundle=2).create(timeout_s=30)
    yield pool
    pool.remove()
    ray.shutdown()


@pytest.fixture(scope="module")
def tp_group(cluster):
    plan = make_placement(nodes=[4], actor=ParallelDims(tp=2), ref=ParallelDims(tp=1))
    group = WorkerGroup(TPWorker, cluster, args=("a",), num_gpus=plan.gpu_fraction("actor"), timeout_s=60)
    group.call_all(TPWorker.setup_tp2)
    yield group
    group.shutdown()


def test_env_and_coordinates_come_from_the_ranks(tp_group):
    envs = tp_group.call_all(TPWorker.env)
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]  # one node
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"} and {e["torch_threads"] for e in envs} == {1}
    assert len(set(envs[0]["CUDA_VISIBLE_DEVICES"].split(","))) == 4  # this node's 4 fake GPUs, local-rank order
    coords = tp_group.refresh_coordinates()
    assert [(c.rank, c.dp_rank, c.tp_rank, c.pp_rank) for c in coords] == [(0, 0, 0, 0), (1, 0, 1, 0),
                                                                          (2, 1, 0, 0), (3, 1, 1, 0)]
    assert tp_group.dp_size == 2
    assert tp_group.collect_ranks() == [0, 2]
    assert tp_group.call_rank(3, TPWorker.ping) == 3


def test_split_and_gather_by_dp_round_trip(tp_group):
    n = 6
    batch = Batch.from_dict({"x": torch.arange(n, dtype=torch.float32),
                             "uid": [f"u{i}" for i in range(n)]}, meta={"step": 7})
    pieces = tp_group.split_by_dp(batch)
    assert [p["x"].tolist() for p in pieces] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    out = tp_group.call_dp(TPWorker.compute, batch, 2.0)
    assert out["y"].tolist() == [0, 2, 4, 6, 8, 10]
    assert out["dp"].tolist() == [0, 0, 0, 1, 1, 1]
    assert out["rank"].tolist() == [0, 0, 0, 2, 2, 2]  # TP rank 0 of each replica
    assert list(out["uid"]) == [f"u{i}" for i in range(n)]
    assert all(s > 0 for s in tp_group.call_all(Worker.take_busy))  # @busy methods are called as themselves


@pytest.fixture
def submitted(tp_group, monkeypatch):
    """What the group hands to Ray (actor calls and ray.put of call_dp's chunks); must stay empty."""
    record = []
    monkeypatch.setattr(tp_group, "_submit", lambda *args: record.append(("submit", args)))
    monkeypatch.setattr(ray, "put", lambda *args, **kwargs: record.append(("put", args)))
    return record


def test_a_method_of_another_class_fails_before_anything_is_submitted(tp_group, submitted):
    batch = Batch.from_dict({"x": torch.arange(4, dtype=torch.float32), "uid": list("abcd")})
    listing = r"TPWorker's methods: compute, coordinates, env, init_parallel, node_info, ping, " \
              r"rendezvous_address, setup_env, setup_tp2, slow_barrier, take_busy$"
    with pytest.raises(TypeError, match=r"^actor: OtherWorker.compute is not a method of the group's worker class "
                                        r"\S*TPWorker \(did you mean TPWorker.compute\?\). " + listing):
        tp_group.call_dp(OtherWorker.compute, batch, 2.0)
    with pytest.raises(TypeError, match=r"^actor: OtherWorker.env is not a method .*" + listing):
        tp_group.call_all(OtherWorker.env)
    with pytest.raises(TypeError, match=r"^actor: SideWorker.nap is not a method .*" + listing):
        tp_group.call_rank(0, SideWorker.nap, 1.0)
    with pytest.raises(TypeError, match=r"^actor: OtherWorker.env is not a method .*" + listing):
        tp_group.call_ranks([((), {})] * 4, OtherWorker.env)
    with pytest.raises(TypeError, match=r"^actor: ping is not a method .*did you mean TPWorker.ping"):
        tp_group.call_all(ping)  # the right name is not enough
    with pytest.raises(TypeError, match=r"^actor: len is not a method"):
        tp_group.call_all(len)
    with pytest.raises(AttributeError, match="slow_barier"):
        tp_group.call_all(TPWorker.slow_barier)  # a typo fails where it is written
    assert submitted == []


def test_a_method_name_string_is_refused(tp_group, submitted):
    batch = Batch.from_dict({"x": torch.arange(4, dtype=torch.float32), "uid": list("abcd")})
    advice = r"pass the worker method itself, e.g. TPWorker.{} \(WorkerClass.method\), not a string\. " \
             r"TPWorker's methods: compute, .*, take_busy$"
    with pytest.raises(TypeError, match=r"^actor: got the method name 'compute'; " + advice.format("compute")):
        tp_group.call_dp("compute", batch, 2.0)
    with pytest.raises(TypeError, match=r"^actor: got the method name 'env'; " + advice.format("env")):
        tp_group.call_all("env")
    with pytest.raises(TypeError, match=advice.format("ping")):
        tp_group.call_rank(0, "pnig")  # misspelt: the nearest method is suggested
    with pytest.raises(TypeError, match=advice.format("<method>")):
        tp_group.call_ranks([((), {})] * 4, "nothing_like_it")
    assert submitted == []


def test_colocated_worker_classes_share_bundles(cluster, tp_group):
    side = WorkerGroup(SideWorker, cluster, num_gpus=0.5, timeout_s=30)
    try:
        side_gpus = [ids for ids, _ in side.call_all(SideWorker.gpu)]
        assert all(len(ids) == 1 for ids in side_gpus)
        # Rank r of both groups sits on bundle r: the same fake GPU.
        actor_envs = tp_group.call_all(Worker.node_info)
        assert [[str(i) for i in ids] for ids in side_gpus] == [info["gpu_ids"] for info in actor_envs]
        assert side.call_all(SideWorker.ping) == [0, 1, 2, 3]
        # The base method is accepted and dispatched by name: the subclass's override runs on the ranks.
        assert all(info["side"] for info in side.call_all(Worker.node_info))
        assert side.call_rank(1, SideWorker.node_info)["side"]
        with pytest.raises(TypeError, match=r"^ref: TPWorker.env is not a method of the group's worker class"):
            side.call_all(TPWorker.env)
        assert side.refresh_coordinates()[2].dp_rank == 2  # no parallel init: pure data parallel
        with pytest.raises(WorkerError, match=r"ref rank 0 failed in fail: ValueError: bad input"):
            side.call_rank(0, SideWorker.fail)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"ref.nap: ranks \[0, 1, 2, 3\] did not answer within 0 s"):
            side.call_all(SideWorker.nap, 600.0, timeout_s=0.3)
        assert time.monotonic() - start < 300  # at the call's limit, not the nap's end
    finally:
        side.shutdown()


def test_killed_worker_ends_a_blocked_call_with_role_and_rank(tp_group):
    refs_started = time.monotonic()
    # All ranks sleep then meet in a barrier; rank 1 is killed while they are blocked.
    import threading

    killer = threading.Timer(1.0, tp_group.kill_rank, args=(1,))
    killer.start()
    with pytest.raises(WorkerError, match=r"actor rank 1 died during slow_barrier") as info:
        tp_group.call_all(TPWorker.slow_barrier, 3.0, timeout_s=600)
    killer.join()
    assert info.value.rank == 1 and info.value.role == "actor"
    assert time.monotonic() - refs_started < 300  # seen dead; the others would wait out the call's 600 s
    # A call on the dead rank fails at once, too.
    start = time.monotonic()
    with pytest.raises(WorkerError, match="actor rank 1 died during ping"):
        tp_group.call_rank(1, Worker.ping, timeout_s=600)
    assert time.monotonic() - start < 300  # at once, not at the call's limit


def _wandb_as_megatron_sees_it() -> str:
    import sys

    import megatron.core.timers as timers

    return f"{sys.modules.get('wandb', 'never imported')!r} {timers.wandb!r}"


def test_ray_workers_and_spawned_ranks_never_import_wandb(cluster):
    """Megatron imports wandb when it is installed; wandb's import leaves two temporary directories in /tmp in a
    process that is killed, as every worker is at a run's end. Workers see wandb as absent (megarl/__init__.py)."""
    from megarl.parallel.launch import run_ranks

    assert ray.get(ray.remote(num_cpus=0)(_wandb_as_megatron_sees_it).remote(), timeout=120) == "None None"
    assert run_ranks(_wandb_as_megatron_sees_it, 1, timeout_s=120) == ["None None"]
