"""megarl's CPU engine server, a real process, driven by the one HTTP client.

The model is a tiny random Qwen2 (project code). Each test talks HTTP to one server started
for the module; the numbers are checked against :class:`HFEngine` in this process with the
same weights and seeds.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import torch

from megarl.convert.export import Bucket
from megarl.engines.client import EngineClient, EngineError, gather_sync, run_sync
from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.engine import FinishReason, SamplingParams
from megarl.engines.server_process import ServerProcess, ServerStartError, free_port
from megarl.sync.base import flattened_payload
from tests.engine_servers import get_json, load, set_step_gate, wait_for, wait_held_at_gate

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
HOLD = 9
"""Where the step gate stops a long generation (its rows' output tokens) so that a pause, an update or an abort
lands mid-generation on a machine of any speed."""


def payloads(named, tp: int) -> list[bytes]:
    """One bucket's ``/update_weights_from_tensor`` payloads for ``tp`` engine TP ranks (one reference each)."""
    bucket = Bucket.pack(named, shared_memory=True)
    return [flattened_payload(bucket) for _ in range(tp)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    # Llama: the family whose SGLang model answers /get_weights_by_name (with TP rank 0's slices at TP 2).
    return save_tiny(tmp_path_factory.mktemp("server") / "model", arch="llama", num_layers=2)


def _server(model_dir, log_dir, name="engine 0") -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", str(model_dir), "--port",
                          str(port), "--random-seed", "3", "--tp-size", "2", "--enable-step-gate"], name=name, url=f"http://127.0.0.1:{port}",
                         log_path=log_dir / f"{name.replace(' ', '_')}.log", env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    process = _server(model_dir, tmp_path_factory.mktemp("logs")).start()
    try:
        process.wait_healthy(120)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def local(model_dir):
    return HFEngine(model_dir, seed=3)


@pytest.fixture
def client(server):
    return EngineClient(server.url, name="engine 0")


def test_a_batch_equals_the_in_process_engine_token_for_token(client, local):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)
    remote = run_sync(client.generate_batch(PROMPTS, params, seed=11, return_logprob=True))
    expected = local.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=11),
                              return_logprob=True)
    assert [r.output_ids for r in remote] == [e.output_ids for e in expected]
    assert [r.output_logprobs for r in remote] == [e.output_logprobs for e in expected]  # exact: same floats
    assert [r.finish_reason for r in remote] == [e.finish_reason for e in expected]
    assert all(r.weight_version == "default" for r in remote)


def test_single_requests_and_fields_the_router_adds(client, server):
    import json
    import urllib.request

    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "return_logprob": True, "model": "x", "stream": False, "return_text_in_logprobs": False,
            "log_metrics": True, "return_hidden_states": False, "background": False, "no_logs": False,
            "return_bytes": False, "return_entropy": False, "rid": "abc"}
    request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer = json.loads(reply.read())
    assert answer["meta_info"]["id"] == "abc" and len(answer["output_ids"]) == 4
    assert [entry[1] for entry in answer["meta_info"]["output_token_logprobs"]] == answer["output_ids"]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    outs = gather_sync([client.generate(p, greedy) for p in PROMPTS])
    assert outs[0].output_ids == answer["output_ids"]
    info = run_sync(client.model_info())
    assert info["is_generation"] is True


def test_weights_update_in_a_session_by_flattened_bucket_and_read_back(client, local):
    names = ["model.norm.weight", "model.layers.0.mlp.down_proj.weight"]
    new = [(name, torch.full_like(local._params[name], 0.5 + i)) for i, name in enumerate(names)]

    async def sync():
        await client.begin_weight_update()
        await client.update_weights_from_tensor(payloads(new, 2), weight_version="7")
        await client.end_weight_update()
        return [await client.get_weights_by_name(name, truncate_size=10_000) for name in names]

    values = run_sync(sync())
    for (name, tensor), got in zip(new, values, strict=True):
        assert torch.tensor(got).equal(tensor), name
    out = run_sync(client.generate(PROMPTS[1], SamplingParams(max_new_tokens=2, temperature=0.0)))
    assert out.weight_version == "7"
    with pytest.raises(EngineError, match=r"engine 0 at http://127\.0\.0\.1:\d+: POST /update_weights_from_tensor "
                                          r"failed with HTTP 400: update_weights_from_tensor must run between "
                                          r"begin_weight_update\(\) and end_weight_update\(\)"):
        run_sync(client.update_weights_from_tensor(payloads(new, 2)))
    run_sync(client.begin_weight_update())
    try:
        with pytest.raises(EngineError, match=r"serialized_named_tensors must hold one payload per engine TP rank "
                                              r"\(2\), got 1"):
            run_sync(client.update_weights_from_tensor(payloads(new, 1)))
        other = payloads(new[:1], 1) + payloads(new[1:], 1)
        with pytest.raises(EngineError, match=r"TP rank 1's payload names other tensors than rank 0's"):
            run_sync(client.update_weights_from_tensor(other))
    finally:
        run_sync(client.end_weight_update())


def test_a_reused_bucket_buffer_is_held_only_for_the_session(client, local):
    """A sender that refills one shared-memory buffer sends the same handle each bucket: the server keeps it open
    for the session (torch reopens a live storage from its cache) and lets go at the session's end, so the
    memory is freed once the sender frees it."""
    from pathlib import Path

    name = "model.norm.weight"
    bucket = Bucket.pack([(name, torch.zeros_like(local._params[name]))], shared_memory=True)
    shm = Path("/dev/shm") / bucket.flat.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/")
    assert shm.exists()
    run_sync(client.begin_weight_update())
    try:
        for value in (1.5, 2.5):
            bucket.flat.fill_(value)
            run_sync(client.update_weights_from_tensor([flattened_payload(bucket) for _ in range(2)]))
    finally:
        run_sync(client.end_weight_update())
    got = run_sync(client.get_weights_by_name(name, truncate_size=10_000))
    assert torch.tensor(got).eq(2.5).all()
    del bucket
    deadline = time.monotonic() + 10
    while shm.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shm.exists(), "the server still holds the bucket buffer after the session"


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_weights_by_broadcast_from_the_trainer_rank(client, local, load_format):
    """/init_weights_update_group + /update_weights_from_distributed: this process is rank 0 of a gloo group
    (megarl.engines.weight_group.join_group, whose keys meet SGLang's init_custom_process_group) and broadcasts while the
    server's two TP ranks (group ranks 1 and 2) receive."""
    import concurrent.futures

    from megarl.engines.weight_group import join_group

    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    new = [torch.randn(local._params[name].shape, generator=torch.Generator().manual_seed(i))
           for i, name in enumerate(names)]
    port = free_port()
    with pytest.raises(EngineError, match=r"ranks 1\.\.2 \(this engine's 2 TP ranks\) do not fit a group of 2"):
        run_sync(client.init_weights_update_group(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                                  world_size=2, group_name="wu", backend="gloo"))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    joined = pool.submit(join_group, "127.0.0.1", port, 0, 3, "wu")
    run_sync(client.init_weights_update_group(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                              world_size=3, group_name="wu", backend="gloo"))
    group = joined.result(timeout=60)

    def send():
        if load_format == "flattened_bucket":
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            group.broadcast(FlattenedTensorBucket(named_tensors=list(zip(names, new))).get_flattened_tensor(),
                            0).wait()
        else:
            for work in [group.broadcast(tensor, 0) for tensor in new]:
                work.wait()

    run_sync(client.begin_weight_update())
    sent = pool.submit(send)
    run_sync(client.update_weights_from_distributed(names, ["float32", "float32"], [list(t.shape) for t in new],
                                                    group_name="wu", load_format=load_format, weight_version="b"))
    sent.result(timeout=60)
    run_sync(client.end_weight_update())
    for name, tensor in zip(names, new, strict=True):  # q_proj is column-parallel: TP rank 0's half of it
        held = tensor[:tensor.shape[0] // 2] if "q_proj" in name else tensor
        assert torch.tensor(run_sync(client.get_weights_by_name(name, 10_000))).equal(held)
    run_sync(client.destroy_weights_update_group("wu"))
    with pytest.raises(EngineError, match=r"The group to be destroyed does not exist"):
        run_sync(client.destroy_weights_update_group("wu"))


def test_released_tags_refuse_generation_and_updates(client, local):
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    run_sync(client.release_memory_occupation(["kv_cache", "cuda_graph"]))
    with pytest.raises(EngineError, match=r"memory \['kv_cache'\] is released; /resume_memory_occupation first"):
        run_sync(client.generate(PROMPTS[0], greedy))
    run_sync(client.release_memory_occupation(["weights"]))
    with pytest.raises(EngineError, match=r"begin_weight_update: weights are released"):
        run_sync(client.begin_weight_update())
    run_sync(client.resume_memory_occupation(["weights"]))
    run_sync(client.begin_weight_update())
    run_sync(client.end_weight_update())
    run_sync(client.resume_memory_occupation(["kv_cache", "cuda_graph"]))
    with pytest.raises(EngineError, match="weight tensors hold released memory"):  # freed, as SGLang frees them
        run_sync(client.generate(PROMPTS[0], greedy))
    run_sync(_push(client, [(name, tensor.detach().clone()) for name, tensor in local._params.items()], "restored"))
    expected = local.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, temperature=0.0))[0].output_ids
    assert run_sync(client.generate(PROMPTS[0], greedy)).output_ids == expected


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_pause_modes(client, server, mode):
    """abort ends a running generation with finish reason abort (tokens kept); in_place and retract hold it,
    let a weight update through, and finish it after continue_generation. The step gate stops the batch at its
    HOLD-th token, so the pause lands mid-generation."""
    long = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)

    async def scenario():
        await set_step_gate(server.url, HOLD)
        try:
            running = asyncio.ensure_future(client.generate([1, 2, 3], long, seed=5))
            assert (await wait_held_at_gate(server.url))["tokens"] == HOLD
            await client.pause_generation(mode)
            await set_step_gate(server.url, None)  # from here only the pause holds the batch
            if mode == "abort":
                return await running
            held = load(await get_json(server.url, "/v1/loads"))
            assert held["num_running_reqs"] == 1 and held["queues"]["paused"] == 1
            assert held["queues"]["retracted"] == (mode == "retract")
            assert not running.done()
            await client.begin_weight_update()
            await client.end_weight_update()
            await client.continue_generation()
            return await running
        finally:
            await set_step_gate(server.url, None)

    out = run_sync(scenario())
    if mode == "abort":
        assert out.finish_reason is FinishReason.ABORT and len(out.output_ids) == HOLD
        run_sync(client.continue_generation())
    else:
        assert out.finish_reason is FinishReason.LENGTH and len(out.output_ids) == 400


def test_requests_sent_together_share_one_batch(model_dir):
    """An idle engine starts a batch once no request has arrived for a quiet interval (``ARRIVAL_QUIET_S``; here
    5 s, far longer than anything between two sends here): a request sent once another is queued, as the asynchronous
    producer sends its groups, runs in the same batch; a request sent while a batch runs waits for the next one."""
    from aiohttp.test_utils import TestClient, TestServer

    from megarl.engines.cpu_engine.server import EngineServer

    engine = HFEngine(model_dir, seed=3)
    batches: list[int] = []
    generate_rows = engine.generate_rows

    def counted(prompts, *args, **kwargs):
        batches.append(len(prompts))
        return generate_rows(prompts, *args, **kwargs)

    engine.generate_rows = counted
    server = EngineServer(engine, model_path=str(model_dir), enable_step_gate=True, arrival_wait_s=(5.0, 60.0))
    params = SamplingParams(max_new_tokens=HOLD + 3, temperature=1.0, ignore_eos=True)

    async def exchange():
        http = TestClient(TestServer(server.app()))
        await http.start_server()
        url = str(http.make_url("")).rstrip("/")
        client = EngineClient(url, name="engine")
        try:
            await set_step_gate(url, HOLD)
            first = asyncio.ensure_future(client.generate_batch([[1, 2, 3], [4, 5]], params, seed=1))
            await wait_for(url, "/v1/loads", lambda answer: load(answer)["num_waiting_reqs"] == 2,
                           "the first request's rows queued")
            second = asyncio.ensure_future(client.generate([6, 7], params, seed=2))
            await wait_held_at_gate(url)
            late = asyncio.ensure_future(client.generate([8, 9], params, seed=3))
            await wait_for(url, "/v1/loads", lambda answer: load(answer)["num_waiting_reqs"] == 1, "the late row queued")
            await set_step_gate(url, None)
            return await asyncio.gather(first, second, late)
        finally:
            await set_step_gate(url, None)
            await client.close()
            await http.close()

    (pair, single, late) = asyncio.run(exchange())
    assert batches == [3, 1]
    assert [len(o.output_ids) for o in [*pair, single, late]] == [HOLD + 3] * 4


def _push(client, named, version: str, flush_cache: bool = True):
    """All of ``named`` into the server in one session, as ``version``."""
    async def sync():
        await client.begin_weight_update()
        await client.update_weights_from_tensor(payloads(named, 2), weight_version=version, flush_cache=flush_cache)
        await client.end_weight_update()
    return sync()


def _teacher_forced(engine, prompt, output) -> torch.Tensor:
    """Each output token's log-prob under ``engine``'s weights, from one forward over prompt ‖ output."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), dim=-1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1), torch.tensor(output)]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_update_during_a_pause_tags_the_later_tokens_with_the_new_version(client, server, local, model_dir, mode):
    """SGLang's per-token versions: tokens sampled before the update carry the old version, the later ones the new
    (``meta_info.weight_versions``). retract recomputes the cache: every token's log-prob is its version's model's;
    in_place keeps the old cache (the earlier tokens are the old model's). The pause lands at the step gate's
    HOLD-th token."""
    old = [(name, tensor.detach().clone()) for name, tensor in local._params.items()]
    new = [(name, tensor * 1.1) for name, tensor in old]
    prompt, long = [1, 2, 3], SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)

    async def scenario():
        await _push(client, old, f"old-{mode}")
        await set_step_gate(server.url, HOLD)
        try:
            running = asyncio.ensure_future(client.generate(prompt, long, seed=5, return_logprob=True))
            await wait_held_at_gate(server.url)
            await client.pause_generation(mode)
        finally:
            await set_step_gate(server.url, None)
        assert not running.done()
        if mode == "in_place":  # SGLang refuses to flush a cache that requests still use
            with pytest.raises(EngineError, match="(?s)HTTP 400: Flush cache failed.*pending requests"):
                await client.flush_cache()
        else:
            await client.flush_cache()
        await _push(client, new, f"new-{mode}", flush_cache=True)
        await client.continue_generation()
        return await running

    out = run_sync(scenario())
    assert out.finish_reason is FinishReason.LENGTH and len(out.output_ids) == 400
    (_, _, k), (later, start, end) = out.weight_versions
    assert out.weight_versions[0][:2] == (f"old-{mode}", 0) and (later, start, end) == (f"new-{mode}", k, 400)
    assert k == HOLD and out.weight_version == f"new-{mode}"
    assert out.token_versions() == [f"old-{mode}"] * k + [f"new-{mode}"] * (400 - k)
    got = torch.tensor(out.output_logprobs)
    assert (got[:k] - _teacher_forced(local, prompt, out.output_ids)[:k]).abs().max() <= 1e-4
    if mode == "retract":
        updated = HFEngine(model_dir, seed=3)
        updated.begin_weight_update()
        updated.update_weights_from_tensor(new)
        updated.end_weight_update()
        assert (got[k:] - _teacher_forced(updated, prompt, out.output_ids)[k:]).abs().max() <= 1e-4
    run_sync(_push(client, old, "restored"))


def test_abort_keeps_the_tokens_of_one_version_and_an_unpaused_update_waits_for_the_batch(client, server, local):
    long = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)

    def waiting(rows):
        return lambda answer: load(answer)["num_waiting_reqs"] == rows

    async def aborted():
        await set_step_gate(server.url, HOLD)
        try:
            running = asyncio.ensure_future(client.generate([1, 2, 3], long, seed=6))
            await wait_held_at_gate(server.url)
            await client.pause_generation("abort")
        finally:
            await set_step_gate(server.url, None)
        queued = asyncio.ensure_future(client.generate([4, 5], SamplingParams(max_new_tokens=3, temperature=0.0)))
        await wait_for(server.url, "/v1/loads", waiting(1), "queued the request")
        state = load(await get_json(server.url, "/v1/loads"))  # a second look: still queued, nothing running
        assert state["num_waiting_reqs"] == 1 and state["num_running_reqs"] == 0 and not queued.done()
        await client.continue_generation()
        return await running, await queued

    out, later = run_sync(aborted())
    assert out.finish_reason is FinishReason.ABORT and len(out.output_ids) == HOLD
    assert out.weight_versions == ((out.weight_version, 0, len(out.output_ids)),)
    assert later.finish_reason is FinishReason.LENGTH and len(later.output_ids) == 3

    async def unpaused():
        await set_step_gate(server.url, HOLD)
        try:
            running = asyncio.ensure_future(client.generate([1, 2, 3], long, seed=7))
            await wait_held_at_gate(server.url)
            # begin_weight_update waits for the running batch: no token may see half-updated weights.
            begin = asyncio.ensure_future(client.begin_weight_update())
            await wait_for(server.url, "/step_gate", lambda gate: gate["in_weight_update"], "opened the session")
            assert not begin.done() and not running.done()
        finally:
            await set_step_gate(server.url, None)
        await begin
        norm = [("model.norm.weight", local._params["model.norm.weight"].detach().clone())]
        await client.update_weights_from_tensor(payloads(norm, 2), weight_version="after")
        await client.end_weight_update()
        return await running

    out = run_sync(unpaused())
    assert len(out.output_ids) == 400 and len(out.weight_versions) == 1
    assert out.weight_version != "after"


def test_an_http2_probe_is_one_info_line_not_an_error(server):
    """sglang-router opens each connection with HTTP/2's preface first (then HTTP/1.1): the server answers 400 and
    logs one INFO line, not an ERROR with a traceback (every engine log used to start with two)."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(24))
        assert connection.recv(64).startswith(b"HTTP/1.0 400 Bad Request")
    deadline = time.monotonic() + 30
    while "HTTP/2 connection preface" not in (log := server.log_path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "INFO aiohttp.server: refused an HTTP/2 connection preface (sglang-router's probe" in log
    assert "ERROR" not in log and "Traceback" not in log


HEALTHY_STUB = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_dead_server_is_named_by_its_refused_connection(tmp_path):
    port = free_port()
    process = ServerProcess([sys.executable, "-c", HEALTHY_STUB, str(port)], name="engine 9",
                            url=f"http://127.0.0.1:{port}", log_path=tmp_path / "e9.log").start()
    process.wait_healthy(60)
    client = EngineClient(process.url, name="engine 9")
    process.stop()
    assert not process.alive()
    with pytest.raises(EngineError, match=rf"engine 9 at {process.url}: POST /generate: the server cannot be reached"):
        run_sync(client.generate([1, 2], SamplingParams(max_new_tokens=2)))  # refused connection, not a time-out
    broken = ServerProcess([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                           name="engine 8", url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "e8.log")
    with pytest.raises(ServerStartError, match=r"engine 8 \(http://127\.0\.0\.1:\d+\) exited with code 3 before it "
                                               r"was healthy; its log .*e8\.log ends:\nno model here"):
        broken.start().wait_healthy(30)


def test_a_server_dies_with_the_process_that_started_it(model_dir, tmp_path):
    """PR_SET_PDEATHSIG: the owner is SIGKILLed (no clean-up runs) and its server goes too."""
    import os
    import signal
    import subprocess

    code = (f"import sys, time; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parents[2])!r})\n"
            "from megarl.engines.server_process import ServerProcess, free_port\n"
            "p = ServerProcess([sys.executable, '-c', 'import time; time.sleep(600)'], name='x', "
            "url='http://127.0.0.1:1', log_path=sys.argv[1]).start()\n"
            "print(p.pid, flush=True); time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "x.log")], stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    os.kill(server_pid, 0)  # alive
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"server pid {server_pid} outlived its owner")


def test_the_trainers_memory_phases_keep_engine_weights_valid(client, local):
    """With the trainer's own phase code against a real server: a step that syncs releases the
    weights too and resumes them before the sync, kv after; a critic warm-up step keeps the weights (it used to
    resume released weights without a sync: garbage on SGLang) and only kv comes back; tags never released are
    never resumed (SGLang refuses that)."""
    from megarl.controller.engine_memory import TRAINING_TAGS, EngineMemory

    memory = EngineMemory([client], enabled=True)
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)

    def generate():
        return run_sync(client.generate(PROMPTS[0], greedy)).output_ids

    memory.release(weights=False)  # warm-up step: no sync follows
    assert memory.released == {"kv_cache", "cuda_graph"}
    with pytest.raises(EngineError, match=r"memory \['kv_cache'\] is released"):
        generate()
    memory.resume(TRAINING_TAGS)
    assert len(generate()) == 2 and memory.released == set()
    memory.release(weights=True)  # a step that syncs
    memory.resume(["weights"])
    run_sync(_push(client, [(name, tensor.detach().clone()) for name, tensor in local._params.items()], "synced"))
    assert memory.released == {"kv_cache", "cuda_graph"}
    memory.resume(TRAINING_TAGS)
    assert len(generate()) == 2
    memory.resume(["weights", "kv_cache"])  # nothing released: no call at all
    assert memory.released == set()
    off = EngineMemory([client], enabled=False)  # engines on their own GPUs keep their memory
    off.release(weights=True)
    assert off.released == set() and len(generate()) == 2



class _CudaPayloadStandIn:
    """Pickles as a CUDA tensor does under SGLang's torch-reduction patch (``_rebuild_cuda_tensor_modified`` with
    torch's rebuild_cuda_tensor arguments, the device at index 6); its "IPC handle" carries the bytes themselves."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        from sglang.srt.utils.patch_torch import _rebuild_cuda_tensor_modified

        return _rebuild_cuda_tensor_modified, (torch.Tensor, torch.Size([len(self.data)]), (1,), 0, None, torch.uint8,
                                               0, self.data)


# A fresh process that never applied SGLang's patch; torch's CUDA rebuild is stood in by one that reads the bytes
# from the "handle" (no GPU here).
OPEN_IN_A_FRESH_PROCESS = """
import json, sys
import torch
from torch.multiprocessing import reductions
reductions.rebuild_cuda_tensor = lambda cls, size, stride, offset, storage, dtype, device, handle, *rest: (
    torch.frombuffer(bytearray(handle), dtype=dtype))
assert not hasattr(reductions, "_rebuild_cuda_tensor_original")
from megarl.engines.cpu_engine.weights import Payload
named = Payload(sys.argv[1], "flattened_bucket").named()
print(json.dumps({name: tensor.tolist() for name, tensor in named}))
"""


def test_a_cuda_payload_pickled_under_sglangs_patch_opens_in_the_server(tmp_path):
    """A CUDA sender pickles under SGLang's monkey_patch_torch_reductions(); the engine server, a process that had
    not applied it, opens such a payload (before: AttributeError _rebuild_cuda_tensor_original)."""
    import json
    import os
    import subprocess

    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    values = torch.tensor([1.5, -2.0, 3.25, 4.0])
    metadata = [FlattenedTensorMetadata(name="w", shape=torch.Size([4]), dtype=torch.float32, start_idx=0, end_idx=16,
                                        numel=16)]
    payload = MultiprocessingSerializer.serialize(
        {"flattened_tensor": _CudaPayloadStandIn(values.numpy().tobytes()), "metadata": metadata}, output_str=True)
    done = subprocess.run([sys.executable, "-c", OPEN_IN_A_FRESH_PROCESS, payload], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"w": [1.5, -2.0, 3.25, 4.0]}
