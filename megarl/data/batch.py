"""The batch container that flows between the controller, the workers and the algorithms.

A :class:`Batch` holds three things:

- ``tensors``: ``torch.Tensor`` fields that all share their first dimension (the rows: one
  row per prompt before rollout, one per trajectory after it);
- ``non_tensors``: per-row numpy arrays (object dtype for strings, dicts, lists), with the
  same first dimension (``uid``, ``data_source``, ``raw_prompt_ids``, ...);
- ``meta``: a plain dict of step-level values (``temperature``, ``multi_turn``, metrics).

Row operations (``select``, ``repeat``, ``chunk``, ``split``, ``reorder``, ``shard``,
padding) return new batches whose fields share storage with the original where indexing
allows it; ``pop`` is the one in-place operation. Every operation checks its inputs and
names the offending key or setting in its error. A batch is plain data (dicts of tensors
and numpy arrays), so it pickles, and therefore travels through Ray, as is.

Field names: docs/design.md, 'The batch fields'.

Shape legend: ``N`` rows of an index (``idx_N``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

Field = torch.Tensor | np.ndarray


def _as_rows(key: str, value: Any) -> Field:
    """Turn one field value into a tensor or a numpy array with a first (row) dimension."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"Batch field {key!r} is a 0-dim tensor; fields need a first (row) dimension, "
                             f"put step-level scalars in `meta` instead")
        return value
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"Batch field {key!r} is a 0-dim array; fields need a first (row) dimension, "
                             f"put step-level scalars in `meta` instead")
        return value
    if isinstance(value, (list, tuple)):
        # One object per row, whatever each object is (str, dict, list of token ids, ...).
        array = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            array[i] = item
        return array
    raise TypeError(f"Batch field {key!r} has type {type(value).__name__}; use a torch.Tensor, "
                    f"a numpy array or a list with one entry per row")


def _same_value(a: Any, b: Any) -> bool:
    """Whether two field or meta values are equal (tensors and arrays compared element-wise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu())))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


def _index_field(value: Field, idx: torch.Tensor) -> Field:
    """Rows ``idx`` (a 1-D long tensor on the CPU) of one field."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, idx.to(value.device))
    return value[idx.numpy()]


@dataclasses.dataclass(eq=False)
class Batch:
    """Tensors and per-row arrays sharing a first dimension, plus step-level meta.

    Build one with ``Batch(tensors={...}, non_tensors={...}, meta={...})`` or, sorting the
    values by type, with :meth:`from_dict`. Read a field with ``batch["key"]`` and set one
    with ``batch["key"] = value`` (tensors go to ``tensors``, arrays and lists to
    ``non_tensors``); both check the key and the row count.
    """

    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Tensor fields; dim 0 is the row."""
    non_tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """Per-row numpy arrays (object dtype for Python objects); dim 0 is the row."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Step-level values that are not per row."""

    def __post_init__(self) -> None:
        self.tensors = dict(self.tensors)
        self.non_tensors = {key: _as_rows(key, value) for key, value in self.non_tensors.items()}
        self.meta = dict(self.meta)
        for key, value in self.tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"Batch.tensors[{key!r}] has type {type(value).__name__}; put non-tensor "
                                f"per-row values in `non_tensors` (or build the batch with Batch.from_dict)")
            _as_rows(key, value)
        for key, value in self.non_tensors.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(f"Batch.non_tensors[{key!r}] is a torch.Tensor; put it in `tensors`")
        both = self.tensors.keys() & self.non_tensors.keys()
        if both:
            raise ValueError(f"Batch keys {sorted(both)} are both tensor and non-tensor fields; rename one")
        self._check_lengths()

    # ----------------------------------------------------------------------------- build

    @classmethod
    def from_dict(cls, fields: dict[str, Any], meta: dict[str, Any] | None = None) -> Batch:
        """Sort ``fields`` into tensors (``torch.Tensor`` values) and non-tensors (the rest)."""
        tensors = {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in fields.items() if not isinstance(v, torch.Tensor)}
        return cls(tensors=tensors, non_tensors=non_tensors, meta=dict(meta or {}))

    def _fields(self) -> dict[str, Field]:
        return {**self.tensors, **self.non_tensors}

    def _check_lengths(self) -> None:
        fields = self._fields()
        if not fields:
            return
        first_key = next(iter(fields))
        num_rows = len(fields[first_key])
        for key, value in fields.items():
            if len(value) != num_rows:
                raise ValueError(f"Batch field {key!r} has {len(value)} rows but {first_key!r} has {num_rows}; "
                                 f"every tensor and non-tensor field must share the first dimension")

    def _with_fields(self, fields: dict[str, Field], meta: dict[str, Any] | None = None) -> Batch:
        """A batch with ``fields`` (sorted by type) and a shallow copy of this meta."""
        return Batch(tensors={k: v for k, v in fields.items() if isinstance(v, torch.Tensor)},
                     non_tensors={k: v for k, v in fields.items() if not isinstance(v, torch.Tensor)},
                     meta=dict(self.meta if meta is None else meta))

    # ----------------------------------------------------------------------------- access

    def __len__(self) -> int:
        """Number of rows; 0 for a batch without fields."""
        for value in self._fields().values():
            return len(value)
        return 0

    def keys(self) -> list[str]:
        """Names of all tensor and non-tensor fields."""
        return list(self.tensors) + list(self.non_tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def _missing(self, key: str, action: str) -> KeyError:
        return KeyError(f"Batch has no field {key!r} to {action}; it has tensors {sorted(self.tensors)} and "
                        f"non-tensors {sorted(self.non_tensors)}. Produce {key!r} in an earlier stage first")

    def __getitem__(self, key: str) -> Field:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise self._missing(key, "read")

    def __setitem__(self, key: str, value: Any) -> None:
        value = _as_rows(key, value)
        others = [v for k, v in self._fields().items() if k != key]
        if others and len(value) != len(others[0]):
            raise ValueError(f"cannot set Batch field {key!r} with {len(value)} rows on a batch of "
                             f"{len(others[0])} rows")
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        non_tensors = ", ".join(f"{k}: {v.shape} {v.dtype}" for k, v in self.non_tensors.items())
        return (f"Batch(rows={len(self)}, tensors={{{tensors}}}, non_tensors={{{non_tensors}}}, "
                f"meta_keys={sorted(self.meta)})")

    # ----------------------------------------------------------------------------- keys

    def select(self, *keys: str, meta_keys: Iterable[str] | None = None) -> Batch:
        """A batch with only the fields ``keys`` (tensor or non-tensor; all rows).

        Meta is copied whole, or only ``meta_keys`` when given. A missing key raises ``KeyError``.
        """
        fields = {}
        for key in keys:
            if key not in self:
                raise self._missing(key, "select")
            fields[key] = self[key]
        meta = self.meta
        if meta_keys is not None:
            missing = [k for k in meta_keys if k not in self.meta]
            if missing:
                raise KeyError(f"Batch meta has no keys {missing} to select; it has {sorted(self.meta)}")
            meta = {k: self.meta[k] for k in meta_keys}
        return self._with_fields(fields, meta)

    def pop(self, *keys: str) -> Batch:
        """Remove the fields ``keys`` from this batch (in place) and return them as a new batch.

        The returned batch gets a shallow copy of the meta. All keys are checked before anything
        is removed, so a missing key leaves this batch unchanged.
        """
        for key in keys:
            if key not in self:
                raise self._missing(key, "pop")
        popped = self.select(*keys)
        for key in keys:
            self.tensors.pop(key, None)
            self.non_tensors.pop(key, None)
        return popped

    def rename(self, old: str, new: str) -> Batch:
        """A batch whose field ``old`` is called ``new``; refuses to overwrite an existing ``new``."""
        if old not in self:
            raise self._missing(old, "rename")
        if new in self and new != old:
            raise ValueError(f"cannot rename Batch field {old!r} to {new!r}: {new!r} exists; pop it first")
        fields = {(new if k == old else k): v for k, v in self._fields().items()}
        return self._with_fields(fields)

    def union(self, other: Batch) -> Batch:
        """A batch with the fields and meta of both; ``self`` and ``other`` are not modified.

        Both must have the same number of rows (a batch without fields matches any). A key
        present in both is kept only if both values are equal; otherwise ``ValueError``.
        Meta is merged by the same rule.
        """
        if self._fields() and other._fields() and len(self) != len(other):
            raise ValueError(f"cannot union Batches of {len(self)} and {len(other)} rows; "
                             f"repeat or select rows so that both sides match")
        fields = self._fields()
        for key, value in other._fields().items():
            if key in fields and not _same_value(fields[key], value):
                raise ValueError(f"cannot union Batches: field {key!r} is in both with different values; "
                                 f"pop or rename it on one side first")
            fields[key] = value
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and not _same_value(meta[key], value):
                raise ValueError(f"cannot union Batches: meta[{key!r}] is {meta[key]!r} on one side and "
                                 f"{value!r} on the other; set it to one value first")
            meta[key] = value
        return self._with_fields(fields, meta)

    # ----------------------------------------------------------------------------- rows

    def reorder(self, idx: torch.Tensor | np.ndarray | Sequence[int]) -> Batch:
        """A batch made of rows ``idx`` in that order (a permutation, a subset or with repeats)."""
        idx_N = (idx if isinstance(idx, torch.Tensor) else torch.as_tensor(np.asarray(idx))).cpu()
        if idx_N.dim() != 1 or (idx_N.numel() and (idx_N.is_floating_point() or idx_N.dtype == torch.bool)):
            raise ValueError(f"Batch.reorder needs a 1-D integer index, got shape {tuple(idx_N.shape)} "
                             f"dtype {idx_N.dtype}")
        idx_N = idx_N.long()
        if idx_N.numel() and (int(idx_N.min()) < -len(self) or int(idx_N.max()) >= len(self)):
            raise ValueError(f"Batch.reorder index out of range for a batch of {len(self)} rows "
                             f"(min {int(idx_N.min())}, max {int(idx_N.max())})")
        idx_N = torch.remainder(idx_N, max(len(self), 1))
        return self._with_fields({k: _index_field(v, idx_N) for k, v in self._fields().items()})

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``[a, a, b, b]`` when interleaved (the default), else ``[a, b, a, b]``.

        Interleaving keeps the ``n`` samples of one prompt adjacent, which is what grouping by
        ``uid`` and splitting into mini-batches of whole groups expect.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"Batch.repeat needs n >= 1 (e.g. rollout.n), got {n!r}")
        rows = torch.arange(len(self))
        idx_N = rows.repeat_interleave(n) if interleave else rows.repeat(n)
        return self.reorder(idx_N)

    def split(self, size: int | Sequence[int]) -> list[Batch]:
        """Consecutive pieces of ``size`` rows (the last may be shorter), or of the given sizes.

        Pieces are views of this batch's tensors. ``size`` as a list must sum to ``len(self)``.
        """
        if isinstance(size, int):
            if size < 1:
                raise ValueError(f"Batch.split needs a piece size >= 1 (e.g. ppo_micro_batch_size_per_gpu), "
                                 f"got {size}")
            sizes = [size] * (len(self) // size) + ([len(self) % size] if len(self) % size else [])
        else:
            sizes = [int(s) for s in size]
            if any(s < 0 for s in sizes) or sum(sizes) != len(self):
                raise ValueError(f"Batch.split sizes {sizes} must be >= 0 and sum to the {len(self)} rows")
        pieces, start = [], 0
        for piece in sizes:
            fields = {k: v[start:start + piece] for k, v in self._fields().items()}
            pieces.append(self._with_fields(fields))
            start += piece
        return pieces

    def chunk(self, k: int) -> list[Batch]:
        """``k`` consecutive pieces of equal size; ``len(self)`` must be divisible by ``k``."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"Batch.chunk needs k >= 1, got {k!r}")
        if len(self) % k:
            raise ValueError(f"Batch.chunk: {len(self)} rows do not divide into {k} equal chunks; "
                             f"call pad_to_divisor({k}) first and unpad the results")
        return self.split([len(self) // k] * k)

    def shard(self, dp_rank: int, dp_size: int) -> Batch:
        """The contiguous share of data-parallel rank ``dp_rank`` out of ``dp_size`` equal shares."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"Batch.shard needs 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if len(self) % dp_size:
            raise ValueError(f"Batch.shard: {len(self)} rows do not divide over dp_size={dp_size} ranks; "
                             f"call pad_to_divisor({dp_size}) first")
        per_rank = len(self) // dp_size
        fields = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in self._fields().items()}
        return self._with_fields(fields)

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order; all must have the same fields. Meta of the first is kept."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            if set(batch.tensors) != set(first.tensors) or set(batch.non_tensors) != set(first.non_tensors):
                diff = sorted(set(first.keys()) ^ set(batch.keys()))
                raise ValueError(f"Batch.concat: batch {i} and batch 0 differ in fields {diff}; "
                                 f"select the same keys on every batch")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return cls(tensors=tensors, non_tensors=non_tensors, meta=dict(first.meta))

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append copies of the first rows until the row count divides ``divisor``.

        Returns the padded batch and the number of rows added, to pass to :meth:`unpad` on
        the results. Padding rows are real rows (cycled from the start), so they are valid inputs
        for every computation; drop them before anything is aggregated.
        """
        if not isinstance(divisor, int) or divisor < 1:
            raise ValueError(f"Batch.pad_to_divisor needs a divisor >= 1 (e.g. the DP size), got {divisor!r}")
        num_pad = (-len(self)) % divisor
        if num_pad == 0:
            return self._with_fields(self._fields()), 0
        idx_N = torch.cat([torch.arange(len(self)), torch.arange(num_pad) % len(self)])
        return self.reorder(idx_N), num_pad

    def unpad(self, num_pad: int) -> Batch:
        """Drop the last ``num_pad`` rows added by :meth:`pad_to_divisor`."""
        if not 0 <= num_pad <= len(self):
            raise ValueError(f"Batch.unpad: num_pad={num_pad} must be between 0 and the {len(self)} rows")
        return self.split([len(self) - num_pad, num_pad])[0]

    def to(self, device: torch.device | str) -> Batch:
        """A batch with every tensor moved to ``device`` (non-tensors and meta shared)."""
        return self._with_fields({**{k: v.to(device) for k, v in self.tensors.items()}, **self.non_tensors})
