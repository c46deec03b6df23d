"""HF <-> Megatron at TP=2×PP=2: bit-exact round trips, HF logits, TP-matched shards, dist checkpoints.

One 4-rank job (convert_jobs.convert_job) measures everything for Llama (GQA, untied),
Qwen2 (biases, tied) and Qwen3 (q/k norms); the tests assert on its numbers.
"""

import os

import pytest
import torch

from megarl.parallel.launch import run_ranks
from tests.distributed import convert_jobs

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    cases, sizes = {}, {}
    for name in FAMILIES:
        model = convert_jobs.save_tiny_hf_model(name, root / name)
        input_ids = torch.randint(0, convert_jobs.VOCAB, (2, convert_jobs.SEQ), generator=torch.Generator().manual_seed(1))
        cases[name] = (str(root / name), input_ids, convert_jobs.hf_logits(model, input_ids))
        sizes[name] = os.path.getsize(root / name / "model.safetensors")
    results = run_ranks(convert_jobs.convert_job, 4, cases, str(root / "ckpt"), timeout_s=300)
    return results, sizes


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_to_hf_is_bit_exact(converted, family):
    for rank in converted[0]:
        r = rank[family]
        assert r["names_equal"] and r["bit_exact"]
        assert r["num_buckets"] > 5 and r["max_bucket_bytes"] <= 64 * 1024  # bucketed, within the bound


@pytest.mark.parametrize("family", FAMILIES)
def test_export_order_is_deterministic_hf_order(converted, family):
    orders = [rank[family]["order"] for rank in converted[0]]
    assert all(o == orders[0] for o in orders)
    assert orders[0][0] == "model.embed_tokens.weight" and orders[0][-1] in ("lm_head.weight", "model.norm.weight")
    layers = [int(n.split(".")[2]) for n in orders[0] if n.startswith("model.layers.")]
    assert layers == sorted(layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_equal_hf_and_after_checkpoint_reload(converted, family):
    last_stage = [rank[family] for rank in converted[0][2:]]  # ranks 2, 3 hold the last stage
    for r in last_stage:
        assert r["logits_diff"] <= 1e-4
        assert r["reload_tp1_pp2_vppNone_logits_diff"] <= 1e-4
        assert r["reload_tp2_pp2_vpp2_logits_diff"] <= 1e-4
    for rank in converted[0]:
        assert rank[family]["reload_tp1_pp2_vppNone_bit_exact"] and rank[family]["reload_tp2_pp2_vpp2_bit_exact"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_matched_shards_equal_slices_of_full_export(converted, family):
    for rank in converted[0]:
        assert rank[family]["shard_names_equal"] and rank[family]["shards_equal_slices"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_only_its_slices(converted, family):
    results, sizes = converted
    for rank in results:
        # a quarter of the model (TP=2 × PP=2) plus replicated norms, never the whole file
        assert rank[family]["bytes_read"] < 0.35 * sizes[family]
