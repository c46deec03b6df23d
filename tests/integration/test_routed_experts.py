"""Routed experts from the engines (routing replay): what the CPU engine returns, over SGLang's wire.

The engine captures the top-k experts of every token it computes (prompt and sampled, the last sampled one excepted:
SGLang's ``[seqlen - 1, num_hidden_layers, top_k]``); the numbers are checked against one teacher-forced forward of
the whole sequence through the same HF model, then through a real server process and sglang-router.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megarl.engines.client import run_sync
from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.engine import SamplingParams
from megarl.models.tiny import build_tiny_tokenizer
from tests.distributed import family_jobs, moe_jobs
from tests.engine_servers import engine_servers

PROMPTS = [[5, 9, 31, 4, 17, 2], [8, 3], [40, 41, 42, 43]]
PARAMS = SamplingParams(max_new_tokens=7, temperature=1.0, seed=11)


def teacher_forced_routing(model, ids: list[int]) -> np.ndarray:
    """``[len(ids), num_layers, top_k]``: the experts of each token in one forward over ``ids`` (zeros on dense
    layers)."""
    from megarl.engines.cpu_engine.model_facts import routers as _routers

    routers, captured = _routers(model), {}
    handles = [router.register_forward_hook(lambda m, a, out, layer=layer: captured.__setitem__(layer, out[2]))
               for layer, router in routers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    topk = next(iter(captured.values())).shape[-1]
    out = np.zeros((len(ids), model.config.num_hidden_layers, topk), dtype=np.int32)
    for layer, indices in captured.items():
        out[:, layer] = indices.numpy()
    return out


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Tiny Qwen3-MoE, Mixtral, MiniMax-M2 (a sigmoid router with a bias) and Qwen3.5-MoE (linear attention between
    the routers) checkpoints with a tokenizer, by name."""
    out = {}
    for name in ("qwen3_moe", "mixtral", "minimax_m2"):
        out[name] = tmp_path_factory.mktemp(name)
        moe_jobs.save_tiny_moe(name, out[name], seed=2)
        build_tiny_tokenizer(moe_jobs.VOCAB).save_pretrained(out[name])
    out["qwen3_5_moe"] = tmp_path_factory.mktemp("qwen3_5_moe")
    family_jobs.save_tiny("qwen3_5_moe", out["qwen3_5_moe"], seed=2)
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "minimax_m2", "qwen3_5_moe"])
def test_the_engine_returns_the_experts_of_every_computed_token(moe_dirs, name):
    """Batched, left-padded decoding with a KV cache routes each token as one forward over the whole sequence does
    (exactly, fp32); Qwen3-MoE's dense layer 1 holds zeros; the last sampled token has no routing."""
    engine = HFEngine(moe_dirs[name], seed=0)
    outputs = engine.generate_rows(PROMPTS, PARAMS, False, [1, 2, 3], return_routed_experts=True)
    layers, topk = engine.model.config.num_hidden_layers, engine.model.config.num_experts_per_tok
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        routed = output.routed_experts
        assert routed.dtype == np.int32 and routed.shape == (len(prompt) + len(output.output_ids) - 1, layers, topk)
        expected = teacher_forced_routing(engine.model, prompt + output.output_ids[:-1])
        np.testing.assert_array_equal(np.sort(routed, axis=-1), np.sort(expected, axis=-1))
    if engine.model.config.model_type == "qwen3_moe":
        assert not outputs[0].routed_experts[:, 1].any()  # mlp_only_layers=[1]
    # Every expert is used somewhere, and a token's k experts are distinct.
    everything = np.concatenate([o.routed_experts for o in outputs])
    sparse = everything[:, [0, 2, 3]]
    assert set(np.unique(sparse)) == set(range(4))
    assert (sparse[..., 0] != sparse[..., 1]).all()
    # Without the flag: nothing captured, and a dense model refuses the request.
    assert engine.generate_rows(PROMPTS[:1], PARAMS, False, [1])[0].routed_experts is None


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_retracted_batch_returns_the_routing_of_the_rebuilt_pass(moe_dirs, name):
    """A rebuild after a weight change (retract) recomputes every token: its routing is the new weights'."""
    from megarl.models.sampling import REBUILD

    engine = HFEngine(moe_dirs[name], seed=0)
    steps = []

    def control():
        steps.append(1)
        if len(steps) == 3:  # change the router of layer 0, then rebuild the KV cache
            with torch.no_grad():
                engine.routers[0][1].weight.mul_(-1)
            return REBUILD
        return None

    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    output, = engine.generate_rows(PROMPTS[:1], greedy, False, [0], control=control, return_routed_experts=True)
    assert len(output.output_ids) == 6
    routed = output.routed_experts
    fed = PROMPTS[0] + output.output_ids[:-1]
    after = teacher_forced_routing(engine.model, fed)
    # Up to the rebuild (prompt + 3 tokens) every token was recomputed by the new weights; later ones too.
    np.testing.assert_array_equal(np.sort(routed, axis=-1), np.sort(after, axis=-1))


def test_the_manager_brings_every_rows_routing_from_the_engine_servers(moe_dirs, tmp_path):
    """Two servers launched with --enable-return-routed-experts: a training batch of 3 prompts × n=2 carries
    ``rollout_routed_experts`` [N, P+R, layers, top_k], each row's routed tokens at its columns equal to one
    teacher-forced forward, experts 0..k-1 elsewhere. Requests go to the engines directly: through sglang-router
    0.3.2 the answer has no routed experts (the router drops the request field; checked here so an upgrade that
    forwards it shows). SGLang's ``routed_experts_start_len`` cuts the front; an answer without them names the launch flag."""
    from megarl.config import RolloutConfig
    from megarl.data.dataset import collate
    from megarl.rollout.manager import RolloutManager

    moe_dir = moe_dirs["qwen3_moe"]
    engine = HFEngine(moe_dir, seed=0)
    config = engine.model.config
    shape = (config.num_hidden_layers, config.num_experts_per_tok)
    P, R = 8, 6
    batch = collate([{"input_ids": torch.tensor(p)} for p in PROMPTS], pad_token_id=0, pad_to=P)
    with engine_servers(moe_dir, tmp_path, num_engines=2, router=True,
                        extra_args=["--enable-return-routed-experts"]) as servers:
        manager = RolloutManager(servers.generator, servers.engines, engine.tokenizer, RolloutConfig(n=2),
                                 prompt_length=P, response_length=R, routing_shape=shape)
        out = manager.generate(batch, seed=3)
        routed = out["rollout_routed_experts"]
        assert routed.shape == (6, P + R, *shape) and routed.dtype == torch.uint8
        fallback = torch.arange(shape[1], dtype=torch.uint8)
        for row in range(6):
            mask = out["attention_mask"][row].bool()
            ids = out["input_ids"][row][mask].tolist()
            first = int(mask.int().argmax())
            expected = teacher_forced_routing(engine.model, ids[:-1])
            got = routed[row, first:first + len(ids) - 1].numpy()
            np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(expected, axis=-1))
            others = torch.ones(P + R, dtype=torch.bool)
            others[first:first + len(ids) - 1] = False
            assert (routed[row, others] == fallback).all()
        assert "rollout_routed_experts" not in manager.generate(batch, validate=True)
        # Through the router the field does not come back, and the client says what an engine without the flag
        # would be missing.
        answer = run_sync(servers.generator.call("/generate", input_ids=PROMPTS[0], return_routed_experts=True,
                                                 sampling_params={"max_new_tokens": 2}))
        assert "routed_experts" not in answer["meta_info"]
        with pytest.raises(RuntimeError, match="launched with --enable-return-routed-experts"):
            run_sync(servers.generator.generate(PROMPTS[0], PARAMS, routing_shape=shape))
        single = run_sync(servers.engines[0].call("/generate", input_ids=PROMPTS[0], return_routed_experts=True,
                                                  routed_experts_start_len=4,
                                                  sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                                   "ignore_eos": True}))
        flat = np.frombuffer(base64.b64decode(single["meta_info"]["routed_experts"]), dtype=np.int32)
        assert flat.size == (len(PROMPTS[0]) - 4 + 3 - 1) * shape[0] * shape[1]
        with pytest.raises(Exception, match=r"routed_experts_start_len=7 must be in \[0, 6\]"):
            run_sync(servers.engines[0].call("/generate", input_ids=PROMPTS[0], return_routed_experts=True,
                                             routed_experts_start_len=7, sampling_params={"max_new_tokens": 1}))
