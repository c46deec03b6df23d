"""Checkpoint directories on the controller side: atomic commits, the ``latest`` pointer, retention.

Layout under the checkpoint root (``trainer.default_local_dir/<project>/<experiment>``)::

    global_step_<k>/
        actor/  critic/         role checkpoints (megarl.workers.model_checkpoint.save_model)
        actor_hf/               optional HF export (megarl.workers.model_checkpoint.export_hf)
        rollout_buffer/         asynchronous runs: the groups generated ahead (megarl.rollout.buffer.save_state)
        trainer_state.json      step, data position, KL coefficient, ... (the trainer's dict)
        manifest.json           every other file: relative path, size, SHA-256 (see below)
    latest_checkpointed_iteration.txt   the step of the newest committed checkpoint (verl's name)

A save goes ``begin(k)`` → workers write into the temporary directory it returns →
``commit(k, tmp, trainer_state)``. ``commit`` writes ``trainer_state.json`` and then
``manifest.json`` into the temporary directory, renames it to ``global_step_<k>`` and only then replaces the pointer
(write a temporary file, ``os.replace``). A crash at any point before the rename leaves
a ``.tmp_global_step_*`` directory that nothing points to; the previous checkpoint stays
the latest. ``clean_stale`` removes such debris at start-up. The temporary directory sits
under the root, so workers on other machines need the root on a shared file system.

The manifest catches what the rename cannot: a file truncated, lost or altered after the
commit (a full disk on a copy, a partial ``rsync``, bit rot). ``commit`` records every file's
size and SHA-256 (of the whole file up to 64 MiB; of 8 evenly spaced 1 MiB blocks, first and
last included, above that, plus the size) and writes the manifest durably before the
rename. :func:`verify_checkpoint` checks sizes (a ``stat`` per file) and, when asked,
contents. :meth:`CheckpointManager.steps` and :func:`is_complete` check sizes;
:meth:`CheckpointManager.latest` and :func:`resolve_resume` check contents too, so
``resume_mode=auto`` skips a damaged checkpoint with a warning that names the file and
the earlier checkpoint used instead, and ``resume_path`` refuses it naming the file.
Checkpoints written before the manifest existed have none: they count as complete when
their trainer state reads (unverified; the model loader names a truncated shard itself).

Cost (measured on 2 CPU cores): the tiny recipe's checkpoint (11 files, 11 MB) takes 15-30 ms
to hash at commit and about 15 ms to verify at resume (sizes alone: 0.1 ms).
Hashing every byte runs at about 1.2 GB/s on one core, which for a 70B model with its
optimizer (about 1 TB) would be some 15 minutes per save and per resume, reading everything
back from a shared file system; hence the sampled hash above 64 MiB: at most 8 MiB read per
file, with sizes catching truncation exactly and the blocks catching rewritten headers,
tails and stretches of zeros. Files are hashed on a few threads (hashlib releases the GIL).

A run owns its root: :class:`RunLock` holds an exclusive ``flock`` on ``<root>/.run.lock`` for
the run's life (the kernel drops it when the process ends, however it ends), and the trainer
takes it before anything else touches the directory. A second run into the same root refuses
at once, naming the holder's PID and host, so ``clean_stale`` never removes a live run's save.

:func:`role_checkpoint` turns what a user names (a run root, a step, a role directory) into a role's
directory (``megarl-convert mcore-to-hf --mcore``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megarl.errors import FieldsError

POINTER_NAME = "latest_checkpointed_iteration.txt"
TRAINER_STATE_NAME = "trainer_state.json"
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp_" + STEP_PREFIX
OLD_PREFIX = ".old_" + STEP_PREFIX
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
LOCK_NAME = ".run.lock"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "megarl-checkpoint-manifest"
FULL_HASH_BYTES = 64 * 2**20
"""Files up to this size are hashed whole; larger ones by :data:`SAMPLE_BLOCKS` blocks."""
SAMPLE_BLOCK_BYTES = 2**20
SAMPLE_BLOCKS = 8
_HASH_THREADS = 4


class CheckpointSaveError(FieldsError, RuntimeError):
    """A checkpoint could not be written (:meth:`CheckpointManager.save_failed`); nothing committed is lost."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
        """The step whose checkpoint failed."""


def _directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file() and not path.is_symlink())


def _out_of_space(error: BaseException, free: int, total: int) -> bool:
    """True when ``error`` (or one it was raised from) is ENOSPC, names it (a worker's error reaches the driver as
    text), or the device was all but full when the save failed (torch's checkpoint errors can lose the errno)."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return "No space left on device" in str(error) or free < min(64 * 2**20, total // 100)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            dangling = next((p for p in [self.root, *self.root.parents] if p.is_symlink() and not p.exists()), None)
            if dangling is None:
                raise
            raise FileNotFoundError(f"checkpoint directory {self.root}: {dangling} is a symbolic link to "
                                    f"{os.readlink(dangling)}, which does not exist; create it, or choose another "
                                    f"trainer.default_local_dir") from None
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


def _file_digest(path: Path, size: int, full_bytes: int, block_bytes: int, blocks: int) -> str:
    """SHA-256 of the whole file up to ``full_bytes``; above, of ``blocks`` evenly spaced blocks and the size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= full_bytes:
            while chunk := f.read(4 * 2**20):
                digest.update(chunk)
        else:
            digest.update(f"sampled {size} {block_bytes} {blocks}".encode())
            last = size - block_bytes
            for k in range(blocks):
                f.seek(last * k // (blocks - 1))
                digest.update(f.read(block_bytes))
    return digest.hexdigest()


def _digests(root: Path, sizes: dict[str, int], scheme: dict) -> dict[str, str]:
    args = (scheme["full_hash_bytes"], scheme["sample_block_bytes"], scheme["sample_blocks"])
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, max(1, len(sizes)))) as pool:
        futures = {rel: pool.submit(_file_digest, root / rel, size, *args) for rel, size in sizes.items()}
        return {rel: future.result() for rel, future in futures.items()}


def build_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of every file under ``directory`` (but a manifest itself): size and SHA-256 by relative path."""
    directory = Path(directory)
    sizes = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.relative_to(directory).as_posix() != MANIFEST_NAME:
            sizes[path.relative_to(directory).as_posix()] = path.stat().st_size
    scheme = {"hash": "sha256", "full_hash_bytes": FULL_HASH_BYTES, "sample_block_bytes": SAMPLE_BLOCK_BYTES,
              "sample_blocks": SAMPLE_BLOCKS}
    digests = _digests(directory, sizes, scheme)
    return {"format": MANIFEST_FORMAT, "version": 1, **scheme,
            "files": {rel: {"size": size, "sha256": digests[rel]} for rel, size in sizes.items()}}


def _trainer_state_problem(path: Path) -> str | None:
    state = path / TRAINER_STATE_NAME
    if not state.is_file():
        return f"it has no {TRAINER_STATE_NAME} (its save was interrupted)"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as error:
        return f"its {TRAINER_STATE_NAME} is unreadable ({error})"
    return None


def verify_checkpoint(path: str | os.PathLike, *, content: bool = True) -> str | None:
    """What is wrong with the committed checkpoint ``path``, or None when it verifies.

    Checks that the trainer state reads and that every file the manifest lists exists with
    its recorded size and, with ``content``, its recorded hash. The answer names the file,
    relative to ``path``. A checkpoint without a manifest (written before manifests existed)
    verifies when its trainer state reads.
    """
    path = Path(path)
    if not path.is_dir():
        return "it is not a directory" if path.exists() else "it does not exist"
    problem = _trainer_state_problem(path)
    if problem is not None:
        return problem
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.exists():
        return None  # written before manifests: unverified, but complete
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("hash") != "sha256":
            raise ValueError(f"format {manifest.get('format')!r}, hash {manifest.get('hash')!r}")
        if not all(isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in files.values()):
            raise ValueError("an entry lacks its size or hash")
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"its {MANIFEST_NAME} is unreadable ({error})"
    sizes = {}
    for rel, entry in sorted(files.items()):
        file = path / rel
        if not file.is_file():
            return f"file {rel} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            how = "truncated" if size < entry["size"] else "grown"
            return f"file {rel} has {size} bytes where the manifest records {entry['size']} ({how})"
        sizes[rel] = size
    if content:
        digests = _digests(path, sizes, manifest)
        for rel in sizes:
            if digests[rel] != files[rel]["sha256"]:
                return f"file {rel} does not hold what was saved (its SHA-256 differs from the manifest's)"
    return None


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a committed checkpoint: a directory with a readable trainer state whose files all
    have the sizes its manifest records (no content hashing: see :func:`verify_checkpoint`)."""
    return verify_checkpoint(path, content=False) is None


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
        The manifest of every file in ``tmp`` is written next to it. An existing checkpoint of
        the same step is replaced.
        """
        tmp = Path(tmp)
        if not tmp.is_dir():
            raise ValueError(f"commit: {tmp} is not a directory (was it returned by begin()?)")
        text = json.dumps({"step": step, **trainer_state}, indent=2, sort_keys=True) + "\n"
        _write_file_durably(tmp / TRAINER_STATE_NAME, text)
        manifest = build_manifest(tmp)
        _write_file_durably(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
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

    def save_failed(self, step: int, tmp: str | os.PathLike, error: BaseException) -> CheckpointSaveError:
        """The error to raise when writing the checkpoint of ``step`` into ``tmp`` failed with ``error``: the partial
        save is removed (a resume never sees it, and its space is given back) and the message says why it failed,
        what is intact and what to do; out of space, it says so with the device's free and total bytes."""
        tmp = Path(tmp)
        partial = _directory_bytes(tmp) if tmp.is_dir() else 0
        usage = shutil.disk_usage(self.root)
        shutil.rmtree(tmp, ignore_errors=True)
        latest = self.steps()
        intact = (f"the checkpoint of step {latest[-1]} ({self.path(latest[-1])}) is intact" if latest
                  else "no earlier checkpoint exists")
        if _out_of_space(error, usage.free, usage.total):
            return CheckpointSaveError(
                f"checkpoint of step {step} not saved: no space left on the device of {self.root} ({_size(usage.free)} "
                f"free of {_size(usage.total)} when it failed; the partial save, {_size(partial)}, is removed). "
                f"Nothing committed is lost: {intact}. Free space there, keep fewer checkpoints "
                f"(trainer.max_actor_ckpt_to_keep) or point trainer.default_local_dir at a larger disk, then resume "
                f"(trainer.resume_mode=auto)", step)
        return CheckpointSaveError(f"checkpoint of step {step} not saved ({intact}; the partial save is removed): "
                                   f"{type(error).__name__}: {error}", step)

    def check_space(self, step: int) -> None:
        """Refuse to start the checkpoint of ``step`` when the device of the root has less free space than the
        last committed checkpoint of this run takes (a save of the same run is about as large)."""
        latest = self.steps()
        if not latest:
            return
        needed = _directory_bytes(self.path(latest[-1]))
        free = shutil.disk_usage(self.root).free
        if free < needed:
            raise CheckpointSaveError(
                f"checkpoint of step {step} not started: the device of {self.root} has {_size(free)} free and the "
                f"last checkpoint (step {latest[-1]}) takes {_size(needed)}. Nothing is lost. Free space there, keep "
                f"fewer checkpoints (trainer.max_actor_ckpt_to_keep) or point trainer.default_local_dir at a larger "
                f"disk, then resume (trainer.resume_mode=auto)", step)

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
        """The checkpoint ``latest`` points to, or (with a warning) the newest one that verifies; None if none.

        The pointed checkpoint is verified in full (sizes and contents, :func:`verify_checkpoint`).
        When it is missing, incomplete or damaged, the warning names it, what is wrong (the file)
        and the checkpoint used instead, checking the others newest first.
        """
        pointed = None
        if self.pointer.exists():
            text = self.pointer.read_text().strip()
            if text.isdigit():
                pointed = self.path(int(text))
                problem = verify_checkpoint(pointed)
                if problem is None:
                    return pointed
        if pointed is None and not self.pointer.exists() and not any(
                (self.path(step) / TRAINER_STATE_NAME).exists() for step in self._step_dirs()):
            return None  # nothing was ever committed here
        if pointed is not None:
            what = ("missing or incomplete" if not pointed.is_dir() or _trainer_state_problem(pointed)
                    else "damaged")
            problems = [f"{self.pointer} points to {pointed.name}, which is {what}: {problem}"]
        else:
            problems = [f"{self.pointer} is missing or unreadable"]
        fallback = None
        for step in sorted(self._step_dirs(), reverse=True):
            candidate = self.path(step)
            if candidate == pointed:
                continue
            problem = verify_checkpoint(candidate)
            if problem is None:
                fallback = candidate
                break
            if (candidate / MANIFEST_NAME).exists():  # committed, then damaged: worth saying
                problems.append(f"checkpoint {candidate.name} is damaged: {problem}")
        using = (f"using {fallback} instead, the newest checkpoint that verifies" if fallback is not None
                 else "using no checkpoint instead (none verifies): the run starts from scratch")
        warnings.warn(f"{'; '.join(problems)}; {using}", stacklevel=2)
        return fallback

    def _step_dirs(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return [int(m.group(1)) for e in self.root.iterdir() if (m := _STEP_DIR.match(e.name)) and e.is_dir()]

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
    try:
        return json.loads(state.read_text())
    except ValueError as error:
        raise ValueError(f"{state} of checkpoint {path} is unreadable ({error}); resume from another "
                         "checkpoint") from error


def resolve_resume(root: str | os.PathLike, mode: str, path: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint to resume from (verl's ``trainer.resume_mode``), or None to start fresh.

    ``auto``: the latest checkpoint under ``root`` that verifies, if any (a damaged newer one is
    skipped with a warning naming it, its file and the checkpoint used instead); ``disable``:
    None; ``resume_path``: ``path``, which must be a committed ``global_step_<k>`` directory that
    verifies (a ``ValueError`` names the file otherwise).
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
    if _trainer_state_problem(path) is not None:
        raise ValueError(f"trainer.resume_from_path={path} is incomplete (no readable {TRAINER_STATE_NAME}): "
                         "its save was interrupted; pick another checkpoint")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"trainer.resume_from_path={path} is damaged: {problem}; pick another checkpoint under "
                         f"{path.parent} (or resume_mode=auto, which takes the newest that verifies)")
    return path


def role_checkpoint(path: str | os.PathLike, role: str = "actor") -> Path:
    """The ``role`` checkpoint directory ``path`` names (``megarl-convert mcore-to-hf --mcore``).

    A step directory (``global_step_<k>``, or any directory with a ``trainer_state.json``): its ``<role>/``, once the
    step verifies (:func:`verify_checkpoint`). A run's checkpoint root (``latest_checkpointed_iteration.txt`` or
    ``global_step_<k>`` directories in it): the latest committed checkpoint's ``<role>/``, as
    :meth:`CheckpointManager.latest` picks it (a damaged one is skipped with a warning naming it). Any other path is
    returned as it is. A ``ValueError`` starts with ``path`` and says what is wrong.
    """
    path = Path(path)
    if _STEP_DIR.match(path.name) or (path / TRAINER_STATE_NAME).is_file():
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"{path} is not a whole checkpoint: {problem}; pick another {STEP_PREFIX}<k>, or "
                             "the run's checkpoint root for its latest")
        step = path
    elif (path / POINTER_NAME).exists() or (path.is_dir() and any(_STEP_DIR.match(p.name) for p in path.iterdir())):
        step = CheckpointManager(path).latest()
        if step is None:
            raise ValueError(f"{path} holds no committed checkpoint that verifies")
    else:
        return path
    if not (step / role).is_dir():
        raise ValueError(f"{path} has no {role} checkpoint ({step / role} is missing)")
    return step / role
