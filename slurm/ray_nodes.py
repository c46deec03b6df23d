"""The parts of the Ray bring-up on Slurm that are easier in Python (called by ``slurm/ray_on_slurm.sh``).

    python slurm/ray_nodes.py free-port START COUNT
        print the first port P >= START such that P .. P+COUNT-1 can all be bound on this machine's
        every address (searching 20000-29999, wrapping once); exit 1 if none.
    python slurm/ray_nodes.py wait-head ADDRESS DEADLINE HEAD [HEAD=PID]
        wait until the Ray head's GCS accepts TCP connections at ADDRESS (ip:port).
    python slurm/ray_nodes.py wait-nodes ADDRESS DEADLINE NODES [NODE=PID ...]
        wait until every node named in NODES (comma-separated Slurm names, given to ``ray start``
        as ``--node-name``) is alive in the Ray cluster at ADDRESS.

DEADLINE is a Unix time. NODE=PID pairs are the ``srun`` processes running ``ray start --block``
on those nodes: one that exits ends the wait at once, naming its node. On success the last
line says that all nodes joined; on failure the error names the nodes that are missing.
"""

from __future__ import annotations

import os
import socket
import sys
import time

PORT_RANGE = (20000, 30000)  # above Ray's default worker ports (10002-19999), below Linux's ephemeral ports (32768+)


def log(message: str) -> None:
    """One bring-up line on stderr, in the same form as ray_on_slurm.sh's."""
    print(f"[ray_on_slurm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port(start: int, count: int) -> int | None:
    """First P >= start (in PORT_RANGE, wrapping once) such that P..P+count-1 can all be bound (0.0.0.0)."""
    low, high = PORT_RANGE
    span = high - low - count
    for offset in range(0, span, count):
        port = low + (start - low + offset) % span
        try:
            sockets = []
            for p in range(port, port + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("", p))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    return None


def dead_steps(watch: dict[str, int]) -> list[str]:
    """Nodes whose ``srun ... ray start --block`` process has exited."""
    dead = []
    for node, pid in watch.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(node)
    return dead


def wait_head(address: str, deadline: float, head: str, watch: dict[str, int]) -> int:
    """Wait until the head's GCS port accepts connections; 0, or 1 with an error naming the head."""
    host, port = address.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return 0
        except OSError:
            pass
        if dead_steps(watch):
            log(f"error: Ray exited on the head node {head} before it came up (its output is above); missing: {head}")
            return 1
        if time.time() > deadline:
            log(f"error: the Ray head on {head} did not come up at {address} within MEGARL_RAY_TIMEOUT; missing: {head}")
            return 1
        time.sleep(0.5)


def alive_node_names(address: str) -> set[str]:
    """Names (``ray start --node-name``) of the nodes alive in the cluster at address."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    return {node["NodeName"] for node in ray.nodes() if node["Alive"]}


def wait_nodes(address: str, deadline: float, expected: list[str], watch: dict[str, int]) -> int:
    """Wait until every expected node is alive; 0, or 1 with an error naming the missing nodes."""
    started = time.time()
    while True:
        joined = alive_node_names(address)
        missing = [node for node in expected if node not in joined]
        if not missing:
            log(f"all {len(expected)} nodes joined the Ray cluster at {address} "
                f"({time.time() - started:.1f} s): {' '.join(expected)}")
            return 0
        if dead := [node for node in dead_steps(watch) if node in missing]:
            log(f"error: Ray exited on node(s) {', '.join(dead)} before joining (its output is above); "
                f"{len(expected) - len(missing)} of {len(expected)} nodes joined; missing: {', '.join(missing)}")
            return 1
        if time.time() > deadline:
            log(f"error: {len(expected) - len(missing)} of {len(expected)} nodes joined the Ray cluster at {address} "
                f"within MEGARL_RAY_TIMEOUT; missing: {', '.join(missing)}")
            return 1
        time.sleep(1.0)


def parse_watch(pairs: list[str]) -> dict[str, int]:
    """``NODE=PID`` arguments as a dict."""
    return {node: int(pid) for node, pid in (pair.split("=", 1) for pair in pairs)}


def main(argv: list[str]) -> int:
    """Dispatch the sub-command; see the module docstring."""
    command, args = argv[0], argv[1:]
    if command == "free-port":
        port = free_port(int(args[0]), int(args[1]))
        if port is None:
            log(f"error: no {args[1]} consecutive free ports in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1} on {socket.gethostname()}")
            return 1
        print(port)
        return 0
    if command == "wait-head":
        return wait_head(args[0], float(args[1]), args[2], parse_watch(args[3:]))
    if command == "wait-nodes":
        return wait_nodes(args[0], float(args[1]), args[2].split(","), parse_watch(args[3:]))
    raise SystemExit(f"unknown command {command!r}; see {__file__}'s docstring")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
