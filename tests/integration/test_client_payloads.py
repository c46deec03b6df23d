"""The client's pieces of SGLang's wire format: weight payloads, sampling params, outputs.

:func:`megarl.sync.base.flattened_payload` is checked with sglang's own classes (``MultiprocessingSerializer``,
``FlattenedTensorBucket``) across processes, as a weight sync uses it: a sender process (a
trainer rank) builds the payloads of one bucket (a shared-memory buffer, as the exporter's) for two engines,
one per engine TP rank, and keeps them alive; a second
process that is not its child (an engine server) opens each payload once, as SGLang's
tokenizer manager and scheduler do (and one as megarl's CPU server does). Both run as child
processes: importing sglang patches transformers and sets cache environment variables, which
must not leak into the other tests of this process. It needs sglang 0.5.23 installed with
``--no-deps`` plus the few pure-Python packages its utilities import (see the CI extras).
"""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from megarl.engines.client import generate_output, sampling_params_dict
from megarl.engines.engine import FinishReason, SamplingParams

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="needs sglang==0.5.23 (pip install --no-deps) and its utility imports")

TP_SIZES = [2, 1]
"""Two engines: one with two TP ranks, one with one."""

BUCKET = textwrap.dedent("""
    import torch
    from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer

    def bucket():
        model = build_tiny_model(build_tiny_tokenizer(), seed=0)
        return [(name, p.detach().to(torch.bfloat16)) for name, p in model.named_parameters()]
""")

SENDER = BUCKET + textwrap.dedent("""
    import base64, json, sys
    from megarl.convert.export import Bucket
    from megarl.sync.base import flattened_payload

    packed = Bucket.pack(bucket(), shared_memory=True)
    payloads = [[flattened_payload(packed) for _ in range(tp)] for tp in TP_SIZES]
    report = {"payloads": [[base64.b64encode(p).decode("ascii") for p in engine] for engine in payloads],
              "types": sorted({type(p).__name__ for engine in payloads for p in engine}),
              "strategy": torch.multiprocessing.get_sharing_strategy(),
              "payload_bytes": max(len(p) for engine in payloads for p in engine),
              "bucket_bytes": packed.nbytes}
    for bad, named in (("empty", []), ("mixed", [("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.int32))])):
        try:
            Bucket.pack(named)
        except ValueError as error:
            report[bad] = str(error)
    print("REPORT" + json.dumps(report), flush=True)
    sys.stdin.read()  # keep the shared tensor alive until the receiver is done
""")

RECEIVER = BUCKET + textwrap.dedent("""
    import json, sys
    from sglang.srt.utils import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    from megarl.engines.cpu_engine.weights import Payload

    def sglang_open(payload):
        # As SGLang's tokenizer manager normalizes the base64 strings and its scheduler rebuilds a
        # flattened_bucket update before model.load_weights:
        (data,) = normalize_serialized_named_tensor_payloads([payload])
        data = MultiprocessingSerializer.deserialize(data)  # SGLang's restricted unpickler
        metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                            end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
        return FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                     metadata=metadata).reconstruct_tensors()

    payloads = json.loads(sys.stdin.read())
    expected = dict(bucket())
    report = {"expected_names": sorted(expected), "opened": []}
    for engine, ranks in enumerate(payloads):
        for rank, payload in enumerate(ranks):
            how = "megarl-server" if engine == len(payloads) - 1 else "sglang"
            tensors = Payload(payload, "flattened_bucket").named() if how == "megarl-server" else sglang_open(payload)
            report["opened"].append({
                "engine": engine, "rank": rank, "how": how, "names": sorted(name for name, _ in tensors),
                "mismatched": [name for name, t in tensors
                               if t.dtype != expected[name].dtype or t.shape != expected[name].shape
                               or not torch.equal(t, expected[name])],
            })
    print("REPORT" + json.dumps(report), flush=True)
""")


def _report(stdout: str) -> dict:
    return json.loads(stdout.split("REPORT", 1)[1].splitlines()[0])


@needs_sglang
def test_bucket_payloads_round_trip_through_sglang_in_another_process():
    """Payloads carry a handle, not the bytes: each is a few KiB for a bucket of ~100 KiB."""
    prelude = f"TP_SIZES = {TP_SIZES!r}\n"
    sender = subprocess.Popen([sys.executable, "-c", prelude + SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = sender.stdout.readline()
        assert line.startswith("REPORT"), sender.stderr.read()[-3000:] if sender.poll() is not None else line
        sent = _report(line)
        # The receiver is the sender's sibling, not its child: it opens the payloads by file name
        # (torch's file_system strategy), not by file descriptors only the sender's children may fetch.
        received = subprocess.run([sys.executable, "-c", prelude + RECEIVER], input=json.dumps(sent["payloads"]),
                                  capture_output=True, text=True, timeout=300, check=False)
        assert received.returncode == 0, received.stderr[-3000:]
    finally:
        sender.stdin.close()
        sender.wait(timeout=60)
    report = _report(received.stdout)

    # Each engine gets its own payloads: one per TP rank, every one a complete copy of the bucket.
    assert [len(engine) for engine in sent["payloads"]] == TP_SIZES and sent["types"] == ["bytes"]
    assert sent["strategy"] == "file_system"
    assert [(o["engine"], o["rank"], o["how"]) for o in report["opened"]] == [
        (0, 0, "sglang"), (0, 1, "sglang"), (1, 0, "megarl-server")]
    for opened in report["opened"]:
        assert opened["names"] == report["expected_names"], opened
        assert opened["mismatched"] == [], opened
    assert sent["payload_bytes"] < sent["bucket_bytes"] / 10
    assert "at least one (name, tensor) pair" in sent["empty"]
    assert "a bucket holds one dtype" in sent["mixed"]


def test_sampling_params_dict():
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(5, 6), seed=3)
    assert sampling_params_dict(params, seed=11) == {
        "max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "ignore_eos": False,
        "no_stop_trim": True, "stop_token_ids": [5, 6], "sampling_seed": 11}
    # The request's seed is the one given (the manager's share seed), never params.seed; None sends none.
    assert "sampling_seed" not in sampling_params_dict(params, seed=None)
    greedy = sampling_params_dict(SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True), seed=0)
    assert greedy == {"max_new_tokens": 4, "temperature": 0, "top_p": 1.0, "top_k": -1, "ignore_eos": True,
                      "no_stop_trim": True, "sampling_seed": 0}


def test_rollout_ignore_eos_reaches_training_requests_only():
    from megarl.config.rollout import RolloutConfig
    from megarl.engines.engine import sampling_params_for

    config = RolloutConfig(ignore_eos=True)
    assert sampling_params_for(config, max_new_tokens=8).ignore_eos
    assert not sampling_params_for(config, max_new_tokens=8, validate=True).ignore_eos
    assert not sampling_params_for(RolloutConfig(), max_new_tokens=8).ignore_eos


def test_generate_output():
    result = {"output_ids": [7, 8, 2],
              "meta_info": {"finish_reason": {"type": "stop", "matched": 2}, "weight_version": "3",
                            "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None], [-0.125, 2, None]]}}
    output = generate_output(result, return_logprob=True)
    assert output.output_ids == [7, 8, 2] and output.finish_reason is FinishReason.STOP
    assert output.output_logprobs == [-0.5, -1.25, -0.125] and output.weight_version == "3"
    result["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert generate_output(result, return_logprob=False).finish_reason is FinishReason.LENGTH
    assert generate_output(result, return_logprob=False).output_logprobs is None
    result["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted"}
    assert generate_output(result, return_logprob=False).finish_reason is FinishReason.ABORT
    del result["meta_info"]["weight_version"]
    assert generate_output(result, return_logprob=False).weight_version is None
    result["meta_info"]["finish_reason"] = None
    with pytest.raises(RuntimeError, match="unfinished output"):
        generate_output(result, return_logprob=False)


def test_weight_version_spans_give_each_token_its_version():
    meta = {"finish_reason": {"type": "length", "length": 5}, "weight_version": "1",
            "weight_versions": [{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 5}]}
    output = generate_output({"output_ids": [1, 2, 3, 4, 5], "meta_info": meta}, return_logprob=False)
    assert output.weight_versions == (("0", 0, 2), ("1", 2, 5))
    assert output.token_versions() == ["0", "0", "1", "1", "1"]
    # Without spans (an older SGLang) every token has the answer's version.
    del meta["weight_versions"]
    assert generate_output({"output_ids": [1, 2], "meta_info": meta}, return_logprob=False).token_versions() == ["1"] * 2
    for spans in ([{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 3, "end": 5}],
                  [{"version": "0", "start": 0, "end": 4}]):
        meta["weight_versions"] = spans
        with pytest.raises(RuntimeError, match="do not cover its 5 output tokens end to end"):
            generate_output({"output_ids": [1, 2, 3, 4, 5], "meta_info": meta}, return_logprob=False)


def _flaky_server(drops: int):
    """A server on a port of its own that resets the first ``drops`` connections, then answers one with JSON;
    ``(url, served)``, ``served`` growing by one per connection it took."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    served: list[int] = []

    def serve() -> None:
        with listener:
            for attempt in range(drops + 1):
                connection, _ = listener.accept()
                served.append(attempt)
                with connection:
                    connection.recv(65536)
                    if attempt < drops:
                        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # reset
                        continue
                    body = b'{"model_path": "m", "is_generation": true}'
                    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", served


def test_reads_are_retried_when_the_connection_fails_and_other_calls_are_not():
    """``/model_info`` (a read) survives two dropped connections (the engine named if all three
    tries fail); ``/pause_generation`` (a control call) is never repeated: the first failure is the error."""
    from megarl.engines.client import EngineClient, EngineError, run_sync

    url, served = _flaky_server(2)
    assert run_sync(EngineClient(url, name="engine 3").model_info())["model_path"] == "m" and served[-1] == 2
    url, served = _flaky_server(1)
    with pytest.raises(EngineError, match=r"engine 3 at .*: POST /pause_generation: the server cannot be reached"):
        run_sync(EngineClient(url, name="engine 3").pause_generation("abort"))
    assert served == [0]
    url, served = _flaky_server(100)  # aiohttp may itself try a GET twice on a reset connection
    with pytest.raises(EngineError, match=r"engine 3 at .*: GET /health: the server cannot be reached .*\(tried 3 "
                                          r"times\)"):
        run_sync(EngineClient(url, name="engine 3").call("/health"))
    assert len(served) >= 3
