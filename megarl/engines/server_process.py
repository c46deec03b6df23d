"""Server processes megarl owns (engine servers, sglang-router): start, wait until healthy, stop.

A :class:`ServerProcess` starts its command in a new process group with ``PR_SET_PDEATHSIG``
(SIGKILL), so the server dies with the process that started it even when that process is
killed without a chance to clean up; :meth:`ServerProcess.stop` ends the whole group (SGLang's
servers fork schedulers and detokenizers). Output goes to a log file that errors name.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from megarl.parallel.net import free_port  # noqa: F401 - re-exported: servers and tests pick ports here

PR_SET_PDEATHSIG = 1


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time; the message names it, its URL and its log."""


def _die_with_parent() -> None:
    """In the child before exec: a new process group, and SIGKILL when the parent thread dies."""
    os.setpgrp()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def log_tail(path: Path, num_lines: int = 20) -> str:
    """The last lines of a log file ('' when it does not exist)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


class ServerProcess:
    """One server process: ``argv`` run with ``env`` added, answering ``health_path`` at ``url`` when ready."""

    def __init__(self, argv: Sequence[str], *, name: str, url: str, log_path: str | os.PathLike,
                 env: Mapping[str, str] | None = None, inherit_env: bool = True, health_path: str = "/health",
                 ready: Callable[[bytes], bool] | None = None, health_headers: Mapping[str, str] | None = None
                 ) -> None:
        self.argv, self.name, self.url = list(argv), name, url.rstrip("/")
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.inherit_env = inherit_env
        """Start from this process's environment (``env`` added); False: ``env`` is the whole environment."""
        self.health_path = health_path
        self.ready = ready
        """What the ``health_path`` answer's body must say besides its 200 (None: the 200 is enough)."""
        self.health_headers = dict(health_headers or {})
        """Headers of the ``health_path`` request (a keyed route's ``Authorization``)."""
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        """None while running (or never started), else the exit code (a negative signal number when killed)."""
        return None if self._proc is None else self._proc.poll()

    def start(self) -> "ServerProcess":
        """Start the process (output to ``log_path``); returns self."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it open
        try:
            env = {**os.environ, **self.env} if self.inherit_env else self.env
            self._proc = subprocess.Popen(self.argv, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=_die_with_parent)
        finally:
            log.close()
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``health_path`` until it answers 200 (and a body :attr:`ready` accepts); :class:`ServerStartError` if
        the process exits or
        ``timeout_s`` passes (naming the server, its URL and its log, with the log's last lines)."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self._proc.poll() if self._proc is not None else None
            if code is not None:
                raise ServerStartError(f"{self.name} ({self.url}) exited with code {code} before it was healthy; "
                                       f"its log {self.log_path} ends:\n{log_tail(self.log_path)}")
            try:
                probe = urllib.request.Request(self.url + self.health_path, headers=self.health_headers)
                with urllib.request.urlopen(probe, timeout=2) as reply:
                    if reply.status == 200 and (self.ready is None or self.ready(reply.read())):
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} ({self.url}) was not healthy within {timeout_s:g} s; stopped "
                                       f"it; its log {self.log_path} ends:\n{log_tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``; idempotent."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            _signal_group(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self._proc.pid, signal.SIGKILL)  # children of the server, if any are left
        if self._proc.poll() is None:
            self._proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL the process group now, without waiting (a process about to end itself)."""
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)

    def __repr__(self) -> str:
        return f"ServerProcess({self.name} at {self.url}, pid {self.pid})"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
