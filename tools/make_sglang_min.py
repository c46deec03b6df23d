"""Build ``sglang_min``: the few sglang 0.5.23 modules megarl's weight payloads use, copied verbatim, for a machine
that cannot install sglang (a GPU machine without network; see docs/gpu.md).

    python tools/make_sglang_min.py SOURCE OUT_DIR

``SOURCE`` is the sglang 0.5.23 wheel (``pip download --no-deps sglang==0.5.23``) or the directory holding an
installed ``sglang/`` (``python -c 'import sglang, os; print(os.path.dirname(sglang.__path__[0]))'``). ``OUT_DIR``
then holds a package ``sglang`` of about 30 KB; put ``OUT_DIR`` on ``PYTHONPATH``. It has exactly what megarl
imports on the paths of ``tools/gpu_check.py``:

- ``sglang.srt.utils``: ``MultiprocessingSerializer`` and ``SafeUnpickler`` (and the helpers they call), cut from
  ``srt/utils/common.py``, whose other imports the full module needs are left out;
- ``sglang.srt.utils.patch_torch`` (the torch-reduction patch: CUDA IPC handles naming the device by UUID),
  ``weight_versions`` and ``msgspec_utils`` (it needs msgspec and pydantic-core);
- ``sglang.srt.weight_sync.tensor_bucket`` (``FlattenedTensorBucket``).
"""

from __future__ import annotations

import ast
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

COMMON_DEFINITIONS = {"MultiprocessingSerializer", "SafeUnpickler", "_safe_load_torch_storage", "is_npu", "is_musa"}
"""What ``MultiprocessingSerializer`` needs of ``srt/utils/common.py`` (besides ``torch_release``)."""
WHOLE_MODULES = ("sglang/srt/utils/patch_torch.py", "sglang/srt/utils/weight_versions.py",
                 "sglang/srt/utils/msgspec_utils.py", "sglang/srt/weight_sync/tensor_bucket.py")
COMMON_HEADER = '''"""Verbatim excerpts of sglang 0.5.23's sglang/srt/utils/common.py (megarl's tools/make_sglang_min.py)."""
import base64 as pybase64  # the full module uses pybase64; the stdlib has the same b64encode / b64decode(validate)
import functools
from functools import lru_cache
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
from packaging import version as pkg_version
'''


def reader(source: Path) -> Callable[[str], str]:
    """A function reading ``sglang/...`` paths from a wheel or a site-packages directory."""
    if source.is_dir():
        return lambda path: (source / path).read_text()
    wheel = zipfile.ZipFile(source)
    return lambda path: wheel.read(path).decode()


def common_excerpt(text: str) -> str:
    """The definitions of :data:`COMMON_DEFINITIONS` and ``torch_release`` from ``common.py``, in source order."""
    lines = text.splitlines()
    parts, found = [], set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in COMMON_DEFINITIONS:
            start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
            parts.append("\n".join(lines[start:node.end_lineno]))
            found.add(node.name)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "torch_release" for t in node.targets):
            parts.append(ast.get_source_segment(text, node))
            found.add("torch_release")
    missing = (COMMON_DEFINITIONS | {"torch_release"}) - found
    if missing:
        raise ValueError(f"sglang/srt/utils/common.py lacks {sorted(missing)}: is it sglang 0.5.23?")
    return COMMON_HEADER + "\n\n" + "\n\n\n".join(parts) + "\n"


def build(source: Path, out: Path) -> dict[str, str]:
    """Write the package under ``out``; its files and their text."""
    read = reader(source)
    files = {
        "sglang/__init__.py": '__version__ = "0.5.23"  # sglang_min: excerpts only (tools/make_sglang_min.py)\n',
        "sglang/srt/__init__.py": "",
        "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import *  # noqa: F401,F403\n",
        "sglang/srt/utils/common.py": common_excerpt(read("sglang/srt/utils/common.py")),
        "sglang/srt/weight_sync/__init__.py": "",
        **{path: read(path) for path in WHOLE_MODULES},
    }
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    files = build(Path(args[0]), Path(args[1]))
    print(f"wrote {sum(map(len, files.values()))} bytes in {len(files)} files under {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
