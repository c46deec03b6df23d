"""A model's sizes and what they imply: parameters per Megatron or engine rank, KV bytes per token.

:class:`Architecture` counts from an HF config and its family's weight rules (the same rules that
drive loading, export and weight sync, expanded per layer and expert by the family's
``weight_instances``), so a count is exact for megarl's layout: TP-split tensors divided by ``tp``,
replicated norms whole, the vocabulary padded as megarl pads it, and the embedding / final norm /
LM head on the first / last pipeline stage. Mixture-of-experts models: a sparse layer's router is
replicated, its experts are divided over ``ep`` ranks (contiguous blocks) and each expert's matrices
over ``etp`` ranks; :class:`RankParams` keeps the experts apart because the distributed optimizer
shards them over the expert-data-parallel ranks, not the data-parallel ones. No weights, no Megatron.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

from megarl.config.parallel import ParallelDims
from megarl.models.weights import Fuse, Split


class RankParams(NamedTuple):
    """Parameters one Megatron rank holds: expert tensors apart from the rest (``dense``: attention, norms,
    dense MLPs, routers, embedding and head), since each kind has its own data-parallel group."""

    dense: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The sizes the plan needs, from an HF config, and its family's weight rules.

    Mixture-of-experts models (``num_experts > 0``): ``topk`` experts of ``moe_ffn`` each per token in the
    layers ``sparse`` marks; ``ffn`` stays the dense MLP's size (the layers that keep one).
    """

    name: str
    source: str
    hf_config: Any
    family: Any
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    num_experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    sparse: tuple[bool, ...] = ()
    """Per layer: whether its MLP is a mixture of experts (empty: a dense model)."""

    @classmethod
    def from_hf(cls, hf_config, *, name: str, source: str) -> Architecture:
        from megarl.models import family_for

        heads = int(hf_config.num_attention_heads)
        family = family_for(hf_config)
        moe = {}
        if family.moe is not None:
            family.moe.check(hf_config)
            moe = {"num_experts": family.moe.num_experts(hf_config), "topk": family.moe.topk(hf_config),
                   "moe_ffn": family.moe.ffn_size(hf_config), "sparse": family.sparse_layers(hf_config)}
        return cls(name=name, source=source, hf_config=hf_config, family=family, **moe,
                   num_layers=int(hf_config.num_hidden_layers), hidden=int(hf_config.hidden_size), heads=heads,
                   kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
                   ffn=int(getattr(hf_config, "intermediate_size", None) or moe.get("moe_ffn", 0)),
                   vocab=int(hf_config.vocab_size),
                   tied=bool(getattr(hf_config, "tie_word_embeddings", False)))

    @property
    def attention_activations(self) -> dict[str, int]:
        """What a layer's attention keeps for its backward, in elements per token (the memory model's
        :func:`~megarl.plan.activations.activation_bytes_per_layer` arguments): ``attention``, split over TP: the
        queries, keys and values the attention kernel keeps and the output projection's input (Korthikanti et al.'s
        ``4 h`` for multi-head attention, kept for grouped queries too); ``latent``, a multi-latent attention's
        compressed query and key-value latents, each norm's input and output (``2 (q_lora_rank + kv_lora_rank)``),
        whole on every TP rank. Multi-latent attention's queries and keys are ``heads × (qk_nope + qk_rope)``
        wide and its values and output ``heads × v_head_dim``."""
        if self.family.mla is None:
            return {"attention": 4 * self.hidden, "latent": 0}
        c = self.hf_config
        qk, v = int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim), int(c.v_head_dim)
        latent = 2 * int(c.kv_lora_rank) + 2 * int(getattr(c, "q_lora_rank", None) or 0)
        return {"attention": self.heads * (2 * qk + 2 * v), "latent": latent}

    @property
    def is_moe(self) -> bool:
        """Whether some layer's MLP is a mixture of experts."""
        return any(self.sparse)

    @functools.cached_property
    def _hub_shapes(self) -> dict[str, tuple[int, ...]]:
        """Router and expert shapes by HF name, as the family's MoE spec gives them (one tensor per expert)."""
        return self.family.moe.hub_shapes(self.hf_config) if self.is_moe else {}

    def hf_shape(self, template: str) -> tuple[int, ...]:
        """Shape of the HF tensor named ``template`` (``{i}`` for the layer, ``{e}`` for the expert)."""
        h, f, hd = self.hidden, self.ffn, self.head_dim
        q, kv = self.heads * hd, self.kv_heads * hd
        vision = self.family.vision
        if vision is not None and template.startswith(vision.hf_prefix):
            return vision.tensor_shapes(self.hf_config)[template]
        tail = template.rsplit("{i}.", 1)[-1]
        if "{i}" not in template:  # the embedding, final norm and LM head, wherever the checkpoint keeps them
            tail = next((t for t in ("embed_tokens.weight", "lm_head.weight") if template.endswith(t)),
                        "norm.weight" if template.endswith(".norm.weight") else tail)
        shapes = {
            "embed_tokens.weight": (self.vocab, h), "lm_head.weight": (self.vocab, h), "norm.weight": (h,),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        }
        if self.family.attention.qk_norm_all_heads:  # one norm over all heads (megarl.models.attention)
            shapes.update({"self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,)})
        if self.family.attention.output_gate:  # q_proj makes each head's query and output gate
            shapes["self_attn.q_proj.weight"] = (2 * q, h)
        if self.family.linear_attention is not None:  # the Gated DeltaNet mixer (layer 0's names: each has them)
            shapes.update({name.split(".0.", 1)[1]: shape for name, shape in
                           self.family.linear_attention.hub_shapes(self.hf_config, 0, h).items()})
        if self.family.mla is not None:  # multi-latent attention's projections (layer 0's: every layer has them)
            shapes.update({name.split(".0.", 1)[1]: shape
                           for name, shape in self.family.mla.hub_shapes(self.hf_config, 0).items()})
        if tail in shapes:
            return shapes[tail]
        # A router or an expert tensor: the same at every sparse layer and expert, so the first one's.
        return self._hub_shapes[template.format(i=self.sparse.index(True), e=0)]

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the family exports (layers and experts expanded), name -> shape."""
        out = {}
        for at in self.family.weight_instances(self.hf_config):
            for template, name in zip(at.rule.hf, at.hf_names):
                out[name] = self.hf_shape(template)
        return out

    @property
    def num_params(self) -> int:
        """Parameters of the HF model (a tied LM head counted once)."""
        return sum(math.prod(s) for s in self.hf_shapes().values())

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return sum(math.prod(self.hf_shape(t)) for r in self.family.weight_rules(self.hf_config) if r.per_expert
                   for t in r.hf)

    @property
    def num_active_params(self) -> int:
        """Parameters a token passes through: all but the ``num_experts - topk`` experts of each sparse layer it is
        not routed to (the model cards' "activated parameters", embedding and LM head included)."""
        return self.num_params - sum(self.sparse) * (self.num_experts - self.topk) * self.expert_params

    def stage_layers(self, pipeline: ParallelDims | None = None, pp_rank: int = 0) -> list[int]:
        """The global layers pipeline rank ``pp_rank`` of the layout ``pipeline`` holds (its ``pp``, ``vpp`` and
        first/last stage sizes: :meth:`~megarl.config.parallel.ParallelDims.stage_layers`); None: every layer."""
        if pipeline is None:
            return list(range(self.num_layers))
        return pipeline.stage_layers(self.num_layers, pp_rank)

    def _rank_numel(self, rule, tp: int, padded_vocab: int) -> int:
        shapes = [self.hf_shape(t) for t in rule.hf]
        if rule.split is Split.VOCAB:
            return padded_vocab // tp * shapes[0][1]
        total = sum(math.prod(s) for s in shapes)
        if rule.split is Split.REPLICATED:
            return total
        if rule.fuse is Fuse.QKV and tp > self.kv_heads:  # engines replicate KV heads; Megatron refuses it
            q, k, _ = shapes
            return math.prod(q) // tp + 2 * math.prod(k) // self.kv_heads
        return total // tp

    def rank_params(self, *, tp: int, pipeline: ParallelDims | None = None, pp_rank: int = 0,
                    value_head: bool = False, padded_vocab: int | None = None, ep: int = 1,
                    etp: int | None = None) -> int:
        """Parameters one Megatron rank holds (:meth:`rank_param_counts`, experts included)."""
        return self.rank_param_counts(tp=tp, pipeline=pipeline, pp_rank=pp_rank, value_head=value_head,
                                      padded_vocab=padded_vocab, ep=ep, etp=etp).total

    def lora_param_count(self, spec, *, tp: int = 1, pipeline: ParallelDims | None = None, pp_rank: int = 0) -> int:
        """LoRA adapter parameters one rank holds (a :class:`~megarl.config.lora.LoraSpec`): per adapted layer of its
        stage, a column-parallel one (``linear_qkv``, ``linear_fc1``) holds ``A`` whole and ``1/tp`` of ``B``'s rows, a
        row-parallel one (``linear_proj``, ``linear_fc2``) ``1/tp`` of ``A``'s columns and ``B`` whole
        (:mod:`megarl.models.lora`). ``tp=1``, no ``pipeline``: the whole adapter set, what a sync of adapters moves."""
        gated = any(r.fuse.value == "gate_up" for r in self.family.weight_rules(self.hf_config))
        q = self.heads * self.head_dim
        shapes = {"linear_qkv": (self.hidden, q + 2 * self.kv_heads * self.head_dim, True),
                  "linear_proj": (q, self.hidden, False),
                  "linear_fc1": (self.hidden, (2 if gated else 1) * self.ffn, True),
                  "linear_fc2": (self.ffn, self.hidden, False)}
        per_layer = sum(spec.rank * (fan_in + fan_out // tp if column else fan_in // tp + fan_out)
                        for target, (fan_in, fan_out, column) in shapes.items() if target in spec.targets)
        return per_layer * len(self.stage_layers(pipeline, pp_rank))

    def lora_peft_param_count(self, spec) -> int:
        """The whole adapter set in PEFT's layout, what a sync of adapters moves (``rollout.lora_sync=adapters``): as
        :meth:`lora_param_count` at ``tp=1``, but ``A`` once per HF module of a fused layer (q, k, v; gate, up)."""
        gated = any(r.fuse.value == "gate_up" for r in self.family.weight_rules(self.hf_config))
        copies = {"linear_qkv": 2, "linear_fc1": 1 if gated else 0}
        extra = sum(spec.rank * self.hidden * n for target, n in copies.items() if target in spec.targets)
        return self.lora_param_count(spec) + extra * self.num_layers

    def rank_param_counts(self, *, tp: int, pipeline: ParallelDims | None = None, pp_rank: int = 0,
                          value_head: bool = False, padded_vocab: int | None = None, ep: int = 1,
                          etp: int | None = None) -> RankParams:
        """Parameters one Megatron rank holds: its layers (:meth:`stage_layers`), the embedding (and a vision-language
        model's vision tower, whole on every TP rank) on stage 0, the
        final norm and LM head (or ``value_head``: ``Linear(h, 1)`` with bias) on the last stage; in a sparse
        layer ``num_experts / ep`` experts, each split over ``etp`` ranks (None: ``tp``). An engine of TP ``t``
        without expert parallelism holds ``ep=1, etp=t``: every expert, each split over its ``t`` GPUs."""
        vocab = self.family.padded_vocab_size(self.hf_config, tp) if padded_vocab is None else padded_vocab
        etp = tp if etp is None else etp
        rules = self.family.weight_rules(self.hf_config)
        sparse = self.sparse or (False,) * self.num_layers
        dense = experts = 0
        pp = pipeline.pp if pipeline is not None else 1
        kinds = self.family.layer_attention(self.hf_config)
        for layer in self.stage_layers(pipeline, pp_rank):
            for rule in [r for r in rules if r.per_layer]:
                if not rule.applies_to(sparse[layer], kinds[layer]):
                    continue
                if rule.per_expert:
                    experts += self._rank_numel(rule, etp, vocab) * (self.num_experts // ep)
                else:
                    dense += self._rank_numel(rule, tp, vocab)
        n = dense
        embedding = vocab // tp * self.hidden
        last = pp_rank == pp - 1
        if pp_rank == 0:  # the embedding and a vision tower (replicated)
            n += embedding + sum(self._rank_numel(r, tp, vocab) for r in rules if not r.per_layer and r.first_stage)
        if last:
            n += sum(self._rank_numel(r, tp, vocab) for r in rules
                     if not r.per_layer and r.megatron.startswith("decoder."))  # the final norm
            if value_head:
                n += self.hidden + 1
            elif not self.tied or pp > 1:  # untied head, or Megatron's copy of a tied embedding
                n += embedding
        return RankParams(n, experts)

    def engine_fp8_params(self, tp: int) -> int:
        """Of the parameters one GPU of an engine with TP ``tp`` holds (every layer, every expert split over its
        ``tp`` GPUs), those FP8 rollout quantizes (:attr:`~megarl.models.weights.WeightRule.block_fp8`)."""
        vocab = self.family.padded_vocab_size(self.hf_config, tp)
        sparse = self.sparse or (False,) * self.num_layers
        total = 0
        kinds = self.family.layer_attention(self.hf_config)
        for layer in range(self.num_layers):
            for rule in self.family.weight_rules(self.hf_config):
                if rule.per_layer and rule.block_fp8 and rule.applies_to(sparse[layer], kinds[layer]):
                    total += self._rank_numel(rule, tp, vocab) * (self.num_experts if rule.per_expert else 1)
        return total

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        """KV-cache bytes of one token on one GPU of an engine with TP ``tp``; multi-latent attention caches the
        latent and the rotary key of each layer (``kv_lora_rank + qk_rope_head_dim``), whole on every TP rank."""
        if self.family.mla is not None:
            d = self.family.mla.dims(self.hf_config)
            return self.num_layers * (d["kv_lora"] + d["rope"]) * dtype_bytes
        return 2 * self.kv_layers * max(self.kv_heads // tp, 1) * self.head_dim * dtype_bytes

    @property
    def kv_layers(self) -> int:
        """The layers that cache keys and values (a hybrid's linear-attention layers keep a recurrent state per
        sequence instead: :meth:`recurrent_bytes_per_sequence`)."""
        from megarl.models.linear_attention import FULL

        return sum(kind == FULL for kind in self.family.layer_attention(self.hf_config))

    def recurrent_bytes_per_sequence(self, tp: int, dtype_bytes: int) -> int:
        """A hybrid's linear-attention state of one sequence on one GPU of an engine with TP ``tp``: per Gated
        DeltaNet layer, its value heads' ``key_dim × value_dim`` delta-rule state (fp32, as SGLang keeps it) and the
        convolution's last ``kernel - 1`` inputs of q, k and v (in ``dtype_bytes``); 0 without linear attention."""
        spec = self.family.linear_attention
        if spec is None:
            return 0
        h, n = spec.heads(self.hf_config), spec.named_sizes(self.hf_config)
        state = h["value_heads"] // tp * h["key_dim"] * h["value_dim"] * 4
        conv = (2 * n["linear_k"] + n["linear_v"]) // tp * (h["kernel"] - 1) * dtype_bytes
        return (self.num_layers - self.kv_layers) * (state + conv)


def architecture_for(path: str, *, key: str) -> Architecture:
    """The sizes of the model at ``path`` (config.json, else a known architecture); ``key`` names the setting."""
    from pathlib import Path

    from megarl.models.known import resolve_hf_config

    hf_config, source = resolve_hf_config(path, key=key)
    return Architecture.from_hf(hf_config, name=Path(str(path).rstrip("/")).name, source=source)
