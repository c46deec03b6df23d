"""Synthetic 2-digit addition prompts for the tiny CPU recipe, in megarl's parquet row schema.

Each row asks for ``a + b`` with ``a, b`` in 10..99; the format (question, expected answer,
scoring) is defined in :mod:`megarl.reward.addition`. Rows:

- ``data_source``: ``"addition"``; ``ability``: ``"arithmetic"``;
- ``prompt``: ``[{"role": "user", "content": "What is 37 + 45?"}]``;
- ``reward_model``: ``{"style": "rule", "ground_truth": "82"}``;
- ``extra_info``: ``{"split", "index", "question", "answer", "operands": [a, b]}``.

Train and test problems are distinct pairs ``(a, b)`` drawn without replacement from the
8100 possible ones with a seeded generator, so the same seed and sizes give the same files.
``tools/make_addition_data.py`` is the command line over :func:`write_addition_data`;
:func:`ensure_addition_data` is what a run calls to create the files it needs once.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.reward.addition import DATA_SOURCE, MAX_OPERAND, MIN_OPERAND, format_answer, format_question

logger = logging.getLogger(__name__)

NUM_PAIRS = (MAX_OPERAND - MIN_OPERAND + 1) ** 2
"""Distinct problems available (8100)."""


ADDITION_DATA_DIR = "data/addition"
"""Where the tiny recipe's data lives (relative to the run's directory): ``data.train_files`` / ``val_files``."""
ADDITION_DATA_FILES = ("train.parquet", "test.parquet")
"""The files :func:`ensure_addition_data` writes there."""


def make_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """The parquet row asking for ``a + b``."""
    question = format_question(a, b)
    answer = format_answer(a, b)
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": question}], "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "question": question, "answer": answer,
                           "operands": [a, b]}}


def make_addition_rows(num_train: int, num_test: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "test": rows}`` of distinct problems, drawn with ``random.Random(seed)``."""
    if num_train < 1 or num_test < 0:
        raise ValueError(f"need --num-train >= 1 and --num-test >= 0 (num_train, num_test), got {num_train} "
                         f"and {num_test}")
    if num_train + num_test > NUM_PAIRS:
        raise ValueError(f"--num-train + --num-test = {num_train + num_test} exceeds the {NUM_PAIRS} distinct "
                         f"2-digit additions; ask for fewer rows")
    span = MAX_OPERAND - MIN_OPERAND + 1
    drawn = random.Random(seed).sample(range(NUM_PAIRS), num_train + num_test)
    pairs = [(MIN_OPERAND + k // span, MIN_OPERAND + k % span) for k in drawn]
    return {"train": [make_row(a, b, "train", i) for i, (a, b) in enumerate(pairs[:num_train])],
            "test": [make_row(a, b, "test", i) for i, (a, b) in enumerate(pairs[num_train:])]}


def _write_table_atomically(rows: list[dict[str, Any]], path: Path) -> None:
    """Write ``rows`` to a temporary file next to ``path`` and rename it into place.

    A reader (or a second writer) sees either no file or a complete one, never a partial one.
    """
    descriptor, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        pq.write_table(pa.Table.from_pylist(rows), temp_name)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def write_addition_data(out_dir: str | os.PathLike, *, num_train: int = 2000, num_test: int = 200,
                        seed: int = 0) -> dict[str, Path]:
    """Write ``<out_dir>/train.parquet`` and ``<out_dir>/test.parquet`` (test only if ``num_test``).

    Existing files are overwritten (each atomically). Returns ``{split: path}``.
    """
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in make_addition_rows(num_train, num_test, seed).items():
        if not rows:
            continue
        paths[split] = out / f"{split}.parquet"
        _write_table_atomically(rows, paths[split])
        logger.info("%s: %d addition problems written to %s", split, len(rows), paths[split])
    return paths


def ensure_addition_data(directory: str | os.PathLike, *, num_train: int = 2000, num_test: int = 200,
                         seed: int = 0) -> tuple[Path, Path]:
    """``(train_path, test_path)`` in ``directory``, writing whichever file is missing.

    Files that exist are used as they are (a run may bring its own); when one holds a different
    number of rows than asked for, a warning says so. New files are written atomically
    (temporary file + ``os.replace``), so concurrent callers never read a partial file, and
    the same arguments always give the same rows.
    """
    if num_test < 1:
        raise ValueError(f"ensure_addition_data needs num_test >= 1 (it returns a test file), got {num_test}")
    out = Path(directory).expanduser()
    paths = {"train": out / ADDITION_DATA_FILES[0], "test": out / ADDITION_DATA_FILES[1]}
    wanted = {"train": num_train, "test": num_test}
    missing = [split for split, path in paths.items() if not path.exists()]
    if missing:
        out.mkdir(parents=True, exist_ok=True)
        rows = make_addition_rows(num_train, num_test, seed)
        for split in missing:
            _write_table_atomically(rows[split], paths[split])
            logger.info("%s: %d addition problems written to %s", split, len(rows[split]), paths[split])
    for split, path in paths.items():
        if split in missing:
            continue
        num_rows = pq.ParquetFile(path).metadata.num_rows
        if num_rows != wanted[split]:
            logger.warning("%s already exists with %d rows, not the %d asked for; using it as it is (delete it "
                           "to regenerate)", path, num_rows, wanted[split])
    return paths["train"], paths["test"]
