"""megarl's CPU engine server: the HF engine behind SGLang's HTTP API.

    python -m megarl.engines.cpu_engine --model-path DIR --port 30000 [--host 127.0.0.1] [--dtype float32]
                                    [--random-seed 0] [--device cpu] [--tp-size 1] [--trust-remote-code]
                                    [--enable-weights-cpu-backup]
                                    [--enable-return-routed-experts] [--enable-step-gate]
                                    [--enable-lora --max-lora-rank R --lora-target-modules M ...]

It serves the routes of :data:`megarl.engines.http_api.ROUTES` with SGLang's JSON, so the
client, the router and the weight sync run on CPU exactly as against ``sglang.launch_server``
on GPUs. It accepts (and ignores) body fields it does not use: sglang-router adds several.

The state it keeps (requests, pause, memory tags, weights, TP ranks, routed experts, load, step gate, admin
key) is described in :mod:`megarl.engines.cpu_engine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web

from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.cpu_engine.lora import LoraRoutes
from megarl.engines.cpu_engine.read_back import INSPECT_ROUTE
from megarl.engines.cpu_engine.requests import (
    RequestError,
    errors,
    generate_answer,
    is_control,
    json_body,
    memory_tags,
    per_row,
    row_images,
    sampling_params,
    while_connected,
)
from megarl.engines.cpu_engine.weight_routes import WeightRoutes
from megarl.engines.cpu_engine.weights import ReceiveBuffer
from megarl.engines.engine import FinishReason, GenerateOutput, SamplingParams
from megarl.engines.http_api import PAUSE_MODES
from megarl.models.sampling import ABORT, REBUILD

logger = logging.getLogger("megarl.engine_server")

ARRIVAL_QUIET_S, ARRIVAL_WAIT_MAX_S = 0.010, 0.100
"""An idle engine starts a batch once no request has arrived for ``ARRIVAL_QUIET_S`` (at most ``ARRIVAL_WAIT_MAX_S``
after the first): requests sent together by several callers (the asynchronous producer's groups) share the batch, as
SGLang's continuous batching runs them; this engine's batches take no rows once started (without the wait a step's
first group ran alone: nearly twice the engine time a step on ``tools/bench_async.py``'s generation-bound workload)."""


@dataclasses.dataclass
class _Row:
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    row_seed: int
    rid: str
    future: asyncio.Future
    routed_experts_start: int | None = None
    """With ``return_routed_experts``: the first position whose routing is returned (``routed_experts_start_len``)."""
    version_events: list = dataclasses.field(default_factory=list)
    """SGLang's ``WeightVersionEvent``s: the version that ended and the tokens this row had then."""
    adapter: Any = None
    """The LoRA adapter it runs with (``lora_path``; :mod:`megarl.engines.cpu_engine.lora`), None: the base."""
    images: list | None = None
    """Its images (``image_data``, decoded), None: none."""


class EngineServer(WeightRoutes):
    """The server's state and routes over one :class:`HFEngine` (see the module docstring)."""

    def __init__(self, engine: HFEngine, *, model_path: str, seed: int = 0, tp_size: int = 1,
                 enable_return_routed_experts: bool = False, enable_step_gate: bool = False,
                 admin_key: str | None = None, enable_lora: bool = False, max_lora_rank: int = 0,
                 lora_target_modules: tuple[str, ...] = (),
                 arrival_wait_s: tuple[float, float] = (ARRIVAL_QUIET_S, ARRIVAL_WAIT_MAX_S)) -> None:
        if tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
        if enable_return_routed_experts and not engine.routers:
            raise ValueError("--enable-return-routed-experts: the model has no mixture-of-experts router")
        self.engine = engine
        self.enable_return_routed_experts = enable_return_routed_experts
        """As SGLang's ``--enable-return-routed-experts``: without it, ``return_routed_experts`` returns nothing."""
        self.model_path = model_path
        self.tp_size = tp_size
        self.released: set[str] = set()
        self.weight_version = "default"
        self._seeds = torch.Generator().manual_seed(seed)
        self._queue: list[_Row] = []
        self._arrivals = 0  # requests queued so far (the scheduler waits while they keep coming)
        self._arrival_quiet_s, self._arrival_wait_max_s = arrival_wait_s
        self._running: list[_Row] = []
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        # Pause state, shared with the engine thread.
        self._cond = threading.Condition()
        self._pause_mode: str | None = None
        self._abort_running = False
        self._abort_rids: set[str] = set()
        self._holding = False  # the engine thread waits in control under a pause (no forward pass runs)
        self._steps = 0  # decoding steps of the running batch: tokens of each of its unfinished rows
        self.enable_step_gate = enable_step_gate
        self._admin_key = admin_key or None
        self._hold_at: int | None = None  # the step gate (module docstring): hold once the rows have this many tokens
        self._gate_held = False  # the engine thread waits at the step gate
        self._in_session = False
        self._groups: dict[str, list[Any]] = {}
        """Weight-update process groups by name (``/init_weights_update_group``): one member per TP rank."""
        self._receive_buffers: dict[str, list[ReceiveBuffer]] = {}
        """Per group, each member's receive buffer, reused from bucket to bucket (what CUDA's caching allocator
        gives SGLang's ranks: fresh host memory per bucket would cost its page faults every time)."""
        self._opened: dict[int, Any] = {}
        """The bucket buffers opened during the weight-update session (:meth:`Payload.keep_open`)."""
        self.lora = LoraRoutes(self, max_rank=max_lora_rank, targets=lora_target_modules) if enable_lora else None
        """LoRA adapters and their routes (``--enable-lora``), else None."""

    # ------------------------------------------------------------------------ application

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 34, middlewares=[self._authorize, errors])
        routes = [
            web.get("/health", self.health), web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),  # what sglang-router asks workers
            web.post("/generate", self.generate),
            web.post("/begin_weight_update", self.begin_weight_update),
            web.post("/end_weight_update", self.end_weight_update),
            web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.post("/flush_cache", self.flush_cache), web.get("/flush_cache", self.flush_cache),
            web.post("/release_memory_occupation", self.release_memory_occupation),
            web.post("/resume_memory_occupation", self.resume_memory_occupation),
            web.post("/get_weights_by_name", self.get_weights_by_name),
            web.post("/update_weight_version", self.update_weight_version),
            web.post("/abort_request", self.abort_request),
            web.get("/v1/loads", self.loads),
            web.post(INSPECT_ROUTE, self.inspect_weight),  # megarl's own, for its tests and tools
        ]
        if self.lora is not None:
            routes += self.lora.routes()
        if self.enable_step_gate:
            routes += [web.get("/step_gate", self.step_gate_state), web.post("/step_gate", self.step_gate)]
        app.add_routes(routes)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Control routes need the admin key when the server has one (SGLang's ``ADMIN_OPTIONAL`` decision:
        ``Authorization: Bearer <key>``, compared in constant time); the rest are open."""
        if self._admin_key is not None and is_control(request.path):
            given = request.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), self._admin_key.encode()):
                logger.warning("refused %s %s from %s: no valid admin key", request.method, request.path,
                               request.remote)
                return web.json_response({"error": {"message": f"{request.path} needs the engine's admin key "
                                                               f"(Authorization: Bearer <key>)"}}, status=401)
        return await handler(request)

    async def _start(self, app: web.Application) -> None:
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def _stop(self, app: web.Application) -> None:
        with self._cond:
            self._abort_running, self._pause_mode = True, None
            self._cond.notify_all()
        if self._scheduler is not None:
            self._scheduler.cancel()

    # ------------------------------------------------------------------------ info

    async def health(self, request: web.Request) -> web.Response:
        """200; 503 while generation is paused (SGLang's health check generates a token and fails then)."""
        return web.Response(status=503 if self._pause_mode is not None else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "weight_version": self.weight_version})

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's ``/v1/loads`` answer for this engine's one DP rank (the fields this engine keeps)."""
        with self._cond:
            running, waiting = list(self._running), len(self._queue)
            held = len(running) if self._holding else 0
            retracted = held if self._pause_mode == "retract" else 0
            used = sum(len(row.prompt) for row in running) + self._steps * len(running)
        load = {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": len(running),
                "num_waiting_reqs": waiting, "num_used_tokens": used, "num_total_tokens": used,
                "queues": {"waiting": waiting, "paused": held, "retracted": retracted}}
        return web.json_response({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                                  "version": "megarl-cpu", "accelerator": None, "num_accelerators": self.tp_size,
                                  "loads": [load]})

    async def step_gate_state(self, request: web.Request) -> web.Response:
        with self._cond:
            return web.json_response({"hold_at": self._hold_at, "held": self._gate_held, "tokens": self._steps,
                                      "running": len(self._running), "in_weight_update": self._in_session})

    async def step_gate(self, request: web.Request) -> web.Response:
        """Set (``{"hold_at": k}``, k >= 1) or lift (``{"hold_at": null}``) the step gate."""
        hold_at = (await json_body(request)).get("hold_at")
        if hold_at is not None and (isinstance(hold_at, bool) or not isinstance(hold_at, int) or hold_at < 1):
            raise RequestError(f"/step_gate: hold_at must be a positive number of tokens or null, got {hold_at!r}")
        with self._cond:
            self._hold_at = hold_at
            self._cond.notify_all()
        return await self.step_gate_state(request)

    # ------------------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("input_ids") is None:
            raise RequestError("/generate: this engine takes token ids (input_ids), not text; the trainer tokenizes")
        batched = bool(body["input_ids"]) and isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        num = len(prompts)
        sampling = per_row(body.get("sampling_params") or {}, num, "sampling_params")
        logprob = per_row(bool(body.get("return_logprob", False)) if not isinstance(body.get("return_logprob"), list)
                           else body["return_logprob"], num, "return_logprob")
        rids = per_row(body.get("rid"), num, "rid")
        routed = per_row(bool(body.get("return_routed_experts", False)), num, "return_routed_experts")
        routed_start = per_row(int(body.get("routed_experts_start_len", 0)), num, "routed_experts_start_len")
        lora = per_row(body.get("lora_path"), num, "lora_path")
        if self.lora is None and any(name is not None for name in lora):
            raise RequestError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        adapters = self.lora.resolve(lora) if self.lora is not None else [None] * num
        images = row_images(body.get("image_data"), num, batched, self.engine.vision is not None)
        missing = self._missing_tags()
        if missing:
            raise RequestError(f"/generate: memory {missing} is released; /resume_memory_occupation first")
        loop = asyncio.get_running_loop()
        rows = []
        for i in range(num):
            params, seed = sampling_params(sampling[i], i, self._seeds)
            self.engine._check_prompts([prompts[i]], params)
            start = None
            if routed[i] and self.enable_return_routed_experts:
                start = int(routed_start[i])
                if not 0 <= start <= len(prompts[i]):  # SGLang's check (scheduler.py)
                    raise RequestError(f"/generate: routed_experts_start_len={start} must be in [0, {len(prompts[i])}] "
                                       f"(the input's tokens)")
            rows.append(_Row(prompt=[int(t) for t in prompts[i]], params=params, return_logprob=bool(logprob[i]),
                             row_seed=seed, rid=str(rids[i] or uuid.uuid4().hex), future=loop.create_future(),
                             routed_experts_start=start, adapter=adapters[i], images=images[i]))
        for row in rows:
            self._use_adapter(row, True)
        self._queue.extend(rows)
        self._arrivals += 1
        self._wake.set()
        try:  # as SGLang: a client that went away has its rows aborted
            outputs = await while_connected(request, asyncio.gather(*(row.future for row in rows)),
                                            lambda: self._abort_rids_now({row.rid for row in rows}))
        finally:
            for row in rows:
                self._use_adapter(row, False)
        answers = [generate_answer(row, output, self.weight_version)
                   for row, output in zip(rows, outputs, strict=True)]
        return web.json_response(answers if batched else answers[0])

    def _use_adapter(self, row: _Row, queued: bool) -> None:
        if self.lora is not None:
            (self.lora.acquire if queued else self.lora.release)(row.adapter)

    def _missing_tags(self) -> list[str]:
        return sorted(self.released & {"weights", "kv_cache"})

    async def _schedule(self) -> None:
        """Run queued rows in batches on the engine thread, one batch at a time."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._queue:
                await self._await_arrivals(loop)
            # No batch starts while paused or while weights change (SGLang's requests wait for the update lock).
            while self._queue and self._pause_mode is None and not self._in_session:
                pending, self._queue = self._queue, []
                groups: dict[tuple[SamplingParams, bool, bool, Any], list[_Row]] = {}
                for row in pending:
                    key = dataclasses.replace(row.params, max_new_tokens=1)
                    groups.setdefault((key, row.return_logprob, row.routed_experts_start is not None, row.adapter),
                                      []).append(row)
                for (params, return_logprob, return_routed, adapter), rows in groups.items():
                    rows = [row for row in rows if not row.future.done()]
                    if not rows:
                        continue
                    with self._cond:
                        self._running, self._steps = rows, 0
                    try:
                        outputs = await loop.run_in_executor(
                            self.engine._executor, self.engine.generate_rows, [r.prompt for r in rows], params,
                            return_logprob, [r.row_seed for r in rows], [r.params.max_new_tokens for r in rows],
                            self._control, return_routed, adapter, [r.images for r in rows])
                    except Exception as error:  # noqa: BLE001 - handed to every request of the batch
                        for row in rows:
                            if not row.future.done():
                                row.future.set_exception(error)
                    else:
                        for row, output in zip(rows, outputs, strict=True):
                            if not row.future.done():
                                row.future.set_result(output)
                    finally:
                        with self._cond:
                            self._running = []

    async def _await_arrivals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Before a batch starts on an idle engine: wait while requests keep arriving (:data:`ARRIVAL_QUIET_S`)."""
        deadline = loop.time() + self._arrival_wait_max_s
        while loop.time() < deadline:
            seen = self._arrivals
            await asyncio.sleep(min(self._arrival_quiet_s, max(deadline - loop.time(), 0.0)))
            if self._arrivals == seen:
                return

    def _control(self) -> Any:
        """Between two decoding steps (engine thread): abort, hold while paused or at the step gate, rebuild after
        a retract."""
        with self._cond:
            self._steps += 1  # the running rows' tokens so far (this hook follows each sampled token)
            rebuild = False
            while not self._abort_running:
                if self._pause_mode in ("in_place", "retract"):
                    rebuild = rebuild or self._pause_mode == "retract"
                    self._holding, self._gate_held = True, False
                elif (self._hold_at is not None and self._steps >= self._hold_at
                      and not any(row.rid in self._abort_rids for row in self._running)):
                    self._holding, self._gate_held = False, True
                else:
                    break
                self._cond.notify_all()
                self._cond.wait()
            self._holding = self._gate_held = False
            if self._abort_running:
                return ABORT
            if self._abort_rids:
                rows = frozenset(i for i, row in enumerate(self._running) if row.rid in self._abort_rids)
                if rows:
                    return rows
            return REBUILD if rebuild else None

    # ------------------------------------------------------------------------ pause

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await json_body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"/pause_generation: mode {mode!r}; use one of {PAUSE_MODES}")
        with self._cond:
            self._pause_mode = mode
            self._abort_running = mode == "abort"
            self._cond.notify_all()
        if mode == "abort":
            self._abort_queued()
        # Answer once no forward pass runs: the batch ended or waits between steps.
        while self._running and not self._holding:
            await asyncio.sleep(0.005)
        if mode == "abort":
            with self._cond:
                self._abort_running = False
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    def _abort_queued(self, rids: set[str] | None = None) -> None:
        kept = []
        for row in self._queue:
            if rids is None or row.rid in rids:
                if not row.future.done():
                    row.future.set_result(GenerateOutput(output_ids=[], finish_reason=FinishReason.ABORT,
                                                         output_logprobs=[] if row.return_logprob else None))
            else:
                kept.append(row)
        self._queue = kept

    async def continue_generation(self, request: web.Request) -> web.Response:
        await json_body(request)
        with self._cond:
            self._pause_mode = None
            self._cond.notify_all()
        self._wake.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("abort_all"):
            await self._abort_all()
        elif body.get("rid"):
            await self._abort_rids_now({str(body["rid"])})
        return web.Response(status=200)

    async def _abort_rids_now(self, rids: set[str]) -> None:
        """Abort the requests ``rids``: those queued at once, those running at the engine's next step."""
        self._abort_queued(rids)
        with self._cond:
            self._abort_rids |= rids
            self._cond.notify_all()  # a batch held at the step gate lets the rows go
        while any(row.rid in rids and not row.future.done() for row in self._running):
            await asyncio.sleep(0.005)
        with self._cond:
            self._abort_rids -= rids

    async def _abort_all(self) -> None:
        self._abort_queued()
        with self._cond:
            self._abort_running = True
            self._cond.notify_all()
        while self._running:
            await asyncio.sleep(0.005)
        with self._cond:
            self._abort_running = False

    # ------------------------------------------------------------------------ memory

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = memory_tags((await json_body(request)).get("tags"), "/release_memory_occupation")
        if self._running and not self._holding:
            raise RequestError(f"/release_memory_occupation: {len(self._running)} requests are running; "
                               f"/pause_generation first")
        if "weights" in tags and self._in_session:
            raise RequestError("/release_memory_occupation: a weight-update session is open; /end_weight_update "
                               "first")
        if "weights" in tags and "weights" not in self.released:
            await self._off_loop(self.engine.release_memory_occupation)
        self.released |= tags
        return web.json_response(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = memory_tags((await json_body(request)).get("tags"), "/resume_memory_occupation")
        if "weights" in tags and "weights" in self.released:
            await self._off_loop(self.engine.resume_memory_occupation)
        self.released -= tags
        return web.json_response(None)

    def _flush_refusal(self) -> str | None:
        """Why SGLang would not flush now: requests run (held in place, or not paused), or wait while not paused.
        Retracted requests count as waiting, which a paused engine ignores."""
        if (self._running and self._pause_mode != "retract") or (self._queue and self._pause_mode is None):
            return "Cache not flushed because there are pending requests"
        return None

    async def flush_cache(self, request: web.Request) -> web.Response:
        refusal = self._flush_refusal()
        if refusal is not None:
            return web.Response(status=400, text=f"Flush cache failed.\n{refusal}. #queue-req: {len(self._queue)}, "
                                                 f"#running-req: {len(self._running)} (pause with mode retract, or "
                                                 f"wait for them)\n")
        self.engine.flush_cache()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. ")
