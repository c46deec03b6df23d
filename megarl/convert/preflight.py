"""Checks ``megarl-convert`` makes in its own process before it spawns any rank.

Each raises a ``ValueError`` naming the flag and the file, which the CLI prints as one line
and exits 2 with: the output directory must be creatable and writable
(:func:`check_output`); the input's files must be whole (HF safetensors headers,
:func:`megarl.convert.hf_io.check_hf_files`; Megatron shards against their metadata,
:func:`check_mcore_files`); and the HF config must describe the tensors the checkpoint
holds (:func:`check_mcore_shapes`). Only headers and metadata are read, never tensor data.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from megarl.models.weights import Fuse, Split


def check_output(out: str | os.PathLike, force: bool,
                 inputs: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    """Refuse an ``--out`` that cannot become the output directory, before any work.

    It must not be a file; it must not be, or contain, one of ``inputs`` (flag -> directory: replacing ``out``
    would delete that input, and with ``--force`` it did); an existing directory must be empty unless ``force``
    (the CLI's promise: ``--force`` replaces a non-empty output directory); its parent, or the nearest
    existing ancestor when the parent is yet to be created, must be a directory this process
    can create entries in (the conversion writes a temporary directory next to ``out`` and
    renames it). Writability is probed by creating and removing an empty directory there.
    """
    out = Path(out)
    target = out.resolve()
    for flag, directory in (inputs or {}).items():
        if directory is None:
            continue
        source = Path(directory).resolve()
        if source == target or target in source.parents:
            what = "is" if source == target else "contains"
            raise ValueError(f"--out {out} {what} the input {flag} {directory}: the output replaces --out, which "
                             f"would delete that input; choose an --out outside it")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory: choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {out} is not empty: choose another --out or pass --force to replace it")
    ancestor = out.absolute().parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"--out {out} cannot be created: {ancestor} is not a directory; choose another --out")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megarl-convert-probe-", dir=ancestor))
    except OSError as error:
        raise ValueError(f"--out {out} is not writable: cannot create entries in {ancestor} "
                         f"({error.strerror or error}); choose another --out") from None


def check_mcore_files(model_dir: str | os.PathLike, flag: str = "--mcore") -> None:
    """Refuse a Megatron checkpoint whose data files are missing or shorter than its metadata says."""
    from megarl.convert.dist_checkpoint import dist_checkpoint_problem

    problem = dist_checkpoint_problem(model_dir)
    if problem is not None:
        raise ValueError(f"{flag} {Path(model_dir).parent}: {problem}")


def _megatron_shape(rule, hf_shapes: list[tuple[int, ...]], padded_vocab: int) -> tuple[int, ...]:
    """The full (TP-gathered) Megatron shape of one layer's tensor of ``rule``."""
    first = hf_shapes[0]
    if rule.fuse in (Fuse.QKV, Fuse.GATED_QKV, Fuse.GATE_UP) or len(hf_shapes) > 1:
        return (sum(s[0] for s in hf_shapes), *first[1:])
    if rule.split is Split.VOCAB:
        return (padded_vocab, *first[1:])
    return first


def expected_mcore_shapes(family, hf_config, tp: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Global shapes of the tensors in a Megatron checkpoint of ``hf_config`` saved at ``tp``.

    Keyed by the checkpoint's tensor name: layers stacked on a leading axis (``decoder.layers.<name>`` of shape
    ``[num_layers, ...]``), or one key per layer (``decoder.layers.<i>.<name>``) when dense and mixture-of-experts
    layers alternate (Megatron's rule); a sparse layer's experts on one axis
    (``mlp.experts.experts.linear_fc1.weight`` of shape ``[experts, ...]``). Each value is the shape and the HF
    tensors it is made of. Norms fused into the next linear layer are listed under both spellings (local and
    TransformerEngine spec); a checkpoint holds one of them.
    """
    from megarl.convert.hf_io import expected_shapes

    hf_shapes = expected_shapes(hf_config)
    sparse = family.sparse_layers(hf_config)
    kinds = family.layer_attention(hf_config)
    stacked = len(set(zip(sparse, kinds))) == 1  # Megatron stacks the layers of a homogeneous model only
    num_layers = len(sparse)
    experts = family.moe.num_experts(hf_config) if family.moe is not None else 0
    padded_vocab = family.padded_vocab_size(hf_config, tp)
    named = family.named_sizes(hf_config)
    out = {}
    for rule in family.weight_rules(hf_config):
        layers = ([layer for layer in range(num_layers) if rule.applies_to(sparse[layer], kinds[layer])]
                  if rule.per_layer else [None])
        for layer in layers[:1] if stacked else layers:
            names = rule.hf_names(layer, 0 if rule.per_expert else None)
            if any(n not in hf_shapes for n in names):
                continue  # not a tensor transformers' model has (nothing to compare with)
            shape = _megatron_shape(rule, [hf_shapes[n] for n in names], padded_vocab)
            if rule.per_expert:
                shape = (experts, *shape)
            if rule.per_layer and stacked:
                shape = (num_layers, *shape)
            parts = [("", shape)]
            if rule.checkpoint_parts:  # Megatron saves it piece by piece: [layers?, piece rows, rest]
                rest = hf_shapes[names[0]][1:]
                lead = shape[:len(shape) - 1 - len(rest)]
                parts = [(f".{suffix}", (*lead, named[size], *rest)) for suffix, size in rule.checkpoint_parts]
            for spelling in {rule.megatron, rule.te_megatron or rule.megatron}:
                key = spelling.replace("local_experts.{e}.", "experts.").replace(".weight{e}", ".weight")
                key = key.replace(".{i}.", ".") if stacked else key.format(i=layer)
                for suffix, part_shape in parts:
                    out[key + suffix] = (part_shape, rule.hf)
    return out


def check_mcore_shapes(model_dir: str | os.PathLike, family, hf_config, tp: int, config_flag: str, *,
                       lora: bool = False) -> None:
    """Refuse an HF config whose tensor shapes differ from those of the Megatron checkpoint in ``model_dir``.

    Compares the shapes ``hf_config`` implies (:func:`expected_mcore_shapes`) with the global
    shapes in the checkpoint's metadata. The ``ValueError`` names ``config_flag``, the tensor,
    both shapes and the HF tensors it becomes. A training checkpoint's optimizer state is not compared, nor
    with ``lora`` its LoRA adapters.
    """
    import torch

    from megarl.convert.dist_checkpoint import OPTIMIZER_PREFIX, read_dist_metadata
    from megarl.models.lora import is_lora_parameter

    metadata = read_dist_metadata(model_dir)
    saved = {name: tuple(entry.size) for name, entry in metadata.state_dict_metadata.items()
             if isinstance(getattr(entry, "size", None), torch.Size) and not name.startswith(OPTIMIZER_PREFIX)
             and not (lora and is_lora_parameter(name))}  # a LoRA run's adapters (model.json)
    expected = expected_mcore_shapes(family, hf_config, tp)
    problems = []
    for name, shape in saved.items():
        if name not in expected:
            problems.append(f"the checkpoint holds tensor {name} {list(shape)}, which {config_flag} does not describe")
        elif expected[name][0] != shape:
            want, hf = expected[name]
            problems.append(f"tensor {name} has shape {list(shape)} in the checkpoint, {config_flag} implies "
                            f"{list(want)} (from {', '.join(hf)})")
    covered = {name for name in expected if name in saved}
    for name, (want, hf) in expected.items():
        twin = {n for n, (_, h) in expected.items() if h == hf}  # the other spelling of a fused norm
        if not twin & covered:
            problems.append(f"{config_flag} implies tensor {name} {list(want)} (from {', '.join(hf)}), which the "
                            "checkpoint does not hold")
            covered |= twin
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{config_flag} does not match the checkpoint {Path(model_dir).parent}: "
                         f"{'; '.join(problems[:3])}{more}. Pass the HF config the checkpoint was converted from")
