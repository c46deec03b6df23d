"""FP8 buckets into a CPU engine server started on an FP8 checkpoint (megarl.models.fp8, megarl.sync)."""

from __future__ import annotations

import torch

from megarl.models.fp8 import quantize_block_fp8


def test_a_quantized_bucket_reaches_an_fp8_cpu_engine_server_bit_exact(tmp_path):
    """A bucket of a layer's HF tensors (bf16), quantized into one byte buffer of fp32 scales, the bf16 rest and the
    FP8 weights (packed widest first, as SGLang's receiver lays them out), sent as one flattened-bucket payload
    (shared memory) into a CPU engine server started on an FP8 checkpoint: it holds the FP8 values and scales bit for
    bit, and the norms."""
    from transformers import AutoConfig

    from megarl.convert.export import Bucket
    from megarl.convert.fp8 import fp8_names, quantize_bucket, write_fp8_checkpoint
    from megarl.engines.cpu_engine.read_back import inspect_weight
    from megarl.engines.event_loop import run_sync
    from megarl.models import family_for
    from megarl.models.tiny import save_tiny
    from megarl.sync.base import flattened_payload
    from tests.engine_servers import engine_servers

    source = save_tiny(tmp_path / "bf16", num_layers=1, hidden_size=256, intermediate_size=512)
    write_fp8_checkpoint(source, tmp_path / "fp8")
    config = AutoConfig.from_pretrained(source)
    quantized = fp8_names(family_for(config), config)
    generator = torch.Generator().manual_seed(3)
    layer = "model.layers.0."
    named = [(layer + n, torch.randn(shape, generator=generator).to(torch.bfloat16) * 0.05) for n, shape in (
        ("self_attn.q_proj.weight", (256, 256)), ("input_layernorm.weight", (256,)), ("mlp.up_proj.weight", (512, 256)),
        ("self_attn.q_proj.bias", (256,)), ("mlp.down_proj.weight", (256, 512)))]
    bucket = quantize_bucket(Bucket.pack(named), quantized, shared_memory=True)
    assert bucket.flat.dtype == torch.uint8 and len(bucket.names) == 5 + 3
    offsets = [t.data_ptr() - bucket.flat.data_ptr() for t in bucket.tensors]
    assert offsets == sorted(offsets) and all(o % t.element_size() == 0 for o, t in zip(offsets, bucket.tensors))
    assert [t.dtype for t in bucket.tensors] == [torch.float32] * 3 + [torch.bfloat16] * 2 + [torch.float8_e4m3fn] * 3
    # The receive layout SGLang builds from the names, dtypes and shapes in this order is the same.
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    empty = FlattenedTensorBucket.empty(bucket.names, [t.dtype for t in bucket.tensors],
                                        [list(t.shape) for t in bucket.tensors], "cpu")
    assert [m.start_idx for m in empty.metadata] == offsets
    sent = dict(zip(bucket.names, bucket.tensors))
    with engine_servers(tmp_path / "fp8", tmp_path / "logs") as servers:
        client = servers.engines[0]

        async def update():
            await client.begin_weight_update()
            await client.update_weights_from_tensor([flattened_payload(bucket)])
            await client.end_weight_update()
            return {name: await inspect_weight(client.url, name) for name in sent}

        held = run_sync(update())
    for name, tensor in sent.items():  # the FP8 weights held as FP8, the rest in the engine's dtype
        assert torch.equal(held[name].float(), tensor.float()), name
        assert (held[name].dtype == torch.float8_e4m3fn) == (tensor.dtype == torch.float8_e4m3fn), name
    q, scale = quantize_block_fp8(dict(named)[layer + "mlp.up_proj.weight"])
    assert torch.equal(sent[layer + "mlp.up_proj.weight"].float(), q.float())
    assert torch.equal(sent[layer + "mlp.up_proj.weight_scale_inv"], scale)
