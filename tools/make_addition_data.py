"""Synthetic 2-digit addition prompts for the tiny CPU recipe, in megarl's parquet schema.

Each row asks for ``a + b`` with ``a, b`` in 10..99; the format (question, expected answer,
scoring) is defined in :mod:`megarl.reward.addition`. Rows:

- ``data_source``: ``"addition"``; ``ability``: ``"arithmetic"``;
- ``prompt``: ``[{"role": "user", "content": "What is 37 + 45?"}]``;
- ``reward_model``: ``{"style": "rule", "ground_truth": "82"}``;
- ``extra_info``: ``{"split", "index", "question", "answer", "operands": [a, b]}``.

Train and test problems are distinct pairs ``(a, b)`` drawn without replacement from the
8100 possible ones with a seeded generator, so the same seed and sizes give the same files.

Usage::

    python tools/make_addition_data.py --out data/addition --num-train 2000 --num-test 200 --seed 0
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.reward.addition import DATA_SOURCE, MAX_OPERAND, MIN_OPERAND, format_answer, format_question

logger = logging.getLogger("make_addition_data")

NUM_PAIRS = (MAX_OPERAND - MIN_OPERAND + 1) ** 2
"""Distinct problems available (8100)."""


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
        raise ValueError(f"need --num-train >= 1 and --num-test >= 0, got {num_train} and {num_test}")
    if num_train + num_test > NUM_PAIRS:
        raise ValueError(f"--num-train + --num-test = {num_train + num_test} exceeds the {NUM_PAIRS} distinct "
                         f"2-digit additions; ask for fewer rows")
    span = MAX_OPERAND - MIN_OPERAND + 1
    drawn = random.Random(seed).sample(range(NUM_PAIRS), num_train + num_test)
    pairs = [(MIN_OPERAND + k // span, MIN_OPERAND + k % span) for k in drawn]
    return {"train": [make_row(a, b, "train", i) for i, (a, b) in enumerate(pairs[:num_train])],
            "test": [make_row(a, b, "test", i) for i, (a, b) in enumerate(pairs[num_train:])]}


def write_addition_data(out_dir: str | Path, *, num_train: int = 2000, num_test: int = 200,
                        seed: int = 0) -> dict[str, Path]:
    """Write ``<out_dir>/train.parquet`` and ``<out_dir>/test.parquet`` (test only if ``num_test``)."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in make_addition_rows(num_train, num_test, seed).items():
        if not rows:
            continue
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
        logger.info("%s: %d addition problems written to %s", split, len(rows), paths[split])
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command line: write the train/test parquet files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder for train.parquet / test.parquet")
    parser.add_argument("--num-train", type=int, default=2000, help="train problems")
    parser.add_argument("--num-test", type=int, default=200, help="test problems (0: no test file)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problem draw")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_addition_data(args.out, num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
