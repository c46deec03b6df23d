"""The pre-flight planner (megarl.plan.preflight, megarl-plan): numbers checked against hand arithmetic.

The 7B numbers below are worked out from the published Qwen2.5-7B sizes and the recipe's settings,
independently of the planner's code path (no weight rules, no placement helpers).
"""

from __future__ import annotations

import math
import re

import pytest

from megarl.cli.plan import main as plan_main
from megarl.config import load_config
from megarl.config.parallel import ParallelDims
from megarl.models.known import KNOWN_ARCHITECTURES, known_config, known_name, resolve_hf_config
from megarl.models.sizes import Architecture
from megarl.parallel.packing import pack_alignment
from megarl.plan.activations import (
    MicroBatch,
    activation_bytes_per_layer,
    chunks_in_flight,
    micro_batch,
    moe_layer_activation_bytes,
)
from megarl.plan.all_to_all import all_to_all_bytes_per_token
from megarl.plan.memory import CUDA_CONTEXT_BYTES
from megarl.plan.preflight import plan_run, preflight

PP2 = ParallelDims(pp=2)

GiB = 2**30


@pytest.fixture(scope="module")
def plan_7b():
    return plan_run(load_config(["recipe=qwen2_5_7b_grpo"]))


@pytest.fixture(scope="module")
def plan_70b():
    return plan_run(load_config(["recipe=llama3_1_70b_grpo"]))


# ------------------------------------------------------------------------------------ Qwen2.5-7B
# Architecture: hidden 3584, 28 layers, 28 heads of 128, 4 KV heads, ffn 18944, vocab 152064 (a multiple
# of 64 x 2: no padding at TP 2), untied LM head, q/k/v biases.
H, L, A, G, D, F, V = 3584, 28, 28, 4, 128, 18944, 152064
# Recipe qwen2_5_7b_grpo: 1 node x 8 GPUs, actor TP 2 (SP) -> DP 4, bf16, full recompute of every layer,
# token-budget micro-batches of 16384 tokens (update) and 32768 (old and ref log-probs), sequences of
# 1024 + 2048 tokens, SGLang TP 2 at gpu_memory_utilization 0.6 of 80 GiB.
TP, DP, SEQ = 2, 4, 1024 + 2048
QKV = (A + 2 * G) * D * H + (A + 2 * G) * D  # fused q/k/v weights + biases
PER_LAYER_RANK = (QKV + H * A * D + 3 * F * H) // TP + 2 * H  # TP-split matrices + two replicated norms
N_RANK = L * PER_LAYER_RANK + 2 * (V // TP) * H + H  # + embedding and LM head shards + final norm


def test_7b_parameters_per_gpu():
    assert N_RANK == 3_807_910_400
    assert Architecture.from_hf(known_config("Qwen2.5-7B"), name="q", source="t").rank_params(tp=2) == N_RANK


def _kinds(plan):
    return {g.label: g for g in plan.gpus}


def test_7b_weights_grads_optimizer_engine_bytes(plan_7b):
    # pp=1 and an engine on every TP group: one kind of GPU
    kinds = _kinds(plan_7b)
    assert {k: g.gpus for k, g in kinds.items()} == {"actor, engine": tuple(range(8))}
    gpu = kinds["actor, engine"]
    assert gpu.rows["actor_weights"] == 2 * N_RANK  # bf16
    assert gpu.rows["actor_grads"] == 4 * N_RANK  # fp32 gradient buffer
    assert gpu.rows["actor_optimizer"] == 12 * N_RANK // DP  # fp32 main + Adam m, v over 4 DP ranks
    assert gpu.rows["ref_weights"] == 2 * N_RANK  # use_kl_loss: the reference in the actor's processes
    assert gpu.rows["engine_weights"] == 2 * N_RANK  # SGLang TP 2 shards exactly like Megatron TP 2 here
    assert gpu.rows["cuda_context"] == 2 * CUDA_CONTEXT_BYTES  # actor + engine rank


def test_megatrons_hybrid_cpu_optimizer_moves_its_share_of_m_and_v_to_the_host(plan_7b):
    """optimizer_cpu_offload with optimizer_offload_fraction f: the GPU keeps the fp32 main weights and (1 - f) of
    Adam's m and v; each rank's node holds the share's fp32 params, m, v and grads (16 bytes a parameter)."""
    offload = "+actor_rollout_ref.actor.optim.override_optimizer_config"
    plan = plan_run(load_config(["recipe=qwen2_5_7b_grpo", f"{offload}.optimizer_cpu_offload=true",
                                 f"{offload}.optimizer_offload_fraction=0.75", "trainer.host_memory_gb=1024"]))
    gpu, before = _kinds(plan)["actor, engine"], _kinds(plan_7b)["actor, engine"]
    sharded = N_RANK // DP
    assert gpu.rows["actor_optimizer"] == 4 * sharded + 8 * sharded - int(8 * sharded * 0.75)
    assert before.peak - gpu.peak == int(8 * sharded * 0.75)  # every phase holding the optimizer gains that much
    assert plan.host_optimizer_bytes == {0: 8 * int(16 * sharded * 0.75)}  # 8 actor ranks on node 0
    report = plan.report()
    assert "actor optimizer (Adam, /4 ranks, 75% of m, v on the host)" in report
    assert f"keeps {plan.host_optimizer_bytes[0] / GiB:.2f} GiB of optimizer state on the fullest node" in report
    small = plan_run(load_config(["recipe=qwen2_5_7b_grpo", f"{offload}.optimizer_cpu_offload=true",
                                  f"{offload}.optimizer_offload_fraction=0.75", "trainer.host_memory_gb=64"]),
                     check=False)
    assert any("optimizer_offload_fraction" in problem and "trainer.host_memory_gb" in problem
               for problem in small.problems())


def test_7b_activation_logits_and_kv_estimates(plan_7b):
    gpu = _kinds(plan_7b)["actor, engine"]
    tokens = 16384
    # Full recompute with sequence parallelism: each layer keeps its input, 2 s b h / t bytes, for all 28
    # layers (pp=1: one micro-batch in flight), plus one layer rematerialised at 34 s b h / t.
    assert gpu.rows["activations"] == L * (2 * tokens * H // TP) + 34 * tokens * H // TP
    # Logits: tokens x vocab/tp x 14 bytes (bf16 logits + three fp32 temporaries of the log-prob).
    assert gpu.rows["logits"] == tokens * (V // TP) * 14
    assert gpu.rows["forward"] == 34 * 32768 * H // TP + 32768 * (V // TP) * 14
    # SGLang's pool: 0.6 x 80 GiB minus what is in use when it starts (actor weights, grads, fp32 main
    # weights 4 n / dp, the actor's context; the reference went to the host before, ref.param_offload) minus its
    # own context and weights.
    in_use = 2 * N_RANK + 4 * N_RANK + 4 * N_RANK // DP + CUDA_CONTEXT_BYTES
    assert gpu.in_use_at_engine_start == in_use
    kv = int(0.6 * 80 * GiB) - in_use - CUDA_CONTEXT_BYTES - 2 * N_RANK
    assert gpu.rows["kv_cache"] == kv
    assert gpu.kv_tokens == kv // (2 * L * (G // TP) * D * 2)  # K and V, 2 KV heads per GPU, bf16


def _hand_buckets(tensors, budget):
    """``[(chunk, bytes)]`` in HF order grouped as the exporter groups them: a bucket closes when the next
    tensor group would overflow ``budget`` or belongs to another model chunk; a larger one travels alone."""
    out, current, size = [], None, 0
    for chunk, nbytes in tensors:
        if current is not None and (current != chunk or size + nbytes > budget):
            out.append(size)
            size = 0
        current, size = chunk, size + nbytes
    return out + [size]


def _7b_buckets(budget):
    layer = [H, QKV - (A + 2 * G) * D, (A + 2 * G) * D, H * A * D, H, 2 * F * H, H * F]  # norm, qkv w+b, o, norm, fc1, fc2
    tensors = [(0, 2 * V * H)] + [(0, 2 * n) for _ in range(L) for n in layer] + [(0, 2 * H), (0, 2 * V * H)]
    return _hand_buckets(tensors, budget)


def test_7b_phases_and_sync_volume(plan_7b):
    gpu = _kinds(plan_7b)["actor, engine"]
    r = gpu.rows
    state = r["actor_weights"] + r["actor_grads"] + r["actor_optimizer"] + r["ref_weights"]
    # Only ref.param_offload: the actor's training state stays during the rollout, beside the engine;
    # the reference's weights wait in host memory.
    assert gpu.phases["rollout"] == state - r["ref_weights"] + r["engine_weights"] + r["kv_cache"] + r["cuda_context"]
    assert gpu.phases["log-probs"] == state + r["forward"] + r["cuda_context"]  # engine released
    assert gpu.phases["update actor"] == state + r["activations"] + r["logits"] + r["cuda_context"]
    assert gpu.peak_phase == "log-probs"
    # Colocated: the tensor transport, buckets of 512 / 2 MiB taking turns in two buffers, each as large as
    # the largest bucket it takes: the embedding (152064 x 3584 bf16, alone: larger than a bucket) in the first;
    # gather scratch: the fused gate/up of one layer gathered over TP 2.
    sizes = _7b_buckets(256 << 20)
    assert plan_7b.sync.transport == "tensor" and plan_7b.sync.buckets == len(sizes) == 59
    assert max(sizes[0::2]) == V * H * 2
    assert r["sync_buffers"] == V * H * 2 + max(sizes[1::2]) + 2 * F * H * 2
    hf_params = 7_615_616_512  # Qwen2.5-7B's published parameter count
    assert plan_7b.model.num_params == hf_params
    assert plan_7b.sync.model_bytes == hf_params * 2 == sum(sizes)
    assert plan_7b.sync.senders == (0, 2, 4, 6)  # each engine's first GPU posts its requests


def test_7b_weight_sync_estimate_per_transport(plan_7b):
    """The estimate from the published sizes and the default links (NVLink 450, InfiniBand 50, HBM 3350 GB/s,
    10 ms per engine request)."""
    model = 7_615_616_512 * 2
    norms = (2 * L + 1) * H * 2  # replicated: nothing to gather
    gather = (model - norms) // 2  # each TP-2 rank receives the other half of every split tensor
    actor = gather / 450e9
    engine = 59 * 0.010 + 2 * model // 2 / 3350e9  # requests + each engine GPU copying its half (read + write)
    assert plan_7b.sync.seconds == pytest.approx(engine + actor / 59, rel=1e-12)  # double buffered
    assert f"weight sync estimate: {engine + actor / 59:.2f} s" in plan_7b.report()
    # Disaggregated: the distributed transport, buckets of 512 MiB, each engine GPU receives every byte over
    # InfiniBand; nothing overlaps. Engine GPUs receive a bucket into a buffer of its size (the embedding's).
    split = plan_run(load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.hybrid_engine=false",
                                  "actor_rollout_ref.rollout.pool_nodes=[8]", "trainer.links.infiniband_gbps=25"]))
    count = len(_7b_buckets(512 << 20))
    assert split.sync.transport == "distributed" and split.sync.buckets == count
    assert split.sync.seconds == pytest.approx(gather / 450e9 + model / 25e9 + count * 0.010 + model / 3350e9,
                                               rel=1e-12)
    assert split.sync.senders == (0, 2, 4, 6)  # the TP-0 rank of each DP replica
    assert _kinds(split)["rollout pool, engine"].rows["sync_buffers"] == V * H * 2
    # The actor's TP-0 ranks (the senders) build the buckets in one buffer, as large as the largest (the
    # embedding's); their TP-1 peers only join the all-gathers: the gather scratch alone.
    actor = {g.gpus: g.rows["sync_buffers"] for g in split.gpus if g.pool == "global"}
    assert actor == {(0, 2, 4, 6): V * H * 2 + 2 * F * H * 2, (1, 3, 5, 7): 2 * F * H * 2}


# ------------------------------------------------------------------------------------- formulas


def test_activation_formula_matches_korthikanti_table_2():
    s, b, h, a, t = 4096, 2, 8192, 64, 8
    kw = dict(tokens=s * b, seq=s, hidden=h, heads=a, tp=t)
    unfused = dict(kw, fused_attention=False)
    assert activation_bytes_per_layer(**unfused, sequence_parallel=True, recompute=None) == \
        math.ceil(s * b * h / t * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(**unfused, sequence_parallel=False, recompute=None) == \
        math.ceil(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(**kw, sequence_parallel=True, recompute="selective") == 34 * s * b * h // t
    assert activation_bytes_per_layer(**kw, sequence_parallel=False, recompute="selective") == \
        math.ceil(s * b * h * (10 + 24 / t))
    assert activation_bytes_per_layer(**kw, sequence_parallel=True, recompute="full") == 2 * s * b * h // t
    assert activation_bytes_per_layer(**kw, sequence_parallel=False, recompute="full") == 2 * s * b * h
    # Fused (flash) attention stores no scores: no recompute keeps what selective recompute keeps.
    assert activation_bytes_per_layer(**kw, sequence_parallel=True, recompute=None) == 34 * s * b * h // t


def test_chunks_in_flight_follow_megatron_warmup():
    assert chunks_in_flight(pp=4, vpp=None, pp_rank=0, num_micro_batches=16) == 4
    assert chunks_in_flight(pp=4, vpp=None, pp_rank=3, num_micro_batches=16) == 1
    assert chunks_in_flight(pp=4, vpp=None, pp_rank=0, num_micro_batches=2) == 2
    # Interleaved: 2 (pp - r - 1) + (vpp - 1) pp warm-up chunks, + 1.
    assert chunks_in_flight(pp=4, vpp=5, pp_rank=0, num_micro_batches=128) == 2 * 3 + 4 * 4 + 1
    assert chunks_in_flight(pp=4, vpp=5, pp_rank=3, num_micro_batches=128) == 4 * 4 + 1
    assert chunks_in_flight(pp=4, vpp=5, pp_rank=0, num_micro_batches=2) == 10


# ------------------------------------------------------------- packed and padded micro-batches


def test_micro_batch_counts_aligned_packed_or_padded_tokens_before_the_cp_split():
    """Rows of 1001 tokens at CP 2 x TP 3 with sequence parallelism: segments of a multiple of 2 cp = 4, the pack
    (or a padded row) a multiple of lcm(4, cp tp = 6) = 12. A token budget is per GPU: a pack spans cp GPUs."""
    align = pack_alignment(cp=2, tp=3, sequence_parallel=True)
    assert align == (4, 12)
    fixed = {"seq": 1001, "rows": 5, "dynamic": False, "budget": 0, "cp": 2, "align": align, "rows_per_rank": 32}
    # packed: 5 segments of 1004 = 5020, the pack rounded up to 5028; padded: 5 rows of 1008 columns
    assert micro_batch(**fixed, packed=True) == MicroBatch(5028, 1004, 7)
    assert micro_batch(**fixed, packed=False) == MicroBatch(5040, 1008, 7)
    for packed in (True, False):  # CP 1 without SP: no alignment
        assert micro_batch(**fixed | {"cp": 1, "align": (1, 1)}, packed=packed) == MicroBatch(5005, 1001, 7)
    budget = {"seq": 1001, "rows": None, "dynamic": True, "cp": 2, "align": align, "rows_per_rank": 32}
    # 3001 per GPU: a pack of 6002 tokens rounded up to 6012 (5 full segments per pack); padded, 5 full rows take
    # 5 x 1008 = 5040 columns, narrower rows the whole 6002
    assert micro_batch(**budget, budget=3001, packed=True) == MicroBatch(6012, 1004, 7)
    assert micro_batch(**budget, budget=3001, packed=False) == MicroBatch(6002, 1008, 7)
    # 1001 per GPU: 2002 per pack (one full segment, or shorter ones up to 2004); padded, 2 rows of 1008 columns
    assert micro_batch(**budget, budget=1001, packed=True) == MicroBatch(2004, 1004, 32)
    assert micro_batch(**budget, budget=1001, packed=False) == MicroBatch(2016, 1008, 16)
    # A budget below one row: the row goes alone
    assert micro_batch(**budget, budget=300, packed=True) == MicroBatch(1008, 1004, 32)
    assert micro_batch(**budget, budget=300, packed=False) == MicroBatch(1008, 1008, 32)


@pytest.mark.parametrize("cp, packed, tokens", [(1, True, 15336), (1, False, 15340), (2, True, 15336),
                                                (2, False, 15360)])
def test_actor_activations_count_packed_or_padded_tokens_per_cp_rank(cp, packed, tokens):
    """The 7B GRPO recipe at TP 4 with SP, rows of 1019 + 2048 = 3067 tokens, 15335 = 5 x 3067 tokens per GPU.
    CP 1: the pack (or row) a multiple of tp = 4: packed round_up(15335, 4) = 15336; padded 5 rows of 3068.
    CP 2: segments of a multiple of 4, the pack of 8 (cp tp); the pack spans 2 GPUs, 30670 tokens: packed
    round_up(30670, 8) = 30672, 15336 per CP rank; padded 10 rows of 3072 = 30720, 15360 per CP rank."""
    cfg = load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.actor.parallel.tp=4",
                       f"actor_rollout_ref.actor.parallel.cp={cp}", "data.max_prompt_length=1019",
                       "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=15335",
                       f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}"])
    plan = plan_run(cfg, check=False)
    gpu = _kinds(plan)["actor, engine"]
    # Full recompute of every layer with SP (as in test_7b_activation_logits_and_kv_estimates), TP 4.
    assert gpu.rows["activations"] == L * (2 * tokens * H // 4) + 34 * tokens * H // 4
    assert gpu.rows["logits"] == tokens * (V // 4) * 14  # 152064 = 297 x 512: no vocabulary padding at TP 4
    # Log-prob forwards: 32768 tokens per GPU (CP 2: a pack of 65536 over 2 GPUs), aligned already.
    assert gpu.rows["forward"] == 34 * 32768 * H // 4 + 32768 * (V // 4) * 14
    assert f"actor activations (full recompute, {'packed' if packed else 'padded'})" in plan.report()


@pytest.mark.parametrize("cp, packed, budget, tokens, forward", [
    (1, True, None, 4090, 16360),  # 2 rows (update), 8 rows (values) of 2045 tokens
    (2, True, None, 2048, 8192),  # rows of 2048 (a multiple of 2 cp), split over 2 CP ranks
    (2, False, None, 2048, 8192),  # without SP packed and padded full rows align alike
    (1, True, 2045, 2045, 2045),
    (2, True, 2045, 2046, 2046),  # a pack of 4090 tokens over 2 GPUs, rounded up to 4092
    (2, False, 2045, 2048, 2048),  # 2 padded rows of 2048
])
def test_critic_activations_count_packed_or_padded_tokens_per_cp_rank(cp, packed, budget, tokens, forward):
    """The 7B PPO recipe's critic (TP 4, no SP, its own critic.use_remove_padding) at CP 1 and 2, rows of
    1021 + 1024 = 2045 tokens; micro-batches of rows, or a budget of 2045 tokens per GPU."""
    overrides = ["recipe=qwen2_5_7b_ppo", "data.max_prompt_length=1021", f"critic.parallel.cp={cp}",
                 f"critic.use_remove_padding={str(packed).lower()}"]
    if budget:
        overrides += ["critic.use_dynamic_bsz=true", f"critic.ppo_max_token_len_per_gpu={budget}"]
    plan = plan_run(load_config(overrides), check=False)
    gpu = _kinds(plan)["actor, engine"]
    # No recompute, fused attention: T h (10 + 24/t) = 16 T h per layer at TP 4, all 28 layers (pp 1).
    assert gpu.rows["critic_activations"] == L * 16 * tokens * H
    assert gpu.rows["critic_forward"] == 16 * forward * H
    assert f"critic activations ({'packed' if packed else 'padded'})" in plan.report()


# --------------------------------------------------------------------------------- Llama-3.1-70B


def test_70b_recipe_fits_on_8x8_80gb(plan_70b):
    assert plan_70b.fits and plan_70b.gpu_memory_bytes == 80 * GiB
    assert plan_70b.worst.peak < 80 * GiB
    by_label = _kinds(plan_70b)
    # One engine on every actor TP group (engine_layout per_tp_group): every GPU generates.
    assert {k: g.gpus for k, g in by_label.items()} == {f"stage {s}, engine": tuple(range(16 * s, 16 * s + 16))
                                                         for s in range(4)}
    # Stage 0 of TP 8 x PP 4: 20 layers and the embedding (128256 = 8 x 16032 rows).
    h, f, a, g, d = 8192, 28672, 64, 8, 128
    layer = ((a + 2 * g) * d * h + h * a * d + 3 * f * h) // 8 + 2 * h
    assert by_label["stage 0, engine"].rows["actor_weights"] == 2 * (20 * layer + 16032 * h)
    assert by_label["stage 1, engine"].rows["actor_weights"] == 2 * 20 * layer
    assert by_label["stage 3, engine"].rows["actor_weights"] == 2 * (20 * layer + 16032 * h + h)
    # All training state offloaded: beside its engine a GPU holds only the actor's CUDA context while it generates.
    stage1 = by_label["stage 1, engine"]
    assert stage1.phases["rollout"] == 2 * CUDA_CONTEXT_BYTES + stage1.rows["engine_weights"] + stage1.rows["kv_cache"]
    assert plan_70b.model.num_params == 70_553_706_496
    assert plan_70b.sync.senders == tuple(range(0, 64, 8))  # each engine's first GPU


def test_70b_weight_sync_estimate_under_3_s(plan_70b):
    """Tensor transport, TP 8 x PP 4 (20 layers per stage in 5 chunks of 4), engines on every TP group, buckets of
    4096 / 2 MiB; H100 links: NVLink 450 GB/s, 400 Gb/s InfiniBand per GPU, HBM 3350 GB/s, 10 ms per request."""
    h, f, a, g, d, v = 8192, 28672, 64, 8, 128, 128256
    layer = [h, (a + 2 * g) * d * h, h * a * d, h, 2 * f * h, h * f]  # norm, qkv, o, norm, fc1, fc2
    # a bucket never spans two model chunks (of 4 layers)
    tensors = [(0, 2 * v * h)] + [(i // 4, 2 * n) for i in range(80) for n in layer] + [(19, 2 * h), (19, 2 * v * h)]
    sizes = _hand_buckets(tensors, 2 << 30)
    model = 70_553_706_496 * 2
    assert plan_70b.sync.model_bytes == model == sum(sizes) and plan_70b.sync.buckets == len(sizes)
    split = model - (2 * 80 + 1) * h * 2  # everything but the norms is split over TP 8
    actor = (split * 7 // 8 / 450e9  # each stage's TP all-gathers, stages in turn
             + model / 8 / 50e9  # every bucket to the 3 other stages: one broadcast of a 1/8 stripe per GPU, over IB
             + model * 7 // 8 / 450e9)  # the stripes all-gathered on the receiving stages
    engine = len(sizes) * 0.010 + 2 * model // 8 / 3350e9
    expected = max(actor, engine) + min(actor, engine) / len(sizes)
    assert plan_70b.sync.seconds == pytest.approx(expected, rel=1e-9)
    assert expected < 3.0
    assert f"weight sync estimate: {expected:.2f} s" in plan_70b.report()
    # The assumptions are printed, and they are settings: half the InfiniBand costs the stripes twice the time.
    assert "InfiniBand 50 GB/s" in plan_70b.report()
    slow = plan_run(load_config(["recipe=llama3_1_70b_grpo", "trainer.links.infiniband_gbps=25"]))
    ib = next(s for s in slow.sync.steps if s.link == "infiniband")
    assert ib.nbytes == model // 8 and ib.seconds(slow.sync.links) == pytest.approx(model / 8 / 25e9)


def test_70b_with_tp1_is_refused_naming_a_key():
    cfg = load_config(["recipe=llama3_1_70b_grpo", "actor_rollout_ref.actor.parallel.tp=1",
                       "actor_rollout_ref.actor.parallel.sequence_parallel=false"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.parallel\.tp"):
        plan_run(cfg)


def test_too_little_kv_room_is_refused_naming_gpu_memory_utilization():
    cfg = load_config(["recipe=llama3_1_70b_grpo", "actor_rollout_ref.rollout.gpu_memory_utilization=0.2"])
    with pytest.raises(ValueError, match=r"rollout\.gpu_memory_utilization"):
        plan_run(cfg).check()


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.actor.parallel.tp=3", r"actor_rollout_ref\.actor\.parallel\.tp"),  # does not divide 8 GPUs
    ("actor_rollout_ref.actor.parallel.tp=8", r"actor\.parallel\.tp=8 does not divide the model's 28 attention"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=8", r"rollout\.tensor_model_parallel_size=8"),
])
def test_non_factoring_layouts_are_refused_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key):
        plan_run(load_config(["recipe=qwen2_5_7b_grpo", override]))


def test_smaller_gpu_is_refused_with_the_phase_and_keys():
    cfg = load_config(["recipe=qwen2_5_7b_grpo", "trainer.gpu_memory_gb=60"])
    with pytest.raises(ValueError, match=r"log-probs phase.*rollout\.log_prob_max_token_len_per_gpu"):
        plan_run(cfg)


def test_preflight_checks_host_memory_on_cpu_and_plans_cuda_runs(plan_7b, tmp_path):
    from megarl.models.tiny import save_tiny

    model = save_tiny(tmp_path / "tiny")  # a cpu run's pre-flight reads the model's sizes (no device plan)
    assert preflight(load_config(["recipe=tiny_cpu_grpo", f"actor_rollout_ref.model.path={model}",
                                  "actor_rollout_ref.model.init=pretrained"])) is None
    plan = preflight(load_config(["recipe=qwen2_5_7b_grpo"]))
    assert plan is not None and plan.worst.peak == plan_7b.worst.peak


# ------------------------------------------------------------------------------ architectures


def test_known_names_and_unknown_path():
    assert known_name("Qwen/Qwen2.5-7B-Instruct") == "Qwen2.5-7B"
    assert known_name("/models/llama-3.1-70b/") == "Llama-3.1-70B"
    assert known_name("Qwen/Qwen2.5-14B") is None
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.path='nowhere/Foo-13B'"):
        plan_run(load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.model.path=nowhere/Foo-13B"]))


def test_local_config_json_wins(tmp_path):
    known_config("Qwen2.5-0.5B").save_pretrained(tmp_path / "Qwen2.5-7B")  # a misleading directory name
    config, source = resolve_hf_config(str(tmp_path / "Qwen2.5-7B"), key="k")
    assert config.hidden_size == 896 and source.endswith("config.json")


@pytest.mark.parametrize("name, total", [("Qwen2.5-0.5B", 494_032_768), ("Qwen2.5-7B", 7_615_616_512),
                                         ("Llama-3.1-8B", 8_030_261_248), ("Llama-3.1-70B", 70_553_706_496)])
def test_known_architectures_count_like_transformers(name, total):
    from megarl.convert.hf_io import expected_shapes

    arch = Architecture.from_hf(known_config(name), name=name, source="test")
    assert arch.num_params == total  # the published parameter counts
    small = known_config(name)
    small.num_hidden_layers = 2  # same tensors per layer, cheap to build on the meta device
    shapes = Architecture.from_hf(small, name=name, source="test").hf_shapes()
    hf = expected_shapes(small)
    if small.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # tied: one tensor
    assert shapes == hf


def test_critic_counts_a_value_head_instead_of_the_lm_head():
    arch = Architecture.from_hf(known_config("Qwen2.5-7B"), name="q", source="t")
    assert arch.rank_params(tp=2, value_head=True) == N_RANK - (V // TP) * H + H + 1
    tied = Architecture.from_hf(known_config("Qwen2.5-0.5B"), name="q", source="t")
    # A tied embedding: one copy at pp=1, Megatron's second copy on the last stage at pp=2.
    one = tied.rank_params(tp=1)
    assert (tied.rank_params(tp=1, pipeline=PP2, pp_rank=0) + tied.rank_params(tp=1, pipeline=PP2, pp_rank=1)
            == one + 151936 * 896)
    assert set(KNOWN_ARCHITECTURES) == {"Qwen2.5-0.5B", "Qwen2.5-7B", "Llama-3.1-8B", "Skywork-Reward-Llama-3.1-8B-v0.2",
                                        "Llama-3.1-70B", "Qwen3-30B-A3B", "Qwen2.5-VL-7B", "DeepSeek-V3",
                                        "Kimi-K2", "Qwen3-235B-A22B", "GLM-4.5", "MiniMax-M2", "Qwen3-Next-80B-A3B",
                                        "Qwen3.5-35B-A3B"}


# ------------------------------------------------------------------------------------------ CLI


def test_cli_prints_the_plan_and_exits_0_when_it_fits(capsys):
    assert plan_main(["recipe=llama3_1_70b_grpo"]) == 0
    out = capsys.readouterr().out
    for text in ("Placement", "TP groups (8 groups of 8): [0-7] [8-15]", "engine 4: GPUs 8-15",
                 "actor optimizer (Adam, /2 ranks)", "KV cache tokens per engine", "Weight sync per step", "weight sync estimate:", "fits:"):
        assert text in out


def test_cli_exits_2_naming_the_key(capsys):
    assert plan_main(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.actor.parallel.tp=3"]) == 2
    assert "actor_rollout_ref.actor.parallel.tp" in capsys.readouterr().err
    assert plan_main(["recipe=llama3_1_70b_grpo", "actor_rollout_ref.actor.parallel.tp=1",
                      "actor_rollout_ref.actor.parallel.sequence_parallel=false"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "actor_rollout_ref.actor.parallel.tp" in captured.err


def test_critic_hf_and_disaggregated_layouts_are_planned():
    ppo = plan_run(load_config(["recipe=qwen2_5_7b_ppo"]), check=False)
    gpu = _kinds(ppo)["actor, engine"]
    assert gpu.rows["critic_state"] > 0 and {"values", "update critic"} <= set(gpu.phases)
    assert "critic (critic.parallel)" in ppo.report()
    hf = plan_run(load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.rollout.name=hf",
                               "actor_rollout_ref.rollout.tensor_model_parallel_size=null"]), check=False)
    gpu = _kinds(hf)["actor, engine"]
    assert gpu.rows["engine_weights"] == 7_615_616_512 * 2  # an unsharded model per GPU
    assert "kv_cache" not in gpu.parts["weight sync"]  # the hf engine's cache lives only while generating
    split = plan_run(load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.hybrid_engine=false",
                                  "actor_rollout_ref.rollout.pool_nodes=[8]"]))
    training, engines = _kinds(split)["actor"], _kinds(split)["rollout pool, engine"]
    assert training.rows["engine_weights"] == 0 and engines.pool == "rollout" and engines.gpus == tuple(range(8))
    # Alone on its GPU, SGLang takes 0.6 x 80 GiB: its context, weights and KV pool; during the sync also the
    # bucket it receives (the embedding's, the largest).
    assert engines.phases["rollout"] == int(0.6 * 80 * GiB)
    assert engines.phases["weight sync"] == int(0.6 * 80 * GiB) + V * H * 2


@pytest.mark.parametrize("recipe", ["qwen2_5_0_5b_grpo", "qwen2_5_7b_grpo", "qwen2_5_7b_ppo", "llama3_1_70b_grpo",
                                    "qwen3_30b_a3b_grpo", "qwen2_5_7b_fp8_grpo", "llama3_1_70b_fp8_grpo"])
def test_every_gpu_recipe_plans_as_fitting(recipe):
    """The shipped GPU recipes fit their GPUs by the planner's own numbers (they ship runnable)."""
    plan = plan_run(load_config([f"recipe={recipe}"]))
    assert plan.fits, plan.problems()


def test_engines_on_every_tp_group_are_fed_by_the_replica_they_sit_on():
    """70B (TP8 x PP4 x DP2) with per_tp_group engines: 8 engines; each replica's first GPU feeds its 4."""
    plan = plan_run(load_config(["recipe=llama3_1_70b_grpo", "actor_rollout_ref.rollout.engine_layout=per_tp_group"]))
    engines = plan.placement.engines
    assert len(engines) == 8
    # Ranks are TP-fastest, then DP, then PP: replica 0 holds GPUs 0-7, 16-23, 32-39, 48-55.
    assert {e.bundles[0]: e.dp_rank for e in engines} == {0: 0, 16: 0, 32: 0, 48: 0, 8: 1, 24: 1, 40: 1, 56: 1}
    assert plan.sync.senders == tuple(sorted(e.bundles[0] for e in engines))
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.engine_layout"):
        load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.rollout.engine_layout=per_gpu"])


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 0, "hidden_size=0; it must be an integer from 1 to"),
    ("num_hidden_layers", 10**8, "num_hidden_layers=100000000; it must be an integer from 1 to 1024"),
    ("num_hidden_layers", 10**6, "num_hidden_layers=1000000"),
    ("vocab_size", "many", "vocab_size='many'"),
    ("num_key_value_heads", 3, "num_attention_heads=28 not divisible by num_key_value_heads=3"),
    ("intermediate_size", None, "has no intermediate_size"),
])
def test_architecture_values_are_checked_before_planning(tmp_path, field, value, message):
    """A broken config.json is refused at once, naming the key, the file and the field
    (hidden_size 0 was a ZeroDivisionError; 10⁶ layers took 156 s; 10⁸ hung inside transformers' config)."""
    import json
    import time

    from megarl.models.known import KNOWN_ARCHITECTURES

    fields = dict(KNOWN_ARCHITECTURES["Qwen2.5-7B"])
    fields[field] = value
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(fields))
    cfg = load_config(["recipe=qwen2_5_7b_grpo", f"actor_rollout_ref.model.path={model}"])
    start = time.monotonic()
    key = r"actor_rollout_ref\.model\.path: .*config\.json (has )?"
    with pytest.raises(ValueError, match=key + re.escape(message)):
        plan_run(cfg)
    assert time.monotonic() - start < 60  # refused reading config.json, before any memory arithmetic


def test_cli_prints_each_sglang_engine_servers_gpus(capsys):
    """The Engines section (megarl.plan.engine_gpus): 70B, TP8 engines, one on every TP group of 8 nodes x 8."""
    assert plan_main(["recipe=llama3_1_70b_grpo"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("\nEngines"):out.index("\nMemory per GPU")]
    assert "pool bundle b on GPU b mod n of node b div n" in section
    every = "GPUs [0, 1, 2, 3, 4, 5, 6, 7] (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7, base_gpu_id 0)"
    assert f"  engine 0: node 0 {every}" in section and f"  engine 4: node 1 {every}" in section
    tp2 = plan_run(load_config(["recipe=qwen2_5_7b_grpo"]), check=False).report()
    assert "  engine 3: node 0 GPUs [6, 7] (CUDA_VISIBLE_DEVICES=6,7, base_gpu_id 0)" in tp2
    hf = plan_run(load_config(["recipe=qwen2_5_7b_grpo", "actor_rollout_ref.rollout.name=hf",
                               "actor_rollout_ref.rollout.tensor_model_parallel_size=null"]), check=False)
    assert "\nEngines" not in hf.report()  # hf engines are not SGLang servers


# --------------------------------------------------------------------------- mixture of experts


def _tiny_moe(kind):
    """A tiny Qwen3-MoE (layer 1 keeps a dense MLP) or Mixtral config, as transformers builds them."""
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], tie_word_embeddings=False)
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_parameter_count_equals_transformers_model(kind):
    """Counted from the weight rules (one tensor per expert) = the parameters of the real HF model (experts fused in
    memory); the checkpoint's tensor shapes as transformers and the family's MoE spec give them."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.convert.hf_io import expected_shapes

    config = _tiny_moe(kind)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    arch = Architecture.from_hf(config, name=kind, source="test")
    assert arch.num_params == sum(p.numel() for p in model.parameters())
    assert arch.num_params == {"qwen3_moe": 63_072, "mixtral": 27_040}[kind]
    shapes, hub = arch.hf_shapes(), expected_shapes(config)
    assert shapes.items() <= hub.items()
    # The rest are transformers' in-memory names of the same tensors (experts fused; Mixtral's router under mlp.).
    assert all(".mlp.experts." in n or n.endswith(".mlp.gate.weight") for n in set(hub) - set(shapes))
    # Activated: all but the experts a token is not routed to, in every sparse layer.
    sparse_layers, experts, expert = {"qwen3_moe": (3, 8, 3 * 16 * 32), "mixtral": (2, 4, 3 * 16 * 32)}[kind]
    assert arch.num_active_params == arch.num_params - sparse_layers * (experts - 2) * expert


def _rank_numel_from_checkpoint_shapes(family, config, *, tp, ep, etp):
    """Parameters of one Megatron rank from the global checkpoint shapes (megarl.convert.preflight): experts
    (``[E, ...]``) divided over EP and ETP, norms and routers whole, everything else over TP."""
    from megarl.convert.preflight import expected_mcore_shapes

    dense = experts = 0
    for name, (shape, _) in expected_mcore_shapes(family, config, tp).items():
        if name.endswith("layer_norm_weight") or re.search(r"mlp\.experts\.linear_fc", name):
            continue  # the TransformerEngine spelling of a tensor listed under its local name too
        numel = math.prod(shape)
        if ".experts.experts." in name:
            experts += numel // ep // etp
        elif "layernorm" in name or name.endswith("router.weight"):
            dense += numel
        else:
            dense += numel // tp
    return dense, experts


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_parameters_per_megatron_rank_at_tp2_ep2(kind):
    """TP 2 (attention, dense MLP, vocabulary), EP 2 with ETP 1 (half the experts, each whole), routers and norms
    replicated: as the global checkpoint shapes split, and as counted by hand."""
    config = _tiny_moe(kind)
    arch = Architecture.from_hf(config, name=kind, source="test")
    counts = arch.rank_param_counts(tp=2, ep=2, etp=1)
    assert tuple(counts) == _rank_numel_from_checkpoint_shapes(arch.family, config, tp=2, ep=2, etp=1)
    h = 32
    attention = ((4 + 2 * 2) * 8 * h + h * 4 * 8) // 2 + 2 * h  # q/k/v and o over TP 2, two norms
    if kind == "qwen3_moe":
        attention += 2 * 8  # per-head q/k norms
        sparse, dense_mlp, experts, ffn = 3, 1, 8, 16
        dense_layer = 3 * 48 * h // 2
    else:
        sparse, dense_mlp, experts, ffn = 2, 0, 4, 16
        dense_layer = 0
    ends = 2 * (128 // 2) * h + h  # embedding and LM head shards, final norm
    assert counts.dense == (sparse + dense_mlp) * attention + sparse * experts * h + dense_mlp * dense_layer + ends
    assert counts.experts == sparse * (experts // 2) * 3 * ffn * h
    # ETP 2: each rank holds half of each of its experts; an engine at TP 2 (no EP) half of every expert.
    assert arch.rank_param_counts(tp=2, ep=2, etp=2).experts == counts.experts // 2
    assert arch.rank_param_counts(tp=2).experts == sparse * experts * 3 * ffn * h // 2


Q30 = {"h": 2048, "L": 48, "A": 32, "G": 4, "D": 128, "E": 128, "k": 8, "f": 768, "V": 151936}


def test_qwen3_30b_a3b_counts_match_the_model_card():
    """Qwen3-30B-A3B: 30.5 B parameters, 3.3 B activated (its model card), from the known config's sizes."""
    arch = Architecture.from_hf(known_config("Qwen3-30B-A3B"), name="q", source="t")
    h, L, A, G, D, E, k, f, V = Q30.values()
    expert = 3 * f * h
    layer = (A + 2 * G) * D * h + h * A * D + 2 * D + 2 * h + E * h  # q/k/v, o, q/k norms, two norms, router
    total = 2 * V * h + h + L * (layer + E * expert)  # untied embedding and LM head, final norm
    assert arch.num_params == total == 30_532_122_624
    assert arch.num_active_params == total - L * (E - k) * expert == 3_353_032_704
    assert round(arch.num_params / 1e9, 1) == 30.5 and 3.3e9 < arch.num_active_params < 3.4e9  # the card's 3.3 B
    assert arch.sparse == (True,) * 48 and (arch.num_experts, arch.topk, arch.moe_ffn) == (128, 8, 768)


def _mla_moe_counts(h, L, dense, A, V, E, k, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, f=18432,
                    moe_f=2048) -> tuple[int, int]:
    """``(total, active)`` parameters of a DeepSeek-V3-architecture model, by hand: multi-latent attention (low-rank
    queries and keys/values with their norms, a decoupled rotary key), ``dense`` dense layers, then ``E`` routed
    experts (``k`` per token), one shared expert and a router with its bias per layer; untied embeddings."""
    attention = (q_lora * h + q_lora + A * (nope + rope) * q_lora + (kv_lora + rope) * h + kv_lora
                 + A * (nope + v) * kv_lora + h * A * v)
    expert = 3 * moe_f * h
    sparse_layer = E * expert + expert + E * h + E  # routed experts, the shared one, the router and its bias
    total = 2 * V * h + h + L * (attention + 2 * h) + dense * 3 * f * h + (L - dense) * sparse_layer
    return total, total - (L - dense) * (E - k) * expert


def test_deepseek_v3_counts_match_the_model_card():
    """DeepSeek-V3: 671 B parameters in the main model, 37 B activated per token (its model card; the 14 B
    multi-token-prediction module is not counted, as RL does not load it), by hand from its config's sizes; its
    KV cache is the latent and the rotary key of each layer, whole on every TP rank."""
    arch = Architecture.from_hf(known_config("DeepSeek-V3"), name="d", source="t")
    total, active = _mla_moe_counts(h=7168, L=61, dense=3, A=128, V=129280, E=256, k=8)
    assert arch.num_params == total == 671_026_419_200
    assert arch.num_active_params == active == 37_552_297_472
    assert round(arch.num_params / 1e9) == 671 and round(arch.num_active_params / 1e9) in (37, 38)
    assert arch.kv_bytes_per_token(8, 2) == arch.kv_bytes_per_token(1, 2) == 61 * (512 + 64) * 2


def test_multi_latent_attention_keeps_its_wider_queries_keys_and_values_and_its_latents():
    """DeepSeek-V3's attention keeps, per token, queries and keys of 128 heads × (128 + 64) and values and the output
    projection's input of 128 × 128 (81,920 elements: 11.4 h, against multi-head attention's 4 h) split over TP, and
    its compressed latents' norms' inputs and outputs (2 × (1,536 + 512)) whole: at TP 8 with sequence parallelism a
    selectively recomputed dense layer keeps (26 h + 2 × 81,920 + 2 × 4,096) / 8 bytes per token, 1.47 × what the
    same layer with multi-head attention would."""
    arch = Architecture.from_hf(known_config("DeepSeek-V3"), name="d", source="t")
    assert arch.attention_activations == {"attention": 128 * (2 * 192 + 2 * 128), "latent": 2 * (1536 + 512)}
    h, T = 7168, 16384
    kw = dict(tokens=T, seq=4096, hidden=h, heads=128, tp=8, recompute="selective")
    mla = activation_bytes_per_layer(**kw, sequence_parallel=True, **arch.attention_activations)
    assert mla == T * (26 * h + 2 * 81920 + 2 * 4096) // 8 == 734_003_200
    assert round(mla / activation_bytes_per_layer(**kw, sequence_parallel=True), 2) == 1.47
    assert activation_bytes_per_layer(**kw, sequence_parallel=False, **arch.attention_activations) == \
        math.ceil(T * (h * (10 + 16 / 8) + 2 * 81920 / 8 + 2 * 4096))
    llama = Architecture.from_hf(known_config("Llama-3.1-70B"), name="l", source="t")
    assert llama.attention_activations == {"attention": 4 * 8192, "latent": 0}  # Korthikanti's count


def test_kimi_k2_counts_match_the_model_card():
    """Kimi-K2: 1 T parameters, 32 B activated (its model card), by hand as DeepSeek-V3's above with its sizes: 64
    heads, 384 experts, one dense layer, a 163,840-token vocabulary."""
    arch = Architecture.from_hf(known_config("Kimi-K2"), name="k", source="t")
    total, active = _mla_moe_counts(h=7168, L=61, dense=1, A=64, V=163840, E=384, k=8)
    assert arch.num_params == total == 1_026_408_232_448
    assert arch.num_active_params == active == 32_861_500_928
    assert round(arch.num_params / 1e12, 2) == 1.03 and round(arch.num_active_params / 1e9) == 33
    assert known_name("moonshotai/Kimi-K2-Instruct") == "Kimi-K2"


def test_glm_4_5_and_qwen3_235b_counts_match_their_model_cards():
    """GLM-4.5: 355 B with its multi-token-prediction layer (a 93rd MoE layer, 3.8 B, not loaded for RL), 32 B
    active besides the embeddings; Qwen3-235B-A22B: 235 B, 22 B active. By hand from their configs' sizes."""
    glm = Architecture.from_hf(known_config("GLM-4.5"), name="g", source="t")
    h, L, dense, A, G, D, V, f, E, k, mf = 5120, 92, 3, 96, 8, 128, 151552, 12288, 160, 8, 1536
    attention = (A + 2 * G) * D * h + (A + 2 * G) * D + A * D * h + 2 * D  # q/k/v with biases, o, q/k norms
    expert = 3 * mf * h
    total = 2 * V * h + h + L * (attention + 2 * h) + dense * 3 * f * h + (L - dense) * (
        E * expert + expert + E * h + E)
    assert glm.num_params == total == 352_797_829_024
    assert round((total + E * expert + expert) / 1e9) == 357  # + the MTP layer's experts: the card says 355 B
    assert glm.num_active_params == total - (L - dense) * (E - k) * expert == 33_632_266_144
    assert round((glm.num_active_params - 2 * V * h) / 1e9) == 32
    qwen = Architecture.from_hf(known_config("Qwen3-235B-A22B"), name="q", source="t")
    h, L, A, G, D, V, E, k, mf = 4096, 94, 64, 4, 128, 151936, 128, 8, 1536
    expert = 3 * mf * h
    layer = (A + 2 * G) * D * h + A * D * h + 2 * D + 2 * h + E * h + E * expert
    total = 2 * V * h + h + L * layer
    assert qwen.num_params == total == 235_093_634_560
    assert qwen.num_active_params == total - L * (E - k) * expert == 22_190_763_520


def test_minimax_m2_counts_match_its_model_card():
    """MiniMax-M2: 230 B parameters, 10 B activated (the card's rounding). By hand from its config's sizes: per layer
    q/k/v/o, q/k norms over all heads (48·128 and 8·128 wide), two layer norms, the router and its bias, 256 experts
    of three 1536 × 3072 projections; untied embeddings and a final norm."""
    arch = Architecture.from_hf(known_config("MiniMax-M2"), name="m", source="t")
    h, L, A, G, D, V, E, k, f = 3072, 62, 48, 8, 128, 200064, 256, 8, 1536
    assert (A + 2 * G) * D * h + A * D * h == 44_040_192 and E * 3 * f * h == 3_623_878_656
    layer = 44_040_192 + (A + G) * D + 2 * h + E * h + E + 3_623_878_656
    assert layer == 3_668_718_848
    total = 2 * V * h + h + L * layer
    assert arch.num_params == total == 228_689_764_864
    assert arch.num_active_params == total - L * (E - k) * 3 * f * h == 11_030_553_088
    assert round(arch.num_params / 1e9) == 229 and round((arch.num_active_params - 2 * V * h) / 1e9) == 10
    shapes = arch.hf_shapes()
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (A * D,)
    assert shapes["model.layers.61.block_sparse_moe.e_score_correction_bias"] == (E,)


@pytest.mark.parametrize("name, vocab, layers, experts, topk, grouped", [
    ("Qwen3-Next-80B-A3B", 151936, 48, 512, 10, True), ("Qwen3.5-35B-A3B", 248320, 40, 256, 8, False)])
def test_hybrid_linear_attention_counts_match_their_model_cards(name, vocab, layers, experts, topk, grouped):
    """Qwen3-Next-80B-A3B: 79.7 B parameters, 3.9 B activated (3.3 B besides the embeddings: "A3B"); Qwen3.5-35B-A3B:
    34.7 B, 3.5 B activated. By hand from the configs' sizes: three of four layers Gated DeltaNet (fused input
    projections 2·K + 2·V + 2·Hv rows, the q/k/v convolution, dt_bias and A_log per value head, a norm of the value
    head's width, the output projection), every fourth gated attention (q_proj twice the heads' width), every layer
    the experts, the shared expert and its gate, two norms. The engines cache keys and values of the attention
    layers only; each sequence's recurrent state is the linear layers'."""
    arch = Architecture.from_hf(known_config(name), name=name, source="t")
    h, A, G, D, f = 2048, 16, 2, 256, 512
    K, V, Hv = 16 * 128, 32 * 128, 32
    linear = (2 * K + 2 * V + 2 * Hv) * h + (2 * K + V) * 4 + 2 * Hv + 128 + V * h
    assert linear == 33_718_464
    full = 2 * A * D * h + 2 * G * D * h + A * D * h + 2 * D
    assert full == 27_263_488
    moe = experts * h + experts * 3 * f * h + 3 * f * h + h
    total = 2 * vocab * h + h + layers // 4 * 3 * linear + layers // 4 * full + layers * (moe + 2 * h)
    active = total - layers * (experts - topk) * 3 * f * h
    assert arch.num_params == total and arch.num_active_params == active
    assert (total, active) == {"Qwen3-Next-80B-A3B": (79_674_391_296, 3_874_929_408),
                               "Qwen3.5-35B-A3B": (34_660_610_688, 3_454_988_928)}[name]
    assert arch.family.linear_attention.grouped == grouped
    assert arch.kv_bytes_per_token(tp=1, dtype_bytes=2) == 2 * (layers // 4) * G * D * 2
    # per linear layer: 32 heads x 128 x 128 fp32 state, and 3 inputs of q, k, v kept for the convolution
    assert arch.recurrent_bytes_per_sequence(tp=1, dtype_bytes=2) == layers // 4 * 3 * (Hv * 128 * 128 * 4
                                                                                        + (2 * K + V) * 3 * 2)


@pytest.mark.parametrize("recipe, gpus, engines, engine_tp, linear_layers", [
    ("qwen3_5_35b_a3b_grpo", 16, 4, 4, 30), ("qwen3_next_80b_a3b_grpo", 32, 4, 8, 36)])
def test_the_hybrid_linear_attention_recipes_fit_and_hold_each_sequences_state(recipe, gpus, engines, engine_tp,
                                                                               linear_layers):
    """Qwen3.5-35B-A3B (2 x 8 H100) and Qwen3-Next-80B-A3B (4 x 8 H100) are planned as fitting; each engine GPU
    holds its share of the batch's linear-attention states (per sequence and linear layer: 32 value heads of 128 x
    128 fp32 over the engine's TP, and 3 inputs of the q/k/v convolution), taken from SGLang's pool before the KV
    cache, which keeps keys and values of the attention layers only."""
    plan = plan_run(load_config([f"recipe={recipe}"]))
    assert plan.fits, plan.problems()
    assert plan.placement.role("actor").dims.world_size == gpus and len(plan.placement.engines) == engines
    rows = 256 * 8 // engines  # train_batch_size x n over the engines
    per_sequence = linear_layers * (32 // engine_tp * 128 * 128 * 4 + (2 * 2048 + 4096) // engine_tp * 3 * 2)
    engine_gpus = [g for g in plan.gpus if g.engine]
    assert engine_gpus and all(g.rows["recurrent_state"] == rows * per_sequence for g in engine_gpus)
    assert all(g.kv_tokens >= 1_000_000 for g in engine_gpus)


FRONTIER = {  # recipe -> (GPUs, GB per GPU, layers per pipeline stage, experts per GPU and sparse layer)
    "deepseek_v3_671b_grpo": (256, 80, (16, 16, 16, 13), 4),
    "kimi_k2_grpo": (256, 141, (16, 16, 16, 13), 6),
    "glm4_5_355b_grpo": (128, 80, (23, 23, 23, 23), 5),
    "qwen3_235b_a22b_grpo": (128, 80, (24, 24, 24, 22), 4),
}


@pytest.mark.parametrize("recipe", FRONTIER)
def test_the_frontier_moe_recipes_fit_their_clusters(recipe):
    """DeepSeek-V3 671B (32 x 8 H100), Kimi-K2 (32 x 8 H200), GLM-4.5 355B and Qwen3-235B-A22B (16 x 8
    H100) are planned as fitting, their layers split over the stages as the recipes say (the last stage lighter
    where they do not split evenly), each GPU holding its share of every sparse layer's experts."""
    gpus, memory, layers, experts = FRONTIER[recipe]
    plan = plan_run(load_config([f"recipe={recipe}"]))
    assert plan.fits, plan.problems()
    assert plan.worst.peak < memory * GiB and plan.gpu_memory_bytes == memory * GiB
    dims = plan.placement.role("actor").dims
    assert dims.world_size == gpus
    assert tuple(dims.stage_layer_counts(plan.model.num_layers)) == layers
    assert plan.model.num_experts // dims.ep == experts
    assert all(g.kv_tokens >= 100_000 for g in plan.gpus if g.engine)


@pytest.fixture(scope="module")
def plan_30b():
    return plan_run(load_config(["recipe=qwen3_30b_a3b_grpo"]))


def test_30b_a3b_recipe_fits_with_experts_split_by_ep(plan_30b):
    """Recipe qwen3_30b_a3b_grpo: 2 nodes x 8, actor TP 2 x PP 2 x DP 4, EP 8 x ETP 1 (expert-DP 1), SGLang TP 4."""
    assert plan_30b.fits and plan_30b.worst.peak < 80 * GiB
    kinds = _kinds(plan_30b)
    assert {k: g.gpus for k, g in kinds.items()} == {"stage 0, engine": tuple(range(8)),
                                                     "stage 1, engine": tuple(range(8, 16))}
    h, L, A, G, D, E, _, f, V = Q30.values()
    layer = ((A + 2 * G) * D * h + h * A * D) // 2 + 2 * D + 2 * h + E * h  # attention over TP 2; norms, router
    dense0 = 24 * layer + V // 2 * h  # 24 layers and the embedding's vocabulary shard (151936 = 2 x 75968)
    dense1 = 24 * layer + V // 2 * h + h  # the LM head's shard and the final norm
    experts = 24 * (E // 8) * 3 * f * h  # 16 of the 128 experts of each of its 24 layers, whole (ETP 1)
    for label, dense in (("stage 0, engine", dense0), ("stage 1, engine", dense1)):
        rows = kinds[label].rows
        assert rows["actor_weights"] == 2 * (dense + experts) == rows["ref_weights"]
        assert rows["actor_grads"] == 4 * (dense + experts)
        # Distributed optimizer: dense parameters over DP 4, experts over expert-DP 1 (= 2 x 8 x 4 / (1 x 8 x 4)).
        assert rows["actor_optimizer"] == math.ceil(12 * dense / 4) + 12 * experts
    # Every engine GPU holds every expert, split over SGLang's TP 4 (151936 = 4 x 37984: no padding).
    engine = L * (((A + 2 * G) * D * h + h * A * D) // 4 + 2 * D + 2 * h + E * h + E * 3 * f * h // 4) \
        + 2 * (V // 4) * h + h
    assert kinds["stage 0, engine"].rows["engine_weights"] == 2 * engine
    report = plan_30b.report()
    assert "3.35 B activated per token" in report and "actor optimizer (Adam, /4 ranks, experts /1)" in report
    assert "experts: ep=8 etp=1 expert-dp=1" in report and "EP groups (2 groups of 8): [0-7] [8-15]" in report


def test_30b_a3b_all_to_all_volume(plan_30b):
    """Per token and sparse layer: dispatch + combine of 8 copies of 2048 bf16 values, 7/8 of them to other EP
    ranks: 2 x 8 x 2048 x 2 x 7/8 = 57344 bytes. Per GPU and step: 256 prompts x 8 samples / DP 4 = 512 rows of
    3072 tokens, halved by sequence parallelism = 786432 tokens, through the stage's 24 sparse layers 5 times (old
    and reference log-probs; forward, recomputed forward and backward of one PPO epoch)."""
    assert all_to_all_bytes_per_token(hidden=2048, topk=8, ep=8, dtype_bytes=2) == 57344
    assert all_to_all_bytes_per_token(hidden=4, topk=2, ep=1, dtype_bytes=2) == 0  # every expert local
    a2a = plan_30b.all_to_all
    assert (a2a.tokens, a2a.sparse_layers, a2a.passes, a2a.link) == (786432, 24, 5, "intra_node")
    assert a2a.step_bytes == 57344 * 786432 * 24 * 5
    assert a2a.seconds == pytest.approx(57344 * 786432 * 24 * 5 / 450e9)
    assert "56.0 KiB per token and sparse layer" in plan_30b.report()
    # One stage over both nodes with EP 16: each EP group spans the nodes, 15/16 of the copies leave the GPU.
    wide = plan_run(load_config(["recipe=qwen3_30b_a3b_grpo", "actor_rollout_ref.actor.parallel.pp=1",
                                 "actor_rollout_ref.actor.parallel.ep=16"]), check=False)
    assert wide.all_to_all.link == "infiniband" and wide.all_to_all.bytes_per_token == 2 * 8 * 2048 * 2 * 15 / 16
    assert plan_run(load_config(["recipe=qwen2_5_7b_grpo"]), check=False).all_to_all is None


def test_30b_a3b_weight_sync_broadcasts_experts_over_ep(plan_30b):
    """Each expert bucket is built on the EP rank holding its experts and broadcast over the EP group: every GPU
    receives 7/8 of its stage's experts (bf16), stages in turn under the tensor transport."""
    h, L, E, f = Q30["h"], Q30["L"], Q30["E"], Q30["f"]
    step = next(s for s in plan_30b.sync.steps if "EP group" in s.what)
    assert step.link == "intra_node" and step.nbytes == L * E * 3 * f * h * 2 * 7 // 8
    assert plan_30b.sync.model_bytes == plan_30b.model.num_params * 2


def test_moe_layer_activations_by_hand():
    """No recompute, TP 1: Korthikanti's 34 T h less the dense MLP's 16 T h, plus per routed copy (k per token) the
    expert's input and output (2 h each) and its gate/up and down activations (6 f), plus fp32 router scores."""
    T, h, a, E, k, f = 4096, 1024, 16, 64, 4, 512
    kw = {"tokens": T, "seq": T, "hidden": h, "heads": a, "experts": E, "topk": k, "expert_ffn": f}
    assert moe_layer_activation_bytes(**kw, tp=1, sequence_parallel=False, recompute=None, etp=1) == \
        34 * T * h - 16 * T * h + T * k * (4 * h + 6 * f) + 8 * T * E
    # TP 2 with SP and ETP 2: the rank routes T/2 tokens and computes its ETP group's copies at half the FFN.
    assert moe_layer_activation_bytes(**kw, tp=2, sequence_parallel=True, recompute="selective", etp=2) == \
        34 * T * h // 2 - 16 * T * h // 2 + T // 2 * k * (2 * h * 3 + 6 * f) + 8 * T // 2 * E
    # Full recompute keeps the layer's input only, as a dense layer does.
    assert moe_layer_activation_bytes(**kw, tp=2, sequence_parallel=True, recompute="full", etp=1) == 2 * T * h // 2


def test_30b_a3b_on_one_node_is_refused_naming_the_keys(capsys):
    """One node of 8 GPUs (TP 2 x PP 2, EP 4): the experts' Adam states alone take 43 GiB per GPU."""
    overrides = ["recipe=qwen3_30b_a3b_grpo", "trainer.nnodes=1", "actor_rollout_ref.actor.parallel.ep=4"]
    with pytest.raises(ValueError, match=r"update actor phase.*actor optimizer .*raise actor_rollout_ref\.actor\."
                                         r"parallel\.ep.*or add nodes \(trainer\.nnodes"):
        plan_run(load_config(overrides))
    assert plan_main(overrides) == 2
    assert "actor_rollout_ref.actor.parallel.ep" in capsys.readouterr().err
    # Layouts Megatron cannot build are refused before any arithmetic, naming the key.
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.parallel\.tp=2 on a mixture-of-experts model "
                                         r"needs parallel\.sequence_parallel=true"):
        plan_run(load_config(["recipe=qwen3_30b_a3b_grpo", "actor_rollout_ref.actor.parallel.sequence_parallel=false"]))


def test_a_step_larger_than_the_drivers_memory_does_not_fit(plan_7b):
    """``megarl-plan`` said "fits" for 10^16 trajectories per step. A step's batch lives on the driver; its
    token ids alone (int64, prompt + response) bound it from below."""
    rows = 512 * 4  # data.train_batch_size x rollout.n of the recipe
    assert plan_7b.trajectories == rows and plan_7b.batch_bytes_at_least == rows * SEQ * 8
    assert "driver: a step's 2,048 trajectories of up to 3,072 tokens take at least 0.05 GiB" in plan_7b.report()
    huge = ["recipe=qwen2_5_7b_grpo", "data.train_batch_size=1000000000000000", "actor_rollout_ref.rollout.n=10",
            "trainer.host_memory_gb=1024"]
    with pytest.raises(ValueError, match=r"a step's 10,000,000,000,000,000 trajectories .* take at least "
                                         r"228881835937.50 GiB on the driver .* more than its 1024.00 GiB "
                                         r"\(trainer.host_memory_gb\): lower data.train_batch_size"):
        plan_run(load_config(huge))
    # Just above and just below the line: 2,048 rows x 3,072 tokens x 8 bytes = 0.046875 GiB.
    with pytest.raises(ValueError, match="trainer.host_memory_gb"):
        plan_run(load_config(["recipe=qwen2_5_7b_grpo", "trainer.host_memory_gb=0.046"]))
    assert plan_run(load_config(["recipe=qwen2_5_7b_grpo", "trainer.host_memory_gb=0.047"])).fits


def test_the_70b_lora_recipe_fits_one_node_with_the_adapters_training_state_only():
    """Rank-64 adapters on every linear layer of Llama-3.1-70B at TP=8 on one 8 x 80 GB node: the base's
    weights stay, gradients and optimizer state are the adapters' (per layer and rank: A whole and B's rows / 8 for
    QKV and fc1, A's columns / 8 and B whole for the output projection and fc2), and no reference model is held."""
    plan = plan_run(load_config(["recipe=llama3_1_70b_lora_grpo"]))
    assert plan.fits and plan.gpu_memory_bytes == 80 * GiB
    gpu, others = plan.gpus  # GPU 0 posts the adapters to the engine: a second copy of them during the sync
    assert (gpu.gpus, others.gpus) == ((0,), tuple(range(1, 8)))
    assert gpu.rows["sync_buffers"] == 2 * others.rows["sync_buffers"]
    h, f, a, g, d, r = 8192, 28672, 64, 8, 128, 64
    adapters = 80 * r * ((h + (a + 2 * g) * d // 8) + (a * d // 8 + h) + (h + 2 * f // 8) + (f // 8 + h))
    layer = ((a + 2 * g) * d * h + h * a * d + 3 * f * h) // 8 + 2 * h
    base = 80 * layer + 2 * 16032 * h + h  # layers, embedding and untied head (128256 / 8 rows each), final norm
    assert gpu.rows["actor_weights"] == 2 * (base + adapters)
    assert gpu.rows["actor_grads"] == 4 * adapters
    assert gpu.rows["actor_optimizer"] == 12 * adapters  # fp32 main + m + v, one data-parallel rank
    assert not gpu.rows.get("ref_weights")
    # The sync moves the adapters alone (tp=1: A and B whole, 80 layers), A once per HF module in PEFT's layout
    # (q, k, v; gate, up): 1.17 % of the merged weights, which lora_sync=merged moves.
    whole = 80 * r * ((h + (a + 2 * g) * d) + (a * d + h) + (h + 2 * f) + (f + h))
    assert plan.model.lora_param_count(plan.cfg.actor_rollout_ref.model.lora_spec) == whole == 702_545_920
    peft = whole + 80 * r * 3 * h
    assert plan.sync.transport == "adapters" and plan.sync.model_bytes == 2 * peft
    assert others.rows["sync_buffers"] == 2 * peft  # the gathered adapters on every actor GPU
    from megarl.plan.report import format_report

    assert f"PEFT's layout in bf16, {2 * peft / 2**20:.1f} MiB into each of 1 engine(s) serving LoRA" in \
        format_report(plan)
    merged = plan_run(load_config(["recipe=llama3_1_70b_lora_grpo", "actor_rollout_ref.rollout.lora_sync=merged"]))
    assert merged.fits and merged.sync.transport == "tensor"
    assert f"the adapters alone (lora_sync=adapters) are {2 * peft / 2**20:.1f} MiB, 1.17 % of them" in \
        format_report(merged)
    without = plan_run(load_config(["recipe=llama3_1_70b_lora_grpo", "actor_rollout_ref.model.lora_rank=0"]),
                       check=False)
    assert not without.fits  # full fine-tuning of the same layout does not fit the node


def test_the_teacher_is_planned_beside_the_student_and_a_teacher_that_does_not_fit_is_named():
    """Qwen2.5-7B teaching Qwen2.5-0.5B on one 8 x 80 GB node: the teacher's own ranks (TP=2, dp=4) hold
    its weights (7B / 2 in bf16) on every GPU in every phase and its forward in its own phase; a forward that does not
    fit names teacher.log_prob_micro_batch_size_per_gpu first."""
    from megarl.plan.report import format_report

    plan = plan_run(load_config(["recipe=qwen2_5_0_5b_distill"]))
    assert plan.fits
    (gpu,) = plan.gpus
    weights = plan.teacher_model.rank_param_counts(tp=2).total * 2
    assert gpu.rows["teacher_weights"] == weights == 7_615_820_800
    assert gpu.phases["teacher"] > gpu.rows["teacher_weights"] + gpu.rows["teacher_forward"]
    assert all(gpu.parts[phase].get("teacher_weights") == weights for phase in gpu.parts)
    text = format_report(plan)
    assert "teacher (teacher.parallel): 8 ranks on pool global, tp=2 pp=1 cp=1 dp=4" in text
    assert "teacher weights (bf16)" in text and "teacher forward (layer+logits)" in text
    tight = load_config(["recipe=qwen2_5_0_5b_distill", "teacher.log_prob_micro_batch_size_per_gpu=64"])
    with pytest.raises(ValueError, match=r"in the teacher phase.*Largest parts: teacher forward \(layer\+logits\) "
                                         r"[\d.]+ GiB: lower teacher.log_prob_micro_batch_size_per_gpu"):
        plan_run(tight)


def test_the_reward_model_is_planned_beside_the_policy():
    """Skywork-Reward-Llama-3.1-8B (a LlamaForSequenceClassification: Llama's body, a one-label head) scoring
    Llama-3.1-8B's responses on one 8 x 80 GB node, its own ranks at TP=2: its weights (body / 2 plus the head, bf16)
    on every GPU in every phase, its forward in its own phase; a forward that does not fit names its key."""
    from megarl.plan.report import format_report

    plan = plan_run(load_config(["recipe=llama3_1_8b_rm_grpo"]))
    assert plan.fits
    (gpu,) = plan.gpus
    rm = plan.scorers["reward_model"]
    assert rm.hf_config.architectures == ["LlamaForSequenceClassification"]
    h, v = 4096, 128256
    body = rm.rank_param_counts(tp=2).total - (v // 2) * h  # one rank's layers and embedding share
    assert gpu.rows["reward_model_weights"] == 2 * (body + h + 1)  # bf16, the value head (weight and bias) whole
    assert set(gpu.parts["reward model"]) >= {"reward_model_weights", "reward_model_forward"}
    assert all(gpu.parts[phase].get("reward_model_weights") == gpu.rows["reward_model_weights"] for phase in gpu.parts)
    assert "reward_model (reward_model.parallel): 8 ranks on pool global, tp=2" in format_report(plan)
    tight = load_config(["recipe=llama3_1_8b_rm_grpo", "reward_model.micro_batch_size_per_gpu=512"])
    with pytest.raises(ValueError, match=r"in the reward model phase.*reward model forward \(one layer\) [\d.]+ GiB: "
                                         r"lower reward_model.micro_batch_size_per_gpu"):
        plan_run(tight)


def test_a_judge_is_planned_on_its_own_pool_and_one_without_room_is_refused_naming_the_key():
    """Qwen2.5-7B judging on its own node (four SGLang engines of TP=2): each judge GPU holds its weights'
    TP shard (bf16, the vocabulary padded as SGLang pads it) and a KV cache of gpu_memory_utilization x GPU less the
    context and the weights (hand-computed here); a cache smaller than one judge request is refused naming the keys."""
    from megarl.models.family import sglang_padded_vocab
    from megarl.plan.report import format_report

    plan = plan_run(load_config(["recipe=qwen2_5_7b_judge_grpo"]))
    assert plan.fits and plan.judge is not None
    judge = plan.judge
    assert (judge.num_engines, judge.tp, judge.engine) == (4, 2, "sglang")
    h, layers, ffn, kv_heads, head_dim, vocab = 3584, 28, 18944, 4, 128, 152064
    assert sglang_padded_vocab(vocab, 2) == vocab
    per_layer = (h * h + h) + 2 * (kv_heads * head_dim * h + kv_heads * head_dim) + h * h + 3 * h * ffn + 2 * h
    shard = (per_layer * layers) // 2 + 2 * (vocab // 2) * h + h  # attention/MLP split, embedding and head split
    assert abs(judge.weights - 2 * shard) <= 2 * 8 * h * layers  # up to the norms' and biases' TP split
    assert judge.kv_cache == int(0.85 * 80 * (1 << 30)) - CUDA_CONTEXT_BYTES - judge.weights
    per_token = layers * 2 * (kv_heads // 2) * head_dim * 2  # K and V, this rank's 2 KV heads, bf16
    assert judge.kv_tokens == judge.kv_cache // per_token and judge.request_tokens == 3072 + 512
    assert "judge (Qwen2.5-7B-Instruct, 7.62 B parameters): 4 sglang engine(s) of TP 2 on pool judge" in \
        format_report(plan)
    assert "pool judge: 8 GPUs on 1 node(s)" in format_report(plan)
    starved = load_config(["recipe=qwen2_5_7b_judge_grpo", "reward_model.judge.rollout.gpu_memory_utilization=0.09"])
    with pytest.raises(ValueError, match=r"the judge's sglang engines would hold 0 tokens of KV cache per engine, less "
                                         r"than one 3,584-token judge request .*raise "
                                         r"reward_model.judge.rollout.gpu_memory_utilization \(now 0.09\)"):
        plan_run(starved)
    big = load_config(["recipe=qwen2_5_7b_judge_grpo", "reward_model.judge.rollout.tensor_model_parallel_size=1",
                       "reward_model.judge.rollout.gpu_memory_utilization=1.0", "trainer.gpu_memory_gb=12"])
    with pytest.raises(ValueError, match=r"the judge's sglang engines need [\d.]+ GiB per GPU \(weights 14.19 GiB\), "
                                         r"more than 12.00 GiB: raise reward_model.judge.rollout.tensor_model_parallel"):
        plan_run(big)


def test_fp8_engines_hold_their_linear_weights_in_one_byte():
    """With rollout.quantization=fp8 an engine GPU holds its linear weights' TP shard in FP8 (1 byte, an
    fp32 scale per 128 x 128 block) and the rest in BF16; SGLang's KV pool gets what that frees."""
    bf16 = plan_run(load_config(["recipe=llama3_1_70b_grpo"]))
    fp8 = plan_run(load_config(["recipe=llama3_1_70b_grpo", "actor_rollout_ref.rollout.quantization=fp8"]))
    model = fp8.model
    linear = model.engine_fp8_params(8)
    total = bf16.gpus[0].rows["engine_weights"] // 2
    assert linear / total > 0.95  # 70B: all but the embedding, head and norms
    assert fp8.gpus[0].rows["engine_weights"] == (total - linear) * 2 + linear + 4 * math.ceil(linear / 128 ** 2)
    assert fp8.gpus[0].kv_tokens > bf16.gpus[0].kv_tokens
    assert "engine weights (block FP8 linear, bf16, TP 8)" in fp8.report()


def test_an_fp8_sync_moves_the_quantized_bytes_and_holds_two_more_buffers():
    """The engines of the 70B recipe receive its FP8 buckets: 0.515 of the BF16 bytes (as
    tools/bench_fp8_sync.py measures over the same layout), and each sending GPU holds two quantized bucket buffers
    more, and the transients of quantizing one row of blocks (128 rows) of the widest weight, down_proj's
    (K = 28672: 12 bytes per element)."""
    bf16 = plan_run(load_config(["recipe=llama3_1_70b_grpo"]))
    fp8 = plan_run(load_config(["recipe=llama3_1_70b_fp8_grpo"]))
    assert fp8.sync.model_bytes / bf16.sync.model_bytes == pytest.approx(0.5150, abs=5e-4)
    assert "full HF tensors in block FP8 (linear weights) and bf16" in fp8.report()
    # Every GPU hosts an engine rank here (one engine per TP group): each adds two buffers of the largest bucket, the
    # one holding the embedding alone (128256 x 8192 in bf16, stays bf16), larger than the 1 GiB budget.
    added = {gpu.rows["sync_buffers"] - next(g for g in bf16.gpus if g.gpus == gpu.gpus).rows["sync_buffers"]
             for gpu in fp8.gpus}
    assert len(added) == 1 and added.pop() == pytest.approx(2 * 128256 * 8192 * 2 + 12 * 128 * 28672, rel=1e-4)


def test_the_vision_language_recipe_plans_its_tower_on_the_first_stage(capsys):
    """Qwen2.5-VL-7B (the hub's 8.29 B parameters): its 0.68 B-parameter vision tower sits whole on every TP rank
    of the actor's first stage, besides the language model's share."""
    arch = Architecture.from_hf(known_config("Qwen2.5-VL-7B"), name="vl", source="t")
    assert round(arch.num_params / 1e9, 2) == 8.29
    text = Architecture.from_hf(known_config("Qwen2.5-7B"), name="t", source="t")
    tower = arch.num_params - text.num_params
    assert round(tower / 1e9, 2) == 0.68
    assert arch.rank_params(tp=2, pipeline=PP2, pp_rank=0) - text.rank_params(tp=2, pipeline=PP2, pp_rank=0) == tower
    assert arch.rank_params(tp=2, pipeline=PP2, pp_rank=1) == text.rank_params(tp=2, pipeline=PP2, pp_rank=1)
    assert plan_main(["recipe=qwen2_5_vl_7b_grpo"]) == 0
    out = capsys.readouterr().out
    assert "layers 0-27 + vision tower (whole on each TP rank), embedding" in out and "fits:" in out
