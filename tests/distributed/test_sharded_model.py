"""The sharded model: log-probs equal HF transformers', and a PPO step is the same at every layout, packed or
padded."""

import pytest

from megarl.parallel.launch import run_ranks
from tests.distributed import sharded_model_jobs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir, batch, expected = sharded_model_jobs.tiny_reference(tmp_path_factory.mktemp("tiny"))
    return run_ranks(sharded_model_jobs.sharded_model_job, 4, hf_dir, batch, timeout_s=300), batch, expected


@pytest.mark.parametrize("layout", sharded_model_jobs.LAYOUTS)
def test_logprobs_equal_hf_transformers(results, layout):
    ranks, batch, expected = results
    valid = batch["attention_mask"].bool().clone()
    valid[:, :-1] &= batch["attention_mask"][:, 1:].bool()
    valid[:, -1] = False
    last = [r[layout]["logp"] for r in ranks if r[layout]["logp"] is not None]
    assert len(last) == (4 if layout[:2] == (1, 1) else 2)
    for logp in last:
        assert (logp - expected)[valid].abs().max() <= 1e-5


@pytest.mark.parametrize("layout", sharded_model_jobs.LAYOUTS[1:])
def test_ppo_step_is_the_same_at_every_layout(results, layout):
    """DP=4 packed against TP=2 x PP=2, packed (every pipeline call one pack length) and padded."""
    ranks, *_ = results
    a, b = ranks[0][sharded_model_jobs.LAYOUTS[0]], ranks[0][layout]
    assert a["applied"] and b["applied"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["lr"] == b["lr"] == 1e-3
    assert {"pg_clipfrac", "ppo_kl", "entropy"} <= set(a["metrics"])
    for name, tensor in a["weights"].items():
        assert (tensor - b["weights"][name]).abs().max() <= 1e-5, name
    # every rank agrees on the reduced numbers
    for r in ranks:
        assert r[layout]["loss"] == pytest.approx(b["loss"], rel=1e-9)


def test_nan_loss_skips_the_update(results):
    ranks, *_ = results
    for r in ranks:
        for layout in sharded_model_jobs.LAYOUTS:
            assert r[layout]["nan_applied"] is False and r[layout]["nan_unchanged"]
