"""Whole-checkpoint conversions (what ``megarl-convert`` runs), on ranks they spawn themselves.

Each conversion validates everything it can before starting ranks (``megarl.convert.preflight``:
the output is writable, the input's files are whole, its shapes match the HF config; headers
and metadata only), writes into a temporary directory next to the output, and renames it into place only when every rank succeeded:
a crash never leaves a half-written directory under the output's name.

A Megatron checkpoint written here is a directory holding ``megarl.json`` (family,
architecture, layout, dtype), ``hf_config/`` (the HF config and tokenizer files, so it can be
turned back into HF without the original) and ``model/`` (the torch_dist checkpoint).
``mcore_to_hf`` also reads a training checkpoint's role directory (its :class:`McoreSource`:
``megarl.workers.model_checkpoint.export_source``), whose torch_dist directory holds the optimizer
state beside the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from megarl.config.parallel import ParallelDims
from megarl.convert.hf_io import (
    HFCheckpoint,
    ShardedWriter,
    check_checkpoint,
    check_hf_files,
    copy_side_files,
    set_config_dtype,
)
from megarl.convert.layout import Slice
from megarl.convert.preflight import check_mcore_files, check_mcore_shapes, check_output

FORMAT = "megarl-mcore"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """What a conversion did."""

    output: str
    seconds: float
    num_ranks: int
    num_tensors: int
    num_bytes: int
    skipped: tuple[str, ...] = ()
    """Tensors of the input the Megatron model leaves out, by name (a DeepSeek-V3 / GLM-4.5 / MiniMax-M2 checkpoint's
    multi-token-prediction layers: not part of the model RL trains), kept beside the checkpoint as they were
    (:data:`KEPT_DIR`) and written back by :func:`mcore_to_hf`."""

    def skipped_line(self) -> str | None:
        """What the Megatron model leaves out and the output keeps, by layer, for the user (None: nothing)."""
        from megarl.convert.loader import skipped_summary

        return skipped_summary(self.skipped) if self.skipped else None


KEPT_DIR = "kept"
"""Where an hf-to-mcore output keeps the checkpoint's tensors the Megatron model leaves out (its multi-token-prediction
layers), as HF safetensors shards, bit for bit: mcore-to-hf writes them back, so an exported model still serves
speculative decoding."""


def _load_hf_config(directory: Path, flag: str = "--hf"):
    from megarl.models.hf_config import load_hf_config

    if not (directory / "config.json").exists():
        raise ValueError(f"{flag} {directory} has no config.json: pass an HF model directory")
    return load_hf_config(directory)


def _check_config(family, hf_config, dims: ParallelDims) -> None:
    heads, groups = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if heads % groups != 0:
        raise ValueError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}"
        )
    family.transformer_config(hf_config, dims)  # checks sizes against the layout, names the setting


@contextlib.contextmanager
def _atomic_output(out: Path, force: bool):
    """Yield a temporary directory that becomes ``out`` only if the block succeeds."""
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {out} is not empty: choose another --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def hf_to_fp8(hf_dir, out, *, max_shard_bytes: int = 5 * 2**30, force: bool = False) -> ConversionReport:
    """The block-FP8 version of the HF checkpoint ``hf_dir`` in ``out``
    (:func:`megarl.convert.fp8.write_fp8_checkpoint`; written next to it, renamed into place when whole)."""
    from megarl.convert.fp8 import write_fp8_checkpoint

    hf_dir, out = Path(hf_dir), Path(out)
    check_hf_files(hf_dir)
    check_output(out, force, {"--hf": hf_dir})
    with _atomic_output(out, force) as tmp:
        report = write_fp8_checkpoint(hf_dir, tmp, max_shard_bytes=max_shard_bytes)
    return ConversionReport(str(out), report.seconds, 1, 2 * report.quantized + report.kept, report.bytes)


def _world(dims: ParallelDims) -> int:
    return dims.tp * dims.pp * dims.dp


def _dims(family, *, tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int | None = None,
          first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> ParallelDims:
    """The conversion's layout: ``tp × pp × d`` ranks, ``d`` the fewest data-parallel replicas that let the experts'
    layout (``etp × ep``) regroup a pipeline stage; sequence parallelism with a mixture of experts at tp > 1 (as
    training needs it; weights do not depend on it)."""
    d = math.lcm(tp, (etp or tp) * ep) // tp
    return ParallelDims(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, dp=d,
                        sequence_parallel=tp > 1 and family.moe is not None,
                        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)


# ------------------------------------------------------------------------------ HF -> mcore
def hf_to_mcore(hf_dir, out, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, etp: int | None = None,
                first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                dtype: str = "fp32", force: bool = False, timeout_s: float = 3600.0) -> ConversionReport:
    """Convert an HF safetensors checkpoint into a Megatron distributed checkpoint (mixture-of-experts models: each
    rank reads only its experts, ``ep``/``etp`` the expert layout; ``first_stage_layers``/``last_stage_layers``: an
    uneven pipeline split)."""
    from megarl.models import family_for
    from megarl.parallel.launch import run_ranks

    hf_dir, out = Path(hf_dir), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_output(out, force, {"--hf": hf_dir})
    hf_config = _load_hf_config(hf_dir)
    family = family_for(hf_config)
    dims = _dims(family, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first_stage_layers,
                 last_stage_layers=last_stage_layers)
    _check_config(family, hf_config, dims)
    check_hf_files(hf_dir, "--hf")  # headers only: a truncated or corrupt file is named before any rank reads it
    checkpoint = HFCheckpoint(hf_dir)
    check_checkpoint(checkpoint, family, hf_config)
    started = time.monotonic()
    with _atomic_output(out, force) as tmp:
        results = run_ranks(
            _hf_to_mcore_rank, _world(dims), str(hf_dir), str(tmp / "model"), dims, dtype, timeout_s=timeout_s
        )
        (tmp / "hf_config").mkdir()
        copy_side_files(hf_dir, tmp / "hf_config")
        _keep(checkpoint, family.skipped_tensors(hf_config, checkpoint.names()), tmp / KEPT_DIR)
        meta = {
            "format": FORMAT,
            "version": 1,
            "family": family.name,
            "architecture": (hf_config.architectures or [None])[0],
            "tp": tp,
            "pp": pp,
            "vpp": vpp,
            "ep": ep,
            "etp": etp,
            "first_stage_layers": first_stage_layers,
            "last_stage_layers": last_stage_layers,
            "dtype": dtype,
        }
        (tmp / "megarl.json").write_text(json.dumps(meta, indent=2) + "\n")
    skipped = tuple(family.skipped_tensors(hf_config, checkpoint.names()))
    return ConversionReport(str(out), time.monotonic() - started, _world(dims), len(checkpoint.names()) - len(skipped),
                            sum(results), skipped)


def _hf_to_mcore_rank(hf_dir: str, model_dir: str, dims: ParallelDims, dtype: str) -> int:
    from megarl.convert.dist_checkpoint import save_dist_checkpoint
    from megarl.convert.loader import load_hf_into
    from megarl.models import build_model_chunks, family_for
    from megarl.models.hf_config import load_hf_config
    from megarl.parallel import destroy_parallel, init_parallel

    hf_config = load_hf_config(hf_dir)
    family = family_for(hf_config)
    groups = init_parallel(dims)
    config = family.transformer_config(hf_config, dims, params_dtype=DTYPES[dtype])
    chunks = build_model_chunks(family, hf_config, dims, config=config)
    bytes_read = load_hf_into(chunks, hf_dir, family, groups, hf_config=hf_config, progress=groups.rank == 0)
    save_dist_checkpoint(chunks, model_dir)
    destroy_parallel()
    return bytes_read


# ------------------------------------------------------------------------------ mcore -> HF
@dataclasses.dataclass(frozen=True)
class McoreSource:
    """A Megatron checkpoint to turn into HF: a :func:`hf_to_mcore` output (:func:`read_mcore_source`) or a
    training checkpoint's role directory (``megarl.workers.model_checkpoint.export_source``)."""

    directory: Path
    """The checkpoint (what ``--mcore`` resolved to)."""
    model_dir: Path
    """Its torch_dist directory (a training checkpoint's also holds the optimizer state, which is not read)."""
    family: str
    tp: int
    pp: int
    ep: int
    etp: int | None
    dtype: str
    """Of its model tensors: a key of :data:`DTYPES`."""
    config_dir: Path | None
    """Its own HF config and tokenizer files; None when it holds none (``--hf-config`` must name them)."""
    lora: Any = None
    """The LoRA adapters it holds (a :class:`~megarl.config.lora.LoraSpec`; None: none): exported merged into the
    weights, or alone in PEFT's format (``peft=True``)."""
    base_dir: Path | None = None
    """A LoRA checkpoint's base model: the HF directory its run loaded (the checkpoint holds the adapters alone)."""
    first_stage_layers: int | None = None
    """The saved layout's first pipeline stage size, where it was uneven (loading at the saved ``pp`` uses it)."""
    last_stage_layers: int | None = None
    """As :attr:`first_stage_layers`, the last stage's."""


def read_mcore_metadata(mcore_dir: Path) -> dict:
    """The ``megarl.json`` of a checkpoint written by :func:`hf_to_mcore`."""
    path = mcore_dir / "megarl.json"
    if not path.exists() or not (mcore_dir / "model" / "metadata.json").exists():
        raise ValueError(
            f"{mcore_dir} is not a megarl Megatron checkpoint (expected megarl.json and model/metadata.json)"
        )
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def read_mcore_source(mcore_dir) -> McoreSource:
    """The :class:`McoreSource` of a checkpoint written by :func:`hf_to_mcore` (its ``megarl.json``)."""
    mcore_dir = Path(mcore_dir)
    meta = read_mcore_metadata(mcore_dir)
    return McoreSource(mcore_dir, mcore_dir / "model", meta["family"], int(meta["tp"]), int(meta["pp"]),
                       int(meta.get("ep") or 1), meta.get("etp"), meta["dtype"], mcore_dir / "hf_config",
                       first_stage_layers=meta.get("first_stage_layers"),
                       last_stage_layers=meta.get("last_stage_layers"))


def dtype_name(dtype: torch.dtype, where) -> str:
    """The :data:`DTYPES` key of ``dtype`` (a ``ValueError`` naming ``where`` for another dtype)."""
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"{where} holds {dtype} tensors; megarl-convert reads {', '.join(DTYPES)}")
    return names[dtype]


def _source_config(source: McoreSource, hf_config_dir) -> tuple[Path, str]:
    """The HF config directory of ``source`` (``--hf-config`` first) and how messages name it."""
    if hf_config_dir:
        return Path(hf_config_dir), f"--hf-config {hf_config_dir}"
    if source.config_dir is None or not (source.config_dir / "config.json").exists():
        raise ValueError(f"--mcore {source.directory} holds no HF config (a checkpoint saved before checkpoints "
                         "kept theirs): pass --hf-config DIR, the HF model directory the run started from "
                         "(actor_rollout_ref.model.path)")
    return source.config_dir, f"the checkpoint's own config {source.config_dir}"


def mcore_to_hf(mcore, out, *, hf_config_dir=None, tp: int | None = None, pp: int | None = None,
                ep: int | None = None, etp: int | None = None, dtype: str | None = None, max_shard_bytes: int = 5 * 2**30, bucket_bytes: int = 256 * 2**20,
                force: bool = False, timeout_s: float = 3600.0, peft: bool = False,
                base_dir=None) -> ConversionReport:
    """Convert a Megatron checkpoint into HF safetensors shards, index, config and tokenizer files.

    A checkpoint with LoRA adapters (:attr:`McoreSource.lora`) is exported with the adapters merged into the
    weights, or with ``peft`` as the adapters alone in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained`` on the HF base model). Its base
    weights come from the HF model its run loaded (``base_dir`` overrides :attr:`McoreSource.base_dir`).

    ``mcore``: a directory written by :func:`hf_to_mcore`, or a :class:`McoreSource` (a training checkpoint:
    ``megarl-convert`` resolves those). It loads at the layout it was saved at unless ``tp``/``pp``/``ep``/``etp``
    say otherwise (the model's tensors are layout-independent; virtual pipeline chunks do not matter).
    """
    from megarl.models import family_for
    from megarl.parallel.launch import run_ranks

    source = mcore if isinstance(mcore, McoreSource) else read_mcore_source(mcore)
    out = Path(out)
    # A LoRA checkpoint's base model is an input too: replacing it with the merged weights would apply the
    # adapters twice at a later resume or export, silently.
    base_input = None if source.lora is None else (base_dir or source.base_dir)
    base_flag = "--base" if base_dir else "(the base model the LoRA checkpoint names)"
    check_output(out, force, {"--mcore": source.directory, "--hf-config": hf_config_dir, base_flag: base_input})
    config_dir, config_flag = _source_config(source, hf_config_dir)
    hf_config = _load_hf_config(config_dir, "--hf-config" if hf_config_dir else "the checkpoint's own config")
    family = family_for(hf_config)
    if family.name != source.family:
        raise ValueError(
            f"--hf-config {config_dir} is a {family.name} model but {source.directory} holds a {source.family} model"
        )
    if peft and source.lora is None:
        raise ValueError(f"--peft: {source.directory} holds no LoRA adapters (its run had "
                         f"actor_rollout_ref.model.lora_rank=0); export it without --peft")
    dtype = dtype or source.dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    tp = tp or source.tp
    etp = etp or (source.etp if tp == source.tp else None)
    pp = pp or source.pp
    saved_split = {"first_stage_layers": source.first_stage_layers,
                   "last_stage_layers": source.last_stage_layers} if pp == source.pp else {}
    dims = _dims(family, tp=tp, pp=pp, ep=ep or source.ep, etp=etp, **saved_split)
    _check_config(family, hf_config, dims)
    check_mcore_files(source.model_dir)  # metadata only: a truncated shard is named before any rank loads it
    base = None
    if source.lora is None:
        check_mcore_shapes(source.model_dir, family, hf_config, source.tp, config_flag)
    else:  # the adapters' checkpoint; the base weights are the HF model the run loaded
        base = Path(base_dir or source.base_dir or "")
        if not base_dir and not (base / "config.json").exists():
            raise ValueError(f"{source.directory} holds LoRA adapters for the base model {str(base)!r}, which is "
                             f"not there now: pass --base DIR, that model's HF directory")
        check_checkpoint(HFCheckpoint(base), family, hf_config)
    started = time.monotonic()
    with _atomic_output(out, force) as tmp:
        results = run_ranks(
            _mcore_to_hf_rank, _world(dims), str(source.model_dir), str(config_dir), str(tmp), dims,
            source.dtype, dtype, max_shard_bytes, bucket_bytes, timeout_s=timeout_s, lora=source.lora, peft=peft,
            base_dir=None if base is None else str(base),
            kept_dir=str(source.directory / KEPT_DIR) if (source.directory / KEPT_DIR).is_dir() else None,
        )
        if peft:
            num_tensors, num_bytes = _write_peft(tmp, results, source.lora, hf_config, dtype)
        else:
            copy_side_files(config_dir, tmp)  # config.json as the checkpoint had it (a model_type of its own)
            set_config_dtype(tmp, DTYPES[dtype])
            num_tensors, num_bytes = results[0]
    return ConversionReport(str(out), time.monotonic() - started, _world(dims), num_tensors, num_bytes)


def _write_peft(out: Path, results: list, lora, hf_config, dtype: str) -> tuple[int, int]:
    """PEFT's adapter directory from the ranks' adapters (each stage's TP rank 0 returns its layers)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for result in results:
        tensors.update(result)
    tensors = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in sorted(tensors.items())}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = lora.peft_config(getattr(hf_config, "_name_or_path", None))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _keep(checkpoint: HFCheckpoint, names: list[str], directory: Path) -> None:
    """The checkpoint's tensors ``names`` (those the Megatron model leaves out) written under ``directory`` as they
    are, one at a time (a shard per 5 GiB)."""
    if not names:
        return
    directory.mkdir()
    writer = ShardedWriter(directory)
    for name in names:
        writer.add(name, checkpoint.read(name, Slice(None)))
    writer.close()


def _mcore_to_hf_rank(model_dir, config_dir, out_dir, dims, saved_dtype, dtype, max_shard_bytes, bucket_bytes,
                      lora=None, peft=False, base_dir=None, kept_dir=None):
    from tqdm import tqdm

    from megarl.convert.dist_checkpoint import load_dist_checkpoint
    from megarl.convert.export import WeightExporter
    from megarl.models import build_model_chunks, family_for
    from megarl.models.hf_config import load_hf_config
    from megarl.parallel import destroy_parallel, init_parallel

    hf_config = load_hf_config(config_dir)
    family = family_for(hf_config)
    groups = init_parallel(dims)
    config = family.transformer_config(hf_config, dims, params_dtype=DTYPES[saved_dtype])
    chunks = build_model_chunks(family, hf_config, dims, config=config, use_te=False if lora is not None else None)
    if lora is not None:  # the base from HF, the adapters as the run had them, their values from the checkpoint
        from megarl.convert.loader import load_hf_into
        from megarl.convert.lora import adapter_tensors, attach_lora

        load_hf_into(chunks, base_dir, family, groups, hf_config=hf_config)
        attach_lora(chunks, lora, family, hf_config)
    load_dist_checkpoint(chunks, model_dir, adapters_only=lora is not None)
    if peft:
        adapters = adapter_tensors(chunks, family, hf_config)
        keep = groups.tp_rank == 0 and groups.dp_rank == 0
        destroy_parallel()
        return adapters if keep else {}
    exporter = WeightExporter(chunks, family, hf_config, groups, dtype=DTYPES[dtype])
    writer = ShardedWriter(out_dir, max_shard_bytes) if groups.rank == 0 else None
    num_tensors = 0
    with tqdm(total=exporter.total_bytes, unit="B", unit_scale=True, desc="export", disable=writer is None) as bar:
        for bucket in exporter.iter_full(bucket_bytes):
            for name, tensor in bucket:
                if writer is not None:
                    writer.add(name, tensor)
                num_tensors += 1
            bar.update(sum(t.numel() * t.element_size() for _, t in bucket))
    kept_bytes = 0
    if writer is not None and kept_dir is not None:  # the layers the model left out, back as they were
        kept = HFCheckpoint(kept_dir)
        for name in kept.names():
            tensor = kept.read(name, Slice(None))
            writer.add(name, tensor)
            kept_bytes += tensor.numel() * tensor.element_size()
            num_tensors += 1
    if writer is not None:
        writer.close()
    destroy_parallel()
    return num_tensors, exporter.total_bytes + kept_bytes
