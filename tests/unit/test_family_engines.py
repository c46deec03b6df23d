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
from tests.distributed import family_jobs, moe_jobs

FAMILIES = ["minimax_m2", "qwen3_5", "qwen3_5_moe", "qwen3_next"]


def _save(name: str, directory, seed: int):
    """The family's tiny checkpoint (and a tokenizer) saved under ``directory``: the model and its config."""
    if name in family_jobs.FAMILIES:
        return family_jobs.save_tiny(name, directory, seed=seed), family_jobs.tiny_config(name)
    model = moe_jobs.save_tiny_moe(name, directory, seed=seed)
    build_tiny_tokenizer(moe_jobs.VOCAB).save_pretrained(directory)
    return model, moe_jobs.tiny_moe_config(name)
PROMPTS = [[5, 9, 31, 4, 17, 2], [8, 3], [40, 41, 42, 43]]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_rollouts_equal_transformers_generate(name, tmp_path):
    from transformers import AutoModelForCausalLM

    _save(name, tmp_path, seed=2)
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

    target, cfg = _save(name, tmp_path, seed=1)
    engine = HFEngine(AutoModelForCausalLM.from_config(cfg), build_tiny_tokenizer(moe_jobs.VOCAB))
    tensors = load_file(tmp_path / "model.safetensors")
    skipped = set(family_for(cfg).skipped_tensors(cfg, tensors))
    sent = {n: t for n, t in tensors.items() if n not in skipped}
    assert bool(skipped) == (name in ("minimax_m2", "qwen3_next")) and all(n in engine._params for n in sent)
    update_weights(engine, [list(sent.items())])
    ids = torch.randint(0, moe_jobs.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, target(input_ids=ids).logits)
    assert all(torch.equal(engine._params[n], t) for n, t in sent.items())


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_a_rebuilt_rollout_resumes_with_the_same_recurrent_state(name, tmp_path):
    """A retracted rollout (the engine's REBUILD: every token so far recomputed into a fresh cache, as after a weight
    update) goes on from the Gated DeltaNet state of one pass over prompt and tokens so far: with the weights
    unchanged, greedy decoding rebuilt at every step equals uninterrupted decoding, and so does one paused in place
    (the cache kept). Left-padded rows included (their padding must not reach the recurrent state)."""
    from megarl.models.sampling import REBUILD

    _save(name, tmp_path, seed=3)
    engine = HFEngine(str(tmp_path), seed=0)
    greedy = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)
    plain = engine.generate_rows(PROMPTS, greedy, True, [0, 1, 2])
    steps = []

    def rebuild_every_step():
        steps.append(1)
        return REBUILD

    rebuilt = engine.generate_rows(PROMPTS, greedy, True, [0, 1, 2], control=rebuild_every_step)
    paused = engine.generate_rows(PROMPTS, greedy, True, [0, 1, 2], control=lambda: None)
    assert len(steps) == 6  # between the 7 steps
    for a, b, c in zip(plain, rebuilt, paused, strict=True):
        assert a.output_ids == b.output_ids == c.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)) <= 1e-5
