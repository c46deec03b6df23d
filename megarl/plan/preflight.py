"""The pre-flight plan of a run: where every rank and engine runs, what each GPU holds in each phase, and the
weight sync and all-to-all traffic per step.

Pure arithmetic on the config and the model's sizes (no Ray, no GPU, no weights): ``megarl-plan`` prints it
(:meth:`RunPlan.report`), and :func:`preflight` lets the trainer refuse a run before placing anything. Its
parts: the placement (:mod:`megarl.plan.placement`), the memory model (:mod:`megarl.plan.memory`), the weight
sync (:mod:`megarl.plan.weight_sync`), the all-to-all (:mod:`megarl.plan.all_to_all`), gathered as data in
:mod:`megarl.plan.run_plan`; its text (the report, the refusal messages) is :mod:`megarl.plan.report`.

A plan that does not fit (a phase above ``trainer.gpu_memory_gb``, or an SGLang engine left with
KV room for less than one sequence) raises ``ValueError`` naming the settings that would help.
"""

from __future__ import annotations

import os

from megarl.config.schema import RunConfig
from megarl.models.sizes import Architecture, architecture_for
from megarl.plan.all_to_all import plan_all_to_all
from megarl.plan.judge import plan_judge
from megarl.plan.memory import CUDA_CONTEXT_BYTES, GiB, MemoryModel
from megarl.plan.placement import PlacementPlan, placement_for
from megarl.plan.report import format_report, plan_problems
from megarl.plan.run_plan import PlanFigures
from megarl.plan.weight_sync import plan_weight_sync
from megarl.workers.roles import SCORING_ROLES

ARR = "actor_rollout_ref"


class RunPlan(PlanFigures):
    """The pre-flight plan of a run: its figures (:class:`~megarl.plan.run_plan.PlanFigures`), whether it fits, and
    its printable report."""

    def problems(self) -> list[str]:
        """Why the run does not fit (empty when it does), each naming the settings that would help."""
        return plan_problems(self)

    @property
    def fits(self) -> bool:
        return not self.problems()

    def check(self) -> None:
        """Raise ``ValueError`` naming the keys to change when the run does not fit."""
        problems = self.problems()
        if problems:
            raise ValueError("\n".join(problems))

    def report(self) -> str:
        """The printable plan (placement, memory table, phase peaks, weight-sync volume)."""
        return format_report(self)


def plan_run(cfg: RunConfig, *, gpu_memory_gb: float | None = None, check: bool = True) -> RunPlan:
    """The pre-flight plan of ``cfg``; with ``check``, raise ``ValueError`` (naming keys) when it does not fit.

    ``cfg`` comes validated from :func:`megarl.config.load_config`. Refuses first what does not factor: the placement, and the
    model's heads and layers against each layout. ``gpu_memory_gb``: GiB per GPU, default
    ``trainer.gpu_memory_gb``.
    """
    arr = cfg.actor_rollout_ref
    model = architecture_for(arr.model.path, key=f"{ARR}.model.path")
    critic_model = None
    if cfg.critic.enable:
        critic_model = model if cfg.critic.model_path is None else architecture_for(cfg.critic.model_path,
                                                                               key="critic.model_path")
    scorers = {spec.name: architecture_for(spec.section_of(cfg).model.path, key=f"{spec.section}.model.path")
               for spec in SCORING_ROLES if spec.enabled(cfg)}
    placement = placement_for(cfg)
    _check_model_layouts(cfg, model, critic_model, placement, scorers)
    memory = int((gpu_memory_gb if gpu_memory_gb is not None else cfg.trainer.gpu_memory_gb) * GiB)
    sync = plan_weight_sync(cfg, model, placement)
    memory_model = MemoryModel(cfg, model, critic_model, placement, memory, scorers)
    judge = None
    if cfg.reward_model.judge.enable:
        judge = plan_judge(cfg, architecture_for(cfg.reward_model.judge.model.path, key="reward_model.judge.model.path"),
                           memory, CUDA_CONTEXT_BYTES)
    plan = RunPlan(cfg, model, critic_model, placement, memory, memory_model.gpus(sync.actor, sync.engine),
                   sync.plan, memory_model.max_seq, plan_all_to_all(cfg, model, placement), host_memory_bytes(cfg),
                   memory_model.host_optimizer_bytes(), scorers, judge)
    if check:
        plan.check()
    return plan


def host_memory_bytes(cfg: RunConfig) -> int:
    """``trainer.host_memory_gb`` in bytes; unset, this machine's physical memory."""
    if cfg.trainer.host_memory_gb is not None:
        return int(cfg.trainer.host_memory_gb * GiB)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def preflight(cfg: RunConfig) -> RunPlan | None:
    """The trainer's check before placing anything: the plan of a cuda run (raises when it does not fit); on cpu,
    where there is no device memory to plan, the host memory the run's weights and states take at least
    (:func:`cpu_host_bytes`; raises when the machine has less), and None."""
    if cfg.trainer.device == "cpu":
        parts = cpu_host_bytes(cfg)
        available = host_memory_bytes(cfg)
        if sum(parts.values()) > available:
            shown = ", ".join(f"{name} {bytes_ / GiB:.1f}" for name, bytes_ in parts.items() if bytes_)
            raise ValueError(f"this cpu run holds at least {sum(parts.values()) / GiB:.1f} GiB in host memory ({shown} "
                             f"GiB; activations and KV caches come on top), more than the machine's "
                             f"{available / GiB:.1f} GiB (trainer.host_memory_gb): use a smaller model "
                             f"({ARR}.model.path), a lower {ARR}.model.lora_rank, fewer engines or ranks "
                             f"(trainer.n_cpu_ranks), or run on GPUs (trainer.device=cuda)")
        return None
    return plan_run(cfg)


def cpu_host_bytes(cfg: RunConfig) -> dict[str, int]:
    """What a cpu run's processes hold in host memory at least, by part: every data-parallel replica's weights
    (LoRA adapters included), the trainable parameters' fp32 gradients and Adam moments (sharded over the replicas
    by the distributed optimizer), the reference model's and the critic's copies, and each engine's weights in the
    rollout's dtype (megarl's CPU engine holds its model whole)."""
    from megarl.plan.memory import DTYPE_BYTES

    arr = cfg.actor_rollout_ref
    model = architecture_for(arr.model.path, key=f"{ARR}.model.path")
    placement = placement_for(cfg)
    weight, engine = DTYPE_BYTES[arr.model.dtype], DTYPE_BYTES[arr.rollout.dtype]
    spec = arr.model.lora_spec
    params = model.num_params
    adapters = model.lora_param_count(spec) if spec is not None else 0
    trainable = adapters if spec is not None else params
    dp = placement.role("actor").dims.dp
    shards = 1 if arr.actor.optim.use_distributed_optimizer else dp
    parts = {"actor weights": (params + adapters) * dp * weight,
             "actor gradients": trainable * dp * 4,
             "actor Adam moments": trainable * 8 * shards,
             "reference weights": params * dp * weight if cfg.needs_ref and spec is None else 0,
             "engine weights": params * engine * len(placement.engines)}
    if cfg.critic.enable:
        critic = model if cfg.critic.model_path is None else architecture_for(cfg.critic.model_path,
                                                                            key="critic.model_path")
        critic_dp = placement.role("critic").dims.dp
        parts["critic weights, gradients and Adam moments"] = critic.num_params * critic_dp * (weight + 4) + \
            critic.num_params * 8 * (1 if cfg.critic.optim.use_distributed_optimizer else critic_dp)
    return parts


def _check_model_layouts(cfg: RunConfig, model: Architecture, critic_model: Architecture | None,
                         placement: PlacementPlan, scorers: dict[str, Architecture] | None = None) -> None:
    roles = [(f"{ARR}.actor.", placement.role("actor").dims, model)]
    if critic_model is not None:
        roles.append(("critic.", placement.role("critic").dims, critic_model))
    for role, sizes in (scorers or {}).items():
        roles.append((f"{role}.", placement.role(role).dims, sizes))
    for prefix, dims, sizes in roles:
        try:
            dims.check_model(num_layers=sizes.num_layers, num_attention_heads=sizes.heads,
                             num_query_groups=sizes.kv_heads, num_experts=sizes.num_experts or None,
                             expert_ffn=sizes.moe_ffn or None)
        except ValueError as error:
            raise ValueError(f"{prefix}{error}") from error
    engine_tp = placement.engines[0].tp
    if model.heads % engine_tp:
        raise ValueError(f"{ARR}.rollout.tensor_model_parallel_size={engine_tp} does not divide the model's "
                         f"{model.heads} attention heads: choose a divisor of {model.heads}")
    if model.is_moe and model.moe_ffn % engine_tp:
        raise ValueError(f"{ARR}.rollout.tensor_model_parallel_size={engine_tp} does not divide the experts' FFN size "
                         f"{model.moe_ffn} (an engine splits every expert over its TP ranks): choose a divisor of "
                         f"{model.moe_ffn}")
