"""Rank-side job for the model checkpoint tests: save, crash, resume, reload at another layout.

One 4-rank job at TP=2×PP=2: an uninterrupted run takes steps 1..5 and checkpoints after
step 2 through the CheckpointManager; a save of step 5 crashes after its model part is
written; a fresh sharded model (weights from the original HF directory) loads the latest
checkpoint and retakes steps 3..5. Then TP=1×PP=2×DP=2 loads the weights alone, takes a
step, saves, and a fresh sharded model at that layout resumes from it (DP-sharded optimizer state).
Before the save, the actor's log-probs of a fixed batch (for megarl-convert's export of the checkpoint).
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from tests.distributed.sharded_model_jobs import NUM_ROWS, _rows, make_batch

SAVE_AFTER, LAST_STEP = 2, 5
OPTIM = dict(lr=1e-3, eps=1e-3, clip_grad=1.0, warmup_steps=1, decay_style="cosine", decay_steps=8, min_lr=1e-4)


def _broadcast_object(value, src: int = 0):
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _draw_rng() -> list[float]:
    """One number from each generator the checkpoint restores (Megatron's tracker included)."""
    from megatron.core import tensor_parallel

    draws = [random.random(), float(np.random.rand()), float(torch.rand(()))]
    with tensor_parallel.get_cuda_rng_tracker().fork():
        draws.append(float(torch.rand(())))
    return draws


def _params(sharded) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(sharded.module_chunks) for n, p in c.named_parameters()}


def _hf_weights(sharded) -> dict[str, torch.Tensor] | None:
    """Full HF tensors (collective), kept on rank 0."""
    weights = {n: t.clone() for b in sharded.exporter().iter_full(1 << 22) for n, t in b}
    return weights if sharded.groups.rank == 0 else None


def _step(sharded, step: int, vocab_size: int) -> dict:
    """One PPO-like step on data fixed by ``step`` (the same in every run)."""
    from megarl.algo.losses import agg_norm, policy_loss

    batch = make_batch(vocab_size, seed=step)
    old_logp = batch.pop("old_logp_shift") - 2.0
    global_norm = agg_norm(batch["loss_mask"], "token-mean")

    def loss_fn(logp_BS, entropy_BS, mb):
        return policy_loss(logp_BS, mb["old_logp"], mb["advantages"], mb["loss_mask"], loss_agg_mode="token-mean",
                           global_norm=global_norm, entropy_BT=entropy_BS, entropy_coeff=0.01)

    rows = [{**_rows(batch, slice(i, i + 1)), "old_logp": old_logp[i : i + 1]} for i in range(NUM_ROWS)]
    groups = sharded.groups
    result = sharded.train_step(rows[groups.dp_rank :: groups.dims.dp], loss_fn)
    return {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr, "applied": result.applied}


def checkpoint_job(hf_dir: str, root: str) -> dict:
    from megarl.config import OptimConfig
    from megarl.controller.run_checkpoints import CheckpointManager, load_trainer_state
    from megarl.parallel import ParallelDims
    from megarl.workers import model_checkpoint as ckpt
    from megarl.workers.sharded_model import ShardedModel

    manager = CheckpointManager(root, max_to_keep=2)
    dims = ParallelDims(tp=2, pp=2)

    # ---------------------------------------------------------------- uninterrupted run
    sharded = ShardedModel(hf_dir, dims, optim=OptimConfig(**OPTIM))
    rank = sharded.groups.rank
    out: dict = {"rank": rank}
    vocab = sharded.hf_config.vocab_size
    run = {}
    for step in range(1, LAST_STEP + 1):
        run[step] = _step(sharded, step, vocab)
        if step == SAVE_AFTER:
            # The saved actor's own log-probs (last stage), for the HF model megarl-convert makes of its checkpoint.
            batch = make_batch(vocab, seed=100)
            logp = sharded.forward_logprobs([_rows(batch, slice(0, NUM_ROWS))])
            if logp is not None:
                out["actor_logp"] = {"batch": batch, "logp": logp[0]["logp"]}
            tmp = _broadcast_object(str(manager.begin(step)) if rank == 0 else None)
            out["save_s"] = ckpt.save_model(sharded, f"{tmp}/actor")
            out["export_s"] = ckpt.export_hf(sharded, f"{tmp}/actor_hf")
            out["hf_at_save"] = _hf_weights(sharded)
            dist.barrier()
            if rank == 0:
                manager.commit(step, tmp, {"data": {"epoch": 0, "position": 7}, "kl_coef": 0.05})
            dist.barrier()
            out["rng_after_save"] = _draw_rng()
    out["run"] = run
    out["params"] = _params(sharded)

    # ----------------------------------- a save that dies after the model part is written
    tmp = _broadcast_object(str(manager.begin(LAST_STEP)) if rank == 0 else None)
    real_save_rng = ckpt._save_rng

    def crash(directory, rank):
        raise RuntimeError("simulated crash during save")

    ckpt._save_rng = crash
    try:
        ckpt.save_model(sharded, f"{tmp}/actor")
        out["crash_raised"] = False
    except RuntimeError:
        out["crash_raised"] = True
    finally:
        ckpt._save_rng = real_save_rng
    dist.barrier()
    if rank == 0:
        from pathlib import Path

        out["crash_tmp_has_model"] = (Path(tmp) / "actor" / "dist" / "metadata.json").exists()
        out["latest_after_crash"] = str(manager.latest())
        out["removed"] = [p.name for p in manager.clean_stale()]
    dist.barrier()

    # ------------------------------------------------------------------------- resume
    latest = _broadcast_object(str(manager.latest()) if rank == 0 else None)
    fresh = ShardedModel(hf_dir, dims, optim=OptimConfig(**OPTIM))
    out["load_s"] = ckpt.load_model(fresh, f"{latest}/actor")
    out["rng_after_load"] = _draw_rng()
    out["trainer_state"] = load_trainer_state(latest)
    out["resumed"] = {step: _step(fresh, step, vocab) for step in range(SAVE_AFTER + 1, LAST_STEP + 1)}
    resumed_params = _params(fresh)
    out["params_equal"] = all(torch.equal(out["params"][n], resumed_params[n]) for n in resumed_params)
    out["num_params"] = len(resumed_params)
    del out["params"]

    # ------------------- the weights alone at another layout (TP1×PP2×DP2), then a DP-sharded resume
    other_dims = ParallelDims(tp=1, pp=2)
    other = ShardedModel(hf_dir, other_dims, optim=OptimConfig(**OPTIM))
    try:
        ckpt.load_model(other, f"{latest}/actor")
        out["layout_error"] = None
    except ValueError as error:
        out["layout_error"] = str(error)
    out["load_other_layout_s"] = ckpt.load_model(other, f"{latest}/actor", with_optimizer=False, load_rng=False)
    out["hf_other_layout"] = _hf_weights(other)
    _step(other, SAVE_AFTER + 1, vocab)
    dp_dir = _broadcast_object(str(manager.begin(SAVE_AFTER + 1)) if rank == 0 else None)
    ckpt.save_model(other, dp_dir)
    out["dp_run"] = _step(other, SAVE_AFTER + 2, vocab)
    dp_params = _params(other)
    other = ShardedModel(hf_dir, other_dims, optim=OptimConfig(**OPTIM))
    ckpt.load_model(other, dp_dir)
    out["dp_resumed"] = _step(other, SAVE_AFTER + 2, vocab)
    out["dp_params_equal"] = all(torch.equal(dp_params[n], t) for n, t in _params(other).items())

    # ------------- damaged files: every rank refuses before the collective load, naming the file
    from pathlib import Path

    out["damaged"] = {}
    for name in ("rng/rank_00001.pt", "dist/__0_0.distcp"):
        file = Path(dp_dir) / name
        original = file.read_bytes()
        dist.barrier()
        if rank == 0:
            file.write_bytes(original[: len(original) // 2])
        dist.barrier()
        try:
            ckpt.load_model(other, dp_dir)
            out["damaged"][name] = None
        except ValueError as error:
            out["damaged"][name] = str(error)
        dist.barrier()
        if rank == 0:
            file.write_bytes(original)
    return out
