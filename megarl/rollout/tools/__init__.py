"""Tools the model can call during multi-turn rollouts, and their registry (tool-config YAML)."""

from megarl.rollout.tools.base import BaseTool, ToolResult, check_tool_schema
from megarl.rollout.tools.registry import load_tools, tools_from_config

__all__ = ["BaseTool", "ToolResult", "check_tool_schema", "load_tools", "tools_from_config"]
