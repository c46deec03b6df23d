"""The Megatron roles of a run, each declared once: the actor (with its reference), the critic, the teacher and the
reward model.

A :class:`RoleSpec` says what a role is: its config section, its worker class, the step phase it serves, how it is
built (the worker calls, in order, with the sections they take), what it keeps on the host between phases, and, for
the planner, its layout, its model and the settings that size its forward. Building the roles
(:func:`megarl.controller.build.build_roles`), their memory moves (:mod:`megarl.controller.role_memory`), the trainer's
look-up of a role's ranks, the placement (:func:`megarl.plan.placement.placement_for`) and the planner's scoring-model
rows and advice (:mod:`megarl.plan.memory`, :mod:`megarl.plan.report`) iterate :data:`ROLE_SPECS`.

Adding a role is one spec here (and its config section and worker): a second reward model would be a
``RoleSpec(name="reward_model_2", section="reward_model_2", worker=...)`` entry and a section of the same shape as
``reward_model``'s. This module imports the config only: the planner reads it without torch or Megatron; the worker
class is imported where the role is built (:meth:`RoleSpec.worker_class`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from megarl.config.parallel import ParallelDims
from megarl.config.schema import RunConfig

WorkerCall = tuple[str, dict[str, Any]]
"""A worker method's name and its keyword arguments (the run's seed is added to each)."""


@dataclasses.dataclass(frozen=True)
class Forward:
    """What sizes a scoring role's forward on one rank (the planner's working memory and its advice)."""

    rows: int | None
    """Rows per micro-batch (None: the planner assumes 16)."""
    dynamic: bool
    """Micro-batches packed by token count (``budget``) instead of rows."""
    budget: int
    """Tokens per micro-batch with ``dynamic``."""
    keys: tuple[str, str]
    """The settings that lower it: (rows, budget), full config paths."""


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One Megatron role: what it is, how it is built and what it holds (see the module docstring)."""

    name: str
    """The role's name: its worker group's role, its placement row, the prefix of its memory rows."""
    section: str
    """Its config section's path (errors, the plan's lines)."""
    label: str
    """What a person calls it (phase lines, the plan report)."""
    worker: str
    """Its worker class, ``module:Class`` (imported where the role is built)."""
    serves: str
    """The step phase it serves (docs/design.md's step table)."""
    trains: bool
    """Its weights are updated (the actor, the critic); a scoring role (teacher, reward model) is never trained."""
    value_head: bool
    """A scalar head in place of the LM head (the critic, the reward model)."""
    enabled: Callable[[RunConfig], bool]
    parallel: Callable[[RunConfig], ParallelDims]
    """Its Megatron layout (its section's ``parallel``)."""
    calls: Callable[[RunConfig], list[WorkerCall]]
    """The worker calls that build it, in order."""
    offload: Callable[[RunConfig], dict[str, bool]]
    """What it keeps on the host between its phases (the workers' ``offload`` keyword arguments)."""
    forward: Callable[[RunConfig], Forward] | None = None
    """A scoring role's forward (the planner's rows); None for the trained roles, which the planner models apart."""
    logits: bool = False
    """Its forward computes log-probs over the vocabulary (the teacher): logits on its last stage."""

    def section_of(self, cfg: RunConfig) -> Any:
        """Its config section's object."""
        value: Any = cfg
        for part in self.section.split("."):
            value = getattr(value, part)
        return value

    def worker_class(self) -> type:
        module, _, name = self.worker.partition(":")
        return getattr(importlib.import_module(module), name)

    def title(self, cfg: RunConfig, world_size: int) -> str:
        """The phase line of its building."""
        if self.name != "actor":
            return f"placing {self.label} on {world_size} rank(s) and building its model"
        lora = cfg.actor_rollout_ref.model.lora_rank
        reference = (" with LoRA (its reference: the adapters off)" if lora else " and its reference") \
            if cfg.needs_ref else (" with LoRA" if lora else "")
        return f"placing the actor{reference} on {world_size} rank(s) and building the model"


# ------------------------------------------------------------------------------------------------ the four roles
_WORKERS = "megarl.workers.megatron_workers"


def _actor_calls(cfg: RunConfig) -> list[WorkerCall]:
    arr = cfg.actor_rollout_ref
    calls = [("init_model", {"model": arr.model, "actor": arr.actor, "rollout": arr.rollout})]
    if cfg.needs_ref:
        calls.append(("init_ref", {"model": arr.model, "ref": arr.ref}))
    return calls


def _actor_offload(cfg: RunConfig) -> dict[str, bool]:
    arr = cfg.actor_rollout_ref
    return {"params": arr.actor.param_offload, "grads": arr.actor.grad_offload,
            "optimizer": arr.actor.optimizer_offload, "ref_params": cfg.needs_ref and arr.ref.param_offload}


def _critic_offload(cfg: RunConfig) -> dict[str, bool]:
    critic = cfg.critic
    return {"params": critic.param_offload, "grads": critic.grad_offload, "optimizer": critic.optimizer_offload}


def _teacher_forward(cfg: RunConfig) -> Forward:
    teacher = cfg.teacher
    return Forward(teacher.log_prob_micro_batch_size_per_gpu, teacher.log_prob_use_dynamic_bsz,
                   teacher.log_prob_max_token_len_per_gpu,
                   ("teacher.log_prob_micro_batch_size_per_gpu", "teacher.log_prob_max_token_len_per_gpu"))


def _reward_model_forward(name: str) -> Callable[[RunConfig], Forward]:
    """The forward sizing of the reward model whose section is ``name``."""

    def forward(cfg: RunConfig) -> Forward:
        rm = getattr(cfg, name)
        return Forward(rm.micro_batch_size_per_gpu, rm.use_dynamic_bsz, rm.forward_max_token_len_per_gpu,
                       (f"{name}.micro_batch_size_per_gpu", f"{name}.forward_max_token_len_per_gpu"))

    return forward


def _scorer(name: str, label: str, worker: str, serves: str, *, value_head: bool, forward, logits: bool = False,
            keyword: str | None = None) -> RoleSpec:
    """A scoring role: built from its own section (``<name>.enable``, ``.parallel``, ``.param_offload``), passed to its
    worker's ``init_model`` as ``keyword`` (default: the name), never trained."""
    return RoleSpec(name=name, section=name, label=label, worker=f"{_WORKERS}:{worker}", serves=serves,
                    trains=False, value_head=value_head,
                    enabled=lambda cfg: getattr(cfg, name).enable,
                    parallel=lambda cfg: getattr(cfg, name).parallel,
                    calls=lambda cfg: [("init_model", {keyword or name: getattr(cfg, name)})],
                    offload=lambda cfg: {"params": getattr(cfg, name).enable and getattr(cfg, name).param_offload},
                    forward=forward, logits=logits)


ACTOR = RoleSpec(name="actor", section="actor_rollout_ref.actor", label="the actor", worker=f"{_WORKERS}:ActorWorker",
                 serves="update actor", trains=True, value_head=False, enabled=lambda cfg: True,
                 parallel=lambda cfg: cfg.actor_rollout_ref.actor.parallel, calls=_actor_calls, offload=_actor_offload)
CRITIC = RoleSpec(name="critic", section="critic", label="the critic", worker=f"{_WORKERS}:CriticWorker",
                  serves="update critic", trains=True, value_head=True, enabled=lambda cfg: cfg.critic.enable,
                  parallel=lambda cfg: cfg.critic.parallel,
                  calls=lambda cfg: [("init_model", {"model": cfg.actor_rollout_ref.model, "critic": cfg.critic,
                                                     "rollout_n": cfg.actor_rollout_ref.rollout.n})],
                  offload=_critic_offload)
TEACHER = _scorer("teacher", "the teacher", "TeacherWorker", "teacher", value_head=False, forward=_teacher_forward,
                  logits=True)
REWARD_MODEL = _scorer("reward_model", "the reward model", "RewardModelWorker", "reward model", value_head=True,
                       forward=_reward_model_forward("reward_model"))

ROLE_SPECS: tuple[RoleSpec, ...] = (ACTOR, CRITIC, TEACHER, REWARD_MODEL)
"""Every Megatron role, in building order."""
SPEC_OF = {spec.name: spec for spec in ROLE_SPECS}
SCORING_ROLES = tuple(spec for spec in ROLE_SPECS if not spec.trains)
"""The roles that score and are never trained (teacher, reward model)."""


def enabled_roles(cfg: RunConfig) -> list[RoleSpec]:
    """The roles ``cfg`` runs, in building order (the actor always)."""
    return [spec for spec in ROLE_SPECS if spec.enabled(cfg)]
