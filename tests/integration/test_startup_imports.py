"""What a process imports before it works: the costly imports only where they are used.

Each check runs in a new interpreter (this one has imported everything)."""

from __future__ import annotations

import json
import subprocess
import sys

REPO_ENV = {"OMP_NUM_THREADS": "1", "MEGARL_WORKER_PROCESS": "1", "PYTHONWARNINGS": "ignore"}


def _run(code: str) -> dict:
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         env={**os.environ, **REPO_ENV})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_engine_servers_owner_imports_no_torch():
    """The Ray actor that owns an engine server (one per engine) starts a process and waits on it: it imports the
    engine's and the model's settings, not torch (``megarl.config``, ``megarl.engines`` and ``megarl.rollout`` load names on first use;
    their ``actor`` / ``algorithm`` and agent-loop modules import torch)."""
    seen = _run("import json, sys\n"
                "from megarl.workers.engine_server import EngineServerWorker\n"
                "worker = EngineServerWorker()\n"
                "worker.node_info()\n"
                "worker.setup_env(rank=0, world_size=1, local_rank=0, master_addr='127.0.0.1', master_port=1)\n"
                "from megarl.config.rollout import EngineConfig\n"
                "from megarl.config.model import ModelSource\n"
                "print(json.dumps({m: m in sys.modules for m in ('torch', 'transformers', 'omegaconf')}))")
    assert seen == {"torch": False, "transformers": False, "omegaconf": True}


def test_the_packages_names_still_load_on_first_use():
    seen = _run("import json, sys, megarl.config as c, megarl.engines as e, megarl.rollout as r\n"
                "before = 'megarl.config.actor' in sys.modules\n"
                "names = [getattr(c, n).__module__ for n in ('ActorConfig', 'RunConfig', 'load_config')]\n"
                "names += [getattr(e, 'EngineClient').__module__]\n"
                "names += [getattr(r, n).__module__ for n in ('AgentLoop', 'RolloutManager')]\n"
                "every = all(sorted(m.__all__) == sorted(m.__getattr__.names) for m in (c, e, r))\n"
                "print(json.dumps({'before': before, 'names': names, 'all': every}))")
    assert seen == {"before": False, "all": True, "names": [
        "megarl.config.actor", "megarl.config.schema", "megarl.config.loading", "megarl.engines.client",
        "megarl.rollout.agent_loop", "megarl.rollout.manager"]}


def test_megatron_imports_without_torchs_compiler_and_compiles_nothing():
    """``megarl`` makes Megatron's ``jit_fuser`` a no-op as ``megatron.core.jit`` is imported (``megatron_patches``
    point 13), so the modules after it decorate nothing with ``torch.compile`` and torch's compiler stack (dynamo, inductor:
    about 4 s of CPU per process) is not imported with Megatron."""
    seen = _run("import json, sys\n"
                "import megarl, megatron.core\n"
                "from megatron.core import jit\n"
                "from megatron.core.fusions import fused_bias_swiglu\n"
                "from megarl.parallel import megatron_patches\n"
                "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'inductor': 'torch._inductor' in sys.modules,"
                " 'fuser': jit.jit_fuser.__name__, 'compiled': megatron_patches.compiled_megatron_functions()}))")
    assert seen == {"dynamo": False, "inductor": False, "fuser": "noop_decorator", "compiled": []}


def test_no_name_a_package_loads_on_first_use_is_one_of_its_submodules():
    """Importing a submodule sets the package's attribute of that name to the module, so a function of the same name
    loaded on first use (``megarl.config.validate`` was one) would become the module once anything imported it."""
    import importlib
    from pathlib import Path

    for package in ("megarl.config", "megarl.engines", "megarl.rollout", "megarl.parallel", "megarl.controller"):
        module = importlib.import_module(package)
        submodules = {p.stem for p in Path(module.__file__).parent.iterdir() if p.suffix == ".py" or p.is_dir()}
        assert not set(module.__all__) & submodules, package
