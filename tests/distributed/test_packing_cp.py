"""Packing, context and sequence parallelism: log-probs, values and one PPO step of the actor and the
critic equal DP=4 within 1e-5, padded or packed, at CP=2, TP2×CP2 and PP2×CP2, and TP=2 with sequence parallelism
(CPU attention and norms of megarl.models.local_spec)."""

import math

import pytest
import torch

from megarl.parallel.launch import run_ranks
from tests.distributed import critic_jobs, packing_cp_jobs, sharded_model_jobs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_dir, batch, expected = sharded_model_jobs.tiny_reference(tmp_path_factory.mktemp("tiny"))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    critic_batch = critic_jobs.make_batch(model.config.vocab_size)
    head = critic_jobs.head_init(model.config.hidden_size, model.config.initializer_range)
    values = critic_jobs.hf_values(model, critic_batch, head)[:, critic_jobs.PROMPT - 1 : -1]
    gen = torch.Generator().manual_seed(1)
    critic_batch["values"] = values + (torch.rand(values.shape, generator=gen) * 4 - 2) * 0.2
    critic_batch["returns"] = torch.randn(values.shape, generator=gen)
    ranks = run_ranks(packing_cp_jobs.packing_cp_job, 4, hf_dir, batch, critic_batch, timeout_s=500)
    return ranks, batch, expected, critic_batch, values


def _name(layout):
    tp, pp, cp, sp, packed = layout
    return "tp%d-pp%d-cp%d%s-%s" % (tp, pp, cp, "-sp" if sp else "", "packed" if packed else "padded")


def _same_step(got, reference):
    assert got["applied"] and reference["applied"]
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-8)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert set(got["weights"]) == set(reference["weights"])
    for name, tensor in reference["weights"].items():
        assert (tensor - got["weights"][name]).abs().max() <= 1e-5, name


@pytest.mark.parametrize("layout", packing_cp_jobs.LAYOUTS, ids=_name)
def test_logprobs_and_one_ppo_step_equal_the_reference(results, layout):
    ranks, batch, expected, _, _ = results
    valid = sharded_model_jobs.scored_positions(batch)
    reference = ranks[0][packing_cp_jobs.REFERENCE]
    got = ranks[0][layout]
    tp, pp, cp, sp, packed = layout
    assert got["dims"] == (tp, pp, cp, 4 // (tp * pp * cp))
    # Row 0 has 9 tokens. Packed: a segment of 9 rounded up to 2·cp, the pack to a multiple of cp·tp under SP;
    # padded: the 12 columns. Split over the cp ranks.
    seg = 2 * cp if cp > 1 else 1
    total = math.lcm(seg, cp * (tp if sp else 1))
    width = -(-9 // seg) * seg if packed else 12
    assert got["local_tokens"] == -(-width // total) * total // cp
    assert (got["logp"] - expected)[valid].abs().max() <= 1e-5  # HF transformers' log-probs
    _same_step(got, reference)
    for r in ranks:  # every rank agrees on the reduced numbers
        assert r[layout]["loss"] == pytest.approx(got["loss"], rel=1e-9)


def test_sequence_parallel_equals_tp2_without(results):
    ranks = results[0]
    plain, sp = ranks[0][(2, 1, 1, False, True)], ranks[0][(2, 1, 1, True, True)]
    assert (plain["logp"] - sp["logp"])[sharded_model_jobs.scored_positions(results[1])].abs().max() <= 1e-5
    _same_step(sp, plain)
    # every norm (2 per layer and the final one) is marked for the TP all-reduce of its gradient
    assert sp["sequence_parallel_params"] == ["decoder.final_layernorm.weight"] + [
        f"decoder.layers.{i}.{norm}.weight" for i in range(2) for norm in ("input_layernorm", "pre_mlp_layernorm")]
    assert plain["sequence_parallel_params"] == []


@pytest.mark.parametrize("layout", packing_cp_jobs.CRITIC_LAYOUTS, ids=_name)
def test_critic_values_and_one_update_equal_the_reference(results, layout):
    ranks, _, _, critic_batch, expected = results
    key = ("critic", *layout)
    reference = ranks[0][("critic", *packing_cp_jobs.CRITIC_REFERENCE)]
    mask = critic_batch["response_mask"].bool()
    for r in ranks:
        assert (r[key]["values"] - expected)[mask].abs().max() <= 1e-5  # HF's final hidden state × the head
        assert r[key]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    with_weights = [r[key] for r in ranks if r[key]["weights"] is not None]
    assert with_weights and "head.weight" in with_weights[0]["weights"]
    ref_weights = next(r[("critic", *packing_cp_jobs.CRITIC_REFERENCE)] for r in ranks
                       if r[("critic", *packing_cp_jobs.CRITIC_REFERENCE)]["weights"] is not None)
    _same_step(with_weights[0], ref_weights)
