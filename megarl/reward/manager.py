"""The reward manager: one score per trajectory, placed on its last valid response token.

Per row (verl's "naive" manager):

1. the valid response is ``responses[i, :last + 1]``, where ``last`` is the last position with
   the rollout's ``attention_mask[:, -T:]`` 1 (``response_mask``, the tokens that train, in a batch
   without the rollout's attention mask): multi-turn responses include their tool-output tokens, as
   in verl;
2. it is decoded with the tokenizer (special tokens skipped);
3. it is scored by the custom compute-score function when one is set, otherwise by the
   scorer registered for the row's ``data_source``, with ``reward_model["ground_truth"]``
   and the row's ``extra_info``;
4. the score goes to ``token_level_scores[i, last]``; every other entry is 0.

A row without any valid response token still gets scored (on the empty string) and its score
is put at position 0, so the trajectory's total reward is kept; such rows are counted and
logged.

If the batch already has ``rm_scores`` (a reward model ran), they are the scores, as in verl,
and no rule scoring happens.

Scoring errors: a row whose function raises, returns something other than a number (Python's,
numpy's, or a one-element tensor or array) or a dict with ``"score"``, returns a non-finite score
(NaN, inf), or has not returned after ``timeout_s`` is an error naming the row (its prompt index
and ``data_source``) and the function. ``on_error="raise"`` raises
:class:`RewardError`; ``on_error="skip"`` scores the row 0, records the message in the row's
``reward_error`` extra info (``None`` on the other rows) and goes on: the trainer counts such
rows and leaves them out of the update.

Time limit: with ``timeout_s`` set, the function runs on a daemon thread of the manager's, one row
at a time, and each row waits at most ``timeout_s`` for it. Python cannot stop a thread, so a row past
its limit leaves its call running on the old thread (it can no longer hold the run: the process exits
without it) and the next row gets a new thread; such threads are counted (``abandoned_calls``).

Shape legend: ``B`` rows (trajectories), ``T`` response tokens (``responses.shape[1]``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from megarl.algo.dapo import overlong_penalty
from megarl.data.batch import Batch
from megarl.reward.registry import ComputeScore, ScorerRegistry, check_compute_score, load_function

logger = logging.getLogger(__name__)

ON_ERROR_MODES = ("raise", "skip")
"""What a scoring error does (``reward_model.on_error``): stop the run, or score the row 0 and count it."""


class RewardError(ValueError):
    """A row could not be scored (``on_error="raise"``); the message names the row, its data source and the
    function."""


PASSED_THROUGH_FIELDS = ("reward_scores", "num_turns")
"""Per-row rollout fields added to a copy of ``extra_info`` when the batch has them
(multi-turn tool rewards ``{tool_name: calc_reward value}`` and the number of turns)."""


def last_valid_positions(mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of ``mask_BT`` (shape ``[B]``), -1 for an all-zero row."""
    positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    return torch.where(mask_BT.bool(), positions_BT, torch.full_like(positions_BT, -1)).max(dim=1).values


def scored_tokens(batch: Batch, num_tokens: int) -> torch.Tensor:
    """Every token of each response (tool outputs included): the response part of a rollout's
    ``attention_mask`` (``[B, P+T]`` beside ``prompts`` ``[B, P]``); else ``response_mask`` (the tokens that
    train), else the last ``T`` columns of ``attention_mask``."""
    if "attention_mask" in batch and "prompts" in batch and \
            batch["attention_mask"].shape[1] == batch["prompts"].shape[1] + num_tokens:
        return batch["attention_mask"][:, -num_tokens:]
    if "response_mask" in batch:
        return batch["response_mask"]
    if "attention_mask" in batch:
        return batch["attention_mask"][:, -num_tokens:]
    raise ValueError("RewardManager needs `attention_mask` [B, P+T] or `response_mask` [B, T] in the batch "
                     f"to find each response's last token; the batch has {batch.keys()}")


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (``reward_model.overlong_buffer``): a response longer than
    ``max_response_length - buffer_len`` tokens loses up to ``penalty_factor`` (:func:`megarl.algo.dapo.
    overlong_penalty`); ``log`` adds each row's ``overlong_reward`` and ``overlong`` to the extras."""

    max_response_length: int
    buffer_len: int
    penalty_factor: float = 1.0
    log: bool = False


class RewardManager:
    """Scores a rollout batch: ``manager(batch) -> (token_level_scores [B, T], extra_info)``.

    ``extra_info`` maps each key to a list with one entry per row: always ``"score"``, plus the
    keys of dict-returning scorers (the built-in ones give ``"acc"`` and ``"pred"``). A key
    that only some rows return is ``None`` on the other rows.

    Args:
        tokenizer: decodes the response ids.
        compute_score: a custom compute-score function, or its ``"module_or_path:function"``
            spec; it scores every row, whatever its ``data_source``. ``None``: use ``scorers``.
        reward_kwargs: keyword arguments bound to every call of the custom function.
        scorers: the ``data_source`` registry; a fresh :class:`ScorerRegistry` (built-ins) if None.
        scorer_kwargs: per ``data_source`` settings for registered scorers, e.g.
            ``{"openai/gsm8k": {"method": "flexible", "format_score": 0.1}}``.
        num_examine: how many decoded samples per ``data_source`` to log at INFO level per call
            (0 in training, 1 in validation, as in verl).
        on_error: ``raise`` or ``skip`` (see the module docstring).
        timeout_s: the longest one row's scoring may take (``None``: no limit, and the function runs on the
            caller's thread); see the module docstring.
        overlong: DAPO's overlong penalty, added to each scored row's score on its last token (the ``score``
            extra stays the function's own); None: off.
    """

    def __init__(self, tokenizer: Any, *, compute_score: ComputeScore | str | None = None,
                 reward_kwargs: Mapping[str, Any] | None = None, scorers: ScorerRegistry | None = None,
                 scorer_kwargs: Mapping[str, Mapping[str, Any]] | None = None, num_examine: int = 0,
                 on_error: str = "raise", timeout_s: float | None = None,
                 overlong: OverlongPenalty | None = None) -> None:
        if num_examine < 0:
            raise ValueError(f"num_examine must be >= 0, got {num_examine}")
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"reward_model.on_error={on_error!r}; use one of {ON_ERROR_MODES}")
        self.on_error = on_error
        self.overlong = overlong
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward_model.timeout_s must be > 0 (or null for no limit), got {timeout_s}")
        self._bounded = _BoundedCaller(timeout_s) if timeout_s is not None else None
        if reward_kwargs and compute_score is None:
            raise ValueError("reward_kwargs are bound to a custom reward function, but none is set; set the "
                             "custom function ('module_or_path:function') or use scorer_kwargs per data_source")
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.scorers = scorers if scorers is not None else ScorerRegistry()
        for data_source, kwargs in (scorer_kwargs or {}).items():
            self.scorers.configure(data_source, **kwargs)
        if isinstance(compute_score, str):
            self.function_name = f"custom reward function {compute_score!r}"
            function = load_function(compute_score)
            check_compute_score(function, self.function_name, reward_kwargs or {})
            compute_score = functools.partial(function, **reward_kwargs) if reward_kwargs else function
        elif compute_score is not None:
            self.function_name = f"custom reward function {getattr(compute_score, '__qualname__', compute_score)!r}"
            check_compute_score(compute_score, self.function_name, reward_kwargs or {})
            if reward_kwargs:
                compute_score = functools.partial(compute_score, **reward_kwargs)
        else:
            self.function_name = "the registered scorer"
        self.compute_score = compute_score

    def check_data_sources(self, data_sources: Iterable[str], key: str) -> None:
        """Refuse data sources no scorer is registered for (without a custom function), naming ``key``."""
        if self.compute_score is not None:
            return
        unknown = sorted(source for source in set(data_sources) if source not in self.scorers)
        if unknown:
            raise ValueError(f"{key}: rows of data_source {unknown} have no reward scorer (registered: "
                             f"{self.scorers.names()}); set reward_model.custom_reward_function.path/name to a "
                             f"function that scores them")

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, list]]:
        """Token-level scores ``[B, T]`` (float32, on the responses' device) and per-row extra info."""
        responses_BT = batch["responses"]
        if "rm_scores" in batch:
            return batch["rm_scores"], {}
        num_rows, num_tokens = responses_BT.shape
        mask_BT = scored_tokens(batch, num_tokens)
        last_B = last_valid_positions(mask_BT)
        data_sources = batch["data_source"]
        reward_models = batch["reward_model"]
        extra_infos = batch["extra_info"] if "extra_info" in batch else [None] * num_rows
        scores_BT = torch.zeros(num_rows, num_tokens, dtype=torch.float32, device=responses_BT.device)
        rows_info: list[dict[str, Any]] = []
        examined: dict[str, int] = {}
        for i in range(num_rows):
            last = int(last_B[i])
            solution_str = self.tokenizer.decode(responses_BT[i, :last + 1].tolist(), skip_special_tokens=True)
            ground_truth = self._ground_truth(reward_models[i], data_sources[i], i)
            extra_info = self._extra_info(batch, extra_infos[i], i)
            scorer = self._scorer(data_sources[i])
            try:
                call = functools.partial(_score_row, scorer, solution_str, ground_truth, extra_info)
                score, info = self._split_result(call() if self._bounded is None else self._bounded(call))
            except Exception as error:  # the reward function is user code: name the row, then raise or skip
                message = (f"row {i} ({self._where(batch, i, extra_info, data_sources[i])}): {self.function_name} "
                           f"{_describe(error)}")
                if self.on_error == "raise":
                    raise RewardError(f"{message}; fix the function, or set reward_model.on_error=skip to score "
                                      f"such rows 0 and leave them out of the update (counted)") from error
                score, info = 0.0, {"score": 0.0, "reward_error": message}
            scores_BT[i, max(last, 0)] = score
            rows_info.append(info)
            if examined.get(data_sources[i], 0) < self.num_examine:
                examined[data_sources[i]] = examined.get(data_sources[i], 0) + 1
                self._log_sample(batch, i, solution_str, ground_truth, info)
        if self.overlong is not None:
            self._penalise_overlong(scores_BT, last_B, rows_info)
        empty_rows = [i for i in range(num_rows) if int(last_B[i]) < 0]
        if empty_rows:
            logger.warning("RewardManager: %d of %d rows have no valid response token (rows %s); their scores "
                           "were put at response position 0", len(empty_rows), num_rows, empty_rows[:20])
        return scores_BT, reward_columns(rows_info)

    def _penalise_overlong(self, scores_BT: torch.Tensor, last_B: torch.Tensor, rows_info: list[dict]) -> None:
        """Add the overlong penalty of each row's length (every response token) to its score; rows whose scoring
        failed keep their 0."""
        o = self.overlong
        penalty_B = overlong_penalty(last_B + 1, o.max_response_length, o.buffer_len, o.penalty_factor)
        for i, info in enumerate(rows_info):
            if "reward_error" in info:
                continue
            scores_BT[i, max(int(last_B[i]), 0)] += float(penalty_B[i])
            if o.log:
                info["overlong_reward"], info["overlong"] = float(penalty_B[i]), bool(penalty_B[i] < 0)

    @staticmethod
    def _ground_truth(reward_model: Any, data_source: str, row: int) -> Any:
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise ValueError(f"row {row} (data_source {data_source!r}): reward_model must be a dict with "
                             f"'ground_truth', got {reward_model!r}; fix the dataset's reward_model column")
        return reward_model["ground_truth"]

    @staticmethod
    def _extra_info(batch: Batch, extra_info: Any, row: int) -> dict:
        info = dict(extra_info) if isinstance(extra_info, Mapping) else {}
        for key in PASSED_THROUGH_FIELDS:
            if key in batch.non_tensors:
                info[key] = batch.non_tensors[key][row]
        return info

    def _scorer(self, data_source: str) -> Callable[[str, Any, dict], Any]:
        """``scorer(solution_str, ground_truth, extra_info)`` for rows of ``data_source`` (``ValueError`` when
        no scorer is registered for it and there is no custom function)."""
        if self.compute_score is not None:
            return functools.partial(_call_compute_score, self.compute_score, data_source)
        return self.scorers.get(data_source)

    @staticmethod
    def _where(batch: Batch, row: int, extra_info: Mapping[str, Any], data_source: str) -> str:
        """``prompt index 17, data_source 'openai/gsm8k'`` (the index when the batch or extra_info has one)."""
        index = batch.non_tensors["index"][row] if "index" in batch.non_tensors else extra_info.get("index")
        return f"data_source {data_source!r}" if index is None else f"prompt index {index}, data_source {data_source!r}"

    @staticmethod
    def _split_result(result: Any) -> tuple[float, dict[str, Any]]:
        """The score and the row's extra info (``score`` plus a dict result's other keys)."""
        if isinstance(result, Mapping):
            if "score" not in result:
                raise BadReturn(f"returned a dict without 'score' (keys {sorted(result)}); return a float or a "
                                f"dict with 'score'")
            info = dict(result)
        elif _is_number(result):
            info = {"score": result}
        else:
            raise BadReturn(f"returned {type(result).__name__}; return a float or a dict with 'score'")
        try:
            if not _is_number(info["score"]):
                raise TypeError
            score = float(info["score"])
        except (TypeError, ValueError):
            raise BadReturn(f"returned a score of type {type(info['score']).__name__}; scores are numbers") from None
        if not math.isfinite(score):
            raise BadReturn(f"returned the score {score}; scores must be finite")
        info["score"] = score
        return score, info

    def _log_sample(self, batch: Batch, row: int, solution_str: str, ground_truth: Any, info: dict) -> None:
        prompt = ""
        if "prompts" in batch:
            prompt_ids = batch["prompts"][row]
            if "attention_mask" in batch:
                prompt_ids = prompt_ids[batch["attention_mask"][row, :prompt_ids.shape[0]].bool()]
            prompt = self.tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)
        logger.info("[data_source] %s\n[prompt] %s\n[response] %s\n[ground_truth] %s\n[reward] %s",
                    batch["data_source"][row], prompt, solution_str, ground_truth, info)


def _call_compute_score(compute_score: ComputeScore, data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict) -> Any:
    """A compute-score function called as verl calls it (keywords)."""
    return compute_score(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                         extra_info=extra_info)


def _score_row(scorer: Callable[[str, Any, dict], Any], solution_str: str, ground_truth: Any, extra_info: dict) -> Any:
    """``scorer``'s result for one row; an ``async def`` scorer's is awaited, on an event loop of its own in the
    calling thread (the time limit's thread when ``reward_model.timeout_s`` is set)."""
    result = scorer(solution_str, ground_truth, extra_info)
    if inspect.isawaitable(result):
        return asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class BadReturn(ValueError):
    """The reward function returned something that is not a finite score."""


class ScoreTimeout(RuntimeError):
    """The reward function did not return within ``reward_model.timeout_s``."""


def _is_number(value: Any) -> bool:
    """A score the manager takes: a real number (Python's or numpy's, booleans included) or a one-element
    tensor or array."""
    if isinstance(value, (numbers.Real, np.bool_)):
        return True
    if isinstance(value, np.ndarray):
        return value.size == 1
    return isinstance(value, torch.Tensor) and value.numel() == 1


class _BoundedCaller:
    """Runs calls one at a time on a daemon thread of its own and waits at most ``timeout_s`` for each; a call
    past its limit keeps its thread (Python cannot stop a thread) and the next call gets a new one."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.abandoned_calls = 0
        self._calls: queue.SimpleQueue | None = None

    def __call__(self, function: Callable[[], Any]) -> Any:
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._calls,), name="megarl-reward", daemon=True).start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((function, future))
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._calls.put(None)  # the stuck thread ends once its call returns, if ever
            self._calls = None
            self.abandoned_calls += 1
            raise ScoreTimeout(f"did not return within {self.timeout_s:g} s (reward_model.timeout_s); its call "
                               f"was left running on a thread of its own") from None


def _serve(calls: queue.SimpleQueue) -> None:
    while (item := calls.get()) is not None:
        function, future = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(function())
        except BaseException as error:  # noqa: BLE001 - handed to the caller, which names the row
            future.set_exception(error)


def _describe(error: Exception) -> str:
    """``returned ...`` for a bad return value, ``raised <Type>: <message>`` for an exception."""
    if isinstance(error, (BadReturn, ScoreTimeout)):
        return str(error)
    return f"raised {type(error).__name__}: {error}"


def reward_columns(rows_info: list[dict[str, Any]]) -> dict[str, list]:
    """Per-row dicts -> ``{key: [value per row]}``; ``None`` where a row lacks a key."""
    keys: list[str] = []
    for info in rows_info:
        keys.extend(k for k in info if k not in keys)
    return {key: [info.get(key) for info in rows_info] for key in keys}
