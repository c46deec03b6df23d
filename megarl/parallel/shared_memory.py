"""torch's shared-memory files (``/dev/shm/torch_<pid>_*``) that killed processes leave behind, found and removed.

The ``tensor`` weight transport's bucket buffers are torch shared memory (the ``file_system`` strategy). Ray kills
its workers at the end of a run, so torch never unlinks them, and each file holds its bytes in RAM until the
machine reboots. The driver removes its workers' files at shutdown (on every node:
:func:`megarl.controller.build.Roles.shutdown`), the reaper those of a killed run (:mod:`megarl.parallel.reaper`),
and a run's start those of any process that no longer runs. No torch is imported here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

SHARED_MEMORY_DIR = Path("/dev/shm")
"""Where torch's ``file_system`` strategy creates shared-memory buffers: ``torch_<creator pid>_<...>``."""
_SHARED_FILE = re.compile(r"torch_(\d+)_")


def shared_memory_files(pids: Iterable[int] | None = None, directory: Path | None = None) -> list[Path]:
    """torch's shared-memory files in ``directory`` (:data:`SHARED_MEMORY_DIR`) created by ``pids`` (None: by any
    process that is no longer alive)."""
    directory = SHARED_MEMORY_DIR if directory is None else Path(directory)
    wanted = None if pids is None else {int(pid) for pid in pids}
    found = []
    for path in directory.glob("torch_*") if directory.is_dir() else ():
        match = _SHARED_FILE.match(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if (pid in wanted) if wanted is not None else not _alive(pid):
            found.append(path)
    return found


def remove_shared_memory(pids: Iterable[int] | None = None, directory: Path | None = None) -> int:
    """Unlink the shared-memory files :func:`shared_memory_files` finds: a process killed while it held bucket
    buffers (every Ray worker is killed at the end of a run) never unlinks them, and each holds its bytes in RAM
    until the machine reboots. Mappings still open stay valid. Returns how many were removed."""
    removed = 0
    for path in shared_memory_files(pids, directory):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
