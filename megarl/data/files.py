"""Prompt data files by suffix: ``.parquet``, ``.json`` and ``.jsonl``, read into Arrow tables.

Parquet is read with pyarrow as it always was. JSON is parsed with Python's ``json`` module, either
layout in either suffix: a top-level list of row objects, or one row object a line (JSON lines,
slime's ``.jsonl``); the rows become a table with the type inference that writing the same Python
rows to parquet uses (``pyarrow.array`` per column), so a JSON file and the parquet of the same rows
give the same table. Not ``datasets.load_dataset("json")``: datasets 5 stores a struct whose keys
differ between rows (``extra_info`` with ``tools_kwargs`` on some rows only) as a JSON-string
column, where parquet keeps a struct; and not pyarrow's JSON reader, which reads JSON lines only.

Columns are the union of all rows' keys in first-seen order (a key missing from a row is null).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

DATA_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
"""Data file suffix -> format."""


def data_format(path: str | os.PathLike) -> str:
    """``"parquet"`` or ``"json"`` by the file's suffix, else ``ValueError`` naming the file."""
    suffix = Path(path).suffix.lower()
    if suffix not in DATA_FORMATS:
        raise ValueError(f"{path}: prompt data files are .parquet, .json or .jsonl (by suffix); got "
                         f"{suffix or 'no suffix'!r}")
    return DATA_FORMATS[suffix]


def read_table(path: str | os.PathLike) -> Any:
    """The file's rows as a ``pyarrow.Table``; ``ValueError`` naming the file for bad JSON."""
    # pyarrow is imported here: megarl.config imports the data set module, and a GPU check without data
    # runs where pyarrow is not installed (tools/gpu_check.py, docs/gpu.md).
    if data_format(path) == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    return _json_table(path)


def read_columns(path: str | os.PathLike) -> list[str]:
    """The file's column names (parquet: from its schema alone; JSON: the whole file is parsed)."""
    if data_format(path) == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return list(_json_table(path).column_names)


def _json_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from error
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number}: not a JSON object ({error}); JSON data files hold a "
                                 f"list of row objects or one row object a line") from error
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path} row {number}: a row must be a JSON object {{column: value}}, got "
                             f"{type(row).__name__}")
    return rows


def _json_table(path: str | os.PathLike) -> Any:
    import pyarrow as pa

    rows = _json_rows(path)
    names = list(dict.fromkeys(key for row in rows for key in row))
    columns = {}
    for name in names:
        try:
            columns[name] = pa.array([row.get(name) for row in rows])
        except (pa.ArrowException, TypeError, ValueError) as error:
            raise ValueError(f"{path}: column {name!r} has values of different types across rows "
                             f"({error})") from error
    return pa.table(columns) if columns else pa.table({})


def write_rows(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write ``rows`` (one dict of columns each) as the file's suffix says: parquet, a JSON list (``.json``) or one
    JSON object a line (``.jsonl``); written next to the file and then renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if data_format(path) == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    elif path.suffix.lower() == ".json":
        tmp.write_text(json.dumps(rows, ensure_ascii=False, default=_bytes_as_uri), encoding="utf-8")
    else:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False, default=_bytes_as_uri) + "\n" for row in rows),
                       encoding="utf-8")
    tmp.replace(path)


def _bytes_as_uri(value: Any) -> str:
    """JSON for a value it has no type for: bytes (an image column's encoded images) as a base64 data URI, which
    megarl's image loader (and SGLang's) reads back."""
    if isinstance(value, (bytes, bytearray)):
        return "data:image;base64," + base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"a row holds a {type(value).__name__}, which JSON cannot hold; write .parquet instead")
