"""The settings the run config declares, by full dotted key, and the nearest ones to a misspelled key.

:func:`declared_keys` walks :class:`megarl.config.schema.RunConfig`'s dataclasses; a field typed as a dict (a
scorer's settings, a function's keyword arguments) is *open*: any key below it is the user's own.
:func:`suggest` is what an unknown key's error offers: "did you mean".
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterable


@functools.cache
def declared_keys() -> tuple[frozenset[str], frozenset[str]]:
    """``(keys, open_keys)``: every full key of the run config's dataclasses, and those typed as dicts (whose own
    sub-keys are free)."""
    from megarl.config.schema import RunConfig

    keys: set[str] = set()
    open_keys: set[str] = set()
    _walk(RunConfig, "", keys, open_keys)
    return frozenset(keys), frozenset(open_keys)


def _walk(cls: type, prefix: str, keys: set[str], open_keys: set[str]) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        keys.add(key)
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            _walk(hint, f"{key}.", keys, open_keys)
        elif hint is typing.Any or typing.get_origin(hint) is dict or hint is dict:
            open_keys.add(key)


def is_declared(key: str) -> bool:
    """``key`` is a setting of the run config, or lies below an open (dict-typed) one."""
    keys, open_keys = declared_keys()
    if key in keys:
        return True
    parts = key.split(".")
    return any(".".join(parts[:i]) in open_keys for i in range(1, len(parts)))


def suggest(key: str, candidates: Iterable[str] | None = None, *, limit: int = 3) -> list[str]:
    """The declared keys nearest to ``key``: those with the same last name first (``...megatron.sequence_parallel``
    → ``...parallel.sequence_parallel``), then the closest by spelling."""
    pool = sorted(declared_keys()[0] if candidates is None else set(candidates))
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = [c for c in pool if c.rsplit(".", 1)[-1] == leaf]
    by_leaf.sort(key=lambda c: -difflib.SequenceMatcher(None, key, c).ratio())
    close = difflib.get_close_matches(key, pool, n=limit, cutoff=0.6)
    ranked = list(dict.fromkeys(by_leaf + close))
    return ranked[:limit]


def did_you_mean(key: str, candidates: Iterable[str] | None = None) -> str:
    """``" (did you mean a.b or a.c?)"`` (empty when nothing is near)."""
    near = suggest(key, candidates)
    return f" (did you mean {' or '.join(near)}?)" if near else ""
