"""Weight-sync buffers in shared memory are unlinked when their process is killed (/dev/shm used to fill up,
1.17 GB after 25 runs): the files of a killed process are found by its PID and removed; a live one's are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from megarl.parallel.shared_memory import SHARED_MEMORY_DIR, remove_shared_memory, shared_memory_files

HOLD_A_BUFFER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from megarl.convert.export import empty_buffer
buffer = empty_buffer(1 << 20, torch.float32, "cpu", shared_memory=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_processs_buffers_are_removed_and_a_live_ones_kept():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    holders = [subprocess.Popen([sys.executable, "-c", HOLD_A_BUFFER, root], stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        for holder in holders:
            assert holder.stdout.readline().strip() == "ready"
        killed, alive = holders
        assert len(shared_memory_files([killed.pid])) == len(shared_memory_files([alive.pid])) == 1
        killed.send_signal(signal.SIGKILL)  # no clean-up runs: torch never unlinks its file
        killed.wait()
        assert len(shared_memory_files([killed.pid])) == 1
        assert shared_memory_files([killed.pid])[0] in shared_memory_files()  # found as a dead process's
        assert remove_shared_memory() >= 1
        assert shared_memory_files([killed.pid]) == [] and len(shared_memory_files([alive.pid])) == 1
        assert all(path.parent == SHARED_MEMORY_DIR for path in shared_memory_files([alive.pid]))
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
        remove_shared_memory([holder.pid for holder in holders])


def test_only_torch_files_of_the_given_processes(tmp_path):
    for name in ("torch_1_2_3", "torch_12_5_0", "torch_123_9_1", "sem.mp-x", f"torch_{os.getpid()}_1_1"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(p.name for p in shared_memory_files([12, 123], tmp_path)) == ["torch_123_9_1", "torch_12_5_0"]
    assert remove_shared_memory([12], tmp_path) == 1
    assert f"torch_{os.getpid()}_1_1" not in {p.name for p in shared_memory_files(None, tmp_path)}
