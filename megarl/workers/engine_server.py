"""Rollout engines as server processes, each owned by a Ray actor on the engine's node.

An :class:`EngineServerWorker` sits on the first bundle an engine serves and runs the engine's
server process there: megarl's CPU engine server (``python -m megarl.rollout.server``) for
``rollout.name=hf``, ``python -m sglang.launch_server`` for ``sglang`` (with exactly the
engine's GPUs, :mod:`megarl.controller.engine_gpus`). It starts the server, waits for it to
answer ``/health`` (an error names the engine, its URL and its log), reports its URL, and
stops it. The server dies with the actor (``PR_SET_PDEATHSIG``) even when the actor is killed.

Everything else (generation, weights, memory, pause) goes over HTTP with
:class:`megarl.rollout.client.EngineClient`, from the driver or the actor's ranks.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from megarl.config.model import ModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.rollout.server_process import ServerProcess
from megarl.workers.base import Worker, _node_ip, free_port


@dataclasses.dataclass(frozen=True)
class EngineAddress:
    """Where engine ``index`` serves: its name (in errors), URL and TP size (payloads per update)."""

    index: int
    url: str
    tp: int = 1

    @property
    def name(self) -> str:
        return f"engine {self.index}"


class EngineServerWorker(Worker):
    """Owns one engine server process (see the module docstring)."""

    role = "rollout"
    server: ServerProcess | None = None

    @property
    def index(self) -> int:
        """The engine's number: this worker's rank in its group."""
        return self.rank

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it, for the engine's server (the driver builds an SGLang
        launch command with them)."""
        host = _node_ip()
        return host, free_port(host)

    def start_server(self, *, rollout: RolloutConfig, model: ModelConfig, seed: int, device: str, log_dir: str,
                     launch: Any = None, url: str | None = None) -> str:
        """Start the engine's server and wait until it is healthy; returns its URL.

        ``launch``/``url``: for ``rollout.name=sglang``, the engine's
        :class:`~megarl.controller.engine_gpus.LaunchCommand` (argv and environment with its GPUs)
        and the URL it serves on (from :meth:`address`).
        """
        host = _node_ip()
        name = f"engine {self.index}"
        if rollout.name == "hf":
            port = free_port(host)
            argv = [sys.executable, "-m", "megarl.rollout.server", "--model-path", model.local_path, "--host", host,
                    "--port", str(port), "--dtype", rollout.dtype, "--random-seed", str(seed), "--device",
                    _hf_device(device)]
            if model.trust_remote_code:
                argv.append("--trust-remote-code")
            env: dict[str, str] = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            url = f"http://{host}:{port}"
        elif rollout.name == "sglang":
            if launch is None or url is None:
                raise ValueError(f"{name}: an SGLang engine needs its launch command and URL (GPUs, port)")
            argv, env = list(launch.argv), launch.environ(os.environ)
        else:
            raise ValueError(f"actor_rollout_ref.rollout.name={rollout.name!r} is unknown; use 'hf' or 'sglang'")
        self.server = ServerProcess(argv, name=name, url=url, log_path=Path(log_dir) / f"engine_{self.index}.log",
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


def _hf_device(device: str) -> str:
    """The CPU engine's torch device for ``trainer.device`` (the actor's visible GPU on CUDA runs)."""
    if device == "cuda":
        return "cuda:0"
    return device
