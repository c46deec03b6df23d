"""The wire format pinned to the installed sglang.

megarl's table of what it sends and reads (:data:`megarl.engines.http_api.ROUTES`) is checked
against sglang's own sources, read with ``ast`` by :mod:`tests.sglang_source`: every
route is served with the method megarl uses, every field sent is a field of the route's request
type, every field read is one sglang returns. The CPU engine server is held to the same lists:
it serves every route, and everything it answers is something sglang answers.
"""

from __future__ import annotations

import asyncio

import pytest

from megarl.engines.client import sampling_params_dict
from megarl.engines.cpu_engine.read_back import INSPECT_ROUTE
from megarl.engines.engine import SamplingParams
from megarl.engines.http_api import GENERATE_META_READS, MEMORY_TAGS, PAUSE_MODES, ROUTES, request_body
from tests import sglang_source


def test_the_pinned_sglang_is_the_one_read():
    assert sglang_source.sglang_version() == "0.5.23"


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_every_route_megarl_calls_is_served_with_its_method_and_fields(path):
    route = ROUTES[path]
    served = sglang_source.http_routes()
    assert path in served, f"sglang {sglang_source.sglang_version()} serves no {path}"
    assert route.method in served[path], f"{path} is served with {sorted(served[path])}, megarl uses {route.method}"
    if route.request is not None:
        assert sglang_source.route_request_types().get(path) == route.request
        fields = sglang_source.dataclass_fields(route.request)
        assert set(route.sends) <= set(fields), f"{path}: {sorted(set(route.sends) - set(fields))} are not fields " \
                                                 f"of sglang's {route.request}"
    else:
        assert not route.sends
    if route.reads:
        returned = sglang_source.response_fields(path, 200)
        assert set(route.reads) <= returned, f"{path}: sglang does not return {sorted(set(route.reads) - returned)}"


def test_generate_answers_and_sampling_keys():
    meta = sglang_source.generate_meta_info_fields()
    assert set(GENERATE_META_READS) <= set(meta)
    assert set(ROUTES["/generate"].reads) <= set(sglang_source.generate_response_fields())
    sampling = sampling_params_dict(SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=5,
                                                   stop_token_ids=(2,), ignore_eos=True), seed=5)
    assert set(sampling) <= set(sglang_source.api_schema_fields("SamplingParams"))
    assert set(sglang_source.finish_reasons()) == {"stop", "length", "abort"}
    assert set(MEMORY_TAGS) == set(sglang_source.memory_tags().values()) or set(MEMORY_TAGS) <= set(
        sglang_source.memory_tags().values())
    assert set(PAUSE_MODES) == set(sglang_source.literal_values("PauseGenerationReqInput", "mode"))


def test_a_field_outside_the_table_never_reaches_the_wire():
    with pytest.raises(ValueError, match=r"/generate: fields \['stream'\] are not in megarl's wire format"):
        request_body("/generate", input_ids=[1], stream=True)
    with pytest.raises(ValueError, match=r"megarl does not call SGLang route '/v1/chat/completions'"):
        request_body("/v1/chat/completions")
    assert request_body("/pause_generation", mode="retract") == {"mode": "retract"}


# ---------------------------------------------------------------------------------- the CPU server


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    from megarl.engines.cpu_engine.hf_engine import HFEngine
    from megarl.engines.cpu_engine.server import EngineServer
    from megarl.models.tiny import save_tiny

    model = save_tiny(tmp_path_factory.mktemp("contract") / "model", num_layers=1)
    return EngineServer(HFEngine(model), model_path=str(model), enable_lora=True, max_lora_rank=8)  # every route


def test_the_cpu_server_serves_every_route_with_the_methods_megarl_uses(engine_server):
    served: dict[str, set[str]] = {}
    for resource_route in engine_server.app().router.routes():
        served.setdefault(resource_route.resource.canonical, set()).add(resource_route.method)
    for path, route in ROUTES.items():
        assert route.method in served.get(path, set()), f"the CPU server does not serve {route.method} {path}"
    sglang_paths = sglang_source.http_routes()
    # megarl's own read for its tests and tools (never called by production code: test_strict_engine), under a
    # prefix SGLang does not use; every other route is SGLang's.
    assert INSPECT_ROUTE.startswith("/megarl/") and not [p for p in sglang_paths if p.startswith("/megarl/")]
    for path, methods in served.items():
        if path == INSPECT_ROUTE:
            continue
        assert path in sglang_paths and methods - {"HEAD"} <= sglang_paths[path] | {"HEAD"}, path


def test_what_the_cpu_server_answers_is_what_sglang_answers(engine_server):
    from aiohttp.test_utils import TestClient, TestServer

    async def exchange():
        client = TestClient(TestServer(engine_server.app()))
        await client.start_server()
        try:
            greedy = sampling_params_dict(SamplingParams(max_new_tokens=3, temperature=0.0), seed=1)
            single = await (await client.post("/generate", json=request_body(
                "/generate", input_ids=[1, 2, 3], sampling_params=greedy, return_logprob=True, rid="r1"))).json()
            short = sampling_params_dict(SamplingParams(max_new_tokens=1, temperature=1.0), seed=2)
            batch = await (await client.post("/generate", json=request_body(
                "/generate", input_ids=[[1, 2], [3]], sampling_params=[short, short]))).json()
            info = await (await client.get("/model_info")).json()
            paused = await (await client.post("/pause_generation", json=request_body("/pause_generation",
                                                                                      mode="abort"))).json()
            resumed = await (await client.post("/continue_generation", json={})).json()
            released = await (await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})).json()
            await client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
            begun = await (await client.post("/begin_weight_update", json={})).json()
            ended = await (await client.post("/end_weight_update", json={})).json()
            refused = await client.post("/generate", json={"input_ids": [1], "sampling_params": {"stop": ["x"]}})
            return single, batch, info, paused, resumed, released, begun, ended, refused.status, await refused.json()
        finally:
            await client.close()

    single, batch, info, paused, resumed, released, begun, ended, status, error = asyncio.run(exchange())
    top = set(sglang_source.generate_response_fields())
    meta = set(sglang_source.generate_meta_info_fields())
    finishes = sglang_source.finish_reasons()
    for answer in [single, *batch]:
        assert set(answer) <= top and set(answer["meta_info"]) <= meta
        finish = answer["meta_info"]["finish_reason"]
        assert set(finish) <= finishes[finish["type"]]
    assert single["meta_info"]["id"] == "r1" and len(single["meta_info"]["output_token_logprobs"]) == 3
    assert isinstance(batch, list) and len(batch) == 2
    assert set(info) <= sglang_source.response_fields("/model_info", 200)
    assert set(paused) <= sglang_source.response_fields("/pause_generation", 200)
    assert set(resumed) <= sglang_source.response_fields("/continue_generation", 200)
    assert released is None
    assert set(begun) == set(ended) == sglang_source.response_fields("/begin_weight_update", 200)
    assert status == 400 and "must keep their neutral values" in error["error"]["message"]


def test_the_load_and_step_gate_routes(engine_server, tmp_path):
    """``/v1/loads`` answers in SGLang's shape (``LoadSnapshot`` / ``QueueMetrics`` fields); ``/step_gate`` exists
    only on a server started with ``--enable-step-gate`` and refuses a bad ``hold_at``."""
    from aiohttp.test_utils import TestClient, TestServer

    from megarl.engines.cpu_engine.server import EngineServer

    async def exchange(server):
        client = TestClient(TestServer(server.app()))
        await client.start_server()
        try:
            loads = await (await client.get("/v1/loads")).json()
            gate = await client.get("/step_gate")
            set_gate = await client.post("/step_gate", json={"hold_at": 4})
            bad = await client.post("/step_gate", json={"hold_at": 0})
            return (loads, gate.status, set_gate.status, await set_gate.json() if set_gate.status == 200 else None,
                    bad.status)
        finally:
            await client.close()

    loads, gate, _, _, _ = asyncio.run(exchange(engine_server))
    entry_fields, queue_fields = sglang_source.load_fields()
    (entry,) = loads["loads"]
    assert set(entry) <= entry_fields and set(entry["queues"]) <= queue_fields
    assert entry["num_running_reqs"] == entry["num_waiting_reqs"] == 0 and gate == 404
    gated = EngineServer(engine_server.engine, model_path=engine_server.model_path, enable_step_gate=True)
    _, gate, set_status, answer, bad = asyncio.run(exchange(gated))
    assert (gate, set_status, bad) == (200, 200, 400)
    assert answer == {"hold_at": 4, "held": False, "tokens": 0, "running": 0, "in_weight_update": False}


def test_control_routes_are_sglangs_admin_routes():
    """``Route.admin`` is what SGLang 0.5.23 marks ``@auth_level(AuthLevel.ADMIN_*)``: with ``--admin-api-key`` these
    need the key; generation, health and model info stay open (the router calls them)."""
    sglang_auth = {route.path: route.auth for route in sglang_source.routes()}
    for path, route in ROUTES.items():
        assert route.admin == (sglang_auth[path] != "normal"), (path, sglang_auth[path])
    assert {p for p, r in ROUTES.items() if not r.admin} == {"/health", "/model_info", "/generate", "/v1/loads"}
    assert sglang_source.launch_server_flags()["--admin-api-key"] == "admin_api_key"


def test_an_engine_with_the_runs_key_serves_control_routes_only_to_the_trainer(tmp_path):
    """Every control route answers 401 without the key (a client that was not the trainer used to zero the
    embedding, or pause a run for minutes); with it the trainer's client works; generation needs no key."""
    from aiohttp.test_utils import TestClient, TestServer

    from megarl.engines.client import EngineClient, EngineError
    from megarl.engines.cpu_engine.hf_engine import HFEngine
    from megarl.engines.cpu_engine.server import EngineServer
    from megarl.models.tiny import save_tiny

    model = save_tiny(tmp_path / "model", num_layers=1)
    server = EngineServer(HFEngine(model), model_path=str(model), admin_key="run-key", enable_step_gate=True)

    async def exchange():
        client = TestClient(TestServer(server.app()))
        await client.start_server()
        try:
            refused = {}
            for path, route in ROUTES.items():
                if route.admin:
                    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "run-key"}):
                        reply = await client.request(route.method, path, json={}, headers=headers)
                        refused.setdefault(path, set()).add(reply.status)
            refused["/step_gate"] = {(await client.post("/step_gate", json={"hold_at": 1})).status}
            url = str(client.make_url("")).rstrip("/")
            outsider, trainer = EngineClient(url, name="x"), EngineClient(url, name="t", admin_key="run-key")
            generated = await outsider.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0))
            try:
                await outsider.pause_generation("in_place")
            except EngineError as error:
                outsider_error = str(error)
            await trainer.pause_generation("in_place")
            await trainer.continue_generation()
            await trainer.begin_weight_update()
            await trainer.end_weight_update()
            health = (await client.get("/health")).status
            await outsider.close()
            await trainer.close()
            return refused, generated, outsider_error, health
        finally:
            await client.close()

    refused, generated, outsider_error, health = asyncio.run(exchange())
    assert all(statuses == {401} for statuses in refused.values()), refused
    assert len(refused) == sum(route.admin for route in ROUTES.values()) + 1
    assert len(generated.output_ids) == 2 and health == 200
    assert "POST /pause_generation failed with HTTP 401: /pause_generation needs the engine's admin key" in outsider_error
    assert "run-key" not in outsider_error
