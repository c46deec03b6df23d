"""Reading back what the hosted trackers wrote offline: wandb's ``.wandb`` and swanlab's ``.swanlab`` run files are
LevelDB logs behind a 7-byte header (an ident, a magic number, a version)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
HEADER = 7  # the file's header, and each record's: checksum (4), length (2), type (1)
FULL, LAST = 1, 4


def leveldb_records(path: Path, ident: bytes) -> Iterator[bytes]:
    """The records of ``path`` (a LevelDB log whose file header starts with ``ident``), fragments joined."""
    data = path.read_bytes()
    assert data[:len(ident)] == ident, f"{path} does not start with {ident!r}"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's trailer: padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:  # zeros: nothing more was written
            break
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            yield pending
            pending = b""


def wandb_records(run_file: Path) -> Iterator[tuple[str, object]]:
    """(kind, record) of each record of a wandb offline run's ``run-<id>.wandb``."""
    from wandb.proto import wandb_internal_pb2

    for data in leveldb_records(run_file, b":W&B"):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        yield record.WhichOneof("record_type"), record
