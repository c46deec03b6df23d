"""Engine checkpoint checks that need no ranks: incomplete directories and changed schedules are refused."""

import json

import pytest

from megarl.workers.model_checkpoint import check_schedule, read_model_metadata

SCHEDULE = {"max_lr": 1e-3, "lr_warmup_steps": 1, "num_steps": 2, "lr_decay_style": "cosine", "lr_decay_steps": 9,
            "min_lr": 1e-4, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 1}


def test_an_interrupted_role_save_is_refused(tmp_path):
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "metadata.json").write_text("{}")  # the model part landed, model.json did not
    with pytest.raises(ValueError, match="not a complete model checkpoint.*interrupted"):
        read_model_metadata(tmp_path)
    (tmp_path / "model.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="format 'something-else'"):
        read_model_metadata(tmp_path)


def test_a_changed_schedule_names_the_setting():
    check_schedule(SCHEDULE, {**SCHEDULE, "num_steps": 0}, "ckpt")  # the step count is state, not a setting
    with pytest.raises(ValueError, match=r"optim\.lr: saved 0\.001, now 0\.002.*with_optimizer=False"):
        check_schedule(SCHEDULE, {**SCHEDULE, "max_lr": 2e-3}, "ckpt")
    with pytest.raises(ValueError, match=r"optim\.decay_style: saved 'cosine', now 'linear'"):
        check_schedule(SCHEDULE, {**SCHEDULE, "lr_decay_style": "linear"}, "ckpt")


def test_a_truncated_model_json_names_the_file(tmp_path):
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "metadata.json").write_text("{}")
    (tmp_path / "model.json").write_text('{"format": "megarl-mo')
    with pytest.raises(ValueError, match=r"file .*model\.json of checkpoint .* is unreadable .*truncated"):
        read_model_metadata(tmp_path)


def test_a_truncated_dist_file_is_named_from_the_metadata(tmp_path):
    """The torch_dist checkpoint's files are checked against the byte ranges its .metadata records."""
    from megarl.convert.dist_checkpoint import dist_checkpoint_problem

    assert "has no metadata.json" in dist_checkpoint_problem(tmp_path)
    (tmp_path / "metadata.json").write_text("{}")
    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x95")  # a pickle cut short
    assert "file " + str(tmp_path / ".metadata") + " is unreadable" in dist_checkpoint_problem(tmp_path)


def test_a_critic_checkpoint_is_not_exported(tmp_path):
    """megarl-convert mcore-to-hf on a critic's checkpoint: a value head is no language model."""
    from megarl.workers.model_checkpoint import export_source

    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "metadata.json").write_text("{}")
    (tmp_path / "model.json").write_text(json.dumps({"format": "megarl-model", "family": "qwen2", "value_head": True}))
    with pytest.raises(ValueError, match="is a critic's checkpoint .*export the actor's"):
        export_source(tmp_path)
