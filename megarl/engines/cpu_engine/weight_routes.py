"""The CPU engine server's weight routes (SGLang's): a weight-update session, updates from tensors and from a
process group, the weight version, read-back (``/get_weights_by_name``) and megarl's own look into the engine
(``/megarl/inspect_weight``). A part of :class:`~megarl.engines.cpu_engine.server.EngineServer`, whose state
(requests, session, released tags) they read and set."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from megarl.engines.cpu_engine.read_back import INSPECT_ROUTE, ReadBackRefused
from megarl.engines.cpu_engine.requests import RequestError, json_body, result
from megarl.engines.cpu_engine.weights import Payload, ReceiveBuffer, receive
from megarl.engines.weight_group import join_group


class WeightRoutes:
    """SGLang's weight routes on the CPU engine server (a base of ``EngineServer``)."""

    def _set_weight_version(self, version: Any) -> None:
        """A new version: each running row records the version that ended and its tokens then (SGLang's
        ``record_weight_version_change``); queued rows have no output yet and record nothing."""
        if version is None or str(version) == self.weight_version:
            return
        from sglang.srt.utils.weight_versions import WeightVersionEvent

        with self._cond:
            for row in self._running:
                if not row.future.done():
                    row.version_events.append(WeightVersionEvent(self.weight_version, self._steps))
            self.weight_version = str(version)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await json_body(request)
        if "weights" in self.released:
            return result(False, "begin_weight_update: weights are released; /resume_memory_occupation "
                                  "with tags ['weights'] first")
        # No new batch from here; a running one that is not paused finishes first (SGLang's update takes the
        # writer lock, which waits for running requests), so every token has exactly one weight version.
        self._in_session = True
        try:
            while self._running and not self._holding:
                await asyncio.sleep(0.005)
            await self._off_loop(self.engine.begin_weight_update)
        except BaseException:
            self._in_session = False
            self._wake.set()
            raise
        return result(True, "Weight update session opened.")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await json_body(request)
        await self._off_loop(self.engine.end_weight_update)
        self._in_session = False
        self._opened.clear()
        self._wake.set()  # batches held back by the session
        return result(True, "Weight update session closed.")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if "weights" in self.released:
            return result(False, "update_weights_from_tensor: weights are released; /resume_memory_occupation "
                                  "with tags ['weights'] first (updating released weights writes into freed memory "
                                  "on GPUs)")
        if not self._in_session:
            return result(False, "update_weights_from_tensor must run between begin_weight_update() and "
                                  "end_weight_update()")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != self.tp_size:
            raise RequestError(f"/update_weights_from_tensor: serialized_named_tensors must hold one payload per "
                               f"engine TP rank ({self.tp_size}), got "
                               f"{len(payloads) if isinstance(payloads, list) else type(payloads).__name__}")
        # Every payload is opened (each holds a reference its sender counted) and its layout checked; this one
        # process loads rank 0's tensors (SGLang's ranks load theirs in parallel, one process each).
        ranks = [Payload(payload, body.get("load_format")) for payload in payloads]
        for rank, other in enumerate(ranks[1:], 1):
            if other.layout() != ranks[0].layout():
                raise RequestError(f"/update_weights_from_tensor: TP rank {rank}'s payload names other tensors than "
                                   f"rank 0's (every rank takes the full bucket)")
        for rank in ranks:
            rank.keep_open(self._opened, limit=4 * self.tp_size)
        named = ranks[0].named()
        await self._off_loop(self.engine.update_weights_from_tensor, named)
        self._set_weight_version(body.get("weight_version"))
        if body.get("flush_cache", True) and self._flush_refusal() is None:  # SGLang skips a refused flush
            self.engine.flush_cache()
        return result(True, f"Succeeded to update {len(named)} tensors.")

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the trainer's broadcast group as rank ``rank_offset`` (this engine is one TP rank), as SGLang
        does: ``rendezvous(tcp://master_address:master_port)``, a store prefixed by ``group_name``."""
        body = await json_body(request)
        name = body.get("group_name", "weight_update_group")
        if body.get("backend", "nccl") != "gloo":
            return result(False, f"init_weights_update_group: backend {body.get('backend', 'nccl')!r}; this engine "
                                  f"runs on CPU, use backend 'gloo'")
        if name in self._groups:
            return result(False, f"init_weights_update_group: group {name!r} exists; destroy it first")
        try:
            rank_offset, world_size = int(body["rank_offset"]), int(body["world_size"])
            if rank_offset < 1 or rank_offset + self.tp_size > world_size:
                raise ValueError(f"ranks {rank_offset}..{rank_offset + self.tp_size - 1} (this engine's "
                                 f"{self.tp_size} TP ranks) do not fit a group of {world_size} whose rank 0 sends")
            self._receive_buffers[name] = [ReceiveBuffer() for _ in range(self.tp_size)]
            self._groups[name] = list(await asyncio.gather(*[
                self._off_loop(join_group, str(body["master_address"]), int(body["master_port"]), rank_offset + r,
                               world_size, name) for r in range(self.tp_size)]))
        except (KeyError, RuntimeError, ValueError) as error:
            return result(False, f"Failed to initialize custom process group: {error}.")
        return result(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive one broadcast from rank 0 of the group (per tensor, or one ``flattened_bucket``) and load it."""
        body = await json_body(request)
        name = body.get("group_name", "weight_update_group")
        if name not in self._groups:
            return result(False, f"Group {name} not in {sorted(self._groups)}. Please call "
                                  f"`init_weights_update_group` first.")
        if "weights" in self.released:
            return result(False, "update_weights_from_distributed: weights are released; /resume_memory_occupation "
                                  "with tags ['weights'] first")
        if not self._in_session:
            return result(False, "update_weights_from_distributed must run between begin_weight_update() and "
                                  "end_weight_update()")
        ranks = await asyncio.gather(*[
            self._off_loop(receive, member, body["names"], body["dtypes"], body["shapes"], body.get("load_format"),
                           buffer)
            for member, buffer in zip(self._groups[name], self._receive_buffers[name], strict=True)])
        named = ranks[0]
        await self._off_loop(self.engine.update_weights_from_tensor, named)
        self._set_weight_version(body.get("weight_version"))
        return result(True, f"Succeeded to update {len(named)} tensors.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = (await json_body(request)).get("group_name", "weight_update_group")
        self._receive_buffers.pop(name, None)
        if self._groups.pop(name, None) is None:
            return result(False, "The group to be destroyed does not exist.")
        return result(True, "Succeeded to destroy custom process group.")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's route: aborts every request first unless ``abort_all_requests`` is false."""
        body = await json_body(request)
        if body.get("abort_all_requests", True):
            await self._abort_all()
        self._set_weight_version(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                                  "new_version": body["new_version"]})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        name, truncate = body.get("name"), int(body.get("truncate_size", 100))
        try:
            values = await self._off_loop(self.engine.read_weight, name, truncate, self.tp_size)
        except ReadBackRefused as refused:
            raise RequestError(str(refused)) from None
        return web.json_response(values)

    async def inspect_weight(self, request: web.Request) -> web.Response:
        """``/megarl/inspect_weight``: weight ``name`` whole (or its first ``rows``) as this engine holds it (an FP8
        engine's quantized values), ``{"dtype", "shape", "values"}``, for any model. SGLang has no such route:
        megarl's tests and tools look into this engine with it, the weight sync never does (it asks ``/get_weights_by_name``, answered as
        SGLang answers it; ``tests/unit/test_strict_engine.py`` checks that no production module calls it)."""
        body = await json_body(request)
        name, rows = body.get("name"), body.get("rows")
        try:
            tensor = await self._off_loop(self.engine.inspect_weight, name)
        except KeyError:
            raise RequestError(f"{INSPECT_ROUTE}: no weight named {name!r}") from None
        if rows is not None:
            tensor = tensor[:int(rows)]
        return web.json_response({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                                  "values": tensor.float().cpu().flatten().tolist()})

    async def _off_loop(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking call (one that takes the engine lock, which a running batch holds between its steps, or
        a collective) in a thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)
