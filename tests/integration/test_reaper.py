"""The reaper (megarl.parallel.reaper): a run's tagged processes end with the run, and only they."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from megarl.parallel.reaper import RUN_ID_VARIABLE, _Tracker, start_reaper, tagged_processes


def test_closing_the_reaper_ends_the_runs_processes_and_spares_the_driver_and_others():
    before = os.environ.get(RUN_ID_VARIABLE)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # started before: untagged
    reaper = start_reaper()
    run_id = reaper.run_id
    try:
        child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                                 stdout=subprocess.PIPE, text=True)  # inherits the tag
        # /proc/<pid>/environ shows the forking parent's initial environment until the child has exec'd.
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in tagged_processes(run_id)
        assert other.pid not in tagged_processes(run_id)
        reaper.close()
        assert child.wait(timeout=30) != 0  # ended by the reaper (SIGTERM)
        assert reaper.process.returncode == 0
        assert other.poll() is None  # not the run's
        assert os.environ.get(RUN_ID_VARIABLE) == before  # later children are not tagged
    finally:
        other.kill()
        other.wait()
        reaper.close()


def test_the_reaper_ends_the_runs_processes_when_the_driver_dies():
    """A driver killed with SIGKILL cannot clean up: its reaper sees the pipe close and ends the rest."""
    driver = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from megarl.parallel.reaper import start_reaper\n"
        "reaper = start_reaper()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; print(1, flush=True); time.sleep(600)'],\n"
        "                         stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"  # exec'd: its /proc environ is its own
        "print(reaper.run_id, reaper.process.pid, child.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        run_id, reaper_pid, child_pid = driver.stdout.readline().split()
        assert int(child_pid) in tagged_processes(run_id)
        driver.kill()
        driver.wait()
        # The reaper and the child are not this process's children: poll /proc until they are gone.
        deadline = time.monotonic() + 30
        while (tagged_processes(run_id) or os.path.exists(f"/proc/{reaper_pid}")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tagged_processes(run_id) == []
        assert not os.path.exists(f"/proc/{reaper_pid}")
    finally:
        driver.kill()


def test_a_zombie_has_ended_for_the_orderly_end_and_the_reaper():
    """A process of the run that has exited but that nobody waited for yet (a zombie: a container's first process
    may never wait for the orphans it inherits) is still listed in /proc, and no signal reaches it. It has ended:
    the orderly end returns at once, and the reaper has nothing to report."""
    reaper = start_reaper()
    run_id = reaper.run_id
    try:
        child = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in tagged_processes(run_id)
        tracker = _Tracker(run_id, {os.getpid(), reaper.process.pid})  # as the reaper's own, seen while it lived
        assert child.pid in tracker.refresh()
        child.stdin.close()  # it exits; this process does not wait for it yet
        state = ""
        deadline = time.monotonic() + 60
        while state != "Z" and time.monotonic() < deadline:
            stat = open(f"/proc/{child.pid}/stat").read()
            state = stat[stat.rindex(")") + 2:].split()[0]
            time.sleep(0.05)
        assert state == "Z"
        assert child.pid not in tagged_processes(run_id)
        assert child.pid not in tracker.refresh()
        start = time.monotonic()
        assert reaper.end_run_processes(wait_s=600) == []
        assert time.monotonic() - start < 300  # it did not wait out its limit for a process that had ended
        reaper.close()
        assert reaper.process.returncode == 0
        assert child.wait(timeout=30) == 0  # exited on its own
    finally:
        reaper.close()
