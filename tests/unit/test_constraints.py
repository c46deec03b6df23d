"""`.ci/constraints.txt` pins every package CI installs, each inside the range `pyproject.toml` allows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, Version]:
    found = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        assert version, f".ci/constraints.txt: {line!r} is not 'name==version'"
        found[canonicalize_name(name)] = Version(version)
    return found


def requirements() -> list[Requirement]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    # The packages .ci/run installs besides the project (with --no-deps), as it names them.
    ci = (ROOT / ".ci" / "run").read_text()
    listed += re.findall(r"--no-deps ((?:[\w.-]+==[\w.]+ ?)+)", ci)[0].split()
    listed += re.findall(r"(torch==[\w.]+)", ci)[:1]
    return [Requirement(text) for text in listed]


def test_every_requirement_ci_installs_is_pinned_inside_its_range():
    pinned = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement} is not pinned in .ci/constraints.txt (DEVELOPERS.md says how to move pins)"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f".ci/constraints.txt pins {name}=={pinned[name]}, outside pyproject.toml's {requirement}")


def test_ci_and_the_readme_install_from_the_constraints():
    command = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert command.count("-c .ci/constraints.txt") == 2 and command in (ROOT / "README.md").read_text()
