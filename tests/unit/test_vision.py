"""Vision-language families: megarl's view of a Qwen2.5-VL config, the vision tower's weight rules and
sizes, multimodal positions, and what is refused."""

from __future__ import annotations

import pytest
import torch

from megarl.models import family_for
from megarl.models.tiny import build_tiny_vl_tokenizer, tiny_qwen2_5_vl_config
from megarl.models.vision import is_multimodal, model_config, raw_config
from megarl.parallel import ParallelDims


@pytest.fixture(scope="module")
def raw():
    return tiny_qwen2_5_vl_config(build_tiny_vl_tokenizer())


@pytest.fixture(scope="module")
def view(raw):
    return model_config(raw)


def test_the_view_is_the_text_config_with_the_checkpoints_vision_settings(raw, view):
    assert is_multimodal(view) and not is_multimodal(raw)
    assert view.hidden_size == raw.text_config.hidden_size and view.vocab_size == raw.text_config.vocab_size
    assert view.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    assert view.tie_word_embeddings is True and view.image_token_id == raw.image_token_id
    assert raw_config(view) is raw and model_config(view) is view
    assert family_for(view).name == "qwen2_5_vl" and family_for(raw).name == "qwen2_5_vl"


def test_the_tower_is_replicated_on_the_first_stage_and_counted_like_transformers(view):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megarl.convert.hf_io import expected_shapes
    from megarl.models.sizes import Architecture

    family = family_for(view)
    rules = family.weight_rules(view)
    tower = [r for r in rules if r.megatron.startswith("vision_model.")]
    assert tower and all(r.first_stage and r.on_first_stage and r.split.value == "replicated" for r in tower)
    assert all(r.hf[0] == "visual." + r.megatron.removeprefix("vision_model.") for r in tower)
    instances = family.weight_instances(view)
    assert [at.rule for at in instances[:len(tower) + 1]] == [*tower, rules[len(tower)]]  # then the embedding
    shapes = expected_shapes(view)
    assert {n for at in instances for n in at.hf_names} == set(shapes) - {"lm_head.weight"}  # tied
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(raw_config(view))
    arch = Architecture.from_hf(view, name="tiny-vl", source="test")
    assert arch.num_params == sum(p.numel() for p in hf.parameters())
    tower_params = sum(p.numel() for p in hf.model.visual.parameters())
    stage0, stage1 = (arch.rank_params(tp=1, pipeline=ParallelDims(pp=2), pp_rank=r) for r in (0, 1))
    # Tied embeddings: both stages hold the vocabulary once; the last one the final norm too.
    assert stage0 - stage1 == tower_params - view.hidden_size


def test_mrope_sections_and_refusals(view):
    family = family_for(view)
    config = family.transformer_config(view, ParallelDims(tp=1))
    assert config.mrope_section == [2, 3, 3]
    assert family.gpt_model_kwargs(view, ParallelDims(tp=1))["position_embedding_type"] == "mrope"
    with pytest.raises(ValueError, match="parallel.cp=2.*context parallelism"):
        family.transformer_config(view, ParallelDims(cp=2))
    broken = model_config(tiny_qwen2_5_vl_config(build_tiny_vl_tokenizer()))
    broken.rope_parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 2, 2]}
    with pytest.raises(ValueError, match=r"mrope_section=\[2, 2, 2\] covers 12 of the head dimension 16"):
        family.transformer_config(broken, ParallelDims(tp=1))


def test_positions_number_text_then_each_image_on_its_grid(view):
    spec = family_for(view).vision
    start, end, pad = view.vision_start_token_id, view.vision_end_token_id, view.image_token_id
    ids = torch.tensor([5, 6, start] + [pad] * 6 + [end, 7])  # one image of 2 × 3 merged patches (grid 1, 4, 6)
    positions = spec.position_ids(view, ids, torch.tensor([[1, 4, 6]]))
    assert positions[:3].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert positions[3:9].tolist() == [[3, 3 + h, 3 + w] for h in range(2) for w in range(3)]
    assert positions[9:].tolist() == [[6, 6, 6], [7, 7, 7]]  # after the image: its start + max(h, w)
    with pytest.raises(ValueError, match=r"the 2 placeholder tokens at position 7 do not hold image 1 \(grid \[1, 4, 4\]"):
        spec.position_ids(view, ids, torch.tensor([[1, 4, 4], [1, 4, 4]]))
    with pytest.raises(ValueError, match="the 2 placeholder tokens .* at position 7 are left over after the row's 1"):
        spec.position_ids(view, ids, torch.tensor([[1, 4, 4]]))
    # A placeholder after the row's images (one the model generated) is text, as the engines read it.
    generated = torch.cat([ids, torch.tensor([pad, 8])])
    positions, is_image = spec.layout(view, generated, torch.tensor([[1, 4, 6]]))
    assert positions[:11].tolist() == spec.position_ids(view, ids, torch.tensor([[1, 4, 6]])).tolist()
    assert positions[11:].tolist() == [[8, 8, 8], [9, 9, 9]] and is_image.tolist() == [False] * 3 + [True] * 6 + [False] * 4
    # Only a run right after <|vision_start|> is an image: a stray placeholder is text, an image without a grid an
    # error.
    stray = torch.tensor([5, pad, 6])
    assert spec.position_ids(view, stray, None)[:, 0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="left over after the row's 0 image"):
        spec.position_ids(view, ids, None)
    with pytest.raises(ValueError, match="2 image grids but 1 images"):
        spec.position_ids(view, ids, torch.tensor([[1, 4, 6], [1, 2, 2]]))


def test_qwen3_vl_keeps_transformers_names_and_counts_like_it():
    from transformers import Qwen3VLForConditionalGeneration

    from megarl.models.sizes import Architecture
    from megarl.models.tiny import tiny_qwen3_vl_config

    view = model_config(tiny_qwen3_vl_config(build_tiny_vl_tokenizer()))
    family = family_for(view)
    assert family.name == "qwen3_vl" and family.vision.mrope == "interleaved"
    assert family.vision.deepstack_layers(view) == 2
    names = {n for at in family.weight_instances(view) for n in at.hf_names}
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in names
    assert any(n.startswith("model.visual.deepstack_merger_list.1.") for n in names)
    with torch.device("meta"):
        hf = Qwen3VLForConditionalGeneration(raw_config(view))
    assert Architecture.from_hf(view, name="tiny", source="t").num_params == sum(p.numel() for p in hf.parameters())


def test_deepstack_layers_stay_on_the_first_stage_and_are_not_recomputed():
    from megarl.models.tiny import tiny_qwen3_vl_config

    view = model_config(tiny_qwen3_vl_config(build_tiny_vl_tokenizer(), num_layers=4, deepstack=(0, 1, 2)))
    family = family_for(view)
    family.transformer_config(view, ParallelDims(pp=1))
    with pytest.raises(ValueError, match="parallel.pp=2: the first pipeline stage holds 2 layer.* the first 3"):
        family.transformer_config(view, ParallelDims(pp=2))
    with pytest.raises(ValueError, match="recompute_granularity=full: .* DeepStack"):
        family.transformer_config(view, ParallelDims(pp=1), recompute_granularity="full")


def test_interleaved_mrope_equals_transformers():
    """Qwen3-VL's rotary frequencies: megarl's interleaved multimodal RoPE against transformers' for positions that
    differ on every axis."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from megarl.models.tiny import tiny_qwen3_vl_config
    from megarl.models.vision import _interleaved_mrope_class
    from megarl.parallel.cpu_support import cpu_support

    view = model_config(tiny_qwen3_vl_config(build_tiny_vl_tokenizer(), head_dim=32))
    positions = torch.randint(0, 50, (3, 2, 7))
    cos, sin = Qwen3VLTextRotaryEmbedding(view)(torch.zeros(1, dtype=torch.float32), positions)
    with cpu_support():
        rope = _interleaved_mrope_class()(kv_channels=32, rotary_percent=1.0, rotary_base=1000000.0)
    emb = rope(positions, family_for(view).vision.mrope_section(view))  # [s, b, 1, dim]
    angles = emb[:, :, 0].transpose(0, 1)  # [b, s, dim]
    assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_the_tower_is_built_whole_on_the_models_device(name):
    """Megatron's DDP moves a CUDA model's parameters into its buffers, never its buffers: the tower (the rotary's
    ``inv_freq`` buffer included) is built on the device Megatron builds on, which ``meta`` stands for here."""
    from megarl.models.tiny import tiny_qwen3_vl_config

    make = tiny_qwen2_5_vl_config if name == "qwen2_5_vl" else tiny_qwen3_vl_config
    view = model_config(make(build_tiny_vl_tokenizer()))
    tower = family_for(view).vision.build_tower(view, torch.bfloat16, "meta")
    tensors = dict(tower.named_parameters()) | dict(tower.named_buffers())
    assert any(n.endswith("inv_freq") for n in tensors)
    assert {t.device.type for t in tensors.values()} == {"meta"}
    assert {t.dtype for t in tower.parameters()} == {torch.bfloat16}
    assert {t.device.type for t in family_for(view).vision.build_tower(view, torch.float32).buffers()} == {"cpu"}
