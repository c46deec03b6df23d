"""LoRA adapters on megarl's CPU engine server, as SGLang serves them with ``--enable-lora``.

- Flags (SGLang's): ``--enable-lora``, ``--max-lora-rank`` (an adapter of a higher rank is refused) and
  ``--lora-target-modules`` (PEFT's module names, or ``all``: an adapter touching another module is refused).
- ``/load_lora_adapter_from_tensors``: ``lora_name``, PEFT's ``config_dict``, one payload per engine TP rank
  (``--tp-size``), each the whole adapter (SGLang's ranks each slice their part; this one process opens every
  payload, checks ``expected_checksums`` on each as every SGLang rank does, and keeps rank 0's tensors);
  ``/load_lora_adapter``: a PEFT directory (``lora_path``); ``/unload_lora_adapter``: new requests naming it are
  refused at once, and the answer comes once no queued or running request uses it. A loaded name must be unloaded
  before it is loaded again. Answers: ``{"success", "error_message", "loaded_adapters"}``, 400 when not successful.
- ``/generate``'s ``lora_path`` (one name, or one per row; none: the base model): requests of different adapters
  never share a batch (SGLang mixes them in one batch; the numbers are those of each row alone). An adapter
  adds ``scale · B (A x)`` to each adapted linear layer's output (PEFT's ``lora_B(lora_A(x)) * scaling``,
  ``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``), in the engine's dtype.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from megarl.engines.cpu_engine.requests import RequestError, json_body
from megarl.engines.cpu_engine.weights import Payload
from megarl.engines.lora_wire import check_checksums, module_of

ALL_MODULES = "all"


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded adapter: ``(A [r, in], B [out, r])`` per HF module path, and its scale."""

    name: str
    rank: int
    scale: float
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    source: str
    """``__tensor__`` (loaded from tensors) or its directory."""


def adapter_from_peft(name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], model: torch.nn.Module,
                      *, max_rank: int, targets: Sequence[str], dtype: torch.dtype, source: str) -> Adapter:
    """An :class:`Adapter` of PEFT's ``config`` and tensors for ``model``; ``ValueError`` saying what does not fit."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}; only LORA is served")
    for key, plain in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False), ("modules_to_save", None)):
        if config.get(key, plain) not in (plain, None, False, "none"):
            raise ValueError(f"adapter {name!r}: {key}={config[key]!r} is not served (plain LoRA only)")
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} exceeds the server's --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        path, part = module_of(tensor_name)
        pairs.setdefault(path, {})[part] = tensor
    factors = {}
    for path, pair in sorted(pairs.items()):
        module = modules.get(path)
        leaf = path.rsplit(".", 1)[-1]
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"adapter {name!r}: {path!r} is not a linear layer of the served model")
        if ALL_MODULES not in targets and leaf not in targets:
            raise ValueError(f"adapter {name!r}: {leaf!r} is not among the server's --lora-target-modules "
                             f"{list(targets)}")
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: {path!r} has lora_{''.join(pair)} only; it needs lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, module.in_features) or tuple(b.shape) != (module.out_features, rank):
            raise ValueError(f"adapter {name!r}: {path!r} has A {list(a.shape)} and B {list(b.shape)}; the layer "
                             f"needs [{rank}, {module.in_features}] and [{module.out_features}, {rank}]")
        device = module.weight.device
        factors[path] = (a.to(device=device, dtype=dtype, copy=True), b.to(device=device, dtype=dtype, copy=True))
    if not factors:
        raise ValueError(f"adapter {name!r} has no tensors")
    return Adapter(name, rank, scale, factors, source)


@contextlib.contextmanager
def applied(model: torch.nn.Module, adapter: Adapter | None) -> Iterator[None]:
    """``adapter``'s hooks on ``model``'s layers for the ``with`` block (nothing with None)."""
    if adapter is None:
        yield
        return
    modules = dict(model.named_modules())
    handles = []

    def hook(a: torch.Tensor, b: torch.Tensor):
        def add(module, args, output):
            return output + torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b) * adapter.scale
        return add

    try:
        for path, (a, b) in adapter.factors.items():
            handles.append(modules[path].register_forward_hook(hook(a, b)))
        yield
    finally:
        for handle in handles:
            handle.remove()


class LoraRoutes:
    """The adapters a server holds and its LoRA routes (module docstring)."""

    def __init__(self, server: Any, *, max_rank: int, targets: Sequence[str]) -> None:
        if max_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1 with --enable-lora, got {max_rank}")
        self.server = server
        self.max_rank = max_rank
        self.targets = tuple(targets) or (ALL_MODULES,)
        self.adapters: dict[str, Adapter] = {}
        self._in_use: dict[int, int] = {}
        """Queued or running rows per adapter (by identity)."""
        self._released = asyncio.Event()

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/load_lora_adapter_from_tensors", self.load_from_tensors),
                web.post("/load_lora_adapter", self.load_from_path),
                web.post("/unload_lora_adapter", self.unload)]

    # ---------------------------------------------------------------------------- requests

    def resolve(self, names: Sequence[Any]) -> list[Adapter | None]:
        """The adapter of each row (``lora_path``, None: the base); refuses one not loaded, as SGLang does."""
        missing = sorted({str(n) for n in names if n is not None and n not in self.adapters})
        if missing:
            raise RequestError(f"The following requested LoRA adapters are not loaded: {missing[0]}\n"
                               f"Loaded adapters: {sorted(self.adapters)}.")
        return [None if n is None else self.adapters[n] for n in names]

    def acquire(self, adapter: Adapter | None) -> None:
        if adapter is not None:
            self._in_use[id(adapter)] = self._in_use.get(id(adapter), 0) + 1

    def release(self, adapter: Adapter | None) -> None:
        if adapter is not None:
            self._in_use[id(adapter)] -= 1
            if not self._in_use[id(adapter)]:
                del self._in_use[id(adapter)]
                self._released.set()

    # ---------------------------------------------------------------------------- routes

    def _answer(self, success: bool, error: str | None = None) -> web.Response:
        loaded = {name: adapter.source for name, adapter in self.adapters.items()}
        return web.json_response({"success": success, "error_message": error, "loaded_adapters": loaded},
                                 status=200 if success else 400)

    async def _load(self, name: Any, config: Any, tensors: Mapping[str, torch.Tensor], source: str) -> web.Response:
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name must be a non-empty string")
        if name in self.adapters:
            return self._answer(False, f"LoRA with name {name} already exists. Loaded LoRAs: {sorted(self.adapters)}")
        engine = self.server.engine
        try:
            adapter = adapter_from_peft(name, config, tensors, engine.model, max_rank=self.max_rank,
                                        targets=self.targets, dtype=engine.dtype, source=source)
        except (KeyError, TypeError, ValueError) as error:
            return self._answer(False, str(error))
        self.adapters[name] = adapter
        return self._answer(True)

    async def load_from_tensors(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        payloads = body.get("serialized_named_tensors")
        tp = self.server.tp_size
        if not isinstance(payloads, list) or len(payloads) != tp:
            raise RequestError(f"/load_lora_adapter_from_tensors: serialized_named_tensors must hold one payload per "
                               f"engine TP rank ({tp}), got "
                               f"{len(payloads) if isinstance(payloads, list) else type(payloads).__name__}")
        ranks = [dict(Payload(payload, body.get("load_format")).named()) for payload in payloads]
        expected = body.get("expected_checksums")
        if expected is not None:
            for rank, tensors in enumerate(ranks):
                check_checksums(tensors, expected, where=f"rank{rank}")
        return await self._load(body.get("lora_name"), body.get("config_dict") or {}, ranks[0], "__tensor__")

    async def load_from_path(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        path = Path(str(body.get("lora_path", "")))
        try:
            from safetensors.torch import load_file

            config = json.loads((path / "adapter_config.json").read_text())
            tensors = load_file(str(path / "adapter_model.safetensors"))
        except (OSError, ValueError) as error:
            return self._answer(False, f"cannot read the PEFT adapter at {str(path)!r}: {error}")
        return await self._load(body.get("lora_name"), config, tensors, str(path))

    async def unload(self, request: web.Request) -> web.Response:
        name = (await json_body(request)).get("lora_name")
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return self._answer(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}")
        while id(adapter) in self._in_use:  # SGLang's wait_for_unload: its requests finish first
            self._released.clear()
            await self._released.wait()
        return self._answer(True)
