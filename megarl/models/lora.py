"""LoRA adapters on Megatron's linear layers, sharded the way the layer they adapt is.

An adapted layer ``y = W x`` computes ``y = W x + (alpha / rank) B A x`` with ``A`` ``[rank, in]`` and ``B``
``[out, rank]``; the base weight is frozen (no gradient buffer, no optimizer state) and only ``A`` and ``B`` train.
``B`` starts at zero, so a fresh adapter leaves the model as it was; ``A`` starts as PEFT's (Kaiming-uniform with
``a = sqrt(5)``), drawn whole from a seed and the layer's global name and sliced, so every layout starts alike.

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
Megatron's checkpoint sees them with their split axis. Megatron's local layer spec only for now: the TE spec fuses
the input norm into ``linear_qkv`` / ``linear_fc1``, whose output the adapter needs (refused, naming the setting).
Mixture-of-experts models are refused too (their experts are grouped linears).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
"""Column-parallel layers an adapter can target (Megatron's names)."""
ROW_TARGETS = ("linear_proj", "linear_fc2")
"""Row-parallel layers an adapter can target."""
TARGETS = COLUMN_TARGETS + ROW_TARGETS
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
"""HF (PEFT) module names and the Megatron layer each is part of."""
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which layers get adapters, of what rank, scaled by ``alpha / rank``."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    init_b: str = "zeros"
    """``zeros`` (PEFT's: a fresh adapter leaves the model as it was) or ``random`` (tests)."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_targets(target_modules: str | Sequence[str], *, setting: str = "actor_rollout_ref.model.target_modules"
                 ) -> tuple[str, ...]:
    """Megatron layer names from verl's ``target_modules``: ``all-linear``, Megatron's names (``linear_qkv``,
    ``linear_proj``, ``linear_fc1``, ``linear_fc2``) or PEFT's (``q_proj`` ... ``down_proj``). A fused layer is
    adapted whole, so PEFT names must name all of its parts (``q_proj``, ``k_proj`` and ``v_proj`` together)."""
    if isinstance(target_modules, str):
        if target_modules == ALL_LINEAR:
            return TARGETS
        target_modules = [target_modules]
    names = list(target_modules)
    if not names:
        raise ValueError(f"{setting} is empty: name the layers to adapt ({ALL_LINEAR!r}, {list(TARGETS)} or "
                         f"PEFT's {list(HF_TARGETS)})")
    unknown = [n for n in names if n not in TARGETS and n not in HF_TARGETS and n != ALL_LINEAR]
    if unknown:
        raise ValueError(f"{setting}: unknown module(s) {unknown}; use {ALL_LINEAR!r}, Megatron's {list(TARGETS)} "
                         f"or PEFT's {list(HF_TARGETS)}")
    if ALL_LINEAR in names:
        return TARGETS
    chosen = set()
    for name in names:
        layer = HF_TARGETS.get(name, name)
        if name in HF_TARGETS:
            parts = sorted(n for n, fused in HF_TARGETS.items() if fused == layer)
            missing = [p for p in parts if p not in names and layer not in names]
            if missing:
                raise ValueError(f"{setting}: {name!r} is part of Megatron's fused {layer!r} ({parts}), which is "
                                 f"adapted whole: add {missing} or name {layer!r}")
        chosen.add(layer)
    return tuple(t for t in TARGETS if t in chosen)


def _is_column(module: Any) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return isinstance(module, ColumnParallelLinear)


def _adapted_modules(chunk: Any, targets: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``(name, module)`` of the layers ``targets`` name in ``chunk`` (local names, DDP unwrapped)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    module = chunk.module if hasattr(chunk, "module") else chunk
    for name, sub in module.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last not in targets:
            continue
        if not isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(f"LoRA: {name} is a {type(sub).__name__}, not Megatron's local Column/RowParallelLinear; "
                             f"LoRA runs with the local layer spec for now (the TE spec fuses the input norm into "
                             f"linear_qkv / linear_fc1)")
        if (last in COLUMN_TARGETS) != isinstance(sub, ColumnParallelLinear):
            raise ValueError(f"LoRA: {name} is a {type(sub).__name__}; megarl expects {last} to be "
                             f"{'column' if last in COLUMN_TARGETS else 'row'}-parallel")
        yield name, sub


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
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from megarl.convert.layout import ModelSizes, fuse, hf_slices
    from megarl.models.build import layer_offset

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sizes = ModelSizes.from_config(family, hf_config, tp)
    index = {at.megatron_name: at for at in family.weight_instances(hf_config)}
    adapted = []
    for chunk in chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk
        if getattr(module.config, "num_moe_experts", None):
            raise ValueError("LoRA on mixture-of-experts models is not supported yet (their experts are grouped "
                             "linears): set actor_rollout_ref.model.lora_rank=0")
        module.requires_grad_(False)
        offset = layer_offset(module)
        for name, layer in _adapted_modules(module, spec.targets):
            global_name = _global_name(name, offset)
            at = index[f"{global_name}.weight"]
            column = _is_column(layer)
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
            layer.lora_A = torch.nn.Parameter(local_a.to(device=weight.device, dtype=weight.dtype).contiguous())
            layer.lora_B = torch.nn.Parameter(local_b.to(device=weight.device, dtype=weight.dtype).contiguous())
            sharded, dim = (layer.lora_B, 0) if column else (layer.lora_A, 1)
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)
            if column and layer.sequence_parallel:
                layer.lora_A.sequence_parallel = True  # partial gradients per rank: summed over TP (finalize)
            layer.lora_scale = spec.scale
            layer.lora_enabled = True
            layer.register_forward_hook(_column_hook if column else _row_hook)
            layer.sharded_state_dict = _sharded_state_dict(layer, column)
            adapted.append(global_name)
    return adapted


def _hf_out(rule: Any, sizes: Any, layer: Any, part: int, parts: int) -> int:
    """Output rows of HF module ``part`` of a layer's rule (q, k, v; gate, up; or the one module)."""
    from megarl.models.weights import Fuse

    if rule.fuse is Fuse.QKV:
        return (sizes.num_heads if part == 0 else sizes.num_groups) * sizes.head_dim
    return layer.output_size // parts


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


def lora_parameters(chunks: Sequence[Any]) -> dict[str, torch.nn.Parameter]:
    """This rank's adapter parameters by local name (``...linear_qkv.lora_A``), DDP unwrapped."""
    out = {}
    for i, chunk in enumerate(chunks):
        module = chunk.module if hasattr(chunk, "module") else chunk
        for name, param in module.named_parameters():
            if name.endswith((".lora_A", ".lora_B")):
                out[f"{i}:{name}" if len(chunks) > 1 else name] = param
    return out


def adapter_tensors(chunks: Sequence[Any], family: Any, hf_config: Any, *, grads: bool = False
                    ) -> dict[str, torch.Tensor]:
    """This rank's adapters (their gradients with ``grads``: ``main_grad``) as whole PEFT-named tensors
    (``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``), gathered over the TP group: every TP
    rank of a stage returns its stage's layers. The inverse of :func:`attach_lora`'s layout (fused parts
    unfused, split parts concatenated)."""
    from megatron.core import parallel_state

    from megarl.convert.layout import ModelSizes, hf_split_dim, unfuse
    from megarl.models.build import layer_offset

    tp = parallel_state.get_tensor_model_parallel_world_size()
    sizes = ModelSizes.from_config(family, hf_config, tp)
    index = {at.megatron_name: at for at in family.weight_instances(hf_config)}
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk
        offset = layer_offset(module)
        for name, layer in _adapted_modules(module, TARGETS):
            if not hasattr(layer, "lora_A"):
                continue
            at = index[f"{_global_name(name, offset)}.weight"]
            a, b = ((p.main_grad if grads else p).detach().float() for p in (layer.lora_A, layer.lora_B))
            prefixes = [f"base_model.model.{n.removesuffix('.weight')}" for n in at.hf_names]
            if _is_column(layer):
                shards = _all_gather(b, layer.tp_group, tp)
                parts = [unfuse(at.rule, shard, sizes, r, tp) for r, shard in enumerate(shards)]
                for j, prefix in enumerate(prefixes):
                    out[f"{prefix}.lora_A.weight"] = a.clone()
                    out[f"{prefix}.lora_B.weight"] = torch.cat([p[j] for p in parts], dim=0)
            else:
                (prefix,) = prefixes
                out[f"{prefix}.lora_A.weight"] = torch.cat(_all_gather(a, layer.tp_group, tp),
                                                           dim=hf_split_dim(at.rule) or 1)
                out[f"{prefix}.lora_B.weight"] = b.clone()
    return out


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    import torch.distributed as dist

    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


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
