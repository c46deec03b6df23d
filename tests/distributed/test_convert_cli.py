"""megarl-convert: a round trip through the CLI at different layouts, and every refusal it promises.

Refusals of bad input (a --hf-config whose shapes differ, a truncated file, an unwritable
--out) come from the CLI's own process before any rank is spawned: those tests make spawning fail.
"""

import json
import os
import shutil
import struct
from pathlib import Path

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


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    """hf_dir converted at TP=2 × PP=2 through the CLI (read-only for the tests: copy before damaging it)."""
    mcore = tmp_path_factory.mktemp("mcore") / "mcore"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--tp", "2", "--pp", "2"]) == 0
    return mcore


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if a conversion spawns ranks: refusals must come before."""
    from megarl.parallel import launch

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were spawned before the input was refused")

    monkeypatch.setattr(launch, "run_ranks", refuse)


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


def test_round_trip_through_cli_at_another_layout(hf_dir, mcore_dir, tmp_path, capsys):
    mcore, back = mcore_dir, tmp_path / "back"
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


def test_deepseek_v4_is_refused_naming_its_attention_kinds(tmp_path, capsys, no_ranks):
    from transformers import DeepseekV4Config

    DeepseekV4Config(num_hidden_layers=4, architectures=["DeepseekV4ForCausalLM"]).save_pretrained(tmp_path / "v4")
    err = _fails(["hf-to-mcore", "--hf", str(tmp_path / "v4"), "--out", str(tmp_path / "o")], capsys)
    assert "DeepSeek-V4 (DeepseekV4ForCausalLM) is not supported: its layer_types use compressed_sparse_attention" in err
    assert "heavily_compressed_attention" in err and not (tmp_path / "o").exists()


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


# ------------------------------------------------------------- Refused before any rank starts
def _refused(argv, capsys, *fragments):
    """The CLI exits 2 with one line (no traceback) holding every fragment; before any rank (the ``no_ranks``
    fixture fails a test whose conversion spawns ranks)."""
    err = _fails(argv, capsys)
    assert err.startswith("megarl-convert: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def test_hf_config_whose_shapes_differ_from_the_checkpoint(mcore_dir, tmp_path, capsys, no_ranks):
    config_dir = tmp_path / "wider"
    shutil.copytree(mcore_dir / "hf_config", config_dir)
    config = json.loads((config_dir / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    out = tmp_path / "o"
    _refused(["mcore-to-hf", "--mcore", str(mcore_dir), "--out", str(out), "--hf-config", str(config_dir)], capsys,
             f"--hf-config {config_dir} does not match the checkpoint {mcore_dir}",
             "tensor decoder.layers.mlp.linear_fc1.weight has shape [4, 192, 64] in the checkpoint",
             "implies [4, 256, 64] (from model.layers.{i}.mlp.gate_proj.weight, model.layers.{i}.mlp.up_proj.weight)")
    assert not out.exists()
    # untied embeddings: the config wants an output layer the (tied) checkpoint does not have
    (config_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    _refused(["mcore-to-hf", "--mcore", str(mcore_dir), "--out", str(out), "--hf-config", str(config_dir)], capsys,
             "implies tensor output_layer.weight [256, 64] (from lm_head.weight), which the checkpoint does not hold")


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep(data)])


def _header_length(data):
    return struct.unpack("<Q", data[:8])[0]


@pytest.mark.parametrize("damage, fragment", [
    (lambda d: len(d) - 100, "which holds"),  # data cut short
    (lambda d: 8 + _header_length(d) // 2, "-byte header but holds"),  # header length past the end
    (lambda d: 5, "too short for a header"),
])
def test_truncated_safetensors_file_is_named(hf_dir, tmp_path, capsys, no_ranks, damage, fragment):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    _truncate(src / "model.safetensors", damage)
    out = tmp_path / "o"
    _refused(["hf-to-mcore", "--hf", str(src), "--out", str(out)], capsys,
             f"safetensors file {src / 'model.safetensors'}", fragment)
    assert not out.exists()


def test_corrupt_safetensors_header_and_index_are_named(hf_dir, tmp_path, capsys, no_ranks):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    data = bytearray((src / "model.safetensors").read_bytes())
    data[8] = ord("x")  # the JSON header's opening brace
    (src / "model.safetensors").write_bytes(bytes(data))
    _refused(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o")], capsys,
             f"safetensors file {src / 'model.safetensors'} has a corrupt header (not JSON")
    # sharded: the index names a file that is not there
    (src / "model.safetensors").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "part-2.safetensors"}}))
    _refused(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o")], capsys,
             f"{src / 'part-2.safetensors'}, named by model.safetensors.index.json, is missing")


def test_truncated_megatron_shard_is_named(mcore_dir, tmp_path, capsys, no_ranks):
    mcore = tmp_path / "mcore"
    shutil.copytree(mcore_dir, mcore)
    shard = sorted((mcore / "model").glob("*.distcp"))[0]
    _truncate(shard, lambda d: len(d) // 2)
    _refused(["mcore-to-hf", "--mcore", str(mcore), "--out", str(tmp_path / "o")], capsys,
             f"--mcore {mcore}: file {shard} has", "(truncated)")


def test_unwritable_out_is_named(hf_dir, tmp_path, capsys, no_ranks):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    hf = ["hf-to-mcore", "--hf", str(hf_dir)]
    _refused([*hf, "--out", str(a_file)], capsys, f"--out {a_file} is a file, not a directory")
    _refused([*hf, "--out", str(a_file), "--force"], capsys, f"--out {a_file} is a file")
    _refused([*hf, "--out", str(a_file / "sub" / "out")], capsys,
             f"--out {a_file / 'sub' / 'out'} cannot be created: {a_file} is not a directory")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        target = locked / "out"
        if os.access(locked, os.W_OK):  # root ignores permissions: take a directory nobody may write in
            target = Path("/sys/megarl-convert-out")
            if not Path("/sys").is_dir():
                pytest.skip("running as root without /sys: no unwritable directory to test with")
        _refused([*hf, "--out", str(target)], capsys, f"--out {target} is not writable: cannot create entries in")
        assert not target.exists()
    finally:
        locked.chmod(0o700)
    # --force replaces a non-empty directory (the CLI's promise) once it is writable: checked up to the ranks
    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(AssertionError, match="ranks were spawned"):
        main([*hf, "--out", str(out), "--force"])
    assert (out / "keep.txt").exists()


def test_force_never_replaces_an_input(hf_dir, mcore_dir, tmp_path, capsys, no_ranks):
    """``--out`` equal to the input, or a directory holding it, is refused before any work, ``--force`` or not
    (it used to delete the input model, and with the parent every file beside it)."""
    src = tmp_path / "models" / "src"
    shutil.copytree(hf_dir, src)
    before = sorted(p.name for p in src.iterdir())
    for out, what in [(src, "is"), (src.parent, "contains"), (tmp_path, "contains")]:
        _refused(["hf-to-mcore", "--hf", str(src), "--out", str(out), "--force"], capsys,
                 f"--out {out} {what} the input --hf {src}: the output replaces --out, which would delete that input")
    link = tmp_path / "link"
    link.symlink_to(src)
    _refused(["hf-to-mcore", "--hf", str(link), "--out", str(src), "--force"], capsys, "is the input --hf")
    _refused(["mcore-to-hf", "--mcore", str(mcore_dir), "--out", str(mcore_dir), "--force"], capsys,
             f"--out {mcore_dir} is the input --mcore {mcore_dir}")
    _refused(["mcore-to-hf", "--mcore", str(mcore_dir), "--hf-config", str(src), "--out", str(src.parent),
              "--force"], capsys, "contains the input --hf-config")
    assert sorted(p.name for p in src.iterdir()) == before


def test_moe_round_trip_through_cli_at_tp2_ep2(tmp_path):
    """HF -> Megatron at TP=2 × EP=2 (4 ranks, each reading its experts) -> HF (as saved) is bit-exact;
    the checkpoint holds each sparse layer's experts on one axis, one key per layer (a dense layer among them)."""
    from megarl.convert.dist_checkpoint import read_dist_metadata
    from tests.distributed import moe_jobs

    hf = tmp_path / "hf"
    moe_jobs.save_tiny_moe("qwen3_moe", hf)
    mcore = tmp_path / "mcore"
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(mcore), "--tp", "2", "--ep", "2"]) == 0
    assert json.loads((mcore / "megarl.json").read_text())["ep"] == 2
    keys = {k: tuple(v.size) for k, v in read_dist_metadata(mcore / "model").state_dict_metadata.items()
            if isinstance(getattr(v, "size", None), torch.Size)}
    assert keys["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == (4, 32, 48)  # [experts, 2F, H]
    assert keys["decoder.layers.0.pre_mlp_layernorm.weight"] == (48,)  # TransformerEngine's MoE name
    assert keys["decoder.layers.1.mlp.linear_fc1.weight"] == (80, 48)  # the dense layer
    out = tmp_path / "back"
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(out)]) == 0
    _assert_same_tensors(hf, out)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3", "kimi_k2", "minimax_m2"])
def test_every_moe_family_round_trips_through_cli_at_tp2_ep2(name, tmp_path, capsys):
    """Each MoE family's tiny model (Qwen3-MoE's is above) HF -> Megatron at TP=2 × EP=2 -> HF is bit-exact:
    Mixtral, Qwen2-MoE (gated shared expert), GLM-4.5 (q/k norms, sigmoid router's bias), DeepSeek-V3 (MLA, its
    multi-token-prediction layer left out of the model, said so, and written back as it was), Kimi-K2 (``model_type:
    kimi_k2``), MiniMax-M2 (q/k norms over all heads, split by head; its MTP layer kept likewise). The checkpoint's own
    config.json comes back."""
    from tests.distributed import moe_jobs

    hf = tmp_path / "hf"
    model = moe_jobs.save_tiny_moe(name, hf)
    mcore, out = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(mcore), "--tp", "2", "--ep", "2"]) == 0
    said = capsys.readouterr().out
    meta = json.loads((mcore / "megarl.json").read_text())
    assert (meta["tp"], meta["ep"]) == (2, 2)
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(out)]) == 0
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    skipped = sorted(n for n in load_file(hf / "model.safetensors") if n.startswith(mtp))
    assert skipped or name != "deepseek_v3"  # the hub's DeepSeek-V3 holds one
    assert (f"skipped {len(skipped)} tensors of {mtp[:-1]} (multi-token prediction" in said) == bool(skipped)
    # The multi-token-prediction layer the model leaves out is kept beside the checkpoint and written back as it was:
    # the exported model still serves speculative decoding.
    assert (mcore / "kept").is_dir() == bool(skipped)
    _assert_same_tensors(hf, out)
    config = json.loads((out / "config.json").read_text())
    assert config == {**json.loads((hf / "config.json").read_text()), "dtype": config["dtype"]}


@pytest.mark.parametrize("name, layout", [("qwen3_5", ["--tp", "2", "--pp", "2"]),
                                          ("qwen3_5_moe", ["--tp", "2", "--ep", "2"]),
                                          ("qwen3_next", ["--tp", "2", "--ep", "2"])])
def test_hybrid_linear_attention_families_round_trip_through_cli(name, layout, tmp_path):
    """Qwen3.5 dense at TP=2 × PP=2, Qwen3.5-MoE and Qwen3-Next (projections fused per key head) at TP=2 × EP=2:
    HF -> Megatron -> HF (at TP=1) is bit-exact,
    the Gated DeltaNet's fused projection and convolution (each rank its heads of every piece) included; the
    checkpoint keeps one key per layer (linear and full attention alternate)."""
    from megarl.convert.dist_checkpoint import read_dist_metadata
    from tests.distributed import family_jobs

    hf, mcore, out = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    family_jobs.save_tiny(name, hf)
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(mcore), *layout]) == 0
    keys = set(read_dist_metadata(mcore / "model").state_dict_metadata)
    assert any(k.startswith("decoder.layers.0.self_attention.in_proj.weight") for k in keys)
    assert any(k.startswith("decoder.layers.2.self_attention.linear_qkv.weight") for k in keys)
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(out), "--tp", "1", "--pp", "1"]) == 0
    _assert_same_tensors(hf, out)  # Qwen3-Next's mtp.* module included: kept beside the checkpoint
    assert (mcore / "kept").is_dir() == (name == "qwen3_next")


def test_kimi_k2_round_trip_through_cli_on_an_uneven_pipeline(tmp_path):
    """Kimi-K2 (DeepSeek-V3's architecture, ``model_type: kimi_k2``) HF -> Megatron at PP=2 with a first
    stage of 1 layer of 4 (``--first-stage-layers``, as DeepSeek-V3's 61 layers need) × EP=2 -> HF (as saved) is
    bit-exact, and the checkpoint's own config.json comes back as it was."""
    from tests.distributed import moe_jobs

    hf = tmp_path / "hf"
    moe_jobs.save_tiny_moe("kimi_k2", hf)
    mcore = tmp_path / "mcore"
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(mcore), "--pp", "2", "--first-stage-layers", "1",
                 "--ep", "2"]) == 0
    meta = json.loads((mcore / "megarl.json").read_text())
    assert (meta["pp"], meta["first_stage_layers"], meta["last_stage_layers"], meta["ep"]) == (2, 1, None, 2)
    out = tmp_path / "back"
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(out)]) == 0
    _assert_same_tensors(hf, out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["auto_map"] == json.loads(
        (hf / "config.json").read_text())["auto_map"]


def _assert_same_tensors(hf: Path, out: Path, skip: list[str] = ()) -> None:
    """``out``'s safetensors shards hold exactly ``hf``'s tensors (but ``skip``), bit for bit."""
    original, back = load_file(hf / "model.safetensors"), {}
    for name in skip:
        del original[name]
    for shard in sorted(out.glob("*.safetensors")):
        back.update(load_file(shard))
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[n], original[n]) for n in original)
