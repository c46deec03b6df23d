"""sglang-router in front of the engine servers: generation requests go through it.

The controller starts one router (the Rust router of the ``sglang-router`` package, started as
``python -m sglang_router.launch_router`` does; it runs on CPU too) over the engines' URLs and stops it at the
end of the run. Retries are off: a request that an engine fails comes back as an error naming
that engine's URL (the rollout manager then says which engine it was), instead of being
replayed on another engine with its KV state lost. Weight, memory and pause calls never go
through the router: they go to each engine directly.

The router's periodic health checks are off (``--disable-health-check``): SGLang 0.5.23's ``/health``
generates a token (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` defaults to true) and ``/ready`` is 503
while generation is paused, so an engine paused or with its memory released for a weight sync longer
than three check intervals would be dropped by the router, and taken back only after two more
intervals (``health_failure_threshold`` / ``health_success_threshold``), failing the next rollout.
Liveness is megarl's: each server's owner waits for it to start, and a request a dead engine fails
names that engine.

The router answers ``/health`` before it has registered its workers (sglang-router 0.3 adds each one after
reading its ``/get_server_info`` and ``/get_model_info``); a request in between is refused with 503 "No available
workers". :func:`start_router` waits until ``/workers`` lists every engine, healthy.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from megarl.config.rollout import ROUTER_POLICIES
from megarl.engines.server_process import ServerProcess, free_port

ROUTER_KEY_ENV = "MEGARL_ROUTER_CONTROL_KEY"
"""The run's key for the router's control plane, handed over in the environment (never on a command line, which
every local user can read) and popped by :data:`ROUTER_MAIN`."""

ROUTER_MAIN = """
import argparse, os, sys
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs
parser = argparse.ArgumentParser(prog="sglang-router")
RouterArgs.add_cli_args(parser, use_router_prefix=False)
argv = sys.argv[1:]
key = os.environ.pop("MEGARL_ROUTER_CONTROL_KEY", None)
if key:
    argv += ["--control-plane-api-keys", "megarl:megarl run:admin:" + key]
args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
args._validate_router_args()
Router.from_args(args).start()
"""
"""What ``python -m sglang_router.launch_router`` runs for the Rust router, with the same flags, minus its
import of the Python mini load balancer (which imports all of sglang: ~9 s against 0.1 s here). With the run's key
in :data:`ROUTER_KEY_ENV` the router's control plane (``/workers``: list, add, remove) answers only requests
carrying it (sglang-router's ``--control-plane-api-keys``, an admin key): without it any local process could
register a worker of its own and receive the run's prompts. ``/generate`` stays open, as the engines' is."""


def router_command(worker_urls: Sequence[str], *, host: str, port: int, policy: str,
                   log_level: str = "warn") -> list[str]:
    """The argv of sglang-router over ``worker_urls`` (``launch_router``'s flags)."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"actor_rollout_ref.rollout.router_policy={policy!r}; use one of {ROUTER_POLICIES}")
    if not worker_urls:
        raise ValueError("the router needs at least one engine URL")
    # The metrics exporter gets a port of its own: its default (29000) would collide between two routers.
    return [sys.executable, "-c", ROUTER_MAIN, "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--disable-retries", "--disable-health-check",
            "--log-level", log_level,
            "--prometheus-host", host, "--prometheus-port", str(free_port(host))]


def workers_registered(worker_urls: Sequence[str], body: bytes) -> bool:
    """Whether a ``/workers`` answer lists every one of ``worker_urls`` as healthy."""
    try:
        listed = json.loads(body).get("workers", [])
    except (ValueError, AttributeError):
        return False
    healthy = {w.get("url", "").rstrip("/") for w in listed if w.get("is_healthy", True)}
    return all(url.rstrip("/") in healthy for url in worker_urls)


def start_router(worker_urls: Sequence[str], *, policy: str, log_dir: str | Path, host: str = "127.0.0.1",
                 timeout_s: float = 120.0, log_name: str = "router.log", control_key: str | None = None
                 ) -> ServerProcess:
    """Start sglang-router on a free port of this machine and wait until it has registered every engine of
    ``worker_urls``, healthy (its log: ``log_dir / log_name``). ``control_key``: the run's key; the router's
    control plane then refuses requests without it (see :data:`ROUTER_MAIN`)."""
    port = free_port(host)
    router = ServerProcess(router_command(worker_urls, host=host, port=port, policy=policy), name="sglang-router",
                           url=f"http://{host}:{port}", log_path=Path(log_dir) / log_name, health_path="/workers",
                           ready=functools.partial(workers_registered, worker_urls),
                           env={ROUTER_KEY_ENV: control_key} if control_key else None,
                           health_headers={"Authorization": f"Bearer {control_key}"} if control_key else None)
    router.start()
    try:
        router.wait_healthy(timeout_s)
    except BaseException:
        router.stop()
        raise
    return router
