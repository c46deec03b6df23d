"""megarl's CPU engine is as strict as SGLang where megarl relies on SGLang's behaviour, and the weight sync keeps
to those rules: released weights are gone, a loader that fuses tensors within one request drops a lone half, and
the exporter never splits such a pair across buckets. Each rule is pinned to sglang 0.5.23's source in
``test_sglang_rules.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from megarl.config import load_config
from megarl.convert.param_map import buckets
from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.engine import SamplingParams, update_weights
from megarl.models import family_for
from megarl.models.mla import FUSED_A_PROJ
from megarl.models.tiny import build_tiny_tokenizer
from megarl.plan.preflight import plan_run
from megarl.plan.weight_sync import _units
from tests.distributed import moe_jobs


@pytest.fixture(scope="module")
def deepseek():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(moe_jobs.tiny_moe_config("deepseek_v3"))


def test_deepseeks_down_projections_are_one_co_load_group_per_layer(deepseek):
    groups = family_for(deepseek.config).coload_groups(deepseek.config)
    assert groups == [(f"model.layers.{i}.self_attn.q_a_proj.weight",
                       f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight") for i in range(4)]
    assert family_for(moe_jobs.tiny_moe_config("qwen3_moe")).coload_groups(moe_jobs.tiny_moe_config("qwen3_moe")) == []


def test_a_lone_half_of_a_fused_pair_is_dropped_as_sglang_drops_it(deepseek):
    engine = HFEngine(copy.deepcopy(deepseek), build_tiny_tokenizer())
    q_a, kv_a = "model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    params = dict(engine.model.named_parameters())
    before = params[q_a].detach().clone()
    update_weights(engine, [[(q_a, torch.ones_like(before))], [(kv_a, torch.ones_like(params[kv_a]))]])
    assert torch.equal(params[q_a], before) and engine.dropped_alone == 2
    update_weights(engine, [[(q_a, torch.ones_like(before)), ("model.norm.weight", params["model.norm.weight"]),
                             (kv_a, torch.ones_like(params[kv_a]))]])
    assert torch.equal(params[q_a], torch.ones_like(before)) and torch.equal(params[kv_a], torch.ones_like(params[kv_a]))
    assert engine.dropped_alone == 2


def _layers_split(bucket_list) -> int:
    """Layers whose two MLA down projections are in different buckets."""
    where = {}
    for index, bucket in enumerate(bucket_list):
        for unit in bucket:
            if unit.rule.coload == FUSED_A_PROJ:
                where.setdefault(unit.layer, set()).add(index)
    return sum(len(indices) > 1 for indices in where.values())


@pytest.fixture(scope="module")
def deepseek_v3_units():
    plan = plan_run(load_config(["recipe=deepseek_v3_671b_grpo"]), check=False)
    return _units(plan.model, plan.placement.role("actor").dims)


@pytest.mark.parametrize("bucket_mb,transport", [(256, "tensor"), (512, "tensor"), (2048, "tensor"),
                                                 (1024, "distributed"), (64, "distributed")])
def test_deepseek_v3s_buckets_never_split_a_layers_down_projections(deepseek_v3_units, bucket_mb, transport):
    """At the DeepSeek-V3 recipe's layout (TP8 PP4 EP64), bucket boundaries used to fall between a layer's
    ``q_a_proj`` and ``kv_a_proj_with_mqa`` (54 of 61 layers at ``rollout.bucket_mb=256``; 1 at 2048, and at 1024
    with the distributed transport), which SGLang's loader fuses only within one request."""
    from megarl.sync import transport_class

    units = deepseek_v3_units
    budget = transport_class(transport).bucket_budget(bucket_mb << 20)
    grouped = buckets(units, lambda u: sum(torch.Size(s).numel() for s in u.hf_shapes) * 2, budget)
    assert [u for bucket in grouped for u in bucket] == units
    assert _layers_split(grouped) == 0
    assert sum(u.rule.coload == FUSED_A_PROJ for u in units) == 2 * 61


def test_released_deepseek_weights_synced_in_small_buckets_generate(deepseek):
    """Through the strict engine: after a release (weights garbage), a sync in buckets as small as one tensor leaves
    each layer's fused down projection garbage (SGLang drops each lone half); the exporter's spans, which keep a
    pair and what lies between its halves together, make every weight whole again."""
    from megarl.convert.param_map import Unit, coload_spans

    tokenizer = build_tiny_tokenizer()
    engine, reference = HFEngine(copy.deepcopy(deepseek), tokenizer), HFEngine(copy.deepcopy(deepseek), tokenizer)
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    expected = engine.generate([[1, 2, 3]], greedy, True)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    whole = reference._weight_tensors()  # transformers' tensors (experts fused), each once
    update_weights(engine, [[(name, tensor.detach().clone())] for name, tensor in whole.items()])
    with pytest.raises(RuntimeError, match="8 weight tensors hold released memory"):
        engine.generate([[1, 2, 3]], greedy)
    assert engine.dropped_alone == 8
    family = family_for(deepseek.config)
    units = [Unit(at.rule, at.layer, 0, 0, at.hf_names, (), expert=at.expert)
             for at in family.weight_instances(deepseek.config)]
    spans = coload_spans(units)
    assert [len(span) for span in spans if len(span) > 1] == [4] * 4  # q_a, q_a_layernorm, q_b, kv_a
    update_weights(engine, [[(name, reference._params[name].detach().clone()) for unit in span
                             for name in unit.hf_names] for span in spans])
    assert engine.generate([[1, 2, 3]], greedy, True) == expected


def test_an_adapters_only_sync_keeps_the_engines_weights():
    """The trainer's phase code (EngineMemory) releases the engines' weights only when the sync that follows rewrites
    them all: a LoRA run syncing its adapters alone keeps the base (SGLang would give it back as garbage)."""
    from megarl.controller.engine_memory import EngineMemory

    class Recorder:
        def __init__(self):
            self.calls = []

        async def release_memory_occupation(self, tags):
            self.calls.append(("release", tuple(tags)))

        async def resume_memory_occupation(self, tags):
            self.calls.append(("resume", tuple(tags)))

    for rewrites, released in ((True, ("kv_cache", "cuda_graph", "weights")), (False, ("kv_cache", "cuda_graph"))):
        engine = Recorder()
        memory = EngineMemory([engine], enabled=True, sync_rewrites_weights=rewrites)
        memory.release(weights=True)
        memory.resume(["weights"])
        memory.resume(["kv_cache", "cuda_graph"])
        assert engine.calls[0] == ("release", released)
        assert [c for c in engine.calls if c[0] == "resume"] == (
            [("resume", ("weights",)), ("resume", ("kv_cache", "cuda_graph"))] if rewrites
            else [("resume", ("kv_cache", "cuda_graph"))])


def test_the_lora_recipes_plan_keeps_the_engine_weights_through_training():
    """megarl-plan of llama3_1_70b_lora_grpo: the engine's 16.62 GiB of base weights stay in every training phase."""
    plan = plan_run(load_config(["recipe=llama3_1_70b_lora_grpo"]))
    gpu = plan.gpus[0]
    for phase in ("log-probs", "update actor"):
        assert gpu.parts[phase].get("engine_weights") == gpu.rows["engine_weights"] > 16 * 2**30, phase
    full = plan_run(load_config(["recipe=llama3_1_70b_lora_grpo", "actor_rollout_ref.rollout.lora_sync=merged"]))
    assert "engine_weights" not in full.gpus[0].parts["update actor"]


def test_the_distributed_transport_is_refused_for_colocated_engines_on_gpus():
    """Colocated, the sending rank and its engine's first TP rank share a GPU; NCCL refuses two ranks of one
    communicator on one device. gloo allows it, so CPU runs keep the combination (the CI tests use it)."""
    from megarl.config.loading import ConfigError
    from megarl.config.rollout import resolve_transport

    with pytest.raises(ValueError, match=r"weight_transport=distributed with the engines on the actor's GPUs.*"
                                         r"weight_transport=tensor or auto"):
        resolve_transport("distributed", colocated=True, device="cuda")
    assert resolve_transport("distributed", colocated=False, device="cuda") == "distributed"
    assert resolve_transport("distributed", colocated=True, device="cpu") == "distributed"
    assert resolve_transport("auto", colocated=True, device="cuda") == "tensor"
    with pytest.raises(ConfigError, match="rollout.weight_transport=distributed with the engines"):
        load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.rollout.weight_transport=distributed"])


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
def test_the_hybrid_cpu_optimizer_is_refused_with_megarls_optimizer_offload(role):
    from megarl.config.loading import ConfigError

    hybrid = [f"+{role}.optim.override_optimizer_config.optimizer_cpu_offload=true",
              f"+{role}.optim.override_optimizer_config.optimizer_offload_fraction=0.5"]
    base = ["recipe=qwen2_5_7b_grpo", "critic.enable=true", "algorithm.adv_estimator=gae"] if role == "critic" \
        else ["recipe=qwen2_5_7b_grpo"]
    with pytest.raises(ConfigError, match=rf"{role}.optim.override_optimizer_config.optimizer_cpu_offload=True with "
                                          rf"{role}.optimizer_offload=true.*set {role}.optimizer_offload=false"):
        load_config([*base, *hybrid, f"{role}.optimizer_offload=true"])
    load_config([*base, *hybrid, f"{role}.optimizer_offload=false"])


def test_the_engines_start_with_the_runs_context_length(tmp_path):
    """SGLang sizes its per-request token tables by ``--context-length`` (the model's whole context without it:
    131,072 tokens for Llama-3.1); the engines get ``rollout.max_model_len``, else ``P + R``, and a judge's its
    prompt and answer lengths. megarl's CPU engine takes the flag as SGLang does: a longer request is refused, and
    so is a context longer than the model's."""
    from megarl.controller.fleet import judge_engines, policy_engines
    from megarl.models.tiny import save_tiny
    from megarl.plan.engine_gpus import engine_gpus, planned_bundle_gpus, sglang_launch_command

    cfg = load_config(["recipe=qwen2_5_7b_grpo"])
    plan = plan_run(cfg, check=False)
    engines = policy_engines(cfg, plan.placement)
    assert engines.context_length == 1024 + 2048 == sum(cfg.rollout_widths())
    capped = load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.rollout.max_model_len=2500"])
    assert policy_engines(capped, plan.placement).context_length == 2500
    judged = load_config(["recipe=qwen2_5_7b_judge_grpo"])
    judge_plan = plan_run(judged, check=False).placement
    judge = judged.reward_model.judge.rollout
    assert judge_engines(judged, judge_plan).context_length == judge.prompt_length + judge.response_length
    model = save_tiny(tmp_path / "tiny", num_layers=1)  # max_position_embeddings 512
    tiny_judge = load_config(["recipe=qwen2_5_7b_judge_grpo", f"reward_model.judge.model.path={model}"])
    assert judge_engines(tiny_judge, judge_plan).context_length == 512  # never beyond the model's own
    gpus = engine_gpus(plan.placement.engines, planned_bundle_gpus(plan.placement))[0]
    argv = sglang_launch_command(gpus, rollout=cfg.actor_rollout_ref.rollout, model=cfg.actor_rollout_ref.model,
                                 port=30000, seed=0, context_length=engines.context_length).argv
    assert argv[argv.index("--context-length") + 1] == "3072"

    engine = HFEngine(model, context_length=64)
    assert engine.generate([[1] * 60], SamplingParams(max_new_tokens=4, temperature=0))
    with pytest.raises(ValueError, match="exceeds the engine's context of 64"):
        engine.generate([[1] * 60], SamplingParams(max_new_tokens=5, temperature=0))
    with pytest.raises(ValueError, match="context_length=513 must be in 1..512"):
        HFEngine(model, context_length=513)


def test_a_lora_actors_frozen_base_leaves_the_device_with_its_weights():
    """Megatron's DDP buffers hold only trainable parameters, so offloading them never moved a LoRA actor's base
    (the planner counted it offloaded: SGLang's KV pool came out ~3.7x smaller than planned on the 70B LoRA recipe).
    The frozen parameters move by themselves: copied to the host once, their device copy dropped at every offload
    after that (frozen values never change), the same objects back on the device at onload."""
    from megarl.workers.sharded_model import move_frozen

    base = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
    host: dict[int, torch.Tensor] = {}
    before = base.detach().clone()
    move_frozen([base], host, to_host=True)
    kept = host[id(base)]
    assert base.data.data_ptr() == kept.data_ptr() and torch.equal(base, before)
    base.data = base.data.clone()  # as onload leaves it: a device copy of its own (the GPU move needs CUDA)
    with torch.no_grad():
        base.mul_(1.0)
    move_frozen([base], host, to_host=True)  # no copy back: the kept host tensor again
    assert base.data.data_ptr() == kept.data_ptr() and torch.equal(base, before) and len(host) == 1


class _ReadBack:
    """An engine client reading ``engine``'s weights back as ``/get_weights_by_name`` does (HTTP 400 where SGLang's
    model answers nothing)."""

    name, url = "engine 0", "http://engine"

    def __init__(self, engine):
        self.engine = engine

    async def get_weights_by_name(self, name, truncate_size):
        from megarl.engines.client import EngineError
        from megarl.engines.cpu_engine.read_back import ReadBackRefused

        try:
            return self.engine.read_weight(name, truncate_size)
        except ReadBackRefused as refused:
            raise EngineError(str(refused), engine=self.name, url=self.url, route="/get_weights_by_name",
                              status=400) from None


def test_fp8_weights_are_verified_by_the_values_they_stand_for(tmp_path):
    """SGLang on Blackwell requantizes every loaded FP8 weight and scale to power-of-two scales (megarl's CPU engine:
    ``fp8_scale_ue8m0``), so neither the bits nor the scale read back are those sent: the verification compares the
    values the pairs stand for, within e4m3's rounding, never a scale by itself. A Llama (the family SGLang reads
    back) answers ``down_proj``'s scale but not ``up_proj``'s (stacked into ``gate_up_proj``, narrowed by weight
    rows): that pair is left unverified, the engine's other tensors still checked."""
    from megarl.convert.fp8 import write_fp8_checkpoint
    from megarl.engines.event_loop import run_sync
    from megarl.models.fp8 import quantize_block_fp8, scale_name
    from megarl.models.tiny import save_tiny
    from megarl.sync.base import expected_copy, verify_engine

    source = save_tiny(tmp_path / "bf16", arch="llama", num_layers=1, hidden_size=256, intermediate_size=512)
    write_fp8_checkpoint(source, tmp_path / "fp8")
    engine = HFEngine(tmp_path / "fp8", dtype=torch.bfloat16, fp8_scale_ue8m0=True)
    name, stacked = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"
    torch.manual_seed(0)
    q, scale = quantize_block_fp8(torch.randn(256, 512) * 0.02)
    q_up, scale_up = quantize_block_fp8(torch.randn(512, 256) * 0.02)
    update_weights(engine, [[(name, q), (scale_name(name), scale), (stacked, q_up), (scale_name(stacked), scale_up)]])
    held = engine.fp8.scales[name]
    assert not torch.equal(held, scale) and torch.equal(held, torch.exp2(torch.log2(held).round()))  # powers of two
    assert not torch.equal(engine.fp8.weights[name].float(), q.float())
    expected = {name: expected_copy(q), scale_name(name): expected_copy(scale),
                "model.norm.weight": expected_copy(engine._params["model.norm.weight"])}
    assert run_sync(verify_engine(_ReadBack(engine), expected)) == []
    expected.update({stacked: expected_copy(q_up), scale_name(stacked): expected_copy(scale_up)})
    assert run_sync(verify_engine(_ReadBack(engine), expected)) == [stacked, scale_name(stacked)]
    wrong = {name: expected_copy(quantize_block_fp8(torch.randn(256, 512) * 0.02)[0]),
             scale_name(name): expected_copy(scale)}
    with pytest.raises(RuntimeError, match="does not hold the trainer's weights"):
        run_sync(verify_engine(_ReadBack(engine), wrong))


def _reference_quantize(weight):
    """Block FP8 of the whole weight at once (the quantizer as it was: every transient the weight's size)."""
    from megarl.models.fp8 import FP8_DTYPE, FP8_MAX, _blocks, expand_scales

    w = weight.float()
    scale = (_blocks(w).abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / expand_scales(scale, tuple(w.shape))).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def test_fp8_quantization_works_one_row_of_blocks_at_a_time():
    """Quantizing DeepSeek-V3's dense gate_proj whole held ~12 bytes per element at once (1.5 GiB) beside a sync
    planned at 77.7 of 80 GiB; one row of blocks (128 rows) at a time gives the same bits, and no transient is larger
    than that row; the planner counts it on every quantizing GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megarl.convert.export import Bucket
    from megarl.convert.fp8 import quantize_bucket
    from megarl.models.fp8 import QUANTIZE_BYTES_PER_ELEMENT, quantize_block_fp8
    from megarl.plan.weight_sync import _WeightSync

    torch.manual_seed(0)
    weight = torch.randn(1000, 300, dtype=torch.bfloat16)  # partial blocks in both dimensions
    for got, want in zip(quantize_block_fp8(weight), _reference_quantize(weight)):
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got,
                           want.view(torch.uint8) if want.dtype != torch.float32 else want)

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float32, torch.bool) \
                        and tensor._base is None:
                    Largest.largest = max(Largest.largest, tensor.numel())
            return out

    bucket = Bucket.pack([("w", weight), ("norm", torch.ones(300, dtype=torch.bfloat16))], shared_memory=False)
    with Largest():
        quantize_bucket(bucket, frozenset({"w"}))
    assert 0 < Largest.largest <= 128 * 384  # one row of (padded) blocks, never the weight's 1000 x 300

    cfg = load_config(["recipe=deepseek_v3_671b_grpo"])
    plan = plan_run(cfg, check=False)
    sync = _WeightSync(cfg, plan.model, plan.placement)
    assert sync._quantize_transient() == QUANTIZE_BYTES_PER_ELEMENT * 128 * 18432  # the dense down_proj's K
    memory = sync.memory()
    host = next(iter(sync.hosts))
    assert memory.actor[host] == (sync._actor_buffers(sync._per_stage()[0])[host] + 2 * max(sync.buffers.sizes)
                                  + sync._quantize_transient())


def test_a_local_spec_built_on_a_machine_with_te_gets_the_local_specs_config(monkeypatch):
    """LoRA builds Megatron's local spec even where TransformerEngine is importable; its config must then not ask for
    TE-only kernels (masked_softmax_fusion imports scaled_masked_softmax_cuda, which no package ships), nor grouped
    GEMM. The choice is one function (ModelFamily.uses_te) for the spec and the config."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.config.parallel import ParallelDims
    from megarl.models import family as family_module

    monkeypatch.setattr(family_module, "_te_importable", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object(), raising=False)  # TE's (RoPE fusion)
    config = moe_jobs.tiny_moe_config("qwen3_moe")
    family = family_for(config)
    assert family.uses_te() and not family.uses_te(False)
    with_te = family.transformer_config(config, ParallelDims(), perform_initialization=False)
    local = family.transformer_config(config, ParallelDims(), use_te=False, perform_initialization=False)
    assert with_te.masked_softmax_fusion and with_te.moe_grouped_gemm
    assert not local.masked_softmax_fusion and not local.moe_grouped_gemm
    assert with_te.apply_rope_fusion and not local.apply_rope_fusion


def test_no_production_module_reads_an_engine_by_megarls_own_route():
    """The CPU engine's ``/megarl/inspect_weight`` shows any model's weights whole, which SGLang cannot: tests and
    tools may look with it, but the weight sync and everything else under ``megarl/`` outside the CPU engine reads
    back only as SGLang lets it (``/get_weights_by_name``), or CI would verify what a cluster cannot."""
    from pathlib import Path

    import megarl

    root = Path(megarl.__file__).parent
    users = [str(path.relative_to(root)) for path in root.rglob("*.py")
             if ("inspect_weight" in path.read_text() or "INSPECT_ROUTE" in path.read_text())
             and path.parent != root / "engines" / "cpu_engine"]
    assert users == []
