"""The CPU engine server's request plumbing: refusals answered as SGLang answers them (HTTP 400,
``{"error": {"message"}}``), JSON bodies, per-row fields and memory tags."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from megarl.rollout.http_api import MEMORY_TAGS, ROUTES

logger = logging.getLogger("megarl.engine_server")


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
