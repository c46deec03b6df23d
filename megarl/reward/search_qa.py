"""Search-R1 question answering scorer: exact match of the last ``<answer>...</answer>`` against the targets.

verl scores ``searchR1_nq``, ``searchR1_triviaqa``, ``searchR1_popqa``, ``searchR1_hotpotqa``,
``searchR1_2wikimultihopqa``, ``searchR1_musique`` and ``searchR1_bamboogle`` this way (its
``search_r1_like_qa_em.compute_score``, from Search-R1). The rules:

- **extraction**: the stripped text of the last ``<answer>...</answer>`` (across lines); none -> score 0;
- **normalisation** (SQuAD's): lower case, drop ASCII punctuation, drop the words ``a``/``an``/``the``, collapse
  whitespace;
- **match**: the normalised answer equals one normalised target (``ground_truth["target"]``, one string or a
  list of them); ``subem=True`` accepts a target contained in the answer instead;
- **score**: ``score`` (1.0) for a match, divided by 4 when the response holds more than 10 ``<answer>`` or
  more than 10 ``</answer>`` tags (exact match only); ``format_score`` (0.0) for an answer that does not match.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

DATA_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
"""The ``data_source`` values verl scores by exact match."""

MAX_ANSWER_TAGS = 10
"""More ``<answer>`` (or ``</answer>``) tags than this quarter an exact match's score."""

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def extract_answer(solution_str: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>``, or ``None``."""
    matches = _ANSWER_RE.findall(solution_str)
    return matches[-1].strip() if matches else None


def _targets(ground_truth: Any) -> list[str]:
    """The target answers: ``ground_truth["target"]`` (or ``ground_truth`` itself), one string or several."""
    targets = ground_truth["target"] if isinstance(ground_truth, dict) else ground_truth
    return [targets] if isinstance(targets, str) else [str(target) for target in targets]


def matches_target(prediction: str, targets: Iterable[str], substring: bool = False) -> bool:
    """Whether the normalised prediction equals (or, with ``substring``, contains) a normalised target."""
    normalized = normalize_answer(prediction)
    return any((normalize_answer(target) in normalized) if substring else (normalize_answer(target) == normalized)
               for target in targets)


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None, *, subem: bool = False,
                   format_score: float = 0.0, score: float = 1.0) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCES`: ``{"score", "acc", "pred"}``."""
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    if not matches_target(answer, _targets(ground_truth), substring=subem):
        return {"score": float(format_score), "acc": 0.0, "pred": answer}
    too_many_tags = max(solution_str.count("<answer>"), solution_str.count("</answer>")) > MAX_ANSWER_TAGS
    value = score / 4 if too_many_tags and not subem else score
    return {"score": float(value), "acc": 1.0, "pred": answer}


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's exact-match score as a number."""
    return score_response(solution_str, ground_truth, format_score=format_score, score=score)["score"]
