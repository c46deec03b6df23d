"""Rank-side job of the 2026 families' parallel checks, and their tiny HF checkpoints: one 4-rank job runs every
family at every layout through megarl's trainer (``ShardedModel``: the loader, packing, the PPO step, the export)."""

from __future__ import annotations

import torch

from tests.distributed.sharded_model_jobs import NUM_ROWS, SEQ, _rows, hf_logprobs, make_batch

VOCAB = 250
HYBRID = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def tiny_config(name: str):
    """Tiny configs with what each family must get right (random weights, saved with ``save_pretrained``)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    hybrid = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, layer_types=HYBRID)
    if name == "qwen3_5":  # Gated DeltaNet in 3 of 4 layers, gated attention, zero-centred norms, rotary on 1/4
        return Qwen3_5TextConfig(**common, **hybrid, intermediate_size=40, architectures=["Qwen3_5ForCausalLM"])
    if name == "qwen3_5_moe":  # the same with 4 experts (2 per token) and a gated shared expert in every layer
        return Qwen3_5MoeTextConfig(**common, **hybrid, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                    num_experts=4, num_experts_per_tok=2, architectures=["Qwen3_5MoeForCausalLM"])
    if name == "qwen3_next":  # the hybrid with projections fused per key head, a dense layer among sparse ones
        return Qwen3NextConfig(**common, **hybrid, intermediate_size=40, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                               norm_topk_prob=True, mlp_only_layers=[1], architectures=["Qwen3NextForCausalLM"])
    raise ValueError(name)


FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def save_tiny(name: str, directory, seed: int = 0):
    """A random HF model of ``name`` (norms, decays and routers randomised so that each matters) saved as the hub
    holds it; its tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import build_tiny_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name)).float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):  # zero-centred (1 + w) but the Gated DeltaNet's plain norm
                param.copy_(torch.randn_like(param) * 0.3 + (1.0 if ".linear_attn.norm." in param_name else 0.0))
            elif param_name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif param_name.endswith("gate.weight"):
                param.copy_(torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    if name == "qwen3_next":  # as the hub's: a multi-token-prediction module under mtp.* (not part of the model)
        from safetensors.torch import load_file, save_file

        path, hidden = f"{directory}/model.safetensors", model.config.hidden_size
        tensors = load_file(path)
        tensors.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.randn(hidden),
                        "mtp.layers.0.input_layernorm.weight": torch.randn(hidden)})
        save_file(tensors, path, metadata={"format": "pt"})
    build_tiny_tokenizer(VOCAB).save_pretrained(directory)
    return model


def reference(name: str, directory) -> tuple[dict, torch.Tensor]:
    """``name``'s checkpoint saved under ``directory``, the test batch and HF transformers' log-probs of it."""
    model = save_tiny(name, directory)
    batch = make_batch(VOCAB)
    return batch, hf_logprobs(model, batch)


LAYOUTS = {  # (tp, pp, ep, sequence_parallel, packed) on 4 ranks; dp = 4 / (tp·pp)
    "qwen3_5": [(1, 1, 1, False, False), (1, 1, 1, False, True), (2, 1, 1, True, True), (1, 2, 1, False, True),
                (2, 1, 1, True, False)],
    "qwen3_5_moe": [(1, 1, 1, False, False), (1, 1, 1, False, True), (1, 1, 2, False, True), (2, 1, 2, True, True),
                    (1, 2, 2, False, True)],
    "qwen3_next": [(1, 1, 1, False, False), (1, 1, 1, False, True), (2, 1, 2, True, True)],
}
"""Per family, the reference (DP=4, padded) first."""


def family_job(cases: dict) -> dict:
    """``cases``: family -> (HF directory, batch). Per family and layout: the log-probs of every row, one PPO step
    (loss, grad norm, the weights after it through the streaming export)."""
    return {(name, layout): _step(hf_dir, batch, layout) for name, (hf_dir, batch) in cases.items()
            for layout in LAYOUTS[name]}


def _step(hf_dir: str, batch: dict, layout) -> dict:
    from megarl.algo.losses import agg_norm, policy_loss
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel
    from tests.distributed.packing_cp_jobs import _gather_rows

    tp, pp, ep, sp, packed = layout
    sharded = ShardedModel(hf_dir, ParallelDims(tp=tp, pp=pp, ep=ep, sequence_parallel=sp),
                           optim=OptimConfig(lr=1e-3, eps=1e-3, clip_grad=1.0), packed=packed)
    groups = sharded.groups
    mine = list(range(groups.dp_rank, NUM_ROWS, groups.dims.dp))
    fwd = sharded.forward_logprobs([_rows(batch, slice(i, i + 1)) for i in mine], temperature=1.0)
    logp = torch.zeros(NUM_ROWS, SEQ)
    if fwd is not None:
        for i, out in zip(mine, fwd):
            logp[i] = out["logp"][0]
    full = _gather_rows(fwd is not None and groups.tp_rank == 0, mine, logp)
    global_norm = agg_norm(batch["loss_mask"], "token-mean")

    def loss_fn(logp_BS, entropy_BS, mb):
        return policy_loss(logp_BS, mb["old_logp"], mb["advantages"], mb["loss_mask"], loss_agg_mode="token-mean",
                           global_norm=global_norm, entropy_BT=entropy_BS, entropy_coeff=0.01)

    old = full + batch["old_logp_shift"]
    step = sharded.train_step([{**_rows(batch, slice(i, i + 1)), "old_logp": old[i : i + 1]} for i in mine], loss_fn)
    exporter = sharded.exporter()
    weights = {n: t.clone() for b in exporter.iter_full(1 << 22) for n, t in b}
    # What the broadcast transport asks (TP rank 0 of each stage, its stage's tensors; small buckets): the same bits
    stage = {n: t.clone() for bucket in exporter.iter_buckets(1 << 14, to_pp_ranks=(), tp_ranks=(0,))
             for n, t in bucket.named()}
    held = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, (sorted(stage), all(torch.equal(t, weights[n]) for n, t in stage.items())))
    return {"logp": full, "loss": step.loss, "grad_norm": step.grad_norm, "applied": step.applied,
            "weights": weights if groups.rank == 0 else None,
            "stage_names": sorted({n for names, _ in held for n in names}),
            "stage_export_exact": all(exact for _, exact in held)}
