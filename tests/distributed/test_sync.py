"""Weight transports (megarl.sync) from a TP=2×PP=2 actor (a tiny Llama) on 4 gloo ranks into two real
CPU engine servers that behave as TP=2 SGLang engines (two payloads per update, two group members each).

One 4-rank job (sync_jobs.transports_job) runs three cases, each twice, after changing every weight:

- ``tensor`` with an engine on each pipeline stage's GPUs (per_tp_group: both stages need every bucket, one
  broadcast of a 1/tp stripe per TP rank, then an all-gather of the stripes), and with one engine on stage 0
  only (per_replica: stage 1's stripes go point to point);
- ``distributed``: each stage's TP-0 rank broadcasts its own buckets to both engines (two groups of 5).

The transport verifies what a TP=2 SGLang Llama answers whole (``/get_weights_by_name``: its gathered and replicated
tensors), and rank 0 reads every tensor whole (``/megarl/inspect_weight``) against an independent full export.
"""

from __future__ import annotations

import pytest

from megarl.parallel.launch import run_ranks
from megarl.sync import merge_stats
from tests.distributed import sync_jobs
from tests.engine_servers import engine_servers


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("sync")
    hf_dir = save_tiny(root / "llama", arch="llama", num_layers=4)  # tied embeddings; SGLang reads a Llama back
    with engine_servers(hf_dir, root, num_engines=2, tp_size=sync_jobs.TP) as servers:
        first, second = (p.url for p in servers.processes)
        engine_0 = {"index": 0, "url": first, "tp": 2}
        engine_1 = {"index": 1, "url": second, "tp": 2}
        cases = [
            ("tensor", [{**engine_0, "host_ranks": (0, 1)}, {**engine_1, "host_ranks": (2, 3)}]),
            ("tensor", [{**engine_0, "host_ranks": (0, 1)}]),
            ("distributed", [{**engine_0, "replica": 0}, {**engine_1, "replica": 0}]),
        ]
        results = run_ranks(sync_jobs.transports_job, 4, str(hf_dir), cases, timeout_s=400)
    return results, cases


@pytest.mark.parametrize("case", [0, 1, 2], ids=["tensor_per_tp_group", "tensor_per_replica", "distributed"])
def test_every_tensor_arrives_bit_exact(synced, case):
    results, cases = synced
    rank0 = results[0]["cases"][case]
    assert rank0["max_change"] > 0  # the actor's weights differ from the file the engines loaded
    assert rank0["differ"] == []
    engines = len(cases[case][1])
    for attempt in range(2):
        merged = merge_stats([r["cases"][case]["stats"][attempt] for r in results
                              if r["cases"][case]["stats"][attempt] is not None])
        # The first sync is verified by the transport as far as a TP=2 SGLang Llama answers whole (per layer its 2
        # norms, o_proj and down_proj, gathered; the final norm: 4 x 4 + 1 of 38), the rest (q/k/v, gate/up and the
        # embedding, TP rank 0's slices) counted unverified; the second by rank 0's whole read above.
        assert rank0["names"] == 38
        assert merged["weight_sync/verified_tensors"] == (17 if attempt == 0 else 0)
        assert merged["weight_sync/unverified_tensors"] == (21 if attempt == 0 else 0)
        assert merged["weight_sync/verified_engines"] == merged["weight_sync/engines"] == engines
        assert merged["weight_sync/buckets"] > 10  # dozens of small buckets: the double buffers take turns


def test_tensor_buckets_reuse_their_shared_memory_from_sync_to_sync(synced):
    """tensor: each rank's two shared-memory bucket buffers outlive a sync and serve the next (creating them costs
    more than filling them); distributed's plain buffers are not kept, nor do they replace the kept ones."""
    results, _ = synced
    for r in results:
        first, second = r["cases"][0]["rings"]
        assert first is not None and len(first) == 2 and second == first
        assert r["cases"][1]["rings"][0] == first  # the next transport's sync too (same buckets)
        assert r["cases"][2]["rings"] == [first, first]


def test_buckets_for_the_first_tp_rank_only(synced):
    """iter_buckets(tp_ranks=(0,)) (distributed's senders): TP rank 0 of each stage gets exactly its stage's tensors,
    equal to a full export; the other TP ranks only join the all-gathers and get none. It refuses pipeline
    delivery (stripes come from every TP rank)."""
    results, _ = synced
    for r in results:
        got = r["first_tp_only"]
        tp_rank = r["rank"] % sync_jobs.TP
        assert got["differ"] == []
        assert sorted(got["names"]) == (got["stage_names"] if tp_rank == 0 else [])
        assert len(got["stage_names"]) > 10
        assert "tp_ranks needs to_pp_ranks=()" in got["refused"]


def test_distributed_stages_send_one_after_the_other(synced):
    """distributed with PP=2 and two engines: stage 1 posts its first bucket only after both engines answered stage
    0's last one (two stages broadcasting at once on their own groups can deadlock SGLang engines that take them in
    opposite orders)."""
    results, _ = synced
    stage_0 = results[0]["cases"][2]["posts"]
    stage_1 = results[2]["cases"][2]["posts"]
    assert len(stage_0) > 10 and len(stage_1) > 10  # two syncs of dozens of buckets, to both engines
    for attempt in range(2):  # each sync's requests (sends and answers) in its own half of the records
        first = sorted(stage_0)[attempt * len(stage_0) // 2:(attempt + 1) * len(stage_0) // 2]
        second = sorted(stage_1)[attempt * len(stage_1) // 2:(attempt + 1) * len(stage_1) // 2]
        assert max(end for _, end in first) < min(sent for sent, _ in second)
    assert results[1]["cases"][2]["posts"] == results[3]["cases"][2]["posts"] == []


def test_who_sends(synced):
    """tensor: each engine's first host rank drives it; distributed: each stage's TP-0 rank sends its buckets."""
    results, _ = synced
    senders = {case: [r["rank"] for r in results if r["cases"][case]["stats"][0] is not None] for case in range(3)}
    assert senders == {0: [0, 2], 1: [0], 2: [0, 2]}
    # A stage sends only its own buckets with distributed; a driver sends them all with tensor.
    stats = {r["rank"]: r["cases"][2]["stats"][0] for r in results if r["rank"] in (0, 2)}
    tensor_bytes = results[0]["cases"][1]["stats"][0]["weight_sync/bytes"]
    assert stats[0]["weight_sync/bytes"] + stats[2]["weight_sync/bytes"] == 2 * tensor_bytes
    assert 0 < stats[2]["weight_sync/bytes"] < 2 * tensor_bytes


def test_each_engine_rank_gets_the_adapters_packed_on_its_own_gpu():
    """A colocated TP-2 engine's adapter sync: the sender (the actor rank on the engine's first GPU) posts one
    payload per engine TP rank, each a handle to the adapters packed by the actor rank on that engine rank's GPU
    (shared memory made by that rank's process here; CUDA IPC on that GPU there), never one buffer for all: an engine
    rank opening another GPU's handle keeps a CUDA context there for good."""
    first, second = run_ranks(sync_jobs.adapter_payloads_job, 2, timeout_s=120)
    assert second["posted"] == []
    (handles,) = first["posted"]
    assert [name.split("_")[1] for name in handles] == [str(first["pid"]), str(second["pid"])]
