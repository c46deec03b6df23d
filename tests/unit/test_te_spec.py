"""TransformerEngine's layer specs, as far as a machine without TE can check them: Megatron's own spec functions
run with a stand-in backend whose modules are markers named as TE's classes, and the parameters those classes hold
(TE's ``LayerNormLinear`` keeps its norm as ``layer_norm_weight``, the names megarl's GQA rules already load on GPUs)
give the names a TE-built layer has. The kernels and the timing are a GPU's to show (docs/gpu.md)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from megarl.config.parallel import ParallelDims
from megarl.models import family as family_module
from megarl.models import family_for
from tests.distributed import moe_jobs

TE_PARAMETERS = {"TELinear": ("weight",), "TEColumnParallelLinear": ("weight",), "TERowParallelLinear": ("weight",),
                 "TELayerNormColumnParallelLinear": ("layer_norm_weight", "weight"), "TENorm": ("weight",),
                 "TEDotProductAttention": ()}
"""The parameters of each TE module class a layer spec names (no biases: megarl's models have none there)."""


def _marker(name: str) -> type:
    return type(name, (), {})


class _MarkerBackend:
    """Megatron's ``TESpecProvider`` with each module a marker class of the TE class's name."""

    def linear(self):
        return _marker("TELinear")

    def column_parallel_linear(self):
        return _marker("TEColumnParallelLinear")

    def row_parallel_linear(self):
        return _marker("TERowParallelLinear")

    def fuse_layernorm_and_linear(self):
        return True

    def column_parallel_layer_norm_linear(self):
        return _marker("TELayerNormColumnParallelLinear")

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
        return _marker("TENorm")

    def core_attention(self):
        return _marker("TEDotProductAttention")


def _parameter_names(spec, prefix: str = "") -> set[str]:
    """The parameter names a layer built from ``spec`` (markers for TE modules) holds."""
    names: set[str] = set()
    module = spec.module if hasattr(spec, "module") else spec
    if isinstance(module, type) and module.__name__ in TE_PARAMETERS:
        return {prefix + p for p in TE_PARAMETERS[module.__name__]}
    submodules = getattr(spec, "submodules", None)
    if submodules is None:
        return names
    for field, value in vars(submodules).items():
        if value is None or isinstance(value, (dict, str)) or getattr(value, "__name__", "") == "IdentityOp":
            continue
        if callable(value) and not isinstance(value, type) and not hasattr(value, "submodules"):
            continue  # a function (bias-dropout-add)
        names |= _parameter_names(value, f"{prefix}{field}.")
    return names


def test_te_mla_spec_names_match_the_mla_rules(monkeypatch):
    """Megatron's ``get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)``: the input norm is a
    ``TENorm`` (the down projections are plain ``TELinear``), the q and kv norms fuse into the up projections
    (``TELayerNormColumnParallelLinear``), ``q_layernorm``/``kv_layernorm`` are identities; a dense MLP's norm fuses
    into ``linear_fc1``. The DeepSeek-V3 rules' TE names of a dense layer are exactly these."""
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _MarkerBackend, raising=False)
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True, multi_latent_attention=True)
    built = _parameter_names(spec, "decoder.layers.0.")
    # MLASelfAttention builds linear_q_proj only for a direct query projection (q_lora_rank None), else the down/up
    # pair; megarl maps low-rank queries (DeepSeek-V3, Kimi-K2).
    from megatron.core.transformer import multi_latent_attention

    assert "if self.config.q_lora_rank is None:" in inspect.getsource(multi_latent_attention.MLASelfAttention)
    built.remove("decoder.layers.0.self_attention.linear_q_proj.weight")
    config = moe_jobs.tiny_moe_config("deepseek_v3")
    family = family_for(config)
    assert not family.moe.sparse_layers(config)[0]  # layer 0 is dense (first_k_dense_replace)
    rules = [r for r in family.weight_rules(config) if r.per_layer and r.applies_to(sparse=False)]
    assert {r.megatron_name(0, te=True) for r in rules} == built
    assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in built
    assert "decoder.layers.0.input_layernorm.weight" in built


def test_mla_builds_on_te_where_te_is_and_fuses_what_te_fuses(monkeypatch):
    """On a GPU with TE, an MLA family builds TE's spec (its fused attention and grouped GEMM), with TE's permute
    fusion; RoPE fusion stays off for MLA (Megatron's is training-only and YaRN-only) and for multimodal RoPE, on for
    the GQA families; gradient-accumulation fusion only where apex's extension imports (the output layer needs it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(family_module, "_te_importable", lambda: True)
    monkeypatch.setattr(family_module, "_te_at_least", lambda version: True)
    from megatron.core.transformer.moe import moe_utils

    for kernel in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                   "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):  # TE's, which the config asks for
        monkeypatch.setattr(moe_utils, kernel, object(), raising=False)
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object(), raising=False)  # TE's
    deepseek = moe_jobs.tiny_moe_config("deepseek_v3")
    family = family_for(deepseek)
    assert family.uses_te()
    config = family.transformer_config(deepseek, ParallelDims(), perform_initialization=False)
    assert config.moe_grouped_gemm and config.moe_permute_fusion and not config.moe_router_fusion
    assert not config.apply_rope_fusion and not config.gradient_accumulation_fusion
    qwen = moe_jobs.tiny_moe_config("qwen3_moe")
    assert family_for(qwen).transformer_config(qwen, ParallelDims(), perform_initialization=False).apply_rope_fusion
    monkeypatch.setattr(family_module, "_importable", lambda module: module == "fused_weight_gradient_mlp_cuda")
    fused = family_for(qwen).transformer_config(qwen, ParallelDims(), perform_initialization=False)
    assert fused.gradient_accumulation_fusion
    local = family.transformer_config(deepseek, ParallelDims(), use_te=False, perform_initialization=False)
    assert not (local.moe_grouped_gemm or local.moe_permute_fusion or local.apply_rope_fusion)


def test_megatrons_fused_router_ignores_the_router_replay():
    """``topk_routing_with_score_function(..., fused=True)`` returns TE's fused top-k before it looks at the
    ``router_replay`` megarl's routing replay drives: megarl keeps ``moe_router_fusion`` off."""
    from megatron.core.transformer.moe import moe_utils

    func = ast.parse(inspect.getsource(moe_utils.topk_routing_with_score_function)).body[0]
    fused = next(n for n in ast.walk(func) if isinstance(n, ast.If) and ast.unparse(n.test) == "fused")
    assert any(isinstance(n, ast.Return) for n in fused.body)
    assert "router_replay" not in ast.unparse(fused)


def test_overlapped_gradient_reduction_waits_for_the_last_micro_batch():
    """Megatron's DDP with ``overlap_grad_reduce`` starts a bucket's collective from the backward hook only on the
    last micro-batch (``no_sync`` holds it before); megarl's step sets the schedule's ``no_sync_func`` and
    ``grad_sync_func`` from the chunks, as Megatron's training loop does."""
    from megarl.parallel import pipeline

    source = inspect.getsource(pipeline._set_finalize)
    assert "config.no_sync_func" in source and "config.grad_sync_func" in source
    from megatron.core.distributed import distributed_data_parallel as ddp
    from megatron.core.distributed import param_and_grad_buffer as buffers

    hook = inspect.getsource(ddp.DistributedDataParallel._make_backward_post_hook)
    assert "overlap_grad_reduce" in hook and "register_grad_ready" in hook
    ready = inspect.getsource(buffers._ParamAndGradBucketGroup.register_grad_ready)
    assert "if self.is_last_microbatch:" in ready  # set False inside no_sync()
    assert "is_last_microbatch = False" in inspect.getsource(ddp.DistributedDataParallel.no_sync)


@pytest.mark.parametrize("worker", ["ActorWorker", "CriticWorker", "TeacherWorker", "RewardModelWorker"])
def test_megatron_ranks_run_with_one_cuda_connection(worker):
    """Megatron's TP layers rely on ``CUDA_DEVICE_MAX_CONNECTIONS=1`` to order their overlapped collectives before
    the computation they hide behind; megarl's Megatron roles get it, its engine servers do not."""
    from megatron.core.tensor_parallel import layers

    from megarl.workers import megatron_workers
    from megarl.workers.engine_server import EngineServerWorker

    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in inspect.getsource(layers)
    assert getattr(megatron_workers, worker).env_vars == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in EngineServerWorker.env_vars
