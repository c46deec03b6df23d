"""The reader of SGLang's wire format (:mod:`tests.sglang_source`) against the installed sglang.

Every expectation below was read by hand in the pinned sglang (0.5.23) sources, quoted where it
matters, so a reader bug (a decorator form it misses, a base class it drops) fails here rather
than making the contract test pass vacuously. sglang is a CI dependency: when it is missing
these tests fail (``SGLangSourceError``), they do not skip.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import tomllib

from tests import sglang_source as src

REPO = Path(__file__).resolve().parents[2]

BASE_REQ = ["rid", "http_worker_ipc"]
"""``class BaseReq(msgspec.Struct, tag=True, kw_only=True, array_like=True)``: ``rid: Optional[str] = None``,
``http_worker_ipc: Optional[str] = None``; every request type but the two dataclasses derives from it."""


def test_sglang_is_installed_at_the_pinned_version():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project.get("dependencies", []) + [dep for extra in project.get("optional-dependencies", {}).values()
                                              for dep in extra]
    pins = [dep for dep in deps if dep.replace(" ", "").startswith("sglang==")]
    assert pins, "pyproject.toml pins no sglang==<version>"
    assert src.sglang_version() == pins[0].split("==")[1].strip() == "0.5.23"
    assert (src.sglang_root() / "srt" / "entrypoints" / "http_server.py").is_file()


# --------------------------------------------------------------------------------------------
# Routes (srt/entrypoints/http_server.py)
# --------------------------------------------------------------------------------------------

ROUTES_USED = {
    # path: (methods, request type). Quoted decorators:
    "/generate": ({"POST", "PUT"}, "GenerateReqInput"),  # @app.api_route("/generate", methods=["POST", "PUT"], ...)
    "/update_weights_from_tensor": ({"POST"}, "UpdateWeightsFromTensorReqInput"),
    "/init_weights_update_group": ({"POST"}, "InitWeightsUpdateGroupReqInput"),
    "/update_weights_from_distributed": ({"POST"}, "UpdateWeightsFromDistributedReqInput"),
    "/destroy_weights_update_group": ({"POST"}, "DestroyWeightsUpdateGroupReqInput"),
    "/begin_weight_update": ({"POST"}, "BeginWeightUpdateReqInput"),
    "/end_weight_update": ({"POST"}, "EndWeightUpdateReqInput"),
    "/pause_generation": ({"POST"}, "PauseGenerationReqInput"),
    "/continue_generation": ({"POST"}, "ContinueGenerationReqInput"),
    "/flush_cache": ({"GET", "POST"}, None),  # @app.api_route("/flush_cache", methods=["GET", "POST"]), ?timeout=
    "/release_memory_occupation": ({"GET", "POST"}, "ReleaseMemoryOccupationReqInput"),
    "/resume_memory_occupation": ({"GET", "POST"}, "ResumeMemoryOccupationReqInput"),
    "/get_weights_by_name": ({"GET", "POST"}, "GetWeightsByNameReqInput"),
    "/abort_request": ({"POST"}, "AbortReq"),  # async def abort_request(obj: Annotated[AbortReq, Body()], ...)
    "/health": ({"GET"}, None),  # @app.get("/health") @app.get("/health_generate") on one handler
    "/health_generate": ({"GET"}, None),
    "/get_model_info": ({"GET"}, None),  # deprecated alias of /model_info
    "/model_info": ({"GET"}, None),
}


def test_routes_megarl_uses_are_served_with_their_methods_and_request_types():
    routes = src.http_routes()
    types = src.route_request_types()
    for path, (methods, request_type) in ROUTES_USED.items():
        assert routes.get(path) == methods, path
        assert types.get(path) == request_type, path
        assert not src.route(path).conditional, path
    assert src.route("/health").handler == src.route("/health_generate").handler == "health_generate"
    assert src.route("/flush_cache").params == (("timeout", "float"),)  # timeout: float = Query(0.0, ge=0.0)


def test_route_forms_the_server_uses_are_all_read():
    routes = src.http_routes()
    assert routes["/v1/chat/completions"] == {"POST"}  # @app.post("/v1/chat/completions", dependencies=...)
    assert routes["/tokenize"] == routes["/v1/tokenize"] == {"POST"}  # two stacked @app.post(...) decorators
    # @app.post(os.environ.get("SGLANG_OLLAMA_GENERATE_ROUTE", "/api/generate"))
    assert routes["/api/generate"] == {"POST"}
    assert routes["/v1/loads"] == {"GET"}  # v1_loads.router, app.include_router(v1_loads_router)
    assert routes["/scale_elastic_ep"] == {"POST"}  # elastic_ep.router
    assert routes["/v1/realtime"] == {"WEBSOCKET"}
    assert routes["/"] == {"GET", "HEAD"} and src.route("/").conditional  # else-branch of SGLANG_OLLAMA_ROOT_ROUTE
    assert src.route("/dumper/{method}").conditional  # only when DUMPER_SERVER_PORT=reuse
    assert src.unresolved_routes() == (  # @app.get(_ollama_root_route) / @app.head(...): env var, no default
        "srt/entrypoints/http_server.py:2116: _ollama_root_route",
        "srt/entrypoints/http_server.py:2117: _ollama_root_route")
    assert "/update_weights" not in routes and "/get_server_info" in routes
    with pytest.raises(KeyError, match="does not serve '/no_such_route'"):
        src.route("/no_such_route")


# --------------------------------------------------------------------------------------------
# Request types (srt/managers/io_struct.py)
# --------------------------------------------------------------------------------------------

REQUEST_FIELDS = {
    "UpdateWeightsFromTensorReqInput": BASE_REQ + [
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
        "selector", "torch_empty_cache"],
    "InitWeightsUpdateGroupReqInput": BASE_REQ + [
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"],
    "UpdateWeightsFromDistributedReqInput": BASE_REQ + [
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format", "selector", "torch_empty_cache"],
    "DestroyWeightsUpdateGroupReqInput": BASE_REQ + ["group_name"],
    "BeginWeightUpdateReqInput": BASE_REQ + ["selector"],
    "EndWeightUpdateReqInput": BASE_REQ,
    "PauseGenerationReqInput": BASE_REQ + ["mode"],
    "ContinueGenerationReqInput": BASE_REQ + ["torch_empty_cache"],
    "ReleaseMemoryOccupationReqInput": BASE_REQ + ["tags"],
    "ResumeMemoryOccupationReqInput": BASE_REQ + ["tags"],
    "GetWeightsByNameReqInput": BASE_REQ + ["name", "truncate_size"],
    "GetWeightsByNameReqOutput": BASE_REQ + ["parameter"],
    "AbortReq": BASE_REQ + ["abort_all", "finished_reason", "abort_message", "weight_versions"],
    "FlushCacheReqInput": BASE_REQ + ["timeout_s"],
}


def test_request_types_have_their_exact_fields_base_class_first():
    for name, fields in REQUEST_FIELDS.items():
        assert list(src.dataclass_fields(name)) == fields, name
        assert src.record_kind(name) == "msgspec.Struct", name
    assert list(src.dataclass_fields("BaseReq")) == BASE_REQ
    assert list(src.dataclass_fields("BaseBatchReq")) == ["rids", "http_worker_ipcs"]
    assert src.request_fields("/pause_generation") == src.dataclass_fields("PauseGenerationReqInput")
    with pytest.raises(KeyError, match="takes no io_struct request body"):
        src.request_fields("/flush_cache")


def test_request_annotations_defaults_and_required_fields():
    tensor = src.dataclass_fields("UpdateWeightsFromTensorReqInput")
    # base64 strings over HTTP: "serialized_named_tensors: Annotated[List[bytes], Base64Bytes()]"
    assert tensor["serialized_named_tensors"] == "Annotated[List[bytes], Base64Bytes()]"
    assert src.required_fields("UpdateWeightsFromTensorReqInput") == {"serialized_named_tensors"}
    assert src.dataclass_defaults("UpdateWeightsFromTensorReqInput")["flush_cache"] == "True"
    assert src.required_fields("InitWeightsUpdateGroupReqInput") == {
        "master_address", "master_port", "rank_offset", "world_size"}
    assert src.dataclass_defaults("InitWeightsUpdateGroupReqInput")["group_name"] == "'weight_update_group'"
    assert src.dataclass_defaults("InitWeightsUpdateGroupReqInput")["backend"] == "'nccl'"
    assert src.required_fields("UpdateWeightsFromDistributedReqInput") == {"names", "dtypes", "shapes"}
    assert src.dataclass_fields("UpdateWeightsFromDistributedReqInput")["shapes"] == "List[List[int]]"
    assert src.required_fields("GetWeightsByNameReqInput") == {"name"}
    assert src.dataclass_defaults("GetWeightsByNameReqInput")["truncate_size"] == "100"
    # "parameter: Optional[List[Union[float, List[float]]]]": the rows, no shape, no dtype
    assert src.dataclass_fields("GetWeightsByNameReqOutput")["parameter"] == "Optional[List[Union[float, List[float]]]]"
    assert src.dataclass_fields("ReleaseMemoryOccupationReqInput")["tags"] == "Optional[List[str]]"
    assert src.required_fields("PauseGenerationReqInput") == set()
    # mode: Literal["abort", "retract", "in_place"] = "abort"
    assert src.literal_values("PauseGenerationReqInput", "mode") == ("abort", "retract", "in_place")
    assert src.dataclass_defaults("PauseGenerationReqInput")["mode"] == "'abort'"
    assert src.literal_values("UpdateWeightsFromTensorReqInput", "selector") == ("target", "draft", "all")
    # GPU_MEMORY_TYPE_KV_CACHE = "kv_cache" ... (srt/constants.py); tags None or [] means all three
    assert set(src.memory_tags().values()) == {"weights", "kv_cache", "cuda_graph"}


def test_generate_req_input_is_a_dataclass_with_the_fields_megarl_sends():
    fields = src.dataclass_fields("GenerateReqInput")
    assert src.record_kind("GenerateReqInput") == "dataclass"
    assert len(fields) == 72
    assert list(fields)[:4] == ["rid", "session_id", "text", "input_ids"]  # field order as declared
    assert {"input_ids", "sampling_params", "return_logprob", "rid", "stream", "text", "logprob_start_len",
            "top_logprobs_num", "return_text_in_logprobs", "routed_dp_rank", "data_parallel_rank"} <= set(fields)
    assert fields["sampling_params"] == "Optional[Union[List[Dict[str, Any]], Dict[str, Any]]]"
    assert fields["rid"] == "Optional[Union[str, List[str]]]"
    assert src.required_fields("GenerateReqInput") == set()
    # the JSON schema checked after the parse: GenerateRequest ignores unknown keys, SamplingParams refuses them
    assert not src.api_schema_rejects_unknown("GenerateRequest")
    assert src.api_schema_rejects_unknown("SamplingParams")
    assert {"input_ids", "sampling_params", "return_logprob", "rid"} <= set(src.api_schema_fields("GenerateRequest"))
    sampling = src.api_schema_fields("SamplingParams")
    assert {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
            "skip_special_tokens", "no_stop_trim", "n", "sampling_seed"} <= set(sampling)
    assert "seed" not in sampling and len(sampling) == 28


def test_unknown_names_fail_naming_them():
    with pytest.raises(KeyError, match="NoSuchReqInput"):
        src.dataclass_fields("NoSuchReqInput")
    with pytest.raises(KeyError, match="NoSuchSchema"):
        src.api_schema_fields("NoSuchSchema")
    # aliases: LoadLoRAAdapterReqOutput = UnloadLoRAAdapterReqOutput = (LoRAUpdateOutput)
    assert src.dataclass_fields("LoadLoRAAdapterReqOutput") == src.dataclass_fields("LoRAUpdateOutput")


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def _outcomes(path: str) -> set[tuple[frozenset[int] | None, str, frozenset[str]]]:
    return {(outcome.status, outcome.body, outcome.fields) for outcome in src.route_responses(path)}


S200, S400 = frozenset({200}), frozenset({400})
ERROR = frozenset({"error", "error.message"})  # _create_error_response: {"error": {"message": str(e)}}, 400
SUCCESS_MESSAGE = frozenset({"success", "message"})


def test_weight_update_routes_answer_success_and_message():
    # content = {"success": success, "message": message}; 200 if success else HTTPStatus.BAD_REQUEST
    for path in ("/update_weights_from_tensor", "/destroy_weights_update_group", "/begin_weight_update",
                 "/end_weight_update"):
        assert _outcomes(path) == {(frozenset({200, 400}), "object", SUCCESS_MESSAGE)}, path
    for path in ("/init_weights_update_group", "/update_weights_from_distributed"):
        assert _outcomes(path) == {(S200, "object", SUCCESS_MESSAGE), (S400, "object", SUCCESS_MESSAGE)}, path
    assert src.returns_field("/update_weights_from_tensor", "success", status=400)


def test_control_routes_answer_what_their_handlers_return():
    # {"message": "Generation paused successfully.", "status": "ok"}, status_code=200
    assert _outcomes("/pause_generation") == {(S200, "object", frozenset({"message", "status"}))}
    assert _outcomes("/continue_generation") == {(S200, "object", frozenset({"message", "status"}))}
    assert not src.returns_field("/pause_generation", "success")
    # flush_cache: Response(content="Cache flushed.\n...", status_code=200 if ret.success else HTTPStatus.BAD_REQUEST)
    assert _outcomes("/flush_cache") == {(frozenset({200, 400}), "text", frozenset())}
    # release/resume: the handler falls off the end (JSON null) or returns _create_error_response(e)
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert _outcomes(path) == {(S200, "null", frozenset()), (S400, "object", ERROR)}, path
    # abort_request: Response(status_code=200), or _create_error_response(e)
    assert _outcomes("/abort_request") == {(S200, "empty", frozenset()), (S400, "object", ERROR)}
    # health: Response(status_code=200) / Response(status_code=503), never a body
    assert {(o.status, o.body) for o in src.route_responses("/health")} == {
        (S200, "empty"), (frozenset({503}), "empty")}
    assert src.response_statuses("/health") == {200, 503}
    # get_weights_by_name: ORJSONResponse(ret) with ret the parameter's (truncated) rows; None -> error 400
    assert _outcomes("/get_weights_by_name") == {(S200, "list", frozenset()), (S400, "object", ERROR)}
    assert src.validation_error_fields() == {"object", "message", "type", "param", "code"}


def test_model_info_keys():
    # get_model_info -> `return await model_info()` -> result = {...}; result["embedding"] = ...
    fields = src.response_fields("/get_model_info")
    assert fields == src.response_fields("/model_info")
    assert {"model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
            "weight_version", "load_format", "model_type", "architectures", "embedding"} <= fields
    assert len(fields) == 15


def test_generate_answer_and_meta_info_keys():
    outcomes = _outcomes("/generate")
    assert (S400, "object", frozenset({"error"})) in outcomes  # {"error": contract_error}: a string, not a dict
    assert (S400, "object", ERROR) in outcomes  # _create_error_response(e) of serve_generate_request
    assert any(body == "stream" for _, body, _ in outcomes)  # stream=True: server-sent events
    for field in ("output_ids", "text", "meta_info", "meta_info.id", "meta_info.finish_reason",
                  "meta_info.finish_reason.type", "meta_info.prompt_tokens", "meta_info.completion_tokens",
                  "meta_info.output_token_logprobs", "meta_info.weight_version", "meta_info.weight_versions",
                  "meta_info.cached_tokens", "meta_info.e2e_latency", "meta_info.num_retractions"):
        assert src.returns_field("/generate", field), field
    for field in ("logprobs", "meta_info.logprobs", "meta_info.finish_reason.reason", "meta_info.output_logprobs"):
        assert not src.returns_field("/generate", field), field
    meta = src.generate_meta_info_fields()
    # meta_info = {"id": rid, "finish_reason": ..., "prompt_tokens": ..., "weight_version": ..., "num_retractions": ...}
    assert "srt/managers/tokenizer_manager.py:_handle_batch_output" in meta["prompt_tokens"]
    # the queued-abort answer (_handle_abort_req) has no prompt_tokens
    assert "srt/managers/tokenizer_manager.py:_handle_abort_req" not in meta["prompt_tokens"]
    assert "srt/managers/tokenizer_manager.py:_handle_abort_req" in meta["completion_tokens"]
    assert meta["output_token_logprobs"] == ("api/v1/api_types.py:GenerateMetaInfo",
                                             "srt/managers/tokenizer_manager.py:add_logprob_to_meta_info")
    assert "srt/utils/weight_versions.py:add_weight_versions_to_meta_info" in meta["weight_version"]
    assert set(src.generate_response_fields()) == {
        "text", "output_ids", "meta_info", "prompt_token_ids", "index", "embedding", "pooled_hidden_state"}
    assert src.finish_reasons() == {"stop": {"type", "matched"}, "length": {"type", "length"},
                                    "abort": {"type", "message", "status_code", "err_type"}}


# --------------------------------------------------------------------------------------------
# ServerArgs and launch_server flags
# --------------------------------------------------------------------------------------------


def test_launch_server_flags():
    flags = src.launch_server_flags()
    expected = {"--model-path": "model_path", "--tp-size": "tp_size", "--tensor-parallel-size": "tp_size",
                "--base-gpu-id": "base_gpu_id", "--mem-fraction-static": "mem_fraction_static",
                "--random-seed": "random_seed", "--nnodes": "nnodes", "--node-rank": "node_rank",
                "--dist-init-addr": "dist_init_addr", "--nccl-init-addr": "dist_init_addr", "--port": "port",
                "--host": "host", "--enable-memory-saver": "enable_memory_saver",
                "--skip-server-warmup": "skip_server_warmup", "--weight-version": "weight_version",
                "--load-format": "load_format", "--dtype": "dtype", "--trust-remote-code": "trust_remote_code",
                "--sampling-backend": "sampling_backend", "--disable-cuda-graph": "disable_cuda_graph"}
    for flag, field in expected.items():
        assert flags.get(flag) == field, flag
    # argparse.BooleanOptionalAction adds the --no- form (12 fields use it)
    assert flags["--no-enable-tf32-matmul"] == "enable_tf32_matmul"
    assert "--tp" not in flags and "--gpu-id" not in flags
    # checked once against the real `ServerArgs.add_cli_args(argparse.ArgumentParser())`: 559 options
    assert len(flags) == 559
    assert src.cli_flag("tp_size") == "--tp-size" and src.cli_flag("dist_init_addr") == "--dist-init-addr"
    with pytest.raises(KeyError, match="no launch_server flag"):
        src.cli_flag("disable_cuda_graph")  # Arg(no_cli=True); only the deprecated manual flag sets it


def test_server_args_fields():
    fields = src.server_args_fields()
    assert len(fields) == 546  # msgspec.structs.fields(ServerArgs) of the real class
    assert fields["tp_size"] == "int" and fields["base_gpu_id"] == "int"
    assert fields["dist_init_addr"] == "Optional[str]" and fields["mem_fraction_static"] == "Optional[float]"
    assert {"model_path", "nnodes", "node_rank", "port", "random_seed", "enable_memory_saver"} <= set(fields)


# --------------------------------------------------------------------------------------------
# The reader on a synthetic package: every registration form, without the real sources
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    root = tmp_path / "sglang"
    files = {
        "srt/entrypoints/http_server.py": '''
            import os
            from typing import Annotated
            from fastapi import Body, FastAPI, Request, Response
            from fastapi.responses import ORJSONResponse
            from sglang.srt.managers.io_struct import FooReqInput
            from sglang.srt.entrypoints.extra import router as extra_router

            app = FastAPI()
            app.include_router(extra_router, prefix="/x")
            ROOT = "/root"

            @app.post("/foo")
            @app.api_route(os.environ.get("FOO_ROUTE", "/foo2"), methods=["PUT", "get"])
            async def foo(obj: Annotated[FooReqInput, Body()], request: Request):
                if obj.a:
                    return ORJSONResponse({"ok": True, "detail": {"n": 1}}, status_code=HTTPStatus.CREATED)
                content = {"ok": False}
                content["why"] = "no"
                return ORJSONResponse(content, status_code=418 if obj.b else 400)

            async def bar(request: Request):
                if request:
                    return Response(status_code=204)

            app.add_api_route(ROOT, bar, methods=["DELETE"])

            if os.environ.get("DEBUG"):
                @app.get("/debug")
                async def debug():
                    return {"debug": 1}
        ''',
        "srt/entrypoints/extra.py": '''
            from fastapi import APIRouter
            router = APIRouter()

            @router.get("/y")
            async def y():
                return [1, 2]
        ''',
        "srt/managers/io_struct.py": '''
            from dataclasses import dataclass
            import msgspec

            class BaseReq(msgspec.Struct, kw_only=True):
                rid: Optional[str] = None

            class FooReqInput(BaseReq, kw_only=True):
                a: int
                b: Literal["x", "y"] = "x"
                rid: str = ""

            @dataclass
            class Gen:
                input_ids: list[int] = None
        ''',
    }
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(textwrap.dedent(text))
    src.clear_cache()
    monkeypatch.setattr(src, "sglang_root", lambda: root)
    yield root
    monkeypatch.undo()
    src.clear_cache()


def test_reader_handles_every_registration_form(fake_sglang):
    assert src.http_routes() == {"/foo": {"POST"}, "/foo2": {"PUT", "GET"}, "/root": {"DELETE"},
                                 "/debug": {"GET"}, "/x/y": {"GET"}}
    assert src.http_routes(include_conditional=False).keys() == {"/foo", "/foo2", "/root", "/x/y"}
    assert src.route_request_types() == {"/foo": "FooReqInput", "/foo2": "FooReqInput"}
    assert src.route("/x/y").source == "srt/entrypoints/extra.py:6"
    # a redefined base field keeps the base's position, with the subclass's annotation (as msgspec does)
    assert list(src.dataclass_fields("FooReqInput").items()) == [("rid", "str"), ("a", "int"),
                                                                  ("b", "Literal['x', 'y']")]
    assert src.required_fields("FooReqInput") == {"a"}
    assert src.record_kind("Gen") == "dataclass"
    assert src.literal_values("FooReqInput", "b") == ("x", "y")
    assert _outcomes("/foo") == {(frozenset({201}), "object", frozenset({"ok", "detail", "detail.n"})),
                                 (frozenset({418, 400}), "object", frozenset({"ok", "why"}))}
    assert _outcomes("/root") == {(frozenset({204}), "empty", frozenset()), (S200, "null", frozenset())}
    assert _outcomes("/debug") == {(S200, "object", frozenset({"debug"}))}
    assert _outcomes("/x/y") == {(S200, "list", frozenset())}


def test_a_missing_sglang_fails_loudly(monkeypatch):
    monkeypatch.setattr(src.importlib.util, "find_spec", lambda name: None)
    src.clear_cache()
    try:
        with pytest.raises(src.SGLangSourceError, match="sglang is not installed"):
            src.http_routes()
    finally:
        monkeypatch.undo()
        src.clear_cache()
