"""Vision-language models: a tiny Qwen2.5-VL and a tiny Qwen3-VL (interleaved multimodal RoPE, DeepStack)
in Megatron equal transformers.

One 2-rank job runs every layout (TP=1, TP=2, TP=2 with sequence parallelism, PP=2; padded and packed) on a batch
of image+text rows (two images of different grids in one row, one in another, a text-only row, left padding):
the logits equal transformers' row by row within 1e-5, the multimodal positions equal transformers'
``get_rope_index``, and the vision tower's gradients (replicated on every TP rank, on the first pipeline stage)
equal transformers' for the same loss. ``megarl-convert`` takes the checkpoint HF → Megatron (TP=2 × PP=2) → HF
bit for bit, config included.
"""

from __future__ import annotations

import json

import pytest
import torch

from megarl.parallel.launch import run_ranks
from tests.distributed import vision_jobs

ARCHS = ("qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        directory = tmp_path_factory.mktemp(arch)
        model = vision_jobs.save_tiny_vl(directory, arch=arch)
        batch = vision_jobs.image_batch(model.config)
        batch["weights"][3] = 0  # the row with a generated placeholder: in the logits, not the gradients
        torch.save(batch, directory / "batch.pt")
        logits, positions = vision_jobs.hf_logits_and_positions(model, batch)
        out[arch] = directory, batch, logits, positions, vision_jobs.hf_tower_grads(model, batch)
    return out


@pytest.fixture(scope="module")
def all_layouts(models):
    ranks = run_ranks(vision_jobs.layouts_jobs, 2, [str(models[arch][0]) for arch in ARCHS], timeout_s=900)
    return {arch: [rank[i] for rank in ranks] for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def tiny_vl(models, arch):
    return models[arch]


@pytest.fixture
def layouts(all_layouts, arch):
    return all_layouts[arch]


def test_positions_equal_transformers(tiny_vl, layouts):
    _, batch, _, positions, _ = tiny_vl
    ours = layouts[0]["positions"]
    for i, expected in enumerate(positions):
        assert torch.equal(ours[i][batch["attention_mask"][i].bool()], expected)
    assert (positions[0][:, 1] != positions[0][:, 2]).any()  # the images' patches differ in height and width


@pytest.mark.parametrize("layout", list(vision_jobs.LAYOUTS))
def test_logits_equal_transformers(tiny_vl, layouts, layout):
    _, batch, expected, _, _ = tiny_vl
    results = [rank[layout] for rank in layouts if rank[layout]["logits"] is not None]
    assert results, f"{layout}: no rank returned logits"
    for result in results:
        for i, row in enumerate(expected):
            ours = result["logits"][i][batch["attention_mask"][i].bool()]
            assert (ours - row).abs().max().item() < 1e-5, (layout, i)


@pytest.mark.parametrize("layout", list(vision_jobs.LAYOUTS))
def test_vision_tower_gradients_equal_transformers(tiny_vl, layouts, layout):
    _, _, _, _, expected = tiny_vl
    holders = [rank[layout] for rank in layouts if rank[layout]["grads"] is not None]
    assert len(holders) == (1 if layout.startswith("pp2") else 2)  # the first stage's ranks only
    assert all(h["pp_rank"] == 0 and h["tower_params"] == sum(g.numel() for g in expected.values()) for h in holders)
    for holder in holders:
        assert holder["grads"].keys() == expected.keys()
        for name, grad in expected.items():
            scale = grad.abs().max().item() + 1e-12
            assert (holder["grads"][name] - grad).abs().max().item() / scale < 1e-4, (layout, name)


def test_convert_round_trip_is_bit_exact(tiny_vl, arch, tmp_path):
    from safetensors.torch import load_file

    from megarl.convert.jobs import hf_to_mcore, mcore_to_hf

    directory = tiny_vl[0]
    hf_to_mcore(directory, tmp_path / "mcore", tp=2, pp=2, dtype="fp32", timeout_s=300)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", dtype="fp32", timeout_s=300)
    before, after = load_file(directory / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(name.startswith(("visual.", "model.visual.")) for name in before)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((directory / "config.json").read_text())
