"""LoRA adapters on Megatron's linear layers: the same adapted model at TP=2 (with and without sequence
parallelism), PP=2 and TP2×PP2 gives TP=1's log-probs and adapter gradients (whole, in PEFT's layout) within 1e-5;
only the adapters train (no gradient and no optimizer state for the base, whose weights stay bit for bit); the
weight export merges ``W + alpha / rank · B A``; with the adapters off the model is the base (the reference)."""

from __future__ import annotations

import pytest
import torch

from megarl.parallel.launch import run_ranks
from tests.distributed import lora_jobs

ADAPTED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    path = save_tiny(tmp_path_factory.mktemp("lora") / "model", num_layers=2)
    return run_ranks(lora_jobs.lora_parity_job, 4, str(path), timeout_s=600)


def _merged(parity, layout: str, key: str) -> dict:
    """A layout's per-rank dicts merged (stages hold different layers; TP ranks return the same tensors)."""
    merged = {}
    for rank in parity:
        for name, tensor in rank[layout][key].items():
            if name in merged:
                assert torch.equal(merged[name], tensor), (layout, key, name)  # replicas agree exactly
            merged[name] = tensor
    return merged


def test_every_layer_is_adapted_in_pefts_layout(parity):
    adapters = _merged(parity, "tp1", "adapters")
    expected = {f"base_model.model.model.layers.{i}.{m}.lora_{f}.weight" for i in range(2) for m in ADAPTED
                for f in "AB"}
    assert set(adapters) == expected
    a_q, a_k = (adapters[f"base_model.model.model.layers.0.self_attn.{m}_proj.lora_A.weight"] for m in "qk")
    assert a_q.shape == (4, 64) and torch.equal(a_q, a_k)  # one A for the fused q, k, v
    assert adapters["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
    assert adapters["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 128)


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2", "tp2_pp2"])
def test_logprobs_and_adapter_gradients_equal_tp1(parity, layout):
    reference, other = _merged(parity, "tp1", "logp"), _merged(parity, layout, "logp")
    assert sorted(other) == sorted(reference) == list(range(lora_jobs.NUM_MICRO_BATCHES))
    for i in reference:
        assert torch.allclose(other[i], reference[i], atol=1e-5, rtol=0), (i, (other[i] - reference[i]).abs().max())
    grads, reference_grads = _merged(parity, layout, "grads"), _merged(parity, "tp1", "grads")
    assert sorted(grads) == sorted(reference_grads)
    scale = max(g.abs().max().item() for g in reference_grads.values())
    assert scale > 1e-4  # the adapters do get gradient
    for name, grad in grads.items():
        assert torch.allclose(grad, reference_grads[name], atol=1e-5 * max(1.0, scale), rtol=0), (
            name, (grad - reference_grads[name]).abs().max())
    adapters, reference_adapters = _merged(parity, layout, "adapters"), _merged(parity, "tp1", "adapters")
    for name, tensor in adapters.items():  # after one Adam step
        assert torch.allclose(tensor, reference_adapters[name], atol=1e-5, rtol=0), name


@pytest.mark.parametrize("layout", list(lora_jobs.LAYOUTS))
def test_only_the_adapters_train(parity, layout):
    for rank in parity:
        result = rank[layout]
        assert result["trainable"] and all(n.endswith((".lora_A", ".lora_B")) for n in result["trainable"])
        assert result["optimized_numel"] == result["adapter_numel"] > 0  # no optimizer state for the base
        assert result["base_grads"] == []
        assert result["base_unchanged"]


def test_the_export_merges_the_adapters_into_the_weights(parity, tmp_path):
    """Every layout exports W + alpha / rank · B A, B and A in PEFT's layout (the same across layouts)."""
    from safetensors.torch import load_file

    from megarl.models.tiny import save_tiny

    base = load_file(str(save_tiny(tmp_path / "model", num_layers=2) / "model.safetensors"))  # the same weights
    adapters = _merged(parity, "tp1", "adapters_before")
    merged = _merged(parity, "tp1", "merged")
    scale = 8.0 / 4
    for i in range(2):
        for module in ADAPTED:
            prefix = f"base_model.model.model.layers.{i}.{module}"
            b, a = adapters[f"{prefix}.lora_B.weight"], adapters[f"{prefix}.lora_A.weight"]
            name = f"model.layers.{i}.{module}.weight"
            assert torch.allclose(merged[name], base[name] + scale * b @ a, atol=1e-6, rtol=0), name
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])
    for layout in ("tp2", "tp2_sp", "pp2", "tp2_pp2"):
        other = _merged(parity, layout, "merged")
        assert sorted(other) == sorted(merged)
        for name, tensor in other.items():
            assert torch.allclose(tensor, merged[name], atol=1e-6, rtol=0), (layout, name)


def test_with_the_adapters_off_the_model_is_the_base(parity):
    """The reference of a LoRA run: a fresh adapter (B = 0) gives the base's log-probs bit for bit, and with the
    adapters off any adapted model gives the log-probs of the same model built without LoRA, bit for bit."""
    fresh = parity[0]["fresh"]
    zero_on, zero_off = fresh["zero_b"]
    none_on, _ = fresh["none"]
    for a, b, c in zip(zero_on, zero_off, none_on):
        assert torch.equal(a, b) and torch.equal(b, c)
    reference = _merged(parity, "tp1", "logp")
    off = _merged(parity, "tp1", "logp_off")
    assert all(torch.equal(off[i], none_on[i]) for i in off)  # random adapters off: the base exactly
    assert all((reference[i] - off[i]).abs().max() > 1e-3 for i in off)  # and on, they change the model


def test_a_lora_checkpoint_exports_merged_and_as_pefts_adapters(tmp_path):
    """megarl-convert mcore-to-hf on a LoRA actor's checkpoint (TP=2, adapters on q/k/v and down_proj): the merged
    HF model, and PEFT's adapters loaded by ``peft`` onto the HF base, give the trained actor's log-probs."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from megarl.convert import jobs
    from megarl.models.tiny import save_tiny
    from megarl.workers.model_checkpoint import export_source

    path = save_tiny(tmp_path / "model", num_layers=2)
    results = run_ranks(lora_jobs.lora_checkpoint_job, 2, str(path), str(tmp_path / "actor"), timeout_s=300)
    actor = results[0]["logp"]
    source = export_source(tmp_path / "actor")
    assert source.lora is not None and source.lora.targets == ("linear_qkv", "linear_fc2")
    # The base the checkpoint names is an input: never the output, --force or not (it would be replaced by the merged
    # weights, and a later export would apply the adapters twice), nor with --base naming it.
    before = (path / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"is the input \(the base model the LoRA checkpoint names\)"):
        jobs.mcore_to_hf(source, path, force=True)
    with pytest.raises(ValueError, match=r"is the input --base"):
        jobs.mcore_to_hf(source, path, force=True, peft=True, base_dir=path)
    assert (path / "model.safetensors").read_bytes() == before
    jobs.mcore_to_hf(source, tmp_path / "merged")
    jobs.mcore_to_hf(source, tmp_path / "adapter", peft=True)
    config = __import__("json").loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        4, 8.0, ["down_proj", "k_proj", "q_proj", "v_proj"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                             tmp_path / "adapter").eval()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for micro, logp in zip(lora_jobs._micro_batches(plain.config.vocab_size), actor):
        ids, mask = micro["input_ids"], micro["attention_mask"]
        with torch.no_grad():
            outputs = [m(input_ids=ids, attention_mask=mask).logits for m in (merged, adapted, plain)]
        logps = [torch.log_softmax(o.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0] for o in outputs]
        real = mask[:, 1:].bool()
        for got in logps[:2]:
            assert (got - logp[:, :-1])[real].abs().max() < 1e-5
        assert (logps[2] - logp[:, :-1])[real].abs().max() > 1e-3  # the adapters changed the model


def test_a_lora_checkpoint_holds_the_adapters_alone_and_resumes_bit_for_bit(tmp_path):
    from megarl.models.tiny import save_tiny

    path = save_tiny(tmp_path / "model", num_layers=2)
    results = run_ranks(lora_jobs.lora_resume_job, 4, str(path), str(tmp_path / "actor"), timeout_s=300)
    saved = results[0]["saved"]
    assert saved and all(name.endswith((".lora_A", ".lora_B")) for name in saved), saved  # no base weights
    for rank in results:
        assert rank["resumed"] == rank["straight"][1:]
        assert rank["resumed_adapters"].keys() == rank["straight_adapters"].keys()
        for name, tensor in rank["straight_adapters"].items():
            assert torch.equal(rank["resumed_adapters"][name], tensor), name
