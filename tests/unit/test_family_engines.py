"""megarl's CPU engine serves the 2026 families through transformers as SGLang serves them: greedy rollouts of a
batch (left-padded, a KV cache) equal transformers' own ``generate`` row by row, and a weight update under the
checkpoint's names (what the trainer's export sends; the multi-token-prediction layers it skips left out) makes the
engine another checkpoint's model exactly."""

from __future__ import annotations

import pytest
import torch

from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.engine import SamplingParams, update_weights
from megarl.models.tiny import build_tiny_tokenizer
from tests.distributed import moe_jobs

FAMILIES = ["minimax_m2"]
PROMPTS = [[5, 9, 31, 4, 17, 2], [8, 3], [40, 41, 42, 43]]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_rollouts_equal_transformers_generate(name, tmp_path):
    from transformers import AutoModelForCausalLM

    moe_jobs.save_tiny_moe(name, tmp_path, seed=2)
    build_tiny_tokenizer(moe_jobs.VOCAB).save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path), seed=0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    outputs = engine.generate(PROMPTS, greedy)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                                      pad_token_id=0)
        assert output.output_ids == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_an_update_by_the_checkpoints_names_makes_the_engine_that_model(name, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.models import family_for

    target = moe_jobs.save_tiny_moe(name, tmp_path, seed=1)
    cfg = moe_jobs.tiny_moe_config(name)
    engine = HFEngine(AutoModelForCausalLM.from_config(cfg), build_tiny_tokenizer(moe_jobs.VOCAB))
    tensors = load_file(tmp_path / "model.safetensors")
    skipped = set(family_for(cfg).skipped_tensors(cfg, tensors))
    sent = {n: t for n, t in tensors.items() if n not in skipped}
    assert skipped and all(n in engine._params for n in sent)
    update_weights(engine, [list(sent.items())])
    ids = torch.randint(0, moe_jobs.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, target(input_ids=ids).logits)
    assert all(torch.equal(engine._params[n], t) for n, t in sent.items())
