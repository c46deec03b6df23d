"""Megatron's torch-AdamW fallback runs fused (``megarl.workers.sharded_model.fuse_torch_adam``), also after a
checkpoint's unfused ``param_groups`` are loaded; its update equals the unfused loop's to fp32 rounding.

(Inside Megatron's distributed optimizer, against a plain AdamW step: tests/distributed/test_model_parallel.py.)
"""

from __future__ import annotations

import types

import torch

from megarl.workers.sharded_model import fuse_torch_adam


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((64, 32), (32,), (7, 5))]


def _steps(optimizer: torch.optim.Optimizer, params, steps: int = 3) -> None:
    for step in range(steps):
        for i, param in enumerate(params):
            param.grad = torch.full_like(param, 0.1 * (i + 1)) * torch.cos(param.detach() * (step + 1))
        optimizer.step()


def test_chained_optimizers_run_fused_and_equal_the_loop():
    plain, fused_params = _params(), _params()
    loop = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1, foreach=False)
    first = torch.optim.AdamW(fused_params[:2], lr=1e-2, weight_decay=0.1)
    second = torch.optim.AdamW(fused_params[2:], lr=1e-2, weight_decay=0.1)
    megatron_like = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=first),
                                                              types.SimpleNamespace(optimizer=second)])
    assert fuse_torch_adam(megatron_like) == 2
    assert all(group["fused"] and not group["foreach"] for opt in (first, second) for group in opt.param_groups)
    _steps(loop, plain)
    _steps(first, fused_params[:2])
    _steps(second, fused_params[2:])
    for a, b, start in zip(plain, fused_params, _params(), strict=True):
        assert (a - b).abs().max() <= 1e-6
        assert (a - start).abs().max() > 1e-3  # the steps moved them


def test_loading_an_unfused_state_keeps_it_fused():
    params = _params()
    unfused = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    _steps(unfused, params, steps=1)
    saved = unfused.state_dict()
    assert saved["param_groups"][0]["fused"] in (None, False)

    resumed = torch.optim.AdamW(params, lr=1e-2)
    fuse_torch_adam(types.SimpleNamespace(optimizer=resumed))
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["fused"] is True
    assert all(state["step"].dtype == torch.float32 and state["step"].device == param.device
               for param, state in resumed.state.items())
    _steps(resumed, params, steps=1)
    assert all(float(state["step"]) == 2.0 for state in resumed.state.values())


def test_optimizers_it_cannot_fuse_are_left_alone():
    sgd = torch.optim.SGD(_params(), lr=0.1)
    assert fuse_torch_adam(types.SimpleNamespace(optimizer=sgd)) == 0
    assert fuse_torch_adam(types.SimpleNamespace()) == 0
