"""Benchmark: the bytes an FP8-rollout weight sync moves, over a BF16 one's, for real architectures.

A sync sends every HF tensor of the policy once, in buckets; with ``rollout.quantization=fp8`` each bucket is
quantized (:func:`megarl.convert.fp8.quantize_bucket`), its size given by :func:`megarl.convert.fp8.fp8_layout`: the
linear weights in FP8 (1 byte) with an fp32 scale per 128 × 128 block, embeddings, norms, routers, biases and the
output layer in BF16. This script sizes the whole model's buckets with that layout, from the architecture's tensor
shapes (transformers on the meta device: nothing allocated), for each ``--arch`` (megarl's known architectures), and
checks the layout against the real quantization on one layer of real size (random BF16 values): the bytes
``quantize_bucket`` fills equal the layout's.

One line per architecture, then the summary (the issue's bar: the largest model's fraction <= 0.55):
``RESULT fp8_sync_bytes_frac=<x of the last --arch> <arch>=<x> ...``

    python tools/bench_fp8_sync.py                       # Llama-3.1-8B, Qwen3-30B-A3B, Llama-3.1-70B
    python tools/bench_fp8_sync.py --arch Qwen2.5-7B
"""

from __future__ import annotations

import argparse
import math

import torch

DEFAULT_ARCHS = ("Llama-3.1-8B", "Qwen3-30B-A3B", "Llama-3.1-70B")


def model_bytes(arch: str) -> tuple[int, int, float]:
    """``(bf16 bytes, fp8 bytes, parameters)`` of a whole sync of ``arch``."""
    from megarl.convert.fp8 import fp8_layout, fp8_names, layout_bytes
    from megarl.convert.hf_io import expected_names, expected_shapes
    from megarl.models import family_for
    from megarl.models.known import known_config

    config = known_config(arch)
    family = family_for(config)
    shapes = expected_shapes(config)
    names = expected_names(family, config)
    quantized = fp8_names(family, config)
    bf16 = sum(math.prod(shapes[n]) * 2 for n in names)
    fp8 = layout_bytes(fp8_layout([(n, shapes[n], torch.bfloat16) for n in names], quantized))
    return bf16, fp8, sum(math.prod(shapes[n]) for n in names)


def check_layout_against_quantization(hidden: int = 4096, ffn: int = 14336) -> None:
    """One Llama-3.1-8B-sized layer's projections and norm quantized for real: the buffer ``quantize_bucket`` fills
    is the layout's size."""
    from megarl.convert.export import Bucket
    from megarl.convert.fp8 import fp8_layout, layout_bytes, quantize_bucket

    generator = torch.Generator().manual_seed(0)
    named = [(f"l.{name}.weight", (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
             for name, shape in (("q_proj", (hidden, hidden)), ("down_proj", (hidden, ffn)), ("norm", (hidden,)))]
    quantized = frozenset(n for n, t in named if t.dim() == 2)
    bucket = quantize_bucket(Bucket.pack(named), quantized)
    expected = layout_bytes(fp8_layout([(n, tuple(t.shape), t.dtype) for n, t in named], quantized))
    if bucket.nbytes != expected:
        raise SystemExit(f"the layout says {expected} bytes, quantize_bucket filled {bucket.nbytes}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="a known architecture (repeatable)")
    args = parser.parse_args(argv)
    check_layout_against_quantization()
    fractions = {}
    for arch in args.arch or DEFAULT_ARCHS:
        bf16, fp8, params = model_bytes(arch)
        fractions[arch] = fp8 / bf16
        print(f"{arch}: {params / 1e9:.2f} B parameters; a sync moves {bf16 / 2**30:.2f} GiB in BF16, "
              f"{fp8 / 2**30:.2f} GiB in FP8 ({fractions[arch]:.3f})", flush=True)
    last = list(fractions)[-1]
    result = {"fp8_sync_bytes_frac": fractions[last], **fractions}
    print("RESULT " + " ".join(f"{key}={value:.4f}" for key, value in result.items()))
    return result


if __name__ == "__main__":
    main()
