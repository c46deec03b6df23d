"""``calc_gsm8k_reward``: the model submits its GSM8K answer and is told whether it is right.

Behaviour (as verl's ``Gsm8kTool``):

- ``create(instance_id, ground_truth=...)``: the row's reference answer
  (``tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``) is required.
- ``execute(instance_id, {"answer": ...})``: the answer is written as ``#### <answer>`` and
  scored with the GSM8K scorer (``method``, default ``flexible``). The response text is
  ``"Current parsed answer=<answer> reward=<score>"``; the step reward is 0.0 when the score
  beats the best so far, else ``-penalty`` (default 0.05): resubmitting without improving
  costs a little.
- ``calc_reward``: the best score of the trajectory's submissions (0.0 without any).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarl.reward import gsm8k
from megarl.rollout.tools.base import BaseTool, ToolResult

CONFIG_KEYS = ("type", "method", "penalty")
"""Settings of the tool's ``config``: ``type`` (native), ``method`` (strict/flexible), ``penalty``."""


class Gsm8kTool(BaseTool):
    """Scores submitted GSM8K answers against the row's ground truth."""

    def __init__(self, config: Mapping[str, Any] | None, tool_schema: Mapping[str, Any]) -> None:
        super().__init__(config, tool_schema)
        unknown = sorted(set(self.config) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"unknown Gsm8kTool config keys {unknown}; known: {list(CONFIG_KEYS)}")
        self.method = self.config.get("method", "flexible")
        if self.method not in gsm8k.METHODS:
            raise ValueError(f"Gsm8kTool config method={self.method!r}; use one of {gsm8k.METHODS}")
        self.penalty = float(self.config.get("penalty", 0.05))

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **create_kwargs: Any) -> str:
        """A trajectory with ``ground_truth`` (required: the row's reference answer)."""
        if ground_truth is None:
            raise ValueError(f"tool {self.name!r} needs create_kwargs.ground_truth; set the row's extra_info."
                             f"tools_kwargs.{self.name}.create_kwargs.ground_truth (tools/prepare_gsm8k.py does)")
        instance_id = await super().create(instance_id)
        self._instances[instance_id].update(ground_truth=str(ground_truth), reward=0.0, num_submissions=0)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        """Score ``parameters["answer"]``; see the module docstring for texts and step rewards."""
        state = self._instance(instance_id)
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        submission = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = gsm8k.compute_score(submission, state["ground_truth"], method=self.method, format_score=0.0,
                                     score=1.0)
        step_reward = 0.0 if reward > state["reward"] else -self.penalty
        state["reward"] = max(state["reward"], reward)
        state["num_submissions"] += 1
        return f"Current parsed answer={answer} reward={reward}", step_reward, {"reward": reward}

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The best score among the trajectory's submissions."""
        return float(self._instance(instance_id)["reward"])
