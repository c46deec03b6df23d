"""Checks that span components of a :class:`RunConfig`; each section checks itself in ``__post_init__``.

Every error names the full key to change and what to change it to. The rules:

1. World size: each Megatron layout (the actor's, which the reference shares; the critic's when enabled)
   has ``tp × pp × cp`` dividing the world (``trainer.nnodes × trainer.n_gpus_per_node`` on
   cuda, ``trainer.n_cpu_ranks`` on cpu), and an explicit ``dp`` equal to what is left.
   Multi-node runs need cuda; context and sequence parallelism run on both (the critic refuses sequence
   parallelism: its replicated value head reads whole sequences).
2. Batch divisibility: ``data.train_batch_size × rollout.n`` splits over the world; the
   train batch is a whole number of mini-batches; each mini-batch's trajectories split over
   the role's ``dp``; each rank's share is a whole number of micro-batches (fixed-size
   micro-batches), and with interleaved pipelines the micro-batch count is a multiple of ``pp``.
3. Engines: ``sglang`` needs cuda; its TP (default: the actor's TP) divides the world and
   fits in one node; the ``hf`` engine is not sharded (``tensor_model_parallel_size`` null);
   prompt/response widths agree with ``data.*``; disaggregated engines (``hybrid_engine=false``)
   need their pool (``rollout.pool_nodes``) and only they may have one.
4. Memory flags: offloading needs cuda. ``free_cache_engine`` and CUDA graphs (``enforce_eager=false``) go
   together on SGLang: its memory saver keeps the virtual addresses of what it releases and releases and
   resumes the graphs under their own ``cuda_graph`` tag, so captured graphs survive release/resume; the
   ``hf`` engine never captures graphs (``enforce_eager=false`` is ignored there, with a warning).
5. Algorithm ↔ roles: ``gae`` needs ``critic.enable`` and a critic is only trained for
   ``gae``; ``trainer.critic_warmup`` needs the critic; multi-turn rollouts need
   ``data.return_raw_chat``.
6. Asynchronous training (``trainer.mode`` other than ``sync``): engines on their own resources
   (``hybrid_engine=false``), single-turn rollouts, no critic warm-up; ``one_step_off`` fixes staleness 1 without
   partial rollouts; partial rollouts sync LoRA merged (a held request keeps the adapter it started with).
7. Megatron passthrough (:mod:`megarl.config.megatron`): each ``<role>.megatron.override_transformer_config`` and
   ``<role>.optim.override_optimizer_config`` key is a field of Megatron's dataclass that megarl does not set
   itself; GPU-only fusions and the hybrid CPU optimizer need cuda.
"""

from __future__ import annotations

import logging

from megarl.algo.advantages import GROUP_ESTIMATORS, uses_critic
from megarl.config.actor import ActorConfig
from megarl.config.critic import CriticConfig
from megarl.config.megatron import check_optimizer_overrides, check_transformer_overrides
from megarl.config.parallel import ParallelDims
from megarl.config.rollout import resolve_transport
from megarl.config.schema import RunConfig

logger = logging.getLogger(__name__)

ARR = "actor_rollout_ref"


def validate(cfg: RunConfig, *, generation_only: bool = False) -> None:
    """Raise ``ValueError`` naming the key to change when the sections of ``cfg`` do not fit together
    (``generation_only``: the rules of what generation uses, 1, 3 and 4)."""
    if generation_only:
        _check_world(cfg)
        _check_engines(cfg)
        _check_memory_flags(cfg)
        return
    _check_algorithm(cfg)  # first: it decides which roles exist
    _check_world(cfg)
    _check_batches(cfg)
    _check_engines(cfg)
    _check_memory_flags(cfg)
    _check_async(cfg)
    _check_group_samples(cfg)
    _check_megatron(cfg)


def _check_megatron(cfg: RunConfig) -> None:
    roles = [(f"{ARR}.actor", cfg.actor_rollout_ref.actor)] + ([("critic", cfg.critic)] if cfg.critic.enable else [])
    for prefix, role in roles:
        check_transformer_overrides(prefix, role.megatron.override_transformer_config, device=cfg.trainer.device)
        check_optimizer_overrides(prefix, role.optim.override_optimizer_config, device=cfg.trainer.device,
                                  optimizer_offload=role.optimizer_offload)
    for prefix, section in (("teacher", cfg.teacher), ("reward_model", cfg.reward_model)):  # scoring, never trained
        if section.enable:
            check_transformer_overrides(prefix, section.megatron.override_transformer_config,
                                        device=cfg.trainer.device)


def _world_keys(cfg: RunConfig) -> str:
    trainer = cfg.trainer
    if trainer.device == "cpu":
        return f"trainer.n_cpu_ranks={trainer.n_cpu_ranks}"
    return f"trainer.nnodes × trainer.n_gpus_per_node = {trainer.nnodes} × {trainer.n_gpus_per_node}"


def _roles(cfg: RunConfig) -> list[tuple[str, ParallelDims]]:
    """(key prefix, layout) of each Megatron role the run builds."""
    actor = cfg.actor_rollout_ref.actor
    roles = [(f"{ARR}.actor.parallel", actor.parallel)]  # the reference shares the actor's layout
    if cfg.critic.enable:
        roles.append(("critic.parallel", cfg.critic.parallel))
    if cfg.teacher.enable:
        roles.append(("teacher.parallel", cfg.teacher.parallel))
    if cfg.reward_model.enable:
        roles.append(("reward_model.parallel", cfg.reward_model.parallel))
    return roles


def data_parallel_size(cfg: RunConfig, parallel: ParallelDims) -> int:
    """``dp`` of a role: the world size over ``tp × pp × cp`` (call after :func:`validate`)."""
    return cfg.trainer.world_size // (parallel.tp * parallel.pp * parallel.cp)


def _check_world(cfg: RunConfig) -> None:
    trainer = cfg.trainer
    world = trainer.world_size
    if trainer.device == "cpu" and trainer.nnodes != 1:
        raise ValueError(f"trainer.nnodes={trainer.nnodes} with trainer.device=cpu: CPU runs use one machine "
                         f"(trainer.n_cpu_ranks processes); set trainer.nnodes=1 or trainer.device=cuda")
    for prefix, parallel in _roles(cfg):
        model_parallel = parallel.tp * parallel.pp * parallel.cp
        if prefix == "critic.parallel" and parallel.sequence_parallel:
            raise ValueError("critic.parallel.sequence_parallel=true: the critic's value head reads the full sequence "
                             "on every TP rank; set critic.parallel.sequence_parallel=false")
        if world % model_parallel != 0:
            raise ValueError(
                f"{prefix}.tp × {prefix}.pp × {prefix}.cp = {parallel.tp} × {parallel.pp} × {parallel.cp} = "
                f"{model_parallel} does not divide the world size {world} ({_world_keys(cfg)}): change "
                f"{prefix}.tp/pp/cp so that their product divides {world}, or the number of ranks")
        dp = world // model_parallel
        if parallel.dp is not None and parallel.dp != dp:
            raise ValueError(
                f"{prefix}.dp={parallel.dp} but tp × pp × cp = {model_parallel} on {world} ranks "
                f"({_world_keys(cfg)}) leaves dp={dp}: set {prefix}.dp={dp} or null")
        stage = parallel.tp * parallel.cp * dp
        if stage % (parallel.expert_tp * parallel.ep) != 0:
            raise ValueError(
                f"{prefix}.etp × {prefix}.ep = {parallel.expert_tp} × {parallel.ep} does not divide the {stage} ranks "
                f"of a pipeline stage (tp × cp × dp on {world} ranks, {_world_keys(cfg)}): choose {prefix}.ep and "
                f"{prefix}.etp (null = tp) with etp × ep dividing {stage}")


def _check_role_batches(cfg: RunConfig, prefix: str, role: ActorConfig | CriticConfig) -> None:
    n = cfg.actor_rollout_ref.rollout.n
    train_batch_size = cfg.data.train_batch_size
    mini = role.ppo_mini_batch_size
    if train_batch_size % mini != 0:
        raise ValueError(f"{prefix}.ppo_mini_batch_size={mini} does not divide data.train_batch_size="
                         f"{train_batch_size}: choose a divisor of {train_batch_size} (each optimizer step takes "
                         f"one mini-batch of prompts)")
    dp = data_parallel_size(cfg, role.parallel)
    trajectories = mini * n
    if trajectories % dp != 0:
        raise ValueError(
            f"{prefix}.ppo_mini_batch_size × {ARR}.rollout.n = {mini} × {n} = {trajectories} trajectories do "
            f"not split over the role's dp={dp} data-parallel ranks: make {prefix}.ppo_mini_batch_size × "
            f"rollout.n a multiple of {dp}")
    per_rank = trajectories // dp
    if role.use_dynamic_bsz:
        return
    micro = role.ppo_micro_batch_size_per_gpu
    if per_rank % micro != 0:
        raise ValueError(
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro} does not divide the {per_rank} trajectories each "
            f"rank gets per mini-batch ({prefix}.ppo_mini_batch_size × rollout.n / dp = {mini} × {n} / {dp}): "
            f"choose a divisor of {per_rank}")
    num_micro_batches = per_rank // micro
    parallel = role.parallel
    if parallel.vpp is not None and parallel.vpp > 1 and num_micro_batches % parallel.pp != 0:
        raise ValueError(
            f"{prefix}.parallel.vpp={parallel.vpp} (interleaved pipeline) needs the micro-batches per mini-batch "
            f"({num_micro_batches}) to be a multiple of {prefix}.parallel.pp={parallel.pp}: change "
            f"{prefix}.ppo_micro_batch_size_per_gpu or {prefix}.ppo_mini_batch_size, or set "
            f"{prefix}.parallel.vpp=null")


def _check_batches(cfg: RunConfig) -> None:
    n = cfg.actor_rollout_ref.rollout.n
    world = cfg.trainer.world_size
    total = cfg.data.train_batch_size * n
    if total % world != 0:
        raise ValueError(
            f"data.train_batch_size × {ARR}.rollout.n = {cfg.data.train_batch_size} × {n} = {total} trajectories "
            f"do not split evenly over the {world} ranks ({_world_keys(cfg)}): make data.train_batch_size × "
            f"rollout.n a multiple of {world}")
    _check_role_batches(cfg, f"{ARR}.actor", cfg.actor_rollout_ref.actor)
    if cfg.critic.enable:
        _check_role_batches(cfg, "critic", cfg.critic)


def _check_async(cfg: RunConfig) -> None:
    mode, settings = cfg.trainer.mode, cfg.async_training
    if mode == "sync":
        return
    if cfg.actor_rollout_ref.hybrid_engine:
        raise ValueError(f"trainer.mode={mode} generates while the actor trains: the engines need their own "
                         f"resources; set {ARR}.hybrid_engine=false and {ARR}.rollout.pool_nodes")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        raise ValueError(f"trainer.mode={mode} runs single-turn rollouts; set {ARR}.rollout.multi_turn.enable=false "
                         f"or trainer.mode=sync")
    if cfg.trainer.critic_warmup > 0:
        raise ValueError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} with trainer.mode={mode}: warm-up steps "
                         f"do not update the policy, so its version would not advance; set trainer.critic_warmup=0")
    if settings.partial_rollout and cfg.lora_syncs_adapters:
        raise ValueError(f"async_training.partial_rollout=true holds requests across a weight sync, but with "
                         f"{ARR}.rollout.lora_sync=adapters a held request keeps the adapter it started with; set "
                         f"{ARR}.rollout.lora_sync=merged (or async_training.partial_rollout=false)")
    if mode == "one_step_off" and (settings.max_staleness != 1 or settings.partial_rollout):
        raise ValueError("trainer.mode=one_step_off trains each batch one version after it was generated, whole: it "
                         "needs async_training.max_staleness=1 and async_training.partial_rollout=false (other "
                         "bounds: trainer.mode=fully_async)")


def _check_engines(cfg: RunConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    trainer = cfg.trainer
    prefix = f"{ARR}.rollout"
    if rollout.name == "hf":
        if rollout.tensor_model_parallel_size is not None:
            raise ValueError(f"{prefix}.tensor_model_parallel_size={rollout.tensor_model_parallel_size} with "
                             f"{prefix}.name=hf: the hf engine runs one unsharded model per actor data-parallel "
                             f"replica; set {prefix}.tensor_model_parallel_size=null or {prefix}.name=sglang")
    else:
        if trainer.device != "cuda":
            raise ValueError(f"{prefix}.name={rollout.name} needs trainer.device=cuda; on cpu set {prefix}.name=hf")
        engine_tp = cfg.engine_tp
        if trainer.world_size % engine_tp != 0:
            raise ValueError(f"{prefix}.tensor_model_parallel_size={engine_tp} does not divide the world size "
                             f"{trainer.world_size} ({_world_keys(cfg)}): choose a divisor of it")
        if engine_tp > trainer.n_gpus_per_node and engine_tp % trainer.n_gpus_per_node:
            raise ValueError(f"{prefix}.tensor_model_parallel_size={engine_tp} exceeds trainer.n_gpus_per_node="
                             f"{trainer.n_gpus_per_node} without being a multiple of it: an engine serves within "
                             f"one node or on whole nodes (SGLang's --nnodes); use a divisor or a multiple of "
                             f"{trainer.n_gpus_per_node}")
    hybrid = cfg.actor_rollout_ref.hybrid_engine
    if not hybrid and rollout.pool_nodes is None:
        raise ValueError(f"{ARR}.hybrid_engine=false puts the engines on their own pool: give its size in "
                         f"{prefix}.pool_nodes (GPUs per node, e.g. [8]), or set {ARR}.hybrid_engine=true")
    # tensor needs colocated engines; distributed on GPUs needs them on GPUs of their own
    resolve_transport(rollout.weight_transport, colocated=hybrid, device=cfg.trainer.device)
    if hybrid and rollout.pool_nodes is not None:
        raise ValueError(f"{prefix}.pool_nodes={rollout.pool_nodes} is for disaggregated engines: set "
                         f"{ARR}.hybrid_engine=false, or {prefix}.pool_nodes=null to colocate")
    if rollout.pool_nodes is not None and rollout.name != "hf":
        engine_tp = cfg.engine_tp
        nodes = list(rollout.pool_nodes)
        spans = engine_tp > max(nodes)
        if (spans and (len(set(nodes)) > 1 or engine_tp % nodes[0] or len(nodes) * nodes[0] % engine_tp)) or \
                (not spans and any(n % engine_tp for n in nodes)):
            raise ValueError(f"{prefix}.tensor_model_parallel_size={engine_tp} neither divides the GPUs per node of "
                             f"{prefix}.pool_nodes={rollout.pool_nodes} nor spans whole nodes of equal size: choose "
                             f"a divisor of the GPUs per node, or a multiple of them on equal nodes")
    data = cfg.data
    if rollout.prompt_length is not None and rollout.prompt_length < data.max_prompt_length:
        raise ValueError(f"{prefix}.prompt_length={rollout.prompt_length} is shorter than data.max_prompt_length="
                         f"{data.max_prompt_length}: prompts would not fit; raise it or leave it null")
    if rollout.response_length is not None and rollout.response_length != data.max_response_length:
        raise ValueError(f"{prefix}.response_length={rollout.response_length} differs from "
                         f"data.max_response_length={data.max_response_length}: set one value (leave "
                         f"{prefix}.response_length null to use data.max_response_length)")
    prompt_length, _ = cfg.rollout_widths()
    if rollout.max_model_len is not None and rollout.max_model_len <= prompt_length:
        raise ValueError(f"{prefix}.max_model_len={rollout.max_model_len} leaves no room for a response after "
                         f"the prompt width {prompt_length}: raise it or leave it null")


def _check_memory_flags(cfg: RunConfig) -> None:
    arr = cfg.actor_rollout_ref
    flags = {f"{ARR}.actor.{name}": getattr(arr.actor, name)
             for name in ("param_offload", "grad_offload", "optimizer_offload")}
    flags[f"{ARR}.ref.param_offload"] = arr.ref.param_offload
    flags.update({f"critic.{name}": getattr(cfg.critic, name)
                  for name in ("param_offload", "grad_offload", "optimizer_offload")})
    flags["teacher.param_offload"] = cfg.teacher.param_offload
    flags["reward_model.param_offload"] = cfg.reward_model.param_offload
    rollout = arr.rollout
    if rollout.name == "hf" and not rollout.enforce_eager:
        logger.warning("%s.rollout.enforce_eager=False is ignored by the hf engine: it never captures CUDA graphs",
                       ARR)
    if cfg.trainer.device == "cpu":
        for key, value in flags.items():
            if value:
                raise ValueError(f"{key}=True needs trainer.device=cuda (offloading moves GPU memory to the "
                                 f"host; on cpu everything is already there): set {key}=False")
        return
    if not arr.hybrid_engine and rollout.free_cache_engine:
        logger.warning("%s.rollout.free_cache_engine is ignored without %s.hybrid_engine: separate engines keep "
                       "their memory", ARR, ARR)


def _check_algorithm(cfg: RunConfig) -> None:
    estimator = cfg.algorithm.adv_estimator
    needs_critic = uses_critic(estimator)
    if needs_critic and not cfg.critic.enable:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs a critic: set critic.enable=True, or choose a "
                         f"critic-free estimator such as algorithm.adv_estimator=grpo")
    if cfg.critic.enable and not needs_critic:
        raise ValueError(f"critic.enable=True but algorithm.adv_estimator={estimator} does not use values: set "
                         f"critic.enable=False, or algorithm.adv_estimator=gae")
    if cfg.trainer.critic_warmup > 0 and not cfg.critic.enable:
        raise ValueError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic (critic.enable=True); "
                         f"set trainer.critic_warmup=0")
    if cfg.reward_model.enable and cfg.algorithm.filter_groups.enable:
        raise ValueError("algorithm.filter_groups.enable=true keeps or drops groups by their rule rewards while they "
                         "generate, but reward_model.enable=true scores them later, in the training step: set "
                         "algorithm.filter_groups.enable=false (or reward_model.enable=false)")
    overlong = cfg.reward_model.overlong_buffer
    if overlong.enable and overlong.len > cfg.data.max_response_length:
        raise ValueError(f"reward_model.overlong_buffer.len={overlong.len} exceeds data.max_response_length="
                         f"{cfg.data.max_response_length}: the buffer is the last len tokens of a response; "
                         f"choose at most {cfg.data.max_response_length}")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable and not cfg.data.apply_chat_template:
        raise ValueError(f"{ARR}.rollout.multi_turn.enable=True renders each turn with the chat template: set "
                         f"data.apply_chat_template=True (plain-text prompts are single-turn)")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable and not cfg.data.return_raw_chat:
        raise ValueError(f"{ARR}.rollout.multi_turn.enable=True needs the raw chat messages: set "
                         f"data.return_raw_chat=True")
    actor = cfg.actor_rollout_ref.actor
    if actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        logger.warning("both %s.actor.use_kl_loss and algorithm.use_kl_in_reward are on: the KL is penalised twice",
                       ARR)
    if actor.use_kl_loss and actor.kl_loss_coef == 0:
        raise ValueError(f"{ARR}.actor.use_kl_loss=True with {ARR}.actor.kl_loss_coef=0 computes the reference for "
                         f"nothing: set a positive kl_loss_coef or use_kl_loss=False")
    if actor.router_replay.enabled and cfg.actor_rollout_ref.rollout.multi_turn.enable:
        raise ValueError(f"{ARR}.actor.router_replay.mode={actor.router_replay.mode} needs single-turn rollouts: "
                         f"multi-turn rollouts ({ARR}.rollout.multi_turn.enable) do not carry the engines' routed "
                         f"experts yet; set router_replay.mode=off")
    if cfg.actor_rollout_ref.rollout.quantization and cfg.actor_rollout_ref.model.lora_rank:
        raise ValueError(f"{ARR}.rollout.quantization={cfg.actor_rollout_ref.rollout.quantization} with LoRA "
                         f"({ARR}.model.lora_rank) is not supported yet: set {ARR}.rollout.quantization=null")
    correction = cfg.algorithm.rollout_correction
    if correction.enabled and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        raise ValueError(f"algorithm.rollout_correction compares the engines' log-probs with the trainer's: set "
                         f"{ARR}.rollout.calculate_log_probs=True, or turn rollout_is and rollout_rs off")
    if correction.rollout_is is not None and actor.tis_cap is not None:
        raise ValueError(f"{ARR}.actor.tis_cap={actor.tis_cap} and algorithm.rollout_correction.rollout_is="
                         f"{correction.rollout_is} both weigh the loss by the same ratio: keep one (rollout_is, with "
                         f"rollout_is_threshold, is verl's current name)")
    if actor.tis_cap is not None and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        raise ValueError(f"{ARR}.actor.tis_cap={actor.tis_cap} needs the engines' log-probs: set "
                         f"{ARR}.rollout.calculate_log_probs=True or {ARR}.actor.tis_cap=null")


def _check_group_samples(cfg: RunConfig) -> None:
    """Group estimators (GRPO and relatives) learn from the differences between a prompt's samples: one sample,
    or greedy samples (all alike), give every advantage 0, so the run would train on nothing."""
    estimator, rollout = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout
    greedy = rollout.temperature == 0 or not rollout.do_sample
    if estimator in GROUP_ESTIMATORS:
        if rollout.n < 2:
            raise ValueError(f"algorithm.adv_estimator={estimator} compares the samples of each prompt, but "
                             f"{ARR}.rollout.n={rollout.n}: every advantage would be 0; set {ARR}.rollout.n >= 2 "
                             f"(GRPO commonly uses 4-16)")
        if greedy:
            setting = "temperature=0" if rollout.temperature == 0 else "do_sample=False"
            raise ValueError(f"algorithm.adv_estimator={estimator} compares the samples of each prompt, but "
                             f"{ARR}.rollout.{setting} samples greedily: the {rollout.n} samples are alike and "
                             f"every advantage would be 0; sample (temperature > 0, do_sample=True)")
    elif greedy and rollout.n > 1:
        logger.warning("%s.rollout.n=%d with greedy sampling generates the same response %d times per prompt; "
                       "set %s.rollout.n=1 or sample (temperature > 0)", ARR, rollout.n, rollout.n, ARR)
