"""RolloutManager: the real HFEngine on the tiny model through the batch-level path, and the multi-turn branch."""

import asyncio
import copy
import importlib.util

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch
from megarl.data.dataset import collate
from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer
from megarl.rollout.engine import GenerateOutput, SamplingParams
from megarl.rollout.hf_engine import HFEngine
from megarl.config import MultiTurnConfig, RolloutConfig, ValKwargs
from megarl.rollout.manager import RolloutManager
from tests.unit.test_hf_engine import eos_prone

P, R = 24, 10
TEXTS = ["What is 3 + 4?", "Hi", "The quick brown fox jumps over the lazy dog.", "#### 12", "system user",
         "What is 21 + 5?"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return eos_prone(build_tiny_model(tokenizer, seed=0), tokenizer)


@pytest.fixture(scope="module")
def batch(tokenizer):
    rows = [{"input_ids": torch.tensor(tokenizer.encode(text)), "raw_prompt": [{"role": "user", "content": text}],
             "data_source": "tiny", "index": i} for i, text in enumerate(TEXTS)]
    return collate(rows, pad_token_id=tokenizer.pad_token_id, pad_to=P)


def make_manager(model, tokenizer, num_engines=2, **config):
    engines = [HFEngine(copy.deepcopy(model), tokenizer, seed=i) for i in range(num_engines)]
    return RolloutManager(engines, tokenizer, RolloutConfig(**config), prompt_length=P, response_length=R)


def record_calls(engine):
    calls = []
    generate = engine.generate

    def recording(input_ids, params, return_logprob=False):
        calls.append((len(input_ids), params))
        return generate(input_ids, params, return_logprob)

    engine.generate = recording
    return calls


def test_hf_engines_through_the_manager_n4(model, tokenizer, batch):
    n, temperature = 4, 0.9
    manager = make_manager(model, tokenizer, n=n, temperature=temperature, seed=0)
    calls = [record_calls(engine) for engine in manager.engines]
    out = manager.generate(batch)
    B, N, eos, pad = len(batch), len(batch) * n, tokenizer.eos_token_id, tokenizer.pad_token_id

    # Both replicas served a contiguous half of the prompts with all of their samples.
    assert [[c[0] for c in engine_calls] for engine_calls in calls] == [[B // 2 * n], [B // 2 * n]]
    assert calls[0][0][1].seed != calls[1][0][1].seed
    shapes = {"prompts": (N, P), "responses": (N, R), "input_ids": (N, P + R), "attention_mask": (N, P + R),
              "position_ids": (N, P + R), "response_mask": (N, R), "loss_mask": (N, P + R),
              "rollout_log_probs": (N, R)}
    assert {k: tuple(v.shape) for k, v in out.tensors.items()} == shapes
    assert out.meta == {"temperature": temperature, "do_sample": True, "validate": False}

    # Samples of a prompt are adjacent and carry the prompt's non-tensors (Batch.repeat(n, interleave=True)).
    repeated = batch.repeat(n, interleave=True)
    assert torch.equal(out["prompts"], repeated["input_ids"])
    assert torch.equal(out["attention_mask"][:, :P], repeated["attention_mask"])
    for key in batch.non_tensors:
        assert np.array_equal(out[key], repeated[key]), key
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], dim=1))

    # Response masks: ones exactly up to and including the first EOS; padding after.
    reasons = list(out["finish_reason"])
    assert {"stop", "length"} <= set(reasons)
    for row in range(N):
        response = out["responses"][row].tolist()
        eos_at = response.index(eos) if eos in response else None
        length = R if eos_at is None else eos_at + 1
        assert reasons[row] == ("length" if eos_at is None else "stop")
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (R - length)
        assert response[length:] == [pad] * (R - length)
        assert out["rollout_log_probs"][row, length:].abs().sum() == 0
    assert torch.equal(out["attention_mask"][:, P:], out["response_mask"])
    assert torch.equal(out["loss_mask"], torch.cat([torch.zeros(N, P, dtype=torch.long), out["response_mask"]], 1))
    # The n samples of a prompt differ (each row has its own sampling stream).
    assert len({tuple(r) for r in out["responses"][:n].tolist()}) > 1

    # Positions: from 0 on the prompt's first token, continuing through the response.
    prompt_len = out["attention_mask"][:, :P].sum(dim=1)
    for row in range(N):
        start = P - int(prompt_len[row])
        assert out["position_ids"][row].tolist() == [0] * start + list(range(P + R - start))

    # rollout_log_probs equal a separate forward over the assembled batch.
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits.float()
    logprobs = torch.log_softmax(logits[:, P - 1:-1] / temperature, dim=-1)
    expected = logprobs.gather(-1, out["responses"][..., None]).squeeze(-1) * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-5, rtol=0)


def test_seeded_manager_is_reproducible(model, tokenizer, batch):
    first = make_manager(model, tokenizer, n=2, seed=3).generate(batch)
    second = make_manager(model, tokenizer, n=2, seed=3).generate(batch)
    for key in first.tensors:
        assert torch.equal(first[key], second[key]), key
    other = make_manager(model, tokenizer, n=2, seed=4).generate(batch)
    assert not torch.equal(first["responses"], other["responses"])


def test_validate_and_greedy_use_one_sample(model, tokenizer, batch):
    manager = make_manager(model, tokenizer, n=4, num_engines=3, val_kwargs=ValKwargs(temperature=0.0))
    calls = [record_calls(engine) for engine in manager.engines]
    out = manager.generate(batch, validate=True)
    assert len(out) == len(batch) and out.meta == {"temperature": 1.0, "do_sample": False, "validate": True}
    assert [c[0][0] for c in calls] == [2, 2, 2]
    assert all(c[0][1].greedy for c in calls)
    greedy = manager.engines[0].generate([batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()],
                                         SamplingParams(max_new_tokens=R, temperature=0))[0]
    assert out["responses"][0, :len(greedy.output_ids)].tolist() == greedy.output_ids
    # A batch asking for greedy decoding (REMAX baseline) also gets one sample per prompt.
    greedy_batch = Batch(tensors=dict(batch.tensors), non_tensors=dict(batch.non_tensors), meta={"do_sample": False})
    out = manager.generate(greedy_batch)
    assert len(out) == len(batch) and out.meta["do_sample"] is False and out.meta["temperature"] == 1.0


def test_single_engine_more_engines_than_prompts_and_no_logprobs(model, tokenizer, batch):
    one = make_manager(model, tokenizer, num_engines=1, n=2, calculate_log_probs=False)
    out = one.generate(batch.select("input_ids", "attention_mask", "position_ids"))
    assert len(out) == 2 * len(batch) and "rollout_log_probs" not in out and out.non_tensors.keys() == {"finish_reason"}
    many = make_manager(model, tokenizer, num_engines=4, n=1)
    calls = [record_calls(engine) for engine in many.engines]
    small = batch.select("input_ids", "attention_mask", "position_ids").split(2)[0]
    assert len(many.generate(small)) == 2
    assert [len(c) for c in calls] == [1, 1, 0, 0]


def test_input_checks(model, tokenizer, batch):
    manager = make_manager(model, tokenizer, num_engines=1)
    with pytest.raises(KeyError, match="attention_mask"):
        manager.generate(batch.select("input_ids"))
    short = RolloutManager(manager.engines, tokenizer, RolloutConfig(), prompt_length=4, response_length=R)
    with pytest.raises(ValueError, match="more than rollout.prompt_length=4"):
        short.generate(batch)
    with pytest.warns(UserWarning, match="does not carry input tensors"):
        manager.generate(batch.union(Batch(tensors={"extra": torch.zeros(len(batch))})))
    with pytest.raises(ValueError, match="at least one engine"):
        RolloutManager([], tokenizer, RolloutConfig(), prompt_length=P, response_length=R)
    with pytest.raises(TypeError, match="does not implement"):
        RolloutManager([object()], tokenizer, RolloutConfig(), prompt_length=P, response_length=R)
    with pytest.raises(ValueError, match="response_length must be >= 1"):
        RolloutManager(manager.engines, tokenizer, RolloutConfig(), prompt_length=P, response_length=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"n": 0}, "rollout.n must be > 0"), ({"top_p": 0.0}, r"rollout.top_p must be in \(0, 1\]"),
    ({"top_k": 0}, "rollout.top_k must be -1"), ({"temperature": -1.0}, "rollout.temperature must be >= 0"),
    ({"response_length": 0}, "rollout.response_length must be > 0"),
    ({"prompt_length": 0}, "rollout.prompt_length must be > 0"),
])
def test_config_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)
    with pytest.raises(ValueError, match="rollout.val_kwargs.top_p"):
        ValKwargs(top_p=2.0)


# ----------------------------------------------------------------------------- multi-turn

def record_rows(engine):
    """Record (number of rows, sampling params) of every batch the engine's sampling loop runs."""
    calls = []
    generate_rows = engine.generate_rows

    def recording(rows, params, *args):
        calls.append((len(rows), params))
        return generate_rows(rows, params, *args)

    engine.generate_rows = recording
    return calls


@pytest.fixture(scope="module")
def chat_batch(tokenizer):
    rows = []
    for i, text in enumerate(["What is 3 + 4?", "Hi", "#### 12"]):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        rows.append({"input_ids": torch.tensor(ids), "raw_prompt": messages, "index": i})
    return collate(rows, pad_token_id=tokenizer.pad_token_id, pad_to=P)


@pytest.mark.skipif(importlib.util.find_spec("megarl.rollout.agent_loop") is None,
                    reason="megarl.rollout.agent_loop is not there yet")
def test_multi_turn_runs_the_agent_loop_on_every_engine(model, tokenizer, chat_batch):
    n, temperature, R_turns = 2, 0.9, 16
    engines = [HFEngine(copy.deepcopy(model), tokenizer, seed=i) for i in range(2)]
    calls = [record_rows(engine) for engine in engines]
    config = RolloutConfig(n=n, temperature=temperature, seed=0,
                           multi_turn=MultiTurnConfig(enable=True, tokenization_sanity_check="off"))
    manager = RolloutManager(engines, tokenizer, config, prompt_length=P, response_length=R_turns)
    out = manager.generate(chat_batch)
    B, N = len(chat_batch), len(chat_batch) * n
    # Each engine served half of the requests, their first turns in one batch.
    assert [c[0][0] for c in calls] == [N // 2, N // 2]
    assert all(p.temperature == temperature for c in calls for _, p in c)
    assert tuple(out["input_ids"].shape) == (N, P + R_turns) and tuple(out["loss_mask"].shape) == (N, P + R_turns)
    assert out.meta == {"temperature": temperature, "do_sample": True, "validate": False}
    repeated = chat_batch.repeat(n, interleave=True)
    assert torch.equal(out["prompts"], repeated["input_ids"])
    for key in chat_batch.non_tensors:
        assert np.array_equal(out[key], repeated[key]), key
    for row in range(N):  # sorted back to (prompt, sample) order
        assert out["messages"][row][0] == out["raw_prompt"][row][0]
    assert set(out["finish_reason"]) <= {"stop", "length"}
    # Generated tokens carry the engine's log-probs, equal to a separate forward's; the rest is 0.
    trained = out["loss_mask"][:, P:].bool()
    assert trained.any() and (out["rollout_log_probs"][~trained] == 0).all()
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits.float()
    logprobs = torch.log_softmax(logits[:, P - 1:-1] / temperature, dim=-1)
    expected = logprobs.gather(-1, out["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["rollout_log_probs"][trained], expected[trained], atol=1e-5, rtol=0)

    for engine_calls in calls:
        engine_calls.clear()
    out = manager.generate(chat_batch, validate=True)
    assert len(out) == B and out.meta["validate"] is True
    assert all(p.greedy for c in calls for _, p in c)


def test_generate_refuses_a_running_event_loop():
    from megarl.rollout import manager as manager_module

    async def call():
        return manager_module._run_coroutine(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="cannot run inside a running event loop"):
        asyncio.run(call())


def test_engine_returning_too_many_tokens_is_an_error(model, tokenizer, batch):
    manager = make_manager(model, tokenizer, num_engines=1)
    manager.engines[0].generate = lambda ids, params, return_logprob=False: [
        GenerateOutput(output_ids=[1] * (R + 1), finish_reason="length", output_logprobs=[0.0] * (R + 1))
        for _ in ids]
    with pytest.raises(RuntimeError, match="more than rollout.response_length"):
        manager.generate(batch)
