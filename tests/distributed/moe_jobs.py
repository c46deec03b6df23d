"""Rank-side jobs of the mixture-of-experts tests (imported by spawned ranks), and tiny HF MoE checkpoints."""

from __future__ import annotations

import torch

from tests.distributed.convert_jobs import _megatron_logits

VOCAB = 250


def tiny_moe_config(name: str):
    """Tiny MoE configs with the features each family must get right (random weights, saved with save_pretrained)."""
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        MiniMaxM2Config,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)
    if name == "qwen3_moe":  # renormalised top-k, one dense layer
        return Qwen3MoeConfig(**common, head_dim=12, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                              architectures=["Qwen3MoeForCausalLM"])
    if name == "qwen3_moe_softmax":  # top-k weights of the full softmax (not renormalised)
        return Qwen3MoeConfig(**common, head_dim=12, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=False, architectures=["Qwen3MoeForCausalLM"])
    if name == "qwen2_moe":  # a gated shared expert beside the routed ones, plain top-k weights, one dense layer
        return Qwen2MoeConfig(**common, intermediate_size=40, moe_intermediate_size=16,
                              shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=False, mlp_only_layers=[0], architectures=["Qwen2MoeForCausalLM"])
    if name == "glm4_moe":  # sigmoid routing with a bias, scaled weights, shared experts, partial rotary, q/k norms,
        # 1 dense layer
        return Glm4MoeConfig(**common, head_dim=16, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=4,
                             n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                             routed_scaling_factor=2.5, n_group=1, topk_group=1, attention_bias=True,
                             use_qk_norm=True,  # GLM-4.5's per-head q/k norms (GLM-4.5-Air has none)
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5},
                             architectures=["Glm4MoeForCausalLM"])
    if name == "deepseek_v3":  # multi-latent attention with YaRN, group-limited sigmoid routing with a bias
        return DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=4,
                                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
                                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=16,
                                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                                num_nextn_predict_layers=1, architectures=["DeepseekV3ForCausalLM"])
    if name == "kimi_k2":  # DeepSeek-V3's architecture with Kimi-K2's choices: one group, one dense layer, no MTP layer
        return DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16,
                                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
                                q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                                 "original_max_position_embeddings": 8, "beta_fast": 1.0,
                                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                                num_nextn_predict_layers=0, architectures=["DeepseekV3ForCausalLM"])
    if name == "minimax_m2":  # q/k norms over all heads, partial rotary, sigmoid routing with the block's bias; the
        # published config's keys that SGLang reads (use_qk_norm, use_routing_bias, scoring_func, rotary_dim)
        return MiniMaxM2Config(**common, head_dim=12, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                               rotary_dim=6, use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True,
                               scoring_func="sigmoid", bos_token_id=1, eos_token_id=2, num_mtp_modules=1,
                               architectures=["MiniMaxM2ForCausalLM"])
    if name == "mixtral":
        return MixtralConfig(**common, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                             architectures=["MixtralForCausalLM"])
    raise ValueError(name)


MOE_CONFIGS = ("qwen3_moe", "qwen3_moe_softmax", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3", "kimi_k2",
               "minimax_m2")
FAMILY = {"qwen3_moe": "qwen3_moe", "qwen3_moe_softmax": "qwen3_moe", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe",
          "glm4_moe": "glm4_moe", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "minimax_m2": "minimax_m2"}
SPARSE_LAYERS = {"qwen3_moe": 3, "qwen3_moe_softmax": 4, "mixtral": 4, "qwen2_moe": 3, "glm4_moe": 3, "deepseek_v3": 3,
                 "kimi_k2": 3, "minimax_m2": 4}
"""Each config's family and sparse layers (of 4)."""


def save_tiny_moe(name: str, directory, seed: int = 0):
    """A random HF MoE model (norms randomised too; router weights scaled so routing is decisive) saved as the hub
    holds it (one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(name)).float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.5 + 1.0)
            elif param_name.endswith("gate.weight"):
                param.copy_(torch.randn_like(param))
        for buffer_name, buffer in model.named_buffers():  # a sigmoid router's bias: it must change the routing
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    if getattr(model.config, "num_nextn_predict_layers", 0) or getattr(model.config, "num_mtp_modules", 0):
        # the hub's DeepSeek-V3 (MiniMax-M2) holds MTP layers after the model's
        from safetensors.torch import load_file, save_file

        path = f"{directory}/model.safetensors"
        tensors, mtp = load_file(path), f"model.layers.{model.config.num_hidden_layers}."
        hidden = model.config.hidden_size
        tensors.update({mtp + "enorm.weight": torch.ones(hidden), mtp + "hnorm.weight": torch.ones(hidden),
                        mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden),
                        mtp + "shared_head.norm.weight": torch.ones(hidden)})
        save_file(tensors, path, metadata={"format": "pt"})
    if name == "kimi_k2":  # as moonshotai/Kimi-K2-Instruct's config.json: a model_type of its own, its config code
        kimi_config(directory)
    return model


def kimi_config(directory) -> None:
    """Rewrite ``directory``'s DeepSeek-V3 ``config.json`` as Kimi-K2's checkpoints hold it: ``model_type: kimi_k2``
    (unknown to transformers) and an ``auto_map`` to the repository's own DeepSeek-V3 config and model code."""
    import json
    from pathlib import Path

    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModel": "modeling_deepseek.DeepseekV3Model",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    path.write_text(json.dumps(config, indent=2))


def hf_moe_logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def ep1_job(cases: dict) -> dict:
    """One rank: per config, the Megatron model's parameter count, its logits against HF's, and the streaming
    export against the saved checkpoint (names and bits)."""
    from safetensors.torch import load_file

    from megarl.convert import WeightExporter, load_hf_into
    from megarl.models import build_model_chunks, family_for
    from megarl.models.hf_config import load_hf_config
    from megarl.parallel import ParallelDims, init_parallel

    out = {}
    groups = init_parallel(ParallelDims(tp=1, pp=1))
    for name, (hf_dir, input_ids, expected, hf_params) in cases.items():
        cfg = load_hf_config(hf_dir)  # as megarl reads the directory (Kimi-K2's model_type included)
        family = family_for(cfg)
        chunks = build_model_chunks(family, cfg, groups.dims)
        padded = family.padded_vocab_size(cfg, tp=1)
        params = sum(p.numel() for c in chunks for p in c.parameters()) - 2 * (padded - VOCAB) * cfg.hidden_size
        load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
        logits = _megatron_logits(chunks, groups, input_ids)
        original = load_file(f"{hf_dir}/model.safetensors")
        exported = {n: t.clone() for b in WeightExporter(chunks, family, cfg, groups).iter_full(1 << 16) for n, t in b}
        skipped = family.skipped_tensors(cfg, original)
        out[name] = {"family": family.name, "params": params, "hf_params": hf_params,
                     "logits_diff": (logits - expected).abs().max().item(), "skipped": len(skipped),
                     "names_equal": sorted(exported) == sorted(set(original) - set(skipped)),
                     "bit_exact": all(torch.equal(exported[n], original[n]) for n in original if n in exported)}
    return out


EP_LAYOUTS = {  # name -> ParallelDims kwargs, on 4 ranks
    "ep2": dict(ep=2),
    "ep4": dict(ep=4),
    "ep2_pp2": dict(ep=2, pp=2),
    "tp2_ep2_sp": dict(tp=2, ep=2, sequence_parallel=True),
    "tp2_ep2_etp1_sp": dict(tp=2, ep=2, etp=1, sequence_parallel=True),
}


def _export_checks(chunks, family, cfg, groups, original) -> dict:
    """The streaming export at this layout: every rank receives every HF tensor (experts from the ranks holding
    them), bit-exact; and as the broadcast transport asks (TP rank 0 of each stage, its stage's tensors only)."""
    from megarl.convert import WeightExporter

    exporter = WeightExporter(chunks, family, cfg, groups)
    full = {n: t.clone() for b in exporter.iter_full(1 << 14) for n, t in b}
    wanted = set(original) - set(family.skipped_tensors(cfg, original))  # (DeepSeek-V3's MTP layer: not exported)
    out = {"export_names_equal": sorted(full) == sorted(wanted),
           "export_bit_exact": all(torch.equal(full[n], original[n]) for n in full)}
    stage = {}
    for bucket in exporter.iter_buckets(1 << 14, to_pp_ranks=(), tp_ranks=(0,)):
        stage.update((n, t.clone()) for n, t in bucket.named())
    out["stage_export"] = (sorted(stage), all(torch.equal(stage[n], original[n]) for n in stage))
    return out


class _TeGroupedNames:
    """A model chunk whose experts' weights carry the names TransformerEngine's grouped GEMM gives them
    (``TEGroupedMLP``'s ``GroupedLinear``: ``experts.linear_fc1.weight<local expert>``); the same parameters."""

    def __init__(self, chunk) -> None:
        self.chunk, self.config, self.vp_stage = chunk, chunk.config, chunk.vp_stage

    def named_parameters(self):
        import re

        for name, param in self.chunk.named_parameters():
            yield re.sub(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".experts.\2.weight\1", name), param

    def named_modules(self):
        return self.chunk.named_modules()

    def named_buffers(self):
        return self.chunk.named_buffers()


def _te_grouped_checks(chunks, family, cfg, groups, hf_dir: str, original) -> dict:
    """The experts under TE's grouped-GEMM names: the parameter map finds each at its global expert (this rank's
    expert-parallel offset included) as under the local spec's names; loading through those names gives the same
    weights, and the export is bit-exact."""
    from megarl.convert import load_hf_into
    from megarl.convert.param_map import local_parameters

    grouped_chunks = [_TeGroupedNames(chunk) for chunk in chunks]
    rules = family.weight_rules(cfg)
    local, grouped = local_parameters(chunks, rules), local_parameters(grouped_chunks, rules)
    loaded = {name: param.detach().clone() for name, param in local.items()}
    with torch.no_grad():
        for param in local.values():
            param.zero_()
    load_hf_into(grouped_chunks, hf_dir, family, groups, hf_config=cfg)
    export = _export_checks(grouped_chunks, family, cfg, groups, original)
    return {"renamed": sum(".experts.linear_fc" in n for c in grouped_chunks for n, _ in c.named_parameters()),
            "same_params": list(grouped) == list(local) and all(grouped[n] is local[n] for n in local),
            "reloaded": all(torch.equal(param, loaded[name]) for name, param in local.items()),
            "export_names_equal": export["export_names_equal"], "export_bit_exact": export["export_bit_exact"]}


def _hf_space(chunks, family, cfg, groups, tensor_of) -> dict[str, list]:
    """This rank's view of ``tensor_of(param)`` for every parameter, as (HF name, slice, tensor) in HF layout: the
    pieces each HF tensor is made of at this layout (expert tensors split by expert-TP, the rest by TP)."""
    from megarl.convert.layout import ModelSizes, hf_slices, unfuse
    from megarl.convert.param_map import local_parameters

    sizes = ModelSizes.from_config(family, cfg, groups.dims.tp)
    index = {at.megatron_name: at for at in family.weight_instances(cfg)}
    shapes = {n: s for n, s in zip(*_hf_shapes(family, cfg))}
    out = []
    for name, param in local_parameters(chunks, family.weight_rules(cfg)).items():
        if not isinstance(param, torch.nn.Parameter):  # a router's expert bias (a buffer): no gradient, not stepped
            continue
        at = index[name]
        rank, size = (groups.etp_rank, groups.dims.expert_tp) if at.rule.per_expert else (groups.tp_rank, groups.dims.tp)
        wheres = hf_slices(at.rule, [shapes[n] for n in at.hf_names], sizes, rank, size)
        for hf_name, where, part in zip(at.hf_names, wheres, unfuse(at.rule, tensor_of(param), sizes, rank, size)):
            out.append((hf_name, where, part.detach().clone()))
    return out


def _hf_shapes(family, cfg):
    from megarl.convert.hf_io import expected_shapes

    shapes = expected_shapes(cfg)
    names = [n for at in family.weight_instances(cfg) for n in at.hf_names]
    return names, [shapes[n] for n in names]


EP_CHECKS = {"qwen3_moe": ["ep2", "ep2_pp2", "tp2_ep2_sp", "tp2_ep2_etp1_sp"], "mixtral": ["ep2", "tp2_ep2_sp"],
             "qwen2_moe": ["ep2", "tp2_ep2_sp"], "glm4_moe": ["ep2", "tp2_ep2_sp"],
             "deepseek_v3": ["ep2", "tp2_ep2_sp"], "minimax_m2": ["tp2_ep2_sp"]}
"""The layouts each config is checked at (Qwen3-MoE, with a dense layer among sparse ones, at all but EP4: the same
code as EP2 with a larger group, measured equal; left out for the suite's time)."""


def ep_job(ep1_cases: dict, cases: dict, root: str, sync_cases: list, routing_case: dict) -> dict:
    """Everything on 4 ranks in one job: the EP=1 checks (:func:`ep1_job`, on every rank); per config and layout of
    :data:`EP_CHECKS` (each rank reading only its experts from the HF checkpoint) the logits against HF's, the
    experts this rank holds, the export, and the gradients (Megatron DDP) and one step of the distributed optimizer
    against the same at EP=1 (DP=4), compared piece by piece in HF layout; a run at EP=2 saved after step 2 and
    resumed (:func:`_resume`); the weight transports at TP2×EP2 (:func:`_sync`); routing replay (:func:`_routing`)."""
    out = {"ep1": ep1_job(ep1_cases)}
    for name, case in cases.items():
        layouts = {layout: EP_LAYOUTS[layout] for layout in EP_CHECKS[name]}
        out.update({f"{name}/{layout}": result for layout, result in _ep_checks(*case, name, layouts).items()})
    out["resume"] = _resume(cases["qwen3_moe"][0], root)
    out["sync"] = _sync(cases["qwen3_moe"][0], sync_cases)
    out["routing"] = _routing(cases["qwen3_moe"][0], routing_case)
    out["expert_bias"] = _expert_bias(cases["glm4_moe"][0], root)
    out["glm4_dir"] = cases["glm4_moe"][0]
    from safetensors import safe_open

    from megarl.models import family_for

    out["names"] = {}
    for name, case in cases.items():
        with safe_open(f"{case[0]}/model.safetensors", "pt") as f:
            keys = list(f.keys())
            skipped = set(family_for(tiny_moe_config(name)).skipped_tensors(tiny_moe_config(name), keys))
            out["names"][name] = sorted(set(keys) - skipped)
    return out


def _resume(hf_dir: str, root: str) -> dict:
    """Steps 1..4 of training at EP=2 (DP=4: experts' optimizer state sharded over expert-data-parallel pairs),
    a checkpoint after step 2, and a fresh model resumed from it retaking steps 3 and 4: loss, grad norm, LR
    and every parameter equal bit for bit."""
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers import model_checkpoint as ckpt
    from megarl.workers.sharded_model import ShardedModel
    from tests.distributed.checkpoint_jobs import OPTIM, _params, _step

    dims = ParallelDims(ep=2)
    sharded = ShardedModel(hf_dir, dims, optim=OptimConfig(**OPTIM))
    run = {}
    for step in range(1, 5):
        run[step] = _step(sharded, step, VOCAB)
        if step == 2:
            ckpt.save_model(sharded, f"{root}/step2")
    params = _params(sharded)
    fresh = ShardedModel(hf_dir, dims, optim=OptimConfig(**OPTIM))
    ckpt.load_model(fresh, f"{root}/step2")
    resumed = {step: _step(fresh, step, VOCAB) for step in (3, 4)}
    again = _params(fresh)
    return {"run": run, "resumed": resumed, "params_equal": all(torch.equal(params[n], again[n]) for n in again),
            "experts": sum(".local_experts." in n for n in again)}


BIAS_RATE = 0.01


def _biases(sharded) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for c in sharded.module_chunks for n, b in c.named_buffers()
            if n.endswith("router.expert_bias")}


def hf_routed_counts(hf_dir: str, batch: dict) -> list[torch.Tensor]:
    """Per sparse layer, the real tokens of ``batch`` HF transformers routes to each expert (its gate's top-k)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    real = batch["attention_mask"].reshape(-1).bool()
    counts = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, output: counts.append(torch.zeros(module.weight.shape[0]).index_add_(
            0, output[2][real].reshape(-1), torch.ones(output[2][real].numel()))))
        for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    mask = batch["attention_mask"]
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for hook in hooks:
        hook.remove()
    return counts


def _bf16_export_with_fp32_bias(sharded) -> dict:
    """A bf16 export (what an engine in bf16 receives) of a model whose routers keep an fp32 expert bias: the biases
    travel in fp32, bit for bit, first in their bucket; the other tensors in bf16; SGLang's own receive layout
    (``FlattenedTensorBucket.empty`` of the bucket's names, dtypes and shapes) puts every tensor at the byte
    offset it has in the bucket, and its ``reconstruct_tensors`` reads the bucket's values back."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    layer_of = {f"model.layers.{n.split('.layers.')[1].split('.')[0]}.mlp.gate.e_score_correction_bias": b
                for n, b in _biases(sharded).items()}
    report = {"biases_fp32_exact": 0, "bf16_tensors": 0, "layout_matches": True, "reconstructed": True,
              "bias_first": True, "others_exact": True}
    exporter = sharded.exporter(torch.bfloat16)
    for bucket in exporter.iter_buckets(1 << 14):
        names, tensors = bucket.names, bucket.tensors
        flat = bucket.flat.view(torch.uint8)
        offsets = [t.data_ptr() - bucket.flat.data_ptr() for t in tensors]
        received = FlattenedTensorBucket.empty(names, [str(t.dtype).removeprefix("torch.") for t in tensors],
                                               [list(t.shape) for t in tensors], "cpu")
        report["layout_matches"] &= [m.start_idx for m in received.get_metadata()] == offsets
        again = FlattenedTensorBucket(flattened_tensor=flat.clone(), metadata=received.get_metadata())
        report["reconstructed"] &= all(torch.equal(a, t) for (_, a), t in zip(again.reconstruct_tensors(), tensors))
        kinds = [n in layer_of for n in names]
        report["bias_first"] &= kinds == sorted(kinds, reverse=True)
        for name, tensor in zip(names, tensors):
            if name in layer_of:
                report["biases_fp32_exact"] += tensor.dtype == torch.float32 and torch.equal(tensor, layer_of[name])
            else:
                report["bf16_tensors"] += tensor.dtype == torch.bfloat16
    report["biases"] = len(layer_of)
    exporter.release_buffers()
    return report


def _expert_bias(hf_dir: str, root: str) -> dict:
    """Aux-loss-free balancing at EP=2 (DP=4) on the tiny GLM-4.5 MoE: each router's bias after one step
    (``moe_router_bias_update_rate`` = :data:`BIAS_RATE`), packed and padded; then a checkpoint after step 1 and a
    fresh model resumed from it: the bias loaded, and step 2's bias and weights equal the uninterrupted run's."""
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers import model_checkpoint as ckpt
    from megarl.workers.sharded_model import ShardedModel
    from tests.distributed.checkpoint_jobs import OPTIM, _params, _step

    dims, out = ParallelDims(ep=2), {}
    for packed in (True, False):
        sharded = ShardedModel(hf_dir, dims, optim=OptimConfig(**OPTIM), packed=packed,
                               moe_router_bias_update_rate=BIAS_RATE)
        before = _biases(sharded)
        _step(sharded, 1, VOCAB)
        after = _biases(sharded)
        out[f"packed={packed}"] = {"before": before, "after": after}
        if packed:
            ckpt.save_model(sharded, f"{root}/bias_step1")
            _step(sharded, 2, VOCAB)
            step2, params = _biases(sharded), _params(sharded)
            fresh = ShardedModel(hf_dir, dims, optim=OptimConfig(**OPTIM), moe_router_bias_update_rate=BIAS_RATE)
            ckpt.load_model(fresh, f"{root}/bias_step1")
            loaded = _biases(fresh)
            _step(fresh, 2, VOCAB)
            again = _params(fresh)
            out["bf16_export"] = _bf16_export_with_fp32_bias(fresh)
            out["resume"] = {"loaded_equal": all(torch.equal(loaded[n], after[n]) for n in after),
                             "step2_equal": all(torch.equal(_biases(fresh)[n], step2[n]) for n in step2),
                             "params_equal": all(torch.equal(params[n], again[n]) for n in again),
                             "moved_in_step2": any(not torch.equal(step2[n], after[n]) for n in after)}
    return out


def _ep_checks(hf_dir: str, input_ids, expected, name: str, layouts: dict) -> dict:
    from safetensors.torch import load_file

    from megarl.convert import load_hf_into
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, forward_backward, init_parallel
    from tests.distributed import parity_jobs as pj

    cfg = tiny_moe_config(name)
    family = family_for(cfg)
    mbs = pj.micro_batches()
    original = load_file(f"{hf_dir}/model.safetensors")

    def run(kwargs):
        groups = init_parallel(ParallelDims(**kwargs), seed=99)
        mine = mbs[groups.dp_rank :: groups.dims.dp]
        chunks = build_model_chunks(family, cfg, groups.dims)
        load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
        logits = _megatron_logits(chunks, groups, input_ids)
        held = {"logits_diff": None if logits is None else (logits - expected).abs().max().item(),
                "ep_rank": groups.ep_rank,
                "local_expert_params": sum(".local_experts." in n for c in chunks for n, _ in c.named_parameters()),
                **_export_checks(chunks, family, cfg, groups, original)}
        held["te_grouped"] = _te_grouped_checks(chunks, family, cfg, groups, hf_dir, original)
        forward_backward(pj._wrap_ddp(chunks), mine, loss_fn=pj.loss_fn, temperature=pj.TEMPERATURE, vocab_size=VOCAB,
                         groups=groups)
        grads = _hf_space(chunks, family, cfg, groups, lambda p: p.main_grad)
        chunks = build_model_chunks(family, cfg, groups.dims)
        load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
        ddp = pj._wrap_ddp(chunks, distributed_optimizer=True)
        forward_backward(ddp, mine, loss_fn=pj.loss_fn, temperature=pj.TEMPERATURE, vocab_size=VOCAB, groups=groups)
        ok, grad_norm = _optimizer_step(ddp)
        weights = _hf_space(chunks, family, cfg, groups, lambda p: p)
        return grads, weights, ok, grad_norm, held

    ref_grads, ref_weights, _, ref_norm, _ = run({})
    full_grads = {n: t for n, _, t in ref_grads}  # EP=1, TP=1: every piece is the whole tensor
    full_weights = {n: t for n, _, t in ref_weights}
    out = {}
    for layout, kwargs in layouts.items():
        grads, weights, ok, grad_norm, held = run(kwargs)
        out[layout] = {**held,
            "grad_diff": max((t - where.apply(full_grads[n])).abs().max().item() for n, where, t in grads),
            "grad_worst": max(((t - where.apply(full_grads[n])).abs().max().item(), n) for n, where, t in grads)[1],
            "step_diff": max((t - where.apply(full_weights[n])).abs().max().item() for n, where, t in weights),
            "pieces": len(grads), "step_ok": ok, "grad_norm": grad_norm, "ref_grad_norm": ref_norm}
    return out


def _optimizer_step(ddp_chunks) -> tuple[bool, float]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from tests.distributed import parity_jobs as pj

    config = OptimizerConfig(optimizer="adam", lr=pj.LR, weight_decay=pj.WEIGHT_DECAY, adam_beta1=pj.BETAS[0],
                             adam_beta2=pj.BETAS[1], adam_eps=pj.EPS, clip_grad=pj.CLIP_GRAD,
                             use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config, ddp_chunks)
    OptimizerParamScheduler(optimizer, init_lr=pj.LR, max_lr=pj.LR, min_lr=pj.LR, lr_warmup_steps=0, lr_decay_steps=1,
                            lr_decay_style="constant", start_wd=pj.WEIGHT_DECAY, end_wd=pj.WEIGHT_DECAY,
                            wd_incr_steps=1, wd_incr_style="constant")
    success, grad_norm, _ = optimizer.step()
    return bool(success), float(grad_norm)


def _sync(hf_dir: str, cases: list) -> dict:
    """TP=2 × EP=2 (SP) on 4 ranks, a tiny Qwen3-MoE: per ``(transport, engines)`` case, change every weight, sync
    into the CPU engine servers with every tensor asked to be verified (SGLang's Qwen3-MoE cannot read back: the
    transport reports the engine unverified), read every tensor whole from the engines on rank 0 by the checkpoint's
    per-expert names (``/megarl/inspect_weight``), and return this rank's statistics."""
    import torch.distributed as dist

    from megarl.convert import WeightExporter, load_hf_into
    from megarl.engines import event_loop
    from megarl.engines.client import EngineAddress, gather_sync
    from megarl.engines.cpu_engine.read_back import inspect_weight
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, init_parallel
    from megarl.sync import make_transport
    from tests.distributed.sync_jobs import perturb

    cfg = tiny_moe_config("qwen3_moe")
    family = family_for(cfg)
    groups = init_parallel(ParallelDims(tp=2, ep=2, sequence_parallel=True))
    chunks = build_model_chunks(family, cfg, groups.dims)
    load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
    exporter = WeightExporter(chunks, family, cfg, groups, dtype=torch.float32)
    out = {"rank": dist.get_rank(), "ep_rank": groups.ep_rank, "cases": []}
    for index, (name, engine_fields) in enumerate(cases):
        perturb(chunks, index)
        names = [n for u in exporter.units for n in u.hf_names]
        truth = {n: t.clone() for bucket in exporter.iter_full(1 << 20) for n, t in bucket}
        engines = [EngineAddress(**fields) for fields in engine_fields]
        transport = make_transport(name, groups, engines, device="cpu")
        stats = transport.sync(exporter, bucket_bytes=1 << 16, version=f"v{index}", verify_names=names)
        transport.close()
        case = {"stats": stats, "names": len(names)}
        dist.barrier()
        if dist.get_rank() == 0:  # every tensor whole, as held (SGLang's Qwen3-MoE answers no read-back)
            with event_loop.holding():
                case["differ"] = [(e.name, n) for e in engines for n, t in truth.items()
                                  if not torch.equal(gather_sync([inspect_weight(e.url, n)])[0].float(), t)]
            case["read"] = len(truth) * len(engines)
        out["cases"].append(case)
        dist.barrier()
    return out


# ------------------------------------------------------------------------------------------- routing replay

ROUTING_LAYOUTS = {  # name -> (ParallelDims kwargs, packed), on 4 ranks
    "ep2": (dict(ep=2), True),
    "tp2_ep2_sp": (dict(tp=2, ep=2, sequence_parallel=True), True),
    "ep2_pp2_padded": (dict(ep=2, pp=2), False),
}
ROUTING_P, ROUTING_R = 5, 6


def forced_routing_logprobs(model, ids: list[int], routed) -> torch.Tensor:
    """HF log-probs of each next token of ``ids`` with every sparse layer's router forced to ``routed``
    ``[len(ids), layers, top_k]`` (weights: the router's own softmax at those experts, renormalised as the family
    does): what Megatron with routing replay must compute."""
    from megarl.engines.cpu_engine.model_facts import routers as _routers

    originals = []
    for layer, gate in _routers(model):
        def forced(hidden, gate=gate, layer=layer):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            indices = torch.as_tensor(routed[:, layer], dtype=torch.long)
            values = probs.gather(1, indices)
            if getattr(gate, "norm_topk_prob", True):
                values = values / values.sum(dim=-1, keepdim=True)
            return logits, values.to(logits.dtype), indices
        originals.append((gate, gate.forward))
        gate.forward = forced
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    finally:
        for gate, forward in originals:
            gate.forward = forward
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _routing(hf_dir: str, case: dict) -> dict:
    """Per layout of :data:`ROUTING_LAYOUTS`: (a) measuring against the routing HF computed for the same weights
    finds no difference (the token order of every rank's routers, with SP, CP-free packing and PP, is right); (b)
    replaying perturbed routing uses exactly it (measured 0), though the routers would choose otherwise, and gives
    HF's log-probs under the same forced routing; (c) at EP2×PP2 (1F1B over 2 micro-batches per replica: both
    forwards run before the first backward) a replayed training step with full recomputation equals one without
    (the backward pass pops each micro-batch's own targets), and differs from one without replay."""
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel
    from tests.distributed.checkpoint_jobs import OPTIM

    batch = case["batch"]
    out = {}
    for layout, (kwargs, packed) in ROUTING_LAYOUTS.items():
        model = ShardedModel(hf_dir, ParallelDims(**kwargs), packed=packed, router_replay=True)
        mine = model.groups.dp_rank
        rows = slice(mine * 4 // model.groups.dims.dp, (mine + 1) * 4 // model.groups.dims.dp)
        micro = [{k: v[rows][i:i + 1] for k, v in batch.items()} for i in range(rows.stop - rows.start)]
        result = {}
        for kind in ("true", "perturbed"):
            for mb, routed in zip(micro, case[kind][rows].split(1)):
                mb["rollout_routed_experts"] = routed
            logp = model.forward_logprobs(micro, measure_routing=True, replay_routing=kind == "perturbed")
            result[kind] = {"counts": model.last_routing_counts.sum(0).tolist(),
                            "expected_decisions": 3 * int(case["valid"][rows].sum())}  # 3 sparse layers
            if logp is not None:
                got = torch.cat([o["logp"] for o in logp])
                valid = case["valid"][rows]
                result[kind]["logp_diff"] = (got - case[f"logp_{kind}"][rows]).abs()[valid].max().item()
        out[layout] = result
    # (c) training with replay: recomputation in the backward pass replays each micro-batch's own targets.
    steps = {}
    for recompute in (None, "full"):
        model = ShardedModel(hf_dir, ParallelDims(ep=2, pp=2), optim=OptimConfig(**OPTIM), router_replay=True,
                             recompute_granularity=recompute)
        rows = slice(model.groups.dp_rank * 4 // model.groups.dims.dp, (model.groups.dp_rank + 1) * 4 // model.groups.dims.dp)
        micro = [{k: v[rows][i:i + 1] for k, v in batch.items()} for i in range(4 // model.groups.dims.dp)]
        for mb, routed in zip(micro, case["perturbed"][rows].split(1)):
            mb["rollout_routed_experts"] = routed
            mb["weights"] = torch.linspace(-1, 1, mb["input_ids"].shape[1])[None]
        result = model.train_step(micro, _weighted_loss, replay_routing=True)
        steps[recompute or "none"] = (result.loss, result.grad_norm)
    free = ShardedModel(hf_dir, ParallelDims(ep=2, pp=2), optim=OptimConfig(**OPTIM))
    micro = [{k: v[rows][i:i + 1] for k, v in batch.items()} for i in range(4 // free.groups.dims.dp)]
    for mb in micro:
        mb["weights"] = torch.linspace(-1, 1, mb["input_ids"].shape[1])[None]
    result = free.train_step(micro, _weighted_loss)
    steps["no_replay"] = (result.loss, result.grad_norm)
    out["train"] = steps
    out["aux"] = _aux_losses(hf_dir, batch)
    return out


AUX_LAYOUTS = {"ep1": dict(), "ep2": dict(ep=2), "tp2_ep2_sp": dict(tp=2, ep=2, sequence_parallel=True),
               "ep2_pp2": dict(ep=2, pp=2)}


def _aux_losses(hf_dir: str, batch: dict) -> dict:
    """One training step with the load-balancing and z losses on, over the same 4 one-row micro-batches (rows of
    different lengths) at each layout of :data:`AUX_LAYOUTS` (1 or 2 micro-batches per rank, tokens split by SP or
    not): loss, gradient norm, the logged aux / z losses and the expert load; and without the losses."""
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel
    from tests.distributed.checkpoint_jobs import OPTIM

    out = {}
    for layout, kwargs in [*AUX_LAYOUTS.items(), ("ep1_no_aux", None)]:
        losses = {} if kwargs is None else {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}
        model = ShardedModel(hf_dir, ParallelDims(**(kwargs or {})), optim=OptimConfig(**OPTIM), **losses)
        dp, rank = model.groups.dims.dp, model.groups.dp_rank
        micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(rank * 4 // dp, (rank + 1) * 4 // dp)]
        for mb in micro:
            mb["weights"] = torch.linspace(-1, 1, mb["input_ids"].shape[1])[None]
        result = model.train_step(micro, _weighted_loss)
        out[layout] = {"loss": result.loss, "grad_norm": result.grad_norm, **result.metrics}
    return out


def _weighted_loss(logp, entropy, mb):
    """A fixed linear functional of the log-probs of the rows' next tokens (each row's last position predicts
    nothing of the row: left out)."""
    from megarl.parallel.routing import routed_mask

    return -(logp * mb["weights"] * routed_mask(mb["attention_mask"]).float()).sum() / 64, {}
