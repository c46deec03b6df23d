"""The one client of SGLang's HTTP API: generation, weight updates, memory and pause calls.

:class:`EngineClient` talks to one server (an engine, or sglang-router for generation) with
the wire format of :mod:`megarl.engines.http_api`; the same code drives ``sglang.launch_server``
on GPUs and megarl's CPU engine server (:mod:`megarl.engines.cpu_engine`) in CI.

- Async methods reuse one ``aiohttp`` session (keep-alive connections), opened on the event loop of the client's
  first call (in megarl the process's one loop, :mod:`megarl.engines.event_loop`) and closed there.
- :func:`run_sync` / :func:`gather_sync` / :func:`submit` run calls from synchronous code (the trainer, the actor's
  weight sync) on that loop (:mod:`megarl.engines.event_loop`; re-exported here).
- Failures raise :class:`EngineError` naming the engine, its URL, the route and what the
  server said (or that it cannot be reached).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np

from megarl.engines.engine import FinishReason, GenerateOutput, SamplingParams
from megarl.engines.event_loop import gather_sync, run_sync, submit
from megarl.engines.http_api import FLATTENED_BUCKET, ROUTES, Route, request_body
from megarl.errors import FieldsError

__all__ = ["CONTROL_TIMEOUT_S", "RETRY_DELAYS_S", "EngineAddress", "EngineClient", "EngineError", "gather_sync",
           "generate_output", "run_sync", "sampling_params_dict", "submit"]

RETRY_DELAYS_S = (0.25, 1.0)
"""Waits before the second and third try of an idempotent call whose connection failed (``Route.idempotent``)."""
CONTROL_TIMEOUT_S = 600.0
"""Limit of one control call (weights, memory, pause); generation has none (``generate_timeout_s``)."""


class EngineError(FieldsError, RuntimeError):
    """An engine server refused a request or could not be reached."""

    def __init__(self, message: str, *, engine: str, url: str, route: str, status: int | None = None) -> None:
        super().__init__(message)
        self.engine, self.url, self.route, self.status = engine, url, route, status
        self.unreachable = False
        """The connection failed (refused, reset, cut mid-answer): no answer at all."""


def sampling_params_dict(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """SGLang's ``sampling_params`` of one request (``seed``: its ``sampling_seed``, None for none).

    ``no_stop_trim`` keeps the matched stop token at the end of ``output_ids``, as the engine
    protocol requires.
    """
    body: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                            "top_p": params.top_p, "top_k": params.top_k, "ignore_eos": params.ignore_eos,
                            "no_stop_trim": True}
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        body["sampling_seed"] = int(seed)
    return body


def generate_output(result: dict[str, Any], return_logprob: bool,
                    routing_shape: tuple[int, int] | None = None, *, source: str = "an engine") -> GenerateOutput:
    """One ``/generate`` answer (``output_ids``, ``meta_info``) as a :class:`GenerateOutput`; with
    ``routing_shape`` (``(num_hidden_layers, top_k)``) its ``routed_experts`` decoded (SGLang's base64 int32)."""
    meta = result["meta_info"]
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or "type" not in finish:
        raise RuntimeError(f"an engine returned an unfinished output (finish_reason={finish!r})")
    logprobs = None
    if return_logprob:
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    output_ids = [int(t) for t in result["output_ids"]]
    routed = None
    if routing_shape is not None:
        routed = _routed_experts(meta, routing_shape, len(output_ids), source)
    return GenerateOutput(output_ids=output_ids, finish_reason=FinishReason(finish["type"]), output_logprobs=logprobs,
                          weight_version=meta.get("weight_version"),
                          weight_versions=_version_spans(meta.get("weight_versions"), len(output_ids)),
                          routed_experts=routed)


def _routed_experts(meta: dict[str, Any], shape: tuple[int, int], num_output: int, source: str) -> np.ndarray:
    """``meta_info.routed_experts`` as ``[prompt + output - 1, layers, top_k]`` int32, checked against the token
    counts of the answer."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise RuntimeError(f"{source} answered no meta_info.routed_experts although return_routed_experts was sent: "
                           f"SGLang returns them only when launched with --enable-return-routed-experts (megarl adds "
                           f"it with actor_rollout_ref.actor.router_replay.mode != off)")
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    layers, topk = shape
    expected = (int(meta["prompt_tokens"]) + num_output - 1) * layers * topk
    if flat.size != expected:
        raise RuntimeError(f"{source} answered routed_experts of {flat.size} ids; {meta['prompt_tokens']} prompt and "
                           f"{num_output} output tokens over {layers} layers × top-{topk} make {expected}")
    return flat.reshape(-1, layers, topk)


def _version_spans(spans: Any, num_tokens: int) -> tuple[tuple[str, int, int], ...] | None:
    """SGLang's ``weight_versions`` spans, checked to cover the output tokens end to end."""
    if spans is None:
        return None
    out = tuple((str(span["version"]), int(span["start"]), int(span["end"])) for span in spans)
    position = 0
    for version, start, end in out:
        if start != position or end < start:
            raise RuntimeError(f"an engine answered weight_versions {spans} that do not cover its {num_tokens} output "
                               f"tokens end to end")
        position = end
    if position != num_tokens:
        raise RuntimeError(f"an engine answered weight_versions {spans} that do not cover its {num_tokens} output "
                           f"tokens end to end")
    return out


@dataclasses.dataclass(frozen=True)
class EngineAddress:
    """Where engine ``index`` serves: its name (in errors), URL and TP size (payloads per update, group members),
    and who feeds it weights (:mod:`megarl.sync`)."""

    index: int
    url: str
    tp: int = 1
    admin_key: str | None = dataclasses.field(default=None, repr=False)
    """The run's engine admin key (control routes need it); never printed."""
    timeout_s: float = 120.0
    """The limit of each control call to it (``rollout.engine_timeout_s``)."""
    replica: int = 0
    """The actor DP replica whose senders stream weights into it (``distributed`` transport)."""
    host_ranks: tuple[int, ...] = ()
    """Actor ranks on the engine's GPUs, in engine TP order (colocated engines; the ``tensor`` transport)."""

    @property
    def name(self) -> str:
        return f"engine {self.index}"


class EngineClient:
    """Calls one SGLang-API server at ``url`` (``http://host:port``); ``name`` labels it in errors."""

    def __init__(self, url: str, *, name: str = "engine", generate_timeout_s: float | None = None,
                 control_timeout_s: float = CONTROL_TIMEOUT_S, admin_key: str | None = None,
                 lora_name: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.lora_name = lora_name
        """The LoRA adapter every generation request names (``lora_path``; a run syncing adapters into its engines,
        ``rollout.lora_sync=adapters``); None: the base model."""
        self._admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
        """Sent with every control route (``Route.admin``): an engine started with the run's key serves those
        only to the trainer."""
        self.generate_timeout_s = generate_timeout_s
        self.control_timeout_s = control_timeout_s
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        """The loop the session was opened on (its connections belong to it)."""

    def __repr__(self) -> str:
        return f"EngineClient({self.name} at {self.url})"

    # ------------------------------------------------------------------------ transport

    def _session(self) -> aiohttp.ClientSession:
        """The client's one session, opened on the running loop at the first call (or after :meth:`close`); a call
        on another loop while it is open is an error."""
        loop = asyncio.get_running_loop()
        if self._http is not None and not self._http.closed and self._http_loop is not loop:
            if not self._http_loop.is_closed():
                raise RuntimeError(f"{self!r} has its HTTP session open on another event loop; call it there "
                                   f"(megarl.engines.event_loop.run_sync), or close it first")
            self._http = None  # its loop is gone, and its connections with it
        if self._http is None or self._http.closed:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._http, self._http_loop = aiohttp.ClientSession(connector=connector), loop
        return self._http

    async def call(self, path: str, *, timeout_s: float | None = None, **fields: Any) -> Any:
        """The JSON answer of ``path`` (``None`` for an empty one); ``fields`` go through
        :func:`~megarl.engines.http_api.request_body`. A read (``Route.idempotent``) whose connection fails is
        tried again after each of :data:`RETRY_DELAYS_S`; the error then says how many tries failed."""
        route = ROUTES[path]
        for delay in RETRY_DELAYS_S if route.idempotent else ():
            try:
                return await self._call_once(route, timeout_s, fields)
            except EngineError as error:
                if not error.unreachable:
                    raise
            await asyncio.sleep(delay)
        try:
            return await self._call_once(route, timeout_s, fields)
        except EngineError as error:
            if error.unreachable and route.idempotent:
                error.args = (f"{error} (tried {len(RETRY_DELAYS_S) + 1} times)",)
            raise

    async def _call_once(self, route: Route, timeout_s: float | None, fields: dict[str, Any]) -> Any:
        path = route.path
        body = request_body(path, **fields) if route.method == "POST" else None
        timeout = aiohttp.ClientTimeout(total=self.control_timeout_s if timeout_s is None else timeout_s)
        where = f"{self.name} at {self.url}: {route.method} {path}"
        try:
            headers = self._admin_headers if route.admin else None
            async with self._session().request(route.method, self.url + path, json=body, timeout=timeout,
                                               headers=headers) as reply:
                text = await reply.text()
                if reply.status != 200:
                    raise EngineError(f"{where} failed with HTTP {reply.status}: {_message(text)}", engine=self.name,
                                      url=self.url, route=path, status=reply.status)
                if not text or reply.content_type != "application/json":
                    return None
                return await reply.json(content_type=None)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            failed = EngineError(f"{where}: the server cannot be reached ({type(error).__name__}: {error})",
                                 engine=self.name, url=self.url, route=path)
            failed.unreachable = True
            raise failed from error
        except asyncio.TimeoutError as error:
            raise EngineError(f"{where}: no answer within {timeout.total} s", engine=self.name, url=self.url,
                              route=path) from error

    async def _checked(self, path: str, **fields: Any) -> str:
        """A control call answered ``{"success", "message"}``: its message, or :class:`EngineError`."""
        answer = await self.call(path, **fields)
        if not answer or not answer.get("success", False):
            raise EngineError(f"{self.name} at {self.url}: {path} failed: {answer!r}", engine=self.name, url=self.url,
                              route=path)
        return str(answer.get("message", ""))

    async def close(self) -> None:
        """Close the session (on the loop it was opened on); the next call opens a new one."""
        session, self._http = self._http, None
        if session is not None and not session.closed:
            await session.close()

    def close_sync(self, timeout_s: float = 5.0) -> None:
        """:meth:`close` from synchronous code on another thread than the session's loop (at shutdown)."""
        session, loop = self._http, self._http_loop
        if session is None or session.closed or loop is None or loop.is_closed():
            self._http = None
            return
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(self.close(), loop).result(timeout_s)
        else:
            loop.run_until_complete(self.close())

    # ------------------------------------------------------------------------ generation

    async def generate(self, input_ids: Sequence[int], params: SamplingParams, *, seed: int | None = None,
                       return_logprob: bool = False, rid: str | None = None,
                       routing_shape: tuple[int, int] | None = None,
                       image_data: Sequence[str] | None = None) -> GenerateOutput:
        """One continuation of ``input_ids``; with ``seed`` (``sampling_seed``) megarl's CPU server samples it
        from ``derive_row_seed(seed, 0)``. ``routing_shape`` (``(num_hidden_layers, top_k)`` of a
        mixture-of-experts model): also the routed experts of every token (``return_routed_experts``)."""
        answer = await self.call("/generate", timeout_s=self.generate_timeout_s, input_ids=list(input_ids),
                                 sampling_params=sampling_params_dict(params, seed), return_logprob=return_logprob,
                                 rid=rid, return_routed_experts=True if routing_shape else None,
                                 lora_path=self.lora_name, image_data=list(image_data) if image_data else None)
        return generate_output(answer, return_logprob, routing_shape, source=f"{self.name} at {self.url}")

    async def generate_batch(self, input_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                             seed: int | None = None, return_logprob: bool = False,
                             routing_shape: tuple[int, int] | None = None,
                             image_data: Sequence[list[str] | None] | None = None) -> list[GenerateOutput]:
        """One continuation per row, in one request with one ``sampling_params`` (what sglang-router
        forwards; the server runs the rows as one batch). With ``seed``, megarl's CPU server samples
        row ``i`` from ``derive_row_seed(seed, i)``. ``routing_shape``: as :meth:`generate`. ``image_data``: each
        row's images (base64 data URIs, :func:`megarl.data.images.image_uri`; None for none), a vision-language
        model's, placed at the row's image placeholders."""
        if image_data is not None and not any(image_data):
            image_data = None
        answer = await self.call("/generate", timeout_s=self.generate_timeout_s,
                                 input_ids=[list(ids) for ids in input_ids],
                                 sampling_params=sampling_params_dict(params, seed), return_logprob=return_logprob,
                                 return_routed_experts=True if routing_shape else None, lora_path=self.lora_name,
                                 image_data=None if image_data is None else list(image_data))
        if not isinstance(answer, list) or len(answer) != len(input_ids):
            raise EngineError(f"{self.name} at {self.url}: /generate returned {type(answer).__name__} for a batch "
                              f"of {len(input_ids)}", engine=self.name, url=self.url, route="/generate")
        return [generate_output(result, return_logprob, routing_shape, source=f"{self.name} at {self.url}")
                for result in answer]

    async def async_generate(self, input_ids: Sequence[int], params: SamplingParams,
                             return_logprob: bool = False, image_data: Sequence[str] | None = None) -> GenerateOutput:
        """The agent loop's engine call: :meth:`generate` seeded by ``params.seed`` (``image_data``: the
        conversation's images)."""
        return await self.generate(input_ids, params, seed=params.seed, return_logprob=return_logprob,
                                   image_data=image_data)

    # ------------------------------------------------------------------------ weights

    async def begin_weight_update(self) -> None:
        await self._checked("/begin_weight_update")

    async def end_weight_update(self) -> None:
        await self._checked("/end_weight_update")

    async def update_weights_from_tensor(self, payloads: Sequence[bytes], *, load_format: str = FLATTENED_BUCKET,
                                         flush_cache: bool = False, weight_version: str | None = None) -> None:
        """Apply one bucket: ``payloads`` holds one ``MultiprocessingSerializer`` payload per engine TP rank."""
        await self._checked("/update_weights_from_tensor",
                            serialized_named_tensors=[base64.b64encode(p).decode("ascii") for p in payloads],
                            load_format=load_format, flush_cache=flush_cache, weight_version=weight_version)

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Join the trainer's broadcast group (blocks until every member has joined)."""
        await self._checked("/init_weights_update_group", master_address=master_address, master_port=master_port,
                            rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend)

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], *, group_name: str,
                                              load_format: str | None = None, flush_cache: bool = False,
                                              weight_version: str | None = None) -> None:
        """Receive and load tensors that rank 0 of ``group_name`` broadcasts (it broadcasts concurrently)."""
        await self._checked("/update_weights_from_distributed", names=list(names), dtypes=list(dtypes),
                            shapes=[list(shape) for shape in shapes], group_name=group_name, load_format=load_format,
                            flush_cache=flush_cache, weight_version=weight_version)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._checked("/destroy_weights_update_group", group_name=group_name)

    async def update_weight_version(self, version: str) -> None:
        """Set the version the engine reports for the tokens it samples from now on (running requests go on)."""
        await self._checked("/update_weight_version", new_version=version, abort_all_requests=False)

    async def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        """The first ``truncate_size`` rows of weight ``name`` (HF name), as float lists."""
        return await self.call("/get_weights_by_name", name=name, truncate_size=truncate_size)

    # ------------------------------------------------------------------------ LoRA adapters

    async def load_lora_adapter_from_tensors(self, name: str, config: dict[str, Any], payloads: Sequence[bytes], *,
                                             checksums: dict[str, str] | None = None,
                                             load_format: str | None = FLATTENED_BUCKET) -> None:
        """Load adapter ``name`` (PEFT's ``config``) from ``payloads``, one per engine TP rank, each the adapter's
        whole PEFT-named tensors (:mod:`megarl.engines.lora_wire`); ``checksums``: each tensor's sha256, which
        every engine rank checks (a mismatch fails the load)."""
        await self.call("/load_lora_adapter_from_tensors", lora_name=name, config_dict=config,
                        serialized_named_tensors=[base64.b64encode(p).decode("ascii") for p in payloads],
                        load_format=load_format, expected_checksums=checksums)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load adapter ``name`` from a PEFT directory ``path`` the engine can read."""
        await self.call("/load_lora_adapter", lora_name=name, lora_path=path)

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (the engine waits for its requests to finish)."""
        await self.call("/unload_lora_adapter", lora_name=name)

    # ------------------------------------------------------------------------ memory, pause, cache

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.call("/release_memory_occupation", tags=None if tags is None else list(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.call("/resume_memory_occupation", tags=None if tags is None else list(tags))

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.call("/pause_generation", mode=mode)

    async def continue_generation(self) -> None:
        await self.call("/continue_generation")

    async def flush_cache(self) -> None:
        await self.call("/flush_cache")

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        await self.call("/abort_request", rid=rid, abort_all=abort_all or None)

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when the server answers ``/health`` with 200."""
        try:
            await self.call("/health", timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        return await self.call("/model_info")

    async def answers(self, timeout_s: float) -> bool:
        """True when the server answers at all within ``timeout_s`` (``/v1/loads``; an error status is an answer
        too): a liveness probe that generates nothing."""
        try:
            await self.call("/v1/loads", timeout_s=timeout_s)
        except EngineError as error:
            return error.status is not None
        return True


def _message(text: str) -> str:
    """The error message of a server's answer (SGLang's ``{"error": {"message": ...}}``, or the text)."""
    import json

    try:
        data = json.loads(text)
    except ValueError:
        return text[:2000]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
        if data.get("error_message"):  # LoRA routes (LoRAUpdateOutput)
            return str(data["error_message"])
    return text[:2000]
