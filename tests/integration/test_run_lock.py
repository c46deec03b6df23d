"""A run's directory lock against another process (megarl.controller.run_checkpoints)."""

import pytest

from megarl.controller import run_checkpoints as cm


def test_a_run_owns_its_directory(tmp_path):
    """A second run into a held directory refuses at once, naming the holder; the lock dies with its process."""
    import subprocess
    import sys

    root = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom megarl.controller.run_checkpoints import RunLock\n"
                               f"RunLock({str(root)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        stale = root / f"{cm.TMP_PREFIX}5_{holder.pid}"
        stale.mkdir()  # the holder's save in progress
        with pytest.raises(cm.RunDirectoryInUse, match=rf"{root}.*pid {holder.pid} on host .*experiment_name"):
            cm.RunLock(root).acquire()
        assert stale.is_dir()  # nothing of the live run was touched
    finally:
        holder.kill()
        holder.wait()
    lock = cm.RunLock(root).acquire()  # the killed holder's lock went with its process
    assert cm.CheckpointManager(root).clean_stale() == [stale]
    with pytest.raises(cm.RunDirectoryInUse):
        cm.RunLock(root).acquire()  # a second lock in the same process is refused too
    lock.release()
    cm.RunLock(root).acquire().release()
