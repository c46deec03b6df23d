"""megarl's two-GPU check: what one GPU cannot show, in about ten minutes on one node with two GPUs.

    python tools/multi_gpu_check.py                       # 2 CUDA GPUs, TransformerEngine and sglang 0.5.23 installed
    python tools/multi_gpu_check.py --rehearse            # CPU: gloo ranks, the local spec, megarl's CPU engine
    python tools/multi_gpu_check.py --stages te_parity,distributed --out /tmp/check

``tools/gpu_check.py`` runs on one GPU at world size 1, with the local layer spec and megarl's own engine server.
This script takes what needs two ranks, TransformerEngine or SGLang (how to run it: ``docs/gpu.md``). Stages, in this
order (``--stages`` picks some), each with its models written under ``--work``:

  te_parity    a Qwen2.5-shaped random model (0.5B on GPUs, tiny rehearsed): log-probs of packed (THD) micro-batches
               and one PPO step's gradient norm at TP=2 with sequence parallelism on TE's spec, against TP=1 on the
               local spec, both against HF fp32. Pass: each within 3x of HF bf16's own error from HF fp32, the
               gradient norms within 5 %.
  te_moe       a tiny Qwen3-MoE at EP=2 (TE's grouped GEMM on GPUs): HF -> Megatron -> HF export bit for bit, its
               log-probs against HF fp32's; then rows an engine (GPU 1, ``--enable-return-routed-experts``) sampled
               with the experts it routed every token to, recomputed replaying that routing. Pass: every tensor
               equal, the log-probs within 1e-3, the replay exact and the trainer's own routers agreeing with the
               engine's on at least 75 % of (token, layer) pairs (a misread layout would not).
  offload      a DP=2 actor: three PPO updates with Megatron's offload (parameters, gradients, optimizer states)
               and onload around each, against three without; then with the hybrid CPU optimizer
               (``optimizer_cpu_offload``, half the states on the host) and megarl's offload of parameters and
               gradients only, as megarl allows it. Pass: the losses equal (GPU only: on CPU offload is a no-op and
               the hybrid optimizer is refused).
  colocated    an engine (SGLang with ``--enable-memory-saver``, TP=2) on the actor's two GPUs: release kv_cache,
               cuda_graph and weights, resume the weights, the ``tensor`` transport's sync of changed weights,
               resume the rest, then the engine's log-probs against the actor's. Pass: the gap after the sync
               within 4x of HF bf16's error, and smaller than before the sync.
  lora         a TP=2 LoRA actor and an engine serving LoRA (TP=2) on its GPUs, as ``lora_sync=adapters`` runs: the
               engine releases what megarl's ``EngineMemory`` releases for it (not the weights: the adapters-only
               sync never rewrites them), one update, the adapters alone synced (each rank's payload on its own GPU),
               then the engine's log-probs naming the adapter against the actor's. Pass: within 4x of HF bf16's
               error, the engine's base model not, every adapter tensor checked, nothing left released.
  distributed  the actor on GPU 0, a Llama engine on GPU 1 (Llama: the family SGLang reads weights back from): the
               ``distributed`` transport (a weight group over NCCL) in bf16 and, into an engine started from the FP8
               checkpoint, in block FP8, every tensor verified by the transport as SGLang answers; and megarl's
               refusal of that transport with colocated engines on GPUs. Pass: no tensor differs, the engines
               counted verified, the refusal raised.
  deepseek     a tiny DeepSeek-V3 (MLA, TE's MLA spec on GPUs) into an engine by buckets of 64 KiB (SGLang fuses
               q_a_proj and kv_a_proj_with_mqa only within one request: megarl's buckets keep them together), then
               its log-probs against the actor's. Pass: the gap within 4x of HF bf16's error, smaller than before.

Output as ``tools/gpu_check.py``'s: one JSON line per stage (``{"stage", "ok", "seconds", ...}``) on stdout and
appended to ``$OUT/multi_gpu_check.jsonl`` (``--out``), engine logs beside it; an ``env`` line first, a ``summary``
last; exit code 0 when every stage passed. ``--rehearse`` runs every stage at tiny shapes on the CPU (gloo ranks, the
local spec, megarl's CPU engine server, which answers as SGLang does): the logic, not the kernels;
``tests/e2e/test_multi_gpu_check.py`` runs it so.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import math
import os
import signal
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check's helpers (and its bench_convert)

import gpu_check as single
import torch

STAGES = ("te_parity", "te_moe", "offload", "colocated", "lora", "distributed", "deepseek")
DTYPE = single.DTYPE
LR = single.LR
ENGINE_START_S = 600.0
SMALL_BUCKET = 64 << 10
"""The deepseek stage's bucket bytes: a tiny MLA layer's tensors span several buckets."""


class Sizes:
    """The shapes of a run: GPU (``0.5b``) or rehearsal (``tiny``)."""

    def __init__(self, rehearse: bool) -> None:
        self.shape = "tiny" if rehearse else "0.5b"
        self.rows, self.prompt, self.response = (4, 24, 24) if rehearse else (8, 96, 160)
        self.engine_rows, self.engine_response = (4, 8) if rehearse else (8, 64)


# ------------------------------------------------------------------------------------------------- rank jobs
def _actor(model_dir: str, dims_fields: dict, sizes: Sizes, *, use_te=None, optim_fields=None, lora=None):
    """An ``ActorRole`` over a trainable bf16 ``ShardedModel`` of ``model_dir`` on this rank's ``ParallelDims``."""
    from megarl.config.actor import ActorConfig
    from megarl.config.model import OptimConfig
    from megarl.config.parallel import ParallelDims
    from megarl.workers.actor import ActorRole
    from megarl.workers.sharded_model import ShardedModel

    optim = OptimConfig(lr=LR, clip_grad=1.0, **(optim_fields or {}))
    model = ShardedModel(model_dir, ParallelDims(**dims_fields), params_dtype=DTYPE, optim=optim, use_te=use_te,
                         lora=lora)
    rows = sizes.rows // model.groups.dims.dp  # this DP rank's share of one mini-batch of every row
    config = ActorConfig(ppo_mini_batch_size=sizes.rows, ppo_micro_batch_size_per_gpu=rows, optim=optim)
    return ActorRole(model, config, micro_batch_size=rows)


def _uses_te(model) -> bool:
    return any(type(m).__module__.startswith("transformer_engine") or type(m).__name__.startswith("TE")
               for chunk in model.module_chunks for m in chunk.modules())




def _ppo_steps(actor, batch, steps: int, between=None) -> list[tuple[float, float]]:
    """``steps`` PPO updates of ``batch`` (this rank's rows) with advantages +1 / -1 on alternate rows; ``between``
    runs before each; (loss, grad norm) of each."""
    import torch.distributed as dist

    out = actor.compute_log_prob(batch)  # on each TP group's rank 0 (PP=1 here): the others get it from there
    old = (out["log_probs"] if out is not None else torch.zeros(batch["responses"].shape)).float()
    groups = actor.model.groups
    if groups.dims.tp > 1:
        device = actor.model.device
        old = old.to(device)
        dist.broadcast(old, src=dist.get_global_rank(groups.tp, 0), group=groups.tp)
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = old.cpu()
    batch["advantages"] = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0)[:, None] * mask
    results = []
    for _ in range(steps):
        if between is not None:
            between()
        (result,) = actor.update(batch)
        results.append((float(result.loss), float(result.grad_norm)))
    return results


def parity_job(model_dir: str, dims_fields: dict, use_te, batch, sizes: Sizes) -> dict:
    """Log-probs of ``batch`` (packed micro-batch) and one PPO step's gradient norm on this layout."""
    actor = _actor(model_dir, dims_fields, sizes, use_te=use_te)
    model = actor.model
    outputs = model.forward_logprobs([{"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}])
    logp = outputs[0]["logp"].float().cpu() if outputs else None
    (loss, grad_norm), = _ppo_steps(actor, batch, 1)
    return {"logp": logp, "grad_norm": grad_norm, "loss": loss, "te": _uses_te(model), "rank": model.groups.dims.dp}


def moe_job(model_dir: str, batch, routing: dict) -> dict:
    """EP=2: the checkpoint loaded and exported (rank 0 compares every tensor), the log-probs of ``batch``, and the
    engine's rows of ``routing`` recomputed replaying the experts the engine routed each token to (the routing
    measured against the trainer's own routers)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megarl.config.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel

    model = ShardedModel(model_dir, ParallelDims(ep=2), params_dtype=torch.float32, router_replay=True)
    exported = {n: t.detach().float().cpu().clone() for bucket in model.exporter(torch.float32).iter_full(1 << 24)
                for n, t in bucket}
    out = {"grouped_gemm": bool(model.config.moe_grouped_gemm), "te": _uses_te(model)}
    if dist.get_rank() == 0:
        original = load_file(str(Path(model_dir) / "model.safetensors"))
        out["tensors"] = len(original)
        out["differ"] = sorted(n for n in original if n not in exported or not torch.equal(exported[n],
                                                                                            original[n].float()))
        out["extra"] = sorted(set(exported) - set(original))
    outputs = model.forward_logprobs([{"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}])
    out["logp"] = outputs[0]["logp"].float().cpu() if outputs else None
    micro = [{"input_ids": routing["input_ids"], "attention_mask": routing["attention_mask"],
              "rollout_routed_experts": routing["routed"]}]
    for replay in (False, True):
        outputs = model.forward_logprobs(micro, measure_routing=True, replay_routing=replay)
        key = "replayed" if replay else "own"
        out[f"{key}_counts"] = model.last_routing_counts.sum(0).tolist()
        out[f"{key}_logp"] = outputs[0]["logp"].float().cpu() if outputs else None
    return out


def offload_job(model_dir: str, batch, sizes: Sizes, hybrid: bool) -> dict:
    """Three PPO updates with offload/onload before each against three without (``hybrid``: Megatron's hybrid CPU
    optimizer, megarl offloading parameters and gradients only, as it allows)."""
    import gc

    optim = {"override_optimizer_config": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}} \
        if hybrid else None
    runs = {}
    for mode in ("plain", "offloaded"):
        actor = _actor(model_dir, {"tp": 1}, sizes, optim_fields=optim)
        model = actor.model
        mine = batch.shard(model.groups.dp_rank, model.groups.dims.dp)

        def cycle(model=model):
            model.offload(optimizer=not hybrid)
            model.onload()

        runs[mode] = _ppo_steps(actor, mine, 3, between=cycle if mode == "offloaded" else None)
        del actor, model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return runs


def _perturb(chunks, seed: int) -> None:
    """Change every parameter by 30 % of its own scale (seeded by name: replicated copies stay equal)."""
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                generator = torch.Generator().manual_seed(zlib.crc32(f"{name}:{seed}".encode()))
                noise = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
                param.add_(noise * (0.3 * float(param.float().std()) if param.numel() > 1 else 0.01))


def _engine_gap(actor, url: str, sizes: Sizes, seed: int, lora_name: str | None = None) -> dict:
    """Rank 0 samples from the engine (T=1, log-probs), every rank recomputes them with the actor."""
    import torch.distributed as dist

    from megarl.data.batch import Batch
    from megarl.engines.client import EngineClient, run_sync
    from megarl.engines.engine import SamplingParams

    payload = [None]
    if dist.get_rank() == 0:
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 400, (8 + 3 * row,), generator=g).tolist() for row in range(sizes.engine_rows)]
        params = SamplingParams(max_new_tokens=sizes.engine_response, temperature=1.0, ignore_eos=True)
        client = EngineClient(url, name="engine 0", lora_name=lora_name)
        outputs = run_sync(client.generate_batch(prompts, params, seed=seed, return_logprob=True))
        P, R = max(map(len, prompts)), sizes.engine_response
        ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
        mask, engine_logp = torch.zeros_like(ids), torch.zeros(len(prompts), R)
        for row, (prompt, output) in enumerate(zip(prompts, outputs)):
            n = len(output.output_ids)
            ids[row, P - len(prompt):P + n] = torch.tensor(prompt + list(output.output_ids))
            mask[row, P - len(prompt):P + n] = 1
            engine_logp[row, :n] = torch.tensor(output.output_logprobs)
        payload = [(ids, mask, engine_logp, P)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    ids, mask, engine_logp, P = payload[0]
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:]},
                            meta={"temperature": 1.0})
    out = actor.compute_log_prob(batch)
    if out is None:
        return {}
    response = mask[:, P:].bool()
    diff = (out["log_probs"].float().cpu() - engine_logp)[response]
    return {"tokens": int(response.sum()), "mean": float(diff.abs().mean()), "max": float(diff.abs().max())}


def colocated_job(model_dir: str, url: str, sizes: Sizes) -> dict:
    """TP=2 actor and a TP=2 engine on the same GPUs: release, resume the weights, sync, resume the rest."""
    import torch.distributed as dist

    from megarl.engines import event_loop
    from megarl.engines.client import EngineAddress, EngineClient, run_sync
    from megarl.sync import make_transport

    with event_loop.holding():
        actor = _actor(model_dir, {"tp": 2, "sequence_parallel": True}, sizes)
        model = actor.model
        _perturb(model.module_chunks, seed=1)
        before = _engine_gap(actor, url, sizes, seed=3)
        client = EngineClient(url, name="engine 0")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if dist.get_rank() == 0:
            run_sync(client.release_memory_occupation(["kv_cache", "cuda_graph", "weights"]))
            run_sync(client.resume_memory_occupation(["weights"]))
        dist.barrier()
        transport = make_transport("tensor", model.groups, [EngineAddress(index=0, url=url, tp=2, host_ranks=(0, 1))],
                                   device=device)
        try:
            stats = transport.sync(model.exporter(DTYPE), bucket_bytes=64 << 20, version="1", verify_names=[])
        finally:
            transport.close()
            model.release_export_buffers()
        if dist.get_rank() == 0:
            run_sync(client.resume_memory_occupation(["kv_cache", "cuda_graph"]))
        dist.barrier()
        after = _engine_gap(actor, url, sizes, seed=4)
    return {"before": before, "after": after, "buckets": (stats or {}).get("weight_sync/buckets")}


def lora_job(model_dir: str, url: str, sizes: Sizes) -> dict:
    """A TP=2 LoRA actor and a TP=2 engine serving LoRA on the same GPUs, as a run with ``lora_sync=adapters``: the
    engine releases what ``EngineMemory`` releases for it (never the weights: the adapters-only sync does not
    rewrite them), one PPO update, the adapters alone synced (each rank's payload on its own GPU), then the
    engine's log-probs naming the adapter against the actor's."""
    import torch.distributed as dist

    from megarl.config.lora import LoraSpec
    from megarl.controller.engine_memory import EngineMemory
    from megarl.engines import event_loop
    from megarl.engines.client import EngineAddress, EngineClient
    from megarl.engines.lora_wire import ADAPTER_NAME
    from megarl.sync import make_transport

    spec = LoraSpec(rank=8, alpha=16.0, init_b="random")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with event_loop.holding():
        actor = _actor(model_dir, {"tp": 2}, sizes, lora=spec)
        model = actor.model
        memory = EngineMemory([EngineClient(url, name="engine 0")], enabled=True, sync_rewrites_weights=False)
        if dist.get_rank() == 0:
            memory.release(weights=True)  # what the trainer asks before training: kv_cache and cuda_graph only
        batch = single.rl_batch(sizes.rows, sizes.prompt, sizes.response, model.hf_config.vocab_size, seed=21)
        (loss, grad_norm), = _ppo_steps(actor, batch, 1)
        if dist.get_rank() == 0:
            memory.resume(["weights"])
        transport = make_transport("adapters", model.groups, [EngineAddress(index=0, url=url, tp=2,
                                                                            host_ranks=(0, 1))],
                                   device=device, lora_config=spec.peft_config(model_dir))
        try:
            stats = transport.sync(model.exporter(DTYPE), bucket_bytes=1 << 20, version="lora")
        finally:
            transport.close()
        if dist.get_rank() == 0:
            memory.resume(["kv_cache", "cuda_graph"])
            released = sorted(memory.released)
        dist.barrier()
        base = _engine_gap(actor, url, sizes, seed=23)  # the engine's base model against the adapted actor
        after = _engine_gap(actor, url, sizes, seed=23, lora_name=ADAPTER_NAME)
    out = {"base_vs_adapted": base, "after": after, "grad_norm": grad_norm}
    if dist.get_rank() == 0:
        out.update(verified=(stats or {}).get("verified_checks"), still_released=released)
    return out


def distributed_job(model_dir: str, urls: dict, sizes: Sizes) -> dict:
    """One actor rank; per engine of ``urls`` (``bf16`` / ``fp8``) the ``distributed`` transport's sync of changed
    weights with every tensor verified by the transport."""
    from megarl.engines import event_loop
    from megarl.engines.client import EngineAddress
    from megarl.sync import make_transport, merge_stats

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    with event_loop.holding():
        actor = _actor(model_dir, {"tp": 1}, sizes)
        model = actor.model
        _perturb(model.module_chunks, seed=2)
        names = [n for unit in model.exporter(DTYPE).units for n in unit.hf_names]
        for kind, url in urls.items():
            transport = make_transport("distributed", model.groups, [EngineAddress(index=0, url=url, tp=1)],
                                       device=device, quantization="fp8" if kind == "fp8" else None)
            try:
                stats = transport.sync(model.exporter(DTYPE), bucket_bytes=16 << 20, version=kind, verify_names=names)
                merged = merge_stats([stats])
                out[kind] = {"verified_tensors": merged["weight_sync/verified_tensors"],
                             "unverified_tensors": merged["weight_sync/unverified_tensors"],
                             "verified_engines": merged["weight_sync/verified_engines"],
                             "buckets": merged["weight_sync/buckets"], "gbps": merged["weight_sync/gbps"],
                             "names": len(names)}
            except RuntimeError as error:  # a tensor differs: the verification names it
                out[kind] = {"error": str(error)[:500]}
            finally:
                transport.close()
                model.release_export_buffers()
    return out


def deepseek_job(model_dir: str, url: str, sizes: Sizes) -> dict:
    """One actor rank, a DeepSeek-V3 engine on its own device: changed weights by the ``distributed`` transport in
    64 KiB buckets, the engine's log-probs against the actor's before and after."""
    from megarl.engines import event_loop
    from megarl.engines.client import EngineAddress
    from megarl.sync import make_transport

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with event_loop.holding():
        actor = _actor(model_dir, {"tp": 1}, sizes)
        model = actor.model
        _perturb(model.module_chunks, seed=5)
        before = _engine_gap(actor, url, sizes, seed=6)
        transport = make_transport("distributed", model.groups, [EngineAddress(index=0, url=url, tp=1)], device=device)
        try:
            stats = transport.sync(model.exporter(DTYPE), bucket_bytes=SMALL_BUCKET, version="1", verify_names=[])
        finally:
            transport.close()
            model.release_export_buffers()
        after = _engine_gap(actor, url, sizes, seed=7)
    return {"before": before, "after": after, "buckets": (stats or {}).get("weight_sync/buckets"),
            "te": _uses_te(model)}


# ------------------------------------------------------------------------------------------------- the driver
class Check:
    """The run's arguments, sizes, output and engine processes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rehearse = args, args.rehearse
        self.sizes = Sizes(args.rehearse)
        self.cuda = torch.cuda.is_available() and not args.rehearse
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.work = Path(args.work)
        self.out = Path(args.out or args.work)
        self.recorder = single.Recorder(self.out / "multi_gpu_check.jsonl", args.stage_timeout)
        self.floors: dict[str, float] = {}
        self.servers = []

    def ranks(self, fn, world: int, *args, timeout_s: float = 540.0):
        from megarl.parallel.launch import run_ranks

        env = {} if self.cuda else {"CUDA_VISIBLE_DEVICES": ""}
        return run_ranks(fn, world, *args, timeout_s=timeout_s, env=env)

    def engine(self, model_dir: Path, *, gpus: str, tp: int, name: str, memory_saver: bool = False,
               extra: tuple[str, ...] | list[str] = ()) -> str:
        """Start an engine server on ``gpus`` (SGLang on GPUs; megarl's CPU server rehearsing); its URL."""
        from megarl.engines.server_process import ServerProcess
        from megarl.parallel.net import free_port

        port = free_port()
        if self.cuda:
            argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--tp-size", str(tp),
                    "--mem-fraction-static", str(self.args.mem_fraction), "--dtype", "bfloat16", "--random-seed", "1",
                    "--host", "127.0.0.1", "--port", str(port), "--skip-server-warmup", "--context-length", "512",
                    "--disable-cuda-graph", *(["--enable-memory-saver"] if memory_saver else []), *extra]
            env = {"CUDA_VISIBLE_DEVICES": gpus}
        else:
            argv = [sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", str(model_dir), "--port",
                    str(port), "--dtype", "bfloat16", "--tp-size", str(tp), "--random-seed", "1",
                    "--context-length", "512", *extra]
            env = {"OMP_NUM_THREADS": "1"}
        url = f"http://127.0.0.1:{port}"
        server = ServerProcess(argv, name=name, url=url, log_path=self.out / f"{name.replace(' ', '_')}.log", env=env)
        self.servers.append(server.start())
        server.wait_healthy(ENGINE_START_S)
        return url

    def stop_engines(self) -> None:
        while self.servers:
            self.servers.pop().stop()

    def floor(self, model_dir: Path, batch) -> float:
        """Mean |HF bf16 - HF fp32| of ``batch``'s next-token log-probs: bf16's own error on this model."""
        key = str(model_dir)
        if key not in self.floors:
            refs = self.hf_logprobs(model_dir, batch, (torch.float32, torch.bfloat16))
            pairs = single.next_token_pairs(batch["attention_mask"])
            self.floors[key] = float((refs[torch.bfloat16] - refs[torch.float32])[pairs].abs().mean())
        return self.floors[key]

    def hf_logprobs(self, model_dir: Path, batch, dtypes) -> dict:
        from transformers import AutoModelForCausalLM

        refs = {}
        for dtype in dtypes:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
            refs[dtype] = single.hf_logprobs(hf, batch["input_ids"], batch["attention_mask"])
            del hf
            single.release_memory()
        return refs

    def qwen(self) -> Path:
        return single.save_model(self.work / f"qwen2_{self.sizes.shape}", self.sizes.shape, self.device, seed=0)

    def batch(self, vocab: int, seed: int):
        s = self.sizes
        return single.rl_batch(s.rows, s.prompt, s.response, vocab, seed=seed)


def _tiny(directory: Path, arch: str, **sizes) -> Path:
    from megarl.models.tiny import save_tiny

    if not (directory / "config.json").exists():
        save_tiny(directory, arch=arch, seed=0, **sizes)
    return directory


def stage_te_parity(check: Check, out: dict) -> None:
    model_dir = check.qwen()
    from transformers import AutoConfig

    batch = check.batch(AutoConfig.from_pretrained(model_dir).vocab_size, seed=11)
    te = check.ranks(parity_job, 2, str(model_dir), {"tp": 2, "sequence_parallel": True}, None, batch, check.sizes)[0]
    local = check.ranks(parity_job, 1, str(model_dir), {"tp": 1}, False, batch, check.sizes)[0]
    fp32 = check.hf_logprobs(model_dir, batch, (torch.float32,))[torch.float32]
    pairs = single.next_token_pairs(batch["attention_mask"])
    floor = check.floor(model_dir, batch)
    te_err = float((te["logp"] - fp32)[pairs].abs().mean())
    local_err = float((local["logp"] - fp32)[pairs].abs().mean())
    grad = abs(te["grad_norm"] - local["grad_norm"]) / max(local["grad_norm"], 1e-12)
    out.update(te_spec=te["te"], local_spec_te=local["te"], tp2_vs_hf_fp32=te_err, tp1_local_vs_hf_fp32=local_err,
               hf_bf16_vs_hf_fp32=floor, grad_norm_tp2=te["grad_norm"], grad_norm_tp1=local["grad_norm"],
               grad_norm_rel_diff=grad, tokens=int(pairs.sum()))
    out["ok"] = (te_err <= 3 * floor and local_err <= 3 * floor and grad <= 0.05 and not local["te"]
                 and (te["te"] or check.rehearse))


def _routed_rollout(url: str, hf_config, sizes: Sizes, seed: int) -> dict:
    """Rows sampled from the engine at ``url`` (T=1) with the experts it routed every token to, laid out as a batch."""
    from megarl.engines.client import EngineClient, run_sync
    from megarl.engines.engine import SamplingParams
    from megarl.rollout.manager import routed_experts_tensor

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 400, (6 + 2 * row,), generator=g).tolist() for row in range(sizes.engine_rows)]
    shape = (int(hf_config.num_hidden_layers), int(hf_config.num_experts_per_tok))
    params = SamplingParams(max_new_tokens=sizes.engine_response, temperature=1.0, ignore_eos=True)
    from megarl.engines import event_loop

    with event_loop.holding():
        client = EngineClient(url, name="moe engine")
        outputs = run_sync(client.generate_batch(prompts, params, seed=seed, return_logprob=True,
                                                 routing_shape=shape))
    P, R = max(map(len, prompts)), sizes.engine_response
    ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask, engine_logp = torch.zeros_like(ids), torch.zeros(len(prompts), P + R)
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        n = len(output.output_ids)
        ids[row, P - len(prompt):P + n] = torch.tensor(prompt + list(output.output_ids))
        mask[row, P - len(prompt):P + n] = 1
        engine_logp[row, P - 1:P - 1 + n] = torch.tensor(output.output_logprobs)  # position t: log p(token t+1)
    routed = routed_experts_tensor(prompts, outputs, prompt_width=P, response_width=R, shape=shape)
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[:, P - 1:P - 1 + R] = mask[:, P:].bool()
    return {"input_ids": ids, "attention_mask": mask, "routed": routed, "engine_logp": engine_logp, "scored": scored}


def stage_te_moe(check: Check, out: dict) -> None:
    model_dir = _tiny(check.work / "qwen3_moe", "qwen3_moe", num_experts=4)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    batch = check.batch(hf_config.vocab_size, seed=12)
    url = check.engine(model_dir, gpus="1", tp=1, name="moe engine", extra=["--enable-return-routed-experts"])
    try:
        routing = _routed_rollout(url, hf_config, check.sizes, seed=15)
    finally:
        check.stop_engines()
    ranks = check.ranks(moe_job, 2, str(model_dir), batch, routing)
    fp32 = check.hf_logprobs(model_dir, batch, (torch.float32,))[torch.float32]
    pairs = single.next_token_pairs(batch["attention_mask"])
    rank0 = ranks[0]
    err = float((rank0["logp"] - fp32)[pairs].abs().mean())
    scored = routing["scored"]
    gaps = {key: float((rank0[f"{key}_logp"] - routing["engine_logp"])[scored].abs().mean())
            for key in ("own", "replayed")}
    mismatch, natural, decisions = rank0["replayed_counts"]
    out.update(grouped_gemm=rank0["grouped_gemm"], te=rank0["te"], tensors=rank0["tensors"],
               differ=rank0["differ"][:10], extra=rank0["extra"][:10], logp_vs_hf_fp32=err,
               routing_decisions=decisions, replayed_mismatch=mismatch,
               natural_mismatch_frac=natural / max(decisions, 1),
               engine_gap_own_routing=gaps["own"], engine_gap_replayed=gaps["replayed"])
    # The engine's routing read in megarl's layout: replayed exactly, and mostly what the trainer's routers choose
    # themselves (a misread layout would disagree on ~1 - top_k / experts of the pairs).
    out["ok"] = (not rank0["differ"] and not rank0["extra"] and err <= 1e-3 and decisions > 0 and mismatch == 0
                 and natural / decisions <= 0.25 and math.isfinite(gaps["replayed"])
                 and (rank0["grouped_gemm"] or check.rehearse))


def stage_offload(check: Check, out: dict) -> None:
    from megarl.config.megatron import check_optimizer_overrides

    model_dir = check.qwen()
    from transformers import AutoConfig

    batch = check.batch(AutoConfig.from_pretrained(model_dir).vocab_size, seed=13)
    plain = check.ranks(offload_job, 2, str(model_dir), batch, check.sizes, False)
    out["plain"] = plain[0]
    same = all(r["plain"] == r["offloaded"] for r in plain)
    hybrid = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
    try:
        check_optimizer_overrides("actor", hybrid, device="cuda", optimizer_offload=True)
        refused = False
    except ValueError:
        refused = True
    out["hybrid_with_optimizer_offload_refused"] = refused
    if check.cuda:
        runs = check.ranks(offload_job, 2, str(model_dir), batch, check.sizes, True)
        out["hybrid"] = runs[0]
        same = same and all(r["plain"] == r["offloaded"] for r in runs)
    else:
        out["hybrid"] = "skipped: the hybrid CPU optimizer needs CUDA (megarl refuses it on cpu)"
    out["ok"] = same and refused


def _engine_stage(check: Check, job, model_dir: Path, *, world: int, gpus: str, tp: int, name: str, seed: int,
                  memory_saver: bool = False, extra=()) -> tuple[dict, float]:
    """Start an engine on ``model_dir``, run ``job`` on ``world`` ranks against it, stop it: rank 0's result and the
    bound of an engine-actor gap (4x HF bf16's error on this model)."""
    url = check.engine(model_dir, gpus=gpus, tp=tp, name=name, memory_saver=memory_saver, extra=extra)
    try:
        rank0 = check.ranks(job, world, str(model_dir), url, check.sizes)[0]
    finally:
        check.stop_engines()
    from transformers import AutoConfig

    return rank0, 4 * check.floor(model_dir, check.batch(AutoConfig.from_pretrained(model_dir).vocab_size, seed=seed))


def _closed(gap_after: dict, gap_before: dict, bound: float) -> bool:
    """The sync closed the gap: tokens compared, within ``bound`` after, and not before."""
    return gap_after["tokens"] > 0 and gap_after["mean"] <= bound < gap_before["mean"]


def stage_colocated(check: Check, out: dict) -> None:
    rank0, bound = _engine_stage(check, colocated_job, check.qwen(), world=2, gpus="0,1", tp=2,
                                 name="colocated engine", seed=11, memory_saver=True)
    out.update(rank0, bound=bound)
    out["ok"] = _closed(rank0["after"], rank0["before"], bound)


def stage_lora(check: Check, out: dict) -> None:
    from megarl.config.lora import LoraSpec
    from megarl.plan.engine_gpus import lora_flags

    rank0, bound = _engine_stage(check, lora_job, check.qwen(), world=2, gpus="0,1", tp=2, name="lora engine",
                                 seed=11, memory_saver=True, extra=lora_flags(LoraSpec(rank=8, alpha=16.0)))
    out.update(rank0, bound=bound)
    out["ok"] = (_closed(rank0["after"], rank0["base_vs_adapted"], bound) and rank0["verified"] > 0
                 and rank0["still_released"] == [])


def stage_distributed(check: Check, out: dict) -> None:
    from megarl.config.rollout import resolve_transport
    from megarl.convert.fp8 import write_fp8_checkpoint

    model_dir = _tiny(check.work / "llama", "llama", num_layers=2, hidden_size=256, intermediate_size=512)
    fp8_dir = check.work / "llama_fp8"
    if not (fp8_dir / "config.json").exists():
        write_fp8_checkpoint(model_dir, fp8_dir)
    try:
        urls = {"bf16": check.engine(model_dir, gpus="1", tp=1, name="engine bf16"),
                "fp8": check.engine(fp8_dir, gpus="1", tp=1, name="engine fp8")}
        rank0 = check.ranks(distributed_job, 1, str(model_dir), urls, check.sizes)[0]
    finally:
        check.stop_engines()
    try:
        resolve_transport("distributed", colocated=True, device="cuda")
        refused = False
    except ValueError:
        refused = True
    out.update(rank0, colocated_distributed_refused=refused)
    out["ok"] = refused and all("error" not in r and r["verified_engines"] == 1 and r["verified_tensors"] > 0
                                for r in rank0.values())


def stage_deepseek(check: Check, out: dict) -> None:
    model_dir = _tiny(check.work / "deepseek_v3", "deepseek_v3", num_experts=4, num_layers=2)
    rank0, bound = _engine_stage(check, deepseek_job, model_dir, world=1, gpus="1", tp=1, name="deepseek engine",
                                 seed=14)
    out.update(rank0, bound=bound)
    out["ok"] = _closed(rank0["after"], rank0["before"], bound) and (rank0["te"] or check.rehearse)


RUNNERS = {"te_parity": stage_te_parity, "te_moe": stage_te_moe, "offload": stage_offload,
           "colocated": stage_colocated, "lora": stage_lora, "distributed": stage_distributed,
           "deepseek": stage_deepseek}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)}")
    parser.add_argument("--rehearse", action="store_true",
                        help="on the CPU: gloo ranks, the local spec, megarl's CPU engine, tiny shapes")
    parser.add_argument("--mem-fraction", type=float, default=0.35,
                        help="SGLang's --mem-fraction-static (the colocated engine shares its GPUs with the actor)")
    parser.add_argument("--stage-timeout", type=float, default=None, help="seconds a stage may run (default: none)")
    parser.add_argument("--work", default="/tmp/megarl_multi_gpu_check", help="where the models are written (kept)")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="directory of multi_gpu_check.jsonl and the engine logs (default: $OUT, else --work)")
    args = parser.parse_args(argv)
    picked = {s for s in args.stages.split(",") if s}
    if picked - set(STAGES):
        parser.error(f"--stages: unknown {sorted(picked - set(STAGES))}; pick from {','.join(STAGES)}")
    args.stages = [s for s in STAGES if s in picked]
    if not args.rehearse and torch.cuda.device_count() < 2:
        parser.error(f"{torch.cuda.device_count()} CUDA GPUs: this check needs 2 (--rehearse runs it on the CPU)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check = Check(args)
    if hasattr(signal, "SIGTERM"):
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    import megatron.core
    import transformers

    start = time.perf_counter()
    check.recorder.record("env", True, 0.0, rehearse=args.rehearse, gpus=torch.cuda.device_count(),
                          device=torch.cuda.get_device_name(0) if check.cuda else "cpu", torch=torch.__version__,
                          transformers=transformers.__version__, megatron_core=megatron.core.__version__,
                          transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
                          sglang=importlib.util.find_spec("sglang") is not None, stages=args.stages)
    try:
        for name in args.stages:
            with check.recorder.stage(name) as out:
                RUNNERS[name](check, out)
    finally:
        check.stop_engines()
    failed = [n for n in args.stages if not check.recorder.results.get(n)]
    check.recorder.record("summary", not failed, time.perf_counter() - start, passed=len(args.stages) - len(failed),
                          failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
