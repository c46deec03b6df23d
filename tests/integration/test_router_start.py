"""sglang-router answers ``/health`` before it has registered its workers (0.3 adds each after reading its server
and model info): ``start_router`` returns only once ``/workers`` lists every engine, healthy, so a first request
is never refused with "No available workers"."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request

from megarl.engines.router import start_router, workers_registered
from megarl.engines.server_process import free_port


class _SlowWorker(http.server.BaseHTTPRequestHandler):
    """Answers every GET (the router's metadata reads) a second late: the router's ``/health`` answers long before
    it has registered such a worker."""

    never = threading.Event()

    def do_GET(self):
        self.never.wait(timeout=1.0)
        body = json.dumps({"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_start_router_returns_once_every_worker_is_registered(tmp_path):
    servers, urls = [], []
    for _ in range(2):
        port = free_port("127.0.0.1")
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _SlowWorker)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{port}")
    router = start_router(urls, policy="round_robin", log_dir=tmp_path)
    try:
        with urllib.request.urlopen(router.url + "/workers", timeout=5) as reply:
            listed = json.loads(reply.read())["workers"]
        assert sorted(w["url"] for w in listed) == sorted(urls)
        assert all(w["is_healthy"] for w in listed)
    finally:
        router.stop()
        for server in servers:
            server.shutdown()


def test_workers_registered_reads_the_routers_worker_list():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2/"]
    both = {"workers": [{"url": "http://127.0.0.1:1", "is_healthy": True},
                        {"url": "http://127.0.0.1:2", "is_healthy": True}], "total": 2}
    assert workers_registered(urls, json.dumps(both).encode())
    one = {"workers": both["workers"][:1], "total": 1}
    assert not workers_registered(urls, json.dumps(one).encode())
    sick = {"workers": [both["workers"][0], {"url": "http://127.0.0.1:2", "is_healthy": False}]}
    assert not workers_registered(urls, json.dumps(sick).encode())
    assert not workers_registered(urls, b"not json")
    assert not workers_registered(urls, b'{"workers": []}')


class _Worker(_SlowWorker):
    """A worker that also answers ``/generate`` (what the router forwards)."""

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        body = json.dumps({"text": "ok", "meta_info": {"finish_reason": {"type": "length"}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _request(url: str, method: str = "GET", body: dict | None = None, key: str | None = None) -> tuple[int, bytes]:
    import urllib.error

    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_the_routers_control_plane_answers_only_the_runs_key(tmp_path):
    """Any local process could ``POST /workers`` to a run's router (202) and receive the run's prompts. With the
    run's key (sglang-router's control-plane API key, handed over in the environment, not on the command line) the
    router refuses an unkeyed or wrongly keyed registration with 401 and lists its workers only to the key, while
    ``/generate`` still serves the run's engines."""
    port = free_port("127.0.0.1")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Worker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, key = f"http://127.0.0.1:{port}", "the-runs-key"
    router = start_router([url], policy="round_robin", log_dir=tmp_path, control_key=key)
    try:
        assert key not in " ".join(router.argv)
        intruder = {"url": "http://127.0.0.1:9"}
        assert _request(router.url + "/workers", "POST", intruder)[0] == 401
        assert _request(router.url + "/workers", "POST", intruder, key="guess")[0] == 401
        assert _request(router.url + "/workers")[0] == 401
        status, body = _request(router.url + "/workers", key=key)
        assert status == 200 and [w["url"] for w in json.loads(body)["workers"]] == [url]
        status, body = _request(router.url + "/generate", "POST", {"text": "hi", "sampling_params": {}})
        assert status == 200 and json.loads(body)["text"] == "ok"
    finally:
        router.stop()
        server.shutdown()
