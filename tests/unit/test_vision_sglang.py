"""What megarl sends a vision-language SGLang engine, checked against sglang 0.5.23's own sources (read, not
imported: they need GPU-only packages): an image's placeholders already expanded to its merged patches are one image
to SGLang's Qwen-VL processor, as one placeholder is; images travel as base64 data URIs, which its ``load_image``
takes; and the weight names megarl's exporter gives the tower are those SGLang's Qwen2.5-VL and Qwen3-VL load."""

from __future__ import annotations

import ast
import re

import pytest

from tests.sglang_source import source_path

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def _regex_literals(relative: str, keyword: str) -> list[str]:
    """The string patterns of ``re.compile(...)`` calls passed as ``keyword=`` in a source file."""
    tree = ast.parse(source_path(relative).read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == keyword and isinstance(node.value, ast.Call):
            args = node.value.args
            if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                out.append(args[0].value)
    return out


def test_an_expanded_image_is_one_image_to_sglangs_qwen_vl_processor():
    (pattern,) = _regex_literals("srt/multimodal/processors/qwen_vl.py", "image_token_regex")
    regex = re.compile(pattern)
    for pads in (1, 6, 64):
        text = f"look: {VISION_START}{IMAGE_PAD * pads}{VISION_END} and {VISION_START}{IMAGE_PAD * 2}{VISION_END}"
        assert [m.group(0).count(IMAGE_PAD) for m in regex.finditer(text)] == [pads, 2]
    assert regex.search(f"a generated {IMAGE_PAD} alone") is None  # text, as megarl's layout reads it


def test_sglang_loads_base64_data_uris():
    source = source_path("srt/utils/common.py").read_text()
    body = source[source.index("def load_image("):source.index("def get_image_bytes(")]
    assert 'startswith("data:")' in body


@pytest.mark.parametrize("model, names", [
    ("qwen2_5_vl", {"visual.blocks.0.attn.qkv.weight", "model.layers.0.self_attn.q_proj.weight"}),
    ("qwen3_vl", {"model.visual.blocks.0.attn.qkv.weight", "model.language_model.layers.0.self_attn.q_proj.weight"}),
])
def test_sglang_loads_the_checkpoint_names_megarl_exports(model, names):
    """megarl's exporter names a VL model's tensors as its hub checkpoint does (:func:`megarl.models.vision.hub_name`);
    SGLang's model keeps the tower at ``visual`` and the language model at ``model`` (Qwen2.5-VL: the checkpoint's
    own names), or maps transformers' ``model.visual.`` / ``model.language_model.`` prefixes onto them (Qwen3-VL)."""
    from megarl.models import family_for
    from megarl.models.tiny import build_tiny_vl_tokenizer, tiny_qwen2_5_vl_config, tiny_qwen3_vl_config
    from megarl.models.vision import model_config

    config = (tiny_qwen2_5_vl_config if model == "qwen2_5_vl" else tiny_qwen3_vl_config)(build_tiny_vl_tokenizer())
    view = model_config(config)
    exported = {n for at in family_for(view).weight_instances(view) for n in at.hf_names}
    assert names <= exported
    source = source_path(f"srt/models/{model}.py").read_text()
    assert "self.visual = " in source and "self.model = " in source
    if model == "qwen3_vl":
        assert '"model.visual.": "visual."' in source and '"model.language_model.": "language_model.model."' in source
