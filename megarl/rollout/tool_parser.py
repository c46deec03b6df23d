"""Tool-call parsing of generated assistant text (Hermes / Qwen2.5 format).

A call is a JSON object between tags, one block per call, any number of blocks per turn::

    Let me check.
    <tool_call>
    {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}
    </tool_call>

:meth:`HermesToolParser.parse` never raises on model output: each block becomes either a
:class:`ToolCall` or a :class:`ToolCallError` (invalid JSON, not an object, no ``name``,
``arguments`` not an object, a block without its closing tag). Both carry ``index``, the
block's position in the text, so the agent loop can answer every block, in order, with one
tool response (an error message for the broken ones) instead of dropping them as verl does.

``arguments`` may also be a JSON *string* holding an object (OpenAI's wire format); it is
decoded. A missing ``arguments`` means ``{}``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

from megarl.config.rollout import TOOL_CALL_FORMATS


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a function name and its decoded arguments."""

    name: str
    arguments: dict[str, Any]
    index: int
    """Position of the call's block among all blocks of the turn (0-based)."""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (what chat templates render)."""
        return {"id": str(self.index), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that could not be turned into a call."""

    index: int
    """Position of the block among all blocks of the turn (0-based)."""
    text: str
    """The block's content as generated (between the tags, stripped)."""
    message: str
    """What is wrong with it, phrased for the model (it is sent back as the tool response)."""


class ParsedToolCalls(NamedTuple):
    """``(normal_text, calls, errors)`` of one assistant turn."""

    normal_text: str
    """The text outside the call blocks, stripped."""
    calls: list[ToolCall]
    errors: list[ToolCallError]


def _decode_call(body: str, index: int) -> ToolCall | ToolCallError:
    """One block's JSON body -> a call, or the reason it is not one."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(index, body, f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
    if not isinstance(payload, dict):
        return ToolCallError(index, body, f"expected a JSON object with 'name' and 'arguments', got "
                                          f"{type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(index, body, "the call has no function 'name' (a non-empty string)")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ToolCallError(index, body, f"'arguments' is a string that is not valid JSON ({exc.msg})")
    if not isinstance(arguments, dict):
        return ToolCallError(index, body, f"'arguments' must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name=name, arguments=arguments, index=index)


class HermesToolParser:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Hermes, Qwen2.5)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def has_tool_call(self, text: str) -> bool:
        """Whether ``text`` opens at least one call block (well-formed or not)."""
        return self.start_tag in text

    def parse(self, text: str) -> ParsedToolCalls:
        """Split ``text`` into normal text, well-formed calls and broken blocks (never raises)."""
        normal_parts: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        position = 0
        index = 0
        while True:
            start = text.find(self.start_tag, position)
            if start < 0:
                normal_parts.append(text[position:])
                break
            normal_parts.append(text[position:start])
            body_start = start + len(self.start_tag)
            end = text.find(self.end_tag, body_start)
            if end < 0:
                body = text[body_start:].strip()
                errors.append(ToolCallError(index, body, f"the {self.start_tag} block has no closing {self.end_tag}"))
                break
            outcome = _decode_call(text[body_start:end].strip(), index)
            (calls if isinstance(outcome, ToolCall) else errors).append(outcome)
            index += 1
            position = end + len(self.end_tag)
        return ParsedToolCalls("".join(normal_parts).strip(), calls, errors)


PARSERS = {"hermes": HermesToolParser, "qwen25": HermesToolParser}
"""``rollout.multi_turn.format`` -> parser class (Qwen2.5 uses the Hermes format); one per name of
:data:`megarl.config.rollout.TOOL_CALL_FORMATS`, which the config checks the setting against."""
if set(PARSERS) != set(TOOL_CALL_FORMATS):
    raise ImportError(f"tool parsers {sorted(PARSERS)} and the config's TOOL_CALL_FORMATS "
                      f"{sorted(TOOL_CALL_FORMATS)} disagree: keep them in step")


def get_tool_parser(format: str) -> HermesToolParser:
    """The parser for a tool-call ``format`` name (see :data:`PARSERS`)."""
    if format not in PARSERS:
        raise ValueError(f"tool-call format {format!r} is unknown; set actor_rollout_ref.rollout.multi_turn.format to one of "
                         f"{sorted(PARSERS)}")
    return PARSERS[format]()
