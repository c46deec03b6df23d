"""Write synthetic 2-digit addition prompts for the tiny CPU recipe (train.parquet, test.parquet).

The rows and their schema are defined in :mod:`megarl.warmstart.addition_data`; this is its command line.

Usage::

    python tools/make_addition_data.py --out data/addition --num-train 2000 --num-test 200 --seed 0
"""

from __future__ import annotations

import argparse
import logging
import sys

from megarl.warmstart.addition_data import NUM_PAIRS, make_addition_rows, make_row, write_addition_data

__all__ = ["NUM_PAIRS", "main", "make_addition_rows", "make_row", "write_addition_data"]


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
