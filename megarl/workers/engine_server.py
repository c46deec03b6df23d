"""Rollout engines as server processes, each owned by a Ray actor on the engine's node.

An :class:`EngineServerWorker` sits on the first bundle an engine serves (for an SGLang engine spanning
nodes, one worker on each of its nodes' first bundle) and runs the engine's server process there: megarl's CPU engine server (``python -m megarl.engines.cpu_engine``) for
``rollout.name=hf``, ``python -m sglang.launch_server`` for ``sglang`` (with exactly the
engine's GPUs, :mod:`megarl.plan.engine_gpus`). It starts the server, waits for it to
answer ``/health`` (an error names the engine, its URL and its log), reports its URL, and
stops it. The server dies with the actor (``PR_SET_PDEATHSIG``) even when the actor is killed.

Everything else (generation, weights, memory, pause) goes over HTTP with
:class:`megarl.engines.client.EngineClient`, from the driver or the actor's ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.config.model import ModelSource
from megarl.config.rollout import EngineConfig
from megarl.engines.http_api import ADMIN_KEY_ENV
from megarl.engines.server_process import ServerProcess
from megarl.parallel.net import free_port, free_ports, node_ip
from megarl.workers.base import Worker


class EngineServerWorker(Worker):
    """Owns one engine server process (see the module docstring): an engine's whole server, or for an SGLang
    engine spanning nodes, its part on one node (node_rank 0 serves the API; the others run their TP ranks
    and answer ``/health`` only, as ``sglang.launch_server`` does on node_rank >= 1)."""

    role = "rollout"
    server: ServerProcess | None = None
    engine: int = -1
    node_rank: int = 0
    label: str = "engine"

    @property
    def name(self) -> str:
        return f"{self.label} {self.engine}" + (f" node_rank {self.node_rank}" if self.node_rank else "")

    def address(self, num_ports: int = 1, host: str | None = None) -> tuple[str, list[int]]:
        """The address to serve on (``host``; None: this node's IP) and ``num_ports`` distinct free ports on it
        (the server's, and for the first node of an engine spanning nodes its ``--dist-init-addr`` port): the
        driver builds SGLang's command with them."""
        host = host or node_ip()
        return host, free_ports(host, num_ports)

    def start_server(self, *, engine: int, rollout: EngineConfig, model: ModelSource, seed: int, device: str,
                     log_dir: str, tp: int = 1, node_rank: int = 0, launch: Any = None, url: str | None = None,
                     extra_args: Sequence[str] = (), admin_key: str | None = None, host: str | None = None,
                     label: str = "engine") -> str:
        """Start engine ``engine``'s server (its part on node ``node_rank``) and wait until it is healthy;
        returns its URL.

        ``tp``: the engine's TP size (megarl's CPU server takes one weight payload, and joins one group member,
        per TP rank, as SGLang's ranks do). ``launch``/``url``: for ``rollout.name=sglang``, the
        :class:`~megarl.plan.engine_gpus.LaunchCommand` of this node (argv and environment with its GPUs)
        and the URL it serves on (from :meth:`address`). ``extra_args``: appended to megarl's CPU server's
        command line (SGLang's are in ``launch``). ``admin_key``: the run's engine admin key: the server then
        serves its control routes only to requests carrying it (SGLang: ``--admin-api-key``; megarl's server
        reads it from :data:`~megarl.engines.http_api.ADMIN_KEY_ENV`, off its command line). ``host``: the address
        megarl's server listens on (None: this node's IP; a run on one machine passes loopback). ``label``: what the
        engine is called in errors and its log's name (``engine``; a generative judge's: ``judge engine``).
        """
        self.engine, self.node_rank, self.label = engine, node_rank, label
        host = host or node_ip()
        if rollout.name == "hf":
            if node_rank:
                raise ValueError(f"{self.name}: megarl's CPU engine server is one process per engine; "
                                 f"it has no node_rank > 0")
            port = free_port(host)
            argv = [sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", model.local_path, "--host", host,
                    "--port", str(port), "--dtype", rollout.dtype, "--random-seed", str(seed), "--device",
                    _hf_device(device, self.local_rank), "--tp-size", str(tp), *extra_args]
            if model.trust_remote_code:
                argv.append("--trust-remote-code")
            env: dict[str, str] = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            if admin_key:
                env[ADMIN_KEY_ENV] = admin_key
            url = f"http://{host}:{port}"
        elif rollout.name == "sglang":
            if launch is None or url is None:
                raise ValueError(f"{self.name}: an SGLang engine needs its launch command and URL (GPUs, port)")
            argv, env = list(launch.argv), launch.environ(os.environ)
            if admin_key:
                argv += ["--admin-api-key", admin_key]
        else:
            raise ValueError(f"{rollout.KEY}.name={rollout.name!r} is unknown; use 'hf' or 'sglang'")
        log_name = f"{label.replace(' ', '_')}_{engine}" + (f"_node{node_rank}" if node_rank else "") + ".log"
        self.server = ServerProcess(argv, name=self.name, url=url, log_path=Path(log_dir) / log_name,
                                    env=env, inherit_env=rollout.name == "hf")
        self.server.start()
        self.server.wait_healthy(rollout.engine_startup_timeout_s)
        return url

    def server_pid(self) -> int | None:
        """The server process's PID (tests check that none outlives its run)."""
        return None if self.server is None else self.server.pid

    def server_exit_code(self) -> int | None:
        """None while the server runs, else its exit code (a negative signal number when killed)."""
        return None if self.server is None else self.server.exit_code()

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _before_exit(self) -> None:
        """Its server goes with it (SIGKILL to the server's process group: nothing waits at this point)."""
        if self.server is not None and self.server.exit_code() is None:
            self.server.kill()


def _hf_device(device: str, local_rank: int) -> str:
    """The hf engine's torch device for ``trainer.device``: on CUDA its own GPU, ``cuda:<local_rank>``. The group's
    set-up (:meth:`megarl.workers.base.Worker.setup_env`) makes ``CUDA_VISIBLE_DEVICES`` the GPUs of all the
    group's workers on the node in local-rank order, and the server process inherits it, so ``cuda:0`` would put
    every engine of a node on the first one."""
    if device == "cuda":
        return f"cuda:{local_rank}"
    return device
