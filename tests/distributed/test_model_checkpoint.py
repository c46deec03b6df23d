"""Engine checkpoints: a resumed run equals the uninterrupted one bit for bit; crashes leave the last one.

One 4-rank job (tests/distributed/checkpoint_jobs.py) produces every number asserted here.
"""

from pathlib import Path

import pytest
import torch

from megarl.parallel.launch import run_ranks
from tests.distributed import checkpoint_jobs
from tests.distributed.checkpoint_jobs import LAST_STEP, SAVE_AFTER


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    hf_dir = save_tiny(tmp_path_factory.mktemp("tiny") / "model", num_layers=2)
    root = tmp_path_factory.mktemp("checkpoints")
    ranks = run_ranks(checkpoint_jobs.checkpoint_job, 4, str(hf_dir), str(root), timeout_s=180)
    return ranks, root, hf_dir


def test_resumed_run_equals_the_uninterrupted_run(job):
    ranks, *_ = job
    for r in ranks:
        for step in range(SAVE_AFTER + 1, LAST_STEP + 1):
            assert r["resumed"][step] == r["run"][step], (r["rank"], step)  # loss, grad norm, lr: exact
            assert r["run"][step]["applied"]
        assert r["params_equal"] and r["num_params"] > 0
    # the schedule moved (warm-up then cosine), so its state had to be restored to match
    assert len({r["run"][s]["lr"] for s in range(1, LAST_STEP + 1) for r in ranks[:1]}) == LAST_STEP


def test_rng_streams_are_restored(job):
    ranks, *_ = job
    for r in ranks:
        assert r["rng_after_load"] == r["rng_after_save"]
    # the streams are per rank (pipeline stages and TP ranks differ), not one shared value
    assert len({tuple(r["rng_after_save"]) for r in ranks}) == 4


def test_trainer_state_round_trips(job):
    ranks, *_ = job
    assert ranks[0]["trainer_state"] == {"step": SAVE_AFTER, "data": {"epoch": 0, "position": 7}, "kl_coef": 0.05}


def test_crash_during_save_leaves_the_previous_checkpoint(job):
    ranks, root, _ = job
    zero = ranks[0]
    assert all(r["crash_raised"] for r in ranks)
    assert zero["crash_tmp_has_model"]  # the crash came after the model part was written
    assert Path(zero["latest_after_crash"]).name == f"global_step_{SAVE_AFTER}"
    assert zero["removed"] and all(name.startswith(".tmp_global_step_") for name in zero["removed"])
    # the resume above loaded from that checkpoint; its layout on disk
    step_dir = Path(root) / f"global_step_{SAVE_AFTER}"
    assert (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_AFTER)
    assert sorted(p.name for p in (step_dir / "actor" / "rng").iterdir()) == [f"rank_{r:05d}.pt" for r in range(4)]
    assert (step_dir / "actor" / "model.json").exists() and (step_dir / "actor" / "dist" / "metadata.json").exists()


def test_hf_export_holds_the_saved_weights(job):
    from safetensors.torch import load_file

    ranks, root, hf_dir = job
    export = Path(root) / f"global_step_{SAVE_AFTER}" / "actor_hf"
    written = load_file(export / "model.safetensors")
    expected = ranks[0]["hf_at_save"]
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    for side_file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (export / side_file).exists(), side_file
    original = load_file(Path(hf_dir) / "model.safetensors")
    assert any(not torch.equal(original[n], expected[n]) for n in expected)  # training moved the weights


def test_weights_load_at_another_layout(job):
    ranks, *_ = job
    zero = ranks[0]
    for name, tensor in zero["hf_at_save"].items():
        assert torch.equal(zero["hf_other_layout"][name], tensor), name
    error = zero["layout_error"]
    assert error is not None
    assert "TP2×PP2×VPP1×CP1×DP1" in error and "TP1×PP2×VPP1×CP1×DP2" in error
    assert "with_optimizer=False" in error


def test_dp_sharded_optimizer_resumes_exactly(job):
    ranks, *_ = job
    for r in ranks:
        assert r["dp_resumed"] == r["dp_run"] and r["dp_run"]["applied"]
        assert r["dp_params_equal"]


def test_a_truncated_file_is_named_on_every_rank(job):
    ranks, *_ = job
    for r in ranks:
        for name, error in r["damaged"].items():
            assert error is not None, (r["rank"], name)
            assert f"/{name} " in error and "truncated" in error and "resume from another checkpoint" in error
            assert "cannot be loaded" in error and ".tmp_global_step_3" in error  # the checkpoint directory
