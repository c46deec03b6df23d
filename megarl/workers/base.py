"""The base of every Ray worker: process environment, rendezvous and parallel coordinates.

Nothing role-specific lives here. ``WorkerGroup`` constructs one instance per rank, calls
:meth:`Worker.node_info` on every rank, asks rank 0 for a rendezvous address
(:meth:`Worker.rendezvous_address`), then :meth:`Worker.setup_env` on every rank; after
that a role calls :meth:`Worker.init_parallel` (directly or from its own ``init_model``)
and the group reads :meth:`Worker.coordinates` to dispatch by data-parallel rank.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from megarl.config.parallel import Coordinates
from megarl.parallel.net import RENDEZVOUS_FILE_VARIABLE, free_port, node_ip


def busy(method):
    """Count the wall time of a worker method as this rank's compute time (see :meth:`Worker.take_busy`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy_s = getattr(self, "_busy_s", 0.0) + time.perf_counter() - start

    return wrapper


class Worker:
    """Base class of megarl's Ray workers (one instance per rank)."""

    role: str = "worker"
    """Role name used in errors and logs; subclasses set it (``actor``, ``ref``, ...)."""

    env_vars: dict[str, str] = {}
    """Environment of this role's processes besides megarl's defaults (:class:`megarl.workers.group.WorkerGroup`)."""

    rank: int = -1
    world_size: int = 0
    local_rank: int = 0
    groups = None
    """``megarl.parallel.ProcessGroups`` after :meth:`init_parallel`, else ``None``."""

    def node_info(self) -> dict:
        """Node IP, Ray node id, process id and the accelerator ids Ray assigned to this process."""
        gpu_ids: list[str] = []
        node_id = None
        try:
            import ray

            if ray.is_initialized():
                gpu_ids = [str(g) for g in ray.get_gpu_ids()]
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"ip": node_ip(), "node_id": node_id, "pid": os.getpid(), "gpu_ids": gpu_ids}

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it, for torch.distributed's TCP store (called on rank 0)."""
        ip = node_ip()
        return ip, free_port()

    def setup_env(self, *, rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int,
                  local_world_size: int = 1, visible_devices: str | None = None,
                  rendezvous_file: str | None = None) -> None:
        """Set this rank's distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*) and pin threads.

        ``visible_devices``: the node's GPU ids of this group in local-rank order; it becomes
        ``CUDA_VISIBLE_DEVICES`` so that ``LOCAL_RANK`` selects this rank's own GPU and NCCL
        sees its node peers (Ray alone would show each process only its own GPU).
        ``rendezvous_file``: a group on one machine meets through this file instead of a TCP store (which listens
        on every interface whatever its address), and gloo binds to loopback (``GLOO_SOCKET_IFNAME=lo``).
        """
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                           "LOCAL_WORLD_SIZE": str(local_world_size),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
                           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if rendezvous_file is not None:
            os.environ.update({RENDEZVOUS_FILE_VARIABLE: rendezvous_file, "GLOO_SOCKET_IFNAME": "lo"})
        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        torch = sys.modules.get("torch")  # one that imports torch later reads OMP_NUM_THREADS then (an engine
        if torch is not None:  # server's owner never does: it need not pay torch's import)
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self._quiet_sigterm()

    def _quiet_sigterm(self) -> None:
        """Make SIGTERM (how a shutdown's kill reaches a worker) end this process at once and quietly, after
        :meth:`_before_exit`. Ray's own handler raises ``SystemExit`` wherever the process is, and one landing in
        a finalizer (``Popen.__del__`` of an engine's owner) printed a traceback into the run's failure report.
        Only from the main thread (Ray runs a plain actor's tasks there); elsewhere nothing changes."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def ended(signum, frame) -> None:
            try:
                self._before_exit()
            finally:
                os._exit(128 + signum)

        signal.signal(signal.SIGTERM, ended)

    def _before_exit(self) -> None:
        """What this worker must end before its process does (a SIGTERM: :meth:`_quiet_sigterm`); nothing here."""

    def init_parallel(self, dims, backend: str | None = None, *, seed: int | None = 1234,
                      timeout_s: float = 600.0) -> Coordinates:
        """Initialise torch.distributed and Megatron's groups for ``dims``; return this rank's coordinates."""
        from megarl.parallel import init_parallel

        self.groups = init_parallel(dims, backend, seed=seed, timeout_s=timeout_s)
        return self.coordinates()

    def coordinates(self) -> Coordinates:
        """This rank's place: from its process groups after :meth:`init_parallel`, else pure data parallel."""
        if self.groups is None:
            return Coordinates.data_parallel(self.rank, self.world_size)
        return self.groups.as_coordinates()

    def take_busy(self) -> float:
        """Seconds spent in :func:`busy` methods since the last call (the controller's overhead metric)."""
        seconds, self._busy_s = getattr(self, "_busy_s", 0.0), 0.0
        return seconds

    def ping(self) -> int:
        """This rank (a liveness check)."""
        return self.rank
