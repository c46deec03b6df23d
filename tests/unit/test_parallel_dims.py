"""ParallelDims factors the world size and names the setting to change when it cannot."""

import pytest

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
