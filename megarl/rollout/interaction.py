"""Interactions: a simulated user that answers the model's turns.

When an assistant turn ends without a tool call and the request has an interaction, the agent
loop asks it for the user's reply::

    should_terminate, reply, score, metadata = await interaction.generate_response(
        request_id, messages, **interaction_kwargs)

``score`` is recorded per turn; if ``should_terminate`` the conversation ends (finish reason
``stop``), otherwise ``reply`` becomes a user message (loss mask 0) and the model answers it.
At the end, ``calculate_score`` gives the value stored in ``reward_scores[interaction_name]``
and ``finalize_interaction`` frees the state.

The interaction-config YAML (``rollout.multi_turn.interaction_config_path``)::

    interaction:
      - name: gsm8k
        class_name: megarl.rollout.interaction.Gsm8kInteraction
        config: {}

A row picks an interaction with ``interaction_kwargs["name"]``; without one, the only
configured interaction is used.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megarl.reward import gsm8k
from megarl.rollout.tools.registry import import_object, read_yaml

InteractionReply = tuple[bool, str, float, dict[str, Any]]
"""``(should_terminate, reply_text, score, metadata)`` of one ``generate_response``."""

ENTRY_KEYS = ("name", "class_name", "config")
"""Keys of one interaction entry."""


class BaseInteraction(abc.ABC):
    """A user simulator with per-instance (per-request) state; subclasses implement ``generate_response``."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.name: str = self.config.get("name", type(self).__name__)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **interaction_kwargs: Any) -> str:
        """Allocate state for one conversation; return its instance id (a new uuid if None)."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {}
        return instance_id

    @abc.abstractmethod
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **interaction_kwargs: Any) -> InteractionReply:
        """The user's reply to the conversation so far (its last message is the model's turn)."""

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The conversation's final score (default 0)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance's state (unknown ids are ignored)."""
        self._instances.pop(instance_id, None)

    def _instance(self, instance_id: str) -> dict[str, Any]:
        if instance_id not in self._instances:
            raise KeyError(f"interaction {self.name!r} has no instance {instance_id!r}; call start_interaction() first")
        return self._instances[instance_id]


class Gsm8kInteraction(BaseInteraction):
    """Tells the model whether its last answer is right; ends the conversation when it is.

    Scores the last assistant message with the GSM8K scorer (``config.method``, default
    ``strict``: the answer must be written ``#### <number>``). A right answer ends the
    conversation; a wrong one gets :attr:`RETRY` and another turn. The final score is the
    best score of the conversation.
    """

    CORRECT = "Your response is correct!"
    RETRY = "Your response is incorrect! You need to reflect on your answer and try again."

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        unknown = sorted(set(self.config) - {"name", "method"})
        if unknown:
            raise ValueError(f"unknown Gsm8kInteraction config keys {unknown}; known: ['name', 'method']")
        self.method = self.config.get("method", "strict")
        if self.method not in gsm8k.METHODS:
            raise ValueError(f"Gsm8kInteraction config method={self.method!r}; use one of {gsm8k.METHODS}")

    async def start_interaction(self, instance_id: str | None = None, ground_truth: Any = None,
                                **interaction_kwargs: Any) -> str:
        """A conversation about a question whose reference answer is ``ground_truth`` (required)."""
        if ground_truth is None:
            raise ValueError(f"interaction {self.name!r} needs interaction_kwargs.ground_truth (set by "
                             f"tools/prepare_gsm8k.py in extra_info.interaction_kwargs)")
        instance_id = await super().start_interaction(instance_id)
        self._instances[instance_id].update(ground_truth=str(ground_truth), best=0.0)
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **interaction_kwargs: Any) -> InteractionReply:
        """Score the last assistant message; ``(correct, reply, score, {})``."""
        state = self._instance(instance_id)
        answer = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), "")
        score = gsm8k.compute_score(answer, state["ground_truth"], method=self.method, format_score=0.0, score=1.0)
        state["best"] = max(state["best"], score)
        correct = score == 1.0
        return correct, self.CORRECT if correct else self.RETRY, score, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The best score of the conversation."""
        return float(self._instance(instance_id)["best"])


def interactions_from_config(interaction_config: Any, source: str = "interaction config") -> dict[str, BaseInteraction]:
    """``{name: interaction}`` from a parsed config ``{"interaction": [{name, class_name, config}, ...]}``."""
    if not isinstance(interaction_config, Mapping) or not isinstance(interaction_config.get("interaction"), list):
        raise ValueError(f"{source}: expected a mapping with an 'interaction' list of {{name, class_name, config}} "
                         f"entries")
    interactions: dict[str, BaseInteraction] = {}
    for position, entry in enumerate(interaction_config["interaction"]):
        where = f"{source} interaction[{position}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: each entry must be a mapping with {list(ENTRY_KEYS)}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; an interaction entry has {list(ENTRY_KEYS)}")
        if "class_name" not in entry:
            raise ValueError(f"{where}: missing 'class_name'")
        cls = import_object(entry["class_name"], where)
        if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
            raise ValueError(f"{where}: {entry['class_name']!r} is not a subclass of "
                             f"megarl.rollout.interaction.BaseInteraction")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ValueError(f"{where}: config must be a mapping, got {type(config).__name__}")
        name = entry.get("name") or cls.__name__
        if name in interactions:
            raise ValueError(f"{where}: interaction name {name!r} is already defined by an earlier entry")
        try:
            interactions[name] = cls({**config, "name": name})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where} ({name}): {cls.__name__} refused its config: {exc}") from exc
    return interactions


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """``{name: interaction}`` from the interaction-config YAML at ``path``."""
    return interactions_from_config(read_yaml(path, "interaction config"), source=str(path))
