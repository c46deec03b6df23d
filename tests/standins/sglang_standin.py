"""Stands in for ``python -m sglang.launch_server`` where SGLang cannot run (no GPU): records how it was started
and answers ``/health``, as SGLang does on every node of an engine (node_rank 0's API server, the others'
health-check server).

Run as ``python -m sglang_standin <sglang.launch_server flags>`` (tests/standins on ``PYTHONPATH``). It writes
``$MEGARL_STANDIN_DIR/<port>.json`` with its argv, pid, parent pid and the environment variables a launch sets
or removes, then serves ``GET /health`` (200) on ``--host``/``--port`` until SIGTERM. It parses nothing else:
the tests parse the recorded argv with the pinned sglang's own ``ServerArgs`` parser.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
from pathlib import Path

RECORDED_ENV = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "OMP_NUM_THREADS")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    argv = sys.argv[1:]
    host, port = _flag(argv, "--host"), int(_flag(argv, "--port"))
    record = {"argv": argv, "pid": os.getpid(), "ppid": os.getppid(),
              "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}}
    out = Path(os.environ["MEGARL_STANDIN_DIR"]) / f"{port}.json"
    out.write_text(json.dumps(record))
    server = http.server.HTTPServer((host, port), _Health)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


if __name__ == "__main__":
    main()
