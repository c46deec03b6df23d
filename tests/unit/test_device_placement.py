"""Where the Megatron path puts its tensors on a GPU, checked without one.

The ``meta`` device stands for the GPU (:data:`DEVICE`). torch's fake tensors (``FakeTensorMode``) carry a device
and no data, and check devices as torch checks CUDA ones: an operation mixing a fake ``meta`` tensor with a host
tensor raises "Expected all tensors to be on the same device" (``FakeTensorDeviceMismatchError``) exactly where a
CUDA tensor would (host zero-dim scalars and copies allowed). Fake ``cuda`` tensors would be more literal, but a
CPU-only torch cannot even take a view of one. Each test runs one piece of the path with device inputs (or a model
whose parameters are on the device) and asserts on the devices it produces.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

DEVICE = torch.device("meta")
"""The GPU of these tests."""


@pytest.fixture
def fake_device():
    """A fake-tensor mode: tensors made inside it on :data:`DEVICE` check devices as CUDA tensors do (also when
    used outside it)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def _rl_batch(rows: int = 3, prompt: int = 3, response: int = 4):
    """Left-padded prompts ‖ right-padded responses, as the rollout hands them over (on the host)."""
    from megarl.data.batch import Batch

    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    mask[0, 0] = 0
    mask[1, -1] = 0
    ids = torch.arange(rows * (prompt + response)).view(rows, -1) % 7 + 1
    return Batch.from_dict({"input_ids": ids * mask, "attention_mask": mask, "responses": ids[:, prompt:],
                            "response_mask": mask[:, prompt:], "values": torch.zeros(rows, response),
                            "returns": torch.zeros(rows, response)})


# ------------------------------------------------------------------------------------------ N1: inputs and outputs
def _sharded_model_on_device(*, value_head: bool):
    """A ShardedModel whose parameters are on the device: its own methods, none of its Megatron state."""
    from megarl.workers.sharded_model import ShardedModel

    class OnCuda(ShardedModel):
        device = DEVICE

        def __init__(self):  # what the methods under test read
            self.value_head, self.packed, self.moe_losses = value_head, True, (0.0, 0.0)
            self.hf_config = SimpleNamespace(vocab_size=8)
            self.groups = SimpleNamespace(is_last_stage=True, dims=SimpleNamespace(dp=1, pp=1))
            self.family = SimpleNamespace(moe=None, vision=None)
            self.chunks = []
            self.optimizer = SimpleNamespace(zero_grad=lambda: None, param_groups=[{"lr": 0.5}])

        def _reduce_metrics(self, outputs, num_micro_batches):
            return float("nan"), {}

    return OnCuda()


def test_the_sharded_model_moves_each_micro_batch_to_its_parameters_device(monkeypatch):
    import megarl.parallel

    seen = []

    def forward_backward(chunks, micro_batches, **kwargs):
        seen.append({key: mb[key].device for mb in micro_batches for key in mb})
        return []

    monkeypatch.setattr(megarl.parallel, "forward_backward", forward_backward)
    batch = _rl_batch()
    micro = [{key: batch[key][i:i + 1] for key in ("input_ids", "attention_mask", "response_mask")} for i in range(3)]
    _sharded_model_on_device(value_head=False).forward_logprobs(micro)
    _sharded_model_on_device(value_head=True).forward_values(micro)
    result = _sharded_model_on_device(value_head=False).train_step(micro, loss_fn=None)
    assert result.applied is False  # the stand-in's NaN loss: the step is skipped, as on any non-finite loss
    assert seen == [{"input_ids": DEVICE, "attention_mask": DEVICE, "response_mask": DEVICE}] * 3
    assert all(mb["input_ids"].device.type == "cpu" for mb in micro)  # the caller's micro-batches are untouched


def _model_returning_device_tensors(keys: tuple[str, ...], *, value_head: bool, fake_device):
    """What ShardedModel returns on a GPU: per micro-batch ``[B, S]`` outputs on the device."""

    def forward(micro_batches, **kwargs):
        with fake_device:
            return [{key: torch.zeros(mb["input_ids"].shape, device=DEVICE) for key in keys} for mb in micro_batches]

    return SimpleNamespace(value_head=value_head, token_layout={"packed_align": None, "cp": 1}, chunks=[None], micro_multiple=1,
                           groups=SimpleNamespace(dims=SimpleNamespace(pp=1), is_collect_rank=True),
                           forward_logprobs=forward, forward_values=forward)


def test_the_roles_return_host_tensors(fake_device):
    from megarl.config.critic import CriticConfig
    from megarl.workers.actor import LogProbRole
    from megarl.workers.critic import CriticRole

    batch = _rl_batch()
    logp = LogProbRole(_model_returning_device_tensors(("logp", "entropy"), value_head=False, fake_device=fake_device))
    critic = CriticRole(_model_returning_device_tensors(("values",), value_head=True, fake_device=fake_device),
                        CriticConfig(ppo_mini_batch_size=3))
    out = {**logp.compute_log_prob(batch, with_entropy=True), **critic.compute_values(batch)}
    assert {key: (tuple(t.shape), t.device.type) for key, t in out.items()} == {
        "log_probs": ((3, 4), "cpu"), "entropy": ((3, 4), "cpu"), "values": ((3, 4), "cpu")}


def test_routing_builds_its_indices_on_the_micro_batch_device(fake_device):
    from megarl.parallel.packing import prepare_padded
    from megarl.parallel.routing import ROUTED_EXPERTS, Routing

    batch = _rl_batch()
    layers, topk = 2, 2
    host = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            ROUTED_EXPERTS: torch.zeros(3, 7, layers, topk, dtype=torch.uint8)}
    prepared = prepare_padded(host)
    model = torch.nn.Module()
    routing = Routing([], replay=False, measure=True)
    routing._routers = {id(model): [SimpleNamespace(layer_number=1)]}  # one router, never called here
    with fake_device:
        micro = {key: value.to(DEVICE) for key, value in host.items()}
        on_device = dataclasses.replace(prepared, input_ids=prepared.input_ids.to(DEVICE),
                                        align_index=prepared.align_index.to(DEVICE), keep=prepared.keep.to(DEVICE))
    routing.before_forward(model, 0, micro, on_device)
    context = routing._contexts[id(model)]
    assert {name: getattr(context, name).device for name in ("targets", "valid", "row")} == {
        "targets": DEVICE, "valid": DEVICE, "row": DEVICE}
    assert tuple(context.targets.shape) == (21, layers, topk)


# ------------------------------------------------------------------------------------------- N2: the backend
def test_on_gpu_the_default_group_has_gloo_for_host_tensors_beside_nccl(monkeypatch):
    """Megatron's groups inherit the default group's backend: NCCL alone cannot reduce a host tensor."""
    import torch.distributed as dist

    from megarl.parallel import groups

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: calls.append(("init", backend)))
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                        "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    groups.init_distributed()
    groups.init_distributed("nccl")
    groups.init_distributed("gloo")
    assert calls == [("set_device", 3), ("init", "cpu:gloo,cuda:nccl"), ("set_device", 3),
                     ("init", "cpu:gloo,cuda:nccl"), ("init", "gloo")]


# ------------------------------------------------------------------------------ N3, N4, N5, MoE: CUDA without TE
def test_the_local_specs_norms_are_built_on_the_models_device_in_its_dtype(monkeypatch):
    from megarl.models.local_spec import CpuRMSNorm

    config = SimpleNamespace(normalization="RMSNorm", sequence_parallel=True, use_cpu_initialization=False,
                             params_dtype=torch.bfloat16, layernorm_zero_centered_gamma=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")  # where Megatron builds the GPU parameters
    norm = CpuRMSNorm(config, 16, eps=1e-6)
    assert (norm.weight.device.type, norm.weight.dtype, tuple(norm.weight.shape)) == ("meta", torch.bfloat16, (16,))
    assert norm.weight.sequence_parallel is True
    on_host = CpuRMSNorm(SimpleNamespace(**{**vars(config), "use_cpu_initialization": True}), 16)
    assert (on_host.weight.device.type, on_host.weight.dtype) == ("cpu", torch.bfloat16)
    # Zero-centred (Qwen3.5's norms, Megatron's layernorm_zero_centered_gamma): the weight holds gamma - 1
    centred = CpuRMSNorm(SimpleNamespace(**{**vars(config), "use_cpu_initialization": True, "params_dtype": torch.float32,
                                            "layernorm_zero_centered_gamma": True}), 16, eps=1e-6)
    assert torch.equal(centred.weight, torch.zeros(16))
    x = torch.randn(3, 16)
    with torch.no_grad():
        centred.weight.copy_(torch.randn(16))
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + centred.weight)
        assert (centred(x) - expected).abs().max() <= 1e-6


@pytest.mark.parametrize("te", [False, True])
def test_megatrons_fused_softmax_only_with_transformer_engine(monkeypatch, te):
    """Megatron's fused masked softmax imports a kernel no package ships: on CUDA without TE it stays off."""
    from megarl.config.parallel import ParallelDims
    from megarl.models import family as family_module
    from megarl.models.tiny import build_tiny_tokenizer, tiny_qwen2_config

    hf_config = tiny_qwen2_config(build_tiny_tokenizer())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(family_module, "_te_importable", lambda: te)
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object(), raising=False)  # TE's (RoPE fusion)
    family = family_module.family_for(hf_config)
    config = family.transformer_config(hf_config, ParallelDims(), params_dtype=torch.bfloat16)
    assert (config.masked_softmax_fusion, config.use_cpu_initialization) == (te, False)


def _attention(cp: int):
    """megarl's core attention without Megatron's state: only megarl's part of the forward runs."""
    from megarl.models.local_spec import core_attention

    cls = core_attention()
    attention = cls.__new__(cls)
    torch.nn.Module.__init__(attention)
    attention.cp, attention.cp_group = cp, None
    return attention


def _device_bounds(fake_device, lengths: list[int]) -> torch.Tensor:
    """A pack's ``cu_seqlens`` on the (fake) device, unreadable there (a fake tensor's values raise when read, as a
    read of a CUDA tensor would sync), with the host copy :func:`megarl.parallel.packing.prepare_packed` records."""
    import itertools

    from megarl.parallel.packing import record_host_bounds

    with fake_device:
        bounds = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=DEVICE)
    return record_host_bounds(bounds, [0, *itertools.accumulate(lengths)])


def test_the_pack_keeps_its_bounds_on_the_host_too():
    from megarl.parallel.packing import host_bounds, prepare_packed

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    prepared = prepare_packed({"input_ids": torch.ones(3, 4, dtype=torch.long), "attention_mask": mask},
                              seg_align=2, total_align=4)
    params = prepared.packed_seq_params
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        tensor = getattr(params, name)
        assert host_bounds(tensor) == tuple(tensor.tolist()) and tensor._megarl_host_bounds == tuple(tensor.tolist())
    assert host_bounds(params.cu_seqlens_q) == (0, 3, 5, 9) and host_bounds(params.cu_seqlens_q_padded) == (0, 4, 6, 12)
    assert host_bounds(torch.tensor([0, 2, 7])) == (0, 2, 7)  # no recorded copy: read


def test_packed_rope_reads_no_bounds_from_the_device(fake_device):
    """Megatron's THD RoPE (megarl's one-index version) runs twice per layer: it takes the pack's host bounds, so
    it queues no device-to-host copy (which would wait for the GPU each time)."""
    import types

    from megatron.core.models.common.embeddings import rope_utils

    from megarl.parallel import megatron_patches
    from megarl.parallel.cpu_support import cpu_support

    megatron_patches.apply()  # megarl's THD RoPE (point 9)
    lengths = [6, 4, 10]
    bounds = _device_bounds(fake_device, lengths)
    group = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    with cpu_support(), fake_device:
        t = torch.zeros(20, 2, 8, device=DEVICE)
        freqs = torch.zeros(10, 1, 1, 8, device=DEVICE)
        out = rope_utils._apply_rotary_pos_emb_thd(t, bounds, freqs, cp_group=group)
    assert (tuple(out.shape), out.device) == ((20, 2, 8), DEVICE)


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_attention_plans_are_on_the_queries_device(monkeypatch, fake_device, cp):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.models.local_spec import core_attention

    masks = []

    def base(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kwargs):
        masks.append(None if attention_mask is None else attention_mask.device)
        with fake_device:  # Megatron's [Lq, n, heads·dim], fake (pad_sequence's output of fake inputs is not)
            return torch.zeros(query.shape[0], query.shape[1], query.shape[2] * query.shape[3], device=query.device)

    monkeypatch.setattr(core_attention(), "_attend", base)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    attention = _attention(cp)
    attention._gather = lambda key, value, lengths: [torch.cat([key] * cp), torch.cat([value] * cp)]
    lengths = [8, 4, 4, 2 * cp * 5, 160]  # rows of one pack: a long one alone, short ones batched
    bounds = _device_bounds(fake_device, lengths)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             cu_seqlens_q_padded=bounds, cu_seqlens_kv_padded=bounds, max_seqlen_q=160,
                             max_seqlen_kv=160)
    with fake_device:
        q, k, v = (torch.zeros(sum(lengths) // cp, 2, 4, device=DEVICE) for _ in range(3))
    out = attention(q, k, v, None, packed_seq_params=params)
    assert (tuple(out.shape), out.device) == ((sum(lengths) // cp, 1, 8), DEVICE)
    assert masks and set(masks) <= ({None, DEVICE} if cp == 1 else {DEVICE})


def test_padded_context_parallel_attention_mask_is_on_the_queries_device(monkeypatch, fake_device):
    from megarl.models.local_spec import core_attention

    masks = []

    def base(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kwargs):
        masks.append(attention_mask.device)
        with fake_device:
            return torch.zeros(query.shape[0], query.shape[1], query.shape[2] * query.shape[3], device=query.device)

    monkeypatch.setattr(core_attention(), "_attend", base)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    attention = _attention(2)
    attention._gather = lambda key, value, lengths: [torch.cat([key] * 2), torch.cat([value] * 2)]
    with fake_device:
        q, k, v = (torch.zeros(4, 1, 2, 4, device=DEVICE) for _ in range(3))
    attention(q, k, v, None)
    assert masks == [DEVICE]


def test_install_prepares_megatron_for_the_local_spec_on_cuda_too(monkeypatch):
    """On CUDA without TransformerEngine: MoE gating needs ``te_general_gemm`` defined (None), and the unfused THD
    RoPE is megarl's (no host sync per sequence and layer)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils

    from megarl.parallel import cpu_support, megatron_patches

    megatron_rope = getattr(rope_utils._apply_rotary_pos_emb_thd, "megatron", rope_utils._apply_rotary_pos_emb_thd)
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", megatron_rope)
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(megatron_patches, "_APPLIED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    megatron_patches.apply()  # as megarl.parallel.init_parallel does on every machine
    cpu_support.install()
    assert moe_utils.te_general_gemm is None
    assert rope_utils._apply_rotary_pos_emb_thd.megatron is megatron_rope
    assert torch.cuda.current_device is current_device  # the CPU patches stay off


# ------------------------------------------------------------------------------ S: the local spec's attention kernel
@pytest.mark.parametrize("layer_scaling", [False, True])
def test_local_attention_by_sdpa_equals_megatrons_math(monkeypatch, layer_scaling):
    """The local spec's core attention computes with torch's scaled_dot_product_attention (flash attention on CUDA,
    no [b, heads, s, s] scores kept): Megatron's own DotProductAttention math, causal, grouped-query, with a
    boolean mask (True: masked) and query-key layer scaling; Megatron's math itself where SDPA is not the same
    function (attention dropout while training)."""
    import contextlib
    import types

    from megatron.core import parallel_state, tensor_parallel

    from megarl.parallel.cpu_support import cpu_support

    class Buffer:
        def get_tensor(self, shape, dtype, name):
            return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: Buffer())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker",
                        lambda: types.SimpleNamespace(fork=contextlib.nullcontext))
    with cpu_support():  # Megatron's causal mask is made on "cuda"
        _compare_attention(layer_scaling)


def _compare_attention(layer_scaling: bool) -> None:
    import types

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models.local_spec import core_attention

    tp = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                               kv_channels=8, use_cpu_initialization=True, attention_softmax_in_fp32=True,
                               apply_query_key_layer_scaling=layer_scaling, fp16=False, bf16=False)
    attention = core_attention()(config, 3, AttnMaskType.causal, "self", pg_collection=tp).eval()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 8, 8, generator=generator)
    k, v = (torch.randn(12, 2, 2, 8, generator=generator) for _ in range(2))
    q.requires_grad_(True)
    expected = DotProductAttention.forward(attention, q, k, v, None)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
    torch.nn.functional.scaled_dot_product_attention = lambda *a, **kw: calls.append(kw) or sdpa(*a, **kw)
    try:
        got = attention(q, k, v, None)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    assert [c["is_causal"] for c in calls] == [True]  # SDPA's own causal kernel, no mask tensor
    assert got.shape == expected.shape == (12, 2, 64)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    # The gradient too (what a train step uses).
    (grad_expected,) = torch.autograd.grad(expected.square().sum(), q)
    (grad_got,) = torch.autograd.grad(attention(q, k, v, None).square().sum(), q)
    torch.testing.assert_close(grad_got, grad_expected, atol=1e-5, rtol=1e-4)
    # A boolean mask (True: masked), as context parallelism and batched packed segments pass: each query sees
    # some keys (its own position at least).
    mask = torch.rand(2, 1, 12, 12, generator=generator) > 0.5
    mask &= ~torch.eye(12, dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, v, mask), DotProductAttention.forward(attention, q, k, v, mask),
                               atol=1e-6, rtol=1e-5)
    # Attention dropout while training: Megatron's math (and its RNG tracker), so both draw the same mask.
    attention.attention_dropout.p = 0.5
    attention.train()
    torch.manual_seed(1)
    dropped = attention(q, k, v, None)
    torch.manual_seed(1)
    torch.testing.assert_close(dropped, DotProductAttention.forward(attention, q, k, v, None))
    assert not torch.allclose(dropped, expected)


def test_megatrons_fused_functions_run_eager():
    """RL micro-batches change shape every call, so Megatron's torch.compile'd fused functions (jit_fuser) would
    recompile for each until dynamo gives up: after megarl's set-up none is compiled, those imported before it
    and those imported after alike, and a new one is not."""
    import megatron.core  # noqa: F401  (its package imports some fused functions, compiled then)
    from megatron.core import jit

    from megarl.parallel import megatron_patches

    megatron_patches.apply()
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.attention  # noqa: F401
    import megatron.core.transformer.moe.router  # noqa: F401
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    assert megatron_patches.compiled_megatron_functions() == []
    assert jit.jit_fuser(len) is len  # a no-op from now on
    x = torch.randn(3, 4)
    out = fused_bias_dropout.bias_dropout_add_fused_inference((x.clone(), None), x.clone(), 0.0)
    assert torch.equal(out, 2 * x)
    assert "_torchdynamo_orig_callable" not in vars(fused_bias_swiglu.bias_swiglu)
