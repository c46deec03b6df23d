"""Each rule of megarl's strict CPU engine, pinned to sglang 0.5.23's own source (:mod:`tests.sglang_rules`), so the
stand-in cannot drift from the engine it stands in for. The expectations were read by hand in the pinned sources,
quoted where it matters; sglang is a CI dependency, so these tests fail (never skip) without it."""

from __future__ import annotations

import pytest
import torch

from megarl.models.family import FAMILIES
from megarl.models.known import known_config
from tests import sglang_rules as rules
from tests import sglang_source as src

CAUSAL_LMS = sorted(arch for arch in FAMILIES if not arch.endswith("ForSequenceClassification"))
"""The architectures megarl's engines serve (a reward model's classifier runs on Megatron ranks, never an engine)."""


def test_released_weights_are_freed_unless_sglang_keeps_a_cpu_backup():
    """``enable_weights_cpu_backup: A[bool, "Save model weights ... to CPU memory during release..."] = False``;
    the model loads inside ``memory_saver_adapter.region(GPU_MEMORY_TYPE_WEIGHTS, enable_cpu_backup=...)`` whose
    backup is that flag; release pauses the region (its pages freed), resume maps fresh ones and restores what
    ``_export_static_state`` kept: ``model.named_buffers()``, never the parameters."""
    assert rules.server_flag_default(rules.EXEC_FIELDS, "enable_weights_cpu_backup") is False
    assert "enable_weights_cpu_backup" in rules.weights_region_cpu_backup()
    assert rules.released_tags_paused()["GPU_MEMORY_TYPE_WEIGHTS"] == "pause"
    assert rules.released_tags_paused("resume_memory_occupation")["GPU_MEMORY_TYPE_WEIGHTS"] == "resume"
    assert rules.static_state_kept() == {"named_buffers"}
    # The flag megarl's CPU engine takes for the backup is SGLang's own.
    assert src.launch_server_flags()["--enable-weights-cpu-backup"] == "enable_weights_cpu_backup"


def test_the_strict_engine_drops_released_weights_by_default():
    import inspect

    from megarl.engines.cpu_engine.hf_engine import HFEngine

    assert inspect.signature(HFEngine).parameters["weights_cpu_backup"].default is False


@pytest.mark.parametrize("arch", CAUSAL_LMS)
def test_every_tensor_sglangs_loader_takes_only_within_one_request_is_a_co_load_group(arch):
    """The loader of each architecture megarl serves, read from its ``load_weights`` and the methods it calls: a
    local dict filled in the loop over a request's tensors holds them until their partners arrive in that same call
    (DeepSeek's ``cached_a_proj``: ``"q_a_proj" in name or "kv_a_proj_with_mqa" in name`` -> written to
    ``fused_qkv_a_proj_with_mqa`` once both are there). Every tensor of megarl's family such a cache collects is in
    one of the family's co-load groups with exactly the tensors the cache pairs it with; no other family has one."""
    caches = rules.request_caches(arch)
    family = FAMILIES[arch]
    if arch != "DeepseekV3ForCausalLM":
        assert caches == [], caches
        assert all(rule.coload is None for rule in family.weights)
        return
    assert {c.variable: (sorted(c.keys), rules.fused_parameter(c)) for c in caches} == {
        "cached_a_proj": (["kv_a_proj_with_mqa", "q_a_proj"], "fused_qkv_a_proj_with_mqa"),
        "pending_indexer_wk": ([".indexer.weights_proj.", ".indexer.wk."], None)}  # DSA's indexer (V3.2): not ours
    config = known_config("DeepSeek-V3")
    names = [name for at in family.weight_instances(config) for name in at.hf_names]
    assert not [n for n in names if ".indexer." in n]
    groups = family.coload_groups(config)
    collected = [n for n in names if "q_a_proj" in n or "kv_a_proj_with_mqa" in n]
    assert len(collected) == 2 * config.num_hidden_layers
    assert sorted(n for g in groups for n in g) == sorted(collected)
    for group in groups:  # one layer's pair, each name the other's partner by SGLang's replace()
        q_a, kv_a = group
        assert kv_a == q_a.replace("q_a_proj", "kv_a_proj_with_mqa")


@pytest.mark.parametrize("arch", CAUSAL_LMS)
def test_which_models_sglang_can_read_weights_back_from(arch):
    """Only SGLang's Llama class (and Mistral's, derived from it) has ``get_weights_by_name``; Qwen2/3, their MoE and
    VL models, Mixtral, GLM-4.5 and DeepSeek-V3 have none: SGLang logs the AttributeError and the route answers an
    error. Each family declares which (``ModelFamily.engine_reads_back``), and megarl's CPU engine answers as SGLang."""
    assert FAMILIES[arch].engine_reads_back == rules.reads_weights_back(arch)


def test_sglang_reads_a_llama_back_as_its_tp_rank_0_holds_it():
    """``LlamaForCausalLM.get_weights_by_name``: a stacked tensor (its ``stacked_params_mapping``) is the fused
    parameter narrowed in heads of ``hidden_size // num_attention_heads`` (counts divided by ``tp_size``) or in
    ``intermediate_size // tp_size`` rows; ``o_proj``/``down_proj`` are all-gathered along dim 1; a tied
    ``lm_head.weight`` answers the embedding; every answer is ``float32`` rows cut at ``truncate_size``; nothing
    answered: "Get parameter by name failed". megarl's CPU engine (:mod:`megarl.engines.cpu_engine.read_back`)
    follows each of these."""
    from megarl.engines.cpu_engine import read_back

    llama = rules.llama_read_back()
    assert llama.stacked == read_back.STACKED
    assert llama.gathered == read_back.GATHERED and llama.gather_dim == 1
    assert llama.head_dim == "self.config.hidden_size // self.config.num_attention_heads"
    assert llama.tp_divided == ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    assert llama.tied_head_reads.startswith("self.model.embed_tokens.weight.")
    assert llama.rows.endswith(".to(torch.float32).numpy().tolist()[:truncate_size]")
    assert llama.tied_head_reads.endswith(".to(torch.float32).numpy().tolist()[:truncate_size]")
    assert rules.vocab_padding() == read_back.VOCAB_PADDING
    assert rules.read_back_failure() == read_back.FAILED


def test_megarls_engine_reads_back_a_llama_at_tp_2_and_refuses_the_rest(tmp_path):
    """The strict engine's answers on a tiny Llama at TP 2: TP rank 0's half of q/k/v/gate/up, whole o_proj,
    down_proj and norms, the embedding's first shard of its padded vocabulary (446 -> 448 rows -> 224; a stacked
    name's FP8 scale: ``test_strict_engine``); a Qwen2 refuses every read (its weights are seen only by megarl's own
    ``inspect_weight``, which tests and tools use and the weight sync never does)."""
    from megarl.engines.cpu_engine.hf_engine import HFEngine
    from megarl.engines.cpu_engine.read_back import ReadBackRefused
    from megarl.models.tiny import save_tiny

    engine = HFEngine(save_tiny(tmp_path / "llama", arch="llama", num_layers=1))
    held = {name: p.detach() for name, p in engine._params.items()}
    layer = "model.layers.0."
    for name, rows in (("self_attn.q_proj.weight", 32), ("self_attn.k_proj.weight", 16),
                       ("self_attn.v_proj.weight", 16), ("mlp.gate_proj.weight", 64), ("mlp.up_proj.weight", 64)):
        assert torch.tensor(engine.read_weight(layer + name, 1000, 2)).equal(held[layer + name][:rows]), name
        assert torch.tensor(engine.read_weight(layer + name, 1000, 1)).equal(held[layer + name]), name
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
        assert torch.tensor(engine.read_weight(layer + name, 1000, 2)).equal(held[layer + name]), name
    embed = held["model.embed_tokens.weight"]
    assert embed.shape[0] == 446 and engine.read_weight("lm_head.weight", 5, 1) == embed[:5].tolist()
    assert torch.tensor(engine.read_weight("model.embed_tokens.weight", 10_000, 2)).equal(embed[:224])
    assert len(engine.read_weight("model.embed_tokens.weight", 10_000, 4)) == 112
    with pytest.raises(ReadBackRefused, match=r"Get parameter by name failed: the model has no parameter 'x'"):
        engine.read_weight("x", 1, 1)
    qwen = HFEngine(save_tiny(tmp_path / "qwen2", num_layers=1))
    with pytest.raises(ReadBackRefused, match=r"Get parameter by name failed: SGLang's Qwen2ForCausalLM has no "
                                              r"get_weights_by_name"):
        qwen.read_weight("model.norm.weight", 1, 1)
    assert torch.equal(qwen.inspect_weight("model.norm.weight"), qwen._params["model.norm.weight"])


def test_sglang_requantizes_fp8_weights_to_power_of_two_scales_on_blackwell_only():
    """``DEEPGEMM_SCALE_UE8M0 = ENABLE_JIT_DEEPGEMM and (get_platform().is_sm100 or get_device_sm() in (120, 121))``:
    on those GPUs every block-FP8 weight is dequantized to bf16 and quantized again at power-of-two scales after it
    loads (megarl's CPU engine: ``--fp8-scale-ue8m0``), so a weight sync is verified by the values, not the bits."""
    flag = rules.module_assignment(rules.DEEPGEMM_CONFIG, "DEEPGEMM_SCALE_UE8M0")
    assert "is_sm100" in flag and "(120, 121)" in flag
    calls = rules.ue8m0_requantization()
    dequant = next(c for c in calls if c.startswith("block_quant_dequant("))
    assert "torch.bfloat16" in dequant
    assert calls.index(dequant) < next(i for i, c in enumerate(calls) if c.startswith("quant_weight_ue8m0("))
