"""Tools and interactions: BaseTool API, the tool-config registry (and its errors), the GSM8K
tool, the GSM8K interaction and its YAML loading."""

import asyncio
import textwrap
from pathlib import Path

import pytest

from megarl.rollout.interaction import BaseInteraction, Gsm8kInteraction, load_interactions
from megarl.rollout.tools import BaseTool, load_tools, tools_from_config
from megarl.rollout.tools.gsm8k import Gsm8kTool

REPO = Path(__file__).resolve().parents[2]
GSM8K_TOOL_CONFIG = REPO / "configs" / "tools" / "gsm8k_tool_config.yaml"

SCHEMA = {"type": "function", "function": {"name": "echo", "description": "Echo the text.",
                                           "parameters": {"type": "object",
                                                          "properties": {"text": {"type": "string"}}}}}


class EchoTool(BaseTool):
    """Answers with its input; counts calls per instance."""

    async def create(self, instance_id=None, **create_kwargs):
        instance_id = await super().create(instance_id)
        self._instances[instance_id]["calls"] = 0
        return instance_id

    async def execute(self, instance_id, parameters, **execute_kwargs):
        self._instance(instance_id)["calls"] += 1
        return parameters.get("text", ""), 0.0, {"calls": self._instance(instance_id)["calls"]}


class NotATool:
    pass


def run(coroutine):
    return asyncio.run(coroutine)


# ---------------------------------------------------------------------------------- BaseTool


def test_base_tool_lifecycle():
    tool = EchoTool({}, SCHEMA)
    assert tool.name == "echo"
    schema = tool.get_openai_tool_schema()
    assert schema == SCHEMA and schema is not tool.tool_schema
    generated = run(tool.create())
    assert len(generated) == 32
    assert run(tool.create("req-1")) == "req-1"
    assert run(tool.execute("req-1", {"text": "hi"})) == ("hi", 0.0, {"calls": 1})
    assert run(tool.calc_reward("req-1")) == 0.0
    run(tool.release("req-1"))
    run(tool.release("req-1"))  # idempotent
    with pytest.raises(KeyError, match="has no instance 'req-1'"):
        run(tool.execute("req-1", {"text": "hi"}))


def test_base_tool_requires_execute_and_a_valid_schema():
    with pytest.raises(TypeError, match="abstract"):
        BaseTool({}, SCHEMA)
    with pytest.raises(ValueError, match="tool_schema.type must be 'function'"):
        EchoTool({}, {"type": "fn", "function": {"name": "x"}})


# ---------------------------------------------------------------------------------- registry


def test_gsm8k_tool_config_loads():
    tools = load_tools(GSM8K_TOOL_CONFIG)
    assert list(tools) == ["calc_gsm8k_reward"]
    tool = tools["calc_gsm8k_reward"]
    assert isinstance(tool, Gsm8kTool)
    assert tool.method == "flexible" and tool.penalty == 0.05
    function = tool.get_openai_tool_schema()["function"]
    assert function["parameters"]["required"] == ["answer"]
    assert function["parameters"]["properties"]["answer"]["type"] == "string"


def test_registry_accepts_colon_paths_and_keeps_order(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent("""
        tools:
          - class_name: tests.unit.test_tools:EchoTool
            tool_schema: {type: function, function: {name: echo, parameters: {type: object, properties: {}}}}
          - class_name: tests.unit.test_tools.EchoTool
            config: {type: native, anything: 1}
            tool_schema: {type: function, function: {name: echo2}}
    """))
    tools = load_tools(path)
    assert list(tools) == ["echo", "echo2"]
    assert tools["echo2"].config == {"type": "native", "anything": 1}


def _entry(**overrides):
    entry = {"class_name": "tests.unit.test_tools.EchoTool", "tool_schema": SCHEMA}
    entry.update(overrides)
    return {key: value for key, value in entry.items() if value is not None}


@pytest.mark.parametrize("config, message", [
    ({"tools": [_entry(), _entry()]}, r"tools\[1\]: tool name 'echo' is already defined"),
    ({"tools": [_entry(class_name=None)]}, r"tools\[0\]: missing 'class_name'"),
    ({"tools": [_entry(tool_schema=None)]}, r"tools\[0\]: missing 'tool_schema'"),
    ({"tools": [_entry(class_name="no_such_module.Tool")]},
     r"tools\[0\] \(echo\): cannot import module 'no_such_module'"),
    ({"tools": [_entry(class_name="tests.unit.test_tools.Missing")]},
     r"tools\[0\] \(echo\): module 'tests.unit.test_tools' has no 'Missing'"),
    ({"tools": [_entry(class_name="tests.unit.test_tools.NotATool")]}, "is not a subclass of megarl.rollout.tools"),
    ({"tools": [_entry(class_name="EchoTool")]}, "must name a module and a class"),
    ({"tools": [_entry(tool_schema={"type": "function", "function": {"description": "x"}})]},
     r"tools\[0\]: tool_schema.function.name must be a non-empty string"),
    ({"tools": [_entry(tool_schema={"function": {"name": "x"}})]}, "tool_schema.type must be 'function'"),
    ({"tools": [_entry(config={"type": "mcp"})]}, "config.type 'mcp' is not supported"),
    ({"tools": [_entry(config=[1])]}, "config must be a mapping"),
    ({"tools": [_entry(schema=SCHEMA)]}, r"tools\[0\]: unknown keys \['schema'\]"),
    ({"tools": ["echo"]}, r"tools\[0\]: each tool entry must be a mapping"),
    ({"tool": []}, "expected a mapping with a 'tools' list"),
    ({"tools": [_entry(class_name="megarl.rollout.tools.gsm8k.Gsm8kTool", config={"method": "exact"})]},
     r"tools\[0\] \(echo\): Gsm8kTool\(\{'method': 'exact'\}\) refused its config: .*method='exact'"),
    ({"tools": [_entry(class_name="megarl.rollout.tools.gsm8k.Gsm8kTool", config={"penalt": 1})]},
     r"unknown Gsm8kTool config keys \['penalt'\]"),
])
def test_registry_errors_name_the_entry(config, message):
    with pytest.raises(ValueError, match=message):
        tools_from_config(config, source="my.yaml")


def test_registry_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tool config '.*missing.yaml' does not exist"):
        load_tools(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools: [\n  - {class_name: a\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_tools(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty.yaml: expected a mapping with a 'tools' list"):
        load_tools(empty)


# ---------------------------------------------------------------------------------- GSM8K tool


def test_gsm8k_tool_behaviour():
    tool = load_tools(GSM8K_TOOL_CONFIG)["calc_gsm8k_reward"]
    with pytest.raises(ValueError, match="needs create_kwargs.ground_truth"):
        run(tool.create("r"))
    assert run(tool.create("r", ground_truth="72")) == "r"
    assert run(tool.calc_reward("r")) == 0.0
    assert run(tool.execute("r", {"answer": "70"})) == ("Current parsed answer=70 reward=0.0", -0.05, {"reward": 0.0})
    assert run(tool.execute("r", {"answer": "#### 72"})) == ("Current parsed answer=#### 72 reward=1.0", 0.0,
                                                            {"reward": 1.0})
    assert run(tool.calc_reward("r")) == 1.0
    # A worse resubmission costs the penalty but the best score stays.
    assert run(tool.execute("r", {"answer": 71}))[1:] == (-0.05, {"reward": 0.0})
    assert run(tool.calc_reward("r")) == 1.0
    # Flexible extraction: the last number of the answer counts; other instances are separate.
    run(tool.create("s", ground_truth="1600"))
    assert run(tool.execute("s", {"answer": "It is 1,600 dollars"}))[0] == (
        "Current parsed answer=It is 1,600 dollars reward=1.0")
    assert run(tool.calc_reward("r")) == 1.0
    run(tool.release("r"))
    with pytest.raises(KeyError):
        run(tool.calc_reward("r"))


# ---------------------------------------------------------------------------------- interactions


def test_gsm8k_interaction():
    interaction = Gsm8kInteraction({"name": "gsm8k"})
    with pytest.raises(ValueError, match="needs interaction_kwargs.ground_truth"):
        run(interaction.start_interaction("r", query="q"))
    run(interaction.start_interaction("r", query="q", ground_truth="72"))
    wrong = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### 70"}]
    assert run(interaction.generate_response("r", wrong)) == (False, Gsm8kInteraction.RETRY, 0.0, {})
    # strict by default: a bare number without "####" does not count
    bare = wrong + [{"role": "user", "content": "retry"}, {"role": "assistant", "content": "72"}]
    assert run(interaction.generate_response("r", bare))[:3] == (False, Gsm8kInteraction.RETRY, 0.0)
    right = bare + [{"role": "user", "content": "retry"}, {"role": "assistant", "content": "So #### 72"}]
    assert run(interaction.generate_response("r", right)) == (True, Gsm8kInteraction.CORRECT, 1.0, {})
    assert run(interaction.calculate_score("r")) == 1.0
    run(interaction.finalize_interaction("r"))
    with pytest.raises(KeyError):
        run(interaction.calculate_score("r"))


def test_interaction_yaml(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(textwrap.dedent("""
        interaction:
          - name: gsm8k
            class_name: megarl.rollout.interaction.Gsm8kInteraction
            config: {method: flexible}
    """))
    interactions = load_interactions(path)
    assert list(interactions) == ["gsm8k"]
    assert isinstance(interactions["gsm8k"], Gsm8kInteraction)
    assert interactions["gsm8k"].name == "gsm8k" and interactions["gsm8k"].method == "flexible"


@pytest.mark.parametrize("entries, message", [
    ([{"name": "a"}], r"interaction\[0\]: missing 'class_name'"),
    ([{"name": "a", "class_name": "tests.unit.test_tools.EchoTool"}], "is not a subclass of .*BaseInteraction"),
    ([{"name": "a", "class_name": "megarl.rollout.interaction.Gsm8kInteraction"}] * 2,
     r"interaction\[1\]: interaction name 'a' is already defined"),
    ([{"name": "a", "class_name": "megarl.rollout.interaction.Gsm8kInteraction", "config": {"method": "x"}}],
     r"interaction\[0\] \(a\): Gsm8kInteraction refused its config"),
    ([{"name": "a", "class_name": "megarl.rollout.interaction.Gsm8kInteraction", "kwargs": {}}],
     r"unknown keys \['kwargs'\]"),
])
def test_interaction_yaml_errors(tmp_path, entries, message):
    import yaml

    path = tmp_path / "interaction.yaml"
    path.write_text(yaml.safe_dump({"interaction": entries}))
    with pytest.raises(ValueError, match=message):
        load_interactions(path)


def test_base_interaction_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        BaseInteraction({})
