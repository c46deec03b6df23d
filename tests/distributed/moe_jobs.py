"""Rank-side jobs of the mixture-of-experts tests (imported by spawned ranks), and tiny HF MoE checkpoints."""

from __future__ import annotations

import torch

from tests.distributed.convert_jobs import _megatron_logits

VOCAB = 250


def tiny_moe_config(name: str):
    """Tiny MoE configs with the features each family must get right (random weights, saved with save_pretrained)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)
    if name == "qwen3_moe":  # renormalised top-k, one dense layer
        return Qwen3MoeConfig(**common, head_dim=12, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                              architectures=["Qwen3MoeForCausalLM"])
    if name == "qwen3_moe_softmax":  # top-k weights of the full softmax (not renormalised)
        return Qwen3MoeConfig(**common, head_dim=12, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=False, architectures=["Qwen3MoeForCausalLM"])
    if name == "mixtral":
        return MixtralConfig(**common, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                             architectures=["MixtralForCausalLM"])
    raise ValueError(name)


MOE_CONFIGS = ("qwen3_moe", "qwen3_moe_softmax", "mixtral")


def save_tiny_moe(name: str, directory, seed: int = 0):
    """A random HF MoE model (norms randomised too; router weights scaled so routing is decisive) saved as the hub
    holds it (one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(name)).float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.5 + 1.0)
            elif param_name.endswith("gate.weight"):
                param.copy_(torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_moe_logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def ep1_job(cases: dict) -> dict:
    """One rank: per config, the Megatron model's parameter count, its logits against HF's, and the streaming
    export against the saved checkpoint (names and bits)."""
    from safetensors.torch import load_file

    from megarl.convert import WeightExporter, load_hf_into
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, init_parallel

    out = {}
    groups = init_parallel(ParallelDims(tp=1, pp=1))
    for name, (hf_dir, input_ids, expected, hf_params) in cases.items():
        cfg = tiny_moe_config(name)
        family = family_for(cfg)
        chunks = build_model_chunks(family, cfg, groups.dims)
        padded = family.padded_vocab_size(cfg, tp=1)
        params = sum(p.numel() for c in chunks for p in c.parameters()) - 2 * (padded - VOCAB) * cfg.hidden_size
        load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
        logits = _megatron_logits(chunks, groups, input_ids)
        original = load_file(f"{hf_dir}/model.safetensors")
        exported = {n: t.clone() for b in WeightExporter(chunks, family, cfg, groups).iter_full(1 << 16) for n, t in b}
        out[name] = {"family": family.name, "params": params, "hf_params": hf_params,
                     "logits_diff": (logits - expected).abs().max().item(),
                     "names_equal": sorted(exported) == sorted(original),
                     "bit_exact": all(torch.equal(exported[n], original[n]) for n in original if n in exported)}
    return out


EP_LAYOUTS = {  # name -> ParallelDims kwargs, on 4 ranks
    "ep2": dict(ep=2),
    "ep4": dict(ep=4),
    "ep2_pp2": dict(ep=2, pp=2),
    "tp2_ep2_sp": dict(tp=2, ep=2, sequence_parallel=True),
    "tp2_ep2_etp1_sp": dict(tp=2, ep=2, etp=1, sequence_parallel=True),
}


def ep_logits_job(cases: dict, layouts: dict) -> dict:
    """On 4 ranks, per config and layout: Megatron's logits (from the HF checkpoint, each rank reading its experts)
    against HF's, and how many experts of each sparse layer this rank holds."""
    from megarl.convert import load_hf_into
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, init_parallel

    out = {}
    for layout, kwargs in layouts.items():
        groups = init_parallel(ParallelDims(**kwargs))
        for name, (hf_dir, input_ids, expected, _) in cases.items():
            cfg = tiny_moe_config(name)
            family = family_for(cfg)
            chunks = build_model_chunks(family, cfg, groups.dims)
            load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
            logits = _megatron_logits(chunks, groups, input_ids)
            experts = {n for c in chunks for n, _ in c.named_parameters() if ".local_experts." in n}
            out[f"{name}/{layout}"] = {
                "logits_diff": None if logits is None else (logits - expected).abs().max().item(),
                "ep_rank": groups.ep_rank, "local_expert_params": len(experts)}
    return out
