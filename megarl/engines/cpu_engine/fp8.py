"""FP8 serving in megarl's CPU engine: the weights an FP8 SGLang engine holds, and the model it computes with.

An engine started on a block-FP8 checkpoint (``config.json``'s ``quantization_config``: :mod:`megarl.models.fp8`)
keeps what SGLang's FP8 layers keep, each quantized linear weight as ``float8_e4m3fn`` and its
``weight_scale_inv`` (fp32, per 128 × 128 block), and computes with their dequantization in the engine's dtype
(SGLang multiplies in FP8; the CPU has no FP8 matmul, and the values are the same up to the matmul's rounding). So
what the engine samples carries the real quantization error, and the rollout/training mismatch CI measures is the
FP8 gap.

Weight updates name the FP8 weight and its scale as an FP8 checkpoint does (``<name>`` in ``float8_e4m3fn``,
``<name>_scale_inv`` in fp32), in any bucket order; the parameters they change are dequantized again when the
weight-update session ends (no batch runs inside one). ``/get_weights_by_name`` reads the stored FP8 values and
scales (as float, as SGLang answers), so a sync is verified on the quantized bits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megarl.models.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_block_fp8, num_blocks


def is_fp8_checkpoint(directory: str | Path) -> bool:
    """Whether the HF checkpoint at ``directory`` is block FP8 (its config's ``quantization_config``)."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return "fp8" in str(quantization.get("quant_method", ""))


class Fp8Weights:
    """The FP8 weights and scales of an engine's quantized linear layers, and the parameters they make.

    Args:
        params: the engine's HF name -> parameter map (the dequantized weights live there).
        weights: HF name -> FP8 weight, for every quantized layer.
        scales: HF name (of the weight) -> its ``[Nb, Kb]`` fp32 scales.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor],
                 scales: dict[str, torch.Tensor], *, scale_ue8m0: bool = False) -> None:
        problems = [name for name in weights if name not in params or name not in scales]
        if problems:
            raise ValueError(f"FP8 checkpoint: weights without a parameter or a scale: {problems[:10]}")
        # On each parameter's device (a CUDA engine's GPU): updates arrive there and are dequantized there.
        self.params = params
        self.weights = {name: weight.to(params[name].device) for name, weight in weights.items()}
        self.scales = {name: scales[name].to(params[name].device) for name in weights}
        self._changed: set[str] = set()
        self.scale_ue8m0 = scale_ue8m0
        """Requantize every loaded weight to power-of-two scales, as SGLang does on Blackwell (sm100/sm120: DeepGEMM's
        ``DEEPGEMM_SCALE_UE8M0``), so what the engine holds and answers is not what was sent."""

    @classmethod
    def from_checkpoint(cls, directory: str | Path, params: dict[str, torch.nn.Parameter], *,
                        scale_ue8m0: bool = False) -> Fp8Weights:
        """The FP8 weights and scales read from the checkpoint's safetensors (its ``*_scale_inv`` tensors name
        what is quantized)."""
        from safetensors import safe_open

        weights, scales = {}, {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key.endswith(SCALE_SUFFIX):
                        scales[key[:-len(SCALE_SUFFIX)]] = f.get_tensor(key).float()
                    else:
                        tensor = f.get_tensor(key)
                        if tensor.dtype == FP8_DTYPE:
                            weights[key] = tensor
        return cls(params, weights, scales, scale_ue8m0=scale_ue8m0)

    def owns(self, name: str) -> bool:
        """Whether ``name`` is a quantized weight or its scale."""
        return name in self.weights or (name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in self.weights)

    def problem(self, name: str, tensor: torch.Tensor) -> str | None:
        """Why ``tensor`` cannot be stored as ``name`` (None: it can)."""
        if name in self.weights:
            want_shape, want_dtype = tuple(self.weights[name].shape), FP8_DTYPE
        else:
            base = name[:-len(SCALE_SUFFIX)]
            want_shape, want_dtype = num_blocks(tuple(self.weights[base].shape)), torch.float32
        if tuple(tensor.shape) != want_shape or tensor.dtype != want_dtype:
            return (f"{name!r} is {tuple(tensor.shape)} {tensor.dtype}; this FP8 engine holds it as {want_shape} "
                    f"{want_dtype} (block FP8: the weight in float8_e4m3fn, its scale in fp32 per 128x128 block)")
        return None

    def store(self, name: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (checked by :meth:`problem`) as ``name``; its parameter is remade by :meth:`refresh`."""
        if name in self.weights:
            self.weights[name].copy_(tensor)
            self._changed.add(name)
        else:
            base = name[:-len(SCALE_SUFFIX)]
            self.scales[base].copy_(tensor)
            self._changed.add(base)

    def refresh_all(self) -> None:
        """Dequantize every quantized parameter (at load: the parameters hold exactly what the FP8 values stand for,
        in the engine's dtype)."""
        self._changed = set(self.weights)
        self.refresh()

    def refresh(self) -> int:
        """Dequantize the parameters whose weight or scale changed since the last call; how many."""
        with torch.no_grad():
            for name in self._changed:
                if self.scale_ue8m0:
                    weight, scale = requantize_ue8m0(self.weights[name], self.scales[name])
                    self.weights[name].copy_(weight)
                    self.scales[name].copy_(scale)
                param = self.params[name]
                param.copy_(dequantize_block_fp8(self.weights[name], self.scales[name], param.dtype))
        count, self._changed = len(self._changed), set()
        return count

    def read(self, name: str) -> torch.Tensor:
        """The stored FP8 weight or scale ``name``."""
        return self.weights[name] if name in self.weights else self.scales[name[:-len(SCALE_SUFFIX)]]


def requantize_ue8m0(weight_NK: torch.Tensor, scale_NbKb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 pair requantized to power-of-two scales, as SGLang's ``requant_weight_ue8m0`` does on Blackwell:
    dequantized to bf16, each block's scale its largest magnitude (at least 1e-4) / 448 rounded up to a power of two,
    the values rounded to nearest e4m3 at it."""
    from megarl.models.fp8 import FP8_MAX, _blocks, dequantize_block_fp8, expand_scales

    values = dequantize_block_fp8(weight_NK, scale_NbKb, torch.bfloat16).float()
    amax = _blocks(values).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    quantized = (values / expand_scales(scale, tuple(values.shape))).clamp(-FP8_MAX, FP8_MAX)
    return quantized.to(FP8_DTYPE), scale
