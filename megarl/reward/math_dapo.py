"""DAPO math rule scorer: the last ``Answer: ...`` line, Minerva-normalised, against the reference.

verl scores ``math_dapo``, ``math``, ``math_dapo_reasoning`` and every ``data_source`` starting with ``aime``
this way (its ``math_dapo.compute_score``, the DAPO recipe's reward). The rules:

- only the last 300 characters of the response count;
- **default (Minerva)**: the answer is the text after the last ``Answer:`` (any case, spaces around the colon)
  up to the end of its line, ``"[INVALID]"`` when there is none; answer and reference both pass
  :func:`normalize_final_answer` and must then be equal strings;
- **strict box** (``strict_box_verify=True``): the content of the last ``\\boxed{}`` within the last 100
  characters (or from 100 before the last pause token, with ``pause_tokens_index``) must equal the reference
  exactly;
- **score**: ``{"score": 1.0 or -1.0, "acc": 1.0 or 0.0, "pred": the normalised answer}`` (verl's ``acc`` is a
  bool; ``pred`` is ``""`` here where verl's would be ``None``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

DATA_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
"""The ``data_source`` values verl scores with the DAPO math rules."""

DATA_SOURCE_PREFIXES = ("aime",)
"""verl also scores every ``data_source`` that starts with one of these (``aime2024``, ``aime_2025`` ...)."""

SOLUTION_CLIP_CHARS = 300
"""Only this many characters at the end of a response are read."""

STRICT_BOX_CHARS = 100
"""Strict box verification reads this many characters at the end (or before the last pause token)."""

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
"""The Minerva answer line."""

SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
"""Replacements made in order, after keeping the text right of the last ``=``."""

REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots")
"""Units, words and spacing removed (in order) after the substitutions."""

_TEX_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep the first $...$ only
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
)


def normalize_final_answer(answer: str) -> str:
    """The Minerva normal form of a final answer.

    Keep the text after the last ``=``; apply :data:`SUBSTITUTIONS` then remove :data:`REMOVED_EXPRESSIONS`; keep
    the first ``$...$``; unwrap ``\\text{}``, ``\\textbf{}``, ``\\overline{}`` and ``\\boxed{}``; brace shorthand
    ``\\frac`` and ``\\sqrt`` arguments; drop ``$``; drop commas from a number that is otherwise all digits; strip.
    """
    answer = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        answer = answer.replace(expression, "")
    for pattern, replacement in _TEX_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_content(text: str) -> str | None:
    """The content of the last balanced ``\\boxed{...}`` in ``text``, or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{"):position]
    return None


def verify(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
           pause_tokens_index: Sequence[int] | None = None) -> tuple[bool, str | None]:
    """``(correct, prediction)`` under the Minerva rule, or the strict box rule when ``strict_box_verify``."""
    if strict_box_verify:
        if pause_tokens_index is not None:
            if len(pause_tokens_index) != 4:
                raise ValueError(f"pause_tokens_index must hold 4 positions, got {len(pause_tokens_index)}")
            tail = solution_str[pause_tokens_index[-1] - STRICT_BOX_CHARS:]
        else:
            tail = solution_str[-STRICT_BOX_CHARS:]
        prediction = last_boxed_content(tail)
        return prediction == ground_truth, prediction
    matches = re.findall(ANSWER_PATTERN, solution_str)
    prediction = normalize_final_answer(matches[-1] if matches else "[INVALID]")
    return prediction == normalize_final_answer(ground_truth), prediction


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None, *,
                   strict_box_verify: bool = False, pause_tokens_index: Sequence[int] | None = None) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCES` and :data:`DATA_SOURCE_PREFIXES`: ``{"score", "acc", "pred"}``."""
    correct, prediction = verify(solution_str[-SOLUTION_CLIP_CHARS:], str(ground_truth), strict_box_verify,
                                 pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": prediction or ""}


compute_score = score_response
"""verl's name for the scorer."""
