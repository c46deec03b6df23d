"""Tool calls parsed by SGLang's function-call parsers: one transcript per model family's format (written here from
each format's documented syntax), unreadable calls as errors (never exceptions, never dropped), unknown tools kept,
and the format setting checked against SGLang's own list."""

import json
import logging
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.config import ConfigError, MultiTurnConfig, load_config
from megarl.config.rollout import tool_call_formats
from megarl.rollout.tool_parser import ToolCall, ToolCallError, ToolCallParser


def schema(name, **properties):
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                             "parameters": {"type": "object", "properties": properties}}}


SCHEMAS = {"calc_gsm8k_reward": schema("calc_gsm8k_reward", answer={"type": "string"}),
           "get_weather": schema("get_weather", city={"type": "string"}, days={"type": "integer"}),
           "ping": schema("ping")}
NAMES = list(SCHEMAS)
CALC = ("calc_gsm8k_reward", {"answer": "72"})
WEATHER = ("get_weather", {"city": "Paris", "days": 2})


@pytest.fixture(scope="module")
def parsers():
    cache = {}

    def get(format):
        if format not in cache:
            cache[format] = ToolCallParser(format, SCHEMAS)
        return cache[format]
    return get


def calls_of(parsed):
    return [(call.name, call.arguments) for call in parsed.calls]


# One turn per format: (format, generated text, normal text, calls). Sources of the syntax: Hermes/Qwen2.5 chat
# templates (<tool_call> JSON blocks), Llama 3.1/3.2 JSON tool calling (<|python_tag|>, "parameters", ";" between
# calls), Mistral v0.3 ([TOOL_CALLS] JSON array) and its newer compact form (name[ARGS]{...}), DeepSeek-V3's
# tool-call tokens with a ```json block, GLM-4.5's <arg_key>/<arg_value> pairs, Kimi-K2's functions.<name>:<n>
# sections, Qwen3-Coder's <function=...><parameter=...> XML, pythonic lists and gpt-oss's harmony commentary.
TRANSCRIPTS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>',
     "Let me check.", [CALC]),
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
                '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>'),
     "", [WEATHER, CALC]),
    ("qwen25", ('She sold 72 in all.\n<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n'
                '</tool_call>'), "She sold 72 in all.", [CALC]),
    ("qwen25", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
                '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'), "", [WEATHER, ("ping", {})]),
    ("llama3", '<|python_tag|>{"name": "calc_gsm8k_reward", "parameters": {"answer": "72"}}', "", [CALC]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [WEATHER]),
    ("llama3", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}};'
                '{"name": "calc_gsm8k_reward", "parameters": {"answer": "72"}}'), "", [WEATHER, CALC]),
    ("mistral", '[TOOL_CALLS] [{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}]', "", [CALC]),
    ("mistral", ('Two lookups. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                 '{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}]'), "Two lookups.", [WEATHER, CALC]),
    ("mistral", '[TOOL_CALLS]calc_gsm8k_reward[ARGS]{"answer": "72"}', "", [CALC]),
    ("deepseekv3", ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc_gsm8k_reward\n'
                    '```json\n{"answer": "72"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'), "Checking.", [CALC]),
    ("deepseekv3", ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'calc_gsm8k_reward\n```json\n{"answer": "72"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
     "", [WEATHER, CALC]),
    ("glm45", ('Checking.\n<tool_call>calc_gsm8k_reward\n<arg_key>answer</arg_key>\n<arg_value>72</arg_value>\n'
               '</tool_call>'), "Checking.", [CALC]),
    ("glm45", ('<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>'
               '\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>calc_gsm8k_reward\n<arg_key>answer</arg_key>\n'
               '<arg_value>72</arg_value>\n</tool_call>'), "", [WEATHER, CALC]),
    ("kimi_k2", ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.calc_gsm8k_reward:0'
                 '<|tool_call_argument_begin|>{"answer": "72"}<|tool_call_end|><|tool_calls_section_end|>'),
     "Checking.", [CALC]),
    ("kimi_k2", ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                 '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.calc_gsm8k_reward:1'
                 '<|tool_call_argument_begin|>{"answer": "72"}<|tool_call_end|><|tool_calls_section_end|>'),
     "", [WEATHER, CALC]),
    ("qwen3_coder", ('Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                     '<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>'), "Checking.\n", [WEATHER]),
    ("pythonic", '[get_weather(city="Paris", days=2), calc_gsm8k_reward(answer="72")]', "", [WEATHER, CALC]),
    ("gpt-oss", ('<|channel|>analysis<|message|>I should check the answer.<|end|><|start|>assistant<|channel|>'
                 'commentary to=functions.calc_gsm8k_reward <|constrain|>json<|message|>{"answer": "72"}<|call|>'),
     "", [CALC]),
]


@pytest.mark.parametrize("format, text, normal, calls", TRANSCRIPTS,
                         ids=[f"{t[0]}-{i}" for i, t in enumerate(TRANSCRIPTS)])
def test_each_format_parses_its_calls(parsers, format, text, normal, calls):
    parsed = parsers(format).parse(text, NAMES)
    assert parsed.errors == []
    assert calls_of(parsed) == calls
    assert [call.index for call in parsed.calls] == list(range(len(calls)))
    assert parsed.normal_text == normal


@pytest.mark.parametrize("format, text", [
    ("hermes", "The answer is #### 72"),
    ("qwen25", "I would write <tool_response> myself."),
    ("llama3", "The answer is 72."),
    ("mistral", "No tools needed [1, 2]."),
    ("deepseekv3", "Done."),
    ("glm45", "Done."),
    ("kimi_k2", "Done."),
    ("pythonic", "I think [1, 2] is it"),
])
def test_text_without_a_call_is_no_call(parsers, format, text):
    assert parsers(format).parse(text, NAMES) == (text, [], [])


def test_openai_form_of_a_call(parsers):
    [call] = parsers("hermes").parse(TRANSCRIPTS[0][1], NAMES).calls
    assert call == ToolCall(name="calc_gsm8k_reward", arguments={"answer": "72"}, index=0)
    assert call.to_openai() == {"id": "0", "type": "function",
                                "function": {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}}


# ------------------------------------------------------------------------------ unreadable calls are errors


HERMES_HINT = '. Write each call as <tool_call>{"name":"<function-name>", "arguments":<arguments>}</tool_call>'


@pytest.mark.parametrize("format, text, num_calls, num_errors", [
    # Hermes reads a turn whole: one broken block and it returns no call (every block is answered as unread).
    ("hermes", '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}\n</tool_call>', 0, 1),
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>\n{oops\n</tool_call>', 0, 2),
    ("hermes", 'Hi <tool_call>\n{"name": "ping", "arguments": {}}', 1, 0),  # no closing tag: Hermes reads it
    # Qwen2.5 reads block by block: the broken block is missing from its calls, and counted here.
    ("qwen25", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>\n{oops\n</tool_call>', 1, 1),
    # Llama 3 returns the good call and leaves the broken one in the normal text.
    ("llama3", '<|python_tag|>{"name": "ping", "parameters": {}};{"name": broken', 1, 1),
    ("mistral", '[TOOL_CALLS] [{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}]', 0, 1),
    ("deepseekv3", ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc_gsm8k_reward\n```json\n'
                    '{"answer": 72\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'), 0, 1),
    ("kimi_k2", ('<|tool_calls_section_begin|><|tool_call_begin|>functions.calc_gsm8k_reward:0'
                 '<|tool_call_argument_begin|>{"answer": 7<|tool_call_end|><|tool_calls_section_end|>'), 0, 1),
])
def test_unreadable_calls_are_errors(parsers, format, text, num_calls, num_errors, caplog):
    parser = parsers(format)
    with caplog.at_level(logging.DEBUG):
        parsed = parser.parse(text, NAMES)
    # SGLang's detectors complain about each (with tracebacks); the errors below answer and count them instead.
    assert [r.getMessage() for r in caplog.records if r.name.startswith("sglang") and r.levelno >= logging.WARNING] == []
    assert len(parsed.calls) == num_calls and len(parsed.errors) == num_errors
    assert [e.index for e in parsed.errors] == list(range(num_calls, num_calls + num_errors))
    for error in parsed.errors:
        assert error.text == text and error.message.startswith(f"the {format} parser could not read it")


def test_error_message_shows_the_format(parsers):
    text = '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}\n</tool_call>'
    [error] = parsers("hermes").parse(text, NAMES).errors
    assert error == ToolCallError(0, text, "the hermes parser could not read it" + HERMES_HINT)
    [error] = parsers("glm45").parse("<tool_call>calc_gsm8k_reward\n<arg_key>answer", NAMES).errors
    assert error.message == "the glm45 parser could not read it"  # no call skeleton to show for XML arguments


@pytest.mark.parametrize("arguments, message", [
    ("[1, 2]", "the arguments of 'calc_gsm8k_reward' must be a JSON object, got list"),
    ('"72"', "the arguments of 'calc_gsm8k_reward' must be a JSON object, got str"),
])
def test_arguments_that_are_not_an_object_are_errors(parsers, arguments, message):
    text = f'<tool_call>\n{{"name": "calc_gsm8k_reward", "arguments": {arguments}}}\n</tool_call>'
    parsed = parsers("hermes").parse(text, NAMES)
    assert parsed.calls == []
    assert parsed.errors == [ToolCallError(0, json.dumps(json.loads(arguments)), message)]


def test_calls_and_errors_are_indexed_calls_first(parsers):
    text = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>\n'
            '{"name": "calc_gsm8k_reward", "arguments": [1]}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{oops\n</tool_call>')
    parsed = parsers("qwen25").parse(text, NAMES)
    assert [(c.name, c.index) for c in parsed.calls] == [("ping", 0), ("get_weather", 2)]
    assert [e.index for e in parsed.errors] == [1, 3]


@pytest.mark.parametrize("format, text", [
    ("hermes", '<tool_call>\n{"name": "web_search", "arguments": {"q": "x"}}\n</tool_call>'),
    ("qwen25", '<tool_call>\n{"name": "web_search", "arguments": {"q": "x"}}\n</tool_call>'),
    ("llama3", '<|python_tag|>{"name": "web_search", "parameters": {"q": "x"}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "web_search", "arguments": {"q": "x"}}]'),
    ("deepseekv3", ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>web_search\n```json\n{"q": "x"}\n'
                    '```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')),
    ("glm45", "<tool_call>web_search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>\n</tool_call>"),
    ("kimi_k2", ('<|tool_calls_section_begin|><|tool_call_begin|>functions.web_search:0<|tool_call_argument_begin|>'
                 '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>')),
])
def test_calls_of_tools_not_given_are_kept(parsers, format, text):
    """SGLang drops them by default; the agent loop answers them (num_unknown_tool_calls) instead."""
    before = os.environ.get("SGLANG_FORWARD_UNKNOWN_TOOLS")
    parsed = parsers(format).parse(text, ["calc_gsm8k_reward"])
    assert calls_of(parsed) == [("web_search", {"q": "x"})] and parsed.errors == []
    assert os.environ.get("SGLANG_FORWARD_UNKNOWN_TOOLS") == before


def test_a_request_without_tools_parses_nothing(parsers):
    text = TRANSCRIPTS[0][1]
    assert parsers("hermes").parse(text, []) == (text, [], [])


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=6)


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(NAMES), st.dictionaries(st.text(max_size=6), _json_values, max_size=3)),
                      min_size=1, max_size=3),
       prefix=st.text(max_size=20).filter(lambda t: "<tool_call>" not in t))
def test_rendered_calls_round_trip(parsers, calls, prefix):
    text = prefix + "".join(f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
                            for name, args in calls)
    for format in ("hermes", "qwen25"):
        parsed = parsers(format).parse(text, NAMES)
        assert parsed.errors == []
        assert calls_of(parsed) == calls
        assert parsed.normal_text == prefix.strip()


def sglang_parser(format):
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    return FunctionCallParser([Tool.model_validate(schema) for schema in SCHEMAS.values()], format)


@settings(max_examples=100, deadline=None)
@given(format=st.sampled_from(["hermes", "qwen25", "llama3", "mistral", "deepseekv3", "glm45", "kimi_k2"]),
       pieces=st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS] [", "]",
                                        "<｜tool▁calls▁begin｜>", "<|tool_calls_section_begin|>", "{", "}", '"name"',
                                        ":", '"ping"', '"arguments"', "x", "\n", " ", ";"]), max_size=25))
def test_parse_never_raises_and_answers_every_attempt(parsers, format, pieces):
    text = "".join(pieces)
    parser = parsers(format)
    _normal, calls, errors = parser.parse(text, NAMES)
    assert [c.index for c in calls] + [e.index for e in errors] == list(range(len(calls) + len(errors)))
    if sglang_parser(format).has_tool_call(text):  # SGLang sees a call: it is answered
        assert calls or errors


# ------------------------------------------------------------------------------ the format setting


def test_formats_are_sglangs_parsers():
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    formats = tool_call_formats()
    assert set(formats) == set(FunctionCallParser.ToolCallParserEnum) - {"response_template"}
    assert {"hermes", "qwen25", "qwen3_coder", "llama3", "mistral", "deepseekv3", "glm45", "kimi_k2", "gpt-oss",
            "pythonic"} <= set(formats)


def test_every_format_builds_a_parser(parsers):
    for format in tool_call_formats():
        assert parsers(format).parse("Just text.", NAMES).calls == []


def test_unknown_format_is_refused_by_the_config():
    """megarl-train builds the config first (load_config), before Ray starts: a typo stops the run there."""
    with pytest.raises(ConfigError, match=r"multi_turn.format='llama-3' is unknown; use one of \[.*'llama3'"):
        load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.rollout.multi_turn.format=llama-3"])
    with pytest.raises(ValueError, match=r"multi_turn.format='llama-3' is unknown; use one of \[.*'llama3'"):
        MultiTurnConfig(format="llama-3")
    assert MultiTurnConfig(format="kimi_k2").format == "kimi_k2"
    with pytest.raises(ValueError, match="multi_turn.format='response_template' is unknown"):
        MultiTurnConfig(format="response_template")


def test_unknown_format_is_refused_by_the_parser():
    with pytest.raises(ValueError, match=r"multi_turn.format='nope' is unknown; use one of \["):
        ToolCallParser("nope", SCHEMAS)


def test_without_sglang_only_multi_turn_needs_it(monkeypatch):
    import importlib.util

    import megarl.config.rollout as rollout_config

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else
                        real_find_spec(name, *a))
    rollout_config.tool_call_formats.cache_clear()
    try:
        assert rollout_config.tool_call_formats() is None
        assert MultiTurnConfig(format="hermes").enable is False  # nothing parses calls: nothing to check
        with pytest.raises(ValueError, match="multi_turn.enable=true parses tool calls with SGLang's function-call "
                                             "parsers, and sglang is not installed: install sglang as the README"):
            MultiTurnConfig(enable=True)
    finally:
        rollout_config.tool_call_formats.cache_clear()


def test_a_parser_that_raises_on_model_text_is_an_unreadable_call(parsers):
    """sglang 0.5.23's llama3 detector raises AttributeError on a call that is a JSON string, not an object."""
    parsed = parsers("llama3").parse('<|python_tag|>"ping"', NAMES)
    assert parsed.calls == []
    [error] = parsed.errors
    assert error.message.startswith("the llama3 parser failed on it (AttributeError: ")
