"""HF safetensors -> this rank's Megatron parameters, reading only this rank's slices."""

from __future__ import annotations

import functools
import logging
import os

import torch

from megarl.convert.hf_io import HFCheckpoint
from megarl.convert.layout import ModelSizes, Slice, fuse, hf_slices
from megarl.convert.param_map import local_parameters
from megarl.models.weights import RuleAt

logger = logging.getLogger(__name__)


@torch.no_grad()
def load_hf_into(model_chunks, hf_dir: str | os.PathLike, family, groups, *, hf_config=None, progress=False,
                 score_head: bool = False) -> int:
    """Copy the HF checkpoint in ``hf_dir`` into this rank's Megatron chunks; return bytes read.

    Each rank reads only the slices its parameters hold (memory-mapped safetensors reads):
    its pipeline stage's layers and its tensor-parallel slice, fused as Megatron stores them.
    Every local parameter must be covered by the family's rules, and every value read must
    be finite; anything else is an error naming the parameter or tensor. ``progress`` shows a
    progress bar over this rank's parameters. A critic's value head
    (:class:`~megarl.models.value_head.ValueHead`) is not in the HF checkpoint: it keeps its
    initialisation (the LM head, or the tied embedding, is never copied into it), unless ``score_head``: a reward
    model's HF sequence-classification checkpoint (``*ForSequenceClassification``, one label) holds its head as
    ``score.weight`` ``[1, H]`` (and no bias), which the value head then takes (bias 0).
    """
    from tqdm import tqdm

    from megarl.models.value_head import value_head_parameter_names

    if hf_config is None:
        from megarl.models.hf_config import load_hf_config

        hf_config = load_hf_config(hf_dir)
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
        parts = [where.read(functools.partial(checkpoint.read, n))
                 for n, where in zip(hf_names, hf_slices(rule, shapes, sizes, rank, size))]
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
    skipped = family.skipped_tensors(hf_config, checkpoint.names())
    if skipped and groups.rank == 0:
        logger.info("%s: %s", hf_dir, skipped_summary(skipped))
    if score_head:
        bytes_read += _load_score_head(model_chunks, checkpoint, hf_dir)
    return bytes_read


SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"
"""A sequence-classification checkpoint's head (transformers' ``*ForSequenceClassification.score``)."""


def _load_score_head(model_chunks, checkpoint: HFCheckpoint, hf_dir) -> int:
    """Copy ``score.weight`` (and ``score.bias`` when there is one) into the last stage's value head."""
    from megarl.models.value_head import ValueHead

    heads = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, ValueHead)]
    if not heads:
        return 0  # not the last pipeline stage
    (head,) = heads
    names = set(checkpoint.names())
    if SCORE_WEIGHT not in names:
        raise ValueError(f"{hf_dir} has no {SCORE_WEIGHT}: a reward model is an HF sequence-classification "
                         f"checkpoint (e.g. Qwen2ForSequenceClassification with num_labels=1)")
    shape = tuple(checkpoint.shape(SCORE_WEIGHT))
    if shape != tuple(head.weight.shape):
        raise ValueError(f"{SCORE_WEIGHT} in {hf_dir} is {list(shape)}; a reward model scores with one label: "
                         f"{list(head.weight.shape)} (config.json's num_labels=1)")
    weight = checkpoint.read(SCORE_WEIGHT, Slice(None))
    head.weight.copy_(weight)
    bias = checkpoint.read(SCORE_BIAS, Slice(None)) if SCORE_BIAS in names else None
    head.bias.copy_(bias if bias is not None else torch.zeros_like(head.bias))
    return weight.numel() * weight.element_size()


def skipped_summary(skipped) -> str:
    """The tensors a family skips on load (its multi-token-prediction layers), by layer, for the user."""
    layers = sorted({".".join(name.split(".")[:3]) for name in skipped})
    return (f"skipped {len(skipped)} tensors of {', '.join(layers)} (multi-token prediction: not part of the model RL "
            "trains; megarl-convert keeps them beside the checkpoint and writes them back)")
