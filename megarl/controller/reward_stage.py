"""A row's reward, assembled in one stage: an ordered list of signal sources under one combine rule and one failure
policy (docs/design.md, 'The reward stage').

The sources (:data:`REWARD_SOURCES`, in order; :mod:`megarl.controller.reward_sources`, the judge's in
:mod:`megarl.controller.judge`):

============  =======  ==================  =======================================  ==============================
source        when     into                combine                                  could not score a row
============  =======  ==================  =======================================  ==============================
rule          rollout  score               add                                      ``reward_error`` (``on_error=skip``)
judge         rollout  score               ``reward_model.judge.combine``, ``coef``  ``judge_error``
reward model  step     score               ``reward_model.combine``, ``rm_coef``
in-reward KL  step     reward              add, ``−beta`` (``algorithm.kl_ctrl``)
teacher       step     ``teacher.signal``  add, ``−teacher.kl_coef``
============  =======  ==================  =======================================  ==============================

*When*: a ``rollout`` source scores a trajectory as it is produced (:meth:`RewardStage.score_rollout`: the
synchronous rollout's batches, the asynchronous producer's groups, validation's rounds), which is what DAPO's group
filter reads; a ``step`` source needs the step's forwards (the scoring models', the old and reference log-probs) and
runs in the step's one call, :meth:`RewardStage.score_step`, after the reference.

*Into*: ``score`` is ``token_level_scores``, the task's score (``critic/score/*``, the group filter);
``reward`` is ``token_level_rewards`` only (the estimator's input: the scores and the penalties), which starts from
the scores; ``advantage`` is added to the estimator's advantages (:func:`add_advantage_terms`).

*One combine rule*: each source gives per-token values ``S`` [B, T] and a weight ``c``; its target becomes
``target + c·S`` (``add``) or ``c·S`` (``replace``: what the sources before it put there is dropped, and a rollout
source that a later rollout source replaces is not called). A sequence score sits on the response's last token.

*One failure policy*: a source may say it could not score a row (a reason in the row's ``unscored_key`` column).
Such a row trains with an all-zero loss mask, set as it is scored (before any log-prob, so nothing of the step
counts it); each source counts its rows (``reward/num_errors``, ``judge/*``), the step's first reason is shown, and a
source's own limit (``reward_model.judge.max_failure_share``) stops the run. Validation leaves such rows out of its
metrics and counts them (``val-aux/reward/num_errors``).

Adding a source is an entry in :data:`REWARD_SOURCES` and its class (a second reward model: its role spec in
:mod:`megarl.workers.roles`, its config section, and ``SourceEntry("reward_model_2", ...)`` building a
:class:`~megarl.controller.reward_sources.ModelScore` of it).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from megarl.algo.dapo import REWARD_EXTRA
from megarl.algo.kl import KLController
from megarl.config.schema import RunConfig
from megarl.controller.judge import Judge, JudgeSource
from megarl.controller.metrics import unscored_rows
from megarl.controller.reward_sources import KLInReward, ModelScore, RuleSource, Signal, StepContext, TeacherKL
from megarl.data.batch import Batch
from megarl.reward.manager import RewardManager, reward_columns
from megarl.workers.roles import SPEC_OF

TARGETS = ("score", "reward", "advantage")
ADVANTAGE_TERMS = "advantage_terms"
"""The batch field of the ``advantage`` sources' values, added to the estimator's advantages."""


@dataclasses.dataclass
class StageInputs:
    """What the sources are built from."""

    tokenizer: Any
    rules: RewardManager
    """The rule function (the training or the validation manager)."""
    judge: Judge | None = None
    kl_ctrl: KLController | None = None


@dataclasses.dataclass(frozen=True)
class SourceEntry:
    """One source of the stage: when a run has it, and how it is built."""

    name: str
    enabled: Callable[[RunConfig], bool]
    build: Callable[[RunConfig, StageInputs], Any]
    validation: bool = False
    """Validation scores with it too (the rollout-time sources)."""


REWARD_SOURCES: tuple[SourceEntry, ...] = (
    SourceEntry("rule", lambda cfg: True, lambda cfg, inputs: RuleSource(inputs.rules), validation=True),
    SourceEntry("judge", lambda cfg: cfg.reward_model.judge.enable,
                lambda cfg, inputs: JudgeSource(inputs.judge, inputs.tokenizer), validation=True),
    SourceEntry("reward_model", lambda cfg: cfg.reward_model.enable,
                lambda cfg, inputs: ModelScore(SPEC_OF["reward_model"], cfg.reward_model)),
    SourceEntry("kl_in_reward", lambda cfg: cfg.algorithm.use_kl_in_reward,
                lambda cfg, inputs: KLInReward(inputs.kl_ctrl, cfg.algorithm.kl_penalty)),
    SourceEntry("teacher", lambda cfg: cfg.teacher.enable,
                lambda cfg, inputs: TeacherKL(SPEC_OF["teacher"], cfg.teacher)),
)
"""Every source, in the order the stage combines them (the module docstring's table)."""


def combined(total: torch.Tensor | None, signal: Signal, combine: str) -> torch.Tensor:
    """The combine rule: ``total + c·S`` (``add``; ``c·S`` into an empty target) or ``c·S`` (``replace``)."""
    part = signal.values if signal.coef == 1 else signal.coef * signal.values
    if combine == "replace" or total is None:
        return part
    if combine != "add":
        raise ValueError(f"a reward source's combine is add or replace, got {combine!r}")
    return total + part


class RewardStage:
    """A run's reward stage (module docstring): ``sources`` in order.

    :meth:`score_rollout` and :meth:`rollout_scores` run the rollout-time sources (one call at a time: the
    asynchronous producer scores on a thread of its own); :meth:`score_step` is the step's one call.
    """

    def __init__(self, sources: list[Any], *, console: Callable[[str], None] = print) -> None:
        for source in sources:
            if source.into not in TARGETS:
                raise ValueError(f"reward source {source.name!r}: into={source.into!r}; use one of {TARGETS}")
        into = [source.into for source in sources]
        if "reward" in into and "score" in into[into.index("reward"):]:
            raise ValueError(f"reward sources {[s.name for s in sources]}: a score source after a reward source "
                             f"(the rewards start from the final scores)")
        replaced = {i for i, s in enumerate(sources) for later in sources[i + 1:]
                    if later.when == s.when == "rollout" and later.into == s.into and later.combine == "replace"}
        self.sources = [s for i, s in enumerate(sources) if i not in replaced]
        self.rollout_sources = [s for s in self.sources if s.when == "rollout"]
        self.step_sources = [s for s in self.sources if s.when == "step"]
        self.unscored_keys = [s.unscored_key for s in self.sources if s.unscored_key]
        """The columns that name rows a source could not score."""
        self.console = console
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, cfg: RunConfig, inputs: StageInputs, *, validation: bool = False,
                console: Callable[[str], None] = print) -> RewardStage:
        """The stage of ``cfg``'s sources (validation's: the rollout-time ones)."""
        entries = [e for e in REWARD_SOURCES if e.enabled(cfg) and (e.validation or not validation)]
        return cls([entry.build(cfg, inputs) for entry in entries], console=console)

    # ------------------------------------------------------------------------------------ rollout time
    def rollout_scores(self, batch: Batch) -> tuple[torch.Tensor, dict[str, list]]:
        """``token_level_scores`` [B, T] of a rollout batch by the rollout-time sources, and their per-row columns."""
        total, extra = None, {}
        for source in self.rollout_sources:
            signal = source.score(batch)
            total = combined(total, signal, source.combine)
            extra.update(signal.extra)
        if total is None:
            total = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        return total, extra

    def score_rollout(self, batch: Batch) -> Batch:
        """``batch`` scored in place: ``token_level_scores``, the per-row columns (:data:`REWARD_EXTRA`), and an
        all-zero ``response_mask`` on the rows a source could not score."""
        with self._lock:
            scores, extra = self.rollout_scores(batch)
        batch["token_level_scores"] = scores
        batch[REWARD_EXTRA] = [{key: values[i] for key, values in extra.items()} for i in range(len(batch))]
        unscored = [i for i, flag in enumerate(unscored_rows(extra, self.unscored_keys, len(batch))) if flag]
        if unscored:
            batch["response_mask"][unscored] = 0
        return batch

    # ------------------------------------------------------------------------------------ the step
    def score_step(self, batch: Batch, where: str, timing: dict[str, float], *, roles: Any,
                   around: Callable[[str], AbstractContextManager]) -> tuple[Batch, dict[str, list], dict[str, float]]:
        """The step's reward, after the reference: the rollout-time sources' counts (their rows were left out as
        scored), then the step-time sources in order into ``token_level_scores``, ``token_level_rewards`` and
        :data:`ADVANTAGE_TERMS`. Returns the batch, its per-row columns (taken off it) and the metrics."""
        extra = reward_columns(list(batch.pop(REWARD_EXTRA)[REWARD_EXTRA]))
        metrics = self.failure_metrics(extra, where)
        totals: dict[str, torch.Tensor | None] = {"score": batch["token_level_scores"], "advantage": None}
        for source in self.step_sources:
            signal = source.score(batch, StepContext(roles, timing, around, totals["score"]))
            if source.into == "reward" and "reward" not in totals:
                totals["reward"] = totals["score"]
            totals[source.into] = combined(totals[source.into], signal, source.combine)
            metrics |= signal.metrics
            for key, value in signal.columns.items():
                batch[key] = value
        batch["token_level_scores"] = totals["score"]
        batch["token_level_rewards"] = totals.get("reward", totals["score"])
        if totals["advantage"] is not None:
            batch[ADVANTAGE_TERMS] = totals["advantage"]
        return batch, extra, metrics

    def failure_metrics(self, extra: Mapping[str, list], where: str, *, validation: bool = False) -> dict[str, float]:
        """Each source's counts over the rows of ``extra`` (a step's, or a validation's rounds'); in a step, the
        first reason each source gives is shown. A source's own limit raises."""
        metrics: dict[str, float] = {}
        for source in self.sources:
            metrics |= source.failure_metrics(extra, where, validation)
        if validation:
            return metrics
        for source in self.sources:
            reasons = [reason for reason in extra.get(source.unscored_key, []) if reason] if source.unscored_key \
                else []
            if reasons:
                self.console(f"{where}: {len(reasons)} of {len(next(iter(extra.values())))} rows could not be scored "
                             f"{source.unscored_note}; the first: {reasons[0]}")
        return metrics


def add_advantage_terms(batch: Batch) -> None:
    """The ``advantage`` sources' values added to the estimator's advantages (0 outside ``response_mask``)."""
    if ADVANTAGE_TERMS in batch:
        terms = batch.pop(ADVANTAGE_TERMS)[ADVANTAGE_TERMS]
        batch["advantages"] = (batch["advantages"] + terms) * batch["response_mask"]


def extend_columns(columns: dict[str, list], extra: Mapping[str, list], rows: int) -> None:
    """``extra``'s per-row columns appended to ``columns`` (None where one of the two lacks a key)."""
    before = len(next(iter(columns.values()))) if columns else 0
    for key in list(columns) + [k for k in extra if k not in columns]:
        columns.setdefault(key, [None] * before).extend(extra.get(key, [None] * rows))
