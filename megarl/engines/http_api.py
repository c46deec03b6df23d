"""SGLang's HTTP API as megarl uses it (pinned to sglang 0.5.23): routes, request fields, response fields.

One table, :data:`ROUTES`, is the wire format: the client (:mod:`megarl.engines.client`) builds
every request body with :func:`request_body`, which refuses a field the route's entry does not
list, and reads only the response fields listed; the CPU engine server
(:mod:`megarl.engines.cpu_engine`) serves exactly these routes. The contract test
(``tests/integration/test_http_contract.py``) checks the table against the installed sglang's own
sources: every route is served with that method, every field sent is a field of the route's
request dataclass in ``sglang/srt/managers/io_struct.py``, every field read is one SGLang returns.

Shapes (SGLang's):

- ``/generate``: ``input_ids`` (one list of ids, or a list of them for a batch), ``sampling_params``
  (a dict, or one per row), ``return_logprob``, ``rid``; the answer is one dict per input
  (a list for a batch) with ``output_ids`` and ``meta_info``: ``id``, ``finish_reason``
  (``{"type": "stop" | "length" | "abort", ...}``), ``prompt_tokens``, ``completion_tokens``,
  ``output_token_logprobs`` (``[logprob, token_id, None]`` per output token, when asked),
  ``weight_version``; with ``return_routed_experts`` (a server launched with
  ``--enable-return-routed-experts``) ``routed_experts``: base64 of int32
  ``[prompt + output tokens - 1 - routed_experts_start_len, num_hidden_layers, top_k]``.
- weight routes answer ``{"success": bool, "message": str}`` (400 when not successful);
  ``/pause_generation`` and ``/continue_generation`` ``{"message", "status"}``; memory routes JSON
  ``null``; ``/abort_request`` an empty body; ``/flush_cache`` text; ``/get_weights_by_name`` the
  weight's first ``truncate_size`` rows as lists of floats; ``/model_info`` ``model_path``,
  ``is_generation``, ``weight_version`` and more. Errors: HTTP 400 with ``{"error": {"message"}}``.
- Weight updates must run between ``/begin_weight_update`` and ``/end_weight_update`` (400
  otherwise), with one base64 payload per engine TP rank.
- SGLang's ``/health`` generates a token (and answers 503 while generation is paused): use it to
  wait for a server to come up, not while it is paused. ``sampling_params`` keys SGLang does not
  know are refused with 400.
- LoRA (a server launched with ``--enable-lora``): ``/load_lora_adapter_from_tensors`` takes ``lora_name``, PEFT's
  ``config_dict``, one payload of the adapter's whole PEFT-named tensors per engine TP rank (each rank slices its
  part) and ``expected_checksums`` (sha256 of each tensor's bytes, checked on every rank: a mismatch fails the
  load); ``/load_lora_adapter`` takes a PEFT directory (``lora_path``); ``/unload_lora_adapter`` waits for the
  adapter's requests to finish. A name is loaded once: unload it before loading it again. They answer
  ``{"success", "error_message", "loaded_adapters"}``, 400 when not successful. A ``/generate`` request names its
  adapter in ``lora_path`` (one, or one per row; an adapter not loaded is refused with 400).
- SGLang 0.5.23 implements ``/get_weights_by_name`` only for Llama-like, OPT, Granite, Exaone4
  and Gemma2 models (not Qwen2/Qwen3: 400), and with engine TP > 1 it returns TP rank 0's slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megarl.config.async_training import PAUSE_MODES  # noqa: F401 - re-exported for the server and tests

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""``tags`` of ``/release_memory_occupation`` and ``/resume_memory_occupation`` (None or absent: all)."""
# PAUSE_MODES (megarl.config.async_training, which checks them in the config): ``mode`` of ``/pause_generation``:
# abort running requests (they finish with ``abort``), retract them (their KV is dropped; they resume from their
# tokens on ``/continue_generation``), or hold them in place.
ADMIN_KEY_ENV = "MEGARL_ENGINE_ADMIN_KEY"
"""The environment variable megarl's CPU engine server reads its admin key from (never its command line, which
other users of the machine can read); SGLang takes it as ``--admin-api-key``."""
FLATTENED_BUCKET = "flattened_bucket"
"""``load_format`` of ``/update_weights_from_tensor`` for one flattened tensor per bucket plus metadata."""


@dataclasses.dataclass(frozen=True)
class Route:
    """One SGLang route as megarl uses it."""

    path: str
    method: str
    """``GET`` or ``POST`` (what megarl sends; SGLang may serve more)."""
    request: str | None = None
    """SGLang's request dataclass (``io_struct.py``) whose fields the body uses; None: no body."""
    sends: tuple[str, ...] = ()
    """Body fields megarl may send."""
    reads: tuple[str, ...] = ()
    """Response fields megarl reads (top level)."""
    idempotent: bool = False
    """Asking twice does what asking once does (reads): the client retries it when the connection fails."""
    admin: bool = False
    """A control route: SGLang marks it ``AuthLevel.ADMIN_OPTIONAL``, so an engine launched with an admin key
    (``--admin-api-key``; megarl's CPU server: :data:`ADMIN_KEY_ENV`) serves it only to a request carrying
    ``Authorization: Bearer <key>``. Generation, health and model info stay open (the router calls them)."""


GENERATE_META_READS = ("id", "finish_reason", "prompt_tokens", "completion_tokens", "output_token_logprobs",
                       "weight_version", "weight_versions", "routed_experts")
"""``meta_info`` fields of a ``/generate`` answer megarl reads."""

ROUTES: Mapping[str, Route] = {route.path: route for route in (
    Route("/health", "GET", idempotent=True),
    Route("/model_info", "GET", reads=("model_path", "is_generation", "weight_version"), idempotent=True),
    Route("/generate", "POST", "GenerateReqInput", sends=("input_ids", "sampling_params", "return_logprob", "rid",
                                                          "return_routed_experts", "routed_experts_start_len",
                                                          "lora_path", "image_data"),
          reads=("output_ids", "meta_info")),
    Route("/begin_weight_update", "POST", "BeginWeightUpdateReqInput", reads=("success", "message"), admin=True),
    Route("/end_weight_update", "POST", "EndWeightUpdateReqInput", reads=("success", "message"), admin=True),
    Route("/update_weights_from_tensor", "POST", "UpdateWeightsFromTensorReqInput",
          sends=("serialized_named_tensors", "load_format", "flush_cache", "weight_version"),
          reads=("success", "message"), admin=True),
    Route("/init_weights_update_group", "POST", "InitWeightsUpdateGroupReqInput",
          sends=("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
          reads=("success", "message"), admin=True),
    Route("/update_weights_from_distributed", "POST", "UpdateWeightsFromDistributedReqInput",
          sends=("names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version", "load_format"),
          reads=("success", "message"), admin=True),
    Route("/destroy_weights_update_group", "POST", "DestroyWeightsUpdateGroupReqInput", sends=("group_name",),
          reads=("success", "message"), admin=True),
    Route("/pause_generation", "POST", "PauseGenerationReqInput", sends=("mode",), admin=True),
    Route("/continue_generation", "POST", "ContinueGenerationReqInput", admin=True),
    Route("/flush_cache", "POST", admin=True),
    Route("/release_memory_occupation", "POST", "ReleaseMemoryOccupationReqInput", sends=("tags",), admin=True),
    Route("/resume_memory_occupation", "POST", "ResumeMemoryOccupationReqInput", sends=("tags",), admin=True),
    Route("/get_weights_by_name", "POST", "GetWeightsByNameReqInput", sends=("name", "truncate_size"), admin=True,
          idempotent=True),
    Route("/abort_request", "POST", "AbortReq", sends=("rid", "abort_all"), admin=True),
    Route("/v1/loads", "GET", reads=("loads",), idempotent=True),
    Route("/update_weight_version", "POST", "UpdateWeightVersionReqInput",
          sends=("new_version", "abort_all_requests"), reads=("success", "message"), admin=True),
    Route("/load_lora_adapter_from_tensors", "POST", "LoadLoRAAdapterFromTensorsReqInput",
          sends=("lora_name", "config_dict", "serialized_named_tensors", "load_format", "expected_checksums"),
          admin=True),
    Route("/load_lora_adapter", "POST", "LoadLoRAAdapterReqInput", sends=("lora_name", "lora_path"), admin=True),
    Route("/unload_lora_adapter", "POST", "UnloadLoRAAdapterReqInput", sends=("lora_name",), admin=True),
)}
"""Every route megarl calls, by path."""


def request_body(path: str, **fields: Any) -> dict[str, Any]:
    """The JSON body of a request to ``path``: ``fields`` without the ``None`` ones.

    Raises ``ValueError`` for a route megarl does not use or a field its :class:`Route` does not
    list (so nothing reaches the wire that the contract test has not checked against SGLang).
    """
    route = ROUTES.get(path)
    if route is None:
        raise ValueError(f"megarl does not call SGLang route {path!r}; known: {sorted(ROUTES)}")
    unknown = sorted(set(fields) - set(route.sends))
    if unknown:
        raise ValueError(f"{path}: fields {unknown} are not in megarl's wire format for this route "
                         f"(sends {list(route.sends)}); add them to megarl.engines.http_api.ROUTES, where the "
                         f"contract test checks them against SGLang's {route.request}")
    return {key: value for key, value in fields.items() if value is not None}
