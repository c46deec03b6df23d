"""The 2026 families in megarl's trainer (the loader, padded and packed batches, the PPO step, the streaming export):
log-probs equal HF transformers' within 1e-5 at every layout, and one PPO step (loss, gradient norm, every weight
after the step) equals the DP=4 padded reference at TP2 with sequence parallelism, PP2 and, for the mixtures of
experts, EP2 and TP2×EP2; packed (THD) equal to padded. Qwen3.5 dense and MoE: Gated DeltaNet layers among gated
full-attention ones (packed: each segment's recurrence from a zero state); Qwen3-Next: the same with its projections
fused per key head (reordered into Megatron's piece-major rows even at TP=1) and a dense layer among sparse ones."""

from __future__ import annotations

import pytest
import torch

from megarl.parallel.launch import run_ranks
from tests.distributed import family_jobs
from tests.distributed.sharded_model_jobs import NUM_ROWS, scored_positions


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases, expected = {}, {}
    for name in family_jobs.FAMILIES:
        directory = tmp_path_factory.mktemp(name)
        batch, expected[name] = family_jobs.reference(name, directory)
        cases[name] = (str(directory), batch)
    return run_ranks(family_jobs.family_job, 4, cases, timeout_s=900)[0], cases, expected


CHECKS = [(name, layout) for name in family_jobs.FAMILIES for layout in family_jobs.LAYOUTS[name]]


def _id(check):
    name, (tp, pp, ep, sp, packed) = check
    return f"{name}-tp{tp}-pp{pp}-ep{ep}{'-sp' if sp else ''}-{'packed' if packed else 'padded'}"


@pytest.mark.parametrize("check", CHECKS, ids=[_id(c) for c in CHECKS])
def test_logprobs_equal_hf_and_one_step_equals_the_reference(results, check):
    ranks, cases, expected = results
    name, layout = check
    got, reference = ranks[(name, layout)], ranks[(name, family_jobs.LAYOUTS[name][0])]
    batch = cases[name][1]
    valid = scored_positions(batch)
    assert valid.sum() > 2 * NUM_ROWS
    assert (got["logp"] - expected[name])[valid].abs().max() <= 1e-5
    assert got["applied"] and reference["applied"]
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-8)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert set(got["weights"]) == set(reference["weights"])
    for tensor_name, tensor in reference["weights"].items():
        assert (tensor - got["weights"][tensor_name]).abs().max() <= 1e-5, tensor_name


@pytest.mark.parametrize("check", CHECKS, ids=[_id(c) for c in CHECKS])
def test_the_stage_export_the_broadcast_transport_asks_is_bit_exact(results, check):
    """The buckets the broadcast transport takes (TP rank 0 of each stage, small buckets: the Gated DeltaNet's pieced
    tensors gathered over TP into several ranges each) hold the full export's bits, and the stages together every
    tensor."""
    ranks, _, _ = results
    got = ranks[check]
    assert got["stage_export_exact"]
    assert set(got["stage_names"]) == set(got["weights"])


@pytest.mark.parametrize("name", family_jobs.FAMILIES)
def test_the_step_trains_every_tensor_of_the_linear_attention(results, name):
    """Gradients reach every Gated DeltaNet tensor (projections, convolution, decay, norm): the step moved each from
    the checkpoint's value, so the equalities above compare trained tensors."""
    from safetensors.torch import load_file

    ranks, cases, _ = results
    before = load_file(f"{cases[name][0]}/model.safetensors")
    after = ranks[(name, family_jobs.LAYOUTS[name][0])]["weights"]
    linear = [n for n in before if ".linear_attn." in n]
    projections = ({"in_proj_qkvz.weight", "in_proj_ba.weight"} if name == "qwen3_next" else
                   {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"})
    assert {n.split(".linear_attn.")[1] for n in linear} == projections | {"conv1d.weight", "dt_bias", "A_log",
                                                                          "norm.weight", "out_proj.weight"}
    assert all(not torch.equal(before[n], after[n]) for n in linear)
