"""The memory model: what each GPU of a run holds in each phase (bytes), from the config and the model's sizes.

Pure arithmetic (no Ray, no GPU, no weights); :func:`megarl.plan.preflight.plan_run` runs it with the weight
sync's buffers from :mod:`megarl.plan.weight_sync`. The formulas of its activations and micro-batches are in
:mod:`megarl.plan.activations`.

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
  and ``v`` at its first step. With Megatron's hybrid CPU optimizer (``<role>.optim.override_optimizer_config``:
  ``optimizer_cpu_offload`` and ``optimizer_offload_fraction`` ``f``) the share ``f`` of ``m`` and ``v`` lives on
  the host instead, which also holds those parameters' fp32 copy and a copy of their grads: ``16 f n`` (sharded as
  above) per rank in its node's memory (:meth:`MemoryModel.host_optimizer_bytes`).
- **reference**: ``n × bytes(model.dtype)`` in the actor's processes when a KL term is on; none with LoRA (the
  reference is the actor with its adapters off).
- **LoRA** (``actor_rollout_ref.model.lora_rank``): the actor's ``n`` base weights stay; its gradients and optimizer
  state are those of its ``a`` adapter parameters alone (:meth:`~megarl.models.sizes.Architecture.lora_param_count`),
  which add ``a × bytes(model.dtype)`` of weights.
- **critic**: weights, grads and optimizer as above for its own layout (value head instead of LM head).
- **teacher** (on-policy distillation) and **reward model** (``reward_model.enable``): weights in their
  ``model.dtype`` on their own layouts, held in every phase (``param_offload``: only in their own), and in their own
  phase (``teacher`` / ``reward model``) their forward: the largest layer at the selective size and, for the
  teacher's last stage, its logits (the reward model's value head adds nothing to speak of).
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
  Of the ``24/t`` (``34/t``), ``8 T h / t`` are attention's queries, keys, values and output-projection input (``h``
  wide each); multi-latent attention's are ``2 a (d_qk + d_v)`` wide (DeepSeek-V3: 11.4 ``h``), and it keeps its
  compressed latents (``2 (r_q + r_kv)`` per token, whole per TP rank) besides
  (:attr:`~megarl.models.sizes.Architecture.attention_activations`).
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
  as SGLang pads it; KV heads replicated when engine TP exceeds them); with ``rollout.lora_sync=adapters`` plus
  SGLang's one LoRA slot, the adapters in PEFT's layout over the engine's TP. A mixture-of-experts model: every
  engine GPU holds every expert, its FFN split over the engine's TP (SGLang without ``--ep-size``; megarl
  starts its engines without expert parallelism).
- **KV cache**: SGLang sizes its pool when it starts: ``gpu_memory_utilization × GPU − memory in
  use on the GPU`` (its own weights and context, and whatever the colocated trainer already holds:
  the trainer starts the engines after building the actor, reference and critic). One token takes
  ``2 × layers × kv_heads/tp × head_dim × bytes`` per engine GPU. The hf engine reserves nothing:
  its cache grows to its share of the batch, ``rows × (P + R)`` tokens.
- **weight-sync buffers** (during the sync; :mod:`megarl.plan.weight_sync` says what they are): the bucket buffers
  on every actor rank and the gather scratch, or the buffer a ``distributed`` engine receives each bucket into.
- **CUDA contexts**: :data:`CUDA_CONTEXT_BYTES` per process on the GPU (actor, critic, engine rank).

Phases (colocated; what the trainer holds on the GPU in each, steady state):

- ``rollout``: the engine (weights + KV) + the training state that is not offloaded
  (``<role>.param_offload`` / ``grad_offload`` / ``optimizer_offload``; the reference's weights with
  ``ref.param_offload``, as ``ActorWorker.offload`` does).
- ``log-probs``: everything onloaded + the forward's logits and one layer's activations; the engine
  too unless ``free_cache_engine``, and its weights when a LoRA run syncs its adapters alone (the base is never
  rewritten, so never released). ``values`` / ``update critic`` / ``update actor`` likewise.
- ``weight sync``: everything onloaded (the actor is offloaded after the sync), the engines resumed
  (weights and KV cache), plus the sync buffers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megarl.config.megatron import offloaded_fraction
from megarl.config.parallel import ParallelDims
from megarl.config.schema import RunConfig
from megarl.models.sizes import Architecture
from megarl.parallel.packing import pack_alignment
from megarl.plan.activations import (
    MicroBatch,
    activation_bytes_per_layer,
    chunks_in_flight,
    micro_batch,
    moe_layer_activation_bytes,
)
from megarl.plan.placement import PlacementPlan, megatron_coordinates
from megarl.workers.roles import SCORING_ROLES, SPEC_OF

ROWS = ("actor_weights", "actor_grads", "actor_optimizer", "ref_weights", "critic_state",
        *(f"{spec.name}_weights" for spec in SCORING_ROLES), "activations", "logits", "forward", "critic_activations",
        "critic_forward", *(f"{spec.name}_forward" for spec in SCORING_ROLES), "engine_weights", "kv_cache",
        "recurrent_state", "sync_buffers", "cuda_context")
"""Memory rows of a GPU, in report order (a scoring role's weights and forward: ``<role>_weights``,
``<role>_forward``)."""

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



class MemoryModel:
    """Computes each GPU's rows and phases for one config (see the module docstring)."""

    def __init__(self, cfg: RunConfig, model: Architecture, critic_model: Architecture | None,
                 placement: PlacementPlan, memory: int, scorers: dict[str, Architecture] | None = None):
        self.cfg, self.model, self.critic_model = cfg, model, critic_model
        self.scorers = dict(scorers or {})
        """The scoring models' sizes by role (``teacher``, ``reward_model``): placed, never trained."""
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
               optim, lora=None) -> dict[str, int]:
        counts = sizes.rank_param_counts(tp=dims.tp, pipeline=dims, pp_rank=pp_rank, ep=dims.ep,
                                         etp=dims.expert_tp, value_head=value_head)
        n = counts.total
        if lora is not None:  # the base frozen: gradients and optimizer state of the adapters alone
            adapters = sizes.lora_param_count(lora, tp=dims.tp, pipeline=dims, pp_rank=pp_rank)
            counts = counts._replace(dense=adapters, experts=0)
            weights = (n + adapters) * self.dtype_bytes
            n = adapters
        else:
            weights = n * self.dtype_bytes
        sixteen_bit = self.dtype_bytes == 2
        distributed = optim.use_distributed_optimizer
        # The distributed optimizer shards dense parameters over DP x CP, experts over their own replicas.
        shards, expert_shards = (dims.dp * dims.cp, dims.expert_dp) if distributed else (1, 1)

        def sharded(per_param: int) -> int:
            return math.ceil(counts.dense * per_param / shards) + math.ceil(counts.experts * per_param / expert_shards)

        # Megatron's hybrid optimizer (optimizer_cpu_offload) keeps and steps a share of the states on the host:
        # the moments leave the GPU; the host holds their params' fp32 copy, the moments and a copy of the grads.
        host = offloaded_fraction(optim.override_optimizer_config)
        moments = sharded(8)
        return {"weights": weights, "grads": 4 * n,
                "optimizer": sharded(4 if sixteen_bit else 0) + moments - int(moments * host),
                "optimizer_at_start": sharded(4 if sixteen_bit else 0), "optimizer_host": int(sharded(16) * host)}

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
                  "sequence_parallel": sequence_parallel, "recompute": recompute, "fused_attention": FUSED_ATTENTION,
                  **sizes.attention_activations}
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
        chunk_layers = [list(dims.chunk_layers(sizes.num_layers, pp_rank, v)) for v in range(dims.num_virtual_stages)]
        layers = [layer for chunk in chunk_layers for layer in chunk]
        per_chunk_layers = len(chunk_layers[0])
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

    def _logits(self, mb: MicroBatch, tp: int, sizes: Architecture | None = None) -> int:
        sizes = sizes or self.model
        vocab = sizes.family.padded_vocab_size(sizes.hf_config, tp)
        return mb.tokens * (vocab // tp) * LOGITS_BYTES_PER_ELEMENT

    def _actor_rows(self, bundle: int) -> dict[str, int]:
        m, dims, arr = self.model, self.actor_dims, self.arr
        _, _, _, pp_rank = megatron_coordinates(bundle, dims)
        last = pp_rank == dims.pp - 1
        lora = arr.model.lora_spec
        state = self._state(m, dims, pp_rank, value_head=False, optim=arr.actor.optim, lora=lora)
        update, forward = self._actor_micro()
        sp = arr.actor.parallel.sequence_parallel
        rows = {"actor_weights": state["weights"], "actor_grads": state["grads"],
                "actor_optimizer": state["optimizer"],
                "ref_weights": state["weights"] if self.cfg.needs_ref and lora is None else 0,
                "activations": self._activations(m, dims, pp_rank, update, sequence_parallel=sp,
                                                 recompute=arr.actor.recompute_granularity,
                                                 block=arr.actor.recompute_num_layers),
                "logits": self._logits(update, dims.tp) if last else 0,
                "forward": self._forward_layer(m, dims, forward, sequence_parallel=sp)
                + (self._logits(forward, dims.tp) if last else 0)}
        # The roles' state leaves the GPU by their offload flags before the engines start (role_memory).
        actor = arr.actor
        at_start = (0 if actor.param_offload else state["weights"]) + (0 if actor.grad_offload else state["grads"]) \
            + (0 if actor.optimizer_offload else state["optimizer_at_start"]) \
            + (0 if arr.ref.param_offload else rows["ref_weights"])
        return rows | {"_at_start": at_start, "_optimizer_host": state["optimizer_host"]}

    def _scorer_rows(self, role: str, bundle: int) -> dict[str, int]:
        """A scoring model's weights (its ``model.dtype``) and its forward's working memory (its
        :class:`~megarl.workers.roles.RoleSpec`'s ``forward``): its largest layer and, for a role that computes
        log-probs (the teacher), its logits on its last stage."""
        spec = SPEC_OF[role]
        m, section = self.scorers[role], spec.section_of(self.cfg)
        dims = self.placement.role(role).dims
        _, _, _, pp_rank = megatron_coordinates(bundle, dims)
        counts = m.rank_param_counts(tp=dims.tp, pipeline=dims, pp_rank=pp_rank, ep=dims.ep,
                                     etp=dims.expert_tp, value_head=spec.value_head)
        weights = counts.total * DTYPE_BYTES[section.model.dtype]
        sizing = spec.forward(self.cfg)
        forward = self._micro(dims, section.model.use_remove_padding, rows=sizing.rows or 16, dynamic=sizing.dynamic,
                              budget=sizing.budget)
        logits = self._logits(forward, dims.tp, m) if spec.logits and pp_rank == dims.pp - 1 else 0
        resident = 0 if section.param_offload else weights
        return {f"{role}_weights": weights, f"_{role}_resident": resident,
                f"{role}_forward": self._forward_layer(m, dims, forward, sequence_parallel=dims.sequence_parallel)
                + logits, "_at_start": resident}

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
                "_at_start": sum(state["optimizer_at_start" if k == "optimizer" else k] for k, flag in off.items()
                                 if not flag),
                "_optimizer_host": state["optimizer_host"]}

    def host_optimizer_bytes(self) -> dict[int, int]:
        """Node -> bytes of optimizer state Megatron's hybrid optimizer keeps in that node's host memory (the
        training pool's actor and critic ranks; empty without ``optimizer_cpu_offload``)."""
        pool = self.placement.pools[self.placement.role("actor").pool]
        out: dict[int, int] = {}
        for bundle in range(pool.size):
            held = self._actor_rows(bundle)["_optimizer_host"]
            if self.critic_model is not None:
                held += self._critic_rows(bundle)["_optimizer_host"]
            if held:
                out[pool.node_of(bundle)] = out.get(pool.node_of(bundle), 0) + held
        return out

    # ------------------------------------------------------------------------------- engines
    def _engine_weights(self) -> int:
        """Bytes of the engine's weights on one of its GPUs."""
        m = self.model
        if self.arr.rollout.name == "hf":
            lora = m.lora_peft_param_count(self.arr.model.lora_spec) if self.cfg.lora_syncs_adapters else 0
            return (m.num_params + lora) * self.engine_bytes
        from megarl.models.family import sglang_padded_vocab

        n = m.rank_params(tp=self.engine_tp, padded_vocab=sglang_padded_vocab(m.vocab, self.engine_tp))
        if self.cfg.lora_syncs_adapters:  # SGLang's LoRA slot (--max-loras-per-batch 1), allocated at its start
            n += m.lora_peft_param_count(self.arr.model.lora_spec) // self.engine_tp
        if self.arr.rollout.quantization == "fp8":  # the linear weights in 1 byte, an fp32 scale per 128 x 128 block
            fp8 = m.engine_fp8_params(self.engine_tp)
            return (n - fp8) * self.engine_bytes + fp8 + 4 * math.ceil(fp8 / (128 * 128))
        return n * self.engine_bytes

    def _recurrent_state(self) -> int:
        """Bytes per engine GPU of its share of the batch's linear-attention states (0 without linear attention)."""
        rows = math.ceil(self.cfg.data.train_batch_size * self.arr.rollout.n / len(self.placement.engines))
        tp = self.engine_tp if self.arr.rollout.name == "sglang" else 1
        return rows * self.model.recurrent_bytes_per_sequence(tp, self.engine_bytes)

    def _hf_engine_kv(self) -> int:
        rows = math.ceil(self.cfg.data.train_batch_size * self.arr.rollout.n / len(self.placement.engines))
        return rows * self.seq * self.model.kv_bytes_per_token(1, self.engine_bytes)

    # ----------------------------------------------------------------------------------- GPUs
    def gpus(self, sync_buffers: dict[int, int], engine_buffer: int) -> tuple[GpuPlan, ...]:
        """Each kind of GPU's rows and phases. ``sync_buffers``: each actor rank's weight-sync buffers (bytes, by
        training-pool bundle); ``engine_buffer``: what a rollout-pool GPU receives a bucket into."""
        per_gpu = self._base_rows(sync_buffers, engine_buffer)
        kv = self._kv({(p, b): rows for p, b, _, rows in per_gpu})
        engine_weights = self._engine_weights()
        kv_bytes_per_token = self.model.kv_bytes_per_token(self.engine_tp, self.engine_bytes)
        training_pool = self.placement.role("actor").pool
        engine_gpus = {(e.pool, b): e.index for e in self.placement.engines for b in e.bundles}
        plans = []
        for pool_name, bundle, node, rows in per_gpu:
            index = engine_gpus.get((pool_name, bundle))
            at_start = rows["_at_start"] + rows["cuda_context"]
            tokens = None
            if index is not None:
                rows["engine_weights"] = engine_weights
                # a hybrid's linear-attention state: one per sequence of the engine's share of the batch, carved out
                # of SGLang's pool (its mamba cache) before the KV cache, beside the hf engine's batch share
                rows["recurrent_state"] = self._recurrent_state()
                rows["kv_cache"] = max(kv[index] - (rows["recurrent_state"] if self.arr.rollout.name == "sglang"
                                                    else 0), 0)
                rows["cuda_context"] += CUDA_CONTEXT_BYTES
                per_token = kv_bytes_per_token if self.arr.rollout.name == "sglang" else \
                    self.model.kv_bytes_per_token(1, self.engine_bytes)
                tokens = rows["kv_cache"] // per_token
            label = self._label(pool_name, bundle, index)
            plans.append((pool_name, bundle, node, label, rows,
                          self._phases(rows, pool_name == training_pool), tokens,
                          self.arr.rollout.name if index is not None else None, at_start))
        return _group(plans)

    def _base_rows(self, sync_buffers: dict[int, int],
                   engine_buffer: int) -> list[tuple[str, int, int, dict[str, int]]]:
        """``(pool, bundle, node, rows)`` of every GPU before the engines: the training state on the training
        pool, the sync buffers everywhere."""
        per_gpu: list[tuple[str, int, int, dict[str, int]]] = []
        training_pool = self.placement.role("actor").pool
        pool = self.placement.pools[training_pool]
        for bundle in range(pool.size):
            rows = {key: 0 for key in ROWS} | self._actor_rows(bundle)
            if self.critic_model is not None:
                critic = self._critic_rows(bundle)
                rows |= {k: v for k, v in critic.items() if k != "_at_start"}
                rows["_at_start"] += critic["_at_start"]
            for role in self.scorers:
                scorer = self._scorer_rows(role, bundle)
                rows |= {k: v for k, v in scorer.items() if k != "_at_start"}
                rows["_at_start"] += scorer["_at_start"]
            rows["sync_buffers"] = sync_buffers[bundle]
            processes = 1 + (self.critic_model is not None) + len(self.scorers)
            rows["cuda_context"] = processes * CUDA_CONTEXT_BYTES
            per_gpu.append((training_pool, bundle, pool.node_of(bundle), rows))
        if not self.colocated:
            rollout_pool = self.placement.pools[self.placement.role("rollout").pool]
            for bundle in range(rollout_pool.size):
                rows = {key: 0 for key in ROWS} | {"_at_start": 0, "sync_buffers": engine_buffer}
                per_gpu.append((rollout_pool.name, bundle, rollout_pool.node_of(bundle), rows))
        return per_gpu

    def _kv(self, by_key: dict[tuple[str, int], dict[str, int]]) -> dict[int, int]:
        """Each engine's KV cache (bytes per GPU; below 0 when nothing is left for it)."""
        engine_weights = self._engine_weights()
        kv = {}
        for engine in self.placement.engines:
            if self.arr.rollout.name == "hf":
                kv[engine.index] = self._hf_engine_kv()
                continue
            used = max(by_key[(engine.pool, b)]["_at_start"] + by_key[(engine.pool, b)]["cuda_context"]
                       for b in engine.bundles)
            fraction = self.arr.rollout.gpu_memory_utilization
            kv[engine.index] = int(fraction * self.memory) - used - CUDA_CONTEXT_BYTES - engine_weights
        return kv

    def _label(self, pool_name: str, bundle: int, engine: int | None) -> str:
        parts = []
        if pool_name == self.placement.role("actor").pool:
            dims = self.actor_dims
            if dims.pp > 1:
                role = "actor " if self.critic_dims is not None else ""
                parts.append(f"{role}stage {megatron_coordinates(bundle, dims)[3]}")
            if self.critic_dims is not None and self.critic_dims.pp > 1:
                parts.append(f"critic stage {megatron_coordinates(bundle, self.critic_dims)[3]}")
            for role in self.scorers:
                dims = self.placement.role(role).dims
                if dims.pp > 1:
                    parts.append(f"{role.replace('_', ' ')} stage {megatron_coordinates(bundle, dims)[3]}")
            if not parts:
                parts.append("actor")
        else:
            parts.append("rollout pool")
        if engine is not None:
            parts.append("engine")
        return ", ".join(parts)

    def _phases(self, rows: dict[str, int], training: bool) -> dict[str, dict[str, int]]:
        """Phase -> the rows it holds (bytes each); a phase's total is their sum."""
        engine = {"engine_weights": rows["engine_weights"], "kv_cache": rows["kv_cache"],
                  "recurrent_state": rows["recurrent_state"]}
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
        # What stays between its own phases: the critic's (by its offload flags) and the teacher's weights (unless
        # teacher.param_offload: then only in its forward).
        critic_resident = {"critic_state": rows.get("_critic_resident", 0)} | {
            f"{role}_weights": rows.get(f"_{role}_resident", 0) for role in self.scorers}
        kept = resumed if self.colocated and not arr.rollout.free_cache_engine else {}
        if self.colocated and arr.rollout.free_cache_engine and self.cfg.lora_syncs_adapters:
            # An adapters-only sync never rewrites the base: the engines keep their weights through training
            # (EngineMemory), since SGLang's released weights come back as garbage.
            kept = {"engine_weights": rows["engine_weights"]}
        onloaded = base | actor_full | {"ref_weights": rows["ref_weights"]}
        phases = {"rollout": base | actor_resident | critic_resident | engine,
                  "log-probs": onloaded | critic_resident | kept | {"forward": rows["forward"]}}
        for role in self.scorers:  # the teacher's log-probs, the reward model's scores: in the step, in turn
            phases[SPEC_OF[role].serves] = onloaded | critic_resident | kept | {
                f"{role}_weights": rows[f"{role}_weights"], f"{role}_forward": rows[f"{role}_forward"]}
        if self.critic_model is not None:
            phases["values"] = onloaded | critic_resident | critic_full | kept | {"critic_forward": rows["critic_forward"]}
            phases["update critic"] = onloaded | critic_resident | critic_full | kept | {
                "critic_activations": rows["critic_activations"]}
        phases["update actor"] = onloaded | critic_resident | kept | {"activations": rows["activations"],
                                                                       "logits": rows["logits"]}
        # Before a sync the actor's update state leaves by its offload flags (role_memory): its weights stay.
        synced = base | {"actor_weights": rows["actor_weights"]} | {
            k: v for k, v in (actor_resident | {"actor_weights": 0}).items() if v}
        phases["weight sync"] = synced | critic_resident | resumed | {"sync_buffers": rows["sync_buffers"]}
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
