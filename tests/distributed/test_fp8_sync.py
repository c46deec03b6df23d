"""Block-FP8 weight sync from a TP=2×PP=2 actor (a tiny Llama) on 4 gloo ranks into two real CPU engine
servers started from its FP8 checkpoint that behave as TP=2 SGLang engines (two payloads per update, two group
members each), by both transports: every tensor and scale verified by the transport that such an engine answers
whole, then every quantized weight and scale read whole from both engines equal, bit for bit, to the trainer's
weights quantized independently."""

from __future__ import annotations

import pytest

from megarl.parallel.launch import run_ranks
from megarl.sync import merge_stats
from tests.distributed import sync_jobs
from tests.engine_servers import engine_servers


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    from megarl.convert.fp8 import write_fp8_checkpoint
    from megarl.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("fp8_sync")
    hf_dir = save_tiny(root / "llama", arch="llama", num_layers=4, hidden_size=128, intermediate_size=256)
    fp8_dir = root / "llama_fp8"
    write_fp8_checkpoint(hf_dir, fp8_dir)
    with engine_servers(fp8_dir, root, num_engines=2, tp_size=sync_jobs.TP) as servers:
        first, second = (p.url for p in servers.processes)
        engine_0 = {"index": 0, "url": first, "tp": 2}
        engine_1 = {"index": 1, "url": second, "tp": 2}
        cases = [
            ("tensor", [{**engine_0, "host_ranks": (0, 1)}, {**engine_1, "host_ranks": (2, 3)}]),
            ("distributed", [{**engine_0, "replica": 0}, {**engine_1, "replica": 0}]),
        ]
        results = run_ranks(sync_jobs.fp8_transports_job, 4, str(hf_dir), cases, timeout_s=400)
    return results, cases


@pytest.mark.parametrize("case", [0, 1], ids=["tensor", "distributed"])
def test_fp8_weights_and_scales_arrive_bit_exact_in_tp2_engines(synced, case):
    results, cases = synced
    rank0 = results[0]["cases"][case]
    assert rank0["quantized"] > 10 and rank0["differ"] == [], rank0["differ"][:5]
    assert rank0["read"] == 2 * 2 * rank0["quantized"]  # weight and scale, from both engines
    assert rank0["moved"], "the perturbed weights quantize as the checkpoint's did: a sync that delivers nothing passes"
    merged = merge_stats([r["cases"][case]["stats"] for r in results if r["cases"][case]["stats"] is not None])
    # Verified by the transport as far as a TP=2 SGLang Llama answers: per layer o_proj and down_proj with their
    # scales (gathered whole) and 2 norms, and the final norm (4 x 6 + 1 of 38 + 28 scales); q/k/v and gate/up are
    # TP rank 0's slices and their scales refused (narrowed by weight rows), the embedding a vocabulary shard.
    assert (rank0["names"], rank0["quantized"]) == (38, 28)
    assert merged["weight_sync/verified_tensors"] == 25
    assert merged["weight_sync/unverified_tensors"] == 66 - 25
    assert merged["weight_sync/verified_engines"] == merged["weight_sync/engines"] == 2
