"""ParallelDims factors the world size and names the setting to change when it cannot."""

import pytest
import torch

from megarl.parallel import ParallelDims


def test_dp_is_derived_from_world_size():
    dims = ParallelDims(tp=2, pp=2).for_world(8)
    assert (dims.tp, dims.pp, dims.cp, dims.dp, dims.world_size) == (2, 2, 1, 2, 8)
    assert dims.model_parallel_size == 4
    assert ParallelDims(tp=1, pp=2, vpp=3).num_virtual_stages == 3


def test_layout_not_dividing_world_names_the_settings():
    with pytest.raises(ValueError, match=r"parallel.tp × parallel.pp × parallel.cp = 2 × 3 × 1 = 6 does not divide the world size 8"):
        ParallelDims(tp=2, pp=3).for_world(8)
    with pytest.raises(ValueError, match=r"parallel.tp × parallel.pp × parallel.cp = 2 × 1 × 3 = 6"):
        ParallelDims(tp=2, cp=3).for_world(4)


def test_explicit_dp_must_agree():
    with pytest.raises(ValueError, match=r"parallel.dp=4 but .* leaves dp=2: set parallel.dp=2"):
        ParallelDims(tp=2, dp=4).for_world(4)
    assert ParallelDims(tp=2, dp=2).for_world(4).dp == 2


@pytest.mark.parametrize(
    "kwargs, setting",
    [(dict(tp=0), "parallel.tp"), (dict(pp=-1), "parallel.pp"), (dict(cp=0), "parallel.cp"), (dict(dp=0), "parallel.dp"),
     (dict(vpp=0, pp=2), "parallel.vpp"), (dict(vpp=2), r"parallel.vpp=2 needs pipeline parallelism"),
     (dict(cp=2, cp_comm_type="a2a+p2p"), r"parallel.cp_comm_type='a2a\+p2p': choose one of p2p, all_gather, a2a")],
)
def test_bad_degrees(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        ParallelDims(**kwargs)


def test_world_size_needs_dp():
    with pytest.raises(ValueError, match="for_world"):
        ParallelDims(tp=2).world_size


def test_heads_not_divisible_by_tp():
    with pytest.raises(ValueError, match=r"parallel.tp=4 does not divide the model's 6 attention heads"):
        ParallelDims(tp=4).check_model(num_layers=4, num_attention_heads=6, num_query_groups=2)


def test_kv_heads_not_divisible_by_tp():
    with pytest.raises(ValueError, match=r"parallel.tp=4 does not divide the model's 2 key/value heads"):
        ParallelDims(tp=4).check_model(num_layers=4, num_attention_heads=8, num_query_groups=2)


def test_more_pipeline_chunks_than_layers():
    with pytest.raises(ValueError, match=r"parallel.pp × parallel.vpp = 8 pipeline chunks exceed the model's 4 layers"):
        ParallelDims(pp=8).check_model(num_layers=4, num_attention_heads=4, num_query_groups=4)
    with pytest.raises(ValueError, match=r"parallel.pp × parallel.vpp = 6 pipeline chunks exceed"):
        ParallelDims(pp=2, vpp=3).check_model(num_layers=4, num_attention_heads=4, num_query_groups=4)


def test_uneven_layer_split():
    with pytest.raises(ValueError, match=r"6 layers do not split evenly into parallel.pp × parallel.vpp = 4"):
        ParallelDims(pp=4).check_model(num_layers=6, num_attention_heads=4, num_query_groups=4)
    ParallelDims(pp=2, vpp=2).check_model(num_layers=8, num_attention_heads=4, num_query_groups=4)


UNEVEN = [  # (num_layers, pp, vpp, first, last)
    (61, 8, None, 5, None), (61, 8, None, None, 5), (61, 4, None, 13, 12), (61, 2, None, 31, None),
    (61, 16, None, 1, None), (92, 8, None, 8, 12), (10, 3, 2, 2, 4), (14, 4, 2, None, 2), (9, 2, 3, 3, None),
    (13, 4, None, 4, 3), (8, 2, 2, 4, None), (16, 4, 2, 2, 2), (5, 2, None, 2, None),
]


@pytest.mark.parametrize("num_layers, pp, vpp, first, last", UNEVEN)
def test_uneven_pipeline_stages_hold_the_layers_megatron_gives_them(num_layers, pp, vpp, first, last):
    """``parallel.first_stage_layers`` / ``last_stage_layers`` (DeepSeek-V3's 61 layers): each chunk's layers are
    those Megatron builds there (``get_transformer_layer_offset`` on a TransformerConfig with
    ``num_layers_in_first/last_pipeline_stage``), every layer exactly once; the config carries them to Megatron."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dims = ParallelDims(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    dims.check_model(num_layers=num_layers, num_attention_heads=4, num_query_groups=4)
    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                               pipeline_dtype=torch.float32)
    held = []
    for rank in range(pp):
        for v in range(dims.num_virtual_stages):
            chunk = dims.chunk_layers(num_layers, rank, v)
            assert chunk.start == get_transformer_layer_offset(config, vp_stage=v if vpp else None, pp_rank=rank)
            held += list(chunk)
        assert len(dims.stage_layers(num_layers, rank)) == dims.stage_layer_counts(num_layers)[rank]
    assert sorted(held) == list(range(num_layers))
    counts = dims.stage_layer_counts(num_layers)
    assert (first is None or counts[0] == first) and (last is None or counts[-1] == last)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp=8, first_stage_layers=4), r"parallel.first_stage_layers = 4 leave 57 layers, which do not split evenly "
                                       r"over the other 7 pipeline stage\(s\)"),
    (dict(pp=2, first_stage_layers=30, last_stage_layers=30), r"leave 1 of the model's 61 layers for the other 0"),
    (dict(pp=4, vpp=2, first_stage_layers=12, last_stage_layers=11), r"leave 38 layers, which do not split evenly "
                                                                     r"over the other 2 .* × parallel.vpp=2"),
    (dict(pp=4, vpp=2, first_stage_layers=3, last_stage_layers=6), r"parallel.first_stage_layers=3 does not split "
                                                                   r"evenly into parallel.vpp=2"),
    (dict(pp=8), r"61 layers do not split evenly .*\(parallel.first_stage_layers / parallel.last_stage_layers\)"),
])
def test_uneven_pipeline_stages_that_cannot_hold_the_layers_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs).check_model(num_layers=61, num_attention_heads=4, num_query_groups=4)


def test_stage_sizes_need_a_pipeline():
    with pytest.raises(ValueError, match=r"parallel.first_stage_layers=3 sizes a pipeline stage: it needs parallel.pp"):
        ParallelDims(first_stage_layers=3)
    with pytest.raises(ValueError, match=r"parallel.last_stage_layers must be a positive integer or null, got 0"):
        ParallelDims(pp=2, last_stage_layers=0)


def test_cp_comm_type_reaches_megatron_only_under_cp():
    from transformers import Qwen2Config

    from megarl.models import family_for

    hf = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    family = family_for(hf)
    assert family.transformer_config(hf, ParallelDims(cp=2, cp_comm_type="a2a")).cp_comm_type == "a2a"
    assert family.transformer_config(hf, ParallelDims(cp=1, cp_comm_type="a2a")).cp_comm_type is None


def test_expert_parallelism_regroups_a_stage():
    dims = ParallelDims(tp=2, ep=2).for_world(8)  # dp 4: a stage's 8 ranks = etp 2 × ep 2 × expert-dp 2
    assert (dims.expert_tp, dims.expert_dp) == (2, 2)
    assert ParallelDims(tp=2, ep=4, etp=1).for_world(4).expert_dp == 1
    with pytest.raises(ValueError, match=r"parallel.etp × parallel.ep = 2 × 4 does not divide the 4 ranks of a "
                                         r"pipeline stage \(tp × cp × dp = 2 × 1 × 2\)"):
        ParallelDims(tp=2, ep=4).for_world(4)
    with pytest.raises(ValueError, match="parallel.ep must be a positive integer"):
        ParallelDims(ep=0)
    with pytest.raises(ValueError, match="parallel.etp must be a positive integer or null"):
        ParallelDims(etp=0)


@pytest.mark.parametrize("dims, experts, message", [
    (ParallelDims(ep=2), None, "parallel.ep=2 / parallel.etp=None split experts, and the model has none"),
    (ParallelDims(ep=3), 8, "parallel.ep=3 does not divide the model's 8 experts"),
    (ParallelDims(tp=2, etp=1, sequence_parallel=True), 8, None),
    (ParallelDims(tp=2, sequence_parallel=True), 8, "parallel.etp=2 does not divide the experts' FFN size 9"),
    (ParallelDims(tp=2, etp=1), 8, "parallel.tp=2 on a mixture-of-experts model needs parallel.sequence_parallel=true"),
])
def test_expert_layout_is_checked_against_the_model(dims, experts, message):
    def check():
        dims.check_model(num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=experts, expert_ffn=9)

    if message is None:
        check()
    else:
        with pytest.raises(ValueError, match=message):
            check()
