"""A generative judge's prompt and its verdict: the text the judge is asked (a template filled from the row) and the
number read off its answer (a parser), kept free of any engine so both are checked when the config loads.

Template fields (``str.format``): ``{prompt}`` (the policy's prompt: the last user message of the row's chat prompt
when the batch carries it, else the decoded prompt tokens), ``{response}`` (the decoded response),
``{ground_truth}`` (``reward_model["ground_truth"]``), ``{data_source}`` and ``{extra_info[key]}``.

Parsers (``reward_model.judge.verdict_parser``) read the judge's text and return a number, or raise
:class:`GarbageVerdict` when there is none; a ``"module_or_path:function"`` names one of the user's,
``fn(text) -> float`` (raising, or returning None, for garbage).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from typing import Any

DEFAULT_TEMPLATE = """You are grading a response to a problem.

Problem:
{prompt}

Reference answer:
{ground_truth}

Response:
{response}

Is the response's final answer correct? Reply with a score from 0 (wrong) to 10 (correct) as <score>N</score>."""
"""The default judge prompt (a verifiable task with a reference answer), read by the ``score_tag`` parser."""

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "data_source", "extra_info")
"""What a judge template may name (``extra_info`` indexed: ``{extra_info[question]}``)."""


class GarbageVerdict(ValueError):
    """The judge's answer holds no verdict the parser can read."""


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"


def _last(pattern: str, text: str, what: str, flags: int = 0) -> str:
    found = re.findall(pattern, text, flags)
    if not found:
        raise GarbageVerdict(f"no {what} in the judge's answer {_quote(text)}")
    return found[-1]


def last_number(text: str) -> float:
    """The last number in the text (``Score: 7`` -> 7.0)."""
    return float(_last(_NUMBER, text, "number"))


def score_tag(text: str) -> float:
    """The number in the last ``<score>N</score>``."""
    return float(_last(rf"<score>\s*({_NUMBER})\s*</score>", text, "<score>N</score>"))


def boxed(text: str) -> float:
    """The number in the last ``\\boxed{N}``."""
    return float(_last(rf"\\boxed\{{\s*({_NUMBER})\s*\}}", text, "\\boxed{N}"))


def yes_no(text: str) -> float:
    """1.0 for a last standalone ``yes``, 0.0 for a last ``no`` (any case)."""
    return 1.0 if _last(r"\b(yes|no)\b", text, "yes or no", re.IGNORECASE).lower() == "yes" else 0.0


PARSERS: Mapping[str, Callable[[str], float]] = {"score_tag": score_tag, "last_number": last_number, "boxed": boxed,
                                                 "yes_no": yes_no}
"""The built-in verdict parsers by name."""


def load_parser(spec: str, key: str) -> Callable[[str], float]:
    """The parser ``spec`` names: a built-in (:data:`PARSERS`) or ``"module_or_path:function"``; errors name ``key``."""
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise ValueError(f"{key}={spec!r}: use one of {sorted(PARSERS)} or 'module_or_path:function' "
                         f"(fn(text) -> float)")
    from megarl.reward.registry import load_function

    function = load_function(spec)

    def parse(text: str) -> float:
        value = function(text)
        if value is None:
            raise GarbageVerdict(f"{spec} found no verdict in the judge's answer {_quote(text)}")
        return float(value)

    return parse


def check_template(template: str, key: str) -> None:
    """Refuse a template naming a field a row does not have, or that ``str.format`` cannot read; errors name ``key``."""
    try:
        names = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as error:
        raise ValueError(f"{key}: not a format string ({error}); write a literal brace as {{{{ or }}}}") from None
    for name in names:
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root not in TEMPLATE_FIELDS:
            raise ValueError(f"{key} names {{{name}}}: a judge template may name {list(TEMPLATE_FIELDS)} "
                             f"(extra_info indexed, e.g. {{extra_info[question]}})")
    if "response" not in {re.split(r"[.\[]", n, maxsplit=1)[0] for n in names}:
        raise ValueError(f"{key} never names {{response}}: the judge would not see what it judges")


def fill_template(template: str, *, prompt: str, response: str, ground_truth: Any, data_source: str,
                  extra_info: Mapping[str, Any] | None) -> str:
    """The judge's prompt for one row (a ``KeyError`` names an ``extra_info`` key the row lacks)."""
    return template.format(prompt=prompt, response=response, ground_truth=ground_truth, data_source=data_source,
                           extra_info=dict(extra_info or {}))


def _quote(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
