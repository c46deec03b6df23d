"""The rollout buffer of asynchronous training: whole GRPO groups in prompt order, admitted within a staleness bound.

A *group* is the ``n`` samples of one prompt. Group ``g`` is the ``g``-th prompt of the run's prompt sequence (the
loader's order, epochs end to end), so a step's prompts are known in advance and a resumed run can issue the same
groups again. The producer asks :meth:`RolloutBuffer.capacity` how many groups it may issue, reports them with
:meth:`~RolloutBuffer.issued` and :meth:`~RolloutBuffer.completed`; the trainer takes each step's batch with
:meth:`~RolloutBuffer.take`. Not thread-safe: the caller holds a lock.

Versions count actor updates: the engines hold version ``v`` after the trainer's ``v``-th sync, and step ``k``
trains with version ``k - 1``. A sample's *staleness* at step ``k`` is ``(k - 1) -`` the oldest version among its
tokens (a request continued across an update has tokens of several versions).

- **Admission** (AReaL's rule, in groups): while the engines hold version ``v``, a group may be issued only if
  fewer than ``(v + s + 1) · B`` groups are kept or pending before it (``s`` the staleness bound, ``B`` the groups
  of a step). A kept group of rank ``m`` is trained at step ``⌊m / B⌋ + 1 ≤ v + s + 1``, and its tokens are of
  versions ``≥ v``: its staleness is at most ``s``. Filtered and dropped groups free their place.
- **In order**: step ``k`` takes the next ``B`` kept groups from the head of the sequence, whole; it waits while
  the head is still generating. Without filtering, step ``k`` trains exactly groups ``[(k-1)B, kB)``, as a
  synchronous run does, which is what makes a resumed run's prompts equal an uninterrupted one's.
- **Past the bound** (a resume with a smaller bound): the head group is dropped (counted) or regenerated (issued
  again, a new attempt), per ``stale_policy``.
- **Dynamic sampling** (DAPO): a completed group whose ``filter_metric`` is the same for all its samples is
  filtered (counted) and frees its place; ``max_filtered_batches`` bounds how many groups a step may pass over
  (in batches of ``B``; 0: no bound).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from megarl.algo.dapo import keep_groups_mask, sequence_metric
from megarl.config.async_training import STALE_POLICIES
from megarl.data.batch import Batch


class GroupStatus(str, enum.Enum):
    ISSUED = "issued"
    DONE = "done"
    FILTERED = "filtered"
    DROPPED = "dropped"
    CONSUMED = "consumed"


REJECTED = (GroupStatus.FILTERED, GroupStatus.DROPPED)


@dataclasses.dataclass
class GroupRecord:
    """One group: its place in the prompt sequence, attempt (regenerations), status, and once done its batch and the
    oldest and newest weight versions among its tokens (None when the engines reported none)."""

    index: int
    attempt: int = 0
    status: GroupStatus = GroupStatus.ISSUED
    batch: Batch | None = None
    min_version: int | None = None
    max_version: int | None = None


class RolloutBuffer:
    """See the module docstring. ``groups_per_step``: ``B`` (``data.train_batch_size``); ``max_staleness``: ``s``."""

    def __init__(self, *, groups_per_step: int, max_staleness: int, stale_policy: str = "drop",
                 filter_metric: str | None = None, max_filtered_batches: int = 0) -> None:
        if groups_per_step < 1:
            raise ValueError(f"RolloutBuffer: groups_per_step must be >= 1, got {groups_per_step}")
        if max_staleness < 0:
            raise ValueError(f"async_training.max_staleness must be >= 0, got {max_staleness}")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"async_training.stale_policy={stale_policy!r}: choose one of {', '.join(STALE_POLICIES)}")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.filter_metric = filter_metric
        self.max_filtered_batches = max_filtered_batches
        self.records: dict[int, GroupRecord] = {}
        """Groups from the head (the first not consumed, filtered or dropped) to the last issued."""
        self.head = 0
        self.next_index = 0
        """The next group of the sequence never issued."""
        self.kept_or_pending = 0
        """Groups before ``next_index`` neither filtered nor dropped (consumed ones included)."""
        self.counts = {"filtered": 0, "dropped": 0, "regenerated": 0}

    # --------------------------------------------------------------------------- producer side
    def capacity(self, engine_version: int, inflight_cap: int) -> int:
        """How many groups may be issued now: within the staleness bound and ``inflight_cap`` groups generating
        (regenerations waiting to be issued again count as generating)."""
        inflight = sum(r.status is GroupStatus.ISSUED for r in self.records.values())
        bound = (engine_version + self.max_staleness + 1) * self.groups_per_step - self.kept_or_pending
        return max(0, min(inflight_cap - inflight, bound))

    def issue_next(self) -> GroupRecord:
        """Issue the next group of the sequence (check :meth:`capacity` first)."""
        record = GroupRecord(self.next_index)
        self.records[record.index] = record
        self.next_index += 1
        self.kept_or_pending += 1
        return record

    def completed(self, index: int, attempt: int, group: Batch) -> GroupStatus:
        """Group ``index`` (attempt ``attempt``) finished generating and is scored (``group``: its ``n`` rows).
        Returns its new status; a completion of an older attempt (the group was regenerated since) is ignored."""
        record = self.records.get(index)
        if record is None or record.attempt != attempt or record.status is not GroupStatus.ISSUED:
            return record.status if record is not None else GroupStatus.CONSUMED
        record.batch = group
        if "rollout_weight_versions" in group:
            versions = group["rollout_weight_versions"]
            valid = versions[versions >= 0]
            if valid.numel():
                record.min_version, record.max_version = int(valid.min()), int(valid.max())
        record.status = GroupStatus.DONE
        if self.filter_metric is not None:
            keep, _ = keep_groups_mask(sequence_metric(group, self.filter_metric), group["uid"])
            if not bool(keep.any()):
                self._reject(record, GroupStatus.FILTERED, "filtered")
        return record.status

    # --------------------------------------------------------------------------- trainer side
    def take(self, step: int) -> tuple[list[GroupRecord], list[GroupRecord]] | None:
        """Step ``step``'s groups: the next ``B`` kept ones from the head, in order, marked consumed; and the groups
        sent back for regeneration on the way (issue them again first). None while the head group generates."""
        regenerate: list[GroupRecord] = []
        taken: list[GroupRecord] = []
        passed = 0
        index = self.head
        while len(taken) < self.groups_per_step:
            record = self.records.get(index)
            if record is None or record.status is GroupStatus.ISSUED:
                self._unconsume(taken)
                return None if not regenerate else ([], regenerate)
            if record.status is GroupStatus.DONE and self.staleness(record, step) > self.max_staleness:
                if self.stale_policy == "drop":
                    self._reject(record, GroupStatus.DROPPED, "dropped")
                else:
                    record.status, record.batch = GroupStatus.ISSUED, None
                    record.attempt += 1
                    self.counts["regenerated"] += 1
                    regenerate.append(record)
                    self._unconsume(taken)
                    return [], regenerate
            if record.status in REJECTED:
                passed += 1
                if self.max_filtered_batches and passed > self.max_filtered_batches * self.groups_per_step:
                    raise RuntimeError(f"step {step}: {passed} groups in a row were filtered or dropped, more than "
                                       f"algorithm.filter_groups.max_num_gen_batches={self.max_filtered_batches} "
                                       f"batches of {self.groups_per_step}: the rewards give no signal; raise it "
                                       f"(0: no limit) or check the reward function")
            elif record.status is GroupStatus.DONE:
                record.status = GroupStatus.CONSUMED
                taken.append(record)
            index += 1
        self._advance_head()
        return taken, regenerate

    def staleness(self, record: GroupRecord, step: int) -> int:
        """Versions between step ``step``'s policy (``step - 1``) and the group's oldest token (0 without versions)."""
        return 0 if record.min_version is None else (step - 1) - record.min_version

    @property
    def consumed_head(self) -> int:
        """The first group of the sequence not yet consumed, filtered or dropped."""
        return self.head

    # --------------------------------------------------------------------------- internals
    def _reject(self, record: GroupRecord, status: GroupStatus, counter: str) -> None:
        record.status, record.batch = status, None
        self.kept_or_pending -= 1
        self.counts[counter] += 1

    def _unconsume(self, taken: list[GroupRecord]) -> None:
        for record in taken:
            record.status = GroupStatus.DONE

    def _advance_head(self) -> None:
        while self.head in self.records and self.records[self.head].status in (GroupStatus.CONSUMED, *REJECTED):
            del self.records[self.head]
            self.head += 1

    # --------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[dict[str, Any]]]:
        """JSON meta, the done groups' tensors (``"<index>/<field>"``) and, per done group in ``meta["records"]``
        order, its non-tensors (lists) and batch meta."""
        records, tensors, non_tensors = [], {}, []
        for index in sorted(self.records):
            record = self.records[index]
            records.append({"index": index, "attempt": record.attempt, "status": record.status.value,
                            "min_version": record.min_version, "max_version": record.max_version})
            if record.status is GroupStatus.DONE:
                tensors.update({f"{index}/{k}": v for k, v in record.batch.tensors.items()})
                non_tensors.append({"non_tensors": {k: v.tolist() for k, v in record.batch.non_tensors.items()},
                                    "dtypes": {k: v.dtype.str for k, v in record.batch.non_tensors.items()
                                               if v.dtype != object},
                                    "meta": dict(record.batch.meta)})
        meta = {"groups_per_step": self.groups_per_step, "head": self.head, "next_index": self.next_index,
                "kept_or_pending": self.kept_or_pending, "counts": dict(self.counts), "records": records}
        return meta, tensors, non_tensors

    def load_state_dict(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                        non_tensors: list[dict[str, Any]]) -> list[GroupRecord]:
        """Restore :meth:`state_dict`'s output; returns the groups that were generating (issue them again, same
        index and attempt)."""
        saved = int(meta.get("groups_per_step", self.groups_per_step))
        if saved != self.groups_per_step:
            raise ValueError(f"the checkpoint's rollout buffer holds groups for steps of {saved} prompts, the run "
                             f"has data.train_batch_size={self.groups_per_step}: resume with {saved}")
        self.head, self.next_index = int(meta["head"]), int(meta["next_index"])
        self.kept_or_pending, self.counts = int(meta["kept_or_pending"]), dict(meta["counts"])
        self.records, again = {}, []
        done = iter(non_tensors)
        for entry in meta["records"]:
            record = GroupRecord(int(entry["index"]), int(entry["attempt"]), GroupStatus(entry["status"]),
                                 min_version=entry["min_version"], max_version=entry["max_version"])
            if record.status is GroupStatus.DONE:
                prefix = f"{record.index}/"
                rest = next(done)
                dtypes = rest.get("dtypes", {})
                fields = {k: np.asarray(v, dtype=dtypes[k]) if k in dtypes else v
                          for k, v in rest["non_tensors"].items()}
                record.batch = Batch(tensors={k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                                     non_tensors=fields, meta=rest["meta"])
            elif record.status is GroupStatus.ISSUED:
                again.append(record)
            self.records[record.index] = record
        return again


BUFFER_TENSORS, BUFFER_META = "groups.safetensors", "buffer.json"
"""The files of a rollout buffer in a run checkpoint's ``rollout_buffer/`` directory."""


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON can hold it (numpy scalars and arrays become numbers and lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), where)
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist(), where)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"the rollout buffer cannot save {where}: a {type(value).__name__} (checkpoints hold "
                    f"numbers, strings, lists and dicts in non-tensor fields)")


def save_state(directory: str | os.PathLike, state: tuple[dict[str, Any], dict[str, torch.Tensor],
                                                          list[dict[str, Any]]]) -> None:
    """Write :meth:`RolloutBuffer.state_dict`'s output into ``directory`` (safetensors and JSON)."""
    meta, tensors, non_tensors = state
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, directory / BUFFER_TENSORS)
    groups = [{part: {k: _plain(v, f"field {k!r} of group {entry['index']}") for k, v in fields.items()}
               if part != "dtypes" else fields for part, fields in group.items()}
              for entry, group in zip((r for r in meta["records"] if r["status"] == GroupStatus.DONE.value),
                                      non_tensors)]
    (directory / BUFFER_META).write_text(json.dumps({"meta": meta, "groups": groups}))


def load_state(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Read what :func:`save_state` wrote (for :meth:`RolloutBuffer.load_state_dict`)."""
    directory = Path(directory)
    saved = json.loads((directory / BUFFER_META).read_text())
    return saved["meta"], load_file(directory / BUFFER_TENSORS), saved["groups"]
