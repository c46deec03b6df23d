"""Step metrics computed on the driver: data, timing and throughput.

Names follow verl's so dashboards carry over: ``critic/score/mean``, ``critic/rewards/mean``,
``critic/advantages/max``, ``response_length/mean``, ``response_length/clip_ratio``,
``timing_s/<stage>``, ``timing_per_token_ms/<stage>``, ``perf/throughput`` ...
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from megarl.algo.losses import explained_variance
from megarl.algo.masked import masked_mean
from megarl.data.batch import Batch


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to ``timing[name]`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def data_metrics(batch: Batch, *, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values (over the tokens that train, ``response_mask``), and
    response/prompt lengths (every token of the response, tool outputs included) of a step's batch."""
    mask_NR = batch["response_mask"]
    valid = mask_NR.bool()
    max_response = valid.shape[-1]
    response_length_N = batch["attention_mask"][:, -max_response:].sum(-1).float()
    prompt_length_N = batch["attention_mask"][:, :-max_response].sum(-1).float()
    metrics: dict[str, float] = {}
    metrics |= _stats("critic/score", batch["token_level_scores"].sum(-1))
    metrics |= _stats("critic/rewards", batch["token_level_rewards"].sum(-1))
    metrics |= _stats("critic/advantages", batch["advantages"][valid])
    metrics |= _stats("critic/returns", batch["returns"][valid])
    if use_critic:
        values_NR = batch["values"]
        metrics |= _stats("critic/values", values_NR[valid])
        metrics["critic/vf_explained_var"] = float(explained_variance(values_NR, batch["returns"], mask_NR))
    metrics |= _stats("response_length", response_length_N)
    metrics["response_length/clip_ratio"] = float((response_length_N == max_response).float().mean())
    metrics |= _stats("prompt_length", prompt_length_N)
    if "entropys" in batch:
        metrics["actor/entropy"] = float(masked_mean(batch["entropys"], mask_NR))
    return metrics


def timing_metrics(timing: dict[str, float], *, num_tokens: int, num_response_tokens: int) -> dict[str, float]:
    """``timing_s/<stage>`` and ``timing_per_token_ms/<stage>`` (per response token for ``gen``)."""
    metrics = {f"timing_s/{name}": seconds for name, seconds in timing.items()}
    for name, seconds in timing.items():
        tokens = num_response_tokens if name == "gen" else num_tokens
        if tokens:
            metrics[f"timing_per_token_ms/{name}"] = seconds * 1000 / tokens
    return metrics


def throughput_metrics(timing: dict[str, float], *, num_tokens: int, num_ranks: int) -> dict[str, float]:
    """Tokens per second per rank over the whole step (``perf/throughput``) and totals."""
    step = timing.get("step", 0.0)
    return {"perf/total_num_tokens": float(num_tokens), "perf/time_per_step": step,
            "perf/throughput": num_tokens / max(step, 1e-9) / max(num_ranks, 1)}


def mean_dicts(outputs) -> dict[str, float]:
    """Average the metric dicts of the DP replicas (``None`` entries skipped)."""
    dicts = [o for o in (outputs if isinstance(outputs, list) else [outputs]) if o]
    if not dicts:
        return {}
    keys = dicts[0].keys()
    return {k: sum(float(d[k]) for d in dicts) / len(dicts) for k in keys}


PER_REQUEST_COUNTS = ("num_assistant_turns", "num_user_turns")
"""Multi-turn request metrics that describe one conversation (reported as mean and max, not summed)."""


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Finish-reason shares (``rollout/finish_<reason>_frac``) and, for multi-turn rollouts, the requests'
    counters summed over the batch (``multi_turn/<counter>``: tool calls, each kind of tool error, hook
    time-outs ``multi_turn/num_timeouts/<hook>``...) with turn counts as mean and max."""
    metrics: dict[str, float] = {}
    if "finish_reason" in batch:
        reasons = [str(r) for r in batch["finish_reason"]]
        metrics.update({f"rollout/finish_{kind}_frac": reasons.count(kind) / len(reasons)
                        for kind in sorted(set(reasons))})
    if "metrics" in batch:
        rows = list(batch["metrics"])
        for key in sorted({key for row in rows for key in row}):
            values = [float(row.get(key, 0.0)) for row in rows]
            if key in PER_REQUEST_COUNTS:
                metrics[f"multi_turn/{key}/mean"] = sum(values) / len(values)
                metrics[f"multi_turn/{key}/max"] = max(values)
            else:
                metrics[f"multi_turn/{key}"] = sum(values)
    return metrics


class RolloutFailureError(RuntimeError):
    """More rollouts of a step failed than ``actor_rollout_ref.rollout.max_failed_frac`` allows."""


def check_failed_rollouts(batch: Batch, max_failed_frac: float, where: str) -> int:
    """The number of FAILED rollouts (finish reason ``abort``) in ``batch``; raises :class:`RolloutFailureError`
    naming ``where``, the setting and the most common reasons when their share exceeds ``max_failed_frac``."""
    if "finish_reason" not in batch:
        return 0
    failed = [i for i, reason in enumerate(batch["finish_reason"]) if str(reason) == "abort"]
    total = len(batch["finish_reason"])
    if len(failed) <= max_failed_frac * total:
        return len(failed)
    errors = [str(batch["rollout_error"][i]) or "the engine aborted" for i in failed] if "rollout_error" in batch \
        else ["the engine aborted"] * len(failed)
    counts: dict[str, int] = {}
    for error in errors:
        counts[error] = counts.get(error, 0) + 1
    common = sorted(counts.items(), key=lambda item: -item[1])[:3]
    reasons = "; ".join(f"{n}x: {error}" for error, n in common)
    more = f"; and {len(counts) - 3} other reasons" if len(counts) > 3 else ""
    raise RolloutFailureError(f"{where}: {len(failed)} of {total} rollouts failed, more than "
                              f"actor_rollout_ref.rollout.max_failed_frac={max_failed_frac}. Reasons: "
                              f"{reasons}{more}")


def sample_versions(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample of an asynchronous batch: the oldest and newest weight version among its tokens, and whether it
    has any (rows without versions: -1, -1, False)."""
    versions = batch["rollout_weight_versions"]
    valid = versions >= 0
    has = valid.any(dim=1)
    oldest = torch.where(valid, versions, torch.iinfo(versions.dtype).max).min(dim=1).values
    newest = torch.where(valid, versions, -1).max(dim=1).values
    return torch.where(has, oldest, -1), newest, has


def sample_staleness(batch, step: int) -> torch.Tensor:
    """Weight versions between step ``step``'s policy (``step - 1``) and each sample's oldest token (samples with
    versions only)."""
    oldest, _, has = sample_versions(batch)
    return ((step - 1) - oldest[has]).float()


def staleness_metrics(batch, step: int, producer) -> dict[str, float]:
    """``async/*`` of an asynchronous step: how many weight versions behind the trainer's policy (``step - 1``) each
    sample's oldest token is (``staleness/*``, and ``staleness/frac_<lag>`` per lag), the share of samples whose
    tokens span several versions (partial rollouts), the groups generating and ready in the buffer, and the
    groups dropped or regenerated past the bound so far."""
    out: dict[str, float] = {}
    if "rollout_weight_versions" in batch:
        oldest, newest, has = sample_versions(batch)
        staleness = sample_staleness(batch, step)
        if staleness.numel():
            out.update({"async/staleness/mean": float(staleness.mean()), "async/staleness/max": float(staleness.max()),
                        "async/staleness/min": float(staleness.min())})
            for lag in range(int(staleness.max()) + 1):
                out[f"async/staleness/frac_{lag}"] = float((staleness == lag).float().mean())
        out["async/partial_frac"] = float((newest[has] > oldest[has]).float().mean()) if has.any() else 0.0
    pending = producer.pending
    out.update({"async/groups_generating": float(pending["generating"]), "async/groups_ready": float(pending["ready"]),
                "async/weight_version": float(producer.version)})
    out.update({f"async/groups_{key}": float(value) for key, value in producer.buffer.counts.items()})
    return out


# ------------------------------------------------------------------------------------------------ validation
BOOTSTRAP_ROUNDS = 1000
"""Resamples behind each ``best@k`` / ``worst@k`` / ``maj@k`` estimate (verl's number)."""


def _sizes(n: int) -> list[int]:
    """The ``k`` of ``best@k`` for ``n`` samples: 2, 4, 8, ... below ``n``, then ``n`` (verl's)."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _majority(values: np.ndarray, preds: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """For each row of ``picks`` (sample indices): the value of the first sample whose prediction is the most
    common in the row, ties going to the prediction that appears first (verl's majority vote)."""
    codes = np.unique(preds, return_inverse=True)[1].reshape(-1)[picks]  # [rounds, k]
    kinds = int(codes.max()) + 1
    counts = (codes[..., None] == np.arange(kinds)).sum(1)  # [rounds, kinds]
    position = np.arange(codes.shape[1])
    first = np.where(codes[..., None] == np.arange(kinds), position[None, :, None], codes.shape[1]).min(1)
    first = np.where(counts == counts.max(1, keepdims=True), first, codes.shape[1])  # only the most common
    winner_at = first.min(1)
    return values[picks[np.arange(len(picks)), winner_at]]


def _group_stats(values: np.ndarray, preds: np.ndarray | None, rng: np.random.Generator) -> dict[str, float]:
    n = len(values)
    stats = {f"mean@{n}": float(values.mean())}
    if n == 1:
        return stats
    stats[f"std@{n}"] = float(values.std())
    for k in _sizes(n):
        picks = rng.integers(0, n, size=(BOOTSTRAP_ROUNDS, k))
        for name, reduced in (("best", values[picks].max(1)), ("worst", values[picks].min(1))) + (
                (("maj", _majority(values, preds, picks)),) if preds is not None else ()):
            stats[f"{name}@{k}/mean"], stats[f"{name}@{k}/std"] = float(reduced.mean()), float(reduced.std())
    return stats


def validation_metrics(sources: Sequence[str], groups: Sequence[int], infos: dict[str, Sequence],
                       *, seed: int) -> dict[str, float]:
    """verl's validation metrics: for every data source and every numeric variable of ``infos`` (``reward``, and
    the reward function's extras such as ``acc``), the mean over prompts of each prompt's ``mean@N``, ``std@N``
    and bootstrap ``best@k`` / ``worst@k`` / ``maj@k`` (``mean`` and ``std``; the vote over ``infos["pred"]``)
    of its ``N`` samples (rows of one prompt share a ``groups`` id). Named ``val-core/<source>/<var>/<metric>``
    for the core variable (``acc`` when the reward reports it, else ``reward``) at ``@N`` of ``mean``/``best``/
    ``maj``, ``val-aux/...`` for the rest. ``seed`` seeds the bootstrap."""
    rng = np.random.default_rng(seed)
    preds = infos.get("pred")
    numeric = {name: np.asarray(column, dtype=np.float64) for name, column in infos.items()
               if len(column) and not isinstance(column[0], str) and name != "pred"}
    core = "acc" if "acc" in numeric else "reward"
    rows_of: dict[tuple[str, int], list[int]] = {}
    for row, (source, group) in enumerate(zip(sources, groups, strict=True)):
        rows_of.setdefault((str(source), int(group)), []).append(row)
    per_source: dict[tuple[str, str, str], list[float]] = {}
    for (source, _), rows in rows_of.items():
        picked = None if preds is None else np.asarray([str(preds[r]) for r in rows])
        for name, column in numeric.items():
            for metric, value in _group_stats(column[rows], picked, rng).items():
                per_source.setdefault((source, name, metric), []).append(value)
    n_max = max((len(rows) for rows in rows_of.values()), default=1)
    out = {}
    for (source, name, metric), values in per_source.items():
        section = "val-core" if (name == core and metric.split("@")[0] in ("mean", "best", "maj")
                                 and f"@{n_max}" in metric) else "val-aux"
        out[f"{section}/{source}/{name}/{metric}"] = float(np.mean(values))
    return out


UNSCORED_KEYS = ("reward_error", "judge_error", "judge_answer")
"""Per-row extras that are not validation metrics: why a row has no score, the judge's answer text."""


def unscored_rows(extra: Mapping[str, list], keys: list[str], rows: int) -> list[bool]:
    """Per row: whether a source could not score it (a reason in any of ``keys``, the reward stage's columns)."""
    columns = [extra[key] for key in keys if key in extra]
    return [any(column[row] for column in columns) for row in range(rows)]


class ValidationRows:
    """A validation's scored rows, round by round: each row's data source, prompt group (the rollout manager repeats
    each prompt ``n`` times, interleaved) and per-row columns (``reward`` and the reward function's scalars); rows the
    reward function (``reward_model.on_error=skip``) or the judge could not score are counted and left out
    (``unscored_keys``: the reward stage's columns naming such rows)."""

    def __init__(self, unscored_keys: list[str]) -> None:
        self.unscored_keys = list(unscored_keys)
        self.sources: list[str] = []
        self.groups: list[int] = []
        self.infos: dict[str, list] = {}
        self.num_errors = 0

    def add(self, data_sources, scores: list[float], extra: dict[str, list], *, first_group: int, n: int) -> None:
        errors = unscored_rows(extra, self.unscored_keys, len(scores))
        for row, (source, score, error) in enumerate(zip(data_sources, scores, errors, strict=True)):
            if error:
                self.num_errors += 1
                continue
            self.sources.append(str(source))
            self.groups.append(first_group + row // n)
            self.infos.setdefault("reward", []).append(score)
            for key, column in extra.items():
                if key not in UNSCORED_KEYS and isinstance(column[row], (int, float, str, bool)):
                    self.infos.setdefault(key, []).append(column[row])

    def metrics(self, *, seed: int, count_errors: bool) -> dict[str, float]:
        """:func:`validation_metrics` of the rows (columns every row has), and the errors counted."""
        complete = {key: column for key, column in self.infos.items() if len(column) == len(self.sources)}
        metrics = validation_metrics(self.sources, self.groups, complete, seed=seed)
        if count_errors:
            metrics["val-aux/reward/num_errors"] = float(self.num_errors)
        return metrics
