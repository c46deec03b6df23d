"""The printable pre-flight plan and its refusal messages (:mod:`megarl.plan.preflight`'s text side).

The report: the model, the placement (pools, roles and their TP/PP/DP groups, which layers each
pipeline stage holds, each engine's GPUs and the rank that feeds it), the SGLang engine servers'
GPUs as their launch arguments say them (:mod:`megarl.plan.engine_gpus`), then one memory column per
kind of GPU (GiB: the rows, each phase's total, the peak against the GPU), the KV-cache room,
the weight sync (volume per link and time estimate) and, for mixture-of-experts models, the experts'
layout (EP / ETP / expert-DP groups) and the all-to-all volume per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config.megatron import offloaded_fraction
from megarl.plan.engine_gpus import engine_gpus, planned_bundle_gpus
from megarl.plan.memory import ROWS
from megarl.plan.placement import (
    GLOBAL_POOL,
    engine_replica,
    expert_groups,
    megatron_coordinates,
    ranges,
    rank_groups,
)
from megarl.plan.run_plan import PlanFigures
from megarl.workers.roles import SCORING_ROLES

if TYPE_CHECKING:
    from megarl.plan.memory import GpuPlan

GiB = 1 << 30
ARR = "actor_rollout_ref"
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _format_groups(groups: list[list[int]], limit: int = 4) -> str:
    shown = [f"[{ranges(g) if len(g) > 2 and g == list(range(g[0], g[-1] + 1)) else ' '.join(map(str, g))}]"
             for g in groups]
    if len(shown) > limit:
        shown = shown[: limit - 1] + ["...", shown[-1]]
    return " ".join(shown)


def _stage_layers(num_layers: int, dims, stage: int) -> str:
    return ranges(dims.stage_layers(num_layers, stage))


def _role_lines(plan: PlanFigures, role: str, prefix: str, sizes) -> list[str]:
    placement = plan.placement.role(role)
    dims = placement.dims
    pool = plan.placement.pools[placement.pool]
    vpp = f" vpp={dims.vpp}" if dims.vpp and dims.vpp > 1 else ""
    extra = " (the reference runs in these processes)" if role == "actor" and plan.cfg.needs_ref else ""
    lines = [f"{role} ({prefix}.parallel): {placement.world_size} ranks on pool {placement.pool}, "
             f"tp={dims.tp} pp={dims.pp} cp={dims.cp} dp={dims.dp}{vpp}; rank r on GPU r{extra}"]
    for axis in ("tp", "cp", "pp", "dp"):
        size = getattr(dims, axis)
        if size > 1:
            groups = rank_groups(dims, axis)
            lines.append(f"  {axis.upper()} groups ({len(groups)} groups of {size}): {_format_groups(groups)}")
    for stage in range(dims.pp):
        gpus = [r for r in range(dims.world_size) if megatron_coordinates(r, dims)[3] == stage]
        nodes = sorted({pool.node_of(g) for g in gpus})
        first = ["vision tower (whole on each TP rank)", "embedding"] if sizes.family.vision else ["embedding"]
        ends = (first if stage == 0 else []) + (
            ["final norm", "value head" if role == "critic" else "LM head"] if stage == dims.pp - 1 else [])
        node_word = "nodes" if len(nodes) > 1 else "node"
        lines.append(f"  stage {stage}: GPUs {ranges(gpus)} ({node_word} {ranges(nodes)}): layers "
                     f"{_stage_layers(sizes.num_layers, dims, stage)}" + (f" + {', '.join(ends)}" if ends else ""))
    if sizes.is_moe:
        lines.append(f"  experts: ep={dims.ep} etp={dims.expert_tp} expert-dp={dims.expert_dp}: "
                     f"{sizes.num_experts // dims.ep} experts per sparse layer on each GPU, each split over "
                     f"{dims.expert_tp} GPU(s)")
        for axis, size in (("ep", dims.ep), ("etp", dims.expert_tp)):
            if size > 1:
                groups = expert_groups(dims, axis)
                lines.append(f"  {axis.upper()} groups ({len(groups)} groups of {size}): {_format_groups(groups)}")
    return lines


def _placement_lines(plan: PlanFigures) -> list[str]:
    placement = plan.placement
    lines = [f"pool {p.name}: {p.size} GPUs on {len(p.nodes)} node(s), {ranges(range(p.size))}"
             for p in placement.pools.values()]
    lines += _role_lines(plan, "actor", f"{ARR}.actor", plan.model)
    if plan.critic_model is not None:
        lines += _role_lines(plan, "critic", "critic", plan.critic_model)
    for role, sizes in plan.scorers.items():
        lines += _role_lines(plan, role, role, sizes)
    engines = placement.engines
    rollout = plan.cfg.actor_rollout_ref.rollout
    per_group = placement.engine_layout == "per_tp_group"
    layout = ("not TP-matched: tiling the pool" if not engines[0].tp_matched
              else "TP-matched: one on every actor TP group" if per_group
              else "TP-matched: one per actor DP replica, on its first TP group")
    lines.append(f"rollout ({ARR}.rollout): {len(engines)} {rollout.name} engines of TP {engines[0].tp} on pool "
                 f"{engines[0].pool} ({layout})")
    dp = placement.role("actor").dims.dp
    shown = engines if len(engines) <= 8 else list(engines[:6]) + [None, engines[-1]]
    for engine in shown:
        if engine is None:
            lines.append("  ...")
            continue
        replica = engine_replica(engine, dp)
        where = ranges(engine.bundles) if engine.pool == GLOBAL_POOL else f"{engine.pool}:{ranges(engine.bundles)}"
        lines.append(f"  engine {engine.index}: GPUs {where} ({_nodes(engine.nodes)}), "
                     f"fed by actor DP replica {replica}")
    return lines


def _nodes(nodes: tuple[int, ...]) -> str:
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {ranges(nodes)}"


def _engine_gpu_lines(plan: PlanFigures) -> list[str]:
    """Each SGLang engine server's node, GPUs in TP order, ``CUDA_VISIBLE_DEVICES`` and ``base_gpu_id``, from the
    plan alone (:func:`~megarl.plan.engine_gpus.planned_bundle_gpus`: bundle b on GPU b mod n of node b div n)."""
    if plan.cfg.actor_rollout_ref.rollout.name != "sglang":
        return []
    mapped = engine_gpus(plan.placement.engines, planned_bundle_gpus(plan.placement))
    lines = ["Engines (each SGLang server sees exactly its GPUs, in TP order, with base_gpu_id 0)",
             "  GPU ids from the plan: pool bundle b on GPU b mod n of node b div n (n GPUs per node), as ResourcePool",
             "  lays bundles out; a run reads the ids Ray gives each bundle, which may differ"]
    shown = mapped if len(mapped) <= 8 else list(mapped[:6]) + [None, mapped[-1]]
    lines += ["  ..." if gpus is None else f"  {gpus.describe()}" for gpus in shown]
    return lines


def _scorer_labels(spec, cfg) -> dict[str, str]:
    """A scoring role's two memory rows as the report names them."""
    name = spec.label.removeprefix("the ")
    forward = "layer+logits" if spec.logits else "one layer"
    return {f"{spec.name}_weights": f"{name} weights ({_DTYPE_NAMES[spec.section_of(cfg).model.dtype]})",
            f"{spec.name}_forward": f"{name} forward ({forward})"}


def _row_names(plan: PlanFigures) -> dict[str, str]:
    cfg = plan.cfg
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    dims = plan.placement.role("actor").dims
    dtype, engine_dtype = _DTYPE_NAMES[arr.model.dtype], _DTYPE_NAMES[rollout.dtype]
    shards = dims.dp * dims.cp if actor.optim.use_distributed_optimizer else 1
    expert_shards = dims.expert_dp if actor.optim.use_distributed_optimizer else 1
    over = f"/{shards} ranks" + (f", experts /{expert_shards}" if plan.model.is_moe else "")
    host = offloaded_fraction(actor.optim.override_optimizer_config)
    over += f", {host:.0%} of m, v on the host" if host else ""
    recompute = actor.recompute_granularity or "no"
    layout = {True: "packed", False: "padded"}  # micro-batch tokens as the planner counts them
    return {
        "actor_weights": f"actor weights ({dtype})",
        "actor_grads": "actor grads (fp32 buffer)",
        "actor_optimizer": f"actor optimizer (Adam, {over})",
        "ref_weights": f"reference weights ({dtype})",
        "critic_state": "critic weights+grads+optimizer",
        "activations": f"actor activations ({recompute} recompute, {layout[arr.model.use_remove_padding]})",
        "logits": "actor logits (update)",
        "forward": "log-prob forward (layer+logits)",
        "critic_activations": f"critic activations ({layout[cfg.critic.use_remove_padding]})",
        "critic_forward": "critic forward (one layer)",
        **{row: text for spec in SCORING_ROLES for row, text in _scorer_labels(spec, cfg).items()},
        "engine_weights": f"engine weights ({'block FP8 linear, ' if rollout.quantization else ''}{engine_dtype}, "
                          f"TP {plan.placement.engines[0].tp}"
                          + (", all experts" if plan.model.is_moe else "") + ")",
        "kv_cache": "KV cache" + (" (set at engine start)" if rollout.name == "sglang" else " (batch share)"),
        "recurrent_state": "linear-attention state (per sequence of the batch share)",
        "sync_buffers": "weight-sync buffers",
        "cuda_context": "CUDA contexts",
    }


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row))

    return [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def memory_table(plan: PlanFigures) -> list[str]:
    """The per-kind memory table (GiB): rows, phase totals, peak vs the GPU, KV tokens."""
    kinds = plan.gpus
    names = _row_names(plan)
    header = ["GiB per GPU"] + [k.label for k in kinds]
    body = [["GPUs"] + [ranges(k.gpus) if k.pool == GLOBAL_POOL else f"{k.pool}:{ranges(k.gpus)}" for k in kinds]]
    for key in ROWS:
        if any(k.rows.get(key, 0) for k in kinds):
            body.append([names[key]] + [_gib(k.rows[key]) if k.rows.get(key) else "-" for k in kinds])
    phases = list(dict.fromkeys(p for k in kinds for p in k.parts))
    body.append(["phase totals:"] + [""] * len(kinds))
    for phase in phases:
        body.append([f"  {phase}"] + [_gib(k.phases[phase]) if phase in k.phases else "-" for k in kinds])
    body.append(["peak"] + [_gib(k.peak) for k in kinds])
    body.append(["GPU memory (trainer.gpu_memory_gb)"] + [_gib(plan.gpu_memory_bytes)] * len(kinds))
    body.append(["headroom"] + [_gib(plan.gpu_memory_bytes - k.peak) for k in kinds])
    if any(k.kv_tokens is not None for k in kinds):
        body.append(["KV cache tokens per engine"] + [f"{k.kv_tokens:,}" if k.kv_tokens is not None else "-"
                                                        for k in kinds])
    return _table(header, body)


_LINK_NAMES = {"nvlink": "NVLink", "pcie": "PCIe", "infiniband": "InfiniBand", "hbm": "HBM"}


def _sync_lines(plan: PlanFigures) -> list[str]:
    sync, arr = plan.sync, plan.cfg.actor_rollout_ref
    links = sync.links
    engines = plan.placement.engines
    per_buffer = " (rollout.bucket_mb over two buffers)" if sync.transport == "tensor" else ""
    lora = arr.model.lora_spec
    if sync.transport == "adapters":
        lines = [(f"Weight sync per step: the LoRA adapters alone ({ARR}.rollout.lora_sync=adapters, rank {lora.rank} "
                  f"on {', '.join(lora.targets)}), PEFT's layout in {_DTYPE_NAMES[arr.rollout.dtype]}, "
                  f"{sync.model_bytes / (1 << 20):.1f} MiB into each of {len(engines)} engine(s) serving LoRA; "
                  f"requests posted by actor GPUs {ranges(sync.senders)}")]
    else:
        lines = [(f"Weight sync per step: transport {sync.transport} ({ARR}.rollout.weight_transport="
                  f"{arr.rollout.weight_transport}), full HF tensors in "
                  f"{'block FP8 (linear weights) and ' if arr.rollout.quantization else ''}"
                  f"{_DTYPE_NAMES[arr.rollout.dtype]}, "
                  f"{_gib(sync.model_bytes)} GiB into each of {len(engines)} engine(s), {sync.buckets} buckets of at "
                  f"most {sync.bucket_bytes / (1 << 20):.0f} MiB{per_buffer}; requests posted by actor GPUs "
                  f"{ranges(sync.senders)}")]
    for step in sync.steps:
        amount = f"{step.count} x {links.request_ms:g} ms" if step.link == "requests" else \
            f"{_gib(step.nbytes)} GiB over {_LINK_NAMES[links.physical(step.link)]}"
        lines.append(f"  {step.side:<6} {step.what}: {amount}: {step.seconds(links):.2f} s")
    how = ("the engine loads a bucket while the actor builds the next: the slower side "
           f"({max(sync.side_seconds('actor'), sync.side_seconds('engine')):.2f} s) plus one bucket of the other"
           if sync.overlapped else "the steps in turn")
    lines.append(f"weight sync estimate: {sync.seconds:.2f} s per sync ({how})")
    lines.append(f"  assumed (trainer.links.*): NVLink {links.nvlink_gbps:g} GB/s, PCIe {links.pcie_gbps:g} GB/s, "
                 f"InfiniBand {links.infiniband_gbps:g} GB/s, HBM {links.hbm_gbps:g} GB/s per GPU one way, "
                 f"{links.request_ms:g} ms per engine request; GPUs of a node over {_LINK_NAMES[links.intra_node]} "
                 f"(trainer.links.intra_node)")
    if lora is not None and sync.transport != "adapters":
        adapters = plan.model.lora_peft_param_count(lora) * sync.model_bytes / plan.model.num_params  # engine dtype
        lines.append(f"LoRA (rank {lora.rank} on {', '.join(lora.targets)}): {ARR}.rollout.lora_sync=merged, the "
                     f"engines get the merged weights above; the adapters alone (lora_sync=adapters) are "
                     f"{adapters / (1 << 20):.1f} MiB, {100 * adapters / sync.model_bytes:.2f} % of them")
    return lines


def _all_to_all_lines(plan: PlanFigures) -> list[str]:
    a2a, model = plan.all_to_all, plan.model
    if a2a is None:
        return []
    dims = plan.placement.role("actor").dims
    dtype = _DTYPE_NAMES[plan.cfg.actor_rollout_ref.model.dtype]
    link = _LINK_NAMES[a2a.links.physical(a2a.link)]
    where = "within a node" if a2a.link == "intra_node" else "across nodes"
    per_token = (f"Expert all-to-all per step (actor, ep={a2a.ep}, etp={dims.expert_tp}; EP groups {where}): "
                 f"{a2a.bytes_per_token / 1024:.1f} KiB per token and sparse layer (dispatch + combine: 2 x "
                 f"top-{model.topk} x hidden {model.hidden} x {dtype} x {a2a.ep - 1}/{a2a.ep} to other EP ranks)")
    per_step = (f"  per GPU: {a2a.tokens:,} tokens x {a2a.sparse_layers} sparse layers x {a2a.passes} passes (log-prob "
                f"forwards; forward + backward per PPO epoch, + recompute) = {_gib(a2a.step_bytes)} GiB sent (as much "
                f"received) over {link}: {a2a.seconds:.2f} s per step (balanced routing; ETP gathers not counted)")
    return [per_token, per_step]


def _engine_note(plan: PlanFigures) -> list[str]:
    rollout = plan.cfg.actor_rollout_ref.rollout
    if rollout.name != "sglang":
        return ["  hf engines reserve no KV pool: each caches its share of the batch while it generates"]
    starts = sorted({g.in_use_at_engine_start for g in plan.gpus if g.engine})
    held = _gib(starts[0]) if starts[0] == starts[-1] else f"{_gib(starts[0])} to {_gib(starts[-1])}"
    why = ("the trainer builds the actor, reference and critic before the engines, then moves to the host what "
           "their *_offload flags name" if plan.placement.colocated
           else "the engines have their GPUs to themselves")
    return [f"  SGLang sizes its KV pool when it starts: {ARR}.rollout.gpu_memory_utilization="
            f"{rollout.gpu_memory_utilization} x GPU - memory in use then ({held} GiB; {why}) - engine weights"]


def format_report(plan: PlanFigures) -> str:
    """The whole printable plan."""
    cfg, model = plan.cfg, plan.model
    trainer = cfg.trainer
    experts = ""
    if model.is_moe:
        experts = (f"{sum(model.sparse)} sparse layers of {model.num_experts} experts (top-{model.topk}, expert ffn "
                   f"{model.moe_ffn}), {model.num_active_params / 1e9:.2f} B activated per token, ")
    lines = [
        f"megarl-plan: recipe {cfg.recipe}",
        f"model: {model.name}: {model.hf_config.architectures[0]}, {model.num_params / 1e9:.2f} B parameters, "
        f"{model.num_layers} layers, hidden {model.hidden}, {model.heads} heads / {model.kv_heads} KV heads, "
        f"ffn {model.ffn}, {experts}vocabulary {model.vocab}{' (tied)' if model.tied else ''}; from {model.source}",
        f"GPUs: {trainer.nnodes} node(s) x {trainer.n_gpus_per_node}, {_gib(plan.gpu_memory_bytes)} GiB each; "
        f"sequences of {plan.max_seq} tokens",
        "",
        "Placement",
    ]
    lines += [f"  {line}" for line in _placement_lines(plan)]
    engine_lines = _engine_gpu_lines(plan)
    if engine_lines:
        lines += [""] + engine_lines
    lines += ["", "Memory per GPU (one column per kind of GPU; phases are steady-state totals)"]
    lines += [f"  {line}" for line in memory_table(plan)]
    lines += _engine_note(plan)
    if plan.judge is not None:
        lines += [""] + plan.judge.lines()
    lines += [""] + _sync_lines(plan) + [""]
    a2a = _all_to_all_lines(plan)
    if a2a:
        lines += a2a + [""]
    problems = plan_problems(plan)
    worst = plan.worst
    lines.append(f"driver: a step's {plan.trajectories:,} trajectories of up to {plan.max_seq:,} tokens take at least "
                 f"{_gib(plan.batch_bytes_at_least)} GiB (token ids alone) of its {_gib(plan.host_memory_bytes)} GiB")
    if plan.host_optimizer_bytes:
        lines.append(_host_optimizer_line(plan))
    if problems:
        lines.append("DOES NOT FIT:")
        lines += [f"  {p}" for p in problems]
    else:
        lines.append(f"fits: the fullest GPUs ({ranges(worst.gpus)}, {worst.label}) peak at {_gib(worst.peak)} of "
                     f"{_gib(plan.gpu_memory_bytes)} GiB, in the {worst.peak_phase} phase")
    return "\n".join(line.rstrip() for line in lines)


# ------------------------------------------------------------------------------ refusals


def _advice(plan: PlanFigures, row: str, phase: str) -> str | None:
    """Settings that shrink ``row`` in ``phase``."""
    arr = plan.cfg.actor_rollout_ref
    actor, rollout, critic = arr.actor, arr.rollout, plan.cfg.critic
    a, c = f"{ARR}.actor", "critic"
    layout = f"raise {a}.parallel.tp or {a}.parallel.pp (now tp={actor.parallel.tp}, pp={actor.parallel.pp})"
    if plan.model.is_moe:  # more expert-parallel ranks hold fewer experts each
        layout = (f"raise {a}.parallel.ep, {a}.parallel.tp or {a}.parallel.pp (now ep={actor.parallel.ep}, "
                  f"tp={actor.parallel.tp}, pp={actor.parallel.pp})")
    micro = (f"lower {a}.ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu}" if actor.use_dynamic_bsz
             else f"lower {a}.ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu}")
    offload = {"actor_weights": "param_offload", "actor_grads": "grad_offload", "actor_optimizer": "optimizer_offload",
               "ref_weights": "param_offload"}
    if row in offload:
        section, prefix = (arr.ref, f"{ARR}.ref") if row == "ref_weights" else (actor, a)
        if phase == "rollout" and not getattr(section, offload[row]):
            return f"set {prefix}.{offload[row]}=true"
        return layout + (" or add nodes (trainer.nnodes: more DP ranks share it)" if row == "actor_optimizer" else "")
    if row == "critic_state":
        flags = [f"{c}.{k}=true" for k in ("param_offload", "grad_offload", "optimizer_offload")
                 if not getattr(critic, k)]
        if phase not in ("values", "update critic") and flags:
            return "set " + " / ".join(flags)
        return f"raise {c}.parallel.tp or {c}.parallel.pp"
    if row == "activations":
        steps = [micro]
        if actor.recompute_granularity != "full":
            steps.insert(0, f"set {a}.recompute_granularity=full")
        if actor.parallel.tp > 1 and not actor.parallel.sequence_parallel:
            steps.append(f"set {a}.parallel.sequence_parallel=true")
        return ", or ".join(steps)
    if row == "logits":
        return f"{micro}, or raise {a}.parallel.tp (splits the vocabulary)"
    if row == "forward":
        keys = [f"{ARR}.rollout.log_prob_" + ("max_token_len_per_gpu" if rollout.log_prob_use_dynamic_bsz
                                              else "micro_batch_size_per_gpu")]
        if plan.cfg.needs_ref:
            keys.append(f"{ARR}.ref.log_prob_" + ("max_token_len_per_gpu" if arr.ref.log_prob_use_dynamic_bsz
                                                  else "micro_batch_size_per_gpu"))
        return "lower " + " / ".join(keys)
    if row == "critic_activations":
        return "lower " + (f"{c}.ppo_max_token_len_per_gpu" if critic.use_dynamic_bsz
                           else f"{c}.ppo_micro_batch_size_per_gpu")
    if row == "critic_forward":
        return f"lower {c}.forward_micro_batch_size_per_gpu"
    for spec in SCORING_ROLES:
        section = spec.section_of(plan.cfg)
        if row == f"{spec.name}_weights":
            if phase != spec.serves and not section.param_offload:
                return f"set {spec.section}.param_offload=true"
            return f"raise {spec.section}.parallel.tp or {spec.section}.parallel.pp"
        if row == f"{spec.name}_forward":
            sizing = spec.forward(plan.cfg)
            return f"lower {sizing.keys[1] if sizing.dynamic else sizing.keys[0]}"
    if row in ("engine_weights", "kv_cache", "recurrent_state"):
        if phase not in ("rollout", "weight sync"):
            return f"set {ARR}.rollout.free_cache_engine=true"
        if rollout.name == "sglang":
            return f"lower {ARR}.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}"
        if row == "kv_cache":
            return "lower data.train_batch_size (each hf engine caches its whole share of the batch)"
        return f"set {ARR}.rollout.name=sglang (weights sharded over tensor_model_parallel_size)"
    if row == "sync_buffers":
        return f"lower {ARR}.rollout.bucket_mb={rollout.bucket_mb}"
    return None


def overflow_problem(plan: PlanFigures, gpu: GpuPlan) -> str:
    """The message for a kind of GPU whose peak phase exceeds the GPU: the largest parts and what shrinks them."""
    names = _row_names(plan)
    phase = gpu.peak_phase
    over = gpu.peak - plan.gpu_memory_bytes
    parts = sorted(gpu.parts[phase].items(), key=lambda kv: -kv[1])
    advice = []
    for row, size in parts:
        hint = _advice(plan, row, phase)
        if hint:
            advice.append(f"{names[row]} {_gib(size)} GiB: {hint}")
        if len(advice) == 3:
            break
    return (f"GPUs {ranges(gpu.gpus)} ({gpu.label}) need {_gib(gpu.peak)} GiB in the {phase} phase, "
            f"{_gib(over)} GiB more than trainer.gpu_memory_gb={plan.gpu_memory_bytes / GiB:g}. Largest parts: "
            + "; ".join(advice))


def host_problem(plan: PlanFigures) -> str:
    """The message for a step's batch that cannot fit in the driver's memory."""
    return (f"a step's {plan.trajectories:,} trajectories (data.train_batch_size={plan.cfg.data.train_batch_size} x "
            f"{ARR}.rollout.n={plan.cfg.actor_rollout_ref.rollout.n}) of up to {plan.max_seq:,} tokens take at least "
            f"{_gib(plan.batch_bytes_at_least)} GiB on the driver (their token ids alone), more than its "
            f"{_gib(plan.host_memory_bytes)} GiB (trainer.host_memory_gb): lower data.train_batch_size, "
            f"{ARR}.rollout.n or data.max_response_length")


def _host_optimizer_line(plan: PlanFigures) -> str:
    per_node = plan.host_optimizer_bytes
    return (f"host memory: Megatron's hybrid optimizer (optim.override_optimizer_config.optimizer_cpu_offload) keeps "
            f"{_gib(max(per_node.values()))} GiB of optimizer state on the fullest node (nodes "
            f"{', '.join(str(n) for n in sorted(per_node))}; fp32 params, m, v and grads of its share)")


def host_optimizer_problem(plan: PlanFigures) -> str:
    """The message for offloaded optimizer states that do not fit in a node's host memory."""
    return (f"Megatron's hybrid optimizer would keep {_gib(max(plan.host_optimizer_bytes.values()))} GiB of optimizer "
            f"state in a node's host memory, more than its {_gib(plan.host_memory_bytes)} GiB (trainer.host_memory_gb): "
            f"lower <role>.optim.override_optimizer_config.optimizer_offload_fraction or spread the role over more "
            f"data-parallel ranks (trainer.nnodes)")


def kv_problem(plan: PlanFigures, gpu: GpuPlan) -> str:
    """The message for SGLang engines left with KV room for less than one sequence."""
    rollout = plan.cfg.actor_rollout_ref.rollout
    axes = "tp / pp / ep" if plan.model.is_moe else "tp / pp"
    return (f"the SGLang engines on GPUs {ranges(gpu.gpus)} ({gpu.label}) would hold {gpu.kv_tokens or 0:,} tokens of "
            f"KV cache, less than one {plan.max_seq}-token sequence: SGLang gets {ARR}.rollout.gpu_memory_utilization="
            f"{rollout.gpu_memory_utilization} of the GPU minus what is in use when it starts (the trainer's state "
            f"and contexts: {_gib(gpu.in_use_at_engine_start)} GiB; its own weights: "
            f"{_gib(gpu.rows['engine_weights'])} GiB): raise "
            f"{ARR}.rollout.gpu_memory_utilization, raise {ARR}.rollout.tensor_model_parallel_size, or shrink the "
            f"training state per GPU ({ARR}.actor.parallel.{axes})")


def plan_problems(plan: PlanFigures) -> list[str]:
    """Why the run does not fit (empty when it does), each naming the settings that would help."""
    out = []
    worst = plan.worst
    if worst.peak > plan.gpu_memory_bytes:
        out.append(overflow_problem(plan, worst))
    for gpu in plan.gpus:
        if gpu.engine == "sglang" and (gpu.kv_tokens or 0) < plan.max_seq:
            out.append(kv_problem(plan, gpu))
            break
    if plan.batch_bytes_at_least > plan.host_memory_bytes:
        out.append(host_problem(plan))
    if plan.host_optimizer_bytes and max(plan.host_optimizer_bytes.values()) > plan.host_memory_bytes:
        out.append(host_optimizer_problem(plan))
    if plan.judge is not None:
        out += plan.judge.problems()
    return out

