"""Tool calls in generated assistant text, parsed by SGLang's function-call parsers (every model family's format).

:class:`ToolCallParser` runs ``sglang.srt.function_call.function_call_parser.FunctionCallParser``, the parser SGLang's
OpenAI server uses, so a rollout reads a model's calls exactly as serving does. The format is the parser's name
(SGLang's ``--tool-call-parser``, the setting ``actor_rollout_ref.rollout.multi_turn.format``): ``hermes`` and
``qwen25`` (``<tool_call>`` JSON blocks), ``qwen3_coder``, ``llama3``, ``mistral``, ``deepseekv3``, ``glm45``,
``kimi_k2``, ``gpt-oss``, ``pythonic``, ... (:func:`megarl.config.rollout.tool_call_formats`). The tools are
SGLang ``Tool`` objects built once from the tool registry's schemas; each turn is parsed with the request's own.

:meth:`ToolCallParser.parse` never raises on model output. A turn calls tools when SGLang's detector sees a call in
it (its ``has_tool_call``). Each call the detector returns becomes a :class:`ToolCall`, or a :class:`ToolCallError`
when it has no name or its arguments are not a JSON object. Calls the detector could not read become
:class:`ToolCallError` s as well, so the agent loop answers (and counts) every call the model attempted, never
dropping one silently:

- the detector saw a call but returned none (e.g. ``hermes`` returns no call at all when one block of the turn is
  not valid JSON; ``mistral`` when its array is not);
- it returned fewer calls than the turn has call markers (the format's ``structure_info().trigger``, e.g.
  ``<tool_call>``): ``qwen25`` skips a broken block and keeps the others;
- what it returned as normal text still holds a call (``llama3`` leaves a broken call after a good one there).

Calls of tools the request was not given are kept, for the agent loop to answer with an error: SGLang's detectors
drop them unless ``SGLANG_FORWARD_UNKNOWN_TOOLS`` is set, so the parser sets it around each parse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from megarl.config.rollout import TOOL_PARSER_INSTALL, tool_call_formats

_FORWARD_UNKNOWN_TOOLS = "SGLANG_FORWARD_UNKNOWN_TOOLS"
_SGLANG_PARSER_LOGGER = "sglang.srt.function_call"
_environ_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a function name and its decoded arguments."""

    name: str
    arguments: dict[str, Any]
    index: int
    """Position of the call among all calls of the turn, well-formed or not (0-based)."""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (what chat templates render)."""
        return {"id": str(self.index), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the model attempted that could not be turned into a :class:`ToolCall`."""

    index: int
    """Position among all calls of the turn (0-based); unreadable calls come after the ones the parser returned."""
    text: str
    """What was generated for it: the call's arguments, or the text the parser could not read."""
    message: str
    """What is wrong with it, phrased for the model (it is sent back as the tool response)."""


class ParsedToolCalls(NamedTuple):
    """``(normal_text, calls, errors)`` of one assistant turn; no calls and no errors: the turn calls no tool."""

    normal_text: str
    """The text the parser reports as not part of a call."""
    calls: list[ToolCall]
    errors: list[ToolCallError]


@contextlib.contextmanager
def _forwarding_unknown_tools() -> Iterator[None]:
    """Let SGLang's detectors return calls of unknown tools (they read the variable on every parse).

    A lock, because the environment is the process's: two threads parsing at once must not restore it under each
    other."""
    with _environ_lock:
        before = os.environ.get(_FORWARD_UNKNOWN_TOOLS)
        os.environ[_FORWARD_UNKNOWN_TOOLS] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(_FORWARD_UNKNOWN_TOOLS, None)
            else:
                os.environ[_FORWARD_UNKNOWN_TOOLS] = before


class ToolCallParser:
    """Tool calls of one format, among the tools of a registry.

    Args:
        format: an SGLang function-call parser name (``multi_turn.format``).
        tool_schemas: ``{function_name: OpenAI tool schema}`` of every tool a request may be given.
    """

    def __init__(self, format: str, tool_schemas: Mapping[str, Mapping[str, Any]]) -> None:
        formats = tool_call_formats()
        if formats is None:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={format!r} needs SGLang's function-call "
                             f"parsers and sglang is not installed: {TOOL_PARSER_INSTALL}")
        if format not in formats:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={format!r} is unknown; use one of "
                             f"{list(formats)}")
        try:
            from sglang.srt.entrypoints.openai.protocol import Tool
            from sglang.srt.function_call.function_call_parser import FunctionCallParser
        except ImportError as exc:
            raise ImportError(f"SGLang's function-call parsers do not import ({exc}): {TOOL_PARSER_INSTALL}") from exc
        # SGLang's detectors log every call they cannot read (warnings, errors with tracebacks): a policy in
        # training writes many, and each is already answered to the model and counted
        # (``num_tool_call_parse_errors``), so only their critical records are kept.
        logging.getLogger(_SGLANG_PARSER_LOGGER).setLevel(logging.CRITICAL)
        self.format = format
        self._parser_class = FunctionCallParser
        self._tools = {name: Tool.model_validate(dict(schema)) for name, schema in tool_schemas.items()}
        self.call_marker: str | None = None
        """The text that opens every call (or group of calls) in this format; None: the format has none."""
        self.example: str | None = None
        """One call written in this format, shown to the model with its parse errors; None: none to show."""
        try:
            info = FunctionCallParser([], format).detector.structure_info()("<function-name>")
        except NotImplementedError:  # formats without one call skeleton (XML arguments, harmony, ...)
            pass
        else:
            self.call_marker, self.example = info.trigger, f"{info.begin}<arguments>{info.end}"

    def parse(self, text: str, tool_names: Sequence[str]) -> ParsedToolCalls:
        """Split an assistant turn into normal text, well-formed calls and unreadable calls (never raises).

        ``tool_names`` are the tools the request was given (keys of the registry); calls of other names are
        returned too, for the caller to refuse.
        """
        parser = self._parser_class([self._tools[name] for name in tool_names], self.format)
        if not parser.has_tool_call(text):
            return ParsedToolCalls(text, [], [])
        try:
            with _forwarding_unknown_tools():
                normal_text, items = parser.parse_non_stream(text)
        except Exception as exc:  # noqa: BLE001 - model text that makes a detector raise is an unreadable call
            normal_text, items = text, []
            reason = f"the {self.format} parser failed on it ({type(exc).__name__}: {exc})"
        else:
            reason = f"the {self.format} parser could not read it"
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for item in items:
            outcome = self._decode(item.name, item.parameters, len(calls) + len(errors))
            (calls if isinstance(outcome, ToolCall) else errors).append(outcome)
        num_markers = text.count(self.call_marker) if self.call_marker else 0
        num_unread = max(num_markers - len(items), 0)
        if num_unread == 0 and (not items or parser.has_tool_call(normal_text)):
            num_unread = 1
        hint = f". Write each call as {self.example}" if self.example else ""
        for _ in range(num_unread):
            errors.append(ToolCallError(len(calls) + len(errors), text, reason + hint))
        return ParsedToolCalls(normal_text, calls, errors)

    @staticmethod
    def _decode(name: str | None, parameters: str, index: int) -> ToolCall | ToolCallError:
        """One returned call (its arguments as SGLang's JSON text) -> a call, or the reason it is not one."""
        if not name:
            return ToolCallError(index, parameters, "the call has no function name")
        try:
            arguments = json.loads(parameters) if parameters.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(index, parameters, f"the arguments of {name!r} are not valid JSON ({exc.msg})")
        if not isinstance(arguments, dict):
            return ToolCallError(index, parameters, f"the arguments of {name!r} must be a JSON object, got "
                                                    f"{type(arguments).__name__}")
        return ToolCall(name=name, arguments=arguments, index=index)
