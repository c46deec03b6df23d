"""The pre-flight plan: where every rank and engine runs, and what each GPU holds in each phase.

Its text (the report ``megarl-plan`` prints, the refusal messages) is in
:mod:`megarl.controller.preflight_report`, which this module imports (never the other way).

Pure arithmetic on the config and the model's sizes (no Ray, no GPU, no weights): ``megarl-plan``
prints it, and :func:`preflight` lets the trainer refuse a run before placing anything.

What one GPU holds (bytes; ``n`` = parameters of the role on that rank, counted from the family's
weight rules: TP-split tensors divided by ``tp``, the vocabulary padded as megarl pads it, the
embedding on the first pipeline stage, the final norm and LM head on the last; a tied embedding is
copied onto the last stage when ``pp > 1``, as Megatron does):

- **weights**: ``n × bytes(model.dtype)`` (Megatron DDP's parameter buffer).
- **grads**: ``4 n`` (Megatron DDP's gradient buffer with ``grad_reduce_in_fp32``).
- **optimizer** (Adam): fp32 main weights (16-bit models only) + ``m`` + ``v``: ``12 n`` (``8 n`` for
  fp32 models), divided by ``dp × cp`` with the distributed optimizer; a mixture-of-experts model's expert
  parameters by the expert-data-parallel size ``tp × cp × dp / (etp × ep)`` instead (Megatron shards each
  kind over its own data-parallel group). The main weights are allocated when the optimizer is built, ``m``
  and ``v`` at its first step.
- **reference**: ``n × bytes(model.dtype)`` in the actor's processes when a KL term is on.
- **critic**: weights, grads and optimizer as above for its own layout (value head instead of LM head).
- **activations** of the update (Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", Table 2; 16-bit; ``T`` tokens of a micro-batch, ``s`` sequence, ``h``
  hidden, ``a`` heads, ``t`` TP; with CP, ``T`` and ``s`` per CP rank: divided by ``cp``), per layer:
  no recompute ``T h (10 + 24/t) + 5 a s T / t`` (``34 T h / t + 5 a s T / t`` with sequence
  parallelism), selective ``T h (10 + 24/t)`` (``34 T h / t``), full ``2 T h`` (``2 T h / t``) per
  block of ``recompute_num_layers`` layers, plus one block rematerialised at the selective size
  during its backward. Times the model chunks in flight on the stage under 1F1B: ``pp − r``
  micro-batches of ``L/pp`` layers on stage ``r``; interleaved, ``2(pp − r − 1) + (vpp − 1) pp + 1``
  chunks of ``L/(pp vpp)`` layers (Megatron's warm-up count + 1), at most all micro-batches.
  The scores term ``5 a s T / t`` is left out (:data:`FUSED_ATTENTION`): TransformerEngine's fused
  attention stores none, so without recompute a layer keeps what selective recompute keeps.
  A mixture-of-experts layer (:func:`moe_layer_activation_bytes`, an estimate for balanced routing) keeps
  instead of the dense MLP's ``16 T h / t``: the router's fp32 scores (``8 E`` bytes per token) and, for each
  of the ``k`` copies of a token routed to an expert, the expert's input, its gate/up output and down input
  (``6 f_e / etp``) and output; the rank holding ``T_r`` tokens (``T / t`` with sequence parallelism) computes
  ``T_r × k × etp`` copies (its expert-tensor group's tokens). Plus, once per stage, the all-to-all's send and
  receive buffers of the permuted tokens (``2 × T_r k h × 2`` bytes) while a layer dispatches.
- **micro-batch tokens** ``T`` (the worst case: every row ``S = P + R`` tokens; as
  :func:`megarl.workers.micro.plan` groups rows and :mod:`megarl.parallel.pipeline` lays them out; ``(seg, total)``
  = :func:`~megarl.parallel.packing.pack_alignment` of the role's cp, tp and sequence parallelism):
  packed (``<role>.use_remove_padding``, THD) ``round_up(rows × round_up(S, seg), total)``, with a token budget
  ``round_up(max(budget × cp, round_up(S, seg)), total)`` (the budget is per GPU, a pack spans ``cp`` GPUs; a
  longer row goes alone), ``s = round_up(S, seg)``; padded ``rows × round_up(S, total)``, with a budget
  ``max(budget × cp, rows × round_up(S, total))`` for ``rows = max(budget × cp // S, 1)``, ``s = round_up(S, total)``.
  Under PP every micro-batch of a call takes the largest one's shape: this worst case.
- **logits** (last stage): ``T × V_padded/t × 14`` bytes: the bf16 logits (2) and, inside
  ``megarl.parallel.logprob``, the fp32 scaled logits (4), their exponentials (4) and ``exp·z`` (4).
- **engine weights**: the model in ``rollout.dtype`` sharded over the engine's TP (vocabulary padded
  as SGLang pads it; KV heads replicated when engine TP exceeds them). A mixture-of-experts model: every
  engine GPU holds every expert, its FFN split over the engine's TP (SGLang without ``--ep-size``; megarl
  starts its engines without expert parallelism).
- **KV cache**: SGLang sizes its pool when it starts: ``gpu_memory_utilization × GPU − memory in
  use on the GPU`` (its own weights and context, and whatever the colocated trainer already holds:
  the trainer starts the engines after building the actor, reference and critic). One token takes
  ``2 × layers × kv_heads/tp × head_dim × bytes`` per engine GPU. The hf engine reserves nothing:
  its cache grows to its share of the batch, ``rows × (P + R)`` tokens.
- **weight-sync buffers** (during the sync; :mod:`megarl.sync`): on every actor rank the exporter's bucket
  buffers in the engine dtype (``tensor``: two, each as large as the largest bucket it takes in turn, buckets
  of ``rollout.bucket_mb / 2``; ``distributed``: one, buckets of ``rollout.bucket_mb``; a tensor larger than
  a bucket travels alone and sizes its buffer; a stage whose pipeline group hosts no engine rank holds only
  its own buckets) and the largest TP-gathered parameter of the stage (model dtype; vocabulary rows gather
  in place). ``distributed`` engines receive each bucket into a buffer of its size.
- **CUDA contexts**: :data:`CUDA_CONTEXT_BYTES` per process on the GPU (actor, critic, engine rank).

Phases (colocated; what the trainer holds on the GPU in each, steady state):

- ``rollout``: the engine (weights + KV) + the training state that is not offloaded
  (``<role>.param_offload`` / ``grad_offload`` / ``optimizer_offload``; the reference's weights with
  ``ref.param_offload``, as ``ActorWorker.offload`` does).
- ``log-probs``: everything onloaded + the forward's logits and one layer's activations; the engine
  too unless ``free_cache_engine``. ``values`` / ``update critic`` / ``update actor`` likewise.
- ``weight sync``: everything onloaded (the actor is offloaded after the sync), the engines resumed
  (weights and KV cache), plus the sync buffers.

Weight sync per step (:class:`SyncPlan`; the transport is ``rollout.weight_transport`` resolved as the run
resolves it): every engine loads the whole model as HF tensors in ``rollout.dtype`` (a tied LM head once),
one request per bucket. The estimate adds, on the busiest GPU, bytes over the link that carries them at
``trainer.links.*`` (:class:`~megarl.config.trainer.LinksConfig`), and ``trainer.links.request_ms`` per
request:

- ``tensor``: each stage's TP all-gathers (in turn: every stage waits for the buckets of the stages before
  it), the pipeline delivery of the buckets to the stages hosting engine ranks in ``1/tp`` stripes per GPU
  (InfiniBand when a pipeline group spans nodes; one broadcast when every other stage receives, one send per
  receiving stage otherwise) and the stripes' all-gather there; on the engine side its requests and each
  engine GPU copying its ``1/tp`` shard out of the buckets (HBM, read and write). The engine loads a bucket
  while the actor builds the next: the slower side plus one bucket of the faster.
- ``distributed``: the TP all-gathers (stages at once), every engine GPU receiving every bucket over
  InfiniBand (engines on their own nodes), the requests and the shard copies, in turn (each sender waits
  for the engines' answers before its next bucket).

Mixture-of-experts models under expert parallelism: an expert bucket is filled on the EP rank holding its experts
(gathered over their ETP group) and broadcast over the EP group; the plan adds that broadcast to the actor side.

All-to-all per step (:class:`AllToAllPlan`, mixture-of-experts models): Megatron's dispatcher sends each token's
``k`` routed copies (``h`` values at the model dtype) to the ranks holding their experts and brings them back:
``2 k h × bytes × (ep − 1)/ep`` per token and sparse layer leaves (and reaches) a GPU, the ``(ep − 1)/ep`` of
experts on other EP ranks for balanced routing. Per step: the rank's tokens (every row at full length, ``/tp``
with sequence parallelism, ``/cp``) × its stage's sparse layers × passes (the old and reference log-prob
forwards; per PPO epoch a forward and a backward, and a recomputed forward with full recompute).

A plan that does not fit (a phase above ``trainer.gpu_memory_gb``, or an SGLang engine left with
KV room for less than one sequence) raises ``ValueError`` naming the settings that would help.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megarl.config.parallel import ParallelDims
from megarl.config.schema import RunConfig
from megarl.config.trainer import LinksConfig
from megarl.controller.placement import PlacementPlan, engine_replica, megatron_coordinates, placement_for
from megarl.controller.preflight_report import ROWS, expert_groups, format_report, kv_problem, overflow_problem
from megarl.models.sizes import Architecture, architecture_for
from megarl.models.weights import Split
from megarl.parallel.packing import pack_alignment, round_up

GiB = 1 << 30
CUDA_CONTEXT_BYTES = GiB // 2
"""CUDA context, cuBLAS workspace and NCCL buffers of one process on a GPU (a round estimate)."""
FUSED_ATTENTION = True
"""Plan for fused (flash) attention, which stores no attention scores: on GPU megarl builds TransformerEngine
layers (the ``gpu`` extra). False plans the local layer spec's unfused attention (Korthikanti's ``5 a s T / t``)."""
LOGITS_BYTES_PER_ELEMENT = 14
"""Peak bytes per logit element while log-probs are computed (bf16 logits + three fp32 temporaries)."""
ARR = "actor_rollout_ref"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------------- activations


def activation_bytes_per_layer(*, tokens: int, seq: int, hidden: int, heads: int, tp: int,
                               sequence_parallel: bool, recompute: str | None, fused_attention: bool = True) -> int:
    """Bytes one transformer layer keeps for its backward (Korthikanti et al. 2022, Table 2; 16-bit).

    ``tokens`` = micro-batch rows × ``seq``. ``recompute="full"``: the layer's input only.
    ``fused_attention``: the attention kernel stores no ``a × s²`` scores (flash attention, which
    TransformerEngine's layers use), so no recompute costs what selective recompute does.
    """
    split = tp if sequence_parallel else 1
    if recompute == "full":
        return math.ceil(2 * tokens * hidden / split)
    base = 34 * tokens * hidden / tp if sequence_parallel else tokens * hidden * (10 + 24 / tp)
    if recompute == "selective" or fused_attention:
        return math.ceil(base)
    return math.ceil(base + 5 * heads * seq * tokens / tp)


def moe_layer_activation_bytes(*, tokens: int, seq: int, hidden: int, heads: int, tp: int, sequence_parallel: bool,
                               recompute: str | None, experts: int, topk: int, expert_ffn: int, etp: int,
                               fused_attention: bool = True) -> int:
    """Bytes one mixture-of-experts layer keeps for its backward (16-bit; balanced routing; see the module
    docstring): the dense layer's count without its MLP's ``16 T h / t``, plus the router's fp32 scores and
    the routed copies' expert activations. ``recompute="full"``: the layer's input only, as a dense layer."""
    kwargs = {"tokens": tokens, "seq": seq, "hidden": hidden, "heads": heads, "tp": tp,
              "sequence_parallel": sequence_parallel, "fused_attention": fused_attention}
    if recompute == "full":
        return activation_bytes_per_layer(recompute="full", **kwargs)
    local = tokens / tp if sequence_parallel else tokens  # tokens this rank routes
    # Each copy: the expert's input (2h), gate/up output (4 f/etp), down input (2 f/etp), output (2h/etp; kept
    # for the routing weights' gradient); the etp ranks of an expert all take every copy of their group.
    routed = local * topk * (2 * hidden * (etp + 1) + 6 * expert_ffn)
    dense_mlp = 16 * tokens * hidden / tp
    return math.ceil(activation_bytes_per_layer(recompute=recompute, **kwargs) - dense_mlp + routed
                     + 8 * local * experts)


def all_to_all_bytes_per_token(*, hidden: int, topk: int, ep: int, dtype_bytes: int) -> float:
    """Bytes one token sends to (and receives from) other expert-parallel ranks in one sparse layer's forward:
    dispatch and combine, ``topk`` copies of ``hidden`` values, the ``(ep - 1)/ep`` bound for other ranks."""
    return 2 * topk * hidden * dtype_bytes * (ep - 1) / ep


def chunks_in_flight(*, pp: int, vpp: int | None, pp_rank: int, num_micro_batches: int) -> int:
    """Model chunks whose activations pipeline rank ``pp_rank`` holds at once under (interleaved) 1F1B."""
    chunks = vpp or 1
    if chunks == 1:
        return min(pp - pp_rank, num_micro_batches)
    return min(2 * (pp - pp_rank - 1) + (chunks - 1) * pp + 1, num_micro_batches * chunks)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Worst-case shape of one micro-batch on one rank."""

    tokens: int
    seq: int
    count: int
    """Micro-batches per mini-batch on one rank (the 1F1B cap)."""


def micro_batch(*, seq: int, rows: int | None, dynamic: bool, budget: int, packed: bool, cp: int = 1,
                align: tuple[int, int] = (1, 1), rows_per_rank: int = 1) -> MicroBatch:
    """The largest micro-batch of rows of ``seq`` tokens before the CP split (see the module docstring).

    ``rows`` per micro-batch, or with ``dynamic`` a token ``budget`` per GPU (a micro-batch spans the ``cp`` GPUs
    of a CP group: ``budget × cp`` tokens). ``packed``: THD, every row a segment of ``round_up(seq, seg)``, the
    pack rounded up to ``total``; else every row padded to ``round_up(seq, total)`` columns. ``align``: ``(seg,
    total)`` of :func:`~megarl.parallel.packing.pack_alignment`. ``count``: micro-batches of ``rows_per_rank``.
    """
    seg, total = align
    width = round_up(seq, seg) if packed else round_up(seq, total)
    if not dynamic:
        tokens = round_up(rows * width, total) if packed else rows * width
        return MicroBatch(tokens, width, math.ceil(rows_per_rank / rows))
    pack = budget * cp
    if packed:
        per_micro = max(pack // width, 1)
        return MicroBatch(round_up(max(pack, width), total), width, math.ceil(rows_per_rank / per_micro))
    # Padded: full-width rows round their columns up; narrower rows fill the budget itself.
    per_micro = max(pack // seq, 1)
    return MicroBatch(max(pack, per_micro * width), width, math.ceil(rows_per_rank / per_micro))


# ------------------------------------------------------------------------------------------ plan


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """What one kind of GPU holds: the rows (bytes) and each phase's total."""

    label: str
    pool: str
    gpus: tuple[int, ...]
    nodes: tuple[int, ...]
    rows: dict[str, int]
    parts: dict[str, dict[str, int]]
    """Phase -> the rows it holds on this GPU (bytes each)."""
    kv_tokens: int | None = None
    """Tokens the engine's KV cache holds (SGLang: its pool; hf: its share of the batch); None: no engine."""
    engine: str | None = None
    """``sglang`` or ``hf`` when an engine runs here."""
    in_use_at_engine_start: int = 0
    """Bytes the trainer (and CUDA contexts) already hold here when the engines start."""

    @property
    def phases(self) -> dict[str, int]:
        """Phase -> bytes held on this GPU."""
        return {name: sum(parts.values()) for name, parts in self.parts.items()}

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p])

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]


@dataclasses.dataclass(frozen=True)
class SyncStep:
    """One step of a weight sync and what it costs the busiest GPU: bytes over one link, or engine requests."""

    side: str
    """``actor`` (building and moving buckets) or ``engine`` (loading them)."""
    what: str
    link: str
    """``intra_node``, ``infiniband``, ``hbm`` (see :class:`LinksConfig`) or ``requests``."""
    nbytes: int = 0
    count: int = 0
    """Requests, for ``link="requests"``."""

    def seconds(self, links: LinksConfig) -> float:
        if self.link == "requests":
            return self.count * links.request_ms / 1e3
        return self.nbytes / (links.gbps(self.link) * 1e9)


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """One full weight sync (HF tensors in the engine dtype) by the run's transport, and its time estimate."""

    transport: str
    """``tensor`` or ``distributed`` (``rollout.weight_transport`` resolved)."""
    model_bytes: int
    """All HF tensors of the model at the engine dtype: what each engine loads."""
    bucket_bytes: int
    """Most bytes a bucket groups (a larger tensor travels alone)."""
    buckets: int
    """Buckets per sync: requests each engine answers."""
    steps: tuple[SyncStep, ...]
    links: LinksConfig
    overlapped: bool
    """The engine side runs while the actor side builds the next bucket (``tensor``'s double buffering)."""
    senders: tuple[int, ...]
    """Actor ranks (training-pool bundles) that post the engine requests."""

    def side_seconds(self, side: str) -> float:
        return sum(step.seconds(self.links) for step in self.steps if step.side == side)

    @property
    def seconds(self) -> float:
        """Estimated seconds per sync: the steps in turn; with ``overlapped``, the slower side plus one
        bucket's worth of the faster one (filling and draining the pipeline)."""
        actor, engine = self.side_seconds("actor"), self.side_seconds("engine")
        if not self.overlapped:
            return actor + engine
        return max(actor, engine) + min(actor, engine) / self.buckets


@dataclasses.dataclass(frozen=True)
class AllToAllPlan:
    """The expert-parallel all-to-all traffic of one actor GPU per step (mixture-of-experts models; the module
    docstring says what is counted)."""

    ep: int
    bytes_per_token: float
    """Bytes one token sends (and as many receives) in one sparse layer's forward: dispatch + combine."""
    tokens: int
    """Tokens the GPU routes per step (every row at full length)."""
    sparse_layers: int
    """Sparse layers on the GPU's pipeline stage (the stage with the most)."""
    passes: int
    """Passes through those layers per step: log-prob forwards, and per PPO epoch forward + backward (+ the
    recomputed forward under full recompute)."""
    link: str
    """``intra_node`` when every expert-parallel group stays on one node, else ``infiniband``."""
    links: LinksConfig

    @property
    def step_bytes(self) -> int:
        """Bytes one GPU sends per step (it receives as many)."""
        return math.ceil(self.bytes_per_token * self.tokens * self.sparse_layers * self.passes)

    @property
    def seconds(self) -> float:
        """``step_bytes`` over the link at ``trainer.links.*`` (no overlap with compute)."""
        return self.step_bytes / (self.links.gbps(self.link) * 1e9)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The pre-flight plan of a run: placement, memory per kind of GPU, weight-sync volume."""

    cfg: RunConfig
    model: Architecture
    critic_model: Architecture | None
    placement: PlacementPlan
    gpu_memory_bytes: int
    gpus: tuple[GpuPlan, ...]
    sync: SyncPlan
    max_seq: int
    all_to_all: AllToAllPlan | None = None
    """The actor's expert-parallel all-to-all per step (None: a dense model)."""

    @property
    def worst(self) -> GpuPlan:
        """The kind of GPU with the highest phase peak."""
        return max(self.gpus, key=lambda g: g.peak)

    def problems(self) -> list[str]:
        """Why the run does not fit (empty when it does), each naming the settings that would help."""
        out = []
        worst = self.worst
        if worst.peak > self.gpu_memory_bytes:
            out.append(overflow_problem(self, worst))
        for gpu in self.gpus:
            if gpu.engine == "sglang" and (gpu.kv_tokens or 0) < self.max_seq:
                out.append(kv_problem(self, gpu))
                break
        return out

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
    placement = placement_for(cfg)
    _check_model_layouts(cfg, model, critic_model, placement)
    memory = gpu_memory_gb if gpu_memory_gb is not None else cfg.trainer.gpu_memory_gb
    plan = _MemoryModel(cfg, model, critic_model, placement, int(memory * GiB)).plan()
    if check:
        plan.check()
    return plan


def preflight(cfg: RunConfig) -> RunPlan | None:
    """The trainer's check before placing anything: the plan of a cuda run (raises when it does not fit);
    None on cpu, where there is no device memory to plan."""
    if cfg.trainer.device == "cpu":
        return None
    return plan_run(cfg)


def _check_model_layouts(cfg: RunConfig, model: Architecture, critic_model: Architecture | None,
                         placement: PlacementPlan) -> None:
    roles = [(f"{ARR}.actor.", placement.role("actor").dims, model)]
    if critic_model is not None:
        roles.append(("critic.", placement.role("critic").dims, critic_model))
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


class _MemoryModel:
    """Computes each GPU's rows and phases for one config (see the module docstring)."""

    def __init__(self, cfg: RunConfig, model: Architecture, critic_model: Architecture | None,
                 placement: PlacementPlan, memory: int):
        self.cfg, self.model, self.critic_model = cfg, model, critic_model
        self.placement, self.memory = placement, memory
        arr = cfg.actor_rollout_ref
        self.arr = arr
        self.dtype_bytes = DTYPE_BYTES[arr.model.dtype]
        self.engine_bytes = DTYPE_BYTES[arr.rollout.dtype]
        prompt_length, response_length = cfg.rollout_widths()
        self.seq = prompt_length + response_length
        self.max_seq = min(arr.rollout.max_model_len or self.seq, self.seq)
        self.actor_dims: ParallelDims = placement.role("actor").dims
        self.critic_dims: ParallelDims | None = placement.role("critic").dims if critic_model else None
        self.engine_tp = placement.engines[0].tp
        self.colocated = placement.colocated

    # ------------------------------------------------------------------------- training state
    def _state(self, sizes: Architecture, dims: ParallelDims, pp_rank: int, *, value_head: bool,
               optim) -> dict[str, int]:
        counts = sizes.rank_param_counts(tp=dims.tp, pp=dims.pp, pp_rank=pp_rank, vpp=dims.vpp, ep=dims.ep,
                                         etp=dims.expert_tp, value_head=value_head)
        n = counts.total
        sixteen_bit = self.dtype_bytes == 2
        distributed = optim.use_distributed_optimizer
        # The distributed optimizer shards dense parameters over DP x CP, experts over their own replicas.
        shards, expert_shards = (dims.dp * dims.cp, dims.expert_dp) if distributed else (1, 1)

        def sharded(per_param: int) -> int:
            return math.ceil(counts.dense * per_param / shards) + math.ceil(counts.experts * per_param / expert_shards)

        return {"weights": n * self.dtype_bytes, "grads": 4 * n,
                "optimizer": sharded(12 if sixteen_bit else 8), "optimizer_at_start": sharded(4 if sixteen_bit else 0)}

    def _actor_micro(self) -> tuple[MicroBatch, MicroBatch]:
        """(update micro-batch, largest log-prob forward micro-batch) of the actor, per CP rank."""
        arr, dims = self.arr, self.actor_dims
        actor, rollout, ref = arr.actor, arr.rollout, arr.ref
        packed = arr.model.use_remove_padding  # actor, reference and log-prob recompute alike
        rows_per_rank = actor.ppo_mini_batch_size * rollout.n // dims.dp
        update = self._micro(dims, packed, rows=actor.ppo_micro_batch_size_per_gpu, dynamic=actor.use_dynamic_bsz,
                             budget=actor.ppo_max_token_len_per_gpu, rows_per_rank=rows_per_rank)
        # The trainer's defaults: 16 rows when a micro-batch size is null.
        forwards = [self._micro(dims, packed, rows=rollout.log_prob_micro_batch_size_per_gpu or 16,
                                dynamic=rollout.log_prob_use_dynamic_bsz,
                                budget=rollout.log_prob_max_token_len_per_gpu)]
        if self.cfg.needs_ref:
            forwards.append(self._micro(dims, packed, rows=ref.log_prob_micro_batch_size_per_gpu or 16,
                                        dynamic=ref.log_prob_use_dynamic_bsz,
                                        budget=ref.log_prob_max_token_len_per_gpu))
        return update, max(forwards, key=lambda m: m.tokens)

    def _micro(self, dims: ParallelDims, packed: bool, **kwargs) -> MicroBatch:
        """:func:`micro_batch` of this run's sequences on a role's layout, per CP rank."""
        align = pack_alignment(cp=dims.cp, tp=dims.tp, sequence_parallel=dims.sequence_parallel)
        return _per_cp(micro_batch(seq=self.seq, packed=packed, cp=dims.cp, align=align, **kwargs), dims.cp)

    def _layer_bytes(self, sizes: Architecture, dims: ParallelDims, mb: MicroBatch, layer: int, *,
                     sequence_parallel: bool, recompute: str | None) -> int:
        """What layer ``layer`` keeps for its backward: dense, or a mixture of experts."""
        kwargs = {"tokens": mb.tokens, "seq": mb.seq, "hidden": sizes.hidden, "heads": sizes.heads, "tp": dims.tp,
                  "sequence_parallel": sequence_parallel, "recompute": recompute, "fused_attention": FUSED_ATTENTION}
        if not (sizes.sparse and sizes.sparse[layer]):
            return activation_bytes_per_layer(**kwargs)
        return moe_layer_activation_bytes(**kwargs, experts=sizes.num_experts, topk=sizes.topk,
                                          expert_ffn=sizes.moe_ffn, etp=dims.expert_tp)

    def _dispatch_bytes(self, sizes: Architecture, dims: ParallelDims, mb: MicroBatch, layers: list[int], *,
                        sequence_parallel: bool) -> int:
        """The all-to-all's send and receive buffers of one sparse layer's permuted tokens (bf16), when ``layers``
        has a sparse one."""
        if not any(sizes.sparse[layer] for layer in layers if sizes.sparse):
            return 0
        local = mb.tokens / dims.tp if sequence_parallel else mb.tokens
        return math.ceil(2 * local * sizes.topk * sizes.hidden * 2)

    def _forward_layer(self, sizes: Architecture, dims: ParallelDims, mb: MicroBatch, *,
                       sequence_parallel: bool) -> int:
        """A log-prob (or value) forward's working memory: its largest layer at the selective size."""
        kwargs = {"sequence_parallel": sequence_parallel}
        layers = list(range(sizes.num_layers))
        return (max(self._layer_bytes(sizes, dims, mb, layer, recompute="selective", **kwargs) for layer in layers)
                + self._dispatch_bytes(sizes, dims, mb, layers, **kwargs))

    def _activations(self, sizes: Architecture, dims: ParallelDims, pp_rank: int, mb: MicroBatch, *,
                     sequence_parallel: bool, recompute: str | None, block: int) -> int:
        layers = sizes.stage_layers(dims.pp, pp_rank, dims.vpp)
        per_chunk_layers = len(layers) // dims.num_virtual_stages
        chunk_layers = [layers[i:i + per_chunk_layers] for i in range(0, len(layers), per_chunk_layers)]
        chunks = chunks_in_flight(pp=dims.pp, vpp=dims.vpp, pp_rank=pp_rank, num_micro_batches=mb.count)
        kwargs = {"sequence_parallel": sequence_parallel}
        dispatch = self._dispatch_bytes(sizes, dims, mb, layers, **kwargs)
        if recompute != "full":
            per_chunk = max(sum(self._layer_bytes(sizes, dims, mb, layer, recompute=recompute, **kwargs)
                                for layer in chunk) for chunk in chunk_layers)
            return chunks * per_chunk + dispatch
        block = min(block, per_chunk_layers)
        stored = chunks * math.ceil(per_chunk_layers / block) * self._layer_bytes(sizes, dims, mb, layers[0],
                                                                                  recompute="full", **kwargs)
        rematerialised = max(self._layer_bytes(sizes, dims, mb, layer, recompute="selective", **kwargs)
                             for layer in layers)
        return stored + block * rematerialised + dispatch

    def _logits(self, mb: MicroBatch, tp: int) -> int:
        vocab = self.model.family.padded_vocab_size(self.model.hf_config, tp)
        return mb.tokens * (vocab // tp) * LOGITS_BYTES_PER_ELEMENT

    def _actor_rows(self, bundle: int) -> dict[str, int]:
        m, dims, arr = self.model, self.actor_dims, self.arr
        _, _, _, pp_rank = megatron_coordinates(bundle, dims)
        last = pp_rank == dims.pp - 1
        state = self._state(m, dims, pp_rank, value_head=False, optim=arr.actor.optim)
        update, forward = self._actor_micro()
        sp = arr.actor.parallel.sequence_parallel
        rows = {"actor_weights": state["weights"], "actor_grads": state["grads"],
                "actor_optimizer": state["optimizer"],
                "ref_weights": state["weights"] if self.cfg.needs_ref else 0,
                "activations": self._activations(m, dims, pp_rank, update, sequence_parallel=sp,
                                                 recompute=arr.actor.recompute_granularity,
                                                 block=arr.actor.recompute_num_layers),
                "logits": self._logits(update, dims.tp) if last else 0,
                "forward": self._forward_layer(m, dims, forward, sequence_parallel=sp)
                + (self._logits(forward, dims.tp) if last else 0)}
        at_start = state["weights"] + state["grads"] + state["optimizer_at_start"] + rows["ref_weights"]
        return rows | {"_at_start": at_start}

    def _critic_rows(self, bundle: int) -> dict[str, int]:
        m, dims, critic = self.critic_model, self.critic_dims, self.cfg.critic
        _, _, _, pp_rank = megatron_coordinates(bundle, dims)
        state = self._state(m, dims, pp_rank, value_head=True, optim=critic.optim)
        rows_per_rank = critic.ppo_mini_batch_size * self.arr.rollout.n // dims.dp
        packed = critic.use_remove_padding
        update = self._micro(dims, packed, rows=critic.ppo_micro_batch_size_per_gpu, dynamic=critic.use_dynamic_bsz,
                             budget=critic.ppo_max_token_len_per_gpu, rows_per_rank=rows_per_rank)
        forward = self._micro(dims, packed, rows=critic.forward_micro_batch_size_per_gpu or 1,
                              dynamic=critic.use_dynamic_bsz, budget=critic.ppo_max_token_len_per_gpu)
        sp = critic.parallel.sequence_parallel
        off = {"weights": critic.param_offload, "grads": critic.grad_offload, "optimizer": critic.optimizer_offload}
        return {"critic_state": state["weights"] + state["grads"] + state["optimizer"],
                "_critic_resident": sum(state[k] for k, flag in off.items() if not flag),
                "critic_activations": self._activations(m, dims, pp_rank, update, sequence_parallel=sp,
                                                        recompute=None, block=1),
                "critic_forward": self._forward_layer(m, dims, forward, sequence_parallel=sp),
                "_at_start": state["weights"] + state["grads"] + state["optimizer_at_start"]}

    # ------------------------------------------------------------------------------- engines
    def _engine_weights(self) -> int:
        """Bytes of the engine's weights on one of its GPUs."""
        m = self.model
        if self.arr.rollout.name == "hf":
            return m.num_params * self.engine_bytes
        from megarl.models.family import sglang_padded_vocab

        n = m.rank_params(tp=self.engine_tp, padded_vocab=sglang_padded_vocab(m.vocab, self.engine_tp))
        return n * self.engine_bytes

    def _hf_engine_kv(self) -> int:
        rows = math.ceil(self.cfg.data.train_batch_size * self.arr.rollout.n / len(self.placement.engines))
        return rows * self.seq * self.model.kv_bytes_per_token(1, self.engine_bytes)

    # ------------------------------------------------------------------------------ weight sync
    def _sync(self) -> tuple[SyncPlan, dict[int, int], int]:
        """The sync plan, each actor rank's sync buffers (bytes, by training-pool bundle) and the buffer an engine
        GPU receives a bucket into (``distributed``; 0 for ``tensor``, whose engines read the actor's buffers)."""
        from megarl.config.rollout import resolve_transport
        from megarl.convert.param_map import Unit, buckets
        from megarl.sync.tensor import NUM_BUFFERS

        m, dims, arr = self.model, self.actor_dims, self.arr
        transport = resolve_transport(arr.rollout.weight_transport, colocated=self.colocated)
        chunk_layers = m.num_layers // (dims.pp * dims.num_virtual_stages)

        def owner(layer):
            index = layer // chunk_layers
            return index % dims.pp, index // dims.pp

        # Every tensor in HF order, placed as megarl.convert.param_map.build_plan places it (experts by EP rank).
        experts_per_rank = m.num_experts // dims.ep if m.is_moe else 0
        last = (dims.pp - 1, dims.num_virtual_stages - 1)
        units = []
        for at in m.family.weight_instances(m.hf_config):
            place = owner(at.layer) if at.layer is not None else \
                (0, 0) if at.rule.megatron.startswith("embedding.") else last
            units.append(Unit(at.rule, at.layer, *place, at.hf_names, tuple(m.hf_shape(t) for t in at.rule.hf),
                              expert=at.expert,
                              ep_owner=None if at.expert is None else at.expert // experts_per_rank))

        def full(u, size=self.engine_bytes):
            return sum(math.prod(s) for s in u.hf_shapes) * size

        def split_size(u):  # the group a tensor's shards are gathered over: ETP for experts, else TP
            return dims.expert_tp if u.expert is not None else dims.tp

        tp, pp, num_buffers = dims.tp, dims.pp, NUM_BUFFERS if transport == "tensor" else 1
        # The exporter's buckets (WeightExporter.iter_buckets, at the engine dtype): the tensor transport splits
        # rollout.bucket_mb over its two buffers; buffers hold a multiple of tp elements (stripes).
        budget = max(1, (arr.rollout.bucket_mb << 20) // num_buffers)
        groups = buckets(units, full, budget)
        sizes = [sum(full(u) for u in b) for b in groups]
        padded = [math.ceil(n // self.engine_bytes / tp) * tp * self.engine_bytes for n in sizes]
        owners = [b[0].pp_rank for b in groups]
        vocab_in_place = (m.family.padded_vocab_size(m.hf_config, tp) == m.vocab
                          and self.engine_bytes == self.dtype_bytes)
        etp, ep = dims.expert_tp, dims.ep
        scratch, gathered, ep_received = {}, {}, {}
        for stage in range(pp):
            own = [u for u in units if u.pp_rank == stage and u.rule.split is not Split.REPLICATED]
            # Split tensors gather through a scratch buffer in the model dtype, but vocabulary rows in place.
            scratch[stage] = max((full(u, self.dtype_bytes) for u in own if split_size(u) > 1
                                  and not (u.rule.split is Split.VOCAB and vocab_in_place)), default=0)
            dense = sum(full(u, self.dtype_bytes) for u in own if u.expert is None)
            experts = sum(full(u, self.dtype_bytes) for u in own if u.expert is not None)
            # A rank gathers the experts it holds (1/ep of them) over ETP; then each expert bucket is broadcast
            # over the EP group from its owner: a rank receives the other (ep - 1)/ep, in the engine dtype.
            gathered[stage] = dense * (tp - 1) // tp + experts * (etp - 1) // (etp * ep)
            ep_received[stage] = sum(full(u) for u in units if u.pp_rank == stage and u.expert is not None) \
                * (ep - 1) // ep
        ep_step = []
        if ep > 1:
            in_turn = transport == "tensor"
            ep_step = [SyncStep("actor", "expert buckets broadcast over each EP group from the rank holding them"
                                + ((" (stages in turn)" if in_turn else " (stages at once)") if pp > 1 else ""),
                                self._ep_link(dims), sum(ep_received.values()) if in_turn
                                else max(ep_received.values()))]

        pool = self.placement.pools[self.placement.role("actor").pool]
        group_stride = tp * dims.cp * dims.dp  # rank r's pipeline peers: r mod stride + p * stride
        hosts = ({b for e in self.placement.engines for b in e.bundles} if transport == "tensor" else set())

        def receivers(rank: int) -> frozenset[int]:
            base = rank % group_stride
            return frozenset(p for p in range(pp) if base + p * group_stride in hosts)

        ring: dict[tuple[int, frozenset[int]], int] = {}
        buffers = {}
        for rank in range(pool.size):
            stage, wanted = rank // group_stride, receivers(rank)
            if (stage, wanted) not in ring:
                held = [padded[i] for i in range(len(groups)) if owners[i] == stage or stage in wanted]
                ring[stage, wanted] = sum(max(held[k::num_buffers], default=0) for k in range(num_buffers))
            buffers[rank] = ring[stage, wanted] + scratch[stage]

        model_bytes = sum(sizes)
        links = self.cfg.trainer.links
        load = SyncStep("engine", "each engine GPU copies its shard out of the buckets (read + write)", "hbm",
                        2 * model_bytes // self.engine_tp)
        requests = SyncStep("engine", f"{len(groups)} engine requests, one per bucket", "requests", count=len(groups))
        if transport == "tensor":
            delivered = stripes = 0
            pp_link = "intra_node"
            for base in range(group_stride):
                wanted = receivers(base)
                members = [base + p * group_stride for p in range(pp)]
                if len({pool.node_of(r) for r in members}) > 1:
                    pp_link = "infiniband"
                group_delivered = group_stripes = 0
                for i, stage in enumerate(owners):
                    others = len(wanted - {stage})
                    if others:
                        group_delivered += padded[i]
                        # one broadcast when every other stage receives, else one send per receiving stage
                        group_stripes += padded[i] // tp * (1 if others == pp - 1 else others)
                delivered, stripes = max(delivered, group_delivered), max(stripes, group_stripes)
            steps = [SyncStep("actor", "TP all-gathers building the buckets" + (" (stages in turn)" if pp > 1 else ""),
                              "intra_node", sum(gathered.values()))] + ep_step
            if pp > 1:
                steps += [SyncStep("actor", f"buckets to the other stages' engine ranks, in 1/{tp} stripes "
                                   "per GPU", pp_link, stripes),
                          SyncStep("actor", "TP all-gathers of the stripes on the receiving stages", "intra_node",
                                   delivered * (tp - 1) // tp)]
            steps += [requests, load]
            senders = tuple(sorted(e.bundles[0] for e in self.placement.engines))
        else:
            steps = [SyncStep("actor", "TP all-gathers building the buckets" + (" (stages at once)" if pp > 1 else ""),
                              "intra_node", max(gathered.values())), *ep_step,
                     SyncStep("actor", "broadcast: every engine GPU receives every bucket", "infiniband",
                              model_bytes),
                     requests, load]
            replicas = sorted({engine_replica(e, dims.dp) for e in self.placement.engines})
            senders = tuple(sorted(p * group_stride + d * tp * dims.cp for d in replicas for p in range(pp)))
        plan = SyncPlan(transport, model_bytes, budget, len(groups), tuple(steps), links,
                        overlapped=transport == "tensor", senders=senders)
        return plan, buffers, (max(sizes) if transport == "distributed" else 0)

    # ---------------------------------------------------------------------------- all-to-all
    def _ep_link(self, dims: ParallelDims) -> str:
        """``intra_node`` when every expert-parallel group of the actor sits on one node, else ``infiniband``."""
        pool = self.placement.pools[self.placement.role("actor").pool]
        spans = any(len({pool.node_of(r) for r in group}) > 1 for group in expert_groups(dims))
        return "infiniband" if spans else "intra_node"

    def _all_to_all(self) -> AllToAllPlan | None:
        """The actor's expert-parallel all-to-all per step (the module docstring); None for a dense model."""
        m, dims, actor = self.model, self.actor_dims, self.arr.actor
        if not m.is_moe:
            return None
        rows = self.cfg.data.train_batch_size * self.arr.rollout.n // dims.dp
        split = dims.tp if actor.parallel.sequence_parallel else 1
        tokens = math.ceil(rows * self.seq / split / dims.cp)
        sparse = max(sum(m.sparse[layer] for layer in m.stage_layers(dims.pp, r, dims.vpp)) for r in range(dims.pp))
        passes = 1 + int(self.cfg.needs_ref) + actor.ppo_epochs * (2 + int(actor.recompute_granularity == "full"))
        per_token = all_to_all_bytes_per_token(hidden=m.hidden, topk=m.topk, ep=dims.ep, dtype_bytes=self.dtype_bytes)
        return AllToAllPlan(dims.ep, per_token, tokens, sparse, passes, self._ep_link(dims), self.cfg.trainer.links)

    # ----------------------------------------------------------------------------------- GPUs
    def plan(self) -> RunPlan:
        sync, sync_buffers, engine_buffer = self._sync()
        engine_weights = self._engine_weights()
        kv_bytes_per_token = self.model.kv_bytes_per_token(self.engine_tp, self.engine_bytes)
        per_gpu: list[tuple[str, int, int, dict[str, int]]] = []
        training_pool = self.placement.role("actor").pool
        pool = self.placement.pools[training_pool]
        engine_gpus = {(e.pool, b): e.index for e in self.placement.engines for b in e.bundles}
        for bundle in range(pool.size):
            rows = {key: 0 for key in ROWS} | self._actor_rows(bundle)
            if self.critic_model is not None:
                critic = self._critic_rows(bundle)
                rows |= {k: v for k, v in critic.items() if k != "_at_start"}
                rows["_at_start"] += critic["_at_start"]
            rows["sync_buffers"] = sync_buffers[bundle]
            processes = 1 + (self.critic_model is not None)
            rows["cuda_context"] = processes * CUDA_CONTEXT_BYTES
            per_gpu.append((training_pool, bundle, pool.node_of(bundle), rows))
        if not self.colocated:
            rollout_pool = self.placement.pools[self.placement.role("rollout").pool]
            for bundle in range(rollout_pool.size):
                rows = {key: 0 for key in ROWS} | {"_at_start": 0, "sync_buffers": engine_buffer}
                per_gpu.append((rollout_pool.name, bundle, rollout_pool.node_of(bundle), rows))
        by_key = {(p, b): rows for p, b, _, rows in per_gpu}
        kv = {}
        for engine in self.placement.engines:
            if self.arr.rollout.name == "hf":
                kv[engine.index] = self._hf_engine_kv()
                continue
            used = max(by_key[(engine.pool, b)]["_at_start"] + by_key[(engine.pool, b)]["cuda_context"]
                       for b in engine.bundles)
            fraction = self.arr.rollout.gpu_memory_utilization
            kv[engine.index] = int(fraction * self.memory) - used - CUDA_CONTEXT_BYTES - engine_weights
        plans = []
        for pool_name, bundle, node, rows in per_gpu:
            index = engine_gpus.get((pool_name, bundle))
            at_start = rows["_at_start"] + rows["cuda_context"]
            tokens = None
            if index is not None:
                rows["engine_weights"] = engine_weights
                rows["kv_cache"] = max(kv[index], 0)
                rows["cuda_context"] += CUDA_CONTEXT_BYTES
                per_token = kv_bytes_per_token if self.arr.rollout.name == "sglang" else \
                    self.model.kv_bytes_per_token(1, self.engine_bytes)
                tokens = rows["kv_cache"] // per_token
            label = self._label(pool_name, bundle, index)
            plans.append((pool_name, bundle, node, label, rows,
                          self._phases(rows, pool_name == training_pool), tokens,
                          self.arr.rollout.name if index is not None else None, at_start))
        return RunPlan(self.cfg, self.model, self.critic_model, self.placement, self.memory,
                       _group(plans), sync, self.max_seq, self._all_to_all())

    def _label(self, pool_name: str, bundle: int, engine: int | None) -> str:
        parts = []
        if pool_name == self.placement.role("actor").pool:
            dims = self.actor_dims
            if dims.pp > 1:
                role = "actor " if self.critic_dims is not None else ""
                parts.append(f"{role}stage {megatron_coordinates(bundle, dims)[3]}")
            if self.critic_dims is not None and self.critic_dims.pp > 1:
                parts.append(f"critic stage {megatron_coordinates(bundle, self.critic_dims)[3]}")
            if not parts:
                parts.append("actor")
        else:
            parts.append("rollout pool")
        if engine is not None:
            parts.append("engine")
        return ", ".join(parts)

    def _phases(self, rows: dict[str, int], training: bool) -> dict[str, dict[str, int]]:
        """Phase -> the rows it holds (bytes each); a phase's total is their sum."""
        engine = {"engine_weights": rows["engine_weights"], "kv_cache": rows["kv_cache"]}
        base = {"cuda_context": rows["cuda_context"]}
        # The hf engine's cache lives only while it generates; SGLang's pool comes back with the weights.
        resumed = engine if self.arr.rollout.name == "sglang" else {"engine_weights": rows["engine_weights"]}
        if not training:
            return {"rollout": base | engine,
                    "weight sync": base | resumed | {"sync_buffers": rows["sync_buffers"]}}
        arr = self.arr
        actor = arr.actor
        actor_full = {k: rows[k] for k in ("actor_weights", "actor_grads", "actor_optimizer")}
        # The trainer offloads the reference's weights with ref.param_offload (ActorWorker.offload).
        actor_resident = {"actor_weights": 0 if actor.param_offload else rows["actor_weights"],
                          "actor_grads": 0 if actor.grad_offload else rows["actor_grads"],
                          "actor_optimizer": 0 if actor.optimizer_offload else rows["actor_optimizer"],
                          "ref_weights": 0 if arr.ref.param_offload else rows["ref_weights"]}
        critic_full = {"critic_state": rows["critic_state"]}
        critic_resident = {"critic_state": rows.get("_critic_resident", 0)}
        kept = resumed if self.colocated and not arr.rollout.free_cache_engine else {}
        onloaded = base | actor_full | {"ref_weights": rows["ref_weights"]}
        phases = {"rollout": base | actor_resident | critic_resident | engine,
                  "log-probs": onloaded | critic_resident | kept | {"forward": rows["forward"]}}
        if self.critic_model is not None:
            phases["values"] = onloaded | critic_full | kept | {"critic_forward": rows["critic_forward"]}
            phases["update critic"] = onloaded | critic_full | kept | {"critic_activations": rows["critic_activations"]}
        phases["update actor"] = onloaded | critic_resident | kept | {"activations": rows["activations"],
                                                                       "logits": rows["logits"]}
        phases["weight sync"] = onloaded | critic_resident | resumed | {"sync_buffers": rows["sync_buffers"]}
        return {name: {k: v for k, v in parts.items() if v} for name, parts in phases.items()}


def _per_cp(mb: MicroBatch, cp: int) -> MicroBatch:
    """One CP rank's share: the aligned tokens and sequence divided by ``cp``."""
    return MicroBatch(math.ceil(mb.tokens / cp), math.ceil(mb.seq / cp), mb.count)


def _group(plans) -> tuple[GpuPlan, ...]:
    """GPUs with the same label, rows and phases, as one :class:`GpuPlan` each (first GPU order)."""
    groups: dict[Any, list] = {}
    for pool_name, bundle, node, label, rows, phases, tokens, engine, at_start in plans:
        public = {k: v for k, v in rows.items() if not k.startswith("_")}
        key = (pool_name, label, tuple(sorted(public.items())), repr(phases), tokens, at_start)
        groups.setdefault(key, []).append((bundle, node, public, phases, tokens, engine, at_start))
    out = []
    for (pool_name, label, *_), members in groups.items():
        _, _, rows, phases, tokens, engine, at_start = members[0]
        out.append(GpuPlan(label, pool_name, tuple(m[0] for m in members), tuple(sorted({m[1] for m in members})),
                           rows, phases, tokens, engine, at_start))
    return tuple(out)
