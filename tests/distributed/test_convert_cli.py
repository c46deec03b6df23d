"""megarl-convert: a round trip through the CLI at different layouts, and every refusal it promises."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.cli.convert import main
from tests.distributed import convert_jobs


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "qwen2"
    convert_jobs.save_tiny_hf_model("qwen2", directory)
    return directory


def _copy_model(src, dst, *, config=None, tensors=None):
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    weights = load_file(src / "model.safetensors")
    if tensors is not None:
        weights = tensors(weights)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _fails(argv, capsys, code=2):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code
    return capsys.readouterr().err


def test_round_trip_through_cli_at_another_layout(hf_dir, tmp_path, capsys):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--tp", "2", "--pp", "2"]) == 0
    meta = json.loads((mcore / "megarl.json").read_text())
    assert (meta["family"], meta["tp"], meta["pp"], meta["dtype"]) == ("qwen2", 2, 2, "fp32")
    assert (mcore / "hf_config" / "config.json").exists() and (mcore / "model" / "metadata.json").exists()
    # Load at TP=1 × PP=2 instead of the saved TP=2 × PP=2; small shards force an index.
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(back), "--tp", "1", "--pp", "2",
                 "--max-shard-size", "200KB"]) == 0
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all((back / f).exists() for f in files)
    original = load_file(hf_dir / "model.safetensors")
    exported = {}
    for f in files:
        exported.update(load_file(back / f))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], original[n]) for n in original)
    assert json.loads((back / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert "wrote" in capsys.readouterr().out


def test_refuses_non_empty_output_without_force(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    err = _fails(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(out)], capsys)
    assert "is not empty" in err and "--force" in err
    assert (out / "keep.txt").exists()


def test_unsupported_architecture(hf_dir, tmp_path, capsys):
    src = _copy_model(hf_dir, tmp_path / "gpt2", config={"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    err = _fails(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o")], capsys)
    assert "no megarl model family serves architectures=['GPT2LMHeadModel']" in err


def test_inconsistent_heads_and_groups(hf_dir, tmp_path, capsys):
    src = _copy_model(hf_dir, tmp_path / "heads", config={"num_key_value_heads": 3})
    err = _fails(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o")], capsys)
    assert "num_attention_heads=4 is not a multiple of num_key_value_heads=3" in err


def test_layout_that_does_not_fit_the_model(hf_dir, tmp_path, capsys):
    err = _fails(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--tp", "4"], capsys)
    assert "parallel.tp=4 does not divide the model's 2 key/value heads" in err
    err = _fails(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--pp", "8"], capsys)
    assert "exceed the model's 4 layers" in err


def test_vocab_or_shape_mismatch_is_named(hf_dir, tmp_path, capsys):
    src = _copy_model(hf_dir, tmp_path / "vocab", config={"vocab_size": 300})
    err = _fails(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o")], capsys)
    assert "tensor model.embed_tokens.weight has shape [250, 64], config.json implies [300, 64]" in err


def test_missing_and_unexpected_tensors_are_listed(hf_dir, tmp_path, capsys):
    def edit(weights):
        del weights["model.layers.1.mlp.up_proj.weight"]
        weights["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
        return weights

    src = _copy_model(hf_dir, tmp_path / "names", tensors=edit)
    err = _fails(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o")], capsys)
    assert "missing tensors (1): model.layers.1.mlp.up_proj.weight" in err
    assert "unexpected tensors (1): model.layers.1.mlp.extra.weight" in err


def test_crash_mid_conversion_leaves_no_output(hf_dir, tmp_path, capsys):
    def poison(weights):
        weights["model.layers.3.mlp.down_proj.weight"][0, 0] = float("nan")
        return weights

    src = _copy_model(hf_dir, tmp_path / "nan", tensors=poison)
    out = tmp_path / "o"
    err = _fails(["hf-to-mcore", "--hf", str(src), "--out", str(out), "--pp", "2"], capsys, code=1)
    assert "model.layers.3.mlp.down_proj.weight" in err and "NaN" in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_mcore_to_hf_refuses_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    err = _fails(["mcore-to-hf", "--mcore", str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert "is not a megarl Megatron checkpoint" in err
