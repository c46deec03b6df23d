"""``python -m megarl.engines.cpu_engine``: start megarl's CPU engine server (:mod:`megarl.engines.cpu_engine`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
from aiohttp import web

from megarl.engines.cpu_engine.hf_engine import HFEngine
from megarl.engines.cpu_engine.server import EngineServer, logger
from megarl.engines.http_api import ADMIN_KEY_ENV


class _HTTP2ProbeFilter(logging.Filter):
    """aiohttp logs an ERROR with a traceback for every HTTP/2 connection preface (``PRI * HTTP/2.0``) it
    refuses; sglang-router opens each worker connection that way first and falls back to HTTP/1.1 on the 400.
    Such records become one INFO line each: they are the router's probe, not a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage) and "PRI/Upgrade" in str(error):
            record.msg, record.args, record.exc_info, record.exc_text = (
                "refused an HTTP/2 connection preface (sglang-router's probe; it goes on with HTTP/1.1)", (), None,
                None)
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.engines.cpu_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1, help="TP ranks the weight paths behave as (module doc)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--context-length", type=int, default=None,
                        help="the longest prompt + response a request may reach, as SGLang's flag (default: the "
                             "model's max_position_embeddings; a longer one is refused, as SGLang refuses it)")
    parser.add_argument("--fp8-scale-ue8m0", action="store_true",
                        help="an FP8 engine requantizes what it loads to power-of-two scales, as SGLang on Blackwell "
                             "does (megarl only: SGLang decides by the GPU)")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="keep the weights across /release_memory_occupation, as SGLang's flag (without it "
                             "released weights are garbage until rewritten)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="answer return_routed_experts (mixture-of-experts models), as SGLang's flag")
    parser.add_argument("--enable-step-gate", action="store_true",
                        help="serve /step_gate, which holds generation at a given token (for tests; module doc)")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters, as SGLang's flag")
    parser.add_argument("--max-lora-rank", type=int, default=0, help="the highest adapter rank served")
    parser.add_argument("--max-loras-per-batch", type=int, default=8,
                        help="adapters one batch may mix (SGLang's slots; this engine runs one adapter per batch)")
    parser.add_argument("--lora-target-modules", nargs="*", default=[],
                        help="PEFT module names adapters may touch, or all (default)")
    args = parser.parse_args(argv)
    if args.max_loras_per_batch < 1:
        parser.error(f"--max-loras-per-batch must be >= 1, got {args.max_loras_per_batch}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_HTTP2ProbeFilter())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    engine = HFEngine(args.model_path, dtype=getattr(torch, args.dtype), device=args.device, seed=args.random_seed,
                      trust_remote_code=args.trust_remote_code, weights_cpu_backup=args.enable_weights_cpu_backup,
                      context_length=args.context_length, fp8_scale_ue8m0=args.fp8_scale_ue8m0)
    server = EngineServer(engine, model_path=args.model_path, seed=args.random_seed, tp_size=args.tp_size,
                          enable_return_routed_experts=args.enable_return_routed_experts,
                          enable_step_gate=args.enable_step_gate,
                          admin_key=os.environ.pop(ADMIN_KEY_ENV, None),
                          enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
                          lora_target_modules=tuple(args.lora_target_modules))
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


def _exit_now(code: int) -> None:
    """End the process without the interpreter's finalization: its last garbage collection over torch's and
    transformers' objects takes seconds (~2 s of a tiny model's server), while the server has nothing left to release
    once its app stopped (the weights it mapped are its senders' to unlink; the log is flushed here)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
