"""Benchmark: what a process pays before it works (CPU runs and the test suite are mostly process start-up).

Three rows, each against what megarl did before, in one run on this machine:

- **rank jobs**: a 2-rank :func:`megarl.parallel.launch.run_ranks` job whose ranks import what a Megatron rank imports
  (:data:`~megarl.parallel.launch.PRELOAD`), timed ``--repeats`` times once the forkserver is up, against 2 new
  interpreters importing the same modules side by side (what ``spawn``-ed ranks paid per job).
- **Megatron's import**: CPU seconds of ``import megarl, megatron.core`` (Megatron's fusions eager from its import on)
  against ``import torch, megatron.core`` (each fusion decorated with ``torch.compile``, the compiler imported).
- **an engine server's owner**: CPU seconds of importing the Ray actor's module and the settings it receives
  (``megarl.workers.engine_server``) against the same with torch imported, as it was.

    python tools/bench_startup.py

The last line is ``RESULT rank_job_speedup=<x> rank_job_s=<x> spawned_job_s=<x> megatron_import_speedup=<x>
megatron_import_cpu_s=<x> compiled_import_cpu_s=<x> engine_owner_speedup=<x> engine_owner_cpu_s=<x>
with_torch_cpu_s=<x>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_convert holds shared helpers

import bench_convert as common

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MEGARL_WORKER_PROCESS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def rank_job() -> int:
    """What a rank does before its work: nothing but the imports (done by the forkserver)."""
    import megatron.core  # noqa: F401
    import transformers.models.auto.configuration_auto  # noqa: F401

    return os.getpid()


def _cpu_of(code: str) -> float:
    """CPU seconds (user + system) of a new interpreter running ``code``."""
    before = os.times()
    subprocess.run([sys.executable, "-c", code], env=ENV, check=True, capture_output=True)
    after = os.times()
    return after.children_user - before.children_user + after.children_system - before.children_system


def _median_cpu(code: str, repeats: int) -> float:
    return statistics.median(_cpu_of(code) for _ in range(repeats))


def _spawned_job(world: int, modules: tuple[str, ...]) -> float:
    """Wall seconds of ``world`` new interpreters importing ``modules`` side by side."""
    code = "; ".join(f"import {m}" for m in modules)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=ENV) for _ in range(world)]
    if any(p.wait() for p in procs):
        raise RuntimeError(f"importing {modules} failed")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    from megarl.parallel.launch import PRELOAD, run_ranks

    run_ranks(rank_job, args.world, timeout_s=600)  # starts the forkserver (its imports are paid once)
    timed = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        pids = run_ranks(rank_job, args.world, timeout_s=600)
        timed.append(time.perf_counter() - start)
        assert len(set(pids)) == args.world
    rank_s = statistics.median(timed)
    spawned_s = statistics.median(_spawned_job(args.world, PRELOAD) for _ in range(args.repeats))
    eager = _median_cpu("import megarl, megatron.core", args.repeats)
    compiled = _median_cpu("import torch, megatron.core", args.repeats)
    owner = "import megarl.workers.engine_server, megarl.config.rollout, megarl.config.model"
    light = _median_cpu(owner, args.repeats)
    heavy = _median_cpu(owner + ", torch", args.repeats)
    values = {"rank_job_speedup": spawned_s / rank_s, "rank_job_s": rank_s, "spawned_job_s": spawned_s,
              "megatron_import_speedup": compiled / eager, "megatron_import_cpu_s": eager,
              "compiled_import_cpu_s": compiled, "engine_owner_speedup": heavy / light, "engine_owner_cpu_s": light,
              "with_torch_cpu_s": heavy}
    print(f"{args.world}-rank job, imports done by the forkserver: {rank_s:.2f} s; {args.world} new interpreters "
          f"importing the same: {spawned_s:.2f} s")
    print(f"import megatron.core: {eager:.2f} s CPU with its fusions eager, {compiled:.2f} s compiled")
    print(f"an engine server's owner: {light:.2f} s CPU, {heavy:.2f} s with torch")
    print(common.result_line(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
