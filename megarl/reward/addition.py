"""The 2-digit addition task of the tiny CPU recipe: its prompt format and its scorer.

Format (shared by ``tools/make_addition_data.py``, the tiny model's warm-up SFT and this
scorer, so it is defined only here):

- operands ``a`` and ``b`` are integers from 10 to 99;
- the prompt is one user message, ``"What is {a} + {b}?"`` (:func:`format_question`), with no
  system message; the chat template adds the generation prompt;
- the expected response is the sum in decimal digits, nothing else (:func:`format_answer`,
  e.g. ``"82"``); ``reward_model.ground_truth`` holds the same string;
- scoring: the last integer in the decoded response (``-?[0-9]+``) is the prediction;
  1.0 when it equals the ground truth, 0.0 otherwise (also when there is no integer).
  So ``"37 + 45 = 82"`` scores 1.0 and ``"82 is not 37 + 45"`` scores 0.0.
"""

from __future__ import annotations

import re
from typing import Any

DATA_SOURCE = "addition"
"""``data_source`` of addition rows."""

MIN_OPERAND = 10
"""Smallest operand (inclusive)."""
MAX_OPERAND = 99
"""Largest operand (inclusive)."""

_INTEGER_RE = re.compile(r"-?[0-9]+")


def format_question(a: int, b: int) -> str:
    """The user message asking for ``a + b``."""
    return f"What is {a} + {b}?"


def format_answer(a: int, b: int) -> str:
    """The expected response (and ground truth) for ``a + b``."""
    return str(a + b)


def extract_answer(solution_str: str) -> int | None:
    """The last integer in the response, or ``None`` when it has none."""
    matches = _INTEGER_RE.findall(solution_str)
    return int(matches[-1]) if matches else None


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCE`: ``{"score", "acc", "pred"}``.

    ``score`` and ``acc`` are 1.0 for an exact match of the final integer, else 0.0; ``pred``
    is that integer as text, ``""`` when the response has none. ``extra_info`` is not used.
    """
    return score_last_integer(solution_str, ground_truth, task="addition", rebuild="tools/make_addition_data.py")


def score_last_integer(solution_str: str, ground_truth: Any, *, task: str, rebuild: str) -> dict[str, Any]:
    """``{"score", "acc", "pred"}``: 1.0 when the response's last integer is the (integer) ground truth of ``task``;
    ``rebuild`` says how to remake data whose ground truth is not an integer."""
    try:
        reference = int(str(ground_truth).strip())
    except ValueError as err:
        raise ValueError(f"{task} ground truth {ground_truth!r} is not an integer; rebuild the data with "
                         f"{rebuild}") from err
    prediction = extract_answer(solution_str)
    correct = float(prediction is not None and prediction == reference)
    return {"score": correct, "acc": correct, "pred": "" if prediction is None else str(prediction)}
