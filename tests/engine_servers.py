"""Real CPU engine servers (and optionally sglang-router) for tests, started and stopped together.

    with engine_servers(model_dir, log_dir, num_engines=2, router=True) as servers:
        manager = RolloutManager(servers.generator, servers.engines, tokenizer, config, ...)

Each engine is ``python -m megarl.engines.cpu_engine`` on ``model_dir`` with its own
``--random-seed`` (engine ``i``: ``seeds[i]``, default ``i``), ``OMP_NUM_THREADS=1`` and its log
in ``log_dir``; the servers start concurrently (all started, then each waited for), so N
engines cost about one start-up. With ``router=True`` a real sglang-router
(:func:`megarl.engines.router.start_router`, as a run starts it) runs over them and is the generator;
otherwise the generator is engine 0's client. At exit the router stops first, then the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from megarl.engines.client import EngineClient
from megarl.engines.router import start_router
from megarl.engines.server_process import ServerProcess, free_port

START_TIMEOUT_S = 180.0


class EngineServers(NamedTuple):
    generator: EngineClient
    """Where generation goes: the router's client, or engine 0's when there is no router."""
    engines: list[EngineClient]
    """One client per engine (``engine i``), in order."""
    processes: list[ServerProcess]
    """The engine server processes, in order."""
    router: ServerProcess | None
    """The sglang-router process (None without ``router=True``)."""


def engine_server(model_dir: str | os.PathLike, log_dir: str | os.PathLike, *, index: int = 0,
                  seed: int = 0, tp_size: int = 1, extra_args: Sequence[str] = ()) -> ServerProcess:
    """Engine ``index``'s server process (not started): megarl's CPU engine server on a free port (``extra_args``
    appended to its command line)."""
    port = free_port()
    name = f"engine {index}"
    return ServerProcess([sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", str(model_dir), "--port",
                          str(port), "--random-seed", str(seed), "--tp-size", str(tp_size), *extra_args], name=name,
                         url=f"http://127.0.0.1:{port}",
                         log_path=Path(log_dir) / f"engine_{index}.log", env={"OMP_NUM_THREADS": "1"})


@contextlib.contextmanager
def engine_servers(model_dir: str | os.PathLike, log_dir: str | os.PathLike, *, num_engines: int = 1,
                   seeds: Sequence[int] | None = None, router: bool = False, policy: str = "round_robin",
                   timeout_s: float = START_TIMEOUT_S, tp_size: int = 1,
                   extra_args: Sequence[str] = ()) -> Iterator[EngineServers]:
    """Start ``num_engines`` CPU engine servers (and sglang-router over them with ``router``), wait until
    they answer ``/health``, yield :class:`EngineServers`; stop everything at exit (router first)."""
    seeds = list(range(num_engines)) if seeds is None else list(seeds)
    if len(seeds) != num_engines or num_engines < 1:
        raise ValueError(f"engine_servers needs num_engines >= 1 and one seed per engine, got {num_engines} "
                         f"engines and seeds {seeds}")
    processes = [engine_server(model_dir, log_dir, index=i, seed=seed, tp_size=tp_size, extra_args=extra_args)
                 for i, seed in enumerate(seeds)]
    router_process: ServerProcess | None = None
    clients: list[EngineClient] = []
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.wait_healthy(timeout_s)
        engines = [EngineClient(p.url, name=p.name) for p in processes]
        clients.extend(engines)
        if router:
            router_process = start_router([p.url for p in processes], policy=policy, log_dir=log_dir,
                                          timeout_s=timeout_s)
            generator = EngineClient(router_process.url, name="sglang-router")
            clients.append(generator)
        else:
            generator = engines[0]
        yield EngineServers(generator, engines, processes, router_process)
    finally:
        close_clients(clients)
        if router_process is not None:
            router_process.stop()
        for process in processes:
            process.stop()


def close_clients(clients: Sequence[EngineClient]) -> None:
    """Close the HTTP sessions the clients opened, on the event loop each was opened on (best effort: a session on
    a closed loop, or on the loop running this thread, is left to the garbage collector)."""
    for client in clients:
        with contextlib.suppress(Exception):
            client.close_sync(5)


# ------------------------------------------------------------------------------------ waiting on an engine's state

STATE_TIMEOUT_S = 120.0
"""How long :func:`wait_for` waits for a state before failing (a bound for a broken test, never a pace)."""


async def get_json(url: str, path: str) -> dict:
    """``GET url + path`` (a CPU engine server's ``/v1/loads`` or ``/step_gate``), its JSON answer."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url + path) as reply:
        reply.raise_for_status()
        return await reply.json()


async def set_step_gate(url: str, hold_at: int | None) -> dict:
    """Hold the running batch of the server at ``url`` (started with ``--enable-step-gate``) once its rows have
    ``hold_at`` output tokens; ``None`` lets it go on. The gate's state after the change."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.post(url + "/step_gate", json={"hold_at": hold_at}) as reply:
        reply.raise_for_status()
        return await reply.json()


async def wait_for(url: str, path: str, predicate, what: str, timeout_s: float = STATE_TIMEOUT_S) -> dict:
    """Poll ``GET url + path`` until ``predicate(answer)`` holds; that answer. Fails naming ``what`` and the last
    answer when it never holds."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        answer = await get_json(url, path)
        if predicate(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}: never {what} within {timeout_s} s; last {path}: {answer}")
        await asyncio.sleep(0.01)


async def wait_held_at_gate(url: str) -> dict:
    """Wait until the running batch of the server at ``url`` waits at its step gate; the gate's state."""
    return await wait_for(url, "/step_gate", lambda gate: gate["held"], "held a batch at the step gate")


def load(answer: dict) -> dict:
    """The one DP rank's entry of a ``/v1/loads`` answer."""
    (entry,) = answer["loads"]
    return entry


def admin_key_of(url: str) -> str | None:
    """The admin key of the CPU engine server serving ``url`` on this machine, read from its process's initial
    environment (``/proc/<pid>/environ``, readable by the run's own user only): how a test, or an operator of
    the run, drives the engines of a ``megarl-train`` run from outside it. None when the server has no key."""
    from pathlib import Path
    from urllib.parse import urlsplit

    from megarl.engines.http_api import ADMIN_KEY_ENV

    port = str(urlsplit(url).port)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"megarl.engines.cpu_engine" not in argv or port.encode() not in argv[argv.index(b"--port") + 1:][:1]:
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        prefix = f"{ADMIN_KEY_ENV}=".encode()
        return next((entry[len(prefix):].decode() for entry in environ if entry.startswith(prefix)), None)
    raise LookupError(f"no megarl.engines.cpu_engine process serves {url} on this machine")
