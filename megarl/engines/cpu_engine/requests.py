"""The CPU engine server's request plumbing: refusals answered as SGLang answers them (HTTP 400,
``{"error": {"message"}}``), JSON bodies, per-row fields and memory tags."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch
from aiohttp import web

from megarl.engines.engine import FinishReason, GenerateOutput, SamplingParams
from megarl.engines.http_api import MEMORY_TAGS, ROUTES
from megarl.seeds import MAX_SEED, derive_row_seed

logger = logging.getLogger("megarl.engine_server")

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "no_stop_trim",
                 "sampling_seed", "skip_special_tokens", "spaces_between_special_tokens", "n"}
"""``sampling_params`` keys this engine honours (or that do not change token ids)."""
NEUTRAL_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0, "stop": None, "json_schema": None, "regex": None, "ebnf": None,
                    "logit_bias": None, "custom_params": None}
"""SGLang sampling keys accepted only at their neutral value (this engine does not implement them)."""


class RequestError(ValueError):
    """A request this engine cannot serve; answered with HTTP 400 and the message."""


@web.middleware
async def errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Refusals and engine errors as HTTP 400 with a JSON message (SGLang's ``{"error": {"message"}}``)."""
    try:
        return await handler(request)
    except (RequestError, ValueError, RuntimeError, TypeError, KeyError) as error:
        logger.warning("%s %s: %s", request.method, request.path, error)
        return web.json_response({"error": {"message": f"{type(error).__name__}: {error}"}}, status=400)


async def json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    body = await request.json()
    if not isinstance(body, dict):
        raise RequestError(f"{request.path}: the body must be a JSON object")
    return body


def result(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def per_row(value: Any, num: int, key: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != num:
            raise RequestError(f"/generate: {key} has {len(value)} entries for {num} inputs")
        return value
    return [value] * num


def row_images(image_data: Any, num: int, batched: bool, multimodal: bool) -> list[list | None]:
    """Each row's images from SGLang's ``image_data`` (a batched request's: one entry per row; an entry is an image
    or a list of them, each a base64 data URI or raw base64; None for none) as decoded RGB images. File paths are
    refused, whether the file exists or not: megarl sends data URIs, and an open route must not read, or tell
    apart, the machine's files."""
    from megarl.data.images import BadImage, load_image

    if image_data is None:
        return [None] * num
    rows = per_row(image_data, num, "image_data") if batched else [image_data]
    if any(rows) and not multimodal:
        raise RequestError("/generate: image_data was given, but this engine's model is not a vision-language model")
    out = []
    for i, images in enumerate(rows):
        if images is None:
            out.append(None)
            continue
        images = images if isinstance(images, list) else [images]
        decoded = []
        for k, image in enumerate(images):
            if isinstance(image, str) and not image.startswith("data:"):
                try:
                    image = base64.b64decode(image, validate=True)  # raw base64, as SGLang accepts it
                except ValueError:
                    raise RequestError(f"/generate: image_data[{i}][{k}] is neither a data URI nor base64 (this "
                                       f"engine takes no file paths or URLs)") from None
            try:
                decoded.append(load_image(image, f"image_data[{i}][{k}]", paths=False))
            except BadImage as error:
                raise RequestError(f"/generate: {error}") from error
        out.append(decoded or None)
    return out


def memory_tags(tags: Any, route: str) -> set[str]:
    if tags is None:
        return set(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise RequestError(f"{route}: unknown tags {unknown}; use {list(MEMORY_TAGS)}")
    return set(tags)

def add_weight_versions(meta: dict[str, Any], events: list, version: str, num_tokens: int) -> None:
    """``weight_versions`` (spans of tokens per version) and ``weight_version`` (the last) as SGLang writes them;
    its own functions when the version changed during the request."""
    if not events:
        meta["weight_versions"] = [{"version": version, "start": 0, "end": num_tokens}]
        meta["weight_version"] = version
        return
    from sglang.srt.utils.weight_versions import add_weight_versions_to_meta_info, compute_weight_version_spans

    add_weight_versions_to_meta_info(meta, compute_weight_version_spans(events, version, num_tokens), num_tokens)


def is_control(path: str) -> bool:
    """A route only the trainer may call: SGLang's admin routes megarl uses, and the step gate."""
    route = ROUTES.get(path)
    return path == "/step_gate" or (route is not None and route.admin)


def sampling_params(raw: dict[str, Any], row: int, seeds: torch.Generator) -> tuple[SamplingParams, int]:
    """Row ``row``'s ``sampling_params`` as this engine runs them, and its row seed (``seeds`` draws one when the
    request names none)."""
    unknown = sorted(k for k in raw if k not in SAMPLING_KEYS and k not in NEUTRAL_SAMPLING)
    if unknown:
        raise RequestError(f"/generate: sampling_params {unknown} are not implemented by this engine")
    odd = sorted(k for k, neutral in NEUTRAL_SAMPLING.items() if k in raw and raw[k] not in (neutral, None))
    if odd:
        raise RequestError(f"/generate: sampling_params {odd} must keep their neutral values on this engine")
    if raw.get("n", 1) != 1:
        raise RequestError("/generate: sampling_params.n must be 1; repeat the input for more samples")
    params = SamplingParams(max_new_tokens=int(raw.get("max_new_tokens", 128)),
                            temperature=float(raw.get("temperature", 1.0)), top_p=float(raw.get("top_p", 1.0)),
                            top_k=int(raw.get("top_k", -1)),
                            stop_token_ids=tuple(int(t) for t in raw.get("stop_token_ids") or ()),
                            ignore_eos=bool(raw.get("ignore_eos", False)))
    seed = raw.get("sampling_seed")
    if seed is None:
        return params, int(torch.randint(MAX_SEED, (1,), generator=seeds))
    return params, derive_row_seed(int(seed), row)


def generate_answer(row: Any, output: GenerateOutput, weight_version: str) -> dict[str, Any]:
    """SGLang's ``/generate`` answer for one row (the server's ``_Row``) and its output."""
    finish: dict[str, Any] = {"type": output.finish_reason.value}
    if output.finish_reason is FinishReason.STOP:
        finish["matched"] = output.output_ids[-1]
    elif output.finish_reason is FinishReason.LENGTH:
        finish["length"] = len(output.output_ids)
    else:
        finish["message"] = "aborted"
    meta: dict[str, Any] = {"id": row.rid, "finish_reason": finish, "prompt_tokens": len(row.prompt),
                            "completion_tokens": len(output.output_ids), "cached_tokens": 0}
    add_weight_versions(meta, row.version_events, weight_version, len(output.output_ids))
    if row.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in
                                         zip(output.output_logprobs, output.output_ids, strict=True)]
    if row.routed_experts_start is not None:  # SGLang: base64 of int32 [seqlen - 1 - start, layers, top_k]
        routed = np.ascontiguousarray(output.routed_experts[row.routed_experts_start:], dtype=np.int32)
        meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode("ascii")
    return {"text": "", "output_ids": output.output_ids, "meta_info": meta}


DISCONNECT_CHECK_S = 1.0
"""How often a waiting ``/generate`` looks whether its client is still there (SGLang's tokenizer manager: 4 s)."""


async def while_connected(request: web.Request, done: asyncio.Future, on_gone: Callable[[], Awaitable[Any]]) -> Any:
    """``done``'s result, unless the client of ``request`` goes away first: then ``on_gone()`` (SGLang aborts the
    request) and a :class:`RequestError` for the log (nobody reads the answer)."""
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(done), DISCONNECT_CHECK_S)
        except TimeoutError:
            if request.transport is None or request.transport.is_closing():
                await on_gone()
                raise RequestError("/generate: the client went away; its requests were aborted") from None
