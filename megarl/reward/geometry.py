"""Geometry3K rule scorer (verl's ``geo3k``): the boxed answer, graded, plus a small reward for the format.

verl scores ``hiyouga/geometry3k`` this way. The rules:

- **format**: the whole response matches ``<think>...</think>...\\boxed{...}...`` (across lines) -> 1, else 0;
- **accuracy**: the stripped content of the last ``\\boxed{`` up to its closing brace (``"None"`` without
  one; with ``use_boxed=False`` the whole response) graded against the reference by
  :func:`megarl.reward.verified_math.grade_answer` (verl uses MathRuler's PRM800K grader: the same
  normalisation, with its own sympy rules where megarl uses math-verify);
- **score**: ``(1 - format_score) * accuracy + format_score * format``, ``format_score`` 0.1: 1.0, 0.9, 0.1 or 0.
"""

from __future__ import annotations

import re
from typing import Any

from megarl.reward import verified_math

DATA_SOURCES = ("hiyouga/geometry3k",)
"""The ``data_source`` values verl scores with the geometry rules."""

FORMAT_SCORE = 0.1
"""verl's weight of the format reward."""

_FORMAT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    """1.0 when the response thinks in ``<think></think>`` and then boxes an answer, else 0.0."""
    return 1.0 if _FORMAT_RE.fullmatch(solution_str) else 0.0


def extract_boxed_content(text: str) -> str:
    """The stripped content of the last ``\\boxed{...}``, or ``"None"`` when there is no closed one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return "None"
    content = text[start + len("\\boxed{"):]
    depth = 0
    for position, char in enumerate(content):
        depth += 1 if char == "{" else -1 if char == "}" else 0
        if depth == -1:
            return content[:position].strip()
    return "None"


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None, *, use_boxed: bool = True,
                   format_score: float = FORMAT_SCORE) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCES`: ``{"score", "acc", "format", "pred"}``."""
    answer = extract_boxed_content(solution_str) if use_boxed else solution_str
    accuracy = float(verified_math.grade_answer(answer, ground_truth))
    formatted = format_reward(solution_str)
    return {"score": (1.0 - format_score) * accuracy + format_score * formatted, "acc": accuracy,
            "format": formatted, "pred": answer}


def compute_score(solution_str: str, ground_truth: Any, use_boxed: bool = True,
                  format_score: float = FORMAT_SCORE) -> float:
    """verl's Geometry3K score as a number."""
    return score_response(solution_str, ground_truth, use_boxed=use_boxed, format_score=format_score)["score"]
