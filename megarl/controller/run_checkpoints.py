"""Checkpoint directories on the controller side: atomic commits, the ``latest`` pointer, retention.

Layout under the checkpoint root (``trainer.default_local_dir/<project>/<experiment>``)::

    global_step_<k>/
        actor/  critic/         role checkpoints (megarl.workers.model_checkpoint.save_model)
        actor_hf/               optional HF export (megarl.workers.model_checkpoint.export_hf)
        trainer_state.json      step, data position, KL coefficient, ... (the trainer's dict)
    latest_checkpointed_iteration.txt   the step of the newest committed checkpoint (verl's name)

A save goes ``begin(k)`` → workers write into the temporary directory it returns →
``commit(k, tmp, trainer_state)``. ``commit`` writes ``trainer_state.json`` into the
temporary directory, renames it to ``global_step_<k>`` and only then replaces the pointer
(write a temporary file, ``os.replace``). A crash at any point before the rename leaves
a ``.tmp_global_step_*`` directory that nothing points to; the previous checkpoint stays
the latest. ``clean_stale`` removes such debris at start-up. The temporary directory sits
under the root, so workers on other machines need the root on a shared file system.

A run owns its root: :class:`RunLock` holds an exclusive ``flock`` on ``<root>/.run.lock`` for
the run's life (the kernel drops it when the process ends, however it ends), and the trainer
takes it before anything else touches the directory. A second run into the same root refuses
at once, naming the holder's PID and host, so ``clean_stale`` never removes a live run's save.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
import warnings
from pathlib import Path

POINTER_NAME = "latest_checkpointed_iteration.txt"
TRAINER_STATE_NAME = "trainer_state.json"
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp_" + STEP_PREFIX
OLD_PREFIX = ".old_" + STEP_PREFIX
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
LOCK_NAME = ".run.lock"


class RunDirectoryInUse(RuntimeError):
    """Another live run holds the checkpoint directory's lock."""


class RunLock:
    """An exclusive lock on a run's checkpoint root, held from :meth:`acquire` to :meth:`release` (or exit).

    The lock file records the holder (PID, host, start time) for the refusal message; the lock
    itself is the open file's ``flock``, so a killed run leaves no stale lock behind.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`RunDirectoryInUse` naming the directory and the holder."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirectoryInUse(
                f"checkpoint directory {self.root} is in use by another run ({holder}); give this run its own "
                f"trainer.experiment_name or trainer.default_local_dir, or stop that run first") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def step_dir_name(step: int) -> str:
    """``global_step_<step>``."""
    return f"{STEP_PREFIX}{step}"


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a committed checkpoint: a directory with a readable trainer state."""
    state = Path(path) / TRAINER_STATE_NAME
    if not state.is_file():
        return False
    try:
        json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    """Commits, finds and prunes the ``global_step_<k>`` checkpoints under ``root``.

    ``max_to_keep`` (``trainer.max_actor_ckpt_to_keep``): committed checkpoints kept, the
    newest by step; None keeps all.
    """

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int | None = None):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_actor_ckpt_to_keep must be >= 1 or null, got {max_to_keep}")
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    @property
    def pointer(self) -> Path:
        """The ``latest_checkpointed_iteration.txt`` file."""
        return self.root / POINTER_NAME

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives once committed."""
        return self.root / step_dir_name(step)

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of ``step``; workers write into it."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{step}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def commit(self, step: int, tmp: str | os.PathLike, trainer_state: dict) -> Path:
        """Make ``tmp`` the checkpoint of ``step`` and point ``latest`` at it; then apply retention.

        ``trainer_state`` must be JSON-serialisable (it is written as ``trainer_state.json``).
        An existing checkpoint of the same step is replaced.
        """
        tmp = Path(tmp)
        if not tmp.is_dir():
            raise ValueError(f"commit: {tmp} is not a directory (was it returned by begin()?)")
        text = json.dumps({"step": step, **trainer_state}, indent=2, sort_keys=True) + "\n"
        _write_file_durably(tmp / TRAINER_STATE_NAME, text)
        _fsync_dir(tmp)
        final = self.path(step)
        old = None
        if final.exists():  # re-saving a step (e.g. after resuming from an earlier one)
            old = self.root / f"{OLD_PREFIX}{step}_{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._write_pointer(step)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._prune(step)
        return final

    def _write_pointer(self, step: int) -> None:
        tmp = self.root / f".{POINTER_NAME}.{os.getpid()}"
        _write_file_durably(tmp, f"{step}\n")
        os.replace(tmp, self.pointer)
        _fsync_dir(self.root)

    def steps(self) -> list[int]:
        """Steps of the committed (complete) checkpoints, ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir() and is_complete(entry):
                found.append(int(match.group(1)))
        return sorted(found)

    def _prune(self, committed: int) -> None:
        """Keep the newest ``max_to_keep`` checkpoints up to ``committed``; later ones are left alone."""
        if self.max_to_keep is None:
            return
        steps = self.steps()
        newer = [s for s in steps if s > committed]
        if newer:
            warnings.warn(f"{self.root} holds checkpoints of later steps {newer} than the one just committed "
                          f"({committed}), left from an earlier run; they are not pruned", stacklevel=3)
        earlier = [s for s in steps if s <= committed]
        for step in earlier[: max(0, len(earlier) - self.max_to_keep)]:
            shutil.rmtree(self.path(step))

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points to, or (with a warning) the newest complete one; None if none."""
        pointed = None
        if self.pointer.exists():
            text = self.pointer.read_text().strip()
            if text.isdigit():
                pointed = self.path(int(text))
                if is_complete(pointed):
                    return pointed
        steps = self.steps()
        if pointed is None and not self.pointer.exists() and not steps:
            return None
        fallback = self.path(steps[-1]) if steps else None
        problem = (f"points to {pointed.name}, which is missing or incomplete" if pointed is not None
                   else "is missing or unreadable")
        warnings.warn(f"{self.pointer} {problem}; using {fallback or 'no checkpoint'} instead", stacklevel=2)
        return fallback

    def clean_stale(self) -> list[Path]:
        """Remove temporary directories left by interrupted saves; returns what was removed.

        Call it only while holding the root's :class:`RunLock`: then no live run owns that debris.
        """
        if not self.root.is_dir():
            return []
        removed = []
        for entry in self.root.iterdir():
            if entry.name.startswith((TMP_PREFIX, OLD_PREFIX, f".{POINTER_NAME}.")):
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry)
        return sorted(removed)


def load_trainer_state(path: str | os.PathLike) -> dict:
    """The ``trainer_state.json`` of a committed checkpoint directory."""
    state = Path(path) / TRAINER_STATE_NAME
    if not state.is_file():
        raise ValueError(f"{path} is not a complete checkpoint: it has no {TRAINER_STATE_NAME}")
    return json.loads(state.read_text())


def resolve_resume(root: str | os.PathLike, mode: str, path: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint to resume from (verl's ``trainer.resume_mode``), or None to start fresh.

    ``auto``: the latest checkpoint under ``root`` if any; ``disable``: None;
    ``resume_path``: ``path``, which must be a committed ``global_step_<k>`` directory.
    """
    if mode == "disable":
        return None
    if mode == "auto":
        return CheckpointManager(root).latest()
    if mode != "resume_path":
        raise ValueError(f"trainer.resume_mode must be auto, disable or resume_path, got {mode!r}")
    if not path:
        raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    path = Path(path)
    if not _STEP_DIR.match(path.name):
        raise ValueError(f"trainer.resume_from_path={path} must be a {STEP_PREFIX}<k> checkpoint directory")
    if not path.is_dir():
        raise ValueError(f"trainer.resume_from_path={path} does not exist")
    if not is_complete(path):
        raise ValueError(f"trainer.resume_from_path={path} is incomplete (no readable {TRAINER_STATE_NAME}): "
                         "its save was interrupted; pick another checkpoint")
    return path
