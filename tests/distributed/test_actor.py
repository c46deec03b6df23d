"""The Megatron actor at TP=2×PP=2: recomputed log-probs equal the CPU engine's, and PPO learns."""

import math

import pytest

from megarl.parallel.launch import run_ranks
from tests.distributed import actor_jobs

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    hf_dir = str(save_tiny(tmp_path_factory.mktemp("tiny") / "model", num_layers=2))
    batch = actor_jobs.rollout_batch(hf_dir, temperature=TEMPERATURE)
    return run_ranks(actor_jobs.actor_job, 4, hf_dir, batch, TEMPERATURE, timeout_s=300)


def test_rollout_and_training_log_probs_agree(results):
    output = [r for r in results if r["output_rank"]]
    assert len(output) == 1  # last stage, TP rank 0 of the only DP replica
    mismatch = output[0]["mismatch"]
    assert mismatch["mismatch/abs_logp_diff_mean"] <= 1e-5
    assert mismatch["mismatch/abs_logp_diff_max"] <= 1e-4


def test_ppo_updates_apply_and_move_the_policy_toward_positive_advantages(results):
    for r in results:
        assert len(r["steps"]) == 4  # 2 epochs × 2 mini-batches
        assert all(applied and math.isfinite(loss) and math.isfinite(norm) for applied, loss, norm in r["steps"])
    (output,) = [r for r in results if r["output_rank"]]
    assert any(norm > 0 for _, _, norm in output["steps"])  # the fake reward separates samples
    assert output["moved_toward_advantage"] > 0
