"""Packing and context parallelism (issue 15): log-probs and one PPO step equal DP=4 packed within 1e-5, padded or
packed, at CP=2, TP2×CP2 and PP2×CP2 (CPU attention of megarl.parallel.cpu_support)."""

import pytest

from megarl.parallel.launch import run_ranks
from tests.distributed import packing_cp_jobs, sharded_model_jobs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir, batch, expected = sharded_model_jobs.tiny_reference(tmp_path_factory.mktemp("tiny"))
    return run_ranks(packing_cp_jobs.packing_cp_job, 4, hf_dir, batch, timeout_s=400), batch, expected


def _valid(batch):
    valid = batch["attention_mask"].bool().clone()
    valid[:, :-1] &= batch["attention_mask"][:, 1:].bool()
    valid[:, -1] = False
    return valid


@pytest.mark.parametrize("layout", packing_cp_jobs.LAYOUTS, ids=lambda l: "tp%d-pp%d-cp%d-%s" % (*l[:3], "packed" if l[3] else "padded"))
def test_logprobs_and_one_ppo_step_equal_the_reference(results, layout):
    ranks, batch, expected = results
    valid = _valid(batch)
    reference = ranks[0][packing_cp_jobs.REFERENCE]
    got = ranks[0][layout]
    tp, pp, cp, packed = layout
    assert got["dims"] == (tp, pp, cp, 4 // (tp * pp * cp))
    # Row 0 has 9 tokens: packed, a segment of 9 rounded up to 2·cp; padded, the 12 columns; split over cp ranks.
    align = 2 * cp if cp > 1 else 1
    assert got["local_tokens"] == ((-(-9 // align) * align) if packed else 12) // cp
    assert (got["logp"] - expected)[valid].abs().max() <= 1e-5  # HF transformers' log-probs
    assert got["applied"] and reference["applied"]
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-8)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    for name, tensor in reference["weights"].items():
        assert (tensor - got["weights"][name]).abs().max() <= 1e-5, name
    for r in ranks:  # every rank agrees on the reduced numbers
        assert r[layout]["loss"] == pytest.approx(got["loss"], rel=1e-9)
