"""Vision-language rollouts: image prompts in verl's format go through sglang-router to megarl's CPU
engine server (``image_data``), which generates what transformers generates, token for token (greedy; Qwen2.5-VL
and Qwen3-VL); the
Megatron actor (TP=2 × PP=2, packed) recomputes the sampled tokens' log-probs within 1e-5 of the engine's and
takes PPO steps on them, the images reaching its first stage."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.parallel.launch import run_ranks
from megarl.sync import merge_stats
from tests.distributed import vision_jobs
from tests.engine_servers import engine_servers

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megarl.models.tiny import save_tiny_vl

    root = tmp_path_factory.mktemp("vl_rollout")
    hf_dir = save_tiny_vl(root / "model", seed=1, initializer_range=0.3)  # a random model whose outputs vary
    data = root / "prompts.parquet"
    vision_jobs.write_image_prompts(data)
    return root, str(hf_dir), str(data)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_greedy_rollout_equals_transformers_generate(tiny, arch):
    from transformers import AutoModelForImageTextToText

    from megarl.data.images import ImageProcessor
    from megarl.models.hf_config import load_hf_config
    from megarl.models.tiny import save_tiny_vl

    root, hf_dir, data = tiny
    if arch != "qwen2_5_vl":
        hf_dir = str(save_tiny_vl(root / arch, seed=1, arch=arch, initializer_range=0.3))
    batch = vision_jobs.image_rollout(hf_dir, data, str(root / f"greedy_logs_{arch}"), n=1, temperature=0.0)
    model = AutoModelForImageTextToText.from_pretrained(hf_dir).eval()
    processor = ImageProcessor.from_pretrained(hf_dir, None, load_hf_config(hf_dir))
    assert [x is not None for x in batch["multi_modal_inputs"]] == [True, True, False]
    for row in range(len(batch)):
        prompt = batch["prompts"][row][batch["attention_mask"][row, :batch["prompts"].shape[1]].bool()][None]
        inputs = batch["multi_modal_inputs"][row] or {}
        with torch.no_grad():
            expected = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=8, mm_token_type_ids=(prompt == processor.image_token_id).int(),
                                      eos_token_id=None, **inputs)[0, prompt.shape[1]:]
        eos = model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or [])
        stop = next((i + 1 for i, t in enumerate(expected.tolist()) if t in eos), len(expected))  # the engine's end
        assert batch["responses"][row, :int(batch["response_mask"][row].sum())].tolist() == expected[:stop].tolist()


@pytest.mark.slow
def test_actor_recomputes_the_engines_log_probs_and_learns(tiny):
    root, hf_dir, data = tiny
    batch = vision_jobs.image_rollout(hf_dir, data, str(root / "sampled_logs"), n=4, temperature=TEMPERATURE)
    from megarl.models.hf_config import load_hf_config

    image = load_hf_config(hf_dir).image_token_id
    grids = batch["multi_modal_inputs"][0]["image_grid_thw"]
    assert batch["prompts"][0].tolist().count(image) == int(grids.prod(-1).sum()) // 4  # expanded for the trainer
    with engine_servers(hf_dir, root / "sync_logs", num_engines=1, tp_size=2) as servers:
        engine = {"index": 0, "url": servers.processes[0].url, "tp": 2}
        cases = [("tensor", [{**engine, "host_ranks": (0, 1)}]), ("distributed", [{**engine, "replica": 0}])]
        results = run_ranks(vision_jobs.actor_job, 4, hf_dir, batch, TEMPERATURE, cases, timeout_s=600)
    (output,) = [r for r in results if r["output_rank"]]
    assert output["mismatch"]["mismatch/abs_logp_diff_max"] <= 1e-5
    for r in results:
        assert len(r["steps"]) == 2 and all(applied and math.isfinite(loss) for applied, loss, _ in r["steps"])
    assert any(norm > 0 for _, _, norm in output["steps"])
    # Both transports took every weight to the engine, the vision tower's (checkpoint names) among them: each one
    # read whole from the engine equals the trainer's. SGLang's Qwen2.5-VL cannot read weights back: the
    # transport's verification reports the engine unverified.
    for transport in ("tensor", "distributed"):
        cases = [case for r in results for case in r["sync"] if case[0] == transport]
        tower = cases[0][3]
        (differ,) = [case[4] for case in cases if case[4] is not None]
        assert tower > 0 and differ == [], (transport, differ[:5])
        merged = merge_stats([stats for _, stats, _, _, _ in cases if stats])
        assert merged["weight_sync/verified_tensors"] == 0 and merged["weight_sync/verified_engines"] == 0
        assert merged["weight_sync/engines"] == 1
