"""Megatron distributed checkpoints (torch_dist) of model chunks, reloadable at any TP/PP/VPP.

Tensors are stored under layout-independent keys (Megatron's sharded state dict stacks the
layers along a global axis), so a checkpoint written at TP=2×PP=2 loads at TP=1×PP=2, or
with virtual pipeline chunks, unchanged.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path


def model_sharded_state_dict(model_chunks, *, adapters_only: bool = False) -> dict:
    """Megatron's sharded state dict of the chunks (DDP-wrapped or not): ``model`` or ``model<i>`` keys.
    ``adapters_only``: the LoRA adapters' entries alone (a LoRA run's checkpoint: its base is the HF model)."""
    from megarl.models.lora import is_lora_parameter

    modules = [c.module if hasattr(c, "module") else c for c in model_chunks]

    def state(module) -> dict:
        entries = module.sharded_state_dict()
        if adapters_only:
            entries = {key: value for key, value in entries.items() if is_lora_parameter(key)}
        return entries

    if len(modules) == 1:
        return {"model": state(modules[0])}
    return {f"model{i}": state(m) for i, m in enumerate(modules)}


def use_in_process_results_queue() -> None:
    """Keep Megatron's checkpoint writer from starting a multiprocessing Manager.

    The torch_dist writer reports write results through a queue that it creates, on first
    use, as ``spawn``-context ``Manager().Queue()``: a server process that outlives the
    rank and holds its stdout open. megarl saves synchronously, so the queue is only ever
    used inside this process and a plain ``queue.Queue`` does the same job.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def dist_checkpoint_problem(directory: str | os.PathLike) -> str | None:
    """What makes the torch_dist checkpoint in ``directory`` unloadable, read from its metadata alone; None if nothing.

    Reads ``.metadata`` (the tensors' shapes and where their bytes are) and checks that every
    data file it names exists and reaches the last byte of its last tensor, and that
    ``common.pt`` loads: a truncated or missing file is named, without reading any tensor.
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory)
    if not (directory / "metadata.json").is_file():
        return f"{directory} has no metadata.json (not a Megatron distributed checkpoint, or its save was interrupted)"
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # noqa: BLE001 - pickle reports a damaged file in many ways
        return f"file {directory / '.metadata'} is unreadable ({type(error).__name__}: {error}; truncated?)"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = directory / name
        if not file.is_file():
            return f"file {file} is missing"
        size = file.stat().st_size
        if size < end:
            return f"file {file} has {size} bytes but its tensors reach byte {end} (truncated)"
    common = directory / "common.pt"
    if common.is_file():
        try:
            torch.load(common, map_location="cpu", weights_only=False)
        except Exception as error:  # noqa: BLE001 - as above
            return f"file {common} is unreadable ({type(error).__name__}: {error}; truncated?)"
    return None


def read_dist_metadata(directory: str | os.PathLike):
    """The torch_dist ``.metadata`` of ``directory`` (tensor shapes and storage), read without loading tensors."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(directory)).read_metadata()


OPTIMIZER_PREFIX = "optimizer."
"""Keys of a training checkpoint's optimizer state (``megarl.workers.model_checkpoint``); the model's are the rest."""


def model_tensor_dtype(directory: str | os.PathLike):
    """The torch dtype of the model's tensors in the torch_dist checkpoint ``directory`` (metadata only; the
    optimizer's state, which a training checkpoint holds beside them, is skipped); None when it holds none."""
    import torch

    for name, entry in read_dist_metadata(directory).state_dict_metadata.items():
        if not name.startswith(OPTIMIZER_PREFIX) and isinstance(getattr(entry, "size", None), torch.Size):
            return entry.properties.dtype
    return None


def save_dist_checkpoint(model_chunks, directory: str | os.PathLike) -> None:
    """Save this rank's chunks into ``directory`` (collective: every rank of the model calls it)."""
    from megatron.core import dist_checkpointing

    use_in_process_results_queue()
    Path(directory).mkdir(parents=True, exist_ok=True)  # torch_dist needs it to exist
    dist_checkpointing.save(model_sharded_state_dict(model_chunks), str(directory))


def load_dist_checkpoint(model_chunks, directory: str | os.PathLike, *, adapters_only: bool = False) -> None:
    """Load ``directory`` into this rank's chunks, whatever layout it was saved with (collective);
    ``adapters_only``: a LoRA run's checkpoint (its adapters; the chunks hold the base already)."""
    from megatron.core import dist_checkpointing

    if not (Path(directory) / "metadata.json").exists():
        raise ValueError(f"{directory} is not a Megatron distributed checkpoint (no metadata.json)")
    problem = dist_checkpoint_problem(directory)  # the same answer on every rank: none is left waiting
    if problem is not None:
        raise ValueError(f"checkpoint {directory} cannot be loaded: {problem}")
    sharded = model_sharded_state_dict(model_chunks, adapters_only=adapters_only)
    with warnings.catch_warnings():
        # Megatron 0.16's torch_dist loader calls torch APIs that now announce their successors.
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*(load_state_dict|DTensor).*")
        state = dist_checkpointing.load(sharded, str(directory))
    modules = [c.module if hasattr(c, "module") else c for c in model_chunks]
    keys = ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]
    for module, key in zip(modules, keys):
        module.load_state_dict(state[key], strict=False)
