"""A generative judge (``reward_model.judge.*``): an LLM served by engine servers of its own (SGLang on GPU, megarl's
CPU engine server on CPU) behind an sglang-router of its own, on a resource pool of its own, asked about every
trajectory with a prompt template; a parser reads a number off its answer (:mod:`megarl.reward.verdicts`).

Its score (the verdict mapped from ``score_range`` onto [0, 1]) replaces the rule reward or is added to it
(``combine``). A row the judge could not score (it timed out, answered garbage, the request failed, the prompt was
too long) is counted per step (``judge/*``) and left out of the update, never scored a silent zero; a step in
which more than ``max_failure_share`` of the rows failed stops the run, naming the counts.

verl's generative reward model (``reward_model.model.path`` with an async custom reward function posting to
``reward_router_address``) maps here onto ``reward_model.judge.model.path`` with ``prompt_template`` and
``verdict_parser``: megarl builds the prompt, bounds the concurrency and time of the calls and counts failures.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from megarl.config.common import check_choice, check_positive, check_sampling
from megarl.config.model import ScoringModelConfig
from megarl.config.rollout import EngineConfig
from megarl.reward.verdicts import DEFAULT_TEMPLATE, check_template, load_parser

JUDGE_COMBINE = ("replace", "add")
"""``reward_model.judge.combine``: the judge's score is the score, or is added (times ``coef``) to the rule score."""


@dataclasses.dataclass(kw_only=True)
class JudgeModelSource(ScoringModelConfig):
    """The judge's checkpoint (``reward_model.judge.model.*``): an HF causal LM of a family the engines serve."""

    KEY: ClassVar[str] = "reward_model.judge.model"


@dataclasses.dataclass(kw_only=True)
class JudgeRolloutConfig(EngineConfig):
    """The judge's engines and its sampling (``reward_model.judge.rollout.*``, verl's ``reward_model.rollout``)."""

    KEY: ClassVar[str] = "reward_model.judge.rollout"
    free_cache_engine: bool = False
    """The judge's engines have their pool to themselves: nothing to release between phases."""
    tensor_model_parallel_size: int | None = 1
    """GPUs per judge engine (the ``hf`` engine: 1)."""
    temperature: float = 0.0
    """The judge's sampling temperature; 0: greedy (the same answer for the same trajectory)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """-1 disables top-k."""
    prompt_length: int = 2048
    """The longest judge prompt in tokens (chat template included); a longer one is a failed row, counted."""
    response_length: int = 256
    """The most tokens the judge may answer with."""


@dataclasses.dataclass(kw_only=True)
class JudgeConfig:
    """A generative judge scoring every trajectory (``reward_model.judge.*``; module docstring); off unless
    ``enable``."""

    enable: bool = False
    model: JudgeModelSource = dataclasses.field(default_factory=JudgeModelSource)
    """The judge's model (``path``: an HF directory; its own tokenizer and chat template)."""
    rollout: JudgeRolloutConfig = dataclasses.field(default_factory=JudgeRolloutConfig)
    """Its engines and sampling."""
    pool_nodes: list[int] | None = None
    """The judge's own resource pool, GPUs per node (on cpu: worker slots on this machine), e.g. ``[8]``: split into
    engines of ``rollout.tensor_model_parallel_size``. Needed when ``enable``."""
    prompt_template: str = DEFAULT_TEMPLATE
    """What the judge is asked about each trajectory (:mod:`megarl.reward.verdicts`: ``{prompt}``, ``{response}``,
    ``{ground_truth}``, ``{data_source}``, ``{extra_info[key]}``), sent as one user message through the judge's chat
    template (its tokenizer's; the text as it is when it has none)."""
    verdict_parser: str = "score_tag"
    """How the verdict is read off the answer: ``score_tag`` (``<score>N</score>``), ``last_number``, ``boxed``,
    ``yes_no``, or ``module_or_path:function`` (``fn(text) -> float``, None for no verdict)."""
    score_range: tuple[float, float] = (0.0, 10.0)
    """The verdicts the template asks for, mapped linearly onto [0, 1]; one outside it is garbage (counted)."""
    combine: str = "replace"
    """``replace``: the judge's score is the reward; ``add``: the rule reward plus ``coef`` times it."""
    coef: float = 1.0
    """The judge score's weight with ``combine=add``."""
    max_concurrency: int = 64
    """Judge requests in flight at once (over all its engines)."""
    timeout_s: float = 120.0
    """The longest one row's judging may take (queueing at the engines included); past it the row failed."""
    max_failure_share: float = 0.5
    """A step (or validation round) in which a larger share of the rows could not be judged stops the run; 1.0:
    never stop (the failed rows are still left out of the update)."""

    def __post_init__(self) -> None:
        p = "reward_model.judge"
        check_choice(f"{p}.combine", self.combine, JUDGE_COMBINE)
        check_positive(f"{p}.coef", self.coef)
        check_positive(f"{p}.max_concurrency", self.max_concurrency)
        check_positive(f"{p}.timeout_s", self.timeout_s)
        if not 0 <= self.max_failure_share <= 1:
            raise ValueError(f"{p}.max_failure_share must be in [0, 1] (1: never stop), got {self.max_failure_share}")
        low, high = self.score_range
        if not low < high:
            raise ValueError(f"{p}.score_range={list(self.score_range)} must be [lowest, highest] verdict, lowest < "
                             f"highest")
        r = self.rollout
        check_sampling(JudgeRolloutConfig.KEY, r.temperature, r.top_p, r.top_k)
        check_positive(f"{JudgeRolloutConfig.KEY}.prompt_length", r.prompt_length)
        check_positive(f"{JudgeRolloutConfig.KEY}.response_length", r.response_length)
        check_template(self.prompt_template, f"{p}.prompt_template")
        if not self.enable:
            return
        load_parser(self.verdict_parser, f"{p}.verdict_parser")
        if not self.model.path:
            raise ValueError(f"{p}.enable=true needs {p}.model.path: the judge's HF directory")
        if self.model.init != "pretrained":
            raise ValueError(f"{p}.model.init={self.model.init!r}: the judge is served from its checkpoint; set "
                             f"{p}.model.init=pretrained")
        if not self.pool_nodes or any(n < 1 for n in self.pool_nodes):
            raise ValueError(f"{p}.enable=true needs {p}.pool_nodes, the judge's own pool (GPUs per node, e.g. [8]; "
                             f"on cpu: worker slots, e.g. [1]); got {self.pool_nodes}")
        tp = r.tensor_model_parallel_size or 1
        if r.name == "hf" and tp != 1:
            raise ValueError(f"{JudgeRolloutConfig.KEY}.tensor_model_parallel_size={tp}: the hf engine is one process "
                             f"per engine; set it to 1, or name=sglang")
        if sum(self.pool_nodes) % tp:
            raise ValueError(f"{JudgeRolloutConfig.KEY}.tensor_model_parallel_size={tp} does not divide the "
                             f"{sum(self.pool_nodes)} GPUs of {p}.pool_nodes={self.pool_nodes}")

    @property
    def engine_tp(self) -> int:
        """GPUs per judge engine."""
        return self.rollout.tensor_model_parallel_size or 1
