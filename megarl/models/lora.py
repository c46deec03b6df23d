"""LoRA adapters on Megatron's linear layers, sharded the way the layer they adapt is.

An adapted layer ``y = W x`` computes ``y = W x + (alpha / rank) B A x`` with ``A`` ``[rank, in]`` and ``B``
``[out, rank]``; the base weight is frozen (no gradient buffer, no optimizer state) and only ``A`` and ``B`` train.
``B`` starts at zero, so a fresh adapter leaves the model as it was; ``A`` starts as PEFT's (Kaiming-uniform with
``a = sqrt(5)``), drawn whole from a seed and the layer's global name and laid out by the base weight's rule
(:mod:`megarl.convert.lora`), so every layout starts alike.

Layouts, per tensor-parallel rank (``tp`` ranks; SP: sequence parallelism):

- **column-parallel** layers (``linear_qkv``, ``linear_fc1``: input whole, output split): ``A`` whole, ``B`` split
  along its output rows exactly as the base weight (so ``B``'s rows keep Megatron's fused QKV / gate-up order).
  Without SP the rank-``r`` activation ``h = A x`` passes Megatron's copy-to-TP region (its gradient, a partial
  sum per rank, is all-reduced), so ``A``'s gradient and the input's are whole on every rank. With SP the input
  is gathered along the sequence first (the gradient reduce-scattered back, summing the ranks' partial input
  gradients) and ``A`` is marked ``sequence_parallel``: Megatron's finalize step sums its partial gradients
  over the TP group, as it does for the norms.
- **row-parallel** layers (``linear_proj``, ``linear_fc2``: input split, output all-reduced): ``A`` split along its
  input columns as the base weight, ``B`` whole. ``h = A x`` is all-reduced (Megatron's reduce-from-TP region);
  with SP the adapter's output is then scattered along the sequence like the base's reduce-scatter.

The adapters are parameters of the adapted module itself (``<layer>.lora_A``, ``<layer>.lora_B``), added to its
output by a forward hook, so every other parameter keeps its name (loading, export and checkpoints by name) and
Megatron's checkpoint sees them with their split axis; the weight export merges them in (:func:`merged_weight`).
The reference policy of a LoRA actor is the actor inside :func:`adapters_disabled`. A LoRA model is built with
Megatron's local layer spec, on GPU too: the TE spec fuses the input norm into ``linear_qkv`` / ``linear_fc1``,
whose output the adapter needs. Mixture-of-experts models are refused (their experts are grouped linears).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from megarl.config.lora import COLUMN_TARGETS, TARGETS, LoraSpec


def _is_column(module: Any) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return isinstance(module, ColumnParallelLinear)


def _adapted_modules(chunk: Any, targets: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``(name, module)`` of the layers ``targets`` name in ``chunk`` (local names, DDP unwrapped)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    module = chunk.module if hasattr(chunk, "module") else chunk
    for name, sub in module.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last not in targets or not name.startswith("decoder."):  # the language model's (not a vision tower's)
            continue
        if not isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(f"LoRA: {name} is a {type(sub).__name__}, not Megatron's local Column/RowParallelLinear; "
                             f"LoRA runs with the local layer spec for now (the TE spec fuses the input norm into "
                             f"linear_qkv / linear_fc1)")
        if (last in COLUMN_TARGETS) != isinstance(sub, ColumnParallelLinear):
            raise ValueError(f"LoRA: {name} is a {type(sub).__name__}; megarl expects {last} to be "
                             f"{'column' if last in COLUMN_TARGETS else 'row'}-parallel")
        yield name, sub


def adapted_layers(chunk: Any, targets: Sequence[str] = TARGETS) -> Iterator[tuple[str, Any, bool]]:
    """``(global name, layer, column-parallel?)`` of the layers ``targets`` name in one model chunk (DDP
    unwrapped); the global name is ``decoder.layers.<global i>.<path>``."""
    from megarl.models.build import layer_offset

    module = chunk.module if hasattr(chunk, "module") else chunk
    offset = layer_offset(module)
    for name, layer in _adapted_modules(module, targets):
        yield _global_name(name, offset), layer, _is_column(layer)


def add_adapter(layer: Any, column: bool, a: torch.Tensor, b: torch.Tensor, spec: LoraSpec) -> None:
    """Give ``layer`` this rank's adapter factors ``a`` / ``b`` (already laid out for the rank) as parameters
    ``lora_A`` / ``lora_B``, Megatron's TP attributes on the split one, the forward hook and the checkpoint
    entries."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = layer.weight
    layer.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    layer.lora_B = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype).contiguous())
    sharded, dim = (layer.lora_B, 0) if column else (layer.lora_A, 1)
    set_tensor_model_parallel_attributes(sharded, True, dim, 1)
    if column and layer.sequence_parallel:
        layer.lora_A.sequence_parallel = True  # partial gradients per rank: summed over TP (finalize)
    layer.lora_scale = spec.scale
    layer.lora_enabled = True
    layer.register_forward_hook(_column_hook if column else _row_hook)
    layer.sharded_state_dict = _sharded_state_dict(layer, column)


def freeze_for_lora(chunk: Any) -> None:
    """Freeze every parameter of a model chunk (adapters added afterwards train); refuses a mixture-of-experts
    model."""
    module = chunk.module if hasattr(chunk, "module") else chunk
    if getattr(module.config, "num_moe_experts", None):
        raise ValueError("LoRA on mixture-of-experts models is not supported yet (their experts are grouped "
                         "linears): set actor_rollout_ref.model.lora_rank=0")
    module.requires_grad_(False)


def _global_name(name: str, offset: int) -> str:
    """``decoder.layers.<local i>.rest`` -> ``decoder.layers.<global i>.rest``."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _column_hook(layer: Any, args: tuple, output: Any) -> Any:
    if not layer.lora_enabled:
        return output
    from megatron.core.tensor_parallel import mappings

    out, bias = output
    x = args[0]
    if layer.sequence_parallel:
        x = mappings.gather_from_sequence_parallel_region(x, group=layer.tp_group)
        h = torch.nn.functional.linear(x, layer.lora_A)
    else:
        h = mappings.copy_to_tensor_model_parallel_region(torch.nn.functional.linear(x, layer.lora_A),
                                                          group=layer.tp_group)
    return out + torch.nn.functional.linear(h, layer.lora_B) * layer.lora_scale, bias


def _row_hook(layer: Any, args: tuple, output: Any) -> Any:
    if not layer.lora_enabled:
        return output
    from megatron.core.tensor_parallel import mappings

    out, bias = output
    h = mappings.reduce_from_tensor_model_parallel_region(torch.nn.functional.linear(args[0], layer.lora_A),
                                                          group=layer.tp_group)
    y = torch.nn.functional.linear(h, layer.lora_B) * layer.lora_scale
    if layer.sequence_parallel:
        y = mappings.scatter_to_sequence_parallel_region(y, group=layer.tp_group)
    return out + y, bias


def _sharded_state_dict(layer: Any, column: bool):
    """The layer's checkpoint entries with the adapter's split axis (``lora_B`` rows of a column-parallel layer,
    ``lora_A`` columns of a row-parallel one), as Megatron's own method does for the weight."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        state_dict = layer.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, axes, sharded_offsets, tp_group=layer.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    return sharded_state_dict


def adapted_weights(chunks: Sequence[Any]) -> dict[str, Any]:
    """This rank's LoRA-adapted layers by their weight's global Megatron name (``decoder.layers.<i>....weight``, as
    :func:`megarl.convert.param_map.local_parameters` names it)."""
    return {f"{name}.weight": layer for chunk in chunks for name, layer, _ in adapted_layers(chunk)
            if hasattr(layer, "lora_A")}


@torch.no_grad()
def merged_weight(layer: Any) -> torch.Tensor:
    """An adapted layer's weight shard with its adapter merged in: ``W + alpha / rank · B A`` (in fp32, then the
    weight's dtype); ``W`` itself while the adapters are off. ``B A`` of a rank's factors is exactly the rank's
    shard of the full update (column-parallel: its rows; row-parallel: its columns)."""
    weight = layer.weight.detach()
    if not layer.lora_enabled:
        return weight
    delta = layer.lora_B.detach().float() @ layer.lora_A.detach().float()
    return (weight.float() + delta * layer.lora_scale).to(weight.dtype)


def is_lora_parameter(name: str) -> bool:
    """Whether a parameter name is an adapter factor's."""
    return name.endswith((".lora_A", ".lora_B"))


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[Any]) -> Iterator[None]:
    """The base model inside the block: every adapter of ``chunks`` off (the reference policy of a LoRA run)."""
    layers = [sub for chunk in chunks for sub in (chunk.module if hasattr(chunk, "module") else chunk).modules()
              if hasattr(sub, "lora_enabled")]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True
