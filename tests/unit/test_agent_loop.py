"""The multi-turn agent loop driven by a scripted engine, with the real tokenizer, chat template,
parser, tools and interactions.

Every scenario checks the final state, the finish reason and the exact token ids and loss
mask of the response, token by token, against sequences built here by tokenising hand-written
pieces of the Qwen2.5 template (assistant text + ``<|im_end|>`` -> 1; ``"\\n"`` after it, tool
turns, user turns and generation prompts -> 0). It also checks that the turn-by-turn ids equal
tokenising the final messages with the chat template in one go.
"""

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.config import MultiTurnConfig, RolloutConfig
from megarl.data.batch import Batch
from megarl.engines.engine import sampling_params_for
from megarl.rollout.agent_loop import AgentLoop
from megarl.rollout.interaction import Gsm8kInteraction
from megarl.rollout.request import AsyncRolloutRequest, FinishReasonType, Message, RequestState
from megarl.rollout.request_batch import batch_from_requests, requests_from_batch
from megarl.rollout.tools import BaseTool, load_tools
from tests.scripted_engine import ScriptedEngine, Together, Turn, fake_logprobs, tiny_tokenizer

EOS = "<|im_end|>"
GEN = "<|im_start|>assistant\n"
SYSTEM = "You are a math expert. Solve the question step by step."
Q1 = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
Q2 = "Weng earns 12 dollars an hour. She worked 50 minutes. How much did she earn?"
GSM8K = "calc_gsm8k_reward"
GSM8K_TOOL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tools" / "gsm8k_tool_config.yaml"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tool_turn(*responses):
    return "<|im_start|>user" + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in responses) + EOS + "\n"


def user_turn(text):
    return f"<|im_start|>user\n{text}{EOS}\n"


def assistant(text, complete=True):
    """Pieces of one generated turn: its text and EOS (loss 1), then the template's newline (loss 0)."""
    return [(text + EOS, 1), ("\n", 0)] if complete else [(text, 1)]


T_CALL = "She sold 48 / 2 = 24 clips in May, so 48 + 24 = 72.\n" + call(GSM8K, {"answer": "72"})
T_FINAL = "The tool says it is right. #### 72"


class ExplodingTool(BaseTool):
    async def execute(self, instance_id, parameters, **execute_kwargs):
        raise RuntimeError("boom")


class NapTool(BaseTool):
    """Sleeps ``config["seconds"]`` (or, with ``config["together"]``, waits until that rendezvous is full) then
    answers ``config["reply"]``."""

    async def execute(self, instance_id, parameters, **execute_kwargs):
        if "together" in self.config:
            await self.config["together"].arrive()
        await asyncio.sleep(self.config.get("seconds", 0))
        return self.config["reply"], 0.0, {}


def schema(name):
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                             "parameters": {"type": "object", "properties": {}}}}


def gsm8k_tools():
    return load_tools(GSM8K_TOOL_CONFIG)


def request(question=Q1, *, offset=0, row=0, tools_kwargs=None, interaction_kwargs=None, system=True):
    messages = ([Message("system", SYSTEM)] if system else []) + [Message("user", question)]
    if tools_kwargs is None:
        tools_kwargs = {GSM8K: {"create_kwargs": {"ground_truth": "72"}}}
    return AsyncRolloutRequest(batch_data_id=row, rollout_offset=offset, messages=messages,
                               tools_kwargs=tools_kwargs, interaction_kwargs=interaction_kwargs or {})


MULTI_TURN_KEYS = {f.name for f in dataclasses.fields(MultiTurnConfig)}


def rollout_config(**settings) -> RolloutConfig:
    """A rollout section from flat settings: ``multi_turn.*`` names go into ``multi_turn``."""
    settings = {"tokenization_sanity_check": "strict", **settings}
    multi_turn = {k: settings.pop(k) for k in list(settings) if k in MULTI_TURN_KEYS}
    return RolloutConfig(multi_turn=MultiTurnConfig(enable=True, **multi_turn), **settings)


def make_loop(tok, scripts, *, tools=None, interactions=None, prompt_length=512, response_length=256,
              stop_token_ids=(), **settings):
    engine = ScriptedEngine(tok, scripts)
    loop = AgentLoop(engine, tok, rollout_config(**settings), prompt_length=prompt_length,
                     response_length=response_length, tools=tools, interactions=interactions)
    if stop_token_ids:  # a sampling setting of the request, not of the loop
        base = sampling_params_for(loop.config, max_new_tokens=response_length)
        loop.test_sampling = dataclasses.replace(base, stop_token_ids=tuple(stop_token_ids))
    return loop, engine


def run(loop, requests, **kwargs):
    if getattr(loop, "test_sampling", None) is not None:
        kwargs.setdefault("sampling_params", loop.test_sampling)
    return asyncio.run(loop.run(requests, **kwargs))


def prompt_ids(tok, req):
    text = tok.apply_chat_template([m.to_dict() for m in req.messages[:req_prompt_messages(req)]],
                                   tools=req.tool_schemas or None, add_generation_prompt=True, tokenize=False)
    return enc(tok, text)


def req_prompt_messages(req):
    """Number of prompt messages: everything before the first assistant message."""
    roles = [m.role for m in req.messages]
    return roles.index("assistant") if "assistant" in roles else len(roles)


def check_sequence(tok, req, pieces):
    """The request's ids, loss mask, masks, positions and log-probs are exactly ``pieces``."""
    ids, loss, log_probs = [], [], []
    for text, mask in pieces:
        piece = enc(tok, text) if isinstance(text, str) else list(text)
        ids += piece
        loss += [mask] * len(piece)
        log_probs += fake_logprobs(len(piece)) if mask else [0.0] * len(piece)
    assert req.prompt_ids == prompt_ids(tok, req)
    assert req.prompt_loss_mask == [0] * req.prompt_len
    assert tok.decode(req.response_ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    assert req.response_ids == ids
    assert req.response_loss_mask == loss
    assert req.attention_mask == [1] * len(req.input_ids)
    assert req.position_ids == list(range(len(req.input_ids)))
    assert len(req.loss_mask) == len(req.input_ids)
    assert req.response_log_probs == pytest.approx(log_probs)


def check_equals_template(tok, req):
    """Incremental ids == the chat template applied to all final messages at once."""
    text = tok.apply_chat_template(req.message_dicts(), tools=req.tool_schemas or None, tokenize=False)
    assert req.input_ids == enc(tok, text)
    assert req.check_tokenization(tok) is None


# ---------------------------------------------------------------------------------- scenarios


def test_correct_tool_call_end_to_end_from_a_batch(tok):
    tools = gsm8k_tools()
    loop, engine = make_loop(tok, {Q1: [T_CALL, T_FINAL]}, tools=tools, seed=7)
    prompts = Batch(non_tensors={
        "raw_prompt": [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]],
        "tools_kwargs": [{GSM8K: {"create_kwargs": {"ground_truth": "72"}}}],
        "index": [41]})
    requests = run(loop, requests_from_batch(prompts, n=2))
    assert [(r.batch_data_id, r.rollout_offset) for r in requests] == [(0, 0), (0, 1)]
    req = requests[0]
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    assert req.index == 41
    response = "Current parsed answer=72 reward=1.0"
    pieces = [*assistant(T_CALL), (tool_turn(response), 0), (GEN, 0), *assistant(T_FINAL)]
    check_sequence(tok, req, pieces)
    check_equals_template(tok, req)
    assert req.message_dicts()[2:] == [
        {"role": "assistant", "content": "She sold 48 / 2 = 24 clips in May, so 48 + 24 = 72.",
         "tool_calls": [{"id": "0", "type": "function", "function": {"name": GSM8K, "arguments": {"answer": "72"}}}]},
        {"role": "tool", "content": response},
        {"role": "assistant", "content": T_FINAL}]
    assert req.reward_scores == {GSM8K: 1.0}
    assert req.tool_metrics == {GSM8K: [{"step_reward": 0.0, "reward": 1.0}]}
    assert req.metrics == {"num_tool_calls": 1.0, "num_assistant_turns": 2.0, "num_user_turns": 1.0}
    assert tools[GSM8K]._instances == {}  # released
    # The engine saw the incremental sequence and was given the budget left.
    second_call = [(ids, params) for ids, params in engine.calls if len(ids) > req.prompt_len][0]
    first_response = sum((enc(tok, text) for text, _ in pieces[:4]), [])
    assert second_call[0] == req.prompt_ids + first_response
    assert second_call[1].max_new_tokens == 256 - len(first_response)
    seeds = {params.seed for _, params in engine.calls}
    assert len(seeds) == 4  # per (sample, turn)
    # ... and the reward reaches the batch.
    batch = batch_from_requests(requests, 512, 256, tok.pad_token_id)
    assert list(batch["reward_scores"]) == [{GSM8K: 1.0}, {GSM8K: 1.0}]
    assert list(batch["finish_reason"]) == ["stop", "stop"]
    assert list(batch["num_turns"]) == [3, 3]
    num = len(req.response_ids)
    assert batch["response_mask"][0, :num].tolist() == req.response_loss_mask
    assert batch["rollout_log_probs"][0, :num].tolist() == pytest.approx(req.response_log_probs)


def test_malformed_json_is_answered_with_an_error(tok):
    broken = 'Let me check.\n<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}\n</tool_call>'
    loop, _ = make_loop(tok, {Q1: [broken, T_FINAL]}, tools=gsm8k_tools())
    [req] = run(loop, [request()])
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    error = req.messages[3].content
    assert req.messages[3].role == "tool"
    assert error == ('Error: tool call 0 could not be parsed: the hermes parser could not read it. Write each call '
                     'as <tool_call>{"name":"<function-name>", "arguments":<arguments>}</tool_call>.')
    # The broken turn is kept verbatim (no structured calls), so it re-renders to what was generated.
    assert req.message_dicts()[2] == {"role": "assistant", "content": broken}
    check_sequence(tok, req, [*assistant(broken), (tool_turn(error), 0), (GEN, 0), *assistant(T_FINAL)])
    check_equals_template(tok, req)
    assert req.metrics["num_tool_call_parse_errors"] == 1 and req.metrics["num_tool_calls"] == 1
    assert req.reward_scores == {GSM8K: 0.0}


def test_a_call_the_parser_skips_is_still_answered(tok):
    """qwen25 reads block by block and leaves a broken block out of its calls: the loop still answers and counts it."""
    turn = "Checking.\n" + call(GSM8K, {"answer": "72"}) + "\n<tool_call>\n{oops\n</tool_call>"
    loop, _ = make_loop(tok, {Q1: [turn, T_FINAL]}, tools=gsm8k_tools(), format="qwen25")
    [req] = run(loop, [request()])
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    error = ('Error: tool call 1 could not be parsed: the qwen25 parser could not read it. Write each call as '
             '<tool_call>\n{"name":"<function-name>", "arguments":<arguments>}\n</tool_call>.')
    check_sequence(tok, req, [*assistant(turn), (tool_turn("Current parsed answer=72 reward=1.0", error), 0),
                              (GEN, 0), *assistant(T_FINAL)])
    check_equals_template(tok, req)
    assert req.message_dicts()[2] == {"role": "assistant", "content": turn}  # verbatim: a call was unreadable
    assert req.metrics["num_tool_calls"] == 2 and req.metrics["num_tool_call_parse_errors"] == 1
    assert req.reward_scores == {GSM8K: 1.0}


def test_the_format_setting_chooses_the_parser(tok):
    """A Mistral-format call runs under format=mistral and is plain text under the default (hermes)."""
    turn = "Checking. [TOOL_CALLS] [" + json.dumps({"name": GSM8K, "arguments": {"answer": "72"}}) + "]"
    loop, _ = make_loop(tok, {Q1: [turn, T_FINAL]}, tools=gsm8k_tools(), format="mistral")
    [req] = run(loop, [request()])
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    check_sequence(tok, req, [*assistant(turn), (tool_turn("Current parsed answer=72 reward=1.0"), 0), (GEN, 0),
                              *assistant(T_FINAL)])
    check_equals_template(tok, req)  # the Qwen template renders calls its own way: the turn is kept verbatim
    assert req.metrics["num_tool_calls"] == 1 and req.reward_scores == {GSM8K: 1.0}
    loop, engine = make_loop(tok, {Q1: [turn, T_FINAL]}, tools=gsm8k_tools())
    [req] = run(loop, [request()])
    assert len(engine.calls) == 1 and "num_tool_calls" not in req.metrics and req.reward_scores == {GSM8K: 0.0}


def test_unknown_and_unexposed_tools_are_answered_with_errors(tok):
    tools = {**gsm8k_tools(), "nap": NapTool({"seconds": 0, "reply": "zz"}, schema("nap"))}
    turn = "Searching.\n" + call("web_search", {"q": "clips"}) + "\n" + call("nap", {})
    loop, _ = make_loop(tok, {Q1: [turn, T_FINAL]}, tools=tools)
    [req] = run(loop, [request()])  # the row only names calc_gsm8k_reward: "nap" is not shown to it
    assert [s["function"]["name"] for s in req.tool_schemas] == [GSM8K]
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    errors = ["Error: unknown tool 'web_search'; available tools: calc_gsm8k_reward.",
              "Error: unknown tool 'nap'; available tools: calc_gsm8k_reward."]
    check_sequence(tok, req, [*assistant(turn), (tool_turn(*errors), 0), (GEN, 0), *assistant(T_FINAL)])
    check_equals_template(tok, req)
    assert [c["function"]["name"] for c in req.message_dicts()[2]["tool_calls"]] == ["web_search", "nap"]
    assert req.metrics["num_unknown_tool_calls"] == 2 and req.metrics["num_tool_calls"] == 2


def test_tool_exception_is_contained_in_its_request(tok):
    tools = {**gsm8k_tools(), "explode": ExplodingTool({}, schema("explode"))}
    boom = "Trying the tool.\n" + call("explode", {})
    loop, _ = make_loop(tok, {Q1: [boom, "Never mind. #### 72"], Q2: [T_CALL, T_FINAL]}, tools=tools)
    failing, healthy = run(loop, [request(Q1, tools_kwargs={"explode": {}}),
                                  request(Q2, row=1, tools_kwargs={GSM8K: {"create_kwargs": {"ground_truth": "72"}}})])
    assert failing.state is RequestState.COMPLETED and failing.finish_reason is FinishReasonType.STOP
    error = "Error: tool 'explode' failed: RuntimeError: boom"
    check_sequence(tok, failing, [*assistant(boom), (tool_turn(error), 0), (GEN, 0),
                                  *assistant("Never mind. #### 72")])
    check_equals_template(tok, failing)
    assert failing.metrics["num_tool_exceptions"] == 1
    assert failing.reward_scores == {"explode": 0.0}
    assert healthy.state is RequestState.COMPLETED and healthy.reward_scores == {GSM8K: 1.0}
    assert "num_tool_exceptions" not in healthy.metrics


@pytest.mark.parametrize("side, kept", [("middle", "a" * 10 + "b" * 6 + "...(truncated)..." + "b" * 6 + "c" * 10),
                                         ("left", "a" * 10 + "b" * 22 + "...(truncated)"),
                                         ("right", "(truncated)..." + "b" * 22 + "c" * 10)])
def test_long_and_non_text_tool_replies(tok, side, kept):
    """A reply longer than ``max_tool_response_length`` characters is cut as verl cuts it and counted (a 10 MB
    reply used to cost 17 s and 3.2 GB per call); a dict becomes JSON; an object that is not text is answered
    with an error and counted (it used to pass as ``str(x)`` silently)."""
    big = "a" * 10 + "b" * (10 * 2**20) + "c" * 10
    tools = {"big": NapTool({"seconds": 0, "reply": big}, schema("big")),
             "data": NapTool({"seconds": 0, "reply": {"sum": 72, "ok": True}}, schema("data")),
             "odd": NapTool({"seconds": 0, "reply": object()}, schema("odd"))}
    turn = "Asking.\n" + call("big", {}) + "\n" + call("data", {}) + "\n" + call("odd", {})
    loop, _ = make_loop(tok, {Q1: [turn, "Done. #### 72"]}, tools=tools, max_tool_response_length=32,
                        tool_response_truncate_side=side)
    [req] = run(loop, [request(tools_kwargs={})])
    replies = [kept, '{"sum": 72, "ok": true}', "Error: tool 'odd' returned a object, not text."]
    check_sequence(tok, req, [*assistant(turn), (tool_turn(*replies), 0), (GEN, 0), *assistant("Done. #### 72")])
    assert req.metrics["num_tool_responses_truncated"] == 1 and req.metrics["num_tool_bad_responses"] == 1


def test_tool_timeout(tok):
    tools = {"nap": NapTool({"seconds": 30, "reply": "zz"}, schema("nap"))}
    turn = "Waiting.\n" + call("nap", {})
    loop, _ = make_loop(tok, {Q1: [turn, "Too slow. #### 72"]}, tools=tools, tool_timeout_s=0.2)
    [req] = run(loop, [request(tools_kwargs={})])  # the 30 s nap's reply would be "zz"
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    error = "Error: tool 'nap' timed out after 0.2 s."
    check_sequence(tok, req, [*assistant(turn), (tool_turn(error), 0), (GEN, 0), *assistant("Too slow. #### 72")])
    check_equals_template(tok, req)
    assert req.metrics["num_timeouts/execute"] == 1


@pytest.mark.parametrize("limits", [{"max_turns": 2}, {"max_turns": 5, "max_user_turns": 1}])
def test_turn_limits_end_the_conversation(tok, limits):
    first = "Maybe 70.\n" + call(GSM8K, {"answer": "70"})
    loop, engine = make_loop(tok, {Q1: [first, T_CALL, T_FINAL]}, tools=gsm8k_tools(), **limits)
    [req] = run(loop, [request()])
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.MAX_TURNS
    assert len(engine.calls) == 2
    check_sequence(tok, req, [*assistant(first), (tool_turn("Current parsed answer=70 reward=0.0"), 0), (GEN, 0),
                              *assistant(T_CALL)])
    check_equals_template(tok, req)
    # The second turn's call was not executed: the reward is the first (wrong) answer's.
    assert req.reward_scores == {GSM8K: 0.0}
    assert req.metrics["num_tool_calls"] == 1 and req.metrics["num_tool_calls_skipped"] == 1
    assert req.messages[-1].role == "assistant" and req.messages[-1].tool_calls


def test_budget_exhausted_inside_an_assistant_turn(tok):
    head = [*assistant(T_CALL), (tool_turn("Current parsed answer=72 reward=1.0"), 0), (GEN, 0)]
    used = sum(len(enc(tok, text)) for text, _ in head)
    loop, engine = make_loop(tok, {Q1: [T_CALL, T_FINAL]}, tools=gsm8k_tools(), response_length=used + 5)
    [req] = run(loop, [request()])
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.LENGTH
    assert engine.calls[-1][1].max_new_tokens == 5
    cut = enc(tok, T_FINAL)[:5]
    check_sequence(tok, req, [*head, (cut, 1)])
    assert len(req.response_ids) == used + 5
    assert req.messages[-1].content == tok.decode(cut)
    assert req.check_tokenization(tok) is None
    assert "response_truncated" not in req.metrics
    assert req.reward_scores == {GSM8K: 1.0}


@pytest.mark.parametrize("room_after_call", [6, 20, 22])
def test_budget_exhausted_by_a_tool_response(tok, room_after_call):
    # The tool turn is 20 tokens and the next generation prompt 5: 6 cuts the tool turn, 20
    # leaves no room for a generation prompt, 22 leaves no room for a generated token.
    tool_text = tool_turn("Current parsed answer=72 reward=1.0")
    assert len(enc(tok, tool_text)) == 20 and len(enc(tok, GEN)) == 5
    first = len(enc(tok, T_CALL + EOS + "\n"))
    loop, engine = make_loop(tok, {Q1: [T_CALL, T_FINAL]}, tools=gsm8k_tools(),
                             response_length=first + room_after_call)
    [req] = run(loop, [request()])
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.LENGTH
    assert len(engine.calls) == 1
    kept = enc(tok, tool_text)[:room_after_call]
    check_sequence(tok, req, [*assistant(T_CALL), (kept, 0)])
    assert len(req.response_ids) == min(first + room_after_call, first + 20)
    assert req.metrics.get("response_truncated", 0.0) == (1.0 if room_after_call < 20 else 0.0)
    assert req.messages[-1].content == "Current parsed answer=72 reward=1.0"  # messages are not truncated
    assert req.reward_scores == {GSM8K: 1.0}


def test_interaction_turn(tok):
    interactions = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    wrong, right = "I think it is #### 70", "Let me redo it: 48 + 24 = 72. #### 72"
    loop, _ = make_loop(tok, {Q1: [wrong, right]}, interactions=interactions)
    [req] = run(loop, [request(tools_kwargs={}, interaction_kwargs={"query": Q1, "ground_truth": "72"})])
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    check_sequence(tok, req, [*assistant(wrong), (user_turn(Gsm8kInteraction.RETRY), 0), (GEN, 0),
                              *assistant(right)])
    check_equals_template(tok, req)
    assert [m["role"] for m in req.message_dicts()] == ["system", "user", "assistant", "user", "assistant"]
    assert req.interaction_scores == [0.0, 1.0]
    assert req.reward_scores == {"gsm8k": 1.0}
    assert req.num_user_turns == 1
    assert interactions["gsm8k"]._instances == {}


def test_interaction_at_the_turn_limit_ends_without_a_reply(tok):
    loop, _ = make_loop(tok, {Q1: ["#### 70"]}, interactions={"gsm8k": Gsm8kInteraction({})}, max_turns=1)
    [req] = run(loop, [request(tools_kwargs={}, interaction_kwargs={"ground_truth": "72"})])
    assert req.finish_reason is FinishReasonType.MAX_TURNS
    check_sequence(tok, req, assistant("#### 70"))
    assert req.interaction_scores == [0.0]


def test_several_calls_in_one_turn_run_concurrently(tok):
    together = Together(2)  # each call answers only once both are running: one after another they never would
    tools = {"nap_a": NapTool({"together": together, "reply": "slept a"}, schema("nap_a")),
             "nap_b": NapTool({"together": together, "reply": "slept b"}, schema("nap_b"))}
    turn = call("nap_a", {}) + "\n" + call("nap_b", {})
    loop, _ = make_loop(tok, {Q1: [turn, "Rested. #### 72"]}, tools=tools)
    [req] = run(loop, [request(tools_kwargs={})])
    check_sequence(tok, req, [*assistant(turn), (tool_turn("slept a", "slept b"), 0), (GEN, 0),
                              *assistant("Rested. #### 72")])
    check_equals_template(tok, req)


def test_requests_run_concurrently_and_come_back_sorted(tok):
    questions = [f"Question number {i}: what is {i} + {i}?" for i in range(3)]
    # All six answer once all six are in the engine; later rows then answer sooner, so completion order is the
    # reverse of the input order.
    together = Together(6)
    scripts = {q: [Turn(f"#### {2 * i}", delay_s=0.3 - 0.1 * i, together=together)] for i, q in enumerate(questions)}
    loop, _ = make_loop(tok, scripts)
    batch = Batch(non_tensors={"raw_prompt": [[{"role": "user", "content": q}] for q in questions]})
    requests = run(loop, requests_from_batch(batch, n=2))
    assert [(r.batch_data_id, r.rollout_offset) for r in requests] == [(i, k) for i in range(3) for k in range(2)]
    for r in requests:
        assert r.messages[-1].content == f"#### {2 * r.batch_data_id}"
        check_sequence(tok, r, assistant(f"#### {2 * r.batch_data_id}"))


def test_stop_token_other_than_eos(tok):
    # Stopping at </tool_call>: the template's "<|im_end|>\n" closes the turn as scaffolding (loss 0).
    stop_id = tok.convert_tokens_to_ids("</tool_call>")
    loop, _ = make_loop(tok, {Q1: [T_CALL, T_FINAL]}, tools=gsm8k_tools(), stop_token_ids=(stop_id,))
    [req] = run(loop, [request()])
    assert req.finish_reason is FinishReasonType.STOP
    check_sequence(tok, req, [(T_CALL, 1), (EOS + "\n", 0), (tool_turn("Current parsed answer=72 reward=1.0"), 0),
                              (GEN, 0), *assistant(T_FINAL)])
    check_equals_template(tok, req)


def test_non_canonical_call_json_is_kept_verbatim(tok):
    compact = "Checking.\n<tool_call>\n" + json.dumps({"name": GSM8K, "arguments": {"answer": "72"}},
                                                      separators=(",", ":")) + "\n</tool_call>"
    loop, _ = make_loop(tok, {Q1: [compact, T_FINAL]}, tools=gsm8k_tools())
    [req] = run(loop, [request()])
    assert req.reward_scores == {GSM8K: 1.0}  # the call ran
    assert req.message_dicts()[2] == {"role": "assistant", "content": compact}
    check_equals_template(tok, req)
    assert "template_mismatch_turns" not in req.metrics


@pytest.mark.parametrize("mode", ["strict", "warn", "off"])
def test_tokenization_sanity_check_detects_a_mismatch(tok, mode):
    # "#### 72" written one character per token: the text is right but the tokenizer would
    # never produce these ids, so re-tokenising the conversation gives different ids.
    odd = tuple(i for ch in "#### 72" for i in enc(tok, ch)) + (tok.eos_token_id,)
    assert list(odd[:-1]) != enc(tok, "#### 72")
    loop, _ = make_loop(tok, {Q1: [Turn(ids=odd)]}, tokenization_sanity_check=mode)
    [req] = run(loop, [request(tools_kwargs={})])
    assert req.check_tokenization(tok) == req.prompt_len
    if mode == "strict":
        assert req.state is RequestState.FAILED and req.finish_reason is FinishReasonType.ABORT
        assert "differ from tokenising the whole conversation" in req.error
    else:
        assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReasonType.STOP
    assert req.metrics.get("tokenization_mismatch", 0.0) == (0.0 if mode == "off" else 1.0)


# ---------------------------------------------------------------------------------- failures


def test_engine_abort_fails_only_that_request(tok):
    tools = gsm8k_tools()
    loop, _ = make_loop(tok, {Q1: [Turn(abort=True)], Q2: [T_CALL, T_FINAL]}, tools=tools)
    aborted, fine = run(loop, [request(Q1), request(Q2, row=1)])
    assert aborted.state is RequestState.FAILED and aborted.finish_reason is FinishReasonType.ABORT
    assert "engine aborted turn 1" in aborted.error
    assert fine.state is RequestState.COMPLETED and fine.reward_scores == {GSM8K: 1.0}
    assert tools[GSM8K]._instances == {}
    batch = batch_from_requests([aborted, fine], 512, 256, tok.pad_token_id)
    assert list(batch["finish_reason"]) == ["abort", "stop"]
    assert batch["response_mask"][0].sum() == 0  # a failed request does not train
    assert batch["response_mask"][1].sum() == sum(fine.response_loss_mask)


def test_overlong_prompt_fails_the_request(tok):
    loop, engine = make_loop(tok, {Q1: [T_FINAL]}, tools=gsm8k_tools(), prompt_length=40)
    [req] = run(loop, [request()])
    assert req.state is RequestState.FAILED and req.finish_reason is FinishReasonType.ABORT
    assert "more than prompt_length=40" in req.error
    assert len(req.prompt_ids) == 40 and req.response_ids == [] and engine.calls == []
    assert req.metrics["prompt_truncated"] == 1


def test_tool_create_failure_fails_the_request(tok):
    tools = gsm8k_tools()
    loop, engine = make_loop(tok, {Q1: [T_FINAL]}, tools=tools)
    [req] = run(loop, [request(tools_kwargs={GSM8K: {}})])
    assert req.state is RequestState.FAILED and "needs create_kwargs.ground_truth" in req.error
    assert engine.calls == [] and tools[GSM8K]._instances == {}


class HangingTool(BaseTool):
    """A GSM8K-like tool whose ``config["hang"]`` hook never returns: ``"async"`` awaits forever, ``"blocking"``
    blocks the event loop's thread (the mistake the hook runner contains) until ``config["release"]`` (a
    ``threading.Event``) is set, 60 s at most, having set ``config["blocked"]`` when there is one. Other hooks
    behave."""

    async def _maybe_hang(self, hook):
        if self.config.get("hook") != hook:
            return
        if self.config["hang"] == "blocking":
            if "blocked" in self.config:
                self.config["blocked"].set()
            self.config["release"].wait(60)
        else:
            await asyncio.Event().wait()

    async def create(self, instance_id=None, **kwargs):
        await self._maybe_hang("create")
        return await super().create(instance_id)

    async def execute(self, instance_id, parameters, **kwargs):
        await self._maybe_hang("execute")
        return "ok", self.config.get("step_reward", 0.0), {}

    async def calc_reward(self, instance_id, **kwargs):
        await self._maybe_hang("calc_reward")
        return self.config.get("reward", 1.0)

    async def release(self, instance_id, **kwargs):
        await self._maybe_hang("release")
        await super().release(instance_id)


@pytest.mark.parametrize("hang", ["async", "blocking"])
@pytest.mark.parametrize("hook", ["create", "calc_reward", "release", "execute"])
def test_every_tool_hook_is_bounded_and_counted(tok, hook, hang):
    """A tool hook that never returns (awaiting forever, or blocking its thread) costs the
    time limit, is counted as ``num_timeouts/<hook>``, and fails the request only where its result matters
    (create, calc_reward); execute answers the model with an error; release is counted and logged."""
    release = threading.Event()
    tools = {"hang": HangingTool({"hook": hook, "hang": hang, "release": release}, schema("hang"))}
    turn = "Checking.\n" + call("hang", {})
    loop, _ = make_loop(tok, {Q1: [turn, "Done. #### 72"]}, tools=tools, tool_timeout_s=0.3)
    try:
        [req] = run(loop, [request(tools_kwargs={})])  # finished while the blocking hook still blocks its thread
    finally:
        release.set()
    assert req.metrics[f"num_timeouts/{hook}"] == 1
    if hook in ("create", "calc_reward"):
        assert req.state is RequestState.FAILED and req.finish_reason is FinishReasonType.ABORT
        assert f"'hang' {hook} timed out after 0.3 s" in req.error
        if hang == "blocking":
            assert "the hook loop has been blocked" in req.error
    else:
        assert req.state is RequestState.COMPLETED and req.reward_scores == {"hang": 1.0}
    if hook == "execute":
        assert req.messages[3].content == "Error: tool 'hang' timed out after 0.3 s."


def test_a_blocking_tool_does_not_stall_the_event_loop(tok):
    """While a tool blocks its thread, a coroutine on the agent loop's event loop keeps ticking: the tool is
    released only once the ticker has ticked five times during the block (the block would otherwise last until
    the tool's 60 s guard, and its reward be lost), on a machine of any speed."""
    release, blocked = threading.Event(), threading.Event()
    config = {"hook": "calc_reward", "hang": "blocking", "release": release, "blocked": blocked}
    tools = {"hang": HangingTool(config, schema("hang"))}
    loop, _ = make_loop(tok, {Q1: ["#### 72"]}, tools=tools, tool_timeout_s=None)
    ticks_while_blocked = []

    async def main():
        async def ticker():
            while True:
                if blocked.is_set():
                    ticks_while_blocked.append(None)
                    if len(ticks_while_blocked) == 5:
                        release.set()
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(ticker())
        try:
            return await loop.run([request(tools_kwargs={})])
        finally:
            task.cancel()
            release.set()

    [req] = asyncio.run(main())
    assert len(ticks_while_blocked) >= 5
    assert req.state is RequestState.COMPLETED and req.reward_scores == {"hang": 1.0}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_tool_rewards_are_refused(tok, value):
    tools = {"hang": HangingTool({"reward": value}, schema("hang"))}
    loop, _ = make_loop(tok, {Q1: ["#### 72"]}, tools=tools)
    [req] = run(loop, [request(tools_kwargs={})])
    assert req.state is RequestState.FAILED
    assert f"'hang' final reward is {value}; rewards must be finite" in req.error
    step = {"hang": HangingTool({"step_reward": value}, schema("hang"))}
    loop, _ = make_loop(tok, {Q1: ["Checking.\n" + call("hang", {}), "#### 72"]}, tools=step)
    [req] = run(loop, [request(tools_kwargs={})])
    assert req.state is RequestState.COMPLETED and req.metrics["num_tool_exceptions"] == 1
    assert req.messages[3].content == (f"Error: tool 'hang' failed: ValueError: tool 'hang' execute's step reward "
                                       f"is {value}; rewards must be finite")


def test_interaction_hooks_are_bounded(tok):
    class SlowUser(Gsm8kInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            await asyncio.Event().wait()

    loop, _ = make_loop(tok, {Q1: ["#### 70"]}, interactions={"gsm8k": SlowUser({"name": "gsm8k"})},
                        tool_timeout_s=0.2)
    [req] = run(loop, [request(tools_kwargs={}, interaction_kwargs={"name": "gsm8k", "ground_truth": "72"})])
    assert req.state is RequestState.FAILED and req.metrics["num_timeouts/generate_response"] == 1
    assert "'gsm8k' generate_response timed out after 0.2 s" in req.error


def test_engine_exception_propagates_and_releases_tools(tok):
    tools = gsm8k_tools()
    loop, _ = make_loop(tok, {"no such question": [T_FINAL]}, tools=tools)
    with pytest.raises(ValueError, match="prompt matches scripts"):
        run(loop, [request(), request(Q2, row=1)])
    assert tools[GSM8K]._instances == {}


def test_run_refuses_config_mistakes(tok):
    loop, _ = make_loop(tok, {Q1: [T_FINAL]}, tools=gsm8k_tools(),
                        interactions={"a": Gsm8kInteraction({}), "b": Gsm8kInteraction({})})
    with pytest.raises(ValueError, match=r"tools_kwargs names tools \['search'\] that the tool config does not"):
        run(loop, [request(tools_kwargs={"search": {}})])
    with pytest.raises(ValueError, match="interaction_kwargs has no 'name' and 2 interactions"):
        run(loop, [request(interaction_kwargs={"ground_truth": "1"})])
    with pytest.raises(ValueError, match="interaction 'c' is not configured"):
        run(loop, [request(interaction_kwargs={"name": "c"})])
    done = request()
    done.state = RequestState.COMPLETED
    with pytest.raises(ValueError, match="AgentLoop.run takes PENDING requests"):
        run(loop, [done])
    engine = ScriptedEngine(tok, {})
    config = rollout_config()
    with pytest.raises(ValueError, match="key tools by their function name"):
        AgentLoop(engine, tok, config, prompt_length=8, response_length=8, tools={"other": gsm8k_tools()[GSM8K]})
    with pytest.raises(ValueError, match="both tools and interactions"):
        AgentLoop(engine, tok, config, prompt_length=8, response_length=8, tools=gsm8k_tools(),
                  interactions={GSM8K: Gsm8kInteraction({})})


@pytest.mark.parametrize("overrides, message", [
    ({"response_length": 0}, "response_length must be >= 1"),
    ({"max_model_len": 8}, "leaves no room for a response"),
    ({"max_turns": 0}, "max_turns must be > 0"),
    ({"max_user_turns": -1}, "max_user_turns must be >= 0"),
    ({"tool_timeout_s": 0}, "tool_timeout_s must be > 0"),
    ({"format": "llama-3"}, "format='llama-3' is unknown"),
    ({"tokenization_sanity_check": "loose"}, "tokenization_sanity_check='loose' is unknown"),
    ({"top_p": 0}, "top_p must be in"),
])
def test_config_validation(overrides, message):
    widths = {"prompt_length": 8, "response_length": overrides.pop("response_length", 8)}
    with pytest.raises(ValueError, match=message):
        AgentLoop(ScriptedEngine(None, {}), None, rollout_config(**overrides), **widths)


def test_sampling_override_and_max_model_len(tok):
    from megarl.engines.engine import SamplingParams

    loop, engine = make_loop(tok, {Q1: [T_FINAL]}, prompt_length=80, max_model_len=81, seed=3)
    [req] = run(loop, [request(tools_kwargs={}, system=False)],
                sampling_params=SamplingParams(max_new_tokens=100, temperature=0.0))
    params = engine.calls[0][1]
    assert params.temperature == 0.0 and params.seed is None  # the override's (unseeded) settings
    assert params.max_new_tokens == 81 - req.prompt_len == 4
    assert req.finish_reason is FinishReasonType.LENGTH and len(req.input_ids) == 81
    check_sequence(tok, req, [(enc(tok, T_FINAL)[:4], 1)])


# ---------------------------------------------------------------------------------- batch <-> requests


def test_requests_from_batch(tok):
    batch = Batch(non_tensors={
        "raw_prompt": [[{"role": "user", "content": "a"}], [{"role": "system", "content": "s"},
                                                            {"role": "user", "content": "b", "name": None}]],
        "tools_kwargs": [{}, {GSM8K: {"create_kwargs": {"ground_truth": "3"}}}],
        "interaction_kwargs": [{"ground_truth": "1"}, {}],
        "index": [10, 11]})
    requests = requests_from_batch(batch, n=3)
    assert [(r.batch_data_id, r.rollout_offset, r.index) for r in requests] == [
        (0, 0, 10), (0, 1, 10), (0, 2, 10), (1, 0, 11), (1, 1, 11), (1, 2, 11)]
    assert all(r.state is RequestState.PENDING for r in requests)
    assert len({r.request_id for r in requests}) == 6
    assert requests[3].message_dicts() == [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]
    assert requests[4].tools_kwargs == {GSM8K: {"create_kwargs": {"ground_truth": "3"}}}
    assert requests[4].tools_kwargs is not requests[5].tools_kwargs
    assert requests[0].interaction_kwargs == {"ground_truth": "1"}
    with pytest.raises(ValueError, match="return_raw_chat=True"):
        requests_from_batch(Batch(non_tensors={"index": [1]}), n=1)
    with pytest.raises(ValueError, match="rollout.n must be >= 1"):
        requests_from_batch(batch, n=0)
    with pytest.raises(ValueError, match="batch row 0 .*the prompt must be a list of chat messages"):
        requests_from_batch(Batch(non_tensors={"raw_prompt": ["plain text"]}), n=1)


def _finished(prompt, response, loss, log_probs, state=RequestState.COMPLETED):
    req = AsyncRolloutRequest(batch_data_id=0, rollout_offset=0, messages=[Message("user", "x")], state=state,
                              finish_reason=FinishReasonType.STOP, reward_scores={"t": 0.5},
                              metrics={"num_tool_calls": 1.0}, num_assistant_turns=1)
    ids = prompt + response
    req.input_ids, req.attention_mask = ids, [1] * len(ids)
    req.position_ids, req.loss_mask = list(range(len(ids))), [0] * len(prompt) + loss
    req.prompt_len, req.response_log_probs = len(prompt), log_probs
    return req


def test_batch_from_requests_hand_checked():
    a = _finished([11, 12, 13], [21, 22, 23], [1, 1, 0], [-0.5, -0.25, 0.0])
    b = _finished([14, 15], [24], [1], [-1.0])
    batch = batch_from_requests([a, b], prompt_length=4, response_length=4, pad_token_id=0)
    t = {key: value.tolist() for key, value in batch.tensors.items()}
    assert t["prompts"] == [[0, 11, 12, 13], [0, 0, 14, 15]]
    assert t["responses"] == [[21, 22, 23, 0], [24, 0, 0, 0]]
    assert t["input_ids"] == [[0, 11, 12, 13, 21, 22, 23, 0], [0, 0, 14, 15, 24, 0, 0, 0]]
    assert t["attention_mask"] == [[0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0]]
    assert t["position_ids"] == [[0, 0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4, 5]]
    assert t["response_mask"] == [[1, 1, 0, 0], [1, 0, 0, 0]]  # the requests' own loss masks: what trains
    assert "loss_mask" not in t
    assert t["rollout_log_probs"] == [[-0.5, -0.25, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]
    assert batch["input_ids"].dtype == torch.long and batch["rollout_log_probs"].dtype == torch.float32
    assert list(batch["finish_reason"]) == ["stop", "stop"]
    assert list(batch["reward_scores"]) == [{"t": 0.5}, {"t": 0.5}]
    assert list(batch["metrics"]) == [{"num_tool_calls": 1.0}, {"num_tool_calls": 1.0}]
    assert list(batch["num_turns"]) == [1, 1]
    assert batch["messages"][1] == [{"role": "user", "content": "x"}]
    assert isinstance(batch["messages"], np.ndarray)
    # Without log-probs on every request there is no rollout_log_probs field.
    b.response_log_probs = None
    assert "rollout_log_probs" not in batch_from_requests([a, b], 4, 4, 0)
    with pytest.raises(ValueError, match="more than prompt_length=2"):
        batch_from_requests([a], prompt_length=2, response_length=4, pad_token_id=0)
    pending = _finished([1], [2], [1], [0.0], state=RequestState.RUNNING)
    with pytest.raises(ValueError, match="is running; run AgentLoop.run on it first"):
        batch_from_requests([pending], 4, 4, 0)
