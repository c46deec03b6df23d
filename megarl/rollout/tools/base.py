"""The tool interface: one tool object serves every request, with state per instance id.

A tool is built from its entry in the tool-config YAML (``config`` dict and OpenAI function
``tool_schema``; see :mod:`megarl.rollout.tools.registry`). For each request that may call it,
the agent loop:

1. ``await tool.create(request_id, **create_kwargs)`` when the request starts;
2. ``await tool.execute(request_id, arguments, **execute_kwargs)`` for every call the model
   makes, returning ``(response_text, step_reward, metrics)``; the text goes back to the
   model as the tool response;
3. ``await tool.calc_reward(request_id, **calc_reward_kwargs)`` when the conversation ends:
   the value lands in the request's ``reward_scores[tool_name]``;
4. ``await tool.release(request_id, **release_kwargs)``, always, even if the request failed.

The per-row kwargs come from the row's ``extra_info.tools_kwargs[tool_name]``.
Calls from different requests interleave on one event loop: keep per-request state in
``self._instances[instance_id]`` and never block the loop (a blocking call also defeats the
agent loop's per-call timeout; run blocking work with ``asyncio.to_thread``).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass
class ToolResponse:
    """A tool's answer with images (verl's ``ToolResponse``): ``execute`` may return it in place of text. The images
    (PIL images, encoded bytes, paths or base64 data URIs) go before the text in the tool message, for a
    vision-language policy to see."""

    text: str = ""
    images: list = dataclasses.field(default_factory=list)


ToolResult = tuple[str | ToolResponse, float, dict[str, Any]]
"""``(response, step_reward, metrics)`` of one ``execute``: the response is text, or a :class:`ToolResponse`."""


def check_tool_schema(schema: Any, where: str) -> dict[str, Any]:
    """An OpenAI function schema ``{type: function, function: {name, description, parameters}}``.

    Returns a deep copy; raises ``ValueError`` naming ``where`` and the fault.
    """
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: tool_schema must be a mapping {{type: function, function: {{name, ...}}}}, "
                         f"got {type(schema).__name__}")
    if schema.get("type") != "function":
        raise ValueError(f"{where}: tool_schema.type must be 'function', got {schema.get('type')!r}")
    function = schema.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}: tool_schema.function must be a mapping with name, description and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: tool_schema.function.name must be a non-empty string, got {name!r}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ValueError(f"{where}: tool_schema.function.parameters must be a JSON schema of type 'object'")
    return copy.deepcopy(dict(schema))


class BaseTool(abc.ABC):
    """An async tool with per-instance (per-request) state; subclasses implement ``execute``.

    Args:
        config: the ``config`` mapping of the tool's YAML entry (tool-specific settings).
        tool_schema: the OpenAI function schema shown to the model.
    """

    def __init__(self, config: Mapping[str, Any] | None, tool_schema: Mapping[str, Any]) -> None:
        self.config = dict(config or {})
        self.tool_schema = check_tool_schema(tool_schema, f"tool {type(self).__name__}")
        self._instances: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        """The function name the model calls."""
        return self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict[str, Any]:
        """The OpenAI function schema (a copy; the chat template renders it)."""
        return copy.deepcopy(self.tool_schema)

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Allocate state for one trajectory; return its instance id (a new uuid if None)."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {}
        return instance_id

    @abc.abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        """Run one call with the model's ``parameters``; return ``(text, step_reward, metrics)``."""

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The trajectory's final reward for its use of this tool (default 0)."""
        return 0.0

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Free the instance's state (unknown ids are ignored: release is idempotent)."""
        self._instances.pop(instance_id, None)

    def _instance(self, instance_id: str) -> dict[str, Any]:
        """The state of ``instance_id``, or ``KeyError`` saying it was never created."""
        if instance_id not in self._instances:
            raise KeyError(f"tool {self.name!r} has no instance {instance_id!r}; call create() first")
        return self._instances[instance_id]
