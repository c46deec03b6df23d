"""Rank-side jobs for the model-parallel parity tests (imported by spawned ranks).

One 4-rank job checks every layout against a TP=1/PP=1 reference holding the same weights:
logits, log-probs, and gradients after Megatron DDP's finalisation, per model family. The
reference replicas and the parallel layouts re-initialise Megatron's groups in the same
processes, which also exercises ``destroy_parallel``.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 250
SEQ = 12
MICRO_BATCH = 2
NUM_MICRO_BATCHES = 4  # global, split over DP ranks
TEMPERATURE = 0.7
LAYOUTS = [(2, 1, None), (1, 2, None), (2, 2, None), (2, 2, 2)]
# One optimizer step with clipping active and weight decay, as megarl's actor takes it.
# Adam's first step is lr × g / (|g| + eps): with a tiny eps, gradient entries near 0 turn
# 1e-8-level summation-order noise into lr-sized differences; eps = 1e-3 keeps the comparison
# well-conditioned (sensitivity lr / eps = 10 per unit of gradient difference).
LR, WEIGHT_DECAY, CLIP_GRAD, BETAS, EPS = 1e-2, 0.1, 0.05, (0.9, 0.95), 1e-3


def hf_config(family_name: str):
    """Small but structurally faithful HF configs built with transformers' own classes."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, rms_norm_eps=1e-6)
    if family_name == "llama":  # GQA, untied, Llama 3 RoPE scaling
        return LlamaConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            architectures=["LlamaForCausalLM"],
        )
    if family_name == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            architectures=["Qwen2ForCausalLM"],
        )
    if family_name == "qwen3":  # q/k norms, head_dim not hidden/heads
        return Qwen3Config(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
            architectures=["Qwen3ForCausalLM"],
        )
    raise ValueError(family_name)


def micro_batches(seed: int = 7) -> list[dict]:
    """Micro-batches with left padding, right padding and full rows, and per-token weights."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(NUM_MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
        mask = torch.ones(MICRO_BATCH, SEQ, dtype=torch.long)
        mask[0, :3] = 0  # left-padded prompt
        mask[1, -2:] = 0  # right-padded response
        out.append({"input_ids": ids, "attention_mask": mask, "weights": torch.randn(MICRO_BATCH, SEQ, generator=gen)})
    return out


def loss_fn(logp, entropy, mb):
    """A fixed linear functional of log-probs and entropy over valid next-token positions."""
    valid = mb["attention_mask"].clone().float()
    valid[:, :-1] *= mb["attention_mask"][:, 1:]  # the next token must be real too
    valid[:, -1] = 0
    norm = NUM_MICRO_BATCHES * MICRO_BATCH * SEQ  # a global normaliser, as megarl.algo passes
    loss = -(logp * mb["weights"] * valid).sum() / norm - 0.01 * (entropy * valid).sum() / norm
    return loss, {"num_valid": valid.sum()}


def _wrap_ddp(chunks, *, distributed_optimizer: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    return [
        DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def _target_tensor(full: torch.Tensor, param, name: str, tp_rank: int, tp: int, gated: bool) -> torch.Tensor:
    """Slice a TP=1 tensor into what ``param`` holds on ``tp_rank`` (vocab re-padded)."""
    if "word_embeddings" in name or "output_layer" in name:
        padded = torch.zeros(param.shape[0] * tp, *full.shape[1:], dtype=full.dtype)
        padded[:VOCAB] = full[:VOCAB]
        full = padded
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    if gated and name.endswith("linear_fc1.weight"):
        # Each TP shard of the fused SwiGLU weight holds its gate slice, then its up slice.
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]])
    return full.chunk(tp, dim=param.partition_dim)[tp_rank]


def _reference_name(name: str, offset: int, tied: bool) -> str:
    name = re.sub(r"^module\.", "", name)
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def _gather_tp(local: torch.Tensor, group, tp: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _reference(family, cfg):
    from megarl.models import build_model_chunks
    from megarl.parallel import ParallelDims, forward_backward, init_parallel

    groups = init_parallel(ParallelDims(tp=1, pp=1), seed=1234)
    (model,) = build_model_chunks(family, cfg, groups.dims)
    mbs = micro_batches()
    fwd = forward_backward([model], mbs, forward_only=True, temperature=TEMPERATURE, vocab_size=VOCAB, return_logits=True)
    forward_backward([model], mbs, loss_fn=loss_fn, temperature=TEMPERATURE, vocab_size=VOCAB)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return weights, grads, fwd, _reference_step(model)


def _reference_step(model) -> dict[str, torch.Tensor]:
    """Weights after one clipped AdamW step, no decay on biases and norms (Megatron's groups)."""
    params = list(model.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD))
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim == 1]
    decay = [p for p in params if all(p is not q for q in no_decay)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS,
    )
    optimizer.step()
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "grad_norm": norm}


def _padding_invariance(family, cfg, weights) -> float:
    """The log-probs of a row do not depend on how much padding surrounds it."""
    from megarl.models import build_model_chunks
    from megarl.parallel import ParallelDims, forward_backward, init_parallel

    groups = init_parallel(ParallelDims(tp=1, pp=1), seed=1234)
    (model,) = build_model_chunks(family, cfg, groups.dims)
    model.load_state_dict(weights, strict=False)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    plain = forward_backward([model], [{"input_ids": ids}], forward_only=True, vocab_size=VOCAB)[0]["logp"]
    padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids, torch.zeros(1, 2, dtype=torch.long)], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 8 + [0, 0]])
    padded = forward_backward(
        [model], [{"input_ids": padded_ids, "attention_mask": mask}], forward_only=True, vocab_size=VOCAB
    )[0]["logp"]
    return (plain[0, :7] - padded[0, 3:10]).abs().max().item()


def _load_chunks(family, cfg, groups, ref_weights):
    """Build this rank's chunks and copy the reference weights into them."""
    from megarl.models import build_model_chunks, layer_offset

    tp, tied = groups.dims.tp, bool(cfg.tie_word_embeddings)
    chunks = build_model_chunks(family, cfg, groups.dims)
    gated = chunks[0].config.gated_linear_unit
    names = {}
    with torch.no_grad():
        for chunk in chunks:
            offset = layer_offset(chunk)
            for name, param in chunk.named_parameters():
                ref_name = _reference_name(name, offset, tied)
                names[id(param)] = (name, ref_name)
                param.copy_(_target_tensor(ref_weights[ref_name], param, name, groups.tp_rank, tp, gated))
    return chunks, names, gated


def _layout_check(family, cfg, layout, ref_weights, ref_grads, ref_fwd, ref_stepped) -> dict:
    from megarl.parallel import ParallelDims, forward_backward, init_parallel

    tp, pp, vpp = layout
    groups = init_parallel(ParallelDims(tp=tp, pp=pp, vpp=vpp), seed=99)
    chunks, names, gated = _load_chunks(family, cfg, groups, ref_weights)
    mbs = micro_batches()
    result = {"layout": layout, "rank": groups.rank, "last_stage": groups.is_last_stage}

    fwd = forward_backward(chunks, mbs, forward_only=True, temperature=TEMPERATURE, vocab_size=VOCAB, return_logits=True,
                           groups=groups)
    if groups.is_last_stage:
        logits_diff = logp_diff = 0.0
        for got, ref in zip(fwd, ref_fwd, strict=True):
            full = _gather_tp(got["logits"], groups.tp, tp)[..., :VOCAB]
            valid = mbs[0]["attention_mask"].bool()  # same mask pattern in every micro-batch
            logits_diff = max(logits_diff, (full - ref["logits"][..., :VOCAB])[valid].abs().max().item())
            logp_diff = max(logp_diff, (got["logp"] - ref["logp"])[valid].abs().max().item())
        result.update(logits_diff=logits_diff, logp_diff=logp_diff)

    ddp_chunks = _wrap_ddp(chunks)
    my_mbs = mbs[groups.dp_rank :: groups.dims.dp]
    forward_backward(ddp_chunks, my_mbs, loss_fn=loss_fn, temperature=TEMPERATURE, vocab_size=VOCAB, groups=groups)
    result.update(_gradient_diff(chunks, names, ref_grads, groups, tp, gated))

    # Again from the same weights, with the distributed optimizer (gradients reduce-scattered).
    chunks, names, gated = _load_chunks(family, cfg, groups, ref_weights)
    ddp_chunks = _wrap_ddp(chunks, distributed_optimizer=True)
    forward_backward(ddp_chunks, my_mbs, loss_fn=loss_fn, temperature=TEMPERATURE, vocab_size=VOCAB, groups=groups)
    result.update(_step_diff(ddp_chunks, chunks, names, ref_stepped, groups, tp, gated))
    return result


def _gradient_diff(chunks, names, ref_grads, groups, tp, gated) -> dict:
    grad_diff, compared = 0.0, 0
    for chunk in chunks:
        for param in chunk.parameters():
            name, ref_name = names[id(param)]
            # Padded vocabulary rows get no gradient, as the zero-padded reference says.
            expected = _target_tensor(ref_grads[ref_name], param, name, groups.tp_rank, tp, gated)
            grad_diff = max(grad_diff, (param.main_grad - expected).abs().max().item())
            compared += 1
    return dict(grad_diff=grad_diff, params_compared=compared, params_total=sum(1 for c in chunks for _ in c.parameters()))


def _step_diff(ddp_chunks, chunks, names, ref_stepped, groups, tp, gated) -> dict:
    """One step of Megatron's distributed optimizer (sharded over DP) equals the reference step."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megarl.workers.sharded_model import fuse_torch_adam

    config = OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_eps=EPS, clip_grad=CLIP_GRAD, use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(config, ddp_chunks)
    fused = fuse_torch_adam(optimizer)  # as megarl's models take it: torch's fused AdamW kernel
    # The scheduler applies per-group weight-decay multipliers (none on biases and norms).
    OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=1,
        lr_decay_style="constant", start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY, wd_incr_steps=1,
        wd_incr_style="constant",
    )
    success, grad_norm, _ = optimizer.step()
    step_diff = 0.0
    for chunk in chunks:
        for param in chunk.parameters():
            name, ref_name = names[id(param)]
            # Padded vocabulary rows stay 0 (0 weight, 0 gradient), as in the zero-padded reference.
            expected = _target_tensor(ref_stepped["weights"][ref_name], param, name, groups.tp_rank, tp, gated)
            step_diff = max(step_diff, (param.detach() - expected).abs().max().item())
    return dict(step_ok=bool(success), grad_norm=float(grad_norm), ref_grad_norm=ref_stepped["grad_norm"],
                step_diff=step_diff, fused_optimizers=fused)


def parity_job(family_names: list[str]) -> dict:
    """Run on every rank: reference, then each layout; return this rank's measurements."""
    from megarl.models import FAMILIES

    started = time.monotonic()
    out = {"layouts": [], "padding": {}}
    for family_name in family_names:
        cfg = hf_config(family_name)
        family = FAMILIES[cfg.architectures[0]]
        ref_weights, ref_grads, ref_fwd, ref_stepped = _reference(family, cfg)
        out["padding"][family_name] = _padding_invariance(family, cfg, ref_weights)
        for layout in LAYOUTS:
            result = _layout_check(family, cfg, layout, ref_weights, ref_grads, ref_fwd, ref_stepped)
            out["layouts"].append({"family": family_name, **result})
    out["gloo"] = _gloo_threads()
    out["seconds"] = time.monotonic() - started
    return out


def _gloo_threads() -> dict:
    """This rank's gloo groups (Megatron's, made by the last layout) and its gloo event-loop threads."""
    from torch.distributed import distributed_c10d

    groups = [group for group in distributed_c10d._world.pg_map
              if distributed_c10d.get_backend(group) == "gloo"]
    names = [Path(comm).read_text().strip() for comm in Path(f"/proc/{os.getpid()}/task").glob("*/comm")]
    return {"groups": len(groups), "loop_threads": names.count("gloo_tcp_loop")}
