"""Build Megatron ``GPTModel`` chunks for this rank's pipeline stage(s)."""

from __future__ import annotations

from megarl.models.family import ModelFamily
from megarl.parallel.dims import ParallelDims


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
):
    """One ``GPTModel`` chunk: the embedding if ``pre_process``, the output layer if ``post_process``.

    ``config`` defaults to ``family.transformer_config(hf_config, dims)``; the layers built
    (and their global offset) follow Megatron's split for this rank's pipeline stage and
    ``vp_stage``.
    """
    from megatron.core.models.gpt import GPTModel

    config = config or family.transformer_config(hf_config, dims)
    return GPTModel(
        config=config,
        transformer_layer_spec=family.layer_spec(use_te=use_te),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **family.gpt_model_kwargs(hf_config, dims),
    )


def build_model_chunks(family: ModelFamily, hf_config, dims: ParallelDims, *, config=None, use_te=None) -> list:
    """This rank's model chunks (one per virtual pipeline stage), after ``init_parallel(dims)``."""
    from megatron.core import parallel_state

    config = config or family.transformer_config(hf_config, dims)
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
            )
        )
    return chunks


def layer_offset(model_chunk) -> int:
    """Global index of the first transformer layer held by ``model_chunk``."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model_chunk.config, vp_stage=model_chunk.vp_stage)
