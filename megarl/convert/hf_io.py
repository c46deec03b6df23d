"""Hugging Face checkpoint files: memory-mapped slice reads, validation, sharded writes.

Reading never loads a whole file: ``safe_open(...).get_slice(name)[...]`` reads only the
requested rows or columns. Writing follows ``save_pretrained``'s layout: shards named
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (or a single
``model.safetensors`` when everything fits in one shard).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.convert.layout import Slice
from megarl.models.fp8 import BLOCK, SCALE_SUFFIX, dequantize_block_fp8

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files save_pretrained writes next to the weights, copied through conversions.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
# Buffers some checkpoints carry that are recomputed, not loaded.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Bytes per element of the safetensors dtypes (others are not size-checked).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
                "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def safetensors_header(path: str | os.PathLike) -> dict:
    """The header of a safetensors file (tensor name -> dtype, shape, data offsets), checked against the file.

    Reads the header only. A ``ValueError`` names the file when it is too short, its header
    length runs past the end, its header is not JSON, or a tensor's bytes lie outside the
    file or do not match its shape and dtype (a truncated or corrupt file).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"safetensors file {path} is {size} bytes, too short for a header: it is truncated")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER_BYTES or 8 + length > size:
            raise ValueError(f"safetensors file {path} announces a {length}-byte header but holds {size} bytes: "
                             "it is truncated or not a safetensors file")
        raw = f.read(length)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        raise ValueError(f"safetensors file {path} has a corrupt header (not JSON: {error})") from None
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = [int(n) for n in entry["shape"]]
            dtype = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"safetensors file {path} has a corrupt header entry for tensor {name}") from None
        if not 0 <= begin <= end or end > data_bytes:
            raise ValueError(f"safetensors file {path}: tensor {name} lies at bytes {begin}..{end} of the data, "
                             f"which holds {data_bytes} bytes: the file is truncated")
        if dtype in _DTYPE_BYTES and end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise ValueError(f"safetensors file {path}: tensor {name} ({dtype}, shape {shape}) needs "
                             f"{math.prod(shape) * _DTYPE_BYTES[dtype]} bytes but occupies {end - begin}: it is corrupt")
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    return tensors


def check_hf_files(directory: str | os.PathLike, flag: str = "--hf") -> dict[str, tuple[int, ...]]:
    """Check every safetensors file of an HF checkpoint directory from its headers; return the tensors' shapes.

    Reads the index (if any) and each file's header, never tensor data. A ``ValueError`` names
    ``flag``, the file and what is wrong: no weights, an unreadable index, a file the index
    names that is missing, a truncated or corrupt file, a tensor the index places in a file
    that does not hold it.
    """
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{flag} {directory}: index {index} is unreadable ({error!r})") from None
    elif (directory / SINGLE_NAME).exists():
        weight_map, files = None, [SINGLE_NAME]
    else:
        raise ValueError(f"{flag} {directory} holds no {SINGLE_NAME} or {INDEX_NAME}: point {flag} at a directory "
                         "written by save_pretrained (safetensors weights)")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        file = directory / name
        if not file.is_file():
            raise ValueError(f"{flag} {directory}: {file}, named by {INDEX_NAME}, is missing")
        for tensor, entry in safetensors_header(file).items():
            shapes[tensor] = tuple(entry["shape"])
            if weight_map is not None and weight_map.get(tensor, name) != name:
                raise ValueError(f"{flag} {directory}: {INDEX_NAME} places tensor {tensor} in {weight_map[tensor]}, "
                                 f"but {file} holds it")
    if weight_map is not None:
        absent = sorted(t for t in weight_map if t not in shapes)
        if absent:
            raise ValueError(f"{flag} {directory}: {INDEX_NAME} lists tensor {absent[0]} in {weight_map[absent[0]]}, "
                             f"whose header does not hold it ({len(absent)} such tensor(s)): the file is corrupt")
    return shapes


def _open(path: Path):
    """``safe_open`` with an error that names the file."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"safetensors file {path} cannot be read ({error}): it is truncated or corrupt") from error


class HFCheckpoint:
    """The tensors of a safetensors checkpoint directory, read lazily by slices."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE_NAME).exists():
            weight_map = {name: SINGLE_NAME for name in _open(self.directory / SINGLE_NAME).keys()}
        else:
            raise ValueError(
                f"{self.directory} holds no {SINGLE_NAME} or {INDEX_NAME}: point --hf at a directory "
                "written by save_pretrained (safetensors weights)"
            )
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}
        self.scales: dict[str, str] = {n.removesuffix(SCALE_SUFFIX): n for n in weight_map
                                       if n.endswith(".weight" + SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX)
                                       in weight_map}
        """A block-FP8 checkpoint's (DeepSeek-V3's as published): quantized weight -> its ``weight_scale_inv``;
        :meth:`read` gives such a weight dequantized (fp32), :meth:`names` leaves the scales out."""

    def _file(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name} is not in the checkpoint {self.directory}")
        filename = self.weight_map[name]
        if filename not in self._handles:
            self._handles[filename] = _open(self.directory / filename)
        return self._handles[filename]

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint (a block-FP8 weight's scale is part of its weight)."""
        scales = set(self.scales.values())
        return [name for name in self.weight_map if name not in scales]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header, without reading data."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (``F32``, ``BF16``, ...)."""
        return self._file(name).get_slice(name).get_dtype()

    def read(self, name: str, where: Slice) -> torch.Tensor:
        """Read only ``where`` of tensor ``name`` (memory-mapped); a block-FP8 weight dequantized to fp32 (the
        whole 128-row or -column blocks around ``where`` read, with their scales)."""
        if name in self.scales:
            return self._read_fp8(name, where)
        return self._read(name, where)

    def _read(self, name: str, where: Slice) -> torch.Tensor:
        handle = self._file(name)
        if where.dim is None:
            return handle.get_tensor(name)
        index = [slice(None)] * (where.dim + 1)
        index[where.dim] = slice(where.start, where.stop)
        return handle.get_slice(name)[tuple(index)]

    def _read_fp8(self, name: str, where: Slice) -> torch.Tensor:
        scale = self.scales[name]
        if where.dim is None:
            return dequantize_block_fp8(self._read(name, where), self._read(scale, where))
        block = BLOCK[where.dim]
        first = where.start // block
        stop = min(math.ceil(where.stop / block) * block, self.shape(name)[where.dim])
        weight = dequantize_block_fp8(self._read(name, Slice(where.dim, first * block, stop)),
                                      self._read(scale, Slice(where.dim, first, math.ceil(stop / block))))
        return weight.narrow(where.dim, where.start - first * block, where.stop - where.start)


def expected_names(family, hf_config) -> list[str]:
    """HF tensor names the family's rules consume for ``hf_config``, in HF order."""
    return [name for at in family.weight_instances(hf_config) for name in at.hf_names]


def expected_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the HF model for ``hf_config``, from transformers itself (meta device); a mixture-of-experts
    model's router and experts as the checkpoint holds them (one tensor per expert); a vision-language model's by
    the hub's names (:meth:`megarl.models.vision.VisionSpec.checkpoint_shapes`)."""
    from transformers import AutoModelForCausalLM

    from megarl.models import family_for

    vision = family_for(hf_config).vision
    if vision is not None:
        return vision.checkpoint_shapes(hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    moe = family_for(hf_config).moe
    if moe is not None:
        shapes.update(moe.hub_shapes(hf_config))
    return shapes


def check_checkpoint(checkpoint: HFCheckpoint, family, hf_config) -> None:
    """Refuse a checkpoint whose tensors are missing, unexpected or of the wrong shape (the layers the family skips,
    a multi-token-prediction layer, are expected and left out)."""
    wanted = expected_names(family, hf_config)
    present = set(checkpoint.names()) - set(family.skipped_tensors(hf_config, checkpoint.names()))
    missing = [n for n in wanted if n not in present]
    wanted_set = set(wanted)
    tied_copy = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    unexpected = sorted(
        n for n in present - wanted_set - tied_copy if not n.endswith(IGNORED_SUFFIXES)
    )
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}")
    if unexpected:
        problems.append(
            f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:20])}{' ...' if len(unexpected) > 20 else ''}"
        )
    shapes = expected_shapes(hf_config)
    for name in wanted:
        if name in present and name in shapes and checkpoint.shape(name) != shapes[name]:
            problems.append(f"tensor {name} has shape {list(checkpoint.shape(name))}, config.json implies {list(shapes[name])}")
    if problems:
        raise ValueError(f"checkpoint {checkpoint.directory} does not match its config.json:\n  " + "\n  ".join(problems))


class ShardedWriter:
    """Writes tensors as save_pretrained does, a shard at a time, then the index."""

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int = 5 * 2**30):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor``; a shard is written once the next would overflow it."""
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        tmp_name = f"shard-{len(self._files):05d}.safetensors"
        save_file(self._pending, self.directory / tmp_name, metadata={"format": "pt"})
        self._files.append((tmp_name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard and the index; return the file names."""
        if self._pending or not self._files:
            self._flush()
        count = len(self._files)
        if count == 1:
            os.replace(self.directory / self._files[0][0], self.directory / SINGLE_NAME)
            return [SINGLE_NAME]
        weight_map, names = {}, []
        for k, (tmp_name, tensors) in enumerate(self._files, start=1):
            final = f"model-{k:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / tmp_name, self.directory / final)
            weight_map.update({t: final for t in tensors})
            names.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def copy_side_files(source: str | os.PathLike, destination: str | os.PathLike) -> list[str]:
    """Copy config, generation config and tokenizer files that exist in ``source``."""
    copied = []
    for name in SIDE_FILES:
        path = Path(source) / name
        if path.exists():
            shutil.copy2(path, Path(destination) / name)
            copied.append(name)
    return copied


def set_config_dtype(directory: str | os.PathLike, dtype: torch.dtype) -> None:
    """Record ``dtype`` as the weights' dtype in ``directory``'s ``config.json`` (``dtype``, and ``torch_dtype`` where
    an older transformers wrote it), and drop a ``quantization_config`` (the weights written are not quantized: a
    block-FP8 source is read dequantized); every other field left as it is."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
