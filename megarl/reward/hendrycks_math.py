"""MATH (Hendrycks et al.) rule scorer: the last ``\\boxed{}`` answer, string-normalised, against the reference.

verl scores ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval`` and ``HuggingFaceH4/MATH-500`` this way
(its ``math_reward.compute_score``, after lm-evaluation-harness's ``hendrycks_math``). The rules:

- **extraction**: when the response holds ``"\\boxed "`` (a space), the answer is the text after the last
  ``"\\boxed "`` up to the next ``$``; otherwise the last ``\\boxed{...}`` (balanced braces). A last box that is
  an ``\\fbox{}`` or is never closed gives no answer.
- **equivalence** (:func:`is_equiv`): both sides pass :func:`strip_string` and must then be equal strings; when
  either side cannot be normalised (a ``\\sqrt`` or ``\\frac`` at the very end, two ``"\\text{ "`` units) the
  raw strings are compared instead.
- **score**: 1.0 for an equivalent answer, else 0.0 (no answer included).

A ground truth that is not a string is compared as ``str(ground_truth)`` (verl compares it raw, never equal).
"""

from __future__ import annotations

import re
from typing import Any

DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
"""The ``data_source`` values verl scores with the MATH rules."""

_CANONICAL_FRACTION = re.compile(r"(0|-?[1-9][0-9]*)/(0|-?[1-9][0-9]*)")


class Unnormalisable(ValueError):
    """An answer :func:`strip_string` cannot normalise (``is_equiv`` then compares the raw strings)."""


def last_boxed(text: str) -> str | None:
    """The last boxed expression of ``text``, box command included (``"\\boxed{x}"``), or ``None``."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start:position + 1]
    return None


def unbox(boxed: str) -> str | None:
    """The content of ``"\\boxed x"`` or ``"\\boxed{x}"``; ``None`` for any other form (``\\fbox{}`` included)."""
    if "\\boxed " in boxed:
        return boxed[len("\\boxed "):] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def _fix_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; braced fractions stay."""
    head, *pieces = text.split("\\frac")
    rebuilt = [head]
    for piece in pieces:
        if not piece:
            raise Unnormalisable("\\frac at the end")
        if piece[0] == "{":
            rebuilt.append("\\frac" + piece)
            continue
        if len(piece) < 2:
            return text
        numerator, second, rest = piece[0], piece[1], piece[2:]
        if second != "{":
            rebuilt.append("\\frac{" + numerator + "}{" + second + "}" + rest)
        else:
            rebuilt.append("\\frac{" + numerator + "}" + second + rest)
    return "".join(rebuilt)


def _fix_a_slash_b(text: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` for two integers written canonically; anything else stays."""
    match = _CANONICAL_FRACTION.fullmatch(text)
    return "\\frac{" + match[1] + "}{" + match[2] + "}" if match else text


def _remove_right_units(text: str) -> str:
    """Drop a unit written as ``"\\text{ unit}"`` on the right."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise Unnormalisable("more than one unit")
    return parts[0]


def _fix_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character)."""
    head, *pieces = text.split("\\sqrt")
    rebuilt = [head]
    for piece in pieces:
        if not piece:
            raise Unnormalisable("\\sqrt at the end")
        rebuilt.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(rebuilt)


def strip_string(text: str) -> str:
    """The MATH normal form of an answer (``Unnormalisable`` when it has none).

    In order: drop newlines and ``\\!``; ``\\\\`` -> ``\\``; ``tfrac``/``dfrac`` -> ``frac``; drop ``\\left``,
    ``\\right``, degree marks, ``\\$``, a right unit and percent signs; ``" ."``/``"{."`` get a leading 0 (and so does
    a leading ``.``); ``k = v`` with a left side of at most 2 characters keeps ``v``; ``\\sqrt3`` -> ``\\sqrt{3}``;
    drop spaces; unbraced ``\\frac`` arguments get braces; ``0.5`` -> ``\\frac{1}{2}``; ``a/b`` -> ``\\frac{a}{b}``.
    """
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    text = _remove_right_units(text)
    text = text.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _fix_fracs(_fix_sqrt(text).replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_a_slash_b(text)


def is_equiv(answer: str | None, reference: str | None) -> bool:
    """Whether two answers have the same :func:`strip_string` form (raw equality when one has none)."""
    if answer is None or reference is None:
        return answer is None and reference is None
    try:
        return strip_string(answer) == strip_string(reference)
    except Unnormalisable:
        return answer == reference


def extract_answer(solution_str: str) -> str | None:
    """The answer in the last box of a response, or ``None``."""
    boxed = last_boxed(solution_str)
    return None if boxed is None else unbox(boxed)


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """verl's MATH score: 1.0 when the last boxed answer is equivalent to ``ground_truth``, else 0.0."""
    answer = extract_answer(solution_str)
    return float(answer is not None and is_equiv(answer, str(ground_truth)))


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCES`: ``{"score", "acc", "pred"}`` (``pred`` ``""`` without a box)."""
    answer = extract_answer(solution_str)
    correct = answer is not None and is_equiv(answer, str(ground_truth))
    return {"score": float(correct), "acc": float(correct), "pred": answer or ""}
