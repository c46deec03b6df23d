"""A model's sizes and what they imply: parameters per Megatron or engine rank, KV bytes per token.

:class:`Architecture` counts from an HF config and its family's weight rules (the same rules that
drive loading, export and weight sync), so a count is exact for megarl's layout: TP-split tensors
divided by ``tp``, replicated norms whole, the vocabulary padded as megarl pads it, and the
embedding / final norm / LM head on the first / last pipeline stage. No weights, no Megatron.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megarl.models.weights import Fuse, Split


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The sizes the plan needs, from an HF config, and its family's weight rules."""

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

    @classmethod
    def from_hf(cls, hf_config, *, name: str, source: str) -> Architecture:
        from megarl.models import family_for

        heads = int(hf_config.num_attention_heads)
        family = family_for(hf_config)
        if family.moe is not None:
            raise ValueError(f"{name} ({source}) is a mixture-of-experts model ({family.name}): megarl-plan does not "
                             f"model experts yet (memory by expert parallelism, all-to-all volume)")
        return cls(name=name, source=source, hf_config=hf_config, family=family,
                   num_layers=int(hf_config.num_hidden_layers), hidden=int(hf_config.hidden_size), heads=heads,
                   kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
                   ffn=int(hf_config.intermediate_size), vocab=int(hf_config.vocab_size),
                   tied=bool(getattr(hf_config, "tie_word_embeddings", False)))

    def hf_shape(self, template: str) -> tuple[int, ...]:
        """Shape of the HF tensor named ``template`` (``{i}`` for the layer)."""
        h, f, hd = self.hidden, self.ffn, self.head_dim
        q, kv = self.heads * hd, self.kv_heads * hd
        tail = template.rsplit("{i}.", 1)[-1]
        shapes = {
            "model.embed_tokens.weight": (self.vocab, h), "lm_head.weight": (self.vocab, h), "model.norm.weight": (h,),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        }
        return shapes[tail]

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the family exports (layers expanded), name -> shape."""
        out = {}
        for rule in self.family.weight_rules(self.hf_config):
            for layer in range(self.num_layers) if rule.per_layer else [None]:
                for template, name in zip(rule.hf, rule.hf_names(layer)):
                    out[name] = self.hf_shape(template)
        return out

    @property
    def num_params(self) -> int:
        """Parameters of the HF model (a tied LM head counted once)."""
        return sum(math.prod(s) for s in self.hf_shapes().values())

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

    def rank_params(self, *, tp: int, pp: int = 1, pp_rank: int = 0, value_head: bool = False,
                    padded_vocab: int | None = None) -> int:
        """Parameters one Megatron rank holds: its ``num_layers/pp`` layers, the embedding on stage 0,
        the final norm and LM head (or ``value_head``: ``Linear(h, 1)`` with bias) on the last stage."""
        vocab = self.family.padded_vocab_size(self.hf_config, tp) if padded_vocab is None else padded_vocab
        rules = self.family.weight_rules(self.hf_config)
        per_layer = sum(self._rank_numel(r, tp, vocab) for r in rules if r.per_layer)
        n = per_layer * self.num_layers // pp
        embedding = vocab // tp * self.hidden
        last = pp_rank == pp - 1
        if pp_rank == 0:
            n += embedding
        if last:
            n += sum(self._rank_numel(r, tp, vocab) for r in rules
                     if not r.per_layer and r.megatron.startswith("decoder."))  # the final norm
            if value_head:
                n += self.hidden + 1
            elif not self.tied or pp > 1:  # untied head, or Megatron's copy of a tied embedding
                n += embedding
        return n

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        """KV-cache bytes of one token on one GPU of an engine with TP ``tp``."""
        return 2 * self.num_layers * max(self.kv_heads // tp, 1) * self.head_dim * dtype_bytes


def architecture_for(path: str, *, key: str) -> Architecture:
    """The sizes of the model at ``path`` (config.json, else a known architecture); ``key`` names the setting."""
    from pathlib import Path

    from megarl.models.known import resolve_hf_config

    hf_config, source = resolve_hf_config(path, key=key)
    return Architecture.from_hf(hf_config, name=Path(str(path).rstrip("/")).name, source=source)
