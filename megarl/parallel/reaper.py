"""No process of a run outlives it: a reaper that ends the run's local processes when its driver ends.

A run that starts its own Ray cluster tags its driver's environment with ``MEGARL_RUN_ID=<random>`` before Ray
starts, so every process it starts inherits the tag: Ray's GCS, raylet and agents, the workers, the engine
servers and sglang-router. :func:`start_reaper` then starts a small process (``python -m
megarl.parallel.reaper``, no torch) that holds the read end of a pipe whose write end only the driver holds. The
pipe reaches end of file when the driver closes it (:meth:`Reaper.close`, at the run's shutdown) or when the
driver dies, ``kill -9`` included: the reaper then sends SIGTERM to every process of the run still alive,
SIGKILL to those left after :data:`GRACE_S`, removes the shared-memory buffers they left in ``/dev/shm``
(``torch_<pid>_*``) and exits. The run's processes are those carrying the tag and their descendants (Ray's
agents write their titles over their environments); while the driver lives the reaper refreshes that set every
:data:`TRACK_EVERY_S`, because a killed driver takes Ray's raylet with it and orphans the agents, whose link
to the run is then gone.

Without it, Ray's dashboard and runtime-env agents outlive a killed driver by about a minute, still
listening (measured with Ray 2.60), and the weight sync's shared memory stays until the next run's start. A
cluster started outside the run (``RAY_ADDRESS``, Slurm's ``ray start``) is not the run's: its processes carry
no tag and are left to their owner.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megarl.parallel.shared_memory import remove_shared_memory

RUN_ID_VARIABLE = "MEGARL_RUN_ID"
"""The environment variable that tags a run's processes."""
RENDEZVOUS_PREFIX = "megarl_rendezvous_"
"""A run's rank rendezvous files in the temporary directory: ``<prefix><run id>_<random>`` (removed at shutdown,
and by the reaper when the driver was killed)."""
GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL for the run's processes still alive when the driver has ended."""


class Reaper:
    """The driver's handle on its reaper process (:func:`start_reaper`)."""

    def __init__(self, process: subprocess.Popen, write_fd: int, run_id: str, previous: str | None) -> None:
        self.process, self.run_id, self._write_fd, self._previous = process, run_id, write_fd, previous

    def end_run_processes(self, wait_s: float = 10.0) -> list[int]:
        """The run's orderly end, before :meth:`close`: Ray's agents take a few seconds to exit after
        ``ray.shutdown()``; wait up to ``wait_s`` for every process of the run to end on its own, then end the rest
        as the reaper would (SIGTERM, SIGKILL after :data:`GRACE_S`), quietly. The reaper then finds nothing, and
        its message is left for real leftovers (a killed driver's). Returns what had to be ended, as ``name (pid)``."""
        tracker = _Tracker(self.run_id, {os.getpid(), self.process.pid})
        deadline = time.monotonic() + wait_s
        while tracker.refresh() and time.monotonic() < deadline:
            time.sleep(0.1)
        return reap(tracker)

    def close(self, timeout_s: float = 30.0) -> None:
        """The run has ended: the reaper ends what of it is left and exits (waited for); processes this one starts
        from now on are not tagged."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
            if os.environ.get(RUN_ID_VARIABLE) == self.run_id:
                if self._previous is None:
                    del os.environ[RUN_ID_VARIABLE]
                else:
                    os.environ[RUN_ID_VARIABLE] = self._previous
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_reaper() -> Reaper:
    """Tag this process's environment with a fresh run id (its children from now on inherit it) and start the
    reaper that ends every tagged process once this process closes the reaper or dies."""
    run_id, previous = secrets.token_hex(8), os.environ.get(RUN_ID_VARIABLE)
    os.environ[RUN_ID_VARIABLE] = run_id
    read_fd, write_fd = os.pipe()  # not inheritable (PEP 446): only this process holds the write end
    try:
        process = subprocess.Popen([sys.executable, "-m", "megarl.parallel.reaper", str(read_fd), run_id,
                                    str(os.getpid())],
                                   pass_fds=(read_fd,), stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read_fd)
    return Reaper(process, write_fd, run_id, previous)


ENDED_STATES = ("Z", "X")
"""``/proc/<pid>/stat`` states of a process that has ended: a zombie (``Z``) stays listed until its parent waits for
it, which a container's first process may never do for the orphans it inherits; no signal reaches it."""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid`` from ``/proc/<pid>/stat``; None when it is gone or has
    ended (:data:`ENDED_STATES`)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] in ENDED_STATES:
        return None
    return int(fields[1]), int(fields[19])


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process: listed, and not ended (a zombie has: :data:`ENDED_STATES`)."""
    return _stat(pid) is not None


def describe(pid: int) -> str:
    """``name (pid)`` of a process, its name from ``/proc/<pid>/comm`` (``?`` when it is gone)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        name = "?"
    return f"{name} ({pid})"


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every live process (a zombie has ended: :data:`ENDED_STATES`)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (stat := _stat(int(proc.name))) is not None:
            out[int(proc.name)] = stat
    return out


def tagged_processes(run_id: str, *, exclude: set[int] = frozenset()) -> list[int]:
    """The pids of this user's processes whose environment carries ``MEGARL_RUN_ID=run_id``, and their
    descendants: a process that writes its title over its environment (Ray's agents, through setproctitle)
    no longer shows the tag, but its parent does while it lives."""
    return sorted(_tagged(run_id, exclude, _processes()))


def _tagged(run_id: str, exclude: set[int], processes: dict[int, tuple[int, int]]) -> set[int]:
    entry = f"{RUN_ID_VARIABLE}={run_id}".encode()
    found = set()
    for pid in processes:
        if pid in exclude:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if entry in environ.split(b"\0"):
            found.add(pid)
    while children := {pid for pid, (parent, _) in processes.items()
                       if parent in found and pid not in found and pid not in exclude}:
        found |= children
    return found


class _Tracker:
    """The run's processes as (pid, start time), refreshed while the driver lives: when the driver is killed,
    Ray's raylet dies too and its agents are orphaned (their parent link and, with setproctitle, their tag are
    gone), so the reaper ends what it saw last as well as what it sees then. A pid counts only while its start
    time is the one seen, so a pid reused by another process is never signalled."""

    def __init__(self, run_id: str, exclude: set[int]) -> None:
        self.run_id, self.exclude = run_id, exclude
        self.known: dict[int, int] = {}

    def refresh(self) -> list[int]:
        """Forget what ended, add what is tagged now; the pids of the run's live processes."""
        processes = _processes()
        self.known = {pid: start for pid, start in self.known.items()
                      if pid in processes and processes[pid][1] == start}
        for pid in _tagged(self.run_id, self.exclude, processes):
            self.known[pid] = processes[pid][1]
        return sorted(self.known)


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def reap(tracker: _Tracker) -> list[str]:
    """End every process of the run (SIGTERM, then SIGKILL after :data:`GRACE_S`) and remove their shared memory;
    what it found, as ``name (pid)``."""
    pids = tracker.refresh()
    if not pids:
        return []
    names = [describe(pid) for pid in pids]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and tracker.refresh():
        time.sleep(0.1)
    _signal_all(tracker.refresh(), signal.SIGKILL)
    remove_shared_memory(pids)
    for leftover in Path(tempfile.gettempdir()).glob(f"{RENDEZVOUS_PREFIX}{tracker.run_id}_*"):
        leftover.unlink(missing_ok=True)  # the ranks' rendezvous files (megarl.workers.group)
    return names


TRACK_EVERY_S = 1.0
"""How often the reaper refreshes its view of the run's processes while the driver lives."""


def main(argv: list[str]) -> int:
    read_fd, run_id, driver = int(argv[0]), argv[1], int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the driver; the reaper waits for its end
    tracker = _Tracker(run_id, {os.getpid(), driver})
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:
            readable, _, _ = select.select([pipe], [], [], TRACK_EVERY_S)
            if readable and not pipe.read(4096):
                break  # end of file: the driver closed the pipe or ended
            if not readable:
                tracker.refresh()
    ended = reap(tracker)
    if ended:
        print(f"megarl reaper: ended {len(ended)} process(es) the run left behind: {', '.join(ended)}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
