"""SGLangEngine's pieces that run without a GPU, and (``gpu``) the real engine.

The payload test decodes what the adapter would send with sglang's own classes, in a child
process: importing sglang patches transformers and sets cache environment variables, which
must not leak into the other tests of this process. It needs sglang 0.5.23 installed with
``--no-deps`` plus the few pure-Python packages its utilities import (see the CI extras).
"""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from megarl.models.sampling import derive_row_seed
from megarl.rollout.engine import FinishReason, SamplingParams
from megarl.rollout.sglang_engine import generate_output_from_sglang, sglang_sampling_params

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="needs sglang==0.5.23 (pip install --no-deps) and its utility imports")

CHILD = textwrap.dedent("""
    import json
    import torch
    from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer
    from megarl.rollout.sglang_engine import flattened_bucket_payloads
    from sglang.srt.utils import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    model = build_tiny_model(build_tiny_tokenizer())
    named = [(name, p.detach().to(torch.bfloat16 if i % 2 else torch.float32))
             for i, (name, p) in enumerate(model.named_parameters())]
    named.append(("extra.int_buffer", torch.arange(7, dtype=torch.int32)))
    tp_size = 2
    payloads = flattened_bucket_payloads(named, tp_size)
    report = {"num_payloads": len(payloads), "types": sorted({type(p).__name__ for p in payloads}), "ranks": []}
    expected = dict(named)
    for payload in normalize_serialized_named_tensor_payloads(payloads):  # what the tokenizer manager does
        data = MultiprocessingSerializer.deserialize(payload)  # SGLang's restricted unpickler
        # As SGLang's scheduler rebuilds a flattened_bucket update before model.load_weights:
        metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                            end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
        decoded = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata)
        tensors = decoded.reconstruct_tensors()
        report["ranks"].append({
            "names": sorted(name for name, _ in tensors),
            "mismatched": [name for name, t in tensors
                           if t.dtype != expected[name].dtype or t.shape != expected[name].shape
                           or not torch.equal(t, expected[name])],
        })
    report["expected_names"] = sorted(expected)
    for bad, kwargs in (("empty", dict(named_tensors=[], tp_size=1)), ("tp0", dict(named_tensors=named, tp_size=0))):
        try:
            flattened_bucket_payloads(**kwargs)
        except ValueError as error:
            report[bad] = str(error)
    print("REPORT" + json.dumps(report))
""")


@needs_sglang
def test_flattened_bucket_payload_round_trips_through_sglang():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT", 1)[1])
    assert report["num_payloads"] == 2 and report["types"] == ["bytes"]
    assert len(report["ranks"]) == 2
    for rank in report["ranks"]:
        assert rank["names"] == report["expected_names"]
        assert rank["mismatched"] == []
    assert "non-empty bucket" in report["empty"]
    assert "tp_size >= 1" in report["tp0"]


def test_sampling_params_mapping():
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(5, 6), seed=3)
    rows = sglang_sampling_params(params, 3, seeded=True)
    assert rows[0] == {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "ignore_eos": False,
                       "no_stop_trim": True, "stop_token_ids": [5, 6], "sampling_seed": derive_row_seed(3, 0)}
    assert [r["sampling_seed"] for r in rows] == [derive_row_seed(3, i) for i in range(3)]
    unseeded = sglang_sampling_params(params, 2, seeded=False)
    assert all("sampling_seed" not in r for r in unseeded)
    greedy = sglang_sampling_params(SamplingParams(max_new_tokens=4, temperature=0), 1, seeded=True)[0]
    assert greedy["temperature"] == 0 and "stop_token_ids" not in greedy and "sampling_seed" not in greedy


def test_output_mapping():
    result = {"output_ids": [7, 8, 2],
              "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                            "output_token_logprobs": [(-0.5, 7, None), (-1.25, 8, None), (-0.125, 2, None)]}}
    output = generate_output_from_sglang(result, return_logprob=True)
    assert output.output_ids == [7, 8, 2] and output.finish_reason == FinishReason.STOP
    assert output.output_logprobs == [-0.5, -1.25, -0.125]
    result["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert generate_output_from_sglang(result, return_logprob=False).finish_reason == FinishReason.LENGTH
    assert generate_output_from_sglang(result, return_logprob=False).output_logprobs is None
    result["meta_info"]["finish_reason"] = None
    with pytest.raises(RuntimeError, match="unfinished output"):
        generate_output_from_sglang(result, return_logprob=False)


@pytest.mark.gpu
@needs_sglang
def test_sglang_engine_generates_and_updates_weights(tmp_path):
    """The real engine: log-probs close to HF's forward, then a bucketed update to new weights."""
    from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny
    from megarl.rollout.engine import update_weights
    from megarl.rollout.hf_engine import HFEngine
    from megarl.rollout.sglang_engine import SGLangEngine

    sizes = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1}
    model_dir = save_tiny(tmp_path / "tiny", seed=0, **sizes)
    tokenizer = build_tiny_tokenizer()
    prompts = [tokenizer.encode(t) for t in ["What is 3 + 4?", "Hi", "#### 12"]]
    engine = SGLangEngine(str(model_dir), tp_size=1, mem_fraction_static=0.3, dtype="float32",
                          port=30011, disable_cuda_graph=True)
    try:
        params = SamplingParams(max_new_tokens=8, temperature=0.8)
        outputs = engine.generate(prompts, params, return_logprob=True)
        reference = HFEngine(str(model_dir), device="cuda")
        for prompt, output in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + output.output_ids], device="cuda")
            with torch.no_grad():
                logits = reference.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            expected = torch.log_softmax(logits / 0.8, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(output.output_logprobs), expected.cpu(), atol=2e-3, rtol=0)

        new_model = build_tiny_model(tokenizer, seed=1, **sizes)
        named = [(name, p.detach().cuda()) for name, p in new_model.named_parameters()]
        update_weights(engine, [named[i::3] for i in range(3)])
        fresh = HFEngine(new_model, tokenizer, device="cuda")
        greedy = SamplingParams(max_new_tokens=8, temperature=0)
        assert [o.output_ids for o in engine.generate(prompts, greedy)] == \
            [o.output_ids for o in fresh.generate(prompts, greedy)]
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
    finally:
        engine.shutdown()
