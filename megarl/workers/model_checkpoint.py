"""Save and restore a trainable ``ShardedModel``: weights, optimizer, LR schedule and RNG streams.

Collective: every rank of the role calls each function with the same directory. A role's
checkpoint directory holds

- ``dist/``: one Megatron distributed checkpoint (torch_dist) with the model and, unless
  ``with_optimizer=False``, the optimizer state;
- ``rng/rank_<r>.pt``: rank r's generators (Python, NumPy, torch, CUDA when present, and
  Megatron's model-parallel tracker);
- ``hf_config/``: the HF ``config.json``, generation config and tokenizer files of the model it
  was built from, so ``megarl-convert mcore-to-hf`` turns the checkpoint into an HF directory on
  its own (:func:`export_source`);
- ``model.json``: the layout it was saved at, the optimizer's sharding type, the LR
  schedule's state, the HF directory the model was built from. Rank 0 writes it last, after every rank finished, so a directory with
  ``model.json`` is complete (the controller's temporary-directory rename adds atomicity).

Damaged files. ``load_model`` checks, before any collective load, that every data file of
``dist/`` reaches the end its metadata records and that the RNG files read; a truncated or
unreadable file is refused on every rank, naming the file and the checkpoint directory
(the controller's manifest, ``megarl.controller.run_checkpoints``, catches it earlier).

Layouts. The model part is layout-independent: it loads at any TP/PP/VPP. The optimizer
part is stored as Megatron's ``dp_reshardable`` distributed-optimizer format (the default of
Megatron's own training loop; fully parallel, no gather; on CPU the other formats fail: the
model-space default at save, ``fully_reshardable`` and ``dp_zero_gather_scatter`` when loading
torch Adam's state); it and the RNG streams belong to
ranks, so they load only at the layout they were saved at (``load_model`` says so, naming
both layouts). Resuming at a new layout: ``load_model(..., with_optimizer=False,
load_rng=False)``.

Torch-Adam fallback (no Apex/TE, i.e. CPU), three snags of Megatron 0.16.1 that
``load_model`` works around: the distributed optimizer cannot describe the state of an
optimizer that never stepped (it asserts one ``step`` per parameter), so the state is
allocated first; its ``dp_reshardable`` loader restores Adam's ``step`` and then overwrites
it with the pre-load value, and gives every parameter one shared ``step`` tensor (torch's
per-tensor Adam would add to it once per parameter), so each parameter gets its own tensor
with the checkpoint's step; with fp32 params its main params are views of the model's
leaf parameters, which it copies into outside ``no_grad``, so the load runs under it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "megarl-model"
VERSION = 1
SHARDING_TYPE = "dp_reshardable"
METADATA_FILE = "model.json"
DIST_DIR = "dist"
RNG_DIR = "rng"
HF_CONFIG_DIR = "hf_config"


def layout_of(dims) -> dict:
    """The layout a checkpoint records (``model.json``'s ``layout``) of ``ParallelDims`` with ``dp`` bound."""
    uneven = {k: getattr(dims, k) for k in ("first_stage_layers", "last_stage_layers") if getattr(dims, k) is not None}
    return {"tp": dims.tp, "pp": dims.pp, "vpp": dims.num_virtual_stages, "cp": dims.cp, "dp": dims.dp,
            "ep": dims.ep, "etp": dims.expert_tp, **uneven}


def _layout(model) -> dict:
    return layout_of(model.groups.dims)


def layout_mismatch(meta: dict, dims) -> str | None:
    """None when the checkpoint of ``meta`` (its ``model.json``) was saved at ``dims`` (``dp`` bound), else
    ``"TP2×PP1×… on 2 ranks" vs "TP1×…"``-style text naming both."""
    saved = {"ep": 1, "etp": meta["layout"]["tp"], **meta["layout"], "world_size": meta["world_size"]}
    current = {**layout_of(dims), "world_size": dims.world_size}
    if saved == current:
        return None
    return f"saved at {_describe(saved)}, but this run's layout is {_describe(current)}"


def _optimizer_metadata() -> dict:
    return {"distrib_optim_sharding_type": SHARDING_TYPE}


def _sharded_state(model, *, with_optimizer: bool, is_loading: bool) -> dict:
    """Model (and optimizer) sharded state dict in the keys Megatron's training uses."""
    from megarl.convert.dist_checkpoint import model_sharded_state_dict

    # A LoRA model saves its adapters alone (its base is the HF model it loads from, frozen).
    state = model_sharded_state_dict(model.chunks, adapters_only=model.lora is not None)
    if with_optimizer:
        state["optimizer"] = model.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_optimizer_metadata(),
        )
    return state


def _inner_optimizers(model) -> list:
    """The torch optimizers inside Megatron's (chained) optimizer."""
    optimizer = model.optimizer
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        if "cuda" not in state:
            raise ValueError("the checkpoint was saved without CUDA: its CUDA generator states are missing")
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_rng(directory: Path, rank: int) -> None:
    import io

    buffer = io.BytesIO()
    torch.save(_rng_state(), buffer)
    _write_durably(directory / RNG_DIR / f"rank_{rank:05d}.pt", buffer.getvalue())


def save_model(model, directory: str | os.PathLike, *, with_optimizer: bool = True) -> float:
    """Write ``model``'s weights, optimizer, schedule and RNG states into ``directory``.

    Collective over the role's ranks. Returns the seconds it took on this rank.
    """
    from megatron.core import dist_checkpointing

    from megarl.convert.dist_checkpoint import use_in_process_results_queue

    started = time.monotonic()
    if with_optimizer and model.optimizer is None:
        raise ValueError("save_model(with_optimizer=True) on a frozen role: it has no optimizer")
    directory = Path(directory)
    rank = model.groups.rank
    for sub in (DIST_DIR, RNG_DIR):  # every rank: the directory may be on a file system of its own node
        (directory / sub).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    use_in_process_results_queue()
    dist_checkpointing.save(_sharded_state(model, with_optimizer=with_optimizer, is_loading=False),
                            str(directory / DIST_DIR))
    _save_rng(directory, rank)
    dist.barrier()  # every rank's files are written before model.json marks the directory complete
    if rank == 0:
        _save_hf_config(model, directory / HF_CONFIG_DIR)
        meta = {
            "format": FORMAT, "version": VERSION, "family": model.family.name,
            "world_size": dist.get_world_size(), "layout": _layout(model),
            "with_optimizer": with_optimizer,
            "optimizer_sharding_type": SHARDING_TYPE if with_optimizer else None,
            "scheduler": model.scheduler.state_dict() if model.scheduler is not None else None,
            "hf_dir": os.path.abspath(model.hf_dir), "value_head": bool(model.value_head),
            "lora": (None if model.lora is None else
                     {"rank": model.lora.rank, "alpha": model.lora.alpha, "targets": list(model.lora.targets)}),
        }
        _write_durably(directory / METADATA_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    dist.barrier()
    return time.monotonic() - started


def _save_hf_config(model, directory: Path) -> None:
    """Copy the model's HF config, generation config and tokenizer files (small) into ``directory``, durably."""
    from megarl.convert.hf_io import SIDE_FILES

    directory.mkdir(exist_ok=True)
    for name in SIDE_FILES:
        source = Path(model.hf_dir) / name
        if source.is_file():
            _write_durably(directory / name, source.read_bytes())


def read_model_metadata(directory: str | os.PathLike) -> dict:
    """The ``model.json`` of a role checkpoint written by :func:`save_model`."""
    path = Path(directory) / METADATA_FILE
    if not path.exists() or not (Path(directory) / DIST_DIR / "metadata.json").exists():
        raise ValueError(f"{directory} is not a complete model checkpoint (expected {METADATA_FILE} and "
                         f"{DIST_DIR}/metadata.json); was its save interrupted?")
    try:
        meta = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"file {path} of checkpoint {directory} is unreadable ({error}; truncated?): "
                         "resume from another checkpoint") from error
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def _describe(layout: dict) -> str:
    layout = {"ep": 1, "etp": layout["tp"], **layout}  # checkpoints from before expert parallelism
    experts = "×EP{ep}×ETP{etp}".format(**layout) if layout["ep"] > 1 or layout["etp"] != layout["tp"] else ""
    return ("TP{tp}×PP{pp}×VPP{vpp}×CP{cp}×DP{dp}".format(**layout) + experts
            + " on {world_size} ranks".format(**layout))


def _check_same_layout(model, meta: dict, directory) -> None:
    mismatch = layout_mismatch(meta, model.groups.dims)
    if mismatch is not None:
        raise ValueError(
            f"{directory} was {mismatch}: optimizer and RNG states load only at the layout they were saved at. "
            "Resume at that layout, or load the weights alone with load_model(..., with_optimizer=False, "
            "load_rng=False)"
        )


# The LR schedule's fixed settings, as OptimConfig names them (num_steps is the state proper).
_SCHEDULE_SETTINGS = {
    "max_lr": "optim.lr", "min_lr": "optim.min_lr", "lr_warmup_steps": "optim.warmup_steps",
    "lr_decay_steps": "optim.warmup_steps + optim.decay_steps", "lr_decay_style": "optim.decay_style",
    "start_wd": "optim.weight_decay", "end_wd": "optim.weight_decay",
}


def check_schedule(saved: dict, current: dict, directory) -> None:
    """Refuse to resume a schedule whose settings changed (Megatron would fail an assert)."""
    changed = [f"{setting}: saved {saved[key]!r}, now {current[key]!r}"
               for key, setting in _SCHEDULE_SETTINGS.items() if key in saved and saved[key] != current[key]]
    if changed:
        raise ValueError(
            f"{directory} was saved with other learning-rate schedule settings ({'; '.join(changed)}): "
            "resume with the saved settings, or load the weights alone with load_model(..., with_optimizer=False)"
        )


def _allocate_optimizer_state(model) -> None:
    """Give a never-stepped torch Adam zero state, so Megatron can describe it for loading."""
    for inner in _inner_optimizers(model):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # Apex/TE FusedAdam: Megatron handles a fresh state itself
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def _restore_step_tensors(model) -> None:
    """Give each parameter its own ``step`` tensor holding the checkpoint's step (torch-Adam fallback).

    Megatron keeps torch Adam's per-parameter ``step`` out of the checkpoint's tensors and in
    the param groups. Its ``dp_reshardable`` loader then copies the pre-load ``step`` back over
    the restored one, and it gives every parameter the same tensor, which torch's per-tensor
    Adam increments once per parameter per step. The param groups hold the right value.
    """
    for inner in _inner_optimizers(model):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param, {})
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].new_tensor(float(group["step"]))


def load_model(model, directory: str | os.PathLike, *, with_optimizer: bool = True,
                load_rng: bool = True) -> float:
    """Restore what :func:`save_model` wrote into ``model`` (collective). Returns the seconds taken.

    The weights load at any layout; the optimizer, schedule and RNG streams only at the
    layout they were saved at (a ``ValueError`` names both otherwise).
    """
    from megatron.core import dist_checkpointing

    started = time.monotonic()
    directory = Path(directory)
    meta = read_model_metadata(directory)
    if meta["family"] != model.family.name:
        raise ValueError(f"{directory} holds a {meta['family']} model, this role a {model.family.name} model")
    if with_optimizer:
        if model.optimizer is None:
            raise ValueError("load_model(with_optimizer=True) on a frozen role: it has no optimizer")
        if not meta["with_optimizer"]:
            raise ValueError(f"{directory} was saved without optimizer state: pass with_optimizer=False")
        if meta["optimizer_sharding_type"] != SHARDING_TYPE:
            raise ValueError(f"{directory}: optimizer sharding type {meta['optimizer_sharding_type']!r} "
                             f"is not {SHARDING_TYPE!r}")
    if with_optimizer or load_rng:
        _check_same_layout(model, meta, directory)
    if with_optimizer and model.scheduler is not None and meta["scheduler"] is not None:
        check_schedule(meta["scheduler"], model.scheduler.state_dict(), directory)
    rng_file = directory / RNG_DIR / f"rank_{model.groups.rank:05d}.pt"
    if load_rng and not rng_file.exists():  # checked before any collective: no rank is left waiting
        raise ValueError(f"{directory} has no RNG state for rank {model.groups.rank} ({rng_file})")
    rng_state = _check_files(model, directory, rng_file if load_rng else None)
    if with_optimizer:
        _allocate_optimizer_state(model)
    sharded = _sharded_state(model, with_optimizer=with_optimizer, is_loading=True)
    with warnings.catch_warnings():
        # Megatron 0.16's torch_dist loader calls torch APIs that now announce their successors.
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*(load_state_dict|DTensor).*")
        state = dist_checkpointing.load(sharded, str(directory / DIST_DIR))
    modules = [c.module if hasattr(c, "module") else c for c in model.chunks]
    keys = ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]
    for module, key in zip(modules, keys, strict=True):
        module.load_state_dict(state[key], strict=False)
    if with_optimizer:
        # With fp32 params the distributed optimizer's main params are views of the model's
        # leaf parameters: Megatron copies into them in place, which autograd refuses outside no_grad.
        with torch.no_grad():
            model.optimizer.load_state_dict(state["optimizer"])
        _restore_step_tensors(model)
        if model.scheduler is not None and meta["scheduler"] is not None:
            model.scheduler.load_state_dict(copy.deepcopy(meta["scheduler"]))
    if load_rng:
        _set_rng_state(rng_state)
    dist.barrier()
    return time.monotonic() - started


def _check_files(model, directory: Path, rng_file: Path | None) -> dict | None:
    """Refuse, on every rank, a checkpoint with a truncated or unreadable file (named); returns this rank's RNG state.

    Rank 0 checks the distributed checkpoint's files against its metadata
    (:func:`~megarl.convert.dist_checkpoint.dist_checkpoint_problem`), each rank reads its RNG
    file; one small collective shares the answers, so every rank raises the same error before
    the collective load instead of some ranks waiting in it.
    """
    from megarl.convert.dist_checkpoint import dist_checkpoint_problem

    problem = dist_checkpoint_problem(directory / DIST_DIR) if model.groups.rank == 0 else None
    rng_state = None
    if rng_file is not None:
        try:
            rng_state = torch.load(rng_file, weights_only=False)
        except Exception as error:  # noqa: BLE001 - torch.load reports a damaged file in many ways
            problem = problem or f"file {rng_file} is unreadable ({type(error).__name__}: {error}; truncated?)"
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise ValueError(f"checkpoint {directory} cannot be loaded: {first}. It was damaged after it was saved: "
                         "resume from another checkpoint")
    return rng_state


def export_hf(model, directory: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
              bucket_bytes: int = 256 * 2**20) -> float:
    """Write the current weights as an HF safetensors checkpoint with config and tokenizer files.

    Collective: every rank iterates the exporter (it gathers over TP and broadcasts over PP);
    rank 0 writes. Returns the seconds taken.
    """
    from megarl.convert.hf_io import ShardedWriter, copy_side_files, set_config_dtype

    started = time.monotonic()
    directory = Path(directory)
    exporter = model.exporter()
    writer = None
    if model.groups.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        writer = ShardedWriter(directory, max_shard_bytes)
    for bucket in exporter.iter_full(bucket_bytes):
        if writer is not None:
            for name, tensor in bucket:
                writer.add(name, tensor)  # copies: the bucket's views are reused
    if writer is not None:
        writer.close()
        copy_side_files(model.hf_dir, directory)  # config.json as the checkpoint had it (a model_type of its own)
        set_config_dtype(directory, exporter.dtype)
    dist.barrier()
    return time.monotonic() - started


def export_source(directory: str | os.PathLike):
    """What ``megarl-convert mcore-to-hf`` reads of the role checkpoint ``directory`` (a ``McoreSource``).

    The saved layout (TP, PP, EP, ETP) comes from ``model.json``, the dtype of the weights from the distributed
    checkpoint's metadata, the HF config from ``hf_config/`` (None in checkpoints saved before it was kept:
    the converter then needs ``--hf-config``). A critic's checkpoint (a value head, no LM head) is refused.
    """
    from megarl.convert.dist_checkpoint import model_tensor_dtype
    from megarl.convert.jobs import McoreSource, dtype_name

    directory = Path(directory)
    meta = read_model_metadata(directory)
    if meta.get("value_head"):
        raise ValueError(f"{directory} is a critic's checkpoint (a value head, not a language model): "
                         "export the actor's, its sibling actor/")
    dtype = model_tensor_dtype(directory / DIST_DIR)
    if dtype is None:
        raise ValueError(f"{directory / DIST_DIR} holds no model tensors")
    layout = meta["layout"]
    config_dir = directory / HF_CONFIG_DIR
    return McoreSource(directory, directory / DIST_DIR, meta["family"], int(layout["tp"]), int(layout["pp"]),
                       int(layout.get("ep") or 1), layout.get("etp"), dtype_name(dtype, directory / DIST_DIR),
                       config_dir if (config_dir / "config.json").exists() else None, lora=_lora_spec(meta.get("lora")),
                       base_dir=Path(meta["hf_dir"]) if meta.get("lora") else None,
                       first_stage_layers=layout.get("first_stage_layers"),
                       last_stage_layers=layout.get("last_stage_layers"))


def _lora_spec(saved: dict | None):
    """The :class:`~megarl.config.lora.LoraSpec` a checkpoint's ``model.json`` records (None: no adapters)."""
    if not saved:
        return None
    from megarl.config.lora import LoraSpec

    return LoraSpec(rank=int(saved["rank"]), alpha=float(saved["alpha"]), targets=tuple(saved["targets"]))
