"""megarl's GPU readiness check: one process on one GPU (or the CPU), no Ray, no SGLang, no TransformerEngine.

    python tools/gpu_check.py                          # CUDA: Qwen2.5-0.5B-shaped checks, a 1.5B-shaped MFU step
    python tools/gpu_check.py --shape tiny             # the default without CUDA: every stage in well under a minute
    python tools/gpu_check.py --stages parity,ppo --work /tmp/gpu_check

What it imports besides megarl: torch, transformers, numpy, safetensors, aiohttp, megatron-core, omegaconf, and
for the weight payloads sglang's serializer, torch-reduction patch, flattened buckets and weight versions (a
full sglang or ``tools/make_sglang_min.py``'s copy of just those modules). Never Ray, Hydra, sglang-router, datasets
or pyarrow (``tests/e2e/test_gpu_check.py`` runs it with them blocked). How to run it on a bare machine:
``docs/gpu.md``.

Every stage uses megarl's own API as a run does, with the model in bf16 at TP=1: batches are CPU tensors (as they
come from the rollout) and megarl places them; the engine is megarl's server process; the weights travel by the
``tensor`` transport. Stages, run in this order (``--stages`` picks some; a stage builds what it needs):

  parity  megarl's Megatron model (local layer spec, bf16) against HF transformers in fp32 and in bf16 on the
          same weights (a random Qwen2.5-shaped model, ``initializer_range`` 0.05 so a wrong position, mask or
          norm shows), packed (THD) and padded micro-batches. Pass: mean |megarl - HF fp32| within 3x of
          mean |HF bf16 - HF fp32| in both modes.
  engine  ``python -m megarl.engines.cpu_engine --device cuda:0 --dtype bfloat16`` (``cpu`` without CUDA) generates
          (T=1, log-probs); the actor recomputes them (``ActorRole.compute_log_prob``): the rollout/train gap on
          identical weights. Pass: tokens generated, gap finite and within 4x parity's HF bf16 error (both
          models are within that of HF fp32) when parity ran.
  ppo     one ``ActorRole.update`` (one ``ShardedModel.train_step`` with megarl's PPO loss), advantages +1 and
          -1 on alternate rows. Pass: applied, finite gradient norm, log-probs moved with the advantages.
  sync    the ``tensor`` transport (CUDA IPC handles on GPU, shared memory on CPU) into that server: the
          trained weights at ``rollout.bucket_mb`` (timed, GB/s against a device-to-device copy of the same
          bytes in this run), then again in 4 MiB buckets (every small tensor reuses a buffer); each followed by
          reading back the first rows of every tensor, and whole tensors of a sample after the last. Pass: the
          engine held other weights before, everything read back equal, the engine's weight version is the last
          sync's, the gap after the sync within the engine stage's bound. Runs ``ppo`` first (added when not
          picked): without an update a read-back cannot tell a sync from none.
  lora    LoRA on this device: an actor with rank-8 adapters on every linear layer (random ``B``: they change the
          model; Megatron's local spec), its adapters off against a plain actor of the same weights, one update,
          then the adapters alone into a server serving LoRA (``--enable-lora``; ``rollout.lora_sync=adapters``:
          ``/load_lora_adapter_from_tensors``, CUDA IPC payloads on GPU, checksums checked by the engine) and the
          engine's log-probs naming the adapter against the actor's. Pass: adapters off equal to the plain model bit
          for bit, the update applied with every base weight unchanged, every adapter tensor verified, the gap
          within the engine stage's bound.
  fp8     FP8 rollout (``rollout.quantization=fp8``): the check's model written as a block-FP8 checkpoint, an engine
          server started from it (FP8 weights and scales kept, computing with their dequantization), the actor's
          weights synced into it by the ``tensor`` transport as FP8 byte buckets (CUDA IPC payloads of one byte
          buffer on GPU), the transport asking for its sample (``rollout.verify_weights``) and refused, as SGLang
          refuses a Qwen2 (the engine reported unverified), then the first rows of every quantized weight and scale
          read from the engine (megarl's own ``inspect_weight``), all rows of the small ones (JSON answers of every
          value took minutes on a 0.5B model). Pass: every value read equals the
          actor's weights quantized here, bit for bit, and the engine's log-probs are finite (their gap to the
          actor's, FP8's, is reported next to the engine stage's bf16 bound).
  vl      a vision-language policy (a random Qwen2.5-VL: the shape's language model, a 4-block vision tower): an
          engine server started from it generates from image prompts (``image_data``: the tower and multimodal
          RoPE on this device in transformers), the actor (the tower on its first stage, Megatron's multimodal
          RoPE) recomputes the log-probs, takes one update, and the ``tensor`` transport takes every weight, the
          tower's ``visual.*`` too, into the server (its sample refused, as SGLang's Qwen2.5-VL refuses it); the
          first rows of every tensor are read from the engine. Pass: the gap within the engine stage's bound
          (finite without parity), the update applied, the engine reported unverified, every value read equal.
  mfu     train steps of a Qwen2.5-1.5B-shaped random model (``ActorRole.update``, one micro-batch): tokens/s and
          MFU (6 N + causal attention flops per token against the chip's dense bf16 peak), against HF
          transformers' step (sdpa, AdamW, the same log-softmax) on the same chip in this run. Printed, not
          judged: ok when both ran and every step was finite. ``--profile``: one more step of each side under
          torch's profiler, the operators and kernels by their own device time (CPU time without CUDA) written to
          ``profile_megarl.txt`` and ``profile_hf.txt`` beside ``gpu_check.jsonl``.

Output: one JSON line per stage as it finishes (``{"stage", "ok", "seconds", ...}``, a failed stage with its
``error`` and ``where``), on stdout and appended to ``$OUT/gpu_check.jsonl`` (``--out``), so a run cut short
keeps what finished; first an ``env`` line, last a ``summary``. Benchmark ratios also as ``RESULT`` lines:
``RESULT sync_vs_copy=...`` and ``RESULT mfu_vs_hf=...`` (megarl's tokens/s over HF's). Exit code 0 when every
stage passed, 1 otherwise.

On the local layer spec (no TransformerEngine) the MFU is a lower bound for production: no fused attention,
unfused RoPE. What one GPU cannot check (TE, THD with TE, CP, EP, grouped GEMM): ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib.util
import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_convert holds RESULT helpers

import bench_convert as common
import torch

STAGES = ("parity", "engine", "ppo", "sync", "lora", "fp8", "vl", "mfu")
REQUIRES = {"sync": ("ppo",)}
"""Stages a picked stage needs run before it (added to ``--stages``)."""

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
}
"""Qwen2.5 shapes, random weights (the tokenizer is megarl's tiny one: only its special ids matter)."""
VL_SHAPES = {
    "tiny": dict(vision_hidden=32, vision_depth=2),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                 vision_hidden=256, vision_depth=4),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                 vision_hidden=256, vision_depth=4),
}
"""The ``vl`` stage's Qwen2.5-VL per ``--shape`` (:func:`megarl.models.tiny.tiny_qwen2_5_vl_config` sizes)."""
INIT_RANGE = 0.05
"""Qwen's is 0.02; wider weights make attention and logits peaked, so a wrong position, mask or norm shows."""

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.4),
                    ("H200", 989.4), ("A100", 312.0))
"""Dense bf16 peak by device name, first match wins (SXM unless named); ``--peak-tflops`` overrides."""

DTYPE = torch.bfloat16
"""The training and engine dtype of every stage (bf16 on CPU too: the same numerics as on the GPU)."""
LR = 1e-4
"""The PPO step's learning rate (Adam: every weight moves by about this much)."""
ROWS, PROMPT, RESPONSE = 8, 96, 160
"""Parity and PPO batch: rows, prompt width P, response width R (lengths drawn per row, at least 8 each)."""
ENGINE_ROWS, ENGINE_RESPONSE = 8, 64
"""Engine rows (prompts of 32-53 tokens) and tokens generated per row."""
SMALL_BUCKET_MB = 4
VERIFY_SAMPLE, WHOLE_MAX_VALUES = 12, 1 << 20
"""About this many tensors of at most this many values are read back whole after the last sync (besides the first
rows of every tensor): the engine answers in JSON, a few seconds per million values."""
ENGINE_START_S = 300.0


# ----------------------------------------------------------------------------------------------------- output
class StageTimeout(Exception):
    """A stage ran past ``--stage-timeout``."""


class Recorder:
    """One JSON line per stage on stdout and in ``path`` (appended and flushed line by line); a stage running past
    ``stage_timeout`` seconds has every thread's stack printed and is stopped as failed (SIGALRM, main thread)."""

    def __init__(self, path: Path, stage_timeout: float | None = None) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, bool] = {}
        self.stage_timeout = stage_timeout
        self._stage: tuple[str, float] | None = None

    def note(self, what: str) -> None:
        """A progress line of the running stage, with its seconds so far."""
        if self._stage is not None:
            name, start = self._stage
            print(f"[{name} +{time.perf_counter() - start:.1f} s] {what}", flush=True)

    def _alarm(self, signum, frame) -> None:
        name = self._stage[0] if self._stage else "?"
        print(f"[{name}] past --stage-timeout {self.stage_timeout:g} s; every thread's stack:", file=sys.stderr,
              flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        raise StageTimeout(f"stage {name} ran past --stage-timeout {self.stage_timeout:g} s (stacks in the log)")

    def record(self, stage: str, ok: bool, seconds: float, **fields) -> None:
        line = json.dumps({"stage": stage, "ok": bool(ok), "seconds": round(seconds, 2), **fields}, default=str)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
        self.results[stage] = bool(ok)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[dict]:
        """Run a stage's body, which fills the dict it is given (``ok`` and its figures); record it. An exception
        is this stage's finding: it is recorded (type, message, megarl/Megatron frames) and the run goes on."""
        fields: dict = {}
        start = time.perf_counter()
        self._stage = (name, start)
        timer = self.stage_timeout is not None and hasattr(signal, "setitimer")
        if timer:
            previous = signal.signal(signal.SIGALRM, self._alarm)
            signal.setitimer(signal.ITIMER_REAL, self.stage_timeout)
        try:
            yield fields
        except Exception as error:  # noqa: BLE001 - any failure is the stage's result; later stages still run
            traceback.print_exc()
            fields = {"ok": False, "error": f"{type(error).__name__}: {error}"[:1500], "where": _where(error)}
        finally:
            if timer:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self._stage = None
        self.record(name, fields.pop("ok"), time.perf_counter() - start, **fields)


def _where(error: BaseException) -> list[str]:
    """The last megarl and Megatron frames of ``error``'s traceback (``file:line``)."""
    frames = traceback.extract_tb(error.__traceback__)
    return [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}" for f in frames
            if "megarl" in f.filename or "megatron" in f.filename][-6:]


# ----------------------------------------------------------------------------------------------------- set-up
def save_model(directory: Path, shape: str, device: torch.device, seed: int) -> Path:
    """A random Qwen2.5-shaped model in bf16 (safetensors) with megarl's tiny tokenizer; kept once written."""
    if (directory / "config.json").exists():
        return directory
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megarl.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    sizes = dict(SHAPES[shape], vocab_size=max(SHAPES[shape]["vocab_size"], len(tokenizer)))
    config = Qwen2Config(**sizes, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                         initializer_range=INIT_RANGE, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    partial = directory.with_name(directory.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(directory)
    return directory


def rl_batch(rows: int, P: int, R: int, vocab: int, seed: int, *, min_prompt: int = 8, min_response: int = 8):
    """An RL batch on the CPU as a rollout leaves it: ``input_ids`` / ``attention_mask`` [N, P+R] (left-padded
    prompts ‖ right-padded responses, lengths drawn per row), ``responses`` / ``response_mask`` [N, R]."""
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(rows, P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(rows):
        p = int(torch.randint(min_prompt, P + 1, (1,), generator=g))
        r = int(torch.randint(min_response, R + 1, (1,), generator=g))
        ids[row, P - p:P + r] = torch.randint(0, min(vocab, 500), (p + r,), generator=g)
        mask[row, P - p:P + r] = 1
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:],
                            "response_mask": mask[:, P:]})


def next_token_pairs(mask_NS: torch.Tensor) -> torch.Tensor:
    """[N, S] positions t where tokens t and t+1 are both real (where log p(token t+1) is defined)."""
    real = mask_NS.bool()
    return real & torch.nn.functional.pad(real[:, 1:], (0, 1))


def hf_logprobs(model, ids_NS: torch.Tensor, mask_NS: torch.Tensor) -> torch.Tensor:
    """[N, S] log p(token t+1 | tokens <= t) from an HF model (fp32 log-softmax), on the CPU; positions count from
    each row's first token, as megarl's."""
    device = next(model.parameters()).device
    ids, mask = ids_NS.to(device), mask_NS.to(device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (0, 1)).cpu()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and its wall time, the device drained before and after."""
    synchronize()
    start = time.perf_counter()
    out = fn()
    synchronize()
    return out, time.perf_counter() - start


def stats(diff: torch.Tensor) -> dict[str, float]:
    """Mean and max of an absolute difference."""
    diff = diff.abs().double()
    return {"mean": float(diff.mean()), "max": float(diff.max())}


class Context:
    """What the stages share, built when a stage first needs it: the model directories, the actor (a trainable
    bf16 ``ShardedModel`` at TP=1 in an ``ActorRole``), the engine server, and figures later stages judge by."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.work = Path(args.work)
        self._actor = None
        self._server = None
        self.client = None
        self.out = Path(args.out or args.work)
        """Where the JSON lines and the engine's log go (a directory the machine's caller collects)."""
        self.floor: float | None = None
        """Parity's mean |HF bf16 - HF fp32|: how far bf16 alone moves log-probs on this model and data."""
        self.recorder: Recorder | None = None

    def note(self, what: str) -> None:
        """A progress line of the running stage (its seconds so far)."""
        if self.recorder is not None:
            self.recorder.note(what)

    def model_dir(self, shape: str, seed: int = 0) -> Path:
        return save_model(self.work / f"qwen2_{shape}_seed{seed}", shape, self.device, seed)

    @property
    def actor(self):
        """The actor role over the check's model (built on first use; the process group on first build)."""
        if self._actor is None:
            self._actor = build_actor(self.model_dir(self.args.shape), rows=ROWS, micro_rows=ROWS // 2)
        return self._actor

    def drop_actor(self) -> None:
        """Free the actor (its exporter's buffers too) before another model is built."""
        if self._actor is not None:
            self._actor.model.release_export_buffers()
            self._actor = None
        release_memory()

    def engine(self, extra_args: tuple[str, ...] = (), model_dir: Path | None = None):
        """The engine server's client: megarl's server on this device, started on first use from ``model_dir``
        (default: the model directory, so it holds the actor's initial weights), with ``extra_args`` (a running one
        started otherwise is stopped first)."""
        wanted = (tuple(extra_args), model_dir)
        if self._server is not None and getattr(self, "_server_args", ((), None)) != wanted:
            self.stop_engine()
        self._server_args = wanted
        if self._server is None:
            from megarl.engines.client import EngineClient
            from megarl.engines.server_process import ServerProcess
            from megarl.parallel.net import free_port

            port = free_port()
            path = model_dir or self.model_dir(self.args.shape)
            argv = [sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", str(path),
                    "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                    "--device", "cuda:0" if self.device.type == "cuda" else "cpu", "--random-seed", "1", *extra_args]
            url = f"http://127.0.0.1:{port}"
            self._server = ServerProcess(argv, name="engine 0", url=url, log_path=self.out / "engine_0.log").start()
            self._server.wait_healthy(ENGINE_START_S)
            self.client = EngineClient(url, name="engine 0")
        return self.client

    @property
    def engine_url(self) -> str:
        return self._server.url

    def stop_engine(self) -> None:
        if self.client is not None:
            self.client.close_sync()
            self.client = None
        if self._server is not None:
            self._server.stop()
            self._server = None


def build_actor(model_dir: Path, *, rows: int, micro_rows: int):
    """An ``ActorRole`` over a trainable bf16 ``ShardedModel`` of ``model_dir`` at TP=1: one optimizer step per
    update of ``rows`` rows, micro-batches of ``micro_rows``."""
    from megarl.config.actor import ActorConfig
    from megarl.config.model import OptimConfig
    from megarl.config.parallel import ParallelDims
    from megarl.workers.actor import ActorRole
    from megarl.workers.sharded_model import ShardedModel

    optim = OptimConfig(lr=LR, clip_grad=1.0)
    model = ShardedModel(model_dir, ParallelDims(tp=1, pp=1), params_dtype=DTYPE, optim=optim)
    config = ActorConfig(ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=micro_rows, optim=optim)
    return ActorRole(model, config, micro_batch_size=micro_rows)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def init_process_group() -> None:
    """World size 1 in this process (megarl's ``init_parallel`` reads the environment, as under torchrun)."""
    from megarl.parallel.net import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


# ----------------------------------------------------------------------------------------------------- stages
def run_parity(ctx: Context, out: dict) -> None:
    """megarl bf16 against HF fp32 and bf16, packed and padded (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    model = ctx.actor.model
    batches = [rl_batch(ROWS, PROMPT, RESPONSE, model.hf_config.vocab_size, seed=s) for s in (11, 12)]
    micro = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]} for b in batches]
    pairs = [next_token_pairs(b["attention_mask"]) for b in batches]
    refs = {}
    for name, dtype in (("hf_fp32", torch.float32), ("hf_bf16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(model.hf_dir, dtype=dtype).to(ctx.device).eval()
        refs[name] = [hf_logprobs(hf, b["input_ids"], b["attention_mask"]) for b in batches]
        del hf
        release_memory()
    floor = torch.cat([(bf - fp)[m] for bf, fp, m in zip(refs["hf_bf16"], refs["hf_fp32"], pairs)])
    ctx.floor = stats(floor)["mean"]
    packed, logp = model.packed, {}
    try:
        for mode in ("packed", "padded"):
            model.packed = mode == "packed"
            outputs, seconds = timed(lambda: model.forward_logprobs(micro))
            logp[mode] = [o["logp"].float().cpu() for o in outputs]
            for ref in refs:
                out[f"{mode}_vs_{ref}"] = stats(torch.cat([(a - b)[m] for a, b, m in zip(logp[mode], refs[ref], pairs)]))
            out[f"{mode}_seconds"] = round(seconds, 3)
    finally:
        model.packed = packed
    worst = max(out["packed_vs_hf_fp32"]["mean"], out["padded_vs_hf_fp32"]["mean"])
    out.update(hf_bf16_vs_hf_fp32=stats(floor), bound=3 * ctx.floor, worst_over_hf_bf16=worst / ctx.floor,
               packed_vs_padded=stats(torch.cat([(a - b)[m] for a, b, m in zip(logp["packed"], logp["padded"], pairs)])),
               tokens=int(sum(m.sum() for m in pairs)))
    out["ok"] = math.isfinite(worst) and worst <= 3 * ctx.floor


def engine_gap(actor, client, seed: int) -> dict:
    """Generate from the engine (T=1, log-probs) and recompute the log-probs with the actor, as a step does."""
    from megarl.data.batch import Batch
    from megarl.engines.client import run_sync
    from megarl.engines.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 500, (32 + 3 * row,), generator=g).tolist() for row in range(ENGINE_ROWS)]
    params = SamplingParams(max_new_tokens=ENGINE_RESPONSE, temperature=1.0, ignore_eos=True)
    outputs = run_sync(client.generate_batch(prompts, params, seed=seed, return_logprob=True))
    ids, mask, engine_logp = rollout_rows(prompts, outputs)
    P = ids.shape[1] - ENGINE_RESPONSE
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:]}, meta={"temperature": 1.0})
    recomputed = actor.compute_log_prob(batch)["log_probs"].float().cpu()
    response = mask[:, P:].bool()
    return {"tokens": int(response.sum()), **stats((recomputed - engine_logp)[response]),
            "engine_mean_logp": float(engine_logp[response].mean())}


def rollout_rows(prompts: list[list[int]], outputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [N, P+R], mask, engine log-probs [N, R])`` of generated rows: prompts left-padded to the longest,
    responses of up to :data:`ENGINE_RESPONSE` tokens after them."""
    P, R = max(map(len, prompts)), ENGINE_RESPONSE
    ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    engine_logp = torch.zeros(len(prompts), R)
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        n = len(output.output_ids)
        ids[row, P - len(prompt):P + n] = torch.tensor(prompt + list(output.output_ids))
        mask[row, P - len(prompt):P + n] = 1
        engine_logp[row, :n] = torch.tensor(output.output_logprobs)
    return ids, mask, engine_logp


def gap_bound(ctx: Context) -> float | None:
    """Largest mean rollout/train gap accepted: both models within 3x of bf16's own error from HF fp32 (parity's
    bar), so within 4x of it from each other; None when parity did not run."""
    return None if ctx.floor is None else 4 * ctx.floor


def run_engine(ctx: Context, out: dict) -> None:
    """The engine's log-probs against the actor's recompute on the same weights."""
    client = ctx.engine()
    gap, seconds = timed(lambda: engine_gap(ctx.actor, client, seed=3))
    bound = gap_bound(ctx)
    out.update(gap, seconds_generate_and_recompute=round(seconds, 2), bound=bound)
    out["ok"] = gap["tokens"] > 0 and math.isfinite(gap["max"]) and (bound is None or gap["mean"] <= bound)


def run_ppo(ctx: Context, out: dict) -> None:
    """One PPO update with advantages +1 / -1 on alternate rows; did the log-probs follow them?"""
    actor = ctx.actor
    batch = rl_batch(ROWS, PROMPT, RESPONSE, actor.model.hf_config.vocab_size, seed=21)
    before = actor.compute_log_prob(batch)["log_probs"].float().cpu()
    sign_N = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0)
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = before
    batch["advantages"] = sign_N[:, None] * mask
    (result,), seconds = timed(lambda: actor.update(batch))
    after = actor.compute_log_prob(batch)["log_probs"].float().cpu()
    moved_N = ((after - before) * mask).sum(-1) / mask.sum(-1)  # each row's mean change
    toward = float((moved_N * sign_N).mean())
    out.update(applied=result.applied, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr,
               logp_moved_toward_advantage=toward, step_seconds=round(seconds, 3),
               metrics={k: float(v) for k, v in result.metrics.items()})
    out["ok"] = result.applied and math.isfinite(result.grad_norm) and toward > 0


def read_back(client, expected: dict[str, torch.Tensor], whole: set[str]) -> tuple[list[str], int]:
    """Names whose engine values differ from ``expected`` (the first rows of each, all rows of ``whole``) and the
    number of values compared: read by megarl's engine server's own look at its weights (``inspect_weight``: this
    check's Qwen2 models are ones SGLang cannot read back, so the transport's verification reports them unverified)."""
    from megarl.engines.client import run_sync
    from megarl.engines.cpu_engine.read_back import inspect_weight

    differ, compared = [], 0
    for name, tensor in expected.items():
        rows = tensor.shape[0] if (name in whole or tensor.dim() < 2) else min(8, tensor.shape[0])
        got = run_sync(inspect_weight(client.url, name, rows)).float().reshape(tensor[:rows].shape)
        compared += got.numel()
        if not torch.equal(got, tensor[:rows]):
            differ.append(name)
    return differ, compared


def copy_gbps(total_bytes: int, bucket_bytes: int, device: torch.device) -> float:
    """GB/s of copying ``total_bytes`` device to device in buffers of ``bucket_bytes`` (the sync's own copy floor)."""
    size = min(bucket_bytes, total_bytes)
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copies = -(-total_bytes // size)
    dst.copy_(src)  # warm-up
    _, seconds = timed(lambda: [dst.copy_(src) for _ in range(copies)])
    return copies * size / seconds / 1e9


def run_sync_stage(ctx: Context, out: dict) -> None:
    """The trained weights into the engine by the ``tensor`` transport, read back (see the module docstring)."""
    from megarl.config.rollout import RolloutConfig
    from megarl.engines.client import EngineAddress, run_sync
    from megarl.sync.base import verify_sample
    from megarl.sync.tensor import TensorTransport

    client, actor = ctx.engine(), ctx.actor
    model = actor.model
    exporter = model.exporter(DTYPE)
    expected = {}
    for bucket in exporter.iter_full(RolloutConfig.bucket_mb << 20, reuse_buffer=False):
        expected.update((name, tensor.detach().float().cpu()) for name, tensor in bucket)
    names = list(expected)
    small = [name for name in names if expected[name].numel() <= WHOLE_MAX_VALUES]
    whole = set(small[1::max(1, len(small) // VERIFY_SAMPLE)])
    differed_before, _ = read_back(client, expected, set())
    transport = TensorTransport(model.groups, [EngineAddress(index=0, url=ctx.engine_url, tp=1, host_ranks=(0,))])
    runs, differ = [], {}
    memory_before = torch.cuda.memory_allocated() if ctx.device.type == "cuda" else 0
    try:
        for version, bucket_mb in enumerate((RolloutConfig.bucket_mb, SMALL_BUCKET_MB), start=1):
            verify = verify_sample(names, RolloutConfig.verify_weights, step=version)
            report, seconds = timed(lambda: transport.sync(exporter, bucket_bytes=bucket_mb << 20,
                                                           version=str(version), verify_names=verify))
            last = version == 2
            differ[bucket_mb], compared = read_back(client, expected, whole if last else set())
            runs.append({"bucket_mb": bucket_mb, "seconds": round(seconds, 4), "gbps": report["weight_sync/gbps"],
                         "buckets": report["weight_sync/buckets"], "verified_by_transport": report["verified_checks"],
                         "values_read_back": compared, "differing": differ[bucket_mb][:10]})
            if version == 1:
                gap = engine_gap(actor, client, seed=3)
    finally:
        transport.close()
        model.release_export_buffers()
    if ctx.device.type == "cuda":  # buffers the engine has not let go of yet (CUDA IPC), then after collecting them
        held = torch.cuda.memory_allocated() - memory_before
        torch.cuda.ipc_collect()
        out["ipc_memory_mb"] = {"held_after_syncs": held >> 20,
                                "after_ipc_collect": (torch.cuda.memory_allocated() - memory_before) >> 20}
    version = run_sync(client.model_info())["weight_version"]
    copy = copy_gbps(exporter.total_bytes, RolloutConfig.bucket_mb << 20, ctx.device)
    bound = gap_bound(ctx)
    out.update(tensors=len(names), bytes=exporter.total_bytes, tensors_differing_before=len(differed_before),
               whole_tensors=len(whole), syncs=runs, engine_weight_version=version, copy_gbps=copy,
               sync_vs_copy=runs[0]["gbps"] / copy, gap_after_sync=gap, gap_bound=bound)
    out["ok"] = (len(differed_before) > 0 and not any(differ.values()) and version == "2"
                 and math.isfinite(gap["max"]) and (bound is None or gap["mean"] <= bound))
    print(common.result_line({"sync_vs_copy": out["sync_vs_copy"], "sync_gbps": runs[0]["gbps"],
                              "copy_gbps": copy}), flush=True)


def run_lora(ctx: Context, out: dict) -> None:
    """LoRA on this device and its adapters synced alone into a server serving LoRA (see the module docstring)."""
    from megarl.config.actor import ActorConfig
    from megarl.config.lora import LoraSpec
    from megarl.config.model import OptimConfig
    from megarl.config.parallel import ParallelDims
    from megarl.engines.client import EngineAddress
    from megarl.engines.lora_wire import ADAPTER_NAME
    from megarl.models.lora import adapters_disabled, is_lora_parameter
    from megarl.plan.engine_gpus import lora_flags
    from megarl.sync.adapters import AdapterSync
    from megarl.workers.actor import ActorRole
    from megarl.workers.sharded_model import ShardedModel

    ctx.drop_actor()
    model_dir = ctx.model_dir(ctx.args.shape)
    spec = LoraSpec(rank=8, alpha=16.0, init_b="random")
    optim = OptimConfig(lr=LR, clip_grad=1.0)
    model = ShardedModel(model_dir, ParallelDims(tp=1, pp=1), params_dtype=DTYPE, optim=optim, lora=spec,
                         groups=ctx.actor.model.groups)
    actor = ActorRole(model, ActorConfig(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=ROWS // 2,
                                         optim=optim), micro_batch_size=ROWS // 2)
    batch = rl_batch(ROWS, PROMPT, RESPONSE, model.hf_config.vocab_size, seed=31)
    plain = ctx.actor.compute_log_prob(batch)["log_probs"].float().cpu()
    with adapters_disabled(model.module_chunks):
        off = actor.compute_log_prob(batch)["log_probs"].float().cpu()
    on = actor.compute_log_prob(batch)["log_probs"].float().cpu()
    ctx.drop_actor()
    base = {n: p.detach().clone() for n, p in model.module_chunks[0].named_parameters() if not is_lora_parameter(n)}
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = on
    batch["advantages"] = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0)[:, None] * mask
    (result,) = actor.update(batch)
    moved = [n for n, p in model.module_chunks[0].named_parameters() if n in base and not torch.equal(p, base[n])]
    client = ctx.engine(tuple(lora_flags(spec)))
    client.lora_name = ADAPTER_NAME
    sync = AdapterSync(model.groups, [EngineAddress(index=0, url=ctx.engine_url, tp=1, host_ranks=(0,))],
                       config=spec.peft_config(str(model_dir)))
    try:
        report, seconds = timed(lambda: sync.sync(model.exporter(DTYPE), bucket_bytes=1 << 20, version="lora"))
        gap = engine_gap(actor, client, seed=5)
    finally:
        sync.close()
        ctx.stop_engine()
    bound = gap_bound(ctx)
    adapters = len(model.exporter(DTYPE).adapters())
    out.update(adapters_off_vs_plain=stats(off - plain), adapters_on_vs_off=stats(on - off), applied=result.applied,
               grad_norm=result.grad_norm, base_weights_moved=moved[:10], adapter_tensors=adapters,
               verified=report["verified_checks"], sync_seconds=round(seconds, 4), sync_bytes=report["weight_sync/bytes"],
               gap=gap, gap_bound=bound)
    out["ok"] = (torch.equal(off, plain) and float((on - off).abs().max()) > 0 and result.applied and not moved
                 and report["verified_checks"] == adapters > 0 and math.isfinite(gap["max"])
                 and (bound is None or gap["mean"] <= bound))


def run_fp8(ctx: Context, out: dict) -> None:
    """FP8 rollout on this device (see the module docstring)."""
    from megarl.config.rollout import RolloutConfig
    from megarl.convert.fp8 import fp8_names, write_fp8_checkpoint
    from megarl.engines.client import EngineAddress
    from megarl.models.fp8 import quantize_block_fp8, scale_name
    from megarl.sync.base import verify_sample
    from megarl.sync.tensor import TensorTransport

    actor = ctx.actor
    model = actor.model
    fp8_dir = ctx.work / f"qwen2_{ctx.args.shape}_fp8"
    if not (fp8_dir / "config.json").exists():
        write_fp8_checkpoint(ctx.model_dir(ctx.args.shape), fp8_dir)
    ctx.note("FP8 checkpoint written")
    client = ctx.engine(model_dir=fp8_dir)
    ctx.note("engine started")
    quantized = fp8_names(model.family, model.hf_config)
    expected = {}
    for bucket in model.exporter(DTYPE).iter_full(1 << 26, reuse_buffer=False):
        for name, tensor in bucket:
            if name in quantized:
                weight, scale = quantize_block_fp8(tensor.detach())
                expected[name], expected[scale_name(name)] = weight.float().cpu(), scale.float().cpu()
    transport = TensorTransport(model.groups, [EngineAddress(index=0, url=ctx.engine_url, tp=1, host_ranks=(0,))])
    transport.quantization = "fp8"
    # the transport verifies a sample whole (as a run does: JSON answers of every weight would take minutes), the
    # read-back the first rows of every quantized weight and scale, all rows of the small ones
    verify = verify_sample(sorted(quantized), RolloutConfig.verify_weights, step=1)
    whole = {name for name, tensor in expected.items() if tensor.numel() <= WHOLE_MAX_VALUES}
    try:
        report, seconds = timed(lambda: transport.sync(model.exporter(DTYPE), bucket_bytes=1 << 26, version="fp8",
                                                       verify_names=verify))
        ctx.note(f"synced in {seconds:.1f} s")
        differ, compared = read_back(client, expected, whole)
        ctx.note("read back")
        gap = engine_gap(actor, client, seed=7)
    finally:
        transport.close()
        model.release_export_buffers()
        ctx.stop_engine()
    out.update(quantized_weights=len(quantized), values_read_back=compared, whole_read_back=len(whole),
               differing=differ[:10], verified_by_transport=report["verified_checks"],
               unverifiable_engines=len(report["unverifiable"]), sync_bytes=report["weight_sync/bytes"],
               sync_seconds=round(seconds, 4), sync_gbps=report["weight_sync/gbps"], gap=gap,
               bf16_gap_bound=gap_bound(ctx))
    # The transport asked for its sample and was refused, as SGLang refuses a Qwen2: the engine reported unverified.
    out["ok"] = (not differ and compared > 0 and report["unverifiable"] == [0] and report["verified_checks"] == 0
                 and math.isfinite(gap["max"]))


def run_vl(ctx: Context, out: dict) -> None:
    """A vision-language policy on this device (see the module docstring)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    from megarl.config.rollout import RolloutConfig
    from megarl.data.batch import Batch
    from megarl.data.images import ImageProcessor, image_uri
    from megarl.engines.client import EngineAddress, run_sync
    from megarl.engines.engine import SamplingParams
    from megarl.models.hf_config import load_hf_config
    from megarl.models.tiny import save_tiny_vl
    from megarl.sync.base import verify_sample
    from megarl.sync.tensor import TensorTransport

    ctx.drop_actor()
    model_dir = ctx.work / f"qwen2_5_vl_{ctx.args.shape}"
    if not (model_dir / "config.json").exists():
        save_tiny_vl(model_dir, seed=1, initializer_range=INIT_RANGE, **VL_SHAPES[ctx.args.shape])
    ctx.note("model written")
    actor = build_actor(model_dir, rows=ENGINE_ROWS, micro_rows=ENGINE_ROWS // 2)
    ctx.note("actor built")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = ImageProcessor.from_pretrained(model_dir, tokenizer, load_hf_config(model_dir))
    rng = np.random.default_rng(5)
    images = [Image.fromarray((rng.random((28 * (1 + row % 3), 56, 3)) * 255).astype("uint8"))
              for row in range(ENGINE_ROWS)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]
    template = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    inputs = [processor.pixels([image]) for image in images]
    prompts = [processor.expand(template, x["image_grid_thw"]) for x in inputs]
    client = ctx.engine(model_dir=model_dir)
    ctx.note("engine started")
    try:
        params = SamplingParams(max_new_tokens=ENGINE_RESPONSE, temperature=1.0, ignore_eos=True)
        outputs = run_sync(client.generate_batch(prompts, params, seed=5, return_logprob=True,
                                                 image_data=[[image_uri(image)] for image in images]))
        ctx.note("generated")
        ids, mask, engine_logp = rollout_rows(prompts, outputs)
        P = ids.shape[1] - ENGINE_RESPONSE
        batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:],
                                 "response_mask": mask[:, P:], "multi_modal_inputs": inputs},
                                meta={"temperature": 1.0})
        recomputed = actor.compute_log_prob(batch)["log_probs"].float().cpu()
        ctx.note("log-probs recomputed")
        response = mask[:, P:].bool()
        gap = {"tokens": int(response.sum()), **stats((recomputed - engine_logp)[response])}
        sign_N = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0)
        batch["old_log_probs"] = recomputed
        batch["advantages"] = sign_N[:, None] * mask[:, P:].float()
        (result,) = actor.update(batch)
        ctx.note("updated")
        model = actor.model
        expected = {}
        for bucket in model.exporter(DTYPE).iter_full(1 << 26, reuse_buffer=False):
            expected.update((name, tensor.detach().float().cpu()) for name, tensor in bucket)
        names = list(expected)
        # a sample verified whole by the transport, half of it the tower's; the first rows of every tensor read back
        tower_names = [n for n in names if n.startswith("visual.")]
        half = max(1, RolloutConfig.verify_weights // 2)
        verify = sorted(set(verify_sample(tower_names, half, step=1))
                        | set(verify_sample([n for n in names if n not in tower_names], half, step=1)))
        transport = TensorTransport(model.groups, [EngineAddress(index=0, url=ctx.engine_url, tp=1,
                                                                 host_ranks=(0,))])
        try:
            report, seconds = timed(lambda: transport.sync(model.exporter(DTYPE), bucket_bytes=1 << 26, version="vl",
                                                           verify_names=verify))
            ctx.note(f"synced in {seconds:.1f} s")
            differ, compared = read_back(client, expected, set())
            ctx.note("read back")
        finally:
            transport.close()
            model.release_export_buffers()
    finally:
        ctx.stop_engine()
    bound = gap_bound(ctx)
    tower = sum(n.startswith("visual.") for n in names)
    out.update(gap=gap, bound=bound, image_tokens=int((ids == processor.image_token_id).sum()), applied=result.applied,
               grad_norm=result.grad_norm, tensors=len(names), tower_tensors=tower,
               verified_by_transport=report["verified_checks"], unverifiable_engines=len(report["unverifiable"]),
               values_read_back=compared, differing=differ[:10], sync_seconds=round(seconds, 4),
               sync_gbps=report["weight_sync/gbps"])
    out["ok"] = (gap["tokens"] > 0 and math.isfinite(gap["max"]) and (bound is None or gap["mean"] <= bound)
                 and result.applied and math.isfinite(result.grad_norm) and tower > 0 and not differ
                 and compared > 0 and report["unverifiable"] == [0])


def train_flops_per_token(hf_config, seq: int) -> tuple[int, float]:
    """The matmul parameters N (layers and LM head; a tied embedding's lookup is free) and the training flops per
    token: 6 N, plus causal attention over rows of ``seq`` tokens (QK and AV: 4 seq h per layer forward, half of
    it under the causal mask, x3 for forward and backward)."""
    h, ffn, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    kv = hf_config.num_key_value_heads * (h // hf_config.num_attention_heads)
    params = layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + h * hf_config.vocab_size
    return params, 6 * params + 6 * layers * h * seq


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def median_after_first(seconds: list[float]) -> float:
    """The median step time, the first (warm-up, compilation) step left out when there are others."""
    rest = sorted(seconds[1:] or seconds)
    return rest[len(rest) // 2]


def profile_step(step: Callable[[], object], path: Path | None, device: torch.device) -> None:
    """Run ``step`` once more under torch's profiler and write its operators and kernels, by their own device time
    (CPU time without CUDA), to ``path``; nothing without a path."""
    if path is None:
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as profiler:
        timed(step)
    table = profiler.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=60, max_name_column_width=100)
    path.write_text(table)


def hf_train_steps(model_dir: Path, batch, P: int, steps: int, device: torch.device,
                   profile_path: Path | None = None) -> list[float]:
    """HF transformers' training step on the same rows: sdpa forward, fp32 log-softmax of the response tokens,
    backward, AdamW (bf16 parameters and states, fused on CUDA); one more under the profiler with
    ``profile_path``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, attn_implementation="sdpa").to(device).train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=LR, fused=device.type == "cuda")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def step() -> None:
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, P - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, P:, None])
        (-logp.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = [timed(step)[1] for _ in range(steps)]
    profile_step(step, profile_path, device)
    return seconds


def megarl_train_steps(model_dir: Path, rows: int, half_seq: int, steps: int, device: torch.device,
                       profile_path: Path | None = None) -> dict:
    """megarl's training step (``ActorRole.update``: one micro-batch of ``rows`` full rows, the PPO loss) ``steps``
    times, and a log-prob recompute (timed the second time: the first compiles Megatron's fused functions), on a
    fresh actor: the step results, seconds, the batch and the config; one more step under the profiler with
    ``profile_path``."""
    actor = build_actor(model_dir, rows=rows, micro_rows=rows)  # one micro-batch: one forward and backward
    batch = rl_batch(rows, half_seq, half_seq, actor.model.hf_config.vocab_size, seed=5, min_prompt=half_seq,
                     min_response=half_seq)
    for _ in range(2):
        batch["old_log_probs"], logprob_seconds = timed(lambda: actor.compute_log_prob(batch)["log_probs"])
    batch["advantages"] = batch["response_mask"].float()
    results, seconds = [], []
    for _ in range(steps):
        (result,), step_seconds = timed(lambda: actor.update(batch))
        results.append(result)
        seconds.append(step_seconds)
    profile_step(lambda: actor.update(batch), profile_path, device)
    return {"results": results, "seconds": seconds, "logprob_seconds": logprob_seconds, "batch": batch,
            "hf_config": actor.model.hf_config}


def run_mfu(ctx: Context, out: dict) -> None:
    """megarl's train step against HF transformers' on a larger model (see the module docstring)."""
    args = ctx.args
    ctx.stop_engine()
    ctx.drop_actor()
    model_dir = ctx.model_dir(args.mfu_shape, seed=1)
    seq = 2 * args.mfu_half_seq
    rows = max(1, args.mfu_tokens // seq)
    profiles = {side: ctx.out / f"profile_{side}.txt" if args.profile else None for side in ("megarl", "hf")}
    megarl = megarl_train_steps(model_dir, rows, args.mfu_half_seq, args.mfu_steps, ctx.device,
                                profiles["megarl"])
    results, seconds, cfg = megarl["results"], megarl["seconds"], megarl["hf_config"]
    peak_memory = torch.cuda.max_memory_allocated() / 2**30 if ctx.device.type == "cuda" else None
    release_memory()
    hf_seconds = hf_train_steps(model_dir, megarl["batch"], args.mfu_half_seq, args.mfu_steps, ctx.device,
                                profiles["hf"])
    release_memory()
    tokens = rows * seq
    params, flops = train_flops_per_token(cfg, seq)
    peak = peak_tflops(ctx.device, args.peak_tflops)
    step, hf_step = median_after_first(seconds), median_after_first(hf_seconds)
    figures = {"megarl": step, "hf_sdpa": hf_step}
    for name, s in figures.items():
        out[name] = {"step_s": s, "tokens_per_s": tokens / s, "tflops": flops * tokens / s / 1e12,
                     "mfu": None if peak is None else flops * tokens / s / 1e12 / peak}
    out["megarl"].update(steps_s=[round(s, 4) for s in seconds], logprob_tokens_per_s=tokens / megarl["logprob_seconds"],
                         peak_memory_gib=peak_memory, applied=[r.applied for r in results])
    out["hf_sdpa"]["steps_s"] = [round(s, 4) for s in hf_seconds]
    out.update(device=torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
               shape=args.mfu_shape, params=params, flops_per_token=flops, tokens_per_step=tokens, seq=seq,
               peak_tflops=peak, mfu_vs_hf=hf_step / step, spec="local (no TransformerEngine)")
    out["ok"] = all(r.applied and math.isfinite(r.grad_norm) for r in results) and math.isfinite(out["mfu_vs_hf"])
    result = {"mfu_vs_hf": out["mfu_vs_hf"], "megarl_tokens_per_s": out["megarl"]["tokens_per_s"],
              "hf_tokens_per_s": out["hf_sdpa"]["tokens_per_s"]}
    if peak is not None:
        result.update(megarl_mfu=out["megarl"]["mfu"], hf_mfu=out["hf_sdpa"]["mfu"])
    print(common.result_line(result), flush=True)


RUNNERS = {"parity": run_parity, "engine": run_engine, "ppo": run_ppo, "sync": run_sync_stage, "lora": run_lora,
           "fp8": run_fp8, "vl": run_vl, "mfu": run_mfu}


# ----------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated, from {','.join(STAGES)} (run in that order; sync adds ppo)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b" if cuda else "tiny",
                        help="model of parity, engine, ppo and sync (default 0.5b on CUDA, tiny without)")
    parser.add_argument("--mfu-shape", choices=sorted(SHAPES), default=None,
                        help="model of the mfu stage (default 1.5b on CUDA, tiny with --shape tiny)")
    parser.add_argument("--mfu-tokens", type=int, default=None,
                        help="tokens per mfu step (default 8192 on CUDA: the fp32 log-softmax fits 80 GB; 1024 without)")
    parser.add_argument("--mfu-half-seq", type=int, default=None,
                        help="prompt and response width of the mfu rows (default 512 on CUDA, 64 without)")
    parser.add_argument("--mfu-steps", type=int, default=4 if cuda else 2, help="steps per side (the first is warm-up)")
    parser.add_argument("--stage-timeout", type=float, default=None,
                        help="seconds a stage may run before every thread's stack is printed and it is stopped as "
                             "failed (the next stage runs); default: no limit")
    parser.add_argument("--profile", action="store_true",
                        help="mfu: profile one more step of each side (profile_megarl.txt, profile_hf.txt in --out)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak (default: by name)")
    parser.add_argument("--work", default="/tmp/megarl_gpu_check", help="where the random models are written (kept)")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="directory of gpu_check.jsonl and engine_0.log (default: $OUT, else --work)")
    args = parser.parse_args(argv)
    big = cuda and args.shape != "tiny"
    args.mfu_shape = args.mfu_shape or ("1.5b" if big else "tiny")
    args.mfu_tokens = args.mfu_tokens or (8192 if big else 1024)
    args.mfu_half_seq = args.mfu_half_seq or (512 if big else 64)
    picked = {s for s in args.stages.split(",") if s}
    unknown = picked - set(STAGES)
    if unknown:
        parser.error(f"--stages: unknown {sorted(unknown)}; pick from {','.join(STAGES)}")
    for stage in list(picked):
        picked.update(REQUIRES.get(stage, ()))
    args.stages = [s for s in STAGES if s in picked]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = Context(args, device)
    recorder = ctx.recorder = Recorder(ctx.out / "gpu_check.jsonl", args.stage_timeout)
    if hasattr(signal, "SIGTERM"):  # killed by an outer time limit: where every thread was, then the default exit
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    import megatron.core
    import transformers

    from megarl.engines import event_loop

    start = time.perf_counter()
    init_process_group()
    recorder.record("env", True, 0.0, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                    megatron_core=megatron.core.__version__, python=sys.version.split()[0], stages=args.stages,
                    shape=args.shape, mfu_shape=args.mfu_shape, dtype=str(DTYPE).removeprefix("torch."),
                    transformer_engine=importlib.util.find_spec("transformer_engine") is not None)
    event_loop.hold()  # the engine client's calls run on it
    try:
        for name in args.stages:
            with recorder.stage(name) as out:
                RUNNERS[name](ctx, out)
    finally:
        ctx.stop_engine()
        event_loop.release()
    failed = [name for name in args.stages if not recorder.results.get(name)]
    recorder.record("summary", not failed, time.perf_counter() - start, passed=len(args.stages) - len(failed),
                    failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
