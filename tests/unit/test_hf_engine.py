"""HFEngine: log-probs equal a separate forward's, sampling controls, stops, seeds, weight updates, sessions."""

import asyncio
import copy
import dataclasses

import pytest
import torch

from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.engine import FinishReason, RolloutEngine, SamplingParams, update_weights, weight_update_session
from megarl.models.sampling import truncate_probs
from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer
from megarl.seeds import derive_row_seed

TEXTS = ["What is 3 + 4?", "Hi", "The quick brown fox jumps over the lazy dog.", "#### 12"]


def eos_prone(model, tokenizer, alpha: float = 5.0):
    """``model`` with the EOS embedding (tied to its output row) pointed along the mean final hidden
    state, so that sampling at T=1 ends a good share of short generations with EOS."""
    with torch.no_grad():
        hidden = [model(input_ids=torch.tensor([tokenizer.encode(t)]), output_hidden_states=True).hidden_states[-1][0]
                  for t in TEXTS]
        mean = torch.cat(hidden).mean(dim=0)
        model.get_input_embeddings().weight[tokenizer.eos_token_id] = alpha * mean / mean.dot(mean)
    return model


def forward_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at ``output`` from one unpadded full forward over prompt ‖ output."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture
def engine(model, tokenizer):
    return HFEngine(copy.deepcopy(model), tokenizer, seed=0)


def test_implements_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.eos_token_ids == (engine.tokenizer.eos_token_id,)


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.9, 50), (1.3, 1.0, -1), (0.0, 1.0, -1)])
def test_logprobs_equal_a_separate_forward(engine, prompts, temperature, top_p, top_k):
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=5)
    outputs = engine.generate(prompts, params, return_logprob=True)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.output_logprobs) == len(output.output_ids) >= 1
        reference = forward_logprobs(engine.model, prompt, output.output_ids, temperature or 1.0)
        torch.testing.assert_close(torch.tensor(output.output_logprobs), reference, atol=1e-5, rtol=0)


def test_greedy_is_argmax_and_logprobs_only_on_request(engine, prompts):
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_logprobs is None
        ids = list(prompt)
        for token in output.output_ids:
            with torch.no_grad():
                assert engine.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item() == token
            ids.append(token)


def test_top_k_1_and_tiny_top_p_equal_greedy(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), return_logprob=True)
    for params in (SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1, seed=1),
                   SamplingParams(max_new_tokens=10, temperature=0.8, top_p=1e-6, seed=2)):
        sampled = engine.generate(prompts, params, return_logprob=True)
        assert [o.output_ids for o in sampled] == [o.output_ids for o in greedy]
        for prompt, output in zip(prompts, sampled, strict=True):
            # Log-probs stay those of the full tempered distribution, before truncation.
            reference = forward_logprobs(engine.model, prompt, output.output_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(output.output_logprobs), reference, atol=1e-5, rtol=0)


def test_truncate_probs():
    probs = torch.tensor([[0.125, 0.5, 0.25, 0.125]])
    assert truncate_probs(probs, 2, 1.0).tolist() == [[0.0, 0.5, 0.25, 0.0]]
    # Mass before 0.25 is 0.5 <= 0.6: kept; mass before the next is 0.75 > 0.6: dropped.
    assert truncate_probs(probs, -1, 0.6).tolist() == [[0.0, 0.5, 0.25, 0.0]]
    assert truncate_probs(probs, -1, 0.4).tolist() == [[0.0, 0.5, 0.0, 0.0]]
    assert truncate_probs(probs, -1, 1.0) is probs


def test_stop_token_ends_with_stop_and_is_last(engine, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=9)
    sampled = engine.generate(prompts[:1], params)[0].output_ids
    # A token whose first occurrence is after the start: the generation must end right there.
    cut = next(i for i in range(2, len(sampled)) if sampled[i] not in sampled[:i])
    stopped = engine.generate(prompts[:1], dataclasses.replace(params, stop_token_ids=(sampled[cut],)))[0]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.output_ids == sampled[:cut + 1]


def test_eos_stops_sampling_and_max_new_tokens_gives_length(model, tokenizer, prompts):
    engine = HFEngine(eos_prone(copy.deepcopy(model), tokenizer), tokenizer, seed=0)
    outputs = engine.generate(prompts * 4, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3),
                              return_logprob=True)
    eos = tokenizer.eos_token_id
    reasons = {o.finish_reason for o in outputs}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}
    for output in outputs:
        if output.finish_reason == FinishReason.STOP:
            assert output.output_ids[-1] == eos and eos not in output.output_ids[:-1]
        else:
            assert len(output.output_ids) == 10 and eos not in output.output_ids
    ignoring = engine.generate(prompts * 4, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3,
                                                           ignore_eos=True))
    assert all(o.finish_reason == FinishReason.LENGTH and len(o.output_ids) == 10 for o in ignoring)


def test_seeded_sampling_is_reproducible(model, tokenizer, prompts):
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    first, second = HFEngine(copy.deepcopy(model), tokenizer, seed=7), HFEngine(copy.deepcopy(model), tokenizer, seed=7)
    runs_first = [first.generate(prompts, params, True) for _ in range(2)]
    runs_second = [second.generate(prompts, params, True) for _ in range(2)]
    assert runs_first == runs_second  # same engine seed, same sequence of calls
    assert runs_first[0] != runs_first[1]  # the engine's stream moves on between calls
    seeded = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    assert first.generate(prompts, seeded, True) == second.generate(prompts, seeded, True) == \
        first.generate(prompts, seeded, True)
    # Identical prompts in one call sample from different row streams.
    same = first.generate([prompts[0]] * 4, seeded)
    assert len({tuple(o.output_ids) for o in same}) > 1
    assert derive_row_seed(11, 0) != derive_row_seed(11, 1)


def test_async_generate_batches_concurrent_requests(engine, prompts):
    calls = []
    generate_rows = engine.generate_rows

    def counting(rows, *args):
        calls.append(len(rows))
        return generate_rows(rows, *args)

    engine.generate_rows = counting
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    # Seeds and budgets differ per request (as the agent loop's turns do): still one batch.
    seeded = [SamplingParams(max_new_tokens=3 + i, temperature=1.0, seed=4 + i) for i in range(len(prompts))]

    async def run():
        return await asyncio.gather(*[engine.async_generate(p, greedy, True) for p in prompts],
                                    *[engine.async_generate(p, s, True) for p, s in zip(prompts, seeded)])

    results = asyncio.run(run())
    assert calls == [len(prompts), len(prompts)]  # one batch per sampling setting
    assert results[:len(prompts)] == engine.generate(prompts, greedy, True)
    # A seeded request samples from its seed's row-0 stream, as if it were generated alone
    # (log-probs equal up to the last bits that a different padding changes).
    for prompt, params, result in zip(prompts, seeded, results[len(prompts):], strict=True):
        alone = engine.generate([prompt], params, True)[0]
        assert len(result.output_ids) <= params.max_new_tokens
        assert result.output_ids == alone.output_ids and result.finish_reason == alone.finish_reason
        torch.testing.assert_close(result.output_logprobs, alone.output_logprobs, atol=1e-5, rtol=0)


def test_async_generate_reports_errors(engine, prompts):
    engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="inside a weight-update session"):
        asyncio.run(engine.async_generate(prompts[0], SamplingParams(max_new_tokens=2), False))
    engine.end_weight_update()


def hf_buckets(model, num_buckets: int) -> list[list[tuple[str, torch.Tensor]]]:
    named = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    return [named[i::num_buckets] for i in range(num_buckets)]


def test_update_weights_matches_a_fresh_engine(model, tokenizer, prompts):
    engine = HFEngine(copy.deepcopy(model), tokenizer)
    new_model = build_tiny_model(tokenizer, seed=1)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # tied
    buckets = hf_buckets(new_model, 3)
    assert "lm_head.weight" not in {name for bucket in buckets for name, _ in bucket}
    delivered = update_weights(engine, buckets)
    assert delivered == sum(p.numel() * 4 for p in new_model.parameters())
    assert torch.equal(engine.model.lm_head.weight, new_model.lm_head.weight)
    fresh = HFEngine(new_model, tokenizer)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    assert engine.generate(prompts, greedy, True) == fresh.generate(prompts, greedy, True)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, seed=3)
    assert engine.generate(prompts, sampled, True) == fresh.generate(prompts, sampled, True)


def test_update_through_lm_head_name_updates_tied_embedding(engine):
    new_rows = torch.randn_like(engine.model.lm_head.weight)
    with weight_update_session(engine):
        engine.update_weights_from_tensor([("lm_head.weight", new_rows)])
    assert torch.equal(engine.model.model.embed_tokens.weight, new_rows)
    with weight_update_session(engine), pytest.raises(ValueError, match="same .tied. weight"):
        engine.update_weights_from_tensor([("lm_head.weight", new_rows), ("model.embed_tokens.weight", -new_rows)])


@pytest.mark.parametrize("bad,message", [
    (("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64)), "unknown name 'model.layers.9.mlp.up_proj.weight'"),
    (("model.norm.weight", torch.zeros(65)), r"'model.norm.weight' has shape \(65,\), the model's is \(64,\)"),
    (("model.norm.weight", torch.zeros(64, dtype=torch.int64)), "must be floating point"),
])
def test_bad_bucket_raises_and_copies_nothing(engine, bad, message):
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters(remove_duplicate=False)}
    good = ("model.layers.0.mlp.down_proj.weight", torch.ones(64, 128))
    with weight_update_session(engine):
        engine.update_weights_from_tensor([("model.layers.1.input_layernorm.weight", torch.full((64,), 2.0))])
        with pytest.raises(ValueError, match=message) as error:
            engine.update_weights_from_tensor([good, bad])
    assert "nothing of it was copied; 1 earlier bucket(s) (1 tensors) of this session stay applied" in str(error.value)
    for name, p in engine.model.named_parameters(remove_duplicate=False):
        if name == "model.layers.1.input_layernorm.weight":
            assert torch.equal(p, torch.full((64,), 2.0))
        else:
            assert torch.equal(p, before[name]), name


def test_session_and_memory_rules(engine, prompts):
    params = SamplingParams(max_new_tokens=2, temperature=0)
    with pytest.raises(RuntimeError, match="inside a weight-update session: call begin_weight_update"):
        engine.update_weights_from_tensor([("model.norm.weight", torch.ones(64))])
    with pytest.raises(RuntimeError, match="no weight-update session is open"):
        engine.end_weight_update()
    engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="already open"):
        engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="cannot generate inside a weight-update session"):
        engine.generate(prompts, params)
    with pytest.raises(RuntimeError, match="session is open"):
        engine.release_memory_occupation()
    engine.end_weight_update()
    engine.release_memory_occupation()
    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match="memory is released"):
        engine.generate(prompts, params)
    with pytest.raises(RuntimeError, match="memory is released"):
        engine.begin_weight_update()
    engine.resume_memory_occupation()
    engine.flush_cache()
    with pytest.raises(RuntimeError, match="hold released memory"):  # released without a CPU backup
        engine.generate(prompts, params)


def test_released_weights_are_garbage_until_every_tensor_is_rewritten(model, tokenizer, prompts):
    """SGLang's memory saver frees released weights (no --enable-weights-cpu-backup): this engine's are NaN, and it
    refuses to generate until a weight update has rewritten every tensor whole."""
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    expected = HFEngine(copy.deepcopy(model), tokenizer).generate(prompts, greedy, True)
    engine = HFEngine(copy.deepcopy(model), tokenizer)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert all(torch.isnan(p).all() for p in engine.model.parameters())
    first, rest = hf_buckets(model, 2)
    update_weights(engine, [first])
    with pytest.raises(RuntimeError, match=f"{len(rest)} weight tensors hold released memory") as refused:
        engine.generate(prompts, greedy)
    assert "--enable-weights-cpu-backup" in str(refused.value)
    update_weights(engine, [first, rest])
    assert engine.generate(prompts, greedy, True) == expected


def test_a_cpu_backup_keeps_the_weights_across_a_release(model, tokenizer, prompts):
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    engine = HFEngine(copy.deepcopy(model), tokenizer, weights_cpu_backup=True)
    before = engine.generate(prompts, greedy, True)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert engine.generate(prompts, greedy, True) == before


def test_input_checks(engine):
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="at least one input"):
        engine.generate([], params)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        engine.generate([[1], []], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 10_000]], params)
    with pytest.raises(ValueError, match="exceeds the engine's context of 512"):
        engine.generate([[1] * 500], SamplingParams(max_new_tokens=20))


def test_loads_from_an_hf_directory(tmp_path, model, tokenizer, prompts):
    from megarl.models.tiny import save_tiny

    engine = HFEngine(save_tiny(tmp_path / "tiny", seed=0))
    assert engine.eos_token_ids == (tokenizer.eos_token_id,)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    assert engine.generate(prompts, greedy, True) == HFEngine(copy.deepcopy(model), tokenizer).generate(
        prompts, greedy, True)
    with pytest.raises(TypeError, match="needs a model directory or a torch.nn.Module"):
        HFEngine(42)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_weights_update_by_the_checkpoints_per_expert_names(name, tmp_path):
    """A mixture-of-experts engine takes (and reads back) the router and experts under the names the hub
    checkpoint and SGLang use, one tensor per expert, though transformers fuses them in memory: updating every
    tensor of another model's checkpoint makes the engine that model (logits equal)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.distributed import moe_jobs

    target = moe_jobs.save_tiny_moe(name, tmp_path, seed=1)
    engine = HFEngine(AutoModelForCausalLM.from_config(moe_jobs.tiny_moe_config(name)), build_tiny_tokenizer())
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(".experts.3." in n for n in tensors) and all(n in engine._params for n in tensors)
    update_weights(engine, [list(tensors.items())])
    ids = torch.randint(0, moe_jobs.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, target(input_ids=ids).logits)
    expert = next(n for n in tensors if ".experts.2." in n and n.endswith(("up_proj.weight", "w3.weight")))
    assert torch.equal(engine._params[expert], tensors[expert])


def _as_if_on_cuda(engine, monkeypatch):
    """``engine`` (a CPU model) behaving as one on CUDA: its device says cuda, moving the model gives every parameter
    new storage (as ``model.to("cpu")`` / ``model.to("cuda")`` do), and the CUDA stream calls are recorded."""
    synced = []

    def move(*args, **kwargs):
        for param in engine.model.parameters():
            param.data = param.data.clone()
        return engine.model

    class Stream:
        def synchronize(self):
            synced.append(True)

    engine.device = torch.device("cuda", 0)
    engine.model.to = move
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return synced


def test_moe_expert_updates_reach_the_model_after_a_release_and_resume(monkeypatch):
    """On CUDA, release/resume move the model to the host and back, replacing every parameter's storage: the
    per-expert views the updates write through are rebuilt on resume, so a later update changes the model."""
    from transformers import AutoModelForCausalLM

    from tests.distributed import moe_jobs

    engine = HFEngine(AutoModelForCausalLM.from_config(moe_jobs.tiny_moe_config("qwen3_moe")), build_tiny_tokenizer())
    _as_if_on_cuda(engine, monkeypatch)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    value = torch.full_like(engine._params[name], 0.25)
    update_weights(engine, [[(name, value)]])
    fused = dict(engine.model.named_parameters())["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(fused[2], value) and not torch.equal(fused[1], value)


def test_an_update_on_cuda_returns_once_its_copies_are_done(engine, monkeypatch):
    """The sender refills a bucket buffer once the engine has answered for it, and the engine server keeps the CUDA
    IPC mappings open: each update synchronises the stream its copies were enqueued on before returning."""
    synced = _as_if_on_cuda(engine, monkeypatch)
    name, param = next(iter(engine.model.named_parameters()))
    update_weights(engine, [[(name, param.detach() + 1)], [(name, param.detach() + 2)]])
    assert len(synced) == 2
