"""NuminaMath rule scorer (verl's ``prime_math``, from PRIME): a loosely marked final answer, graded.

verl scores ``numina_aops_forum``, ``numina_synthetic_math``, ``numina_amc_aime``, ``numina_synthetic_amc``,
``numina_cn_k12`` and ``numina_olympiads`` this way. The rules:

- **extraction** (:func:`extract_answer`), each step on what the previous one left: after the last ``answer:``,
  ``answer is`` or ``answers are`` (any case, each marker in turn); before the last ``is answer``,
  ``is the answer``, ``are answers`` or ``are the answers``; the content of the last ``\\boxed{}``/``\\fbox{}``;
  before the last ``". "``; after the last ``be ``, ``is ``, ``are ``, ``=``, ``": "``, ``get `` (or the same
  words before a newline). A step that cuts a text ending in a newline also drops its last two characters.
- **grading** (:func:`megarl.reward.verified_math.grade_answer`): equal after the mathd normalisation, or
  equivalent; verl decides equivalence with its own sympy grader (and pi as 3.14 too), megarl with math-verify.
- **score**: 1.0 for a correct answer, else 0.0.
"""

from __future__ import annotations

from typing import Any

from megarl.reward import verified_math

DATA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                "numina_cn_k12", "numina_olympiads")
"""The ``data_source`` values verl scores with PRIME's math grader."""

_AFTER_MARKERS = ("answer:", "answer is", "answers are")
_BEFORE_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def _drop_trailing_newline(text: str) -> str:
    return text[:-2] if text.endswith("\n") else text


def last_box_content(text: str) -> str | None:
    """The stripped content of the last ``\\boxed``/``\\fbox`` (its first balanced braces), or ``None``."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, opened = 0, None
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
            opened = position if opened is None else opened
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[opened + 1:position].strip() if opened is not None else None
    return None


def extract_answer(response: str) -> str:
    """The final answer of a response under PRIME's marker rules (module docstring)."""
    for marker in _AFTER_MARKERS:
        found = response.lower().rfind(marker)
        if found != -1:
            response = _drop_trailing_newline(response[found + len(marker):].strip())
    for marker in _BEFORE_MARKERS:
        found = response.lower().rfind(marker)
        if found != -1:
            response = _drop_trailing_newline(response[:found].strip())
    boxed = last_box_content(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[:response.rfind(". ")].strip()
    for marker in _LAST_MARKERS:
        found = response.lower().rfind(marker)
        if found != -1:
            response = _drop_trailing_newline(response[found + len(marker):].strip())
    return response


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCES`: ``{"score", "acc", "pred"}``, score 1.0 or 0.0."""
    answer = extract_answer(str(solution_str))
    correct = verified_math.grade_answer(answer, ground_truth)
    return {"score": float(correct), "acc": float(correct), "pred": answer}


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """verl's NuminaMath score as a number."""
    return score_response(solution_str, ground_truth)["score"]
