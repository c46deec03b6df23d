"""Tools from a tool-config YAML (``rollout.multi_turn.tool_config_path``).

The file lists tools; each entry names the class, its settings and the OpenAI function schema
shown to the model::

    tools:
      - class_name: megarl.rollout.tools.gsm8k.Gsm8kTool   # or "package.module:Class"
        config: {type: native}
        tool_schema:
          type: function
          function:
            name: calc_gsm8k_reward
            description: ...
            parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}

:func:`load_tools` returns ``{function_name: tool}``. Every mistake raises ``ValueError``
(``FileNotFoundError`` for a missing file) naming the file, the entry and the fault.
Only ``config.type: native`` (in-process Python tools) exists; MCP tools are not supported.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from megarl.rollout.tools.base import BaseTool, check_tool_schema

ENTRY_KEYS = ("class_name", "config", "tool_schema")
"""Keys of one tool entry."""


def import_object(path: str, where: str) -> Any:
    """The object at ``"package.module.Name"`` or ``"package.module:Name"``; ``ValueError`` naming ``where``."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where}: class_name must be a dotted path such as 'package.module.Class', got {path!r}")
    module_name, sep, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"{where}: class_name {path!r} must name a module and a class "
                         f"('package.module.Class' or 'package.module:Class')")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{where}: cannot import module {module_name!r} of class_name {path!r} ({exc})") from exc
    if not hasattr(module, attribute):
        raise ValueError(f"{where}: module {module_name!r} has no {attribute!r} (class_name {path!r})")
    return getattr(module, attribute)


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed YAML file at ``path``; clear errors for a missing file or invalid YAML."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {str(path)!r} is not valid YAML: {exc}") from exc


def _build_tool(entry: Any, where: str) -> BaseTool:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: each tool entry must be a mapping with {list(ENTRY_KEYS)}, got "
                         f"{type(entry).__name__}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; a tool entry has {list(ENTRY_KEYS)}")
    for key in ("class_name", "tool_schema"):
        if key not in entry:
            raise ValueError(f"{where}: missing {key!r}")
    schema = check_tool_schema(entry["tool_schema"], where)
    where = f"{where} ({schema['function']['name']})"
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: config must be a mapping, got {type(config).__name__}")
    if config.get("type", "native") != "native":
        raise ValueError(f"{where}: config.type {config['type']!r} is not supported; only 'native' (Python) tools")
    cls = import_object(entry["class_name"], where)
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ValueError(f"{where}: {entry['class_name']!r} is not a subclass of megarl.rollout.tools.BaseTool")
    try:
        return cls(dict(config), schema)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {cls.__name__}({dict(config)}) refused its config: {exc}") from exc


def tools_from_config(tool_config: Any, source: str = "tool config") -> dict[str, BaseTool]:
    """``{function_name: tool}`` from a parsed tool config ``{"tools": [entry, ...]}``."""
    if not isinstance(tool_config, Mapping) or not isinstance(tool_config.get("tools"), list):
        raise ValueError(f"{source}: expected a mapping with a 'tools' list of {{class_name, config, tool_schema}} "
                         f"entries")
    tools: dict[str, BaseTool] = {}
    for position, entry in enumerate(tool_config["tools"]):
        tool = _build_tool(entry, f"{source} tools[{position}]")
        if tool.name in tools:
            raise ValueError(f"{source} tools[{position}]: tool name {tool.name!r} is already defined by an earlier "
                             f"entry; function names must be unique")
        tools[tool.name] = tool
    return tools


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """``{function_name: tool}`` from the tool-config YAML at ``path``."""
    return tools_from_config(read_yaml(path, "tool config"), source=str(path))
