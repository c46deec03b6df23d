"""LoRA adapters laid out by the weight rules: fresh adapters made in PEFT's layout and placed on each rank as its base
weight is (``B``'s rows of a column-parallel layer, ``A``'s columns of a row-parallel one: fused and split alike),
and read back whole in PEFT's layout (``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``, ``A``
shared by the HF modules a layer fuses). :mod:`megarl.models.lora` holds the adapted layers themselves."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from megarl.config.lora import LoraSpec
from megarl.convert.layout import ModelSizes, fuse, hf_slices, unfuse
from megarl.models.lora import adapted_layers, add_adapter, freeze_for_lora
from megarl.models.weights import Fuse


def _draw(key: str, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    """Uniform in ``[-bound, bound]``, drawn from a generator seeded by ``key`` alone (the same on every rank and
    layout)."""
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(digest)
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def initial_factors(global_name: str, hf_names: Sequence[str], hf_shapes: Sequence[tuple[int, ...]], spec: LoraSpec,
                    seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A fresh adapter of one Megatron layer in PEFT's layout: ``A`` ``[rank, in]`` (shared by the HF modules the
    layer fuses) and one ``B`` ``[out_m, rank]`` per HF module ``m``. ``A`` is PEFT's Kaiming-uniform
    (``a = sqrt(5)``: bound ``1 / sqrt(in)``); ``B`` is zero, or with ``spec.init_b == "random"`` uniform with
    bound ``1 / sqrt(rank)`` (tests: an adapter that changes the model)."""
    in_features = hf_shapes[0][1]
    a = _draw(f"{seed}:{global_name}:A", (spec.rank, in_features), 1.0 / math.sqrt(in_features))
    if spec.init_b == "random":
        bs = [_draw(f"{seed}:{name}:B", (shape[0], spec.rank), 1.0 / math.sqrt(spec.rank))
              for name, shape in zip(hf_names, hf_shapes, strict=True)]
    else:
        bs = [torch.zeros(shape[0], spec.rank) for shape in hf_shapes]
    return a, bs


def attach_lora(chunks: Sequence[Any], spec: LoraSpec, family: Any, hf_config: Any, *, seed: int = 0) -> list[str]:
    """Add adapters to the targeted layers of this rank's ``chunks`` (before Megatron's DDP wraps them) and freeze
    everything else; returns the adapted layers' global names (``decoder.layers.<i>.<path>``). Each adapter is made
    in PEFT's layout (:func:`initial_factors`) and laid out on this rank by the base weight's rule, so ``B``'s rows
    (column-parallel) and ``A``'s columns (row-parallel) are the base weight's, fused and split alike."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sizes = ModelSizes.from_config(family, hf_config, tp)
    index = {at.megatron_name: at for at in family.weight_instances(hf_config)}
    adapted = []
    for chunk in chunks:
        freeze_for_lora(chunk)
        for global_name, layer, column in adapted_layers(chunk, spec.targets):
            at = index[f"{global_name}.weight"]
            if at.rule.rows or at.rule.fuse not in (Fuse.NONE, Fuse.QKV, Fuse.GATE_UP):
                raise ValueError(f"actor_rollout_ref.model.target_modules: LoRA on {global_name} (the {family.name} "
                                 f"family's {', '.join(at.hf_names)}) is not mapped: its rows are pieces laid out "
                                 "otherwise than PEFT's; leave it out of target_modules (e.g. the MLPs': "
                                 "[gate_proj, up_proj, down_proj])")
            out_sizes = [_hf_out(at.rule, sizes, layer, part, len(at.hf_names)) for part in range(len(at.hf_names))]
            hf_shapes = [(rows, layer.input_size) for rows in out_sizes]
            a, bs = initial_factors(global_name, at.hf_names, hf_shapes, spec, seed)
            if column:
                slices = hf_slices(at.rule, [tuple(b.shape) for b in bs], sizes, tp_rank, tp)
                local_a, local_b = a, fuse(at.rule, [s.apply(b) for s, b in zip(slices, bs)], sizes, tp)
            else:
                (piece,) = hf_slices(at.rule, [tuple(a.shape)], sizes, tp_rank, tp)
                local_a, (local_b,) = piece.apply(a), bs
            weight = layer.weight
            if (local_b.shape[0], local_a.shape[1]) != (weight.shape[0], weight.shape[1]):
                raise ValueError(f"LoRA: {global_name}: the adapter's [{local_b.shape[0]}, {local_a.shape[1]}] does "
                                 f"not match the weight's {list(weight.shape)}")
            add_adapter(layer, column, local_a, local_b, spec)
            adapted.append(global_name)
    return adapted


def _hf_out(rule: Any, sizes: Any, layer: Any, part: int, parts: int) -> int:
    """Output rows of HF module ``part`` of a layer's rule (q, k, v; gate, up; or the one module)."""
    from megarl.models.weights import Fuse

    if rule.fuse is Fuse.QKV:
        return (sizes.num_heads if part == 0 else sizes.num_groups) * sizes.head_dim
    return layer.output_size // parts


def adapter_tensors(chunks: Sequence[Any], family: Any, hf_config: Any, *, grads: bool = False
                    ) -> dict[str, torch.Tensor]:
    """This rank's adapters (their gradients with ``grads``: ``main_grad``) as whole PEFT-named tensors
    (``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``), gathered over the TP group: every TP
    rank of a stage returns its stage's layers. The inverse of :func:`attach_lora`'s layout (fused parts
    unfused, split parts concatenated)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    sizes = ModelSizes.from_config(family, hf_config, tp)
    index = {at.megatron_name: at for at in family.weight_instances(hf_config)}
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for global_name, layer, column in adapted_layers(chunk):
            if not hasattr(layer, "lora_A"):
                continue
            at = index[f"{global_name}.weight"]
            a, b = ((p.main_grad if grads else p).detach().float() for p in (layer.lora_A, layer.lora_B))
            prefixes = [f"base_model.model.{n.removesuffix('.weight')}" for n in at.hf_names]
            if column:
                shards = _all_gather(b, layer.tp_group, tp)
                parts = [unfuse(at.rule, shard, sizes, r, tp) for r, shard in enumerate(shards)]
                for j, prefix in enumerate(prefixes):
                    out[f"{prefix}.lora_A.weight"] = a.clone()
                    out[f"{prefix}.lora_B.weight"] = torch.cat([p[j] for p in parts], dim=0)
            else:
                (prefix,) = prefixes
                out[f"{prefix}.lora_A.weight"] = torch.cat(_all_gather(a, layer.tp_group, tp), dim=1)
                out[f"{prefix}.lora_B.weight"] = b.clone()
    return out


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    import torch.distributed as dist

    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards
