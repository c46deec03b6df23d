"""Block FP8: quantize -> dequantize within e4m3's rounding bound, block by block, over random weights of
awkward shapes and magnitudes and over a real model's weights (SmolLM2's); which tensors of each family are
quantized; the format SGLang 0.5.23's FP8 loader reads."""

from __future__ import annotations

import pytest
import torch

from megarl.models.fp8 import (
    BLOCK,
    FP8_MAX,
    QUANTIZATION_CONFIG,
    dequantize_block_fp8,
    error_bound,
    expand_scales,
    num_blocks,
    quantize_block_fp8,
    scale_name,
)


def _check(weight: torch.Tensor) -> float:
    q, scale = quantize_block_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.shape == weight.shape and tuple(scale.shape) == num_blocks(tuple(weight.shape))
    assert float(q.float().abs().max()) <= FP8_MAX
    back = dequantize_block_fp8(q, scale)
    error = (back - weight.float()).abs()
    slack = weight.float().abs() * 2.0 ** -20 + 1e-30  # fp32 division and multiplication
    assert bool((error <= error_bound(weight, scale) + slack).all()), float((error - error_bound(weight, scale)).max())
    return float(error.max())


@pytest.mark.parametrize("shape", [(128, 128), (300, 70), (1, 1), (257, 129), (896, 4864)])
@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 3e3])
def test_quantize_dequantize_stays_within_e4m3s_rounding_bound(shape, magnitude):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=generator) * magnitude
    weight[0, 0] = 0.0
    _check(weight.to(torch.bfloat16))
    _check(weight)


def test_each_block_has_its_own_scale_and_uses_the_whole_range():
    weight = torch.ones(256, 256)
    weight[:128, 128:] *= 1000.0  # one loud block
    weight[128:, :128] = 0.0  # one silent block
    q, scale = quantize_block_fp8(weight)
    assert scale[0, 0] == pytest.approx(1 / FP8_MAX) and scale[0, 1] == pytest.approx(1000 / FP8_MAX)
    assert scale[1, 0] > 0 and bool((q[128:, :128].float() == 0).all())
    assert bool((q[:128, :128].float() == FP8_MAX).all())  # the block's max is 448 exactly
    assert torch.equal(dequantize_block_fp8(q, scale), weight)  # ones and thousands are exact in e4m3 x scale
    assert expand_scales(scale, (200, 130))[199, 129] == scale[1, 1]


def test_a_real_models_weights_quantize_within_the_bound(smollm2_hf):
    """SmolLM2-135M-Instruct's linear weights (a real distribution: outliers, narrow layers), from its GGUF."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(smollm2_hf.glob("*.safetensors")):
        tensors.update(load_file(path))
    linear = [name for name in sorted(tensors) if name.endswith("proj.weight")]
    assert len(linear) == 30 * 7  # q, k, v, o, gate, up, down in each of 30 layers
    for name in linear[:7] + linear[-7:]:  # the first and last layers' (the widest spread of magnitudes)
        relative = _check(tensors[name]) / float(tensors[name].float().abs().max())
        assert relative <= 2.0 ** -4, name


def test_the_linear_weights_of_every_family_are_quantized_and_nothing_else():
    import megarl.models  # noqa: F401  (registers the families)
    from megarl.models.family import FAMILIES

    for family in FAMILIES.values():
        quantized = {rule.megatron.split(".")[-2] + "." + rule.megatron.split(".")[-1] for rule in family.weights
                     if rule.block_fp8}
        kept = {rule.megatron.split(".")[-2] + "." + rule.megatron.split(".")[-1] for rule in family.weights
                if not rule.block_fp8}
        attention = ({"linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
                      "linear_kv_up_proj.weight"} if family.mla else {"linear_qkv.weight"})
        assert quantized >= attention | {"linear_proj.weight"}, family.name
        assert not any(name.endswith(("bias", "layernorm.weight")) for name in quantized), family.name
        assert {"word_embeddings.weight", "final_layernorm.weight"} <= kept, family.name
        assert "output_layer.weight" in kept and "router.weight" not in quantized, family.name


def test_the_format_is_the_one_sglangs_fp8_loader_reads():
    """sglang 0.5.23, read from its sources (importing them needs GPU-only packages): ``Fp8Config.from_config`` takes
    the checkpoint's ``quant_method`` (FP8 serialized when it says fp8), ``activation_scheme`` and
    ``weight_block_size``; its linear method registers ``weight_scale_inv`` of ``[ceil(N/128), ceil(K/128)]`` fp32
    for block-quantized checkpoints; its own ``block_quant_dequant``, run on our pair, gives our weight back."""
    import ast

    from tests.sglang_source import source_path

    fp8 = source_path("srt/layers/quantization/fp8.py").read_text()
    for key in QUANTIZATION_CONFIG:
        if key != "fmt":  # informational in the checkpoints; SGLang does not read it
            assert f'["{key}"]' in fp8, key
    assert 'is_checkpoint_fp8_serialized = ("fp8" in quant_method)' in fp8
    assert 'layer.register_parameter("weight_scale_inv", scale)' in fp8
    assert "(output_size_per_partition + block_n - 1) // block_n" in fp8
    assert "(input_size_per_partition + block_k - 1) // block_k" in fp8
    utils = ast.parse(source_path("srt/layers/quantization/fp8_utils.py").read_text())
    (function,) = [node for node in utils.body if isinstance(node, ast.FunctionDef)
                   and node.name == "block_quant_dequant"]
    namespace: dict = {"torch": torch, "List": list}
    exec(compile(ast.Module([function], []), "fp8_utils.py", "exec"), namespace)
    weight = torch.randn(300, 200)
    q, scale = quantize_block_fp8(weight)
    assert torch.equal(namespace["block_quant_dequant"](q, scale, list(BLOCK), torch.float32),
                       dequantize_block_fp8(q, scale))
    assert scale_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight_scale_inv"


def test_an_fp8_checkpoint_megarl_writes_loads_in_transformers(tmp_path):
    """A tiny Qwen2 (hidden 256: whole and partial blocks) written as block FP8 loads in transformers, which on a CPU
    dequantizes it: its logits equal those of the model with our dequantized weights put in (bit for bit), and stay
    within 8 % of the largest logit of the unquantized model's (measured: 3.1 %)."""
    import json

    from transformers import AutoModelForCausalLM

    from megarl.convert.fp8 import write_fp8_checkpoint
    from megarl.models.tiny import save_tiny

    source = save_tiny(tmp_path / "bf16", num_layers=2, hidden_size=256, intermediate_size=512)
    report = write_fp8_checkpoint(source, tmp_path / "fp8")
    assert (report.quantized, report.kept) == (2 * 7, 2 * 5 + 2)  # 7 projections a layer; norms, q/k/v biases, ...
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    with pytest.raises(ValueError, match="already quantized"):
        write_fp8_checkpoint(tmp_path / "fp8", tmp_path / "again")
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 8, 100]])
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    with torch.no_grad():
        exact = reference(ids).logits
        fp8 = loaded(ids).logits
        for name, parameter in reference.named_parameters():
            if name.endswith("proj.weight"):
                parameter.copy_(dequantize_block_fp8(*quantize_block_fp8(parameter)))
        ours = reference(ids).logits
    assert torch.equal(fp8, ours)
    assert float((fp8 - exact).abs().max()) <= 0.08 * float(exact.abs().max())


def test_megarl_convert_writes_an_fp8_checkpoint(tmp_path, capsys):
    from safetensors import safe_open

    from megarl.cli.convert import main
    from megarl.models.tiny import save_tiny

    source = save_tiny(tmp_path / "model", num_layers=1)
    assert main(["hf-to-fp8", "--hf", str(source), "--out", str(tmp_path / "fp8")]) == 0
    assert "megarl-convert: wrote" in capsys.readouterr().out
    with safe_open(tmp_path / "fp8" / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == num_blocks(tuple(q.shape))
    assert len([n for n in names if n.endswith("_scale_inv")]) == 7
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["hf-to-fp8", "--hf", str(source), "--out", str(tmp_path / "taken")])
    assert exit_.value.code == 2 and "is not empty" in capsys.readouterr().err


def test_the_cpu_engine_serves_an_fp8_checkpoint_as_sglang_holds_it(tmp_path):
    """megarl's CPU engine on a block-FP8 checkpoint keeps the FP8 weights and scales (held as they are) and
    computes with their dequantization; an update of weights and scales (in separate buckets, scale first) changes
    the layer once the session ends; a weight sent in the training dtype is refused, naming the format."""
    from safetensors import safe_open

    from megarl.convert.fp8 import write_fp8_checkpoint
    from megarl.engines.cpu_engine.hf_engine import HFEngine
    from megarl.engines.engine import SamplingParams
    from megarl.models.tiny import save_tiny

    source = save_tiny(tmp_path / "bf16", num_layers=1, hidden_size=256, intermediate_size=512)
    write_fp8_checkpoint(source, tmp_path / "fp8")
    engine = HFEngine(tmp_path / "fp8", dtype=torch.bfloat16)
    plain = HFEngine(source, dtype=torch.bfloat16)
    assert engine.fp8 is not None and plain.fp8 is None and len(engine.fp8.weights) == 7
    name = "model.layers.0.mlp.up_proj.weight"
    original = plain._params[name].detach().float()
    with safe_open(tmp_path / "fp8" / "model.safetensors", framework="pt") as f:
        q, scale = f.get_tensor(name), f.get_tensor(scale_name(name))
    assert torch.equal(engine._params[name], dequantize_block_fp8(q, scale, torch.bfloat16))
    assert torch.equal(engine.inspect_weight(name), q) and torch.equal(engine.inspect_weight(scale_name(name)), scale)
    assert torch.equal(engine.inspect_weight("model.norm.weight"), plain.inspect_weight("model.norm.weight"))
    new_q, new_scale = quantize_block_fp8(torch.randn(original.shape) * 0.02)
    engine.begin_weight_update()
    engine.update_weights_from_tensor([(scale_name(name), new_scale)])
    engine.update_weights_from_tensor([(name, new_q)])
    assert torch.equal(engine._params[name], dequantize_block_fp8(q, scale, torch.bfloat16))  # not before the end
    engine.end_weight_update()
    assert torch.equal(engine._params[name], dequantize_block_fp8(new_q, new_scale, torch.bfloat16))
    assert torch.equal(engine.inspect_weight(name), new_q)
    engine.begin_weight_update()
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' is \(512, 256\) torch.bfloat16; "
                                         r"this FP8 engine holds it as \(512, 256\) torch.float8_e4m3fn"):
        engine.update_weights_from_tensor([(name, original.to(torch.bfloat16))])
    engine.end_weight_update()
    outputs = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert len(outputs[0].output_ids) == 4 or outputs[0].output_ids[-1] in engine.eos_token_ids


def test_the_engines_fp8_weights_live_on_their_parameters_device():
    """A CUDA engine keeps its FP8 weights and scales on the GPU, beside the parameters they make: an update is
    stored there and dequantized there (``meta`` stands for the GPU here; the checkpoint is read on the host)."""
    from megarl.engines.cpu_engine.fp8 import Fp8Weights
    from megarl.models.fp8 import quantize_block_fp8

    weight, scale = quantize_block_fp8(torch.randn(256, 128))
    param = torch.nn.Parameter(torch.empty(256, 128, device="meta"))
    held = Fp8Weights({"w": param}, {"w": weight}, {"w": scale})
    assert held.weights["w"].device.type == held.scales["w"].device.type == "meta"
    assert held.weights["w"].dtype == weight.dtype and held.scales["w"].shape == scale.shape
    on_host = Fp8Weights({"w": torch.nn.Parameter(torch.empty(256, 128))}, {"w": weight}, {"w": scale})
    on_host.refresh_all()
    assert on_host.read("w").device.type == "cpu" and torch.equal(on_host.read("w").float(), weight.float())


def test_a_block_fp8_checkpoint_reads_dequantized_by_any_slice(tmp_path):
    """DeepSeek-V3 is published in block FP8: :class:`HFCheckpoint` reads such a weight dequantized (fp32), whole or
    by any row or column slice (the blocks around it read with their scales), equal to dequantizing the whole
    weight and slicing it; its scale is part of the weight (not a tensor name); other tensors read as they are."""
    import json

    from safetensors.torch import save_file

    from megarl.convert.hf_io import HFCheckpoint
    from megarl.convert.layout import Slice

    weight = torch.randn(300, 200)
    q, scale = quantize_block_fp8(weight)
    norm = torch.randn(200)
    save_file({"w.weight": q, "w.weight_scale_inv": scale, "n.weight": norm}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": QUANTIZATION_CONFIG}))
    checkpoint = HFCheckpoint(tmp_path)
    assert sorted(checkpoint.names()) == ["n.weight", "w.weight"]
    whole = dequantize_block_fp8(q, scale)
    assert torch.equal(checkpoint.read("w.weight", Slice(None)), whole)
    assert ((whole - weight).abs() <= error_bound(q, scale)).all()
    for where in (Slice(0, 0, 150), Slice(0, 150, 300), Slice(0, 127, 129), Slice(1, 100, 200), Slice(1, 0, 1),
                  Slice(1, 130, 131)):
        got = checkpoint.read("w.weight", where)
        assert got.dtype == torch.float32 and torch.equal(got, where.apply(whole)), where
    assert torch.equal(checkpoint.read("n.weight", Slice(0, 3, 7)), norm[3:7])


def test_an_fp8_policy_needs_fp8_engines_and_its_engines_start_from_it(tmp_path):
    """A block-FP8 policy (DeepSeek-V3 as published): its engines start from it as it is with
    ``rollout.quantization=fp8`` (no copy); without it the run is refused naming the key; another quantization is
    refused naming it; exports drop the quantization config (their weights are dequantized)."""
    import json

    from megarl.convert.fp8 import checkpoint_quantization, engine_checkpoint
    from megarl.convert.hf_io import set_config_dtype

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3",
                                                      "quantization_config": QUANTIZATION_CONFIG}))
    assert checkpoint_quantization(tmp_path) == QUANTIZATION_CONFIG
    assert engine_checkpoint(tmp_path, tmp_path / "run") == tmp_path.resolve()
    set_config_dtype(tmp_path, torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "deepseek_v3", "dtype": "bfloat16"}
    assert engine_checkpoint(tmp_path, tmp_path / "run") == tmp_path / "run" / "engine_fp8"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match=r"quantized as .*awq.*: megarl reads block-FP8 checkpoints"):
        checkpoint_quantization(tmp_path)
