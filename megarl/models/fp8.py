"""Block FP8: the weight format of FP8 rollout (DeepSeek-V3's and Qwen3-FP8's checkpoints, SGLang's FP8 loader).

A linear layer's weight ``W [N, K]`` is stored as ``weight`` in ``float8_e4m3fn`` and ``weight_scale_inv`` in fp32,
one scale per ``128 × 128`` block (``[ceil(N / 128), ceil(K / 128)]``, the last blocks partial): ``W ≈ weight ·
scale`` block by block, the scale being the block's largest magnitude over FP8's largest (448), so every block uses
the format's whole range. Embeddings, norms, routers, biases and the output layer stay in the model's dtype: the
tensors quantized are the column- and row-parallel linear weights (:attr:`WeightRule.block_fp8`), as in those
checkpoints.

Error: e4m3 keeps 3 mantissa bits, so rounding to nearest is off by at most ``2**-4`` of a value's magnitude for
values in the normal range (``≥ 2**-6 · scale``) and by at most half the smallest subnormal (``2**-10 · scale``) below
it: :func:`error_bound`.

The config an FP8 checkpoint carries is :data:`QUANTIZATION_CONFIG` (``config.json``'s ``quantization_config``).

Shape legend: ``N`` output rows, ``K`` input columns, ``Nb``/``Kb`` their block counts.
"""

from __future__ import annotations

import math

import torch

BLOCK = (128, 128)
"""Rows × columns of one scale's block (SGLang's ``weight_block_size``)."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448: the largest finite e4m3 value."""
SCALE_SUFFIX = "_scale_inv"
"""``<name>.weight`` is quantized into ``<name>.weight`` (FP8) and ``<name>.weight_scale_inv`` (fp32)."""
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK)}
"""``config.json``'s ``quantization_config`` of a block-FP8 checkpoint (the fields SGLang's ``Fp8Config`` reads)."""


def scale_name(name: str) -> str:
    """The scale tensor's name of the quantized weight ``name`` (``....weight`` -> ``....weight_scale_inv``)."""
    return name + SCALE_SUFFIX


def num_blocks(shape: tuple[int, int]) -> tuple[int, int]:
    """``(Nb, Kb)``: the scale's shape for a ``[N, K]`` weight."""
    return math.ceil(shape[0] / BLOCK[0]), math.ceil(shape[1] / BLOCK[1])


def fp8_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of a ``[N, K]`` weight in block FP8: its FP8 values and its fp32 scales."""
    return math.prod(shape) + 4 * math.prod(num_blocks(tuple(shape)))


def _blocks(x_NK: torch.Tensor) -> torch.Tensor:
    """``x`` zero-padded to whole blocks, viewed ``[Nb, 128, Kb, 128]``."""
    n, k = x_NK.shape
    nb, kb = num_blocks((n, k))
    padded = x_NK.new_zeros(nb * BLOCK[0], kb * BLOCK[1])
    padded[:n, :k] = x_NK
    return padded.view(nb, BLOCK[0], kb, BLOCK[1])


def expand_scales(scale_NbKb: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Each element's scale, ``[N, K]``."""
    full = scale_NbKb.repeat_interleave(BLOCK[0], dim=0).repeat_interleave(BLOCK[1], dim=1)
    return full[:shape[0], :shape[1]]


def quantize_block_fp8(weight_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [N, K] float8_e4m3fn, weight_scale_inv [Nb, Kb] fp32)`` of a 2-D weight (any float dtype): each
    block scaled by its largest magnitude / 448, rounded to nearest (an all-zero block gets the smallest positive
    scale and zeros)."""
    if weight_NK.dim() != 2 or not weight_NK.is_floating_point():
        raise ValueError(f"block FP8 quantizes 2-D float weights, got {tuple(weight_NK.shape)} {weight_NK.dtype}")
    out_NK = torch.empty(weight_NK.shape, dtype=FP8_DTYPE, device=weight_NK.device)
    scale_NbKb = torch.empty(num_blocks(tuple(weight_NK.shape)), dtype=torch.float32, device=weight_NK.device)
    quantize_block_fp8_into(weight_NK, out_NK, scale_NbKb)
    return out_NK, scale_NbKb


QUANTIZE_BYTES_PER_ELEMENT = 12
"""Transient bytes per element of the rows being quantized at once: the fp32 copy, its zero-padded blocks and their
magnitudes, then the expanded scales and the clamped quotient (:func:`quantize_block_fp8_into`)."""


def quantize_block_fp8_into(weight_NK: torch.Tensor, out_NK: torch.Tensor, scale_NbKb: torch.Tensor) -> None:
    """:func:`quantize_block_fp8` of ``weight`` written into ``out`` (FP8) and ``scale`` (fp32), one row of blocks
    (128 rows) at a time: the transients take :data:`QUANTIZE_BYTES_PER_ELEMENT` bytes per element of 128 rows, not of
    the whole weight (DeepSeek-V3's dense ``gate_proj``: 11 MiB instead of 1.5 GiB), and every block is computed as
    the whole weight's would be, bit for bit."""
    for block_row, start in enumerate(range(0, weight_NK.shape[0], BLOCK[0])):
        w = weight_NK[start:start + BLOCK[0]].float()
        amax = _blocks(w).abs().amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        out_NK[start:start + BLOCK[0]] = (w / expand_scales(scale, tuple(w.shape))).clamp(-FP8_MAX, FP8_MAX)
        scale_NbKb[block_row:block_row + 1] = scale


def dequantize_block_fp8(weight_NK: torch.Tensor, scale_NbKb: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight a block-FP8 pair stands for (as SGLang's ``block_quant_dequant``), in ``dtype``."""
    return (weight_NK.float() * expand_scales(scale_NbKb.float(), tuple(weight_NK.shape))).to(dtype)


def error_bound(weight_NK: torch.Tensor, scale_NbKb: torch.Tensor) -> torch.Tensor:
    """The most round-to-nearest e4m3 may be off by at each element of ``weight`` (module docstring), ``[N, K]``."""
    scale_NK = expand_scales(scale_NbKb, tuple(weight_NK.shape))
    return torch.maximum(weight_NK.float().abs() * 2.0 ** -4, scale_NK * 2.0 ** -10)
