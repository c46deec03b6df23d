"""Math answers checked with ``math-verify`` (Hugging Face's Math-Verify), and the answer grader built on it.

``math-verify`` is an optional dependency (``pip install 'megarl[math]'``; the test extra installs it); it is
imported on the first check, and a missing package is named with the extra that installs it.

- :func:`verify_answer` is verl's ``math_verify.compute_score``: the reference is read as LaTeX inside
  ``\\boxed{}``, the response as a plain expression or LaTeX (anywhere in it); 1.0 when one parsed prediction
  is equivalent to the parsed reference (6 decimals), else 0.0; a reference that does not parse scores 0.0, a
  check past its time limit ``timeout_score``. verl offers it for MATH in place of the string rules: a custom
  reward function ``megarl.reward.verified_math:compute_score`` (any ``data_source``) does that here.
- :func:`grade_answer` grades an extracted answer the way verl's ``prime_math`` and geometry scorers do (PRM800K's
  grader): equal after :func:`mathd_normalize`, or else equivalent (but an integer or a
  fraction of integers only as itself).
  verl decides equivalence with its own
  sympy rules; here math-verify decides it (both read LaTeX into sympy), so rare answers may grade differently.

Math-verify bounds its parsing and checking with ``SIGALRM`` (5 s), which only the main thread may set; on
another thread (``reward_model.timeout_s`` runs scorers on one) the checks run without it and the reward
manager's own time limit bounds them.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

from megarl.reward import hendrycks_math

MATH_EXTRA = "math"
"""The ``pyproject.toml`` extra that installs ``math-verify``."""

TIME_LIMIT_S = 5
"""Math-verify's own limit per parse and per check, on the main thread."""

_ENCLOSING_TEXT_RE = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_FRACTION_RE = re.compile(r"-?\\frac\{-?[0-9]+\}\{[0-9]+\}")


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(f"this reward scorer checks math answers with the math-verify package, which is not "
                          f"installed: pip install 'megarl[{MATH_EXTRA}]' (or pip install math-verify)") from error
    return math_verify


def _time_limit() -> int | None:
    return TIME_LIMIT_S if threading.current_thread() is threading.main_thread() else None


def verify_answer(model_output: str, ground_truth: Any, timeout_score: float = 0.0) -> float:
    """verl's math-verify score of a whole response: 1.0 or 0.0 (``timeout_score`` past the time limit)."""
    math_verify = _math_verify()
    from math_verify.errors import TimeoutException

    seconds = _time_limit()
    try:
        gold = math_verify.parse("\\boxed{" + str(ground_truth) + "}", [math_verify.LatexExtractionConfig()],
                                 parsing_timeout=seconds)
        if not gold:
            return 0.0
        predicted = math_verify.parse(model_output, [math_verify.ExprExtractionConfig(),
                                                     math_verify.LatexExtractionConfig()], parsing_timeout=seconds)
        return float(bool(math_verify.verify(gold, predicted, float_rounding=6, timeout_seconds=seconds)))
    except TimeoutException:
        return float(timeout_score)
    except Exception:  # noqa: BLE001 - an answer math-verify cannot read is not a correct one
        return 0.0


def equivalent(answer: str, reference: str) -> bool:
    """Whether math-verify finds the extracted ``answer`` equivalent to ``reference`` (both read as LaTeX)."""
    return verify_answer("\\boxed{" + answer + "}", reference) == 1.0


def mathd_normalize(answer: str) -> str:
    """PRM800K's "mathd" form: stripped, an enclosing ``\\text{}`` removed, then the MATH normal form
    (:func:`megarl.reward.hendrycks_math.strip_string`; the unwrapped text when it has none)."""
    answer = answer.strip()
    enclosed = _ENCLOSING_TEXT_RE.search(answer)
    if enclosed is not None:
        answer = enclosed["text"].strip()
    try:
        return hendrycks_math.strip_string(answer)
    except hendrycks_math.Unnormalisable:
        return answer


def _integer_value(text: str) -> float | None:
    """The value of a number that is an integer (``12``, ``1,000``, ``12.0``, ``12.``), else ``None``."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and abs(value - round(value)) <= 1e-7 else None


def grade_answer(answer: str | None, reference: Any) -> bool:
    """An extracted answer against the reference (PRM800K's rules, math-verify for equivalence).

    Correct when the mathd forms are equal; otherwise an integer reference takes only an integer answer of the
    same value (no ``\\frac{60}{2}`` for ``30``), a fraction of integers only the same fraction (no
    ``\\frac{2}{4}`` for ``\\frac{1}{2}``), and any other reference an answer math-verify finds equivalent.
    """
    if answer is None:
        return False
    reference = str(reference)
    given, expected = mathd_normalize(answer), mathd_normalize(reference)
    if given == expected:
        return True
    given_integer, expected_integer = _integer_value(given), _integer_value(expected)
    if given_integer is not None or expected_integer is not None:
        return given_integer is not None and given_integer == expected_integer
    if _FRACTION_RE.fullmatch(given) and _FRACTION_RE.fullmatch(expected):
        return False
    return bool(answer.strip()) and equivalent(answer, reference)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  timeout_score: float = 0.0) -> dict[str, Any]:
    """A custom reward function (verl's signature) scoring every row with :func:`verify_answer`."""
    value = verify_answer(solution_str, ground_truth, timeout_score)
    return {"score": value, "acc": float(value == 1.0)}
