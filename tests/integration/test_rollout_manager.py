"""RolloutManager over real CPU engine servers behind a real sglang-router.

The module starts two engine servers (seeds 0 and 1) and sglang-router (round robin, retries
off) over them once (:func:`tests.engine_servers.engine_servers`). Generation goes through the
router; a single-engine manager uses engine 0's client as its generator. Outputs are checked
against :class:`HFEngine` in this process on the same weights: share ``k`` of a call (prompts
``[start_k, end_k)``, each repeated ``n`` times) is sampled with
``derive_row_seed(call_seed, start_k * n)`` and reproduces ``HFEngine.generate`` of the share's
rows with that seed token for token and log-prob for log-prob. The test that kills an engine
runs last: it ends the module's engine 1.
"""

import asyncio
import functools
import http.server
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from megarl.config import MultiTurnConfig, RolloutConfig, ValKwargs
from megarl.data.batch import Batch
from megarl.data.dataset import collate
from megarl.engines.client import EngineClient, EngineError, gather_sync, run_sync
from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.engine import FinishReason, SamplingParams
from megarl.engines.server_process import ServerProcess, free_port
from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer
from megarl.rollout.manager import RolloutManager
from megarl.seeds import derive_row_seed
from tests.engine_servers import close_clients, engine_servers
from tests.unit.test_hf_engine import eos_prone

P, R = 24, 10
TEXTS = ["What is 3 + 4?", "Hi", "The quick brown fox jumps over the lazy dog.", "#### 12", "system user",
         "What is 21 + 5?"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """The tiny model, EOS-prone so that both finish reasons occur, saved for the servers."""
    directory = tmp_path_factory.mktemp("rollout") / "model"
    eos_prone(build_tiny_model(tokenizer, seed=0), tokenizer).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def local(model_dir):
    """The same weights in this process: the reference for every token and log-prob."""
    return HFEngine(model_dir, seed=0)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    with engine_servers(model_dir, tmp_path_factory.mktemp("logs"), num_engines=2, router=True,
                        extra_args=("--enable-step-gate",)) as running:
        yield running


@pytest.fixture(scope="module")
def batch(tokenizer):
    rows = [{"input_ids": torch.tensor(tokenizer.encode(text)), "raw_prompt": [{"role": "user", "content": text}],
             "data_source": "tiny", "index": i} for i, text in enumerate(TEXTS)]
    return collate(rows, pad_token_id=tokenizer.pad_token_id, pad_to=P)


def make_manager(servers, tokenizer, *, single=False, response_length=R, **config):
    """Two engines behind the router; ``single``: engine 0 alone, its own client the generator."""
    generator, engines = (servers.engines[0], servers.engines[:1]) if single else (servers.generator, servers.engines)
    return RolloutManager(generator, engines, tokenizer, RolloutConfig(**config), prompt_length=P,
                          response_length=response_length)


def prompt_ids(batch):
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def expected_outputs(local, batch, *, n, num_engines, call_seed, params, return_logprob=True):
    """What the manager must return: per engine share, ``HFEngine.generate`` of its rows with the share's seed."""
    prompts = prompt_ids(batch)
    base, extra = divmod(len(prompts), num_engines)
    outputs, start, seeds = [], 0, []
    for k in range(num_engines):
        end = start + base + (1 if k < extra else 0)
        if end > start:
            seed = None if call_seed is None else derive_row_seed(call_seed, start * n)
            seeds.append(seed)
            rows = [p for p in prompts[start:end] for _ in range(n)]
            outputs += local.generate(rows, SamplingParams(**{**params, "seed": seed}), return_logprob=return_logprob)
        start = end
    return outputs, seeds


def assert_equals_outputs(out, expected, *, logprobs=True):
    for row, output in enumerate(expected):
        length = len(output.output_ids)
        assert out["responses"][row, :length].tolist() == output.output_ids, row
        assert int(out["response_mask"][row].sum()) == length, row
        assert out["finish_reason"][row] == output.finish_reason.value, row
        if logprobs:
            assert out["rollout_log_probs"][row, :length].tolist() == torch.tensor(
                output.output_logprobs, dtype=torch.float32).tolist(), row


def test_engine_servers_through_the_router_n4(servers, local, tokenizer, batch):
    n, temperature = 4, 0.9
    manager = make_manager(servers, tokenizer, n=n, temperature=temperature, seed=0)
    out = manager.generate(batch)
    N, eos, pad = len(batch) * n, tokenizer.eos_token_id, tokenizer.pad_token_id

    # Each engine's share (a contiguous half of the prompts with all their samples) is sampled from its own
    # seed, exactly as the in-process engine samples those rows with that seed.
    expected, seeds = expected_outputs(local, batch, n=n, num_engines=2, call_seed=derive_row_seed(0, 0),
                                       params={"max_new_tokens": R, "temperature": temperature})
    assert len(seeds) == 2 and seeds[0] != seeds[1] and len(expected) == N
    assert_equals_outputs(out, expected)

    shapes = {"prompts": (N, P), "responses": (N, R), "input_ids": (N, P + R), "attention_mask": (N, P + R),
              "position_ids": (N, P + R), "response_mask": (N, R), "rollout_log_probs": (N, R)}
    assert {k: tuple(v.shape) for k, v in out.tensors.items()} == shapes
    assert out.meta == {"temperature": temperature, "do_sample": True, "validate": False}

    # Samples of a prompt are adjacent and carry the prompt's non-tensors (Batch.repeat(n, interleave=True)).
    repeated = batch.repeat(n, interleave=True)
    assert torch.equal(out["prompts"], repeated["input_ids"])
    assert torch.equal(out["attention_mask"][:, :P], repeated["attention_mask"])
    for key in batch.non_tensors:
        assert np.array_equal(out[key], repeated[key]), key
    assert set(out.non_tensors) == set(batch.non_tensors) | {"finish_reason"}
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
    assert torch.equal(out["attention_mask"][:, P:], out["response_mask"])  # single-turn: every token trains
    # The n samples of a prompt differ (each row has its own sampling stream).
    assert len({tuple(r) for r in out["responses"][:n].tolist()}) > 1

    # Positions: from 0 on the prompt's first token, continuing through the response.
    prompt_len = out["attention_mask"][:, :P].sum(dim=1)
    for row in range(N):
        start = P - int(prompt_len[row])
        assert out["position_ids"][row].tolist() == [0] * start + list(range(P + R - start))

    # rollout_log_probs equal a separate forward over the assembled batch.
    with torch.no_grad():
        logits = local.model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                             position_ids=out["position_ids"]).logits.float()
    logprobs = torch.log_softmax(logits[:, P - 1:-1] / temperature, dim=-1)
    reference = logprobs.gather(-1, out["responses"][..., None]).squeeze(-1) * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], reference, atol=1e-5, rtol=0)


def test_seeded_manager_is_reproducible(servers, local, tokenizer, batch):
    first = make_manager(servers, tokenizer, n=2, seed=3).generate(batch)
    second = make_manager(servers, tokenizer, n=2, seed=3).generate(batch)
    for key in first.tensors:
        assert torch.equal(first[key], second[key]), key
    assert list(first["finish_reason"]) == list(second["finish_reason"])
    expected, _ = expected_outputs(local, batch, n=2, num_engines=2, call_seed=derive_row_seed(3, 0),
                                   params={"max_new_tokens": R})
    assert_equals_outputs(first, expected)
    other = make_manager(servers, tokenizer, n=2, seed=4).generate(batch)
    assert not torch.equal(first["responses"], other["responses"])

    # A seed given to the call (the trainer's, from the step) wins over the config's and the call count.
    manager = make_manager(servers, tokenizer, n=2, seed=4)
    manager.generate(batch.split(2)[0])
    given = manager.generate(batch, seed=11)
    expected, _ = expected_outputs(local, batch, n=2, num_engines=2, call_seed=11, params={"max_new_tokens": R})
    assert_equals_outputs(given, expected)


def test_validate_and_greedy_use_one_sample(servers, local, tokenizer, batch):
    manager = make_manager(servers, tokenizer, n=4, val_kwargs=ValKwargs(temperature=0.0))
    out = manager.generate(batch, validate=True)
    assert len(out) == len(batch) and out.meta == {"temperature": 1.0, "do_sample": False, "validate": True}
    # Greedy: each share equals the in-process engine's argmax continuation of its prompts.
    expected, _ = expected_outputs(local, batch, n=1, num_engines=2, call_seed=None,
                                   params={"max_new_tokens": R, "temperature": 0.0})
    assert_equals_outputs(out, expected)
    # A batch asking for greedy decoding (REMAX baseline) also gets one sample per prompt.
    greedy_batch = Batch(tensors=dict(batch.tensors), non_tensors=dict(batch.non_tensors), meta={"do_sample": False})
    out = manager.generate(greedy_batch)
    assert len(out) == len(batch) and out.meta["do_sample"] is False and out.meta["temperature"] == 1.0
    assert_equals_outputs(out, expected)


def test_single_engine_more_engines_than_prompts_and_no_logprobs(servers, local, tokenizer, batch):
    prompts_only = batch.select("input_ids", "attention_mask", "position_ids")
    one = make_manager(servers, tokenizer, single=True, n=2, calculate_log_probs=False, seed=5)
    out = one.generate(prompts_only)
    assert len(out) == 2 * len(batch) and "rollout_log_probs" not in out and out.non_tensors.keys() == {"finish_reason"}
    expected, seeds = expected_outputs(local, batch, n=2, num_engines=1, call_seed=derive_row_seed(5, 0),
                                       params={"max_new_tokens": R}, return_logprob=False)
    assert len(seeds) == 1
    assert_equals_outputs(out, expected, logprobs=False)

    # One prompt over two engines: one share (engine 1's is empty and sends nothing).
    many = make_manager(servers, tokenizer, n=1, seed=6)
    small = prompts_only.split(1)[0]
    out = many.generate(small)
    assert len(out) == 1
    expected, seeds = expected_outputs(local, small, n=1, num_engines=2, call_seed=derive_row_seed(6, 0),
                                       params={"max_new_tokens": R})
    assert len(seeds) == 1
    assert_equals_outputs(out, expected)


def test_input_checks(servers, tokenizer, batch):
    manager = make_manager(servers, tokenizer, single=True)
    with pytest.raises(KeyError, match="attention_mask"):
        manager.generate(batch.select("input_ids"))
    short = RolloutManager(manager.generator, manager.engines, tokenizer, RolloutConfig(), prompt_length=4,
                           response_length=R)
    with pytest.raises(ValueError, match="more than rollout.prompt_length=4"):
        short.generate(batch)
    with pytest.warns(UserWarning, match="does not carry input tensors"):
        manager.generate(batch.union(Batch(tensors={"extra": torch.zeros(len(batch))})))
    with pytest.raises(ValueError, match="at least one engine"):
        RolloutManager(servers.generator, [], tokenizer, RolloutConfig(), prompt_length=P, response_length=R)
    with pytest.raises(ValueError, match="response_length must be >= 1"):
        RolloutManager(servers.generator, servers.engines, tokenizer, RolloutConfig(), prompt_length=P,
                       response_length=0)


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


@pytest.fixture(scope="module")
def chat_batch(tokenizer):
    rows = []
    for i, text in enumerate(["What is 3 + 4?", "Hi", "#### 12"]):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        rows.append({"input_ids": torch.tensor(ids), "raw_prompt": messages, "index": i})
    return collate(rows, pad_token_id=tokenizer.pad_token_id, pad_to=P)


def test_multi_turn_runs_one_agent_loop_through_the_router(servers, local, tokenizer, chat_batch):
    n, temperature, R_turns = 2, 0.9, 16
    config = {"n": n, "temperature": temperature, "seed": 0,
              "multi_turn": MultiTurnConfig(enable=True, tokenization_sanity_check="off")}
    manager = make_manager(servers, tokenizer, response_length=R_turns, **config)
    out = manager.generate(chat_batch)
    B, N = len(chat_batch), len(chat_batch) * n
    assert tuple(out["input_ids"].shape) == (N, P + R_turns) and tuple(out["response_mask"].shape) == (N, R_turns)
    assert out.meta == {"temperature": temperature, "do_sample": True, "validate": False}
    repeated = chat_batch.repeat(n, interleave=True)
    assert torch.equal(out["prompts"], repeated["input_ids"])
    for key in chat_batch.non_tensors:
        assert np.array_equal(out[key], repeated[key]), key
    for row in range(N):  # sorted back to (prompt, sample) order
        assert out["messages"][row][0] == out["raw_prompt"][row][0]
    assert set(out["finish_reason"]) <= {"stop", "length"}
    # Generated tokens carry the engine's log-probs at the configured temperature, equal to a separate
    # forward's; the rest is 0.
    trained = out["response_mask"].bool()
    assert trained.any() and (out["rollout_log_probs"][~trained] == 0).all()
    with torch.no_grad():
        logits = local.model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                             position_ids=out["position_ids"]).logits.float()
    logprobs = torch.log_softmax(logits[:, P - 1:-1] / temperature, dim=-1)
    reference = logprobs.gather(-1, out["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["rollout_log_probs"][trained], reference[trained], atol=1e-5, rtol=0)
    # Seeded: the same call again samples the same conversations.
    again = make_manager(servers, tokenizer, response_length=R_turns, **config).generate(chat_batch)
    assert torch.equal(out["input_ids"], again["input_ids"]) and torch.equal(out["response_mask"], again["response_mask"])

    # Validation: one greedy sample per prompt, the argmax continuation of its first turn.
    out = manager.generate(chat_batch, validate=True)
    assert len(out) == B and out.meta["validate"] is True and out.meta["do_sample"] is False
    greedy = local.generate(prompt_ids(chat_batch), SamplingParams(max_new_tokens=R_turns, temperature=0.0))
    for row, output in enumerate(greedy):
        generated = out["responses"][row][out["response_mask"][row].bool()].tolist()
        assert generated[:len(output.output_ids)] == output.output_ids, row


def test_generate_refuses_a_running_event_loop(tokenizer, batch):
    """generate blocks until the rollout is done: inside a running event loop it would block that loop (agenerate
    is the coroutine to await there)."""
    client = EngineClient("http://127.0.0.1:9", name="engine 0")  # never contacted
    manager = RolloutManager(client, [client], tokenizer, RolloutConfig(), prompt_length=P, response_length=R)

    async def call():
        return manager.generate(batch)

    with pytest.raises(RuntimeError, match="cannot run inside a running event loop"):
        asyncio.run(call())


class _TooManyTokens(http.server.BaseHTTPRequestHandler):
    """A fake engine whose /generate answers every row with ``tokens`` (R + 1) tokens (SGLang's JSON)."""

    tokens = R + 1

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def record(self, body: dict) -> None:
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.record(body)
        rows = body["input_ids"] if body["input_ids"] and isinstance(body["input_ids"][0], list) else None
        tokens = self.tokens
        result = {"output_ids": [1] * tokens, "meta_info": {"finish_reason": {"type": "length", "length": tokens},
                                                            "output_token_logprobs": [[0.0, 1, None]] * tokens}}
        data = json.dumps([result] * len(rows) if rows is not None else result).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_engine_returning_too_many_tokens_is_an_error(tokenizer, batch):
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TooManyTokens)
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        client = EngineClient(f"http://127.0.0.1:{fake.server_address[1]}", name="engine 0")
        manager = RolloutManager(client, [client], tokenizer, RolloutConfig(), prompt_length=P, response_length=R)
        with pytest.raises(RuntimeError, match="more than rollout.response_length"):
            manager.generate(batch)
    finally:
        fake.shutdown()
        fake.server_close()


class _RecordingEngine(_TooManyTokens):
    """A fake engine answering every row with R tokens and recording each /generate's sampling_params."""

    requests: list = []
    tokens = R

    def record(self, body: dict) -> None:
        self.requests.append(body["sampling_params"])


@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_sampling_seeds_go_to_megarls_engine_only(tokenizer, batch, engine):
    """A batched request's one sampling_seed seeds each of its rows on megarl's engine (derive_row_seed(seed, i));
    SGLang would give every row that one seed (with --enable-deterministic-inference: all n samples of a prompt
    identical), so SGLang engines get none."""
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RecordingEngine)
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    _RecordingEngine.requests = []
    try:
        client = EngineClient(f"http://127.0.0.1:{fake.server_address[1]}", name="engine 0")
        manager = RolloutManager(client, [client, client], tokenizer, RolloutConfig(name=engine, n=4, seed=3),
                                 prompt_length=P, response_length=R)
        manager.generate(batch, seed=11)
        manager.generate(batch)  # seeded from rollout.seed
    finally:
        fake.shutdown()
        fake.server_close()
    seeds = [request.get("sampling_seed") for request in _RecordingEngine.requests]
    if engine == "hf":  # one per share: derive_row_seed(call seed, first row of the share)
        half = len(TEXTS) // 2 * 4
        assert sorted(seeds) == sorted([derive_row_seed(11, 0), derive_row_seed(11, half),
                                derive_row_seed(derive_row_seed(3, 1), 0), derive_row_seed(derive_row_seed(3, 1), half)])
    else:
        assert seeds == [None] * 4


def test_engines_paused_past_the_routers_health_checks_still_get_requests(servers, tokenizer, batch, tmp_path):
    """A weight sync pauses the engines (SGLang's /health and /ready fail then; the CPU server's /health is 503):
    the router megarl starts must not drop them. Beside it runs the same router with health checks on (every second,
    a worker dropped after one failure and taken back after five successes): the engines stay paused until that one
    has dropped them (its ``/workers``), and megarl's still lists them all healthy and serves the rollout after."""
    from megarl.engines.router import router_command, workers_registered
    from tests.engine_servers import get_json, wait_for

    urls = [e.url for e in servers.engines]

    def router(name: str, health_checks: bool) -> ServerProcess:
        port = free_port()
        argv = router_command(urls, host="127.0.0.1", port=port, policy="round_robin") + [
            "--health-check-interval-secs", "1", "--health-check-timeout-secs", "1", "--health-failure-threshold",
            "1", "--health-success-threshold", "5"]
        if health_checks:
            argv.remove("--disable-health-check")
        return ServerProcess(argv, name=name, url=f"http://127.0.0.1:{port}", log_path=tmp_path / f"{name}.log",
                             health_path="/workers", ready=functools.partial(workers_registered, urls))

    megarls, checking = router("sglang-router", False), router("checking-router", True)
    generator = EngineClient(megarls.url, name="sglang-router")

    def registered(answer: dict) -> bool:
        return workers_registered(urls, json.dumps(answer).encode())

    try:
        megarls.start().wait_healthy(60)
        checking.start().wait_healthy(60)
        gather_sync([e.pause_generation("in_place") for e in servers.engines])
        try:
            assert not any(gather_sync([e.health() for e in servers.engines]))
            run_sync(wait_for(checking.url, "/workers", lambda answer: not registered(answer),
                              "dropped a paused engine"))
            assert registered(run_sync(get_json(megarls.url, "/workers")))
        finally:
            gather_sync([e.continue_generation() for e in servers.engines])
        manager = RolloutManager(generator, servers.engines, tokenizer, RolloutConfig(n=2, seed=0), prompt_length=P,
                                 response_length=R)
        assert len(manager.generate(batch)) == 2 * len(batch)
    finally:
        close_clients([generator])
        megarls.stop()
        checking.stop()


def test_a_frozen_engine_is_named_and_one_that_comes_back_goes_on(servers, tokenizer, batch):
    """SIGSTOP engine 1 while its share of a rollout is inside it (held at its step gate): the rollout
    fails naming it once it has answered nothing for ``engine_timeout_s`` (it used to hang silently); frozen for
    less than that, it goes on and the rollout completes."""
    import concurrent.futures

    from megarl.engines.client import run_sync
    from tests.engine_servers import set_step_gate, wait_held_at_gate

    victim, pid = servers.engines[1], servers.processes[1].pid
    probe, missed = victim.answers, threading.Event()

    async def answers(timeout_s: float) -> bool:  # the manager's liveness probe, observed
        answered = await probe(timeout_s)
        if not answered:
            missed.set()
        return answered

    victim.answers = answers

    def rollout_with_a_freeze(limit_s: float, comes_back: bool):
        manager = make_manager(servers, tokenizer, response_length=64, engine_timeout_s=limit_s)
        run_sync(set_step_gate(victim.url, 2))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            rollout = pool.submit(manager.generate, batch, seed=5)
            try:
                run_sync(wait_held_at_gate(victim.url))
                missed.clear()
                os.kill(pid, signal.SIGSTOP)
                if comes_back:  # frozen until a probe has gone unanswered, then back within the limit
                    assert missed.wait(60)
                    error = None
                else:  # frozen until the rollout gives up on it
                    error = rollout.exception(timeout=120)
            finally:
                os.kill(pid, signal.SIGCONT)
                run_sync(set_step_gate(victim.url, None))
            return rollout.result(timeout=120) if comes_back else error

    try:
        error = rollout_with_a_freeze(4.0, comes_back=False)
        out = rollout_with_a_freeze(20.0, comes_back=True)  # a probe went unanswered: within the limit
    finally:
        victim.answers = probe
    assert isinstance(error, EngineError) and error.engine == "engine 1" and error.url == victim.url
    assert f"generation: engine 1 at {victim.url} answered nothing for 4 s" in str(error)
    assert len(out) == len(batch) * RolloutConfig().n and set(out["finish_reason"]) <= {"stop", "length"}


# Last in the module: it kills the module's engine 1.
def test_a_killed_engine_server_is_named_by_its_health(servers, tokenizer, batch):
    manager = make_manager(servers, tokenizer, n=2, seed=0)
    assert len(manager.generate(batch)) == 2 * len(batch)
    victim, client = servers.processes[1], servers.engines[1]
    os.killpg(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while victim.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not victim.alive()
    with pytest.raises(EngineError, match=rf"generation failed: engine 1 at {client.url} no longer answer") as caught:
        manager.generate(batch)  # seen gone by its /health, not waited out
    assert caught.value.engine == "engine 1"


def test_assembled_rows_carry_the_weight_version_of_each_token(tokenizer):
    from megarl.engines.engine import GenerateOutput

    client = EngineClient("http://127.0.0.1:9", name="engine 0")  # never contacted: assembling is local
    manager = RolloutManager(client, [client], tokenizer, RolloutConfig(calculate_log_probs=False), prompt_length=P,
                             response_length=R)
    outputs = [GenerateOutput(output_ids=[5, 6, 7], finish_reason=FinishReason.LENGTH, weight_version="4",
                              weight_versions=(("3", 0, 1), ("4", 1, 3))),
               GenerateOutput(output_ids=[5], finish_reason=FinishReason.STOP, weight_version="4")]
    out = manager.assemble([[1, 2], [3]], outputs)
    assert out["rollout_weight_versions"].tolist() == [[3, 4, 4] + [-1] * (R - 3), [4] + [-1] * (R - 1)]
    # Engines say "default" before the first weight sync: no versions then.
    outputs[1] = GenerateOutput(output_ids=[5], finish_reason=FinishReason.STOP, weight_version="default")
    assert "rollout_weight_versions" not in manager.assemble([[1, 2], [3]], outputs)

