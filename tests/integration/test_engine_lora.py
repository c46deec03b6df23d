"""LoRA on megarl's CPU engine server: SGLang's LoRA routes and ``lora_path``, with the
numbers of ``peft`` itself.

An adapter made with ``peft`` on a tiny Qwen2 is loaded into the server from tensors (SGLang's payloads, one per
engine TP rank, checksums checked) and from its PEFT directory; greedy generation naming it gives ``peft``'s
tokens and log-probs; requests of the base and of the adapter in one arrival give each their own numbers.

Servers that open tensor payloads run as their own processes, as in a run: opening one applies SGLang's
torch-reduction patch to the process, after which it can no longer send CPU tensors by handle."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest
import torch

from megarl.convert.export import Bucket
from megarl.engines.client import EngineClient, EngineError
from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.cpu_engine.server import EngineServer
from megarl.engines.engine import SamplingParams
from megarl.engines.lora_wire import checksums
from megarl.engines.server_process import ServerProcess, free_port
from megarl.sync.base import flattened_payload
from tests import sglang_source

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A tiny Qwen2, a PEFT adapter of rank 4 on it with random B (saved), and the PEFT model's numbers."""
    import peft
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("lora")
    model_dir = save_tiny(root / "model", num_layers=2)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=True)
    model = peft.get_peft_model(base, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(root / "adapter")
    tensors = peft.get_peft_model_state_dict(model)
    model.eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            ids = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
            expected.append((ids, logprobs))
    config_dict = {k: v for k, v in model.peft_config["default"].to_dict().items()
                   if k in ("peft_type", "r", "lora_alpha", "target_modules", "bias", "use_rslora", "use_dora")}
    config_dict["target_modules"] = sorted(config_dict["target_modules"])
    return model_dir, root / "adapter", tensors, config_dict, expected


def _serve(model_dir, tp: int = 2, **lora):
    return EngineServer(HFEngine(model_dir), model_path=str(model_dir), tp_size=tp, **lora)


def _exchange(server: EngineServer, work):
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        test = TestClient(TestServer(server.app()))
        await test.start_server()
        client = EngineClient(str(test.make_url("")).rstrip("/"), name="engine 0")
        try:
            return await work(client)
        finally:
            await client.close()
            await test.close()

    return asyncio.run(run())


@contextlib.contextmanager
def _process(model_dir, log_dir, *flags: str):
    """A CPU engine server process with ``flags``; yields its URL."""
    port = free_port()
    process = ServerProcess([sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", str(model_dir),
                             "--port", str(port), *flags], name="engine 0", url=f"http://127.0.0.1:{port}",
                            log_path=log_dir / "engine.log", env={"OMP_NUM_THREADS": "1"}).start()
    try:
        process.wait_healthy(120)
        yield process.url
    finally:
        process.stop()


def _over_http(url: str, work):
    async def run():
        client = EngineClient(url, name="engine 0")
        try:
            return await work(client)
        finally:
            await client.close()

    return asyncio.run(run())


def _shared(tensors, tp):
    bucket = Bucket.pack(sorted(tensors.items()), shared_memory=True)
    return [flattened_payload(bucket) for _ in range(tp)]


def _by_value(tensors, tp):
    return [flattened_payload(Bucket.pack(sorted(tensors.items())), by_value=True)] * tp


@pytest.mark.parametrize("encode", [_shared, _by_value], ids=["shared-memory", "by-value"])
def test_an_adapter_loaded_from_tensors_generates_what_peft_generates(adapter, encode, tmp_path):
    model_dir, _, tensors, config, expected = adapter

    async def work(client):
        await client.load_lora_adapter_from_tensors("a", config, encode(tensors, 2), checksums=checksums(tensors))
        client.lora_name = "a"
        lora = await client.generate_batch(PROMPTS, GREEDY, return_logprob=True)
        client.lora_name = None
        base = await client.generate_batch(PROMPTS, GREEDY, return_logprob=True)
        return lora, base

    with _process(model_dir, tmp_path, "--tp-size", "2", "--enable-lora", "--max-lora-rank", "8",
                  "--lora-target-modules", *TARGETS) as url:
        lora, base = _over_http(url, work)
    for out, (ids, logprobs) in zip(lora, expected):
        assert out.output_ids == ids
        assert torch.allclose(torch.tensor(out.output_logprobs), torch.tensor(logprobs), atol=1e-5)
    assert any(b.output_ids != a.output_ids for a, b in zip(lora, base))  # the adapter changes the model


def test_an_adapter_from_its_peft_directory_and_base_requests_beside_it(adapter):
    """``/load_lora_adapter`` reads PEFT's directory; base and adapter requests arriving together each get their
    own numbers (they never share a batch)."""
    model_dir, directory, _, _, expected = adapter
    server = _serve(model_dir, tp=1, enable_lora=True, max_lora_rank=4)

    async def work(client):
        await client.load_lora_adapter("a", str(directory))
        base_client = EngineClient(client.url, name="base")
        alone = await base_client.generate(PROMPTS[0], GREEDY, return_logprob=True)
        client.lora_name = "a"
        together = await asyncio.gather(client.generate(PROMPTS[0], GREEDY, return_logprob=True),
                                        base_client.generate(PROMPTS[0], GREEDY, return_logprob=True))
        await base_client.close()
        return alone, together

    alone, (lora, base) = _exchange(server, work)
    assert lora.output_ids == expected[0][0]
    assert base.output_ids == alone.output_ids and base.output_logprobs == alone.output_logprobs


def test_what_the_lora_routes_refuse(adapter, tmp_path):
    """A name loaded twice, a rank above ``--max-lora-rank``, a module outside ``--lora-target-modules``, a wrong
    checksum, an unknown adapter in ``lora_path`` and LoRA on a server without ``--enable-lora``: each refused with
    SGLang's 400 and a message saying what; an unloaded name can be loaded again."""
    model_dir, _, tensors, config, _ = adapter
    attention = {n: t for n, t in tensors.items() if ".q_proj." in n or ".v_proj." in n}

    async def refused(call) -> str:
        with pytest.raises(EngineError) as error:
            await call
        assert error.value.status == 400
        return str(error.value)

    async def work(client):
        messages = [await refused(client.load_lora_adapter_from_tensors("a", config, _by_value(tensors, 1)))]
        await client.load_lora_adapter_from_tensors("a", config, _by_value(attention, 1),
                                                    checksums=checksums(attention))
        messages.append(await refused(client.load_lora_adapter_from_tensors("a", config, _by_value(attention, 1))))
        messages.append(await refused(client.load_lora_adapter_from_tensors(
            "b", {**config, "r": 8}, _by_value(attention, 1))))
        wrong = dict(checksums(attention))
        wrong[next(iter(wrong))] = "0" * 64
        messages.append(await refused(client.load_lora_adapter_from_tensors("c", config, _by_value(attention, 1),
                                                                            checksums=wrong)))
        client.lora_name = "nope"
        messages.append(await refused(client.generate([1, 2], GREEDY)))
        await client.unload_lora_adapter("a")
        messages.append(await refused(client.unload_lora_adapter("a")))
        await client.load_lora_adapter_from_tensors("a", config, _by_value(attention, 1))
        return messages

    with _process(model_dir, tmp_path, "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj",
                  "v_proj") as url:
        messages = _over_http(url, work)
    assert "not among the server's --lora-target-modules" in messages[0]
    assert "LoRA with name a already exists" in messages[1]
    assert "exceeds the server's --max-lora-rank 4" in messages[2]
    assert "adapter sync MISMATCH" in messages[3] and "1 value-diff" in messages[3]
    assert "requested LoRA adapters are not loaded: nope" in messages[4]
    assert "does not exist" in messages[5]

    async def no_lora(client):
        client.lora_name = "a"
        return await refused(client.generate([1, 2], GREEDY))

    assert "LoRA is not enabled" in _exchange(_serve(model_dir, tp=1), no_lora)


def test_the_lora_answers_are_sglangs(adapter):
    """What the server answers on the LoRA routes are fields of SGLang's ``LoRAUpdateOutput``."""
    model_dir, directory, _, _, _ = adapter
    server = _serve(model_dir, tp=1, enable_lora=True, max_lora_rank=4)

    async def work(client):
        loaded = await client.call("/load_lora_adapter", lora_name="a", lora_path=str(directory))
        unloaded = await client.call("/unload_lora_adapter", lora_name="a")
        return loaded, unloaded

    loaded, unloaded = _exchange(server, work)
    fields = set(sglang_source.dataclass_fields("LoRAUpdateOutput"))
    assert set(loaded) <= fields and set(unloaded) <= fields
    assert loaded["success"] and loaded["loaded_adapters"] == {"a": str(directory)}
    assert unloaded["loaded_adapters"] == {}
