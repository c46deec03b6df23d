"""This machine's address and free TCP ports: rendezvous of ranks, engine servers, routers, weight-update groups.

Light on purpose (no torch): spawned ranks, the engine server and the router's launcher import it first.
"""

from __future__ import annotations

import socket

RAY_LOOPBACK_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch (read when Ray is imported) that, off, makes it take 127.0.0.1 as the node's address, as it does on
macOS and Windows; its servers (GCS, raylet, workers, agents) then listen there only, otherwise on every interface.
A one-machine cluster needs no other address (``megarl.controller.build.ray_on_loopback``)."""

RENDEZVOUS_FILE_VARIABLE = "MEGARL_RENDEZVOUS_FILE"
"""Set by a worker group whose ranks share one machine: the file its ranks meet through
(:func:`megarl.parallel.groups.init_distributed`), so no TCP store listens for it."""


def node_ip() -> str:
    """This node's IP as Ray reports it when Ray is up (what other nodes reach), else the hostname's address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def free_ports(host: str = "127.0.0.1", count: int = 1) -> list[int]:
    """``count`` distinct TCP ports on ``host`` that nothing listens on now (held together while chosen, then
    released: the caller binds them soon after)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    return free_ports(host, 1)[0]
