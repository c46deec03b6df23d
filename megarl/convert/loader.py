"""HF safetensors -> this rank's Megatron parameters, reading only this rank's slices."""

from __future__ import annotations

import os

import torch

from megarl.convert.hf_io import HFCheckpoint
from megarl.convert.layout import ModelSizes, fuse, hf_slices
from megarl.convert.param_map import local_parameters
from megarl.models.weights import RuleAt


@torch.no_grad()
def load_hf_into(model_chunks, hf_dir: str | os.PathLike, family, groups, *, hf_config=None, progress=False) -> int:
    """Copy the HF checkpoint in ``hf_dir`` into this rank's Megatron chunks; return bytes read.

    Each rank reads only the slices its parameters hold (memory-mapped safetensors reads):
    its pipeline stage's layers and its tensor-parallel slice, fused as Megatron stores them.
    Every local parameter must be covered by the family's rules, and every value read must
    be finite; anything else is an error naming the parameter or tensor. ``progress`` shows a
    progress bar over this rank's parameters. A critic's value head
    (:class:`~megarl.models.value_head.ValueHead`) is not in the HF checkpoint: it keeps its
    initialisation (the LM head, or the tied embedding, is never copied into it).
    """
    from tqdm import tqdm

    from megarl.models.value_head import value_head_parameter_names

    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(hf_dir)
    checkpoint = HFCheckpoint(hf_dir)
    dims = groups.dims
    sizes = ModelSizes.from_config(family, hf_config, dims.tp)
    rules = family.weight_rules(hf_config)
    index: dict[str, RuleAt] = {at.megatron_name: at for at in family.weight_instances(hf_config)}
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    embedding = index["embedding.word_embeddings.weight"]
    bytes_read = 0
    params = local_parameters(model_chunks, rules)
    for name in value_head_parameter_names(model_chunks):
        del params[name]
    for name, param in tqdm(params.items(), desc="load", unit="tensor", disable=not progress):
        if name in index:
            at = index[name]
        elif tied and name == "output_layer.weight":
            at = embedding  # the last stage's copy of the tied embedding
        else:
            raise ValueError(f"Megatron parameter {name} has no rule in the {family.name} family's weight map")
        rule, hf_names = at.rule, at.hf_names
        shapes = [checkpoint.shape(n) for n in hf_names]
        # Experts split over expert-tensor parallelism, everything else over tensor parallelism.
        rank, size = (groups.etp_rank, dims.expert_tp) if rule.per_expert else (groups.tp_rank, dims.tp)
        parts = [checkpoint.read(n, where) for n, where in zip(hf_names, hf_slices(rule, shapes, sizes, rank, size))]
        bytes_read += sum(p.numel() * p.element_size() for p in parts)
        for hf_name, part in zip(hf_names, parts):
            if not torch.isfinite(part).all():
                raise ValueError(f"tensor {hf_name} in {hf_dir} holds NaN or infinite values")
        shard = fuse(rule, parts, sizes, size)
        if shard.shape != param.shape:
            raise ValueError(
                f"{', '.join(hf_names)} make a {list(shard.shape)} shard for Megatron parameter {name}, "
                f"which is {list(param.shape)} at tp={dims.tp}, etp={dims.expert_tp}: the checkpoint does not match "
                f"its config.json"
            )
        param.copy_(shard)
    return bytes_read
