"""GSM8K rule scorer: the model's answer after ``####`` against the reference number.

GSM8K solutions end with ``#### <number>``; the prompts built by ``tools/prepare_gsm8k.py``
ask the model to do the same. Two ways to read the model's answer:

- ``strict``: only the last 300 characters count (a long ramble that never commits does
  not score), and the answer is the last ``#### <number>`` there. This also checks format.
- ``flexible``: the last number anywhere in the text, with or without ``####``.

Numbers are normalised before comparison: ``,`` and ``$`` are removed and a trailing ``.``
(end of sentence) is dropped. A prediction equals the ground truth when the strings match or
both parse as the same decimal (``72.0`` equals ``72``). verl compares raw strings and keeps
the trailing period in flexible mode; the normalisation here only turns such false
negatives into matches.

Scores (as in verl's ``gsm8k.compute_score``): no answer found -> 0; correct -> ``score``;
an answer that is wrong -> ``format_score`` (partial credit for answering in format).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

DATA_SOURCE = "openai/gsm8k"
"""``data_source`` of GSM8K rows (both the plain and the multi-turn tool variant)."""

METHODS = ("strict", "flexible")
"""Answer-extraction methods understood by :func:`extract_solution`."""

SOLUTION_CLIP_CHARS = 300
"""Strict extraction only looks at this many characters at the end of the response."""

_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")
_GROUND_TRUTH_RE = re.compile(r"####\s*(\-?[0-9\.\,\$]+)")


def normalize_number(text: str) -> str | None:
    """``text`` without ``,``/``$`` and a trailing ``.``; ``None`` when no digit is left.

    >>> normalize_number("1,234.")
    '1234'
    """
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    return cleaned if any(ch.isdigit() for ch in cleaned) else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The normalised answer in a model response, or ``None`` when there is none.

    ``strict``: the last ``#### <number>`` within the last :data:`SOLUTION_CLIP_CHARS`
    characters. ``flexible``: the last number anywhere (pure punctuation such as ``.``
    does not count).
    """
    if method == "strict":
        matches = _STRICT_RE.findall(solution_str[-SOLUTION_CLIP_CHARS:])
        return normalize_number(matches[-1]) if matches else None
    if method == "flexible":
        for candidate in reversed(_NUMBER_RE.findall(solution_str)):
            answer = normalize_number(candidate)
            if answer is not None:
                return answer
        return None
    raise ValueError(f"GSM8K answer extraction method {method!r} is unknown; use one of {METHODS} "
                     f"(scorer setting `method`)")


def extract_ground_truth(answer_text: str) -> str | None:
    """The reference number of a published GSM8K ``answer`` (text after the last ``####``).

    Commas and ``$`` are removed (``#### 1,600`` -> ``1600``); ``None`` when the text has no
    ``#### <number>``.
    """
    matches = _GROUND_TRUTH_RE.findall(answer_text)
    return normalize_number(matches[-1]) if matches else None


def answers_match(prediction: str, ground_truth: Any) -> bool:
    """Whether a normalised prediction equals the ground truth (as text or as a decimal)."""
    reference = normalize_number(str(ground_truth))
    if reference is None:
        return False
    if prediction == reference:
        return True
    try:
        return Decimal(prediction) == Decimal(reference)
    except InvalidOperation:
        return False


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """verl's GSM8K score: 0 without an answer, ``score`` when right, else ``format_score``."""
    prediction = extract_solution(solution_str, method=method)
    if prediction is None:
        return 0.0
    return float(score) if answers_match(prediction, ground_truth) else float(format_score)


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None, *, method: str = "strict",
                   format_score: float = 0.0, score: float = 1.0) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCE`: ``{"score", "acc", "pred"}``.

    ``acc`` is 1.0 only for a correct answer (whatever ``format_score`` is); ``pred`` is the
    extracted answer or ``""`` when none was found. ``extra_info`` is not used.
    """
    prediction = extract_solution(solution_str, method=method)
    correct = prediction is not None and answers_match(prediction, ground_truth)
    value = 0.0 if prediction is None else (float(score) if correct else float(format_score))
    return {"score": value, "acc": float(correct), "pred": prediction or ""}
