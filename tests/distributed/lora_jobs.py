"""Rank-side job of the LoRA parity test (imported by spawned ranks): one 4-rank job builds the same adapted model
(random ``B``, so the adapters change the logits) at TP=1, TP=2, TP=2 with sequence parallelism, PP=2 and TP2×PP2,
and returns each layout's log-probs (adapters on and off), adapter gradients (whole, in PEFT's layout), the merged
HF export and what trained; at TP=1 also a fresh adapter's (B = 0) log-probs with the adapters on and off."""

from __future__ import annotations

import torch

LAYOUTS = {"tp1": dict(tp=1), "tp2": dict(tp=2), "tp2_sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
           "tp2_pp2": dict(tp=2, pp=2)}
NUM_MICRO_BATCHES = 4  # global, split over data-parallel ranks
ROWS, SEQ = 2, 16


def _micro_batches(vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(NUM_MICRO_BATCHES):
        ids = torch.randint(0, vocab, (ROWS, SEQ), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # some padding
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _loss(logp_BS, entropy_BS, micro_batch):
    mask = micro_batch["attention_mask"][:, 1:].to(logp_BS.dtype)
    return -(logp_BS[:, :-1] * mask).sum() / (NUM_MICRO_BATCHES * ROWS * SEQ), {}


def lora_parity_job(path: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.config import OptimConfig
    from megarl.config.lora import LoraSpec
    from megarl.convert.export import iter_hf_weights
    from megarl.convert.lora import adapter_tensors
    from megarl.models.lora import adapters_disabled
    from megarl.parallel import ParallelDims, destroy_parallel
    from megarl.workers.sharded_model import ShardedModel

    spec = LoraSpec(rank=4, alpha=8.0, init_b="random")
    out = {}
    for name, layout in LAYOUTS.items():
        dims = ParallelDims(**layout)
        model = ShardedModel(path, dims, optim=OptimConfig(lr=1e-2, use_distributed_optimizer=False, clip_grad=1e9),
                             seed=3, lora=spec, packed=False)
        micro = _micro_batches(model.hf_config.vocab_size)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        mine = list(range(dp_rank, NUM_MICRO_BATCHES, dp))
        logps = model.forward_logprobs([micro[i] for i in mine])
        with adapters_disabled(model.module_chunks):
            off = model.forward_logprobs([micro[i] for i in mine])
        merged = {n: t.clone() for bucket in iter_hf_weights(model.chunks, model.family, model.hf_config,
                                                              model.groups, 1 << 20) for n, t in bucket}
        before = adapter_tensors(model.chunks, model.family, model.hf_config)
        base = {n: p.detach().clone() for n, p in model.module_chunks[0].named_parameters() if not p.requires_grad}
        result = model.train_step([micro[i] for i in mine], _loss)
        trainable = [n for c in model.module_chunks for n, p in c.named_parameters() if p.requires_grad]
        optimized = sum(p.numel() for group in model.optimizer.param_groups for p in group["params"])
        out[name] = {
            "logp": {i: lp["logp"].float() for i, lp in zip(mine, logps)} if logps is not None else {},
            "logp_off": {i: lp["logp"].float() for i, lp in zip(mine, off)} if off is not None else {},
            "merged": merged if parallel_state.get_data_parallel_rank() == 0 else {},
            "adapters_before": before,
            "grads": adapter_tensors(model.chunks, model.family, model.hf_config, grads=True),
            "adapters": adapter_tensors(model.chunks, model.family, model.hf_config),
            "trainable": trainable,
            "optimized_numel": optimized,
            "adapter_numel": sum(p.numel() for c in model.module_chunks for n, p in c.named_parameters()
                                 if p.requires_grad),
            "base_unchanged": all(torch.equal(p, base[n]) for n, p in model.module_chunks[0].named_parameters()
                                  if n in base),
            "base_grads": [n for c in model.module_chunks for n, p in c.named_parameters()
                           if not p.requires_grad and (p.grad is not None or getattr(p, "main_grad", None) is not None)],
            "loss": result.loss,
        }
        del model
        dist.barrier()
        destroy_parallel()
    # A fresh adapter (B = 0) and the same model without LoRA, at TP=1: the reference (adapters off) is the base.
    out["fresh"] = {}
    for name, lora in (("zero_b", LoraSpec(rank=4, alpha=8.0)), ("none", None)):
        model = ShardedModel(path, ParallelDims(tp=1), seed=3, lora=lora, packed=False)
        micro = _micro_batches(model.hf_config.vocab_size)
        on = model.forward_logprobs(micro)
        with adapters_disabled(model.module_chunks):
            off = model.forward_logprobs(micro)
        out["fresh"][name] = ([lp["logp"] for lp in on], [lp["logp"] for lp in off])
        del model
        destroy_parallel()
    return out


def lora_checkpoint_job(path: str, directory: str) -> dict:
    """A TP=2 LoRA actor takes one step, then saves its checkpoint as a run does; returns its log-probs."""
    from megarl.config import OptimConfig
    from megarl.config.lora import LoraSpec
    from megarl.parallel import ParallelDims
    from megarl.workers.model_checkpoint import save_model
    from megarl.workers.sharded_model import ShardedModel

    model = ShardedModel(path, ParallelDims(tp=2), optim=OptimConfig(lr=1e-2), seed=3,
                         lora=LoraSpec(rank=4, alpha=8.0, init_b="random", targets=("linear_qkv", "linear_fc2")),
                         packed=False)
    micro = _micro_batches(model.hf_config.vocab_size)
    model.train_step(micro, _loss)
    logps = model.forward_logprobs(micro)
    save_model(model, directory)
    return {"logp": [lp["logp"].float() for lp in logps] if logps is not None else None}


def lora_resume_job(path: str, directory: str) -> dict:
    """A TP=2×PP=2 LoRA actor: three steps straight, and the same run saved after step 1 and resumed in a fresh
    model (base from HF, adapters and their optimizer state from the checkpoint): steps 2 and 3 must match bit for
    bit. Returns both runs' losses and adapters, and the checkpoint's tensor names."""
    import torch.distributed as dist

    from megarl.config import OptimConfig
    from megarl.config.lora import LoraSpec
    from megarl.convert.dist_checkpoint import OPTIMIZER_PREFIX, read_dist_metadata
    from megarl.convert.lora import adapter_tensors
    from megarl.parallel import ParallelDims, destroy_parallel
    from megarl.workers.model_checkpoint import load_model, save_model
    from megarl.workers.sharded_model import ShardedModel

    spec = LoraSpec(rank=4, alpha=8.0)

    def build():
        return ShardedModel(path, ParallelDims(tp=2, pp=2), optim=OptimConfig(lr=1e-2), seed=3, lora=spec,
                            packed=False)

    def step(model, k):
        generator = torch.Generator().manual_seed(100 + k)
        ids = torch.randint(0, model.hf_config.vocab_size, (NUM_MICRO_BATCHES * ROWS, SEQ), generator=generator)
        micro = [{"input_ids": ids[i * ROWS:(i + 1) * ROWS], "attention_mask": torch.ones(ROWS, SEQ, dtype=torch.long)}
                 for i in range(NUM_MICRO_BATCHES)]
        return model.train_step(micro, _loss).loss

    model = build()
    straight = [step(model, 1)]
    save_model(model, directory)
    straight += [step(model, 2), step(model, 3)]
    straight_adapters = adapter_tensors(model.chunks, model.family, model.hf_config)
    del model
    dist.barrier()
    destroy_parallel()
    model = build()
    load_model(model, directory)
    resumed = [step(model, 2), step(model, 3)]
    resumed_adapters = adapter_tensors(model.chunks, model.family, model.hf_config)
    names = sorted(n for n in read_dist_metadata(f"{directory}/dist").state_dict_metadata
                   if not n.startswith(OPTIMIZER_PREFIX))
    return {"straight": straight, "resumed": resumed, "straight_adapters": straight_adapters,
            "resumed_adapters": resumed_adapters, "saved": names}
