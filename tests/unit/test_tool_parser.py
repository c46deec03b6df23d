"""Hermes/Qwen tool-call parsing: calls, errors for broken blocks (never exceptions), order."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.rollout.tool_parser import HermesToolParser, ToolCall, ToolCallError, get_tool_parser

parser = HermesToolParser()


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_single_call_and_normal_text():
    text = "Let me check.\n" + block('{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}')
    assert parser.has_tool_call(text)
    normal, calls, errors = parser.parse(text)
    assert normal == "Let me check."
    assert calls == [ToolCall(name="calc_gsm8k_reward", arguments={"answer": "72"}, index=0)]
    assert errors == []
    assert calls[0].to_openai() == {"id": "0", "type": "function",
                                    "function": {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}}


def test_no_tool_call():
    text = "The answer is #### 72"
    assert not parser.has_tool_call(text)
    assert parser.parse(text) == ("The answer is #### 72", [], [])


def test_several_calls_keep_their_order_and_the_text_between():
    text = ("A " + block('{"name": "a", "arguments": {"x": 1}}') + " B "
            + block('{"name": "b", "arguments": {}}') + " C")
    normal, calls, errors = parser.parse(text)
    assert normal == "A  B  C"
    assert [(c.name, c.arguments, c.index) for c in calls] == [("a", {"x": 1}, 0), ("b", {}, 1)]
    assert errors == []


@pytest.mark.parametrize("body, fragment", [
    ('{"name": "calc", "arguments": {"answer": 72}', "invalid JSON"),
    ("calc(answer=72)", "invalid JSON"),
    ('["calc", {"answer": 72}]', "expected a JSON object"),
    ('{"arguments": {"answer": "72"}}', "no function 'name'"),
    ('{"name": "", "arguments": {}}', "no function 'name'"),
    ('{"name": 3, "arguments": {}}', "no function 'name'"),
    ('{"name": "calc", "arguments": [1, 2]}', "'arguments' must be a JSON object"),
    ('{"name": "calc", "arguments": "not json"}', "'arguments' is a string that is not valid JSON"),
])
def test_broken_blocks_are_errors_not_exceptions(body, fragment):
    normal, calls, errors = parser.parse("x " + block(body))
    assert calls == []
    assert len(errors) == 1
    assert errors[0].index == 0 and errors[0].text == body
    assert fragment in errors[0].message
    assert normal == "x"


def test_unterminated_block_is_an_error():
    normal, calls, errors = parser.parse('Hi <tool_call>\n{"name": "calc", "arguments": {}}')
    assert calls == []
    assert errors == [ToolCallError(0, '{"name": "calc", "arguments": {}}',
                                    "the <tool_call> block has no closing </tool_call>")]
    assert normal == "Hi"


def test_arguments_as_json_string_and_missing_arguments():
    _, calls, errors = parser.parse(block('{"name": "calc", "arguments": "{\\"answer\\": \\"7\\"}"}')
                                    + block('{"name": "ping"}'))
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"answer": "7"}), ("ping", {})]


def test_mixed_good_and_bad_blocks_are_indexed_in_text_order():
    text = block('{"name": "a", "arguments": {}}') + block("{oops") + block('{"name": "c", "arguments": {}}')
    _, calls, errors = parser.parse(text)
    assert [c.index for c in calls] == [0, 2]
    assert [e.index for e in errors] == [1]


def test_get_tool_parser():
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    assert isinstance(get_tool_parser("qwen25"), HermesToolParser)
    with pytest.raises(ValueError, match="tool-call format 'llama3' is unknown"):
        get_tool_parser("llama3")


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=6)


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                                st.dictionaries(st.text(max_size=6), _json_values, max_size=3)), max_size=3),
       prefix=st.text(max_size=20).filter(lambda t: "<tool_call>" not in t))
def test_rendered_calls_round_trip(calls, prefix):
    text = prefix + "".join(block(json.dumps({"name": name, "arguments": args})) for name, args in calls)
    normal, parsed, errors = parser.parse(text)
    assert errors == []
    assert [(c.name, c.arguments) for c in parsed] == calls
    assert normal == prefix.strip()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"a"', "x", "\n", " "]),
                max_size=25))
def test_parse_never_raises(pieces):
    text = "".join(pieces)
    normal, calls, errors = parser.parse(text)
    assert len(calls) + len(errors) <= text.count("<tool_call>")
    assert parser.has_tool_call(text) == ("<tool_call>" in text)
