"""A worker's SIGTERM (how a shutdown's kill reaches it) ends the process at once and quietly: Ray's handler raised
``SystemExit`` wherever the process was, and one landing in ``Popen.__del__`` of an engine's owner printed a
traceback into a failed run's one-screen report. An engine's owner takes its server with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

SCRIPT = r"""
import os, signal, sys
from megarl.engines.server_process import ServerProcess
from megarl.workers.engine_server import EngineServerWorker

worker = EngineServerWorker.__new__(EngineServerWorker)
worker.server = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"], name="engine 0",
                              url="http://127.0.0.1:1", log_path=sys.argv[1]).start()
worker._quiet_sigterm()
print(worker.server.pid, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("still running", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_an_engine_owner_and_its_server_without_a_word(tmp_path):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "engine.log")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = int(run.stdout.split()[0])
    assert run.returncode == 143 and "still running" not in run.stdout
    assert run.stderr == ""
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:  # SIGKILL delivered; the kernel reaps it
        time.sleep(0.05)
    assert not _alive(server)
