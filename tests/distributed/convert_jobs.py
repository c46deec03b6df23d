"""Rank-side jobs for the converter tests (imported by spawned ranks), and tiny HF checkpoints."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

VOCAB = 250
SEQ = 10


def tiny_hf_config(family_name: str):
    """Tiny configs with the features each family must get right."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, rms_norm_eps=1e-6,
                  max_position_embeddings=256)
    if family_name == "llama":  # GQA, untied
        return LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                           architectures=["LlamaForCausalLM"])
    if family_name == "qwen2":  # q/k/v biases, tied
        return Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           architectures=["Qwen2ForCausalLM"])
    if family_name == "qwen3":  # q/k norms, explicit head_dim
        return Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                           tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    raise ValueError(family_name)


def save_tiny_hf_model(family_name: str, directory, seed: int = 0):
    """A random HF model (norms and biases randomised too) saved with save_pretrained."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family_name)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.5 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _gather_tp(local, group, tp):
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _megatron_logits(chunks, groups, input_ids):
    from megarl.parallel import forward_backward

    micro_batches = [{"input_ids": row} for row in input_ids.split(1)]  # interleaving needs >= pp
    out = forward_backward(chunks, micro_batches, forward_only=True, vocab_size=VOCAB, return_logits=True)
    if not groups.is_last_stage:
        return None
    logits = torch.cat([o["logits"] for o in out])
    return _gather_tp(logits, groups.tp, groups.dims.tp)[..., :VOCAB]


def sglang_slice(name: str, full: torch.Tensor, tp_rank: int, tp: int, padded_vocab: int) -> torch.Tensor:
    """What SGLang's TP rank holds of an HF tensor, written independently of megarl.convert."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per_rank = padded_vocab // tp
        return full[tp_rank * per_rank : min((tp_rank + 1) * per_rank, full.shape[0])]
    if re.search(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name):
        return full.chunk(tp, dim=0)[tp_rank]
    if re.search(r"(o_proj|down_proj)\.weight$", name):
        return full.chunk(tp, dim=1)[tp_rank]
    return full  # norms are replicated


def convert_job(cases: dict, ckpt_root: str) -> dict:
    """Per family: load HF at TP2×PP2, compare logits, export (full, shards, VPP), checkpoint reload."""
    from safetensors.torch import load_file

    from megarl.convert import WeightExporter, load_dist_checkpoint, load_hf_into, save_dist_checkpoint
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, init_parallel

    out = {}
    for family_name, (hf_dir, input_ids, expected) in cases.items():
        cfg = tiny_hf_config(family_name)
        family = family_for(cfg)
        original = load_file(f"{hf_dir}/model.safetensors")
        result = out[family_name] = {}

        groups = init_parallel(ParallelDims(tp=2, pp=2))
        chunks = build_model_chunks(family, cfg, groups.dims)
        result["bytes_read"] = load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
        logits = _megatron_logits(chunks, groups, input_ids)
        result["logits_diff"] = None if logits is None else (logits - expected).abs().max().item()

        exporter = WeightExporter(chunks, family, cfg, groups)
        buckets = list(exporter.iter_full(bucket_bytes=64 * 1024, reuse_buffer=False))
        exported = dict(kv for bucket in buckets for kv in bucket)
        result["num_buckets"] = len(buckets)
        result["max_bucket_bytes"] = max(sum(t.numel() * t.element_size() for _, t in b) for b in buckets)
        result["names_equal"] = sorted(exported) == sorted(original)
        result["order"] = [n for b in buckets for n, _ in b]
        result["bit_exact"] = all(torch.equal(exported[n], original[n]) for n in original if n in exported)

        padded = family.padded_vocab_size(cfg, 2)
        shards = {n: t.clone() for bucket in exporter.iter_shards(bucket_bytes=64 * 1024) for n, t in bucket}
        result["shard_names_equal"] = sorted(shards) == sorted(original)
        result["shards_equal_slices"] = all(
            torch.equal(shards[n], sglang_slice(n, exported[n], groups.tp_rank, 2, padded)) for n in shards
        )

        ckpt = f"{ckpt_root}/{family_name}"
        save_dist_checkpoint(chunks, ckpt)
        for tp, pp, vpp in [(1, 2, None), (2, 2, 2)]:
            groups = init_parallel(ParallelDims(tp=tp, pp=pp, vpp=vpp))
            chunks = build_model_chunks(family, cfg, groups.dims)
            load_dist_checkpoint(chunks, ckpt)
            logits = _megatron_logits(chunks, groups, input_ids)
            key = f"reload_tp{tp}_pp{pp}_vpp{vpp}"
            result[key + "_logits_diff"] = None if logits is None else (logits - expected).abs().max().item()
            again = {n: t.clone() for b in WeightExporter(chunks, family, cfg, groups).iter_full(1 << 20) for n, t in b}
            result[key + "_bit_exact"] = sorted(again) == sorted(original) and all(
                torch.equal(again[n], original[n]) for n in original
            )
    return out
