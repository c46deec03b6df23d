"""Run a function on N local gloo ranks, time-bounded, and bring back results or the failure.

Used by the converter jobs that spawn their own ranks on CPU (``megarl-convert``), the
multi-process tests and the benchmarks in ``tools/``. Each rank is a new process with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, one torch thread, and the
function's return value shipped back by value.

Ranks are forked by a ``forkserver`` that has imported what every rank imports (:data:`PRELOAD`:
torch, Megatron-Core, transformers; about 10 s of CPU per process): one server per calling
process, started at its first job with the ranks' environment (:data:`RANK_ENV`; OpenMP reads
``OMP_NUM_THREADS`` at load) and ended with that process. A job's ranks, and every later job's,
start with those imports done instead of paying them each. The server imports nothing else: no
CUDA context, no process group, no thread; a rank is as new as a ``spawn``-ed one in all but its
import time. The server takes requests on a Unix socket in a private (0700) temporary directory, as Python's
forkserver does: nothing listens on the network. Keep this module (and ``megarl/parallel/__init__.py``) free of
heavy imports: the calling process (``megarl-convert`` at start-up) need not pay them.

Failure policy: the first rank that raises (or dies, or exits without reporting) ends the
job; the others are killed (they would otherwise wait forever in a collective) and
:class:`RankFailure` carries the failing rank's traceback. On timeout every unfinished rank's
Python stack is dumped (faulthandler) into the error before the ranks are killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from megarl.parallel.net import free_port


class RankFailure(RuntimeError):
    """A spawned rank raised, died, or the job ran past its time limit."""


PRELOAD = ("megarl", "torch", "torch.distributed", "torch._dynamo", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "transformers", "transformers.models.auto.configuration_auto")
"""Modules the forkserver imports once for every rank (``megarl`` first: it makes Megatron's fusions eager before
``megatron.core`` is imported; ``torch._dynamo``: torch's optimizers import it at their first step)."""

RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "MEGARL_WORKER_PROCESS": "1",  # no wandb in ranks (megarl/__init__.py)
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""Every rank's environment (the forkserver's too: it imports torch and megarl with it). ``torch.cuda.is_available()``
asks NVML, not the CUDA driver: the forkserver must never initialise CUDA, or ranks forked from it that use a GPU
(``tools/bench_convert.py --device cuda``) could not."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *PRELOAD])  # '__main__': functions of a script's main module
    return ctx


def _rank_main(fn, args, kwargs, rank, world_size, port, results, stack_file, env):
    # Own process group: the parent kills the rank and anything it started in one go.
    os.setpgrp()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            if "torch" in sys.modules:  # imported while unpickling fn's module
                sys.modules["torch"].set_num_threads(1)
            value = fn(*args, **kwargs)
            payload = ("ok", pickle.dumps(value))
        except BaseException:  # noqa: BLE001 - every failure, SystemExit included, is reported
            payload = ("error", traceback.format_exc())
        finally:
            _destroy_process_group()
        results.put((rank, *payload))


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return each rank's result.

    ``fn`` must be importable by module path (a module-level function). ``env``: set in each rank before ``fn``
    runs (after the forkserver's imports: a variable read at import time takes effect only in the job that starts
    the server). Raises :class:`RankFailure` with the failing rank's traceback if any rank fails, dies or the job
    exceeds ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    rank_env = {**RANK_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="megarl-ranks-") as tmp:
        stack_files = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, args, kwargs, r, world_size, port, results, stack_files[r], rank_env),
                name=f"megarl-rank{r}",
                # Not daemonic: ranks may start helper processes (Megatron's checkpoint writer
                # does). The finally-block below kills whatever is left.
                daemon=False,
            )
            for r in range(world_size)
        ]
        # The forkserver (started by the first job) inherits the environment: thread limits must be in place
        # before it imports torch (OpenMP reads OMP_NUM_THREADS once, at load).
        with _environment(rank_env):
            for p in procs:
                p.start()
        try:
            return _collect(procs, results, timeout_s, stack_files, fn)
        finally:
            for p in procs:
                _kill_group(p)
            for p in procs:
                p.join(timeout=10)


def _kill_group(proc) -> None:
    """Kill a rank and every process it started (they share the rank's process group)."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _next_report(results, wait_s: float):
    try:
        return results.get(timeout=wait_s)
    except queue.Empty:
        return None


def _collect(procs, results, timeout_s, stack_files, fn) -> list[Any]:
    world_size = len(procs)
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    name = getattr(fn, "__qualname__", repr(fn))
    while len(outcome) < world_size:
        report = _next_report(results, 0.2)
        if report is None:
            exited = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
            if exited:
                # A rank that just exited may still be flushing its report.
                report = _next_report(results, 2.0)
                if report is None:
                    code = procs[exited[0]].exitcode
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    raise RankFailure(
                        f"rank {exited[0]} of {world_size} running {name} died ({how}) without reporting"
                    )
            elif time.monotonic() > deadline:
                raise RankFailure(_timeout_message(procs, outcome, stack_files, timeout_s, name))
            else:
                continue
        rank, status, payload = report
        if status == "error":
            raise RankFailure(_failure_message({rank: payload}, procs, outcome, results, name))
        outcome[rank] = pickle.loads(payload)
    return [outcome[r] for r in range(world_size)]


# Errors a rank raises because a peer died, not because of its own input.
_PEER_SYMPTOMS = ("gloo", "c10d", "Connection closed by peer", "Connection reset", "NCCL", "Broken pipe")


def _failure_message(errors: dict[int, str], procs, outcome, results, name) -> str:
    """All failing ranks' tracebacks, the likely root cause (not a peer-death symptom) first.

    When one rank raises, its peers usually fail moments later inside a collective; those
    reports arrive in any order, so collect them for a short while before choosing.
    """
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        pending = [r for r in range(len(procs)) if r not in errors and r not in outcome]
        if not pending or all(procs[r].exitcode is not None for r in pending) and results.empty():
            break
        report = _next_report(results, 0.1)
        if report is not None and report[1] == "error":
            errors[report[0]] = report[2]
    ranks = sorted(errors, key=lambda r: (any(s in errors[r] for s in _PEER_SYMPTOMS), r))
    head = f"rank {ranks[0]} of {len(procs)} running {name} failed:\n{errors[ranks[0]]}"
    others = "".join(f"\n--- rank {r} also failed ---\n{errors[r]}" for r in ranks[1:])
    return head + others


def _timeout_message(procs, outcome, stack_files, timeout_s, name) -> str:
    pending = [r for r in range(len(procs)) if r not in outcome]
    for r in pending:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    lines = [f"{name} on {len(procs)} ranks ran past {timeout_s:.0f} s; ranks {pending} did not finish."]
    for r in pending:
        with open(stack_files[r]) as f:
            stack = f.read().strip()
        lines.append(f"--- rank {r} stack ---\n{stack or '(no stack dumped)'}")
    return "\n".join(lines)
