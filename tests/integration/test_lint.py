"""The code is kept to the rules of pyproject.toml's ``[tool.ruff.lint]`` (ruff's classic default and import
sorting): ``ruff check`` over the package, the tests and the tools finds nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]'"
    run = subprocess.run([ruff, "check", "--no-cache", "megarl", "tests", "tools"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
