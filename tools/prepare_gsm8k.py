"""Turn GSM8K files, as published, into megarl's parquet prompt schema (verl's columns).

Input: local files with one record per problem holding ``question`` and ``answer`` (the
answer's last line is ``#### <number>``): the Hugging Face parquet files
(``main/train-00000-of-00001.parquet``) or the original JSON-lines files (``train.jsonl``).
Nothing is downloaded.

Output: ``<out>/train.parquet`` and ``<out>/test.parquet`` with rows

- ``data_source``: ``"openai/gsm8k"``; ``ability``: ``"math"``;
- ``prompt``: ``[user: question + INSTRUCTION]`` (variant ``plain``), or
  ``[system: TOOL_SYSTEM_PROMPT, user: question + INSTRUCTION]`` (variant ``tool``);
- ``reward_model``: ``{"style": "rule", "ground_truth": "<number>"}`` (commas removed);
- ``extra_info``: ``{"split", "index", "answer", "question"}`` (raw texts; ``index`` is the
  record's 0-based position in its file), and for ``tool`` also ``need_tools_kwargs: True``,
  ``tools_kwargs: {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": ...}}}`` and
  ``interaction_kwargs: {"query": question, "ground_truth": ...}``.

Malformed records (unreadable JSON, a missing or empty ``question``/``answer``, an answer
without ``#### <number>``) are skipped, counted and reported with their index.

Usage::

    python tools/prepare_gsm8k.py --train gsm8k/train.jsonl --test gsm8k/test.jsonl \\
        --out ~/data/gsm8k --variant tool
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.reward.gsm8k import DATA_SOURCE, extract_ground_truth

logger = logging.getLogger("prepare_gsm8k")

VARIANTS = ("plain", "tool")
"""``plain``: single-turn prompts; ``tool``: multi-turn prompts for the ``calc_gsm8k_reward`` tool."""

TOOL_NAME = "calc_gsm8k_reward"
"""The GSM8K tool the multi-turn variant asks the model to call (verl's GSM8K tool)."""

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""Appended (after a space) to every question, in both variants."""

TOOL_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reason step by step before any tool call. "
    f"You should use the `{TOOL_NAME}` tool after solving the question step by step, "
    "before giving the final answer, at least once, and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)
"""System message of the ``tool`` variant (as verl's GSM8K multi-turn recipe words it)."""

Record = dict[str, Any] | str
"""One input record: the parsed dict, or (a ``str``) why it could not be read."""


@dataclasses.dataclass(frozen=True)
class SkippedRow:
    """A malformed input record that was not written."""

    split: str
    index: int
    """0-based record position in its file (JSON lines: non-blank lines)."""
    reason: str


@dataclasses.dataclass
class SplitReport:
    """What happened to one split."""

    split: str
    source: str
    output: str
    num_read: int
    num_written: int
    skipped: list[SkippedRow]

    def summary(self) -> str:
        """One line, plus one line per skipped record."""
        lines = [f"{self.split}: {self.num_written} of {self.num_read} records from {self.source} written to "
                 f"{self.output}; {len(self.skipped)} skipped"]
        lines += [f"  skipped {s.split} index {s.index}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def read_records(path: str | Path) -> list[Record]:
    """The records of a GSM8K file: ``.parquet`` or JSON lines (``.jsonl`` / ``.json``)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file {str(path)!r} does not exist; pass a local .parquet or .jsonl file")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unknown GSM8K file type {path.suffix!r}; use .parquet or .jsonl")
    records: list[Record] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                records.append(f"line {line_number} is not valid JSON ({err.msg})")
    return records


def make_row(question: str, answer: str, ground_truth: str, split: str, index: int, variant: str) -> dict[str, Any]:
    """One output row of ``variant`` (see the module docstring)."""
    user_text = f"{question} {INSTRUCTION}"
    extra_info: dict[str, Any] = {"split": split, "index": index, "answer": answer, "question": question}
    if variant == "plain":
        prompt = [{"role": "user", "content": user_text}]
    elif variant == "tool":
        prompt = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, {"role": "user", "content": user_text}]
        extra_info.update(
            need_tools_kwargs=True,
            tools_kwargs={TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}},
            interaction_kwargs={"query": question, "ground_truth": ground_truth},
        )
    else:
        raise ValueError(f"GSM8K variant {variant!r} is unknown; use one of {VARIANTS} (--variant)")
    return {"data_source": DATA_SOURCE, "prompt": prompt, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": extra_info}


def _problem(record: Record) -> tuple[str, str, str] | str:
    """``(question, answer, ground_truth)`` of a record, or why it is malformed."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    for field in ("question", "answer"):
        value = record.get(field)
        if value is None or (isinstance(value, str) and not value.strip()):
            return f"missing or empty {field!r}"
        if not isinstance(value, str):
            return f"{field!r} is a {type(value).__name__}, not text"
    ground_truth = extract_ground_truth(record["answer"])
    if ground_truth is None:
        return "the answer has no '#### <number>'"
    return record["question"].strip(), record["answer"], ground_truth


def convert_records(records: list[Record], split: str, variant: str) -> tuple[list[dict[str, Any]], list[SkippedRow]]:
    """Rows for the well-formed records and the skipped ones, in input order."""
    if variant not in VARIANTS:
        raise ValueError(f"GSM8K variant {variant!r} is unknown; use one of {VARIANTS} (--variant)")
    rows, skipped = [], []
    for index, record in enumerate(records):
        problem = _problem(record)
        if isinstance(problem, str):
            skipped.append(SkippedRow(split, index, problem))
        else:
            rows.append(make_row(*problem, split=split, index=index, variant=variant))
    return rows, skipped


def convert_file(source: str | Path, output: str | Path, split: str, variant: str) -> SplitReport:
    """Convert one GSM8K file to one parquet file; ``ValueError`` if no record is usable."""
    records = read_records(source)
    rows, skipped = convert_records(records, split, variant)
    if not rows:
        first = "; ".join(f"index {s.index}: {s.reason}" for s in skipped[:5])
        raise ValueError(f"{source}: no usable GSM8K record among {len(records)} ({first}); expected fields "
                         f"'question' and 'answer' with '#### <number>'")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output)
    report = SplitReport(split, str(source), str(output), len(records), len(rows), skipped)
    logger.log(logging.WARNING if skipped else logging.INFO, "%s", report.summary())
    return report


def prepare_gsm8k(out_dir: str | Path, *, train: str | Path | None = None, test: str | Path | None = None,
                  variant: str = "plain") -> dict[str, SplitReport]:
    """Write ``<out_dir>/train.parquet`` and/or ``<out_dir>/test.parquet``; a report per split."""
    sources = {split: path for split, path in (("train", train), ("test", test)) if path is not None}
    if not sources:
        raise ValueError("prepare_gsm8k needs at least one input file: --train and/or --test")
    out = Path(out_dir).expanduser()
    return {split: convert_file(path, out / f"{split}.parquet", split, variant) for split, path in sources.items()}


def main(argv: list[str] | None = None) -> int:
    """Command line: convert the given GSM8K files; logs one report per split."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", help="local GSM8K train file (.parquet or .jsonl)")
    parser.add_argument("--test", help="local GSM8K test file (.parquet or .jsonl)")
    parser.add_argument("--out", required=True, help="output folder for train.parquet / test.parquet")
    parser.add_argument("--variant", choices=VARIANTS, default="plain",
                        help="plain single-turn prompts, or the multi-turn calc_gsm8k_reward tool variant")
    args = parser.parse_args(argv)
    if args.train is None and args.test is None:
        parser.error("give --train and/or --test")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prepare_gsm8k(args.out, train=args.train, test=args.test, variant=args.variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
