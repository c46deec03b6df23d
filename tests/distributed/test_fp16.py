"""fp16 training on one gloo rank: Megatron's dynamic loss scaling, the same steps as fp32, overflows skipped.

The tiny model trains a few steps in float32 and in float16 (CPU half matmuls). Tolerance: the fp16 loss and
gradient norm must equal fp32's within RTOL. Measured (2-layer tiny Qwen2, lr 1e-3): at most 7.8e-5 on the
loss and 5.6e-4 on the gradient norm (step 2, after Adam's first, nearly sign-only update). Each optimizer step
lowers the loss by at least 2.2 %, so RTOL = 5e-3 (9x the noise) still fails on a step skipped or taken twice;
a loss-scale error is a power of two.
"""

import pytest
import torch

from megarl.parallel.launch import run_ranks

RTOL = 5e-3
OVERFLOW = 2.0**12
"""Loss factor whose scaled gradient overflows fp16 (max 65504) at the initial loss scale 2^16."""
SMALL = 2.0**-14
"""Loss factor whose unscaled fp16 gradients underflow (the logits' gradient, ~1e-9, is below fp16's 6e-8)."""


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 400, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _train(hf_dir: str, batch: dict) -> dict:
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel

    num_tokens = int(batch["attention_mask"][:, 1:].sum())
    micro = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]

    def loss_times(factor):
        def loss_fn(logp_BS, entropy_BS, mb):
            valid = mb["attention_mask"][:, 1:].float()
            return -(logp_BS[:, :-1] * valid).sum() / num_tokens * factor, {}
        return loss_fn

    plans = {torch.float32: [1, 1, 1, 1, SMALL], torch.float16: [1, 1, 1, OVERFLOW, OVERFLOW, 1, SMALL]}
    out = {}
    for dtype, plan in plans.items():
        sharded = ShardedModel(hf_dir, ParallelDims(), optim=OptimConfig(lr=1e-3, clip_grad=1.0), params_dtype=dtype)
        optimizer = sharded.optimizer.chained_optimizers[0]
        steps = []
        for factor in plan:
            before = [p.detach().clone() for p in sharded.module_chunks[0].parameters()]
            result = sharded.train_step(micro, loss_times(factor))
            unchanged = all(torch.equal(a, p) for a, p in zip(before, sharded.module_chunks[0].parameters()))
            steps.append({"factor": factor, "applied": result.applied, "loss": result.loss,
                          "grad_norm": result.grad_norm, "loss_scale": float(sharded.optimizer.get_loss_scale()),
                          "unchanged": unchanged})
        out[str(dtype)] = {
            "scaler": type(optimizer.grad_scaler).__name__ if optimizer.grad_scaler is not None else None,
            "scales_loss": sharded.config.grad_scale_func == sharded.optimizer.scale_loss,
            "scheduler_steps": sharded.scheduler.num_steps,
            "steps": steps,
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    hf_dir = save_tiny(tmp_path_factory.mktemp("fp16") / "model", num_layers=2)
    (result,) = run_ranks(_train, 1, str(hf_dir), _batch(), timeout_s=120)
    return result["torch.float32"], result["torch.float16"]


def test_fp16_has_a_dynamic_loss_scale_and_fp32_none(runs):
    fp32, fp16 = runs
    assert fp16["scaler"] == "DynamicGradScaler" and fp16["scales_loss"]
    assert fp16["steps"][0]["loss_scale"] == 2.0**16
    assert fp32["scaler"] is None and not fp32["scales_loss"]
    assert {s["loss_scale"] for s in fp32["steps"]} == {1.0}


def test_fp16_steps_equal_fp32_steps(runs):
    """Reported losses and gradient norms are unscaled; a small loss's gradients survive in fp16 (SMALL)."""
    fp32, fp16 = runs
    applied = [s for s in fp16["steps"] if s["applied"]]
    assert [s["factor"] for s in applied] == [s["factor"] for s in fp32["steps"]]
    for step, (a, b) in enumerate(zip(fp32["steps"], applied)):
        assert a["applied"] and not b["unchanged"]
        assert b["loss"] == pytest.approx(a["loss"], rel=RTOL), step
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RTOL), step
    assert fp16["scheduler_steps"] == fp32["scheduler_steps"] == len(applied)


def test_fp16_overflow_is_skipped_and_halves_the_scale_after_hysteresis(runs):
    """Megatron's hysteresis 2: the first overflow keeps the scale, the second in a row halves it."""
    _, fp16 = runs
    first, second, after = fp16["steps"][3:6]
    for overflow in (first, second):
        assert overflow["factor"] == OVERFLOW and not overflow["applied"] and overflow["unchanged"]
        assert overflow["grad_norm"] != overflow["grad_norm"]  # nan: no gradient norm of a skipped step
        # The loss function's value (not times the loss scale) at the weights the next step starts from.
        assert overflow["loss"] == pytest.approx(OVERFLOW * after["loss"], rel=1e-6)
    assert (first["loss_scale"], second["loss_scale"]) == (2.0**16, 2.0**15)
    assert after["applied"] and after["loss_scale"] == 2.0**15
