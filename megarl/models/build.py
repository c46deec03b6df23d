"""Build Megatron ``GPTModel`` chunks for this rank's pipeline stage(s)."""

from __future__ import annotations

import functools

from megarl.config.parallel import ParallelDims
from megarl.models.family import ModelFamily


def build_gpt_model(
    family: ModelFamily,
    hf_config,
    dims: ParallelDims,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    config=None,
    use_te: bool | None = None,
    value_head: bool = False,
    value_head_seed: int = 0,
):
    """One ``GPTModel`` chunk: the embedding (and a vision-language family's vision tower:
    :class:`megarl.models.vision.VisionGPTModel`) if ``pre_process``, the output layer if ``post_process``.

    ``config`` defaults to ``family.transformer_config(hf_config, dims)``; the layers built
    (and their global offset) follow Megatron's split for this rank's pipeline stage and
    ``vp_stage``. With ``value_head`` (a critic) the output layer is a
    :class:`~megarl.models.value_head.ValueHead` seeded with ``value_head_seed``, and the
    embedding is never tied to it, whatever the HF config says.
    """
    from megatron.core.models.gpt import GPTModel

    from megarl.models.value_head import attach_value_head

    config = config or family.transformer_config(hf_config, dims, use_te=use_te)
    kwargs = family.gpt_model_kwargs(hf_config, dims)
    if value_head:
        kwargs["share_embeddings_and_output_weights"] = False
    if family.vision is not None:
        from megarl.models.vision import build_vision_gpt_model

        make = functools.partial(build_vision_gpt_model, family, hf_config)
    else:
        make = GPTModel
    model = make(
        config=config,
        transformer_layer_spec=family.block_spec(config, vp_stage=vp_stage, use_te=use_te),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **kwargs,
    )
    if value_head and post_process:
        attach_value_head(model, seed=value_head_seed)
    if family.moe is not None and family.moe.expert_bias:
        from megarl.models.moe import prepare_expert_bias

        prepare_expert_bias(model)
    return model


def build_model_chunks(family: ModelFamily, hf_config, dims: ParallelDims, *, config=None, use_te=None,
                       value_head: bool = False, value_head_seed: int = 0) -> list:
    """This rank's model chunks (one per virtual pipeline stage), after ``init_parallel(dims)``.

    ``value_head``: build a critic (see :func:`build_gpt_model`).
    """
    from megatron.core import parallel_state

    config = config or family.transformer_config(hf_config, dims, use_te=use_te)
    num_chunks = dims.num_virtual_stages
    chunks = []
    for i in range(num_chunks):
        vp_stage = i if num_chunks > 1 else None
        chunks.append(
            build_gpt_model(
                family,
                hf_config,
                dims,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                config=config,
                use_te=use_te,
                value_head=value_head,
                value_head_seed=value_head_seed,
            )
        )
    return chunks


def layer_offset(model_chunk) -> int:
    """Global index of the first transformer layer held by ``model_chunk``."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model_chunk.config, vp_stage=model_chunk.vp_stage)
