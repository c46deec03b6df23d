"""Block-FP8 HF checkpoints (FP8 rollout): the tensors of a model with its linear weights quantized
(:mod:`megarl.models.fp8`), as DeepSeek-V3's and Qwen3-FP8's checkpoints hold them, so that SGLang's FP8 loader
serves them and transformers loads them (dequantized on a CPU).

Which tensors: every HF tensor of a rule with :attr:`~megarl.models.weights.WeightRule.block_fp8` (the attention
and MLP projections, the experts). Each ``<name>`` becomes ``<name>`` in ``float8_e4m3fn`` plus
``<name>_scale_inv`` (fp32, one per 128 × 128 block); the rest is written as it is. ``config.json`` gains
:data:`~megarl.models.fp8.QUANTIZATION_CONFIG`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megarl.convert.export import Bucket, empty_buffer
from megarl.convert.hf_io import HFCheckpoint, ShardedWriter, check_checkpoint, copy_side_files
from megarl.convert.layout import Slice
from megarl.models.fp8 import (
    FP8_DTYPE,
    QUANTIZATION_CONFIG,
    num_blocks,
    quantize_block_fp8,
    quantize_block_fp8_into,
    scale_name,
)


def fp8_names(family, hf_config) -> frozenset[str]:
    """The HF tensors FP8 rollout quantizes for ``hf_config`` (its family's :attr:`block_fp8` rules, every layer and
    expert)."""
    return frozenset(name for at in family.weight_instances(hf_config) if at.rule.block_fp8 for name in at.hf_names)


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], quantized: frozenset[str]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with each tensor of ``quantized`` replaced by its FP8 weight, then its scale (``<name>_scale_inv``)."""
    for name, tensor in named:
        if name in quantized:
            weight, scale = quantize_block_fp8(tensor)
            yield name, weight
            yield scale_name(name), scale
        else:
            yield name, tensor


def fp8_layout(named: Iterable[tuple[str, tuple[int, ...], torch.dtype]], quantized: frozenset[str]
               ) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """``(name, shape, dtype, byte offset)`` of every tensor of a quantized bucket holding ``named`` (name, shape,
    dtype): each of ``quantized`` as its FP8 weight and its scale, the rest as it is. Packed end to end, the widest
    dtypes first (the scales, then the unquantized tensors, then the FP8 weights), so every offset is a multiple of
    its dtype's size: the layout SGLang's ``FlattenedTensorBucket.empty`` computes for a receive bucket of these
    names, dtypes and shapes, in this order."""
    entries = []
    for name, shape, dtype in named:
        if name in quantized:
            entries += [(name, tuple(shape), FP8_DTYPE), (scale_name(name), num_blocks(tuple(shape)), torch.float32)]
        else:
            entries.append((name, tuple(shape), dtype))
    entries.sort(key=lambda entry: -_itemsize(entry[2]))  # stable: bucket order within a dtype
    out, offset = [], 0
    for name, shape, dtype in entries:
        out.append((name, shape, dtype, offset))
        offset += math.prod(shape) * _itemsize(dtype)
    return out


def layout_bytes(layout: list[tuple[str, tuple[int, ...], torch.dtype, int]]) -> int:
    """The bytes a bucket of :func:`fp8_layout` ``layout`` takes (its last tensor's end)."""
    _, shape, dtype, offset = layout[-1]
    return offset + math.prod(shape) * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def quantize_bucket(bucket: Bucket, quantized: frozenset[str], *, shared_memory: bool = False,
                    buffer: torch.Tensor | None = None) -> Bucket:
    """``bucket`` (full HF tensors in the training dtype) with each tensor of ``quantized`` as its block-FP8 weight
    and scale: a bucket over one byte buffer (``buffer`` when given and large enough, else a new one, in shared
    memory with ``shared_memory``) whose tensors are views of their own dtypes, what
    :func:`megarl.sync.base.flattened_payload` sends as one payload."""
    layout = fp8_layout([(n, tuple(t.shape), t.dtype) for n, t in zip(bucket.names, bucket.tensors)], quantized)
    total = layout_bytes(layout)
    device = bucket.flat.device
    if buffer is None or buffer.numel() < total or buffer.device != device:
        buffer = empty_buffer(total, torch.uint8, device, shared_memory=shared_memory)
    flat = buffer[:total]
    views = {n: flat[o:o + math.prod(s) * _itemsize(d)].view(d).view(s) for n, s, d, o in layout}
    for tensor_name, tensor in zip(bucket.names, bucket.tensors):
        if tensor_name in quantized:
            quantize_block_fp8_into(tensor, views[tensor_name], views[scale_name(tensor_name)])
        else:
            views[tensor_name].copy_(tensor)
    return Bucket([n for n, _, _, _ in layout], [views[n] for n, _, _, _ in layout], flat, bucket.owner_pp_rank)


@dataclasses.dataclass(frozen=True)
class Fp8Report:
    """What :func:`write_fp8_checkpoint` wrote."""

    directory: Path
    quantized: int
    """Tensors quantized."""
    kept: int
    """Tensors written as they were."""
    source_bytes: int
    bytes: int
    seconds: float


def write_fp8_checkpoint(source: str | os.PathLike, destination: str | os.PathLike, *,
                         max_shard_bytes: int = 5 * 2**30) -> Fp8Report:
    """Write the block-FP8 version of the HF checkpoint at ``source`` (safetensors, any float dtype) to
    ``destination``: its quantized tensors, the others as they are, its config (with the quantization config) and
    tokenizer files. Refuses a checkpoint that does not match its config, or one already quantized."""
    from megarl.models import family_for
    from megarl.models.hf_config import load_hf_config

    start = time.perf_counter()
    source, destination = Path(source), Path(destination)
    config = json.loads((source / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{source} is already quantized ({config['quantization_config'].get('quant_method')}); "
                         f"give the checkpoint in its training dtype")
    hf_config = load_hf_config(source)
    family = family_for(hf_config)
    checkpoint = HFCheckpoint(source)
    check_checkpoint(checkpoint, family, hf_config)
    quantized = fp8_names(family, hf_config)
    destination.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(destination, max_shard_bytes)
    source_bytes = 0
    names = checkpoint.names()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal source_bytes
        for name in names:
            tensor = checkpoint.read(name, Slice(None))
            source_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    for name, tensor in quantize_named(tensors(), quantized):
        writer.add(name, tensor)
    writer.close()
    copy_side_files(source, destination)
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (destination / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    done = sum(1 for name in names if name in quantized)
    return Fp8Report(destination, done, len(names) - done, source_bytes, writer.total_bytes,
                     time.perf_counter() - start)


ENGINE_DIR = "engine_fp8"
"""Where, in a run's directory, the FP8 checkpoint its engines start from is written (``rollout.quantization``)."""
SOURCE_MARKER = "megarl_fp8_source.json"


def checkpoint_quantization(directory: str | os.PathLike) -> dict | None:
    """The ``quantization_config`` of the HF checkpoint in ``directory`` (None: not quantized). One megarl cannot
    read (not block FP8 in 128 × 128 blocks, DeepSeek-V3's format and FP8 rollout's) is refused, naming it."""
    config = json.loads((Path(directory) / "config.json").read_text())
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    if quantization.get("quant_method") != "fp8" or list(quantization.get("weight_block_size") or []) != list(
            QUANTIZATION_CONFIG["weight_block_size"]):
        raise ValueError(f"{directory} is quantized as {quantization}: megarl reads block-FP8 checkpoints "
                         f"(quant_method fp8, weight_block_size {QUANTIZATION_CONFIG['weight_block_size']}); give "
                         f"the model in its training dtype")
    return quantization


def engine_checkpoint(source: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """Where FP8 engines start from: ``source`` itself when it is block FP8 already (DeepSeek-V3 as published),
    else the run's FP8 copy of it (:func:`ensure_engine_checkpoint`)."""
    if checkpoint_quantization(source) is not None:
        return Path(source).expanduser().resolve()
    return Path(run_dir).expanduser() / ENGINE_DIR


def ensure_engine_checkpoint(source: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """The FP8 checkpoint of ``source`` the run's engines start from (``<run_dir>/engine_fp8``; the first weight
    sync replaces its values with the trainer's): written unless it was, from the same files (their names, sizes and
    modification times); written beside and renamed into place, so a killed run leaves none half-written. A source
    in block FP8 already is used as it is (:func:`engine_checkpoint`)."""
    if checkpoint_quantization(source) is not None:
        return Path(source).expanduser().resolve()
    source, directory = Path(source).expanduser().resolve(), Path(run_dir).expanduser() / ENGINE_DIR
    stamp = {"source": str(source), "files": sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                                    for p in source.glob("*.safetensors"))}
    marker = directory / SOURCE_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    building = directory.with_name(f".{ENGINE_DIR}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    try:
        write_fp8_checkpoint(source, building)
        (building / SOURCE_MARKER).write_text(json.dumps(stamp) + "\n")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(building, directory)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return directory
