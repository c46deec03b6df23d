"""A generative judge scoring every trajectory (``reward_model.judge``, :mod:`megarl.config.judge`).

:class:`Judge` asks the judge's engines (through their own sglang-router) about each row of a batch: the template
filled from the row (:mod:`megarl.reward.verdicts`), sent as one user message through the judge tokenizer's chat
template, answered by at most ``rollout.response_length`` tokens; the parser reads the verdict, which
``score_range`` maps onto [0, 1]. At most ``max_concurrency`` requests are in flight; each gets ``timeout_s``.

A row that cannot be judged gets no score: its ``judge_error`` names why (``timeout``, ``garbage``, ``too_long``,
``error``) and the trainer leaves it out of the update; each kind is counted per step (``judge/*``) and a step in
which more than ``max_failure_share`` of the rows failed stops the run (:func:`judge_step_metrics`).

:class:`JudgeSource` is the judge in a run's reward stage (:mod:`megarl.controller.reward_stage`): its score replaces
the rule reward or is added to it (``combine``), on each response's last token as the rule reward is.

Shape legend: ``B`` rows, ``T`` response tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megarl.config.judge import JudgeConfig
from megarl.controller.reward_sources import Signal
from megarl.data.batch import Batch
from megarl.engines.client import EngineClient, EngineError
from megarl.engines.engine import SamplingParams
from megarl.engines.event_loop import run_sync
from megarl.reward.manager import last_valid_positions, scored_tokens
from megarl.reward.verdicts import GarbageVerdict, fill_template, load_parser
from megarl.seeds import SEED_STREAM_JUDGE, derive_seed

logger = logging.getLogger(__name__)

FAILURES = ("timeout", "garbage", "too_long", "error")
"""Why a row could not be judged: no answer within ``timeout_s``; no verdict the parser reads (or one outside
``score_range``); a prompt longer than ``rollout.prompt_length``; the request failed (the engine or router answered
an error, a template field the row lacks)."""

class JudgeError(RuntimeError):
    """Too many rows of a step could not be judged (``reward_model.judge.max_failure_share``)."""


@dataclasses.dataclass(frozen=True)
class JudgeRow:
    """What the judge is asked about one trajectory."""

    prompt: str
    response: str
    ground_truth: Any
    data_source: str
    extra_info: Mapping[str, Any] | None
    key: str
    """Seeds the judge's sampling of this row (its uid and sample number): the same row gets the same answer."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The judge on one row: its score in [0, 1] and verdict, or why it has none (``failure``: a :data:`FAILURES`
    kind, ``message``: the details)."""

    score: float | None = None
    verdict: float | None = None
    answer: str | None = None
    failure: str | None = None
    message: str | None = None


class Judge:
    """Asks a generative judge about rows (module docstring).

    Args:
        config: the ``reward_model.judge`` section.
        client: the judge router's client.
        tokenizer: the judge's tokenizer (its chat template frames the prompt; its decoder reads the answer).
        seed: the rollout seed: the judge's sampling of a row is seeded by it and the row's key.
    """

    def __init__(self, config: JudgeConfig, client: EngineClient, tokenizer: Any, *, seed: int) -> None:
        self.config, self.client, self.tokenizer, self.seed = config, client, tokenizer, seed
        self.parse = load_parser(config.verdict_parser, "reward_model.judge.verdict_parser")
        r = config.rollout
        self.params = SamplingParams(max_new_tokens=r.response_length, temperature=r.temperature, top_p=r.top_p,
                                     top_k=r.top_k)
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def prompt_ids(self, text: str) -> list[int]:
        """The judge's input tokens for ``text``: one user message through its chat template (the text's own tokens
        without one)."""
        if self.chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def verdict_of(self, answer: str) -> Verdict:
        """The judge's answer parsed and mapped onto [0, 1]; garbage when no verdict is in ``score_range``."""
        low, high = self.config.score_range
        try:
            verdict = self.parse(answer)
        except GarbageVerdict as error:
            return Verdict(answer=answer, failure="garbage", message=str(error))
        except Exception as error:  # noqa: BLE001 - a user's parser: its failure is the row's, counted
            return Verdict(answer=answer, failure="garbage", message=f"the parser raised {type(error).__name__}: "
                                                                     f"{error}")
        if not low <= verdict <= high:
            return Verdict(answer=answer, verdict=verdict, failure="garbage",
                           message=f"verdict {verdict:g} is outside reward_model.judge.score_range "
                                   f"[{low:g}, {high:g}]")
        return Verdict(score=(verdict - low) / (high - low), verdict=verdict, answer=answer)

    async def ajudge(self, rows: Sequence[JudgeRow]) -> list[Verdict]:
        """A verdict per row, in order (on the event loop the client uses)."""
        gate = asyncio.Semaphore(self.config.max_concurrency)
        return list(await asyncio.gather(*(self._one(row, gate) for row in rows)))

    def judge(self, rows: Sequence[JudgeRow]) -> list[Verdict]:
        """:meth:`ajudge` from a thread that is not the event loop's."""
        return run_sync(self.ajudge(rows))

    async def _one(self, row: JudgeRow, gate: asyncio.Semaphore) -> Verdict:
        try:
            text = fill_template(self.config.prompt_template, prompt=row.prompt, response=row.response,
                                 ground_truth=row.ground_truth, data_source=row.data_source,
                                 extra_info=row.extra_info)
        except (KeyError, IndexError) as error:
            return Verdict(failure="error", message=f"reward_model.judge.prompt_template names {error} that the row "
                                                    f"(data_source {row.data_source!r}) lacks")
        ids = self.prompt_ids(text)
        limit = self.config.rollout.prompt_length
        if len(ids) > limit:
            return Verdict(failure="too_long", message=f"the judge prompt has {len(ids)} tokens, over "
                                                       f"reward_model.judge.rollout.prompt_length={limit}")
        seed = derive_seed(self.seed, SEED_STREAM_JUDGE, zlib.crc32(row.key.encode()))
        async with gate:
            try:
                output = await asyncio.wait_for(self.client.generate(ids, self.params, seed=seed),
                                                self.config.timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                return Verdict(failure="timeout", message=f"no answer within reward_model.judge.timeout_s="
                                                          f"{self.config.timeout_s:g} s")
            except EngineError as error:
                return Verdict(failure="error", message=str(error))
        return self.verdict_of(self.tokenizer.decode(output.output_ids, skip_special_tokens=True))


def judge_rows(batch: Batch, tokenizer: Any, last_B: torch.Tensor) -> list[JudgeRow]:
    """What the judge is asked about each row of a rollout batch: the prompt (the last user message of
    ``raw_prompt`` when the batch has it, else the decoded prompt), the decoded response up to its last token
    (``last_B``: :func:`~megarl.reward.manager.last_valid_positions` of its scored tokens), the row's ground truth,
    data source and extra info."""
    responses = batch["responses"]
    raw = batch.non_tensors.get("raw_prompt")
    prompts = None if raw is not None else tokenizer.batch_decode(batch["prompts"].tolist(), skip_special_tokens=True)
    extra = batch.non_tensors.get("extra_info")
    uids = batch.non_tensors.get("uid")
    rows = []
    for i in range(len(batch)):
        reward_model = batch["reward_model"][i]
        ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
        key = f"{uids[i] if uids is not None else ''}/{i}"
        rows.append(JudgeRow(prompt=_prompt_text(raw[i]) if raw is not None else prompts[i],
                             response=tokenizer.decode(responses[i, :int(last_B[i]) + 1].tolist(),
                                                       skip_special_tokens=True),
                             ground_truth=ground_truth, data_source=batch["data_source"][i],
                             extra_info=extra[i] if extra is not None else None, key=key))
    return rows


def _prompt_text(raw: Any) -> str:
    """The last user message of a chat prompt (the text as it is when it is not one)."""
    if isinstance(raw, str):
        return raw
    users = [m.get("content", "") for m in raw if isinstance(m, Mapping) and m.get("role") == "user"]
    return str(users[-1]) if users else str(raw)


class JudgeSource:
    """The judge as a source of the reward stage (:mod:`megarl.controller.reward_stage`): its score of each row on
    the response's last token, replacing the scores before it or added to them (``combine``, ``coef``); its columns
    ``judge_verdict``, ``judge_score``, ``judge_error`` (None, or ``"<kind>: <why>"``: the row could not be judged)
    and ``judge_answer`` (and ``score``, the judge's, where it replaces the rule function)."""

    name, when, into = "judge", "rollout", "score"
    unscored_key = "judge_error"
    unscored_note = "by the judge and are left out of the update"

    def __init__(self, judge: Judge, tokenizer: Any) -> None:
        self.judge, self.tokenizer, self.config = judge, tokenizer, judge.config
        self.combine = self.config.combine
        self.coef = self.config.coef if self.combine == "add" else 1.0

    def score(self, batch: Batch, step: Any = None) -> Signal:
        responses_BT = batch["responses"]
        last_B = last_valid_positions(scored_tokens(batch, responses_BT.shape[1]))
        verdicts = self.judge.judge(judge_rows(batch, self.tokenizer, last_B))
        values = torch.zeros(responses_BT.shape, dtype=torch.float32, device=responses_BT.device)
        values[torch.arange(len(verdicts), device=values.device), last_B.clamp(min=0)] = torch.tensor(
            [v.score if v.score is not None else 0.0 for v in verdicts], dtype=values.dtype, device=values.device)
        extra = {"score": [v.score for v in verdicts]} if self.combine == "replace" else {}
        extra["judge_verdict"] = [v.verdict for v in verdicts]
        extra["judge_score"] = [v.score for v in verdicts]
        extra["judge_error"] = [f"{v.failure}: {v.message}" if v.failure else None for v in verdicts]
        extra["judge_answer"] = [v.answer for v in verdicts]
        return Signal(values, coef=self.coef, extra=extra)

    def failure_metrics(self, extra: Mapping[str, list], where: str, validation: bool) -> dict[str, float]:
        """The judge's counts (``judge/*``; ``val-judge/*`` in validation); too many failures stop the run."""
        return judge_step_metrics(extra, self.config.max_failure_share, where,
                                  prefix="val-judge" if validation else "judge")


def judge_step_metrics(extra: Mapping[str, list], max_failure_share: float, where: str,
                       prefix: str = "judge") -> dict[str, float]:
    """The judge's counts over a step's (or validation round's) rows: verdicts, failures of each kind and their
    share, the mean score of the judged rows; :class:`JudgeError` when the failures' share exceeds
    ``max_failure_share`` (``where`` names the step)."""
    errors = extra.get("judge_error")
    if errors is None:
        return {}
    counts = {kind: sum(1 for e in errors if e and e.startswith(kind + ":")) for kind in FAILURES}
    failed = sum(counts.values())
    share = failed / max(len(errors), 1)
    scores = [s for s in extra.get("judge_score", []) if s is not None]
    metrics = {f"{prefix}/num_verdicts": float(len(errors) - failed), f"{prefix}/failure_share": share,
               **{f"{prefix}/num_{kind}": float(count) for kind, count in counts.items()}}
    if scores:
        metrics[f"{prefix}/score_mean"] = sum(scores) / len(scores)
    if share > max_failure_share:
        first = next(e for e in errors if e)
        raise JudgeError(f"{where}: the judge could not score {failed} of {len(errors)} rows "
                         f"({', '.join(f'{k} {c}' for k, c in counts.items() if c)}), over "
                         f"reward_model.judge.max_failure_share={max_failure_share:g}; the first: {first}. Check the "
                         f"judge's engines (their logs), its prompt_template and verdict_parser, or raise "
                         f"reward_model.judge.timeout_s")
    return metrics


def build_judge(cfg, client: EngineClient) -> Judge:
    """The run's judge (``reward_model.judge``), asked through ``client`` (its router's), its tokenizer loaded from
    ``reward_model.judge.model``."""
    from transformers import AutoTokenizer

    config = cfg.reward_model.judge
    judge_tokenizer = AutoTokenizer.from_pretrained(config.model.local_tokenizer_path,
                                                    trust_remote_code=config.model.trust_remote_code)
    return Judge(config, client, judge_tokenizer, seed=cfg.rollout_seed)
