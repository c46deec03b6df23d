"""CheckpointManager: atomic commits, the latest pointer written last, crash debris, retention, resume modes."""

import os
import warnings

import pytest

from megarl.controller import run_checkpoints as cm
from megarl.controller.run_checkpoints import CheckpointManager, load_trainer_state, resolve_resume


def _save(manager: CheckpointManager, step: int, **state):
    tmp = manager.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "weights.bin").write_bytes(bytes([step]))
    return manager.commit(step, tmp, {"data": {"position": step * 10}, **state})


def test_commit_renames_the_temporary_dir_and_points_latest_at_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    tmp = manager.begin(3)
    assert tmp.parent == tmp_path and tmp.name.startswith(".tmp_global_step_3_")
    assert manager.latest() is None
    (tmp / "actor").mkdir()
    final = manager.commit(3, tmp, {"kl_coef": 0.1, "data": {"epoch": 1, "position": 4}})
    assert final == tmp_path / "global_step_3" and not tmp.exists()
    assert (final / "actor").is_dir()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert manager.latest() == final
    assert load_trainer_state(final) == {"step": 3, "kl_coef": 0.1, "data": {"epoch": 1, "position": 4}}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_pointer_is_written_after_the_rename(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    order = []
    real_replace = os.replace

    def recording_replace(src, dst):
        order.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(cm.os, "replace", recording_replace)
    _save(manager, 2)
    assert order == ["global_step_2", "latest_checkpointed_iteration.txt"]


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    # crash while workers write
    tmp = manager.begin(2)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "half_written").write_bytes(b"x")
    # crash inside commit, after trainer_state.json and before the rename
    tmp3 = manager.begin(3)

    def dies(src, dst):
        raise OSError("killed")

    monkeypatch.setattr(cm.os, "replace", dies)
    with pytest.raises(OSError):
        manager.commit(3, tmp3, {})
    monkeypatch.undo()
    # a new process starts: the previous checkpoint is the latest and loads
    restarted = CheckpointManager(tmp_path)
    assert restarted.latest() == tmp_path / "global_step_1"
    assert load_trainer_state(restarted.latest())["data"] == {"position": 10}
    assert (restarted.latest() / "actor" / "weights.bin").read_bytes() == bytes([1])
    assert restarted.steps() == [1]
    removed = restarted.clean_stale()
    assert {p.name for p in removed} == {tmp.name, tmp3.name}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "latest_checkpointed_iteration.txt"]


def test_a_crash_while_writing_the_pointer_keeps_the_old_one(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    real_replace = os.replace

    def dies_on_pointer(src, dst):
        if os.path.basename(dst) == "latest_checkpointed_iteration.txt":
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(cm.os, "replace", dies_on_pointer)
    with pytest.raises(OSError):
        _save(manager, 2)
    monkeypatch.undo()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert manager.latest() == tmp_path / "global_step_1"  # the committed step 2 is complete too
    assert [p.name for p in manager.clean_stale()] == [".latest_checkpointed_iteration.txt." + str(os.getpid())]


def test_max_to_keep_deletes_the_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (2, 4, 6):
        _save(manager, step)
    assert manager.steps() == [4, 6]
    assert not (tmp_path / "global_step_2").exists()
    assert manager.latest() == tmp_path / "global_step_6"


def test_resaving_a_step_replaces_it_and_later_steps_are_not_pruned(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=1)
    _save(manager, 1)
    _save(manager, 2)
    _save(manager, 3)
    assert manager.steps() == [3]
    # a run resumed from an earlier checkpoint saves step 3 again, then step 2 shows up under max_to_keep
    _save(manager, 3, attempt=2)
    assert load_trainer_state(manager.path(3))["attempt"] == 2
    with pytest.warns(UserWarning, match="later steps"):
        manager = CheckpointManager(tmp_path, max_to_keep=2)
        _save(manager, 2)
    assert manager.steps() == [2, 3] and manager.latest() == tmp_path / "global_step_2"


def test_missing_or_corrupt_pointer_falls_back_to_the_newest_complete(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    _save(manager, 2)
    (tmp_path / "global_step_5").mkdir()  # incomplete: no trainer_state.json
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.warns(UserWarning, match="missing or unreadable"):
        assert manager.latest() == tmp_path / "global_step_2"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    with pytest.warns(UserWarning, match="global_step_5, which is missing or incomplete"):
        assert manager.latest() == tmp_path / "global_step_2"
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    (tmp_path / "global_step_2" / "trainer_state.json").write_text("{not json")
    with pytest.warns(UserWarning):
        assert manager.latest() == tmp_path / "global_step_1"


def test_no_checkpoint_is_not_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CheckpointManager(tmp_path / "nothing").latest() is None
        assert CheckpointManager(tmp_path / "nothing").clean_stale() == []


def test_resolve_resume_modes(tmp_path):
    assert resolve_resume(tmp_path, "auto") is None
    assert resolve_resume(tmp_path, "disable") is None
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    _save(manager, 2)
    assert resolve_resume(tmp_path, "auto") == tmp_path / "global_step_2"
    assert resolve_resume(tmp_path, "disable") is None
    assert resolve_resume(tmp_path, "resume_path", tmp_path / "global_step_1") == tmp_path / "global_step_1"


@pytest.mark.parametrize("mode, path, message", [
    ("resume_path", None, "trainer.resume_mode=resume_path needs trainer.resume_from_path"),
    ("resume_path", "elsewhere", "trainer.resume_from_path=.*must be a global_step_<k>"),
    ("resume_path", "global_step_9", "trainer.resume_from_path=.*does not exist"),
    ("resume_path", "global_step_5", "trainer.resume_from_path=.*incomplete"),
    ("latest", None, "trainer.resume_mode must be auto, disable or resume_path"),
])
def test_resolve_resume_errors_name_the_setting(tmp_path, mode, path, message):
    (tmp_path / "global_step_5").mkdir()
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ValueError, match=message):
        resolve_resume(tmp_path, mode, None if path is None else tmp_path / path)


def test_bad_arguments(tmp_path):
    manager = CheckpointManager(tmp_path)
    tmp = manager.begin(1)
    with pytest.raises(TypeError):
        manager.commit(1, tmp, {"bad": object()})
    assert manager.latest() is None
    with pytest.raises(ValueError, match="max_actor_ckpt_to_keep"):
        CheckpointManager(tmp_path, max_to_keep=0)


# ---------------------------------------------------------------------- manifest (Truncated files)
def _save_model_like(manager: CheckpointManager, step: int):
    """A checkpoint with shard-like files in sub-directories, like the trainer's."""
    tmp = manager.begin(step)
    (tmp / "actor" / "dist").mkdir(parents=True)
    (tmp / "actor" / "dist" / "__0_0.distcp").write_bytes(bytes(range(256)) * 40 * step)
    (tmp / "actor" / "model.json").write_text('{"format": "megarl-model"}')
    return manager.commit(step, tmp, {"global_step": step})


def test_commit_writes_a_manifest_of_every_file(tmp_path):
    final = _save_model_like(CheckpointManager(tmp_path), 1)
    manifest = cm.json.loads((final / cm.MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == ["actor/dist/__0_0.distcp", "actor/model.json", "trainer_state.json"]
    assert manifest["files"]["actor/dist/__0_0.distcp"]["size"] == 256 * 40
    assert cm.verify_checkpoint(final) is None and cm.is_complete(final)


def test_a_truncated_file_makes_auto_resume_fall_back_and_say_so(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save_model_like(manager, 1)
    newest = _save_model_like(manager, 2)
    shard = newest / "actor" / "dist" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert manager.steps() == [1]  # sizes are checked when listing
    with pytest.warns(UserWarning) as caught:
        assert resolve_resume(tmp_path, "auto") == tmp_path / "global_step_1"
    (message,) = [str(w.message) for w in caught]
    assert "points to global_step_2, which is damaged" in message
    assert "file actor/dist/__0_0.distcp has 1000 bytes where the manifest records 20480 (truncated)" in message
    assert f"using {tmp_path / 'global_step_1'} instead" in message
    # the same check refuses the damaged checkpoint when it is named explicitly
    with pytest.raises(ValueError, match=r"trainer\.resume_from_path=.*global_step_2 is damaged: file "
                                         r"actor/dist/__0_0\.distcp has 1000 bytes.*pick another checkpoint"):
        resolve_resume(tmp_path, "resume_path", newest)
    assert resolve_resume(tmp_path, "resume_path", tmp_path / "global_step_1") == tmp_path / "global_step_1"


@pytest.mark.parametrize("damage, problem", [
    ("altered", r"file actor/dist/__0_0\.distcp does not hold what was saved \(its SHA-256 differs"),
    ("missing", r"file actor/model\.json is missing"),
    ("manifest", r"its manifest\.json is unreadable"),
    ("entry", r"its manifest\.json is unreadable \(an entry lacks its size or hash\)"),
])
def test_altered_missing_or_unreadable_files_are_named(tmp_path, damage, problem):
    manager = CheckpointManager(tmp_path)
    _save_model_like(manager, 1)
    newest = _save_model_like(manager, 2)
    if damage == "altered":  # same size, other bytes: only the hash sees it
        shard = newest / "actor" / "dist" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[5000] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "missing":
        (newest / "actor" / "model.json").unlink()
    elif damage == "manifest":
        (newest / cm.MANIFEST_NAME).write_text('{"files": ')
    else:  # an entry without its size
        manifest = cm.json.loads((newest / cm.MANIFEST_NAME).read_text())
        del manifest["files"]["actor/model.json"]["size"]
        (newest / cm.MANIFEST_NAME).write_text(cm.json.dumps(manifest))
    with pytest.warns(UserWarning, match=f"global_step_2, which is damaged: {problem}.*using .*global_step_1"):
        assert manager.latest() == tmp_path / "global_step_1"
    with pytest.raises(ValueError, match=f"resume_from_path=.*global_step_2 is damaged: {problem}"):
        resolve_resume(tmp_path, "resume_path", newest)


def test_every_damaged_checkpoint_is_named_and_none_left_starts_fresh(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        _save_model_like(manager, step)
    for step in (2, 3):
        (tmp_path / f"global_step_{step}" / "actor" / "model.json").write_text("{}")
    with pytest.warns(UserWarning, match=r"global_step_3, which is damaged: file actor/model\.json has 2 bytes.*"
                                         r"checkpoint global_step_2 is damaged: file actor/model\.json.*"
                                         r"using .*global_step_1 instead"):
        assert manager.latest() == tmp_path / "global_step_1"
    (tmp_path / "global_step_1" / "trainer_state.json").write_text("{")
    with pytest.warns(UserWarning, match="none verifies.*starts from scratch"):
        assert manager.latest() is None


def test_large_files_are_hashed_by_sampled_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(cm, "FULL_HASH_BYTES", 4096)
    monkeypatch.setattr(cm, "SAMPLE_BLOCK_BYTES", 512)
    manager = CheckpointManager(tmp_path)
    final = _save_model_like(manager, 1)  # a 10240-byte shard: 8 blocks of 512 bytes, ends included
    manifest = cm.json.loads((final / cm.MANIFEST_NAME).read_text())
    assert (manifest["full_hash_bytes"], manifest["sample_block_bytes"]) == (4096, 512)
    shard = final / "actor" / "dist" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte is in the last block
    shard.write_bytes(bytes(data))
    assert "SHA-256 differs" in cm.verify_checkpoint(final)
    monkeypatch.undo()  # the manifest's own scheme is used, whatever the module's constants are now
    assert "SHA-256 differs" in cm.verify_checkpoint(final)
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cm.verify_checkpoint(final) is None


def test_a_checkpoint_without_manifest_still_resolves(tmp_path):
    """Checkpoints written before manifests existed: complete when the trainer state reads (unverified)."""
    manager = CheckpointManager(tmp_path)
    _save_model_like(manager, 1)
    legacy = _save_model_like(manager, 2)
    (legacy / cm.MANIFEST_NAME).unlink()
    shard = legacy / "actor" / "dist" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])  # nothing to check it against: the model loader names it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.steps() == [1, 2] and manager.latest() == legacy
        assert resolve_resume(tmp_path, "auto") == legacy
        assert resolve_resume(tmp_path, "resume_path", legacy) == legacy


def test_an_unreadable_trainer_state_names_the_file(tmp_path):
    final = _save_model_like(CheckpointManager(tmp_path), 1)
    (final / "trainer_state.json").write_text('{"global_step": ')
    with pytest.raises(ValueError, match=r"trainer_state\.json of checkpoint .*global_step_1 is unreadable"):
        load_trainer_state(final)


def test_a_dangling_symlink_root_is_named(tmp_path):
    """A checkpoint root that is a symlink to nowhere used to fail with a bare FileExistsError."""
    from megarl.controller.run_checkpoints import RunLock

    (tmp_path / "ckpt").symlink_to(tmp_path / "gone" / "disk")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'ckpt'} is a symbolic link to {tmp_path}/gone/disk, "
                                                r"which does not exist; create it, or choose another "
                                                r"trainer.default_local_dir"):
        RunLock(tmp_path / "ckpt" / "megarl" / "run").acquire()


def test_a_save_is_refused_up_front_when_the_disk_has_less_room_than_the_last_checkpoint(tmp_path):
    """A full disk used to surface as ``CheckpointException ranks:dict_keys([])``. The last checkpoint
    here is a sparse file larger than the disk's free space (no space is used)."""
    import shutil

    manager = CheckpointManager(tmp_path)
    manager.check_space(1)  # no checkpoint yet: nothing to compare with
    tmp = manager.begin(1)
    with open(tmp / "shard.bin", "wb") as shard:
        shard.truncate(shutil.disk_usage(tmp_path).free + 2**30)
    manager.commit(1, tmp, {})
    with pytest.raises(cm.CheckpointSaveError, match=r"checkpoint of step 2 not started: the device of .* free and the "
                                                      r"last checkpoint \(step 1\) takes .*trainer.default_local_dir"):
        manager.check_space(2)


def test_a_failed_save_is_removed_and_says_whether_the_disk_is_full(tmp_path):
    import errno

    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    tmp = manager.begin(2)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "part.bin").write_bytes(b"x" * 4096)
    error = manager.save_failed(2, tmp, RuntimeError("CheckpointException ranks:dict_keys([])"))
    assert not tmp.exists() and manager.steps() == [1]  # the partial save is gone; step 1 is intact
    assert str(error).startswith("checkpoint of step 2 not saved (the checkpoint of step 1 (")
    assert "RuntimeError: CheckpointException" in str(error)
    tmp = manager.begin(2)
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RuntimeError("a worker failed") from full
    except RuntimeError as wrapped:
        error = manager.save_failed(2, tmp, wrapped)
    assert "checkpoint of step 2 not saved: no space left on the device of" in str(error)
    assert "the checkpoint of step 1" in str(error) and "is intact" in str(error)
    assert not tmp.exists()


def test_role_checkpoint_resolves_a_step_and_a_run_root(tmp_path):
    """megarl-convert's --mcore: a step directory means its actor/, a run root its latest committed checkpoint's."""
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    _save(manager, 2)
    manager.begin(3)  # a save in progress (or crashed) is not the latest
    actor = tmp_path / "global_step_2" / "actor"
    assert cm.role_checkpoint(tmp_path) == actor
    assert cm.role_checkpoint(tmp_path / "global_step_1") == tmp_path / "global_step_1" / "actor"
    assert cm.role_checkpoint(actor) == actor  # a role directory as it is
    with pytest.raises(ValueError, match=r"global_step_2 has no critic checkpoint"):
        cm.role_checkpoint(tmp_path / "global_step_2", "critic")
    (actor / "weights.bin").write_bytes(b"")  # damaged after the commit
    with pytest.raises(ValueError, match=r"global_step_2 is not a whole checkpoint: file actor/weights.bin"):
        cm.role_checkpoint(tmp_path / "global_step_2")
    with pytest.warns(UserWarning, match="global_step_2.*using .*global_step_1"):
        assert cm.role_checkpoint(tmp_path) == tmp_path / "global_step_1" / "actor"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"empty holds no committed checkpoint"):
        cm.role_checkpoint(empty)
