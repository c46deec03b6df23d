"""Checks every config section uses, and defaults read from the component that owns them.

Where a lower component already defines a setting's default (the data set's or the loss
functions' keyword arguments), a section's field takes it with :func:`default_of` instead of
repeating it, so a default lives in one place.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
"""Compute dtypes by name (``torch.<name>``)."""


def default_of(owner: Any, name: str) -> Any:
    """The default of ``name`` in ``owner``: a dataclass field, or a function/constructor keyword argument."""
    if dataclasses.is_dataclass(owner):
        field = {f.name: f for f in dataclasses.fields(owner)}[name]
        if field.default is not dataclasses.MISSING:
            return field.default
        return field.default_factory()
    return inspect.signature(owner).parameters[name].default


def check_choice(key: str, value: Any, choices: tuple) -> None:
    """Refuse ``value`` unless it is one of ``choices``; the error lists them."""
    if value not in choices:
        raise ValueError(f"{key}={value!r} is unknown; use one of {list(choices)}")


def check_positive(key: str, value: int | float | None, *, allow_none: bool = False) -> None:
    """Refuse a value that is not > 0 (None only with ``allow_none``)."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


def check_sampling(prefix: str, temperature: float, top_p: float, top_k: int) -> None:
    """Refuse sampling settings no engine accepts (``temperature`` 0 means greedy, ``top_k`` -1 off)."""
    if temperature < 0:
        raise ValueError(f"{prefix}.temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{prefix}.top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"{prefix}.top_k must be -1 (off) or >= 1, got {top_k}")


def check_micro_batches(prefix: str, micro_batch_size: int | None, use_dynamic_bsz: bool, max_token_len: int) -> None:
    """A micro-batch is a row count, or a token budget with ``use_dynamic_bsz``: the one in use must be > 0."""
    if use_dynamic_bsz:
        check_positive(f"{prefix}_max_token_len_per_gpu", max_token_len)
    elif micro_batch_size is None or micro_batch_size < 1:
        raise ValueError(f"{prefix}_micro_batch_size_per_gpu={micro_batch_size!r}: set it to a positive number of "
                         f"rows, or turn on the token budget with the matching use_dynamic_bsz=True")
