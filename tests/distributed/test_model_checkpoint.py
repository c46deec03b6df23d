"""Engine checkpoints: a resumed run equals the uninterrupted one bit for bit; crashes leave the last one.

One 4-rank job (tests/distributed/checkpoint_jobs.py) produces every number asserted here; megarl-convert
turns its checkpoint into HF.
"""

import json
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


# ------------------------------------------- ``megarl-convert`` mcore-to-hf reads a training checkpoint
def test_a_checkpoint_keeps_the_hf_config_it_was_built_from(job):
    ranks, root, hf_dir = job
    actor = Path(root) / f"global_step_{SAVE_AFTER}" / "actor"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (actor / "hf_config" / name).read_bytes() == (Path(hf_dir) / name).read_bytes(), name
    manifest = json.loads((actor.parent / "manifest.json").read_text())
    assert "actor/hf_config/config.json" in manifest["files"]  # verified like the shards


def test_convert_accepts_the_actor_its_step_and_the_run_root(job):
    from megarl.cli.convert import mcore_source

    _, root, _ = job
    actor = Path(root) / f"global_step_{SAVE_AFTER}" / "actor"
    for named in (root, actor.parent, actor):
        source = mcore_source(str(named))
        assert source.directory == actor and source.model_dir == actor / "dist"
        assert (source.family, source.tp, source.pp, source.ep, source.etp, source.dtype) == ("qwen2", 2, 2, 1, 2,
                                                                                                "fp32")
        assert source.config_dir == actor / "hf_config"


def test_convert_exports_the_trained_actor_at_its_tp2_pp2_layout(job, tmp_path):
    """The CLI on the run root: the HF directory holds the actor's exported tensors bit for bit, transformers loads
    it, and its log-probs equal the actor's own (Megatron at TP=2×PP=2, fp32) within 1e-5."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.cli.convert import main
    from tests.distributed.sharded_model_jobs import hf_logprobs

    ranks, root, _ = job
    out = tmp_path / "hf"
    assert main(["mcore-to-hf", "--mcore", str(root), "--out", str(out)]) == 0
    exported = load_file(Path(root) / f"global_step_{SAVE_AFTER}" / "actor_hf" / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[name], tensor) for name, tensor in exported.items())
    for name in ("tokenizer.json", "generation_config.json"):
        assert (out / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    actor = next(r["actor_logp"] for r in ranks if "actor_logp" in r)
    batch = actor["batch"]
    valid = batch["attention_mask"].bool().clone()
    valid[:, :-1] &= batch["attention_mask"][:, 1:].bool()
    valid[:, -1] = False
    diff = (hf_logprobs(model, batch) - actor["logp"])[valid].abs().max().item()
    print(f"max |log p(HF export of the checkpoint) - log p(actor)| = {diff:.3g}")
    assert diff <= 1e-5


def test_convert_needs_hf_config_for_a_checkpoint_without_one(job, tmp_path, capsys, monkeypatch):
    import shutil

    from megarl.cli.convert import main
    from megarl.parallel import launch

    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("ranks spawned before the refusal"))
    _, root, _ = job
    old = tmp_path / "actor"
    shutil.copytree(Path(root) / f"global_step_{SAVE_AFTER}" / "actor", old)
    shutil.rmtree(old / "hf_config")  # as saved before checkpoints kept their HF config
    with pytest.raises(SystemExit) as exit_info:
        main(["mcore-to-hf", "--mcore", str(old), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert f"--mcore {old} holds no HF config" in err and "pass --hf-config DIR" in err
