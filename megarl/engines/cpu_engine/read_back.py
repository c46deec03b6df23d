"""What ``/get_weights_by_name`` answers, as SGLang 0.5.23 answers it.

SGLang reads a weight back only through its model class's ``get_weights_by_name``, and of the families megarl serves
only Llama's class (and Mistral's, derived from it) has one
(:attr:`megarl.models.family.ModelFamily.engine_reads_back`);
for every other model the route answers HTTP 400 ("Get parameter by name failed"). Llama's answers what its TP rank 0
holds, named by the checkpoint's names:

- a tensor SGLang stacks into one parameter (``stacked_params_mapping``: q/k/v into ``qkv_proj``, gate/up into
  ``gate_up_proj``) is the fused parameter narrowed at the part's rows, counted in heads of ``hidden_size //
  num_attention_heads`` (``num_attention_heads // tp`` query heads, ``num_key_value_heads // tp`` key/value heads)
  or in ``intermediate_size // tp`` rows: TP rank 0's slice of the part (none of a key/value part when the model
  has fewer key/value heads than TP ranks). An FP8 scale of such a tensor is narrowed by the same row counts, which
  do not fit the scale's block rows: refused;
- ``o_proj`` and ``down_proj`` (row-parallel) are gathered from every TP rank: whole;
- the embedding and an untied output layer are TP rank 0's shard of the vocabulary padded to a multiple of 64
  (``pad_vocab_size``); a tied ``lm_head.weight`` answers the embedding's;
- everything else (the norms) whole;

each as ``float32`` rows, the first ``truncate_size`` of them. A name the model has no parameter for is refused.
Every rule is read from sglang's ``llama.py`` by ``tests/unit/test_sglang_rules.py``.
"""

from __future__ import annotations

import aiohttp
import torch

STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
"""SGLang's ``LlamaForCausalLM.stacked_params_mapping``: (fused parameter, checkpoint name part, shard id)."""
GATHERED = ("o_proj", "down_proj")
"""Names whose parameter ``get_weights_by_name`` all-gathers over the TP ranks (along dim 1)."""
VOCAB_PADDING = 64
"""SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary rows are padded to a multiple of it, then sharded."""
SCALE_BLOCK = 128
"""Rows of a block-FP8 scale's block."""
INSPECT_ROUTE = "/megarl/inspect_weight"
"""megarl's CPU engine's own read of any weight as held (:func:`inspect_weight`): for tests and tools that look into
the engine, never for the weight sync, which reads back as SGLang lets it."""
FAILED = "Get parameter by name failed"
"""SGLang's answer (HTTP 400) when the model's ``get_weights_by_name`` returns nothing."""


class ReadBackRefused(ValueError):
    """A read-back SGLang's model would refuse (HTTP 400); the message says why."""


def answer(name: str, weights: dict[str, torch.Tensor], hf_config, *, tp: int, truncate: int) -> list:
    """The rows ``/get_weights_by_name`` answers for ``name`` from a Llama-class engine at TP ``tp`` whose weights
    (checkpoint names, unfused, whole) are ``weights``; :class:`ReadBackRefused` where SGLang returns nothing."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if name == "lm_head.weight" and tied:
        name = "model.embed_tokens.weight"
    for fused, part, shard in STACKED:
        if part in name:
            tensor = _stacked_part(name, fused, part, shard, weights, hf_config, tp)
            break
    else:
        if name not in weights:
            raise ReadBackRefused(f"{FAILED}: the model has no parameter {name!r}")
        tensor = weights[name]
        if tp > 1 and name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = -(-tensor.shape[0] // VOCAB_PADDING) * VOCAB_PADDING // tp
            tensor = torch.cat([tensor, tensor.new_zeros(max(0, rows - tensor.shape[0]), *tensor.shape[1:])])[:rows]
    return tensor[:truncate].float().cpu().tolist()


def _stacked_part(name: str, fused: str, part: str, shard, weights: dict[str, torch.Tensor], hf_config,
                  tp: int) -> torch.Tensor:
    """``narrow(0, offset, size)`` of TP rank 0's fused parameter, at the rows SGLang computes for ``part``."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if shard in ("q", "k", "v"):
        parts = (".q_proj", ".k_proj", ".v_proj")
        head_dim = hf_config.hidden_size // heads  # SGLang's, though a config's head_dim may differ
        sizes = {".q_proj": heads // tp * head_dim, ".k_proj": kv_heads // tp * head_dim,
                 ".v_proj": kv_heads // tp * head_dim}
    else:
        parts = (".gate_proj", ".up_proj")
        sizes = dict.fromkeys(parts, hf_config.intermediate_size // tp)
    names = [name.replace(part, p) for p in parts]
    if any(n not in weights for n in names):
        raise ReadBackRefused(f"{FAILED}: the model has no parameter {name.replace(part, fused)!r}")
    offset, size = sum(sizes[p] for p in parts[:parts.index(part)]), sizes[part]
    local = [weights[n][:_local_rows(n, weights[n], hf_config, tp)] for n in names]  # what TP rank 0 holds
    if name.endswith("_scale_inv") or name.endswith("weight_scale"):  # block rows, narrowed by weight rows
        weight_rows = sum(_local_rows(n, weights[n.rsplit(".", 1)[0] + ".weight"], hf_config, tp) for n in names)
        held = -(-weight_rows // SCALE_BLOCK)
        if offset + size > held:
            raise ReadBackRefused(f"{FAILED}: {name} narrows {name.replace(part, fused)} ({held} block rows) at rows "
                                  f"{offset}..{offset + size} (SGLang counts its part in weight rows)")
    fused_rows = torch.cat(local)
    if offset + size > fused_rows.shape[0]:
        raise ReadBackRefused(f"{FAILED}: rows {offset}..{offset + size} of {name.replace(part, fused)} "
                              f"({fused_rows.shape[0]} rows on TP rank 0)")
    return fused_rows[offset:offset + size]


def _local_rows(name: str, tensor: torch.Tensor, hf_config, tp: int) -> int:
    """Rows of a stacked part TP rank 0 holds (a block scale's: of its weight's rows, in blocks): q and gate/up
    ``1 / tp`` of them, k/v ``num_key_value_heads // tp`` heads or, with fewer heads than ranks, one (replicated)."""
    rows = tensor.shape[0]
    if ".k_proj" in name or ".v_proj" in name:
        kv_heads = hf_config.num_key_value_heads
        return rows // kv_heads * max(1, kv_heads // tp) if not name.endswith("scale_inv") else -(-rows // tp)
    return rows // tp


async def inspect_weight(url: str, name: str, rows: int | None = None) -> torch.Tensor:
    """Weight ``name`` whole (or its first ``rows``) as megarl's CPU engine server at ``url`` holds it, in its dtype;
    for tests and tools (SGLang has no such route)."""
    body = {"name": name} if rows is None else {"name": name, "rows": rows}
    async with aiohttp.ClientSession() as session, session.post(url + INSPECT_ROUTE, json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{url}{INSPECT_ROUTE} {name!r}: HTTP {reply.status}: {await reply.text()}")
        body = await reply.json()
    return torch.tensor(body["values"], dtype=torch.float32).to(getattr(torch, body["dtype"])).reshape(body["shape"])
