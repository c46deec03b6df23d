"""The weight-update process group both sides join: the trainer's sender as rank 0, each engine TP rank after it.

SGLang's ``/init_weights_update_group`` joins with ``init_custom_process_group`` (``sglang/srt/utils/common.py``):
``rendezvous(tcp://master_address:master_port, rank, world_size)``, the store wrapped in
``PrefixStore(group_name)``, then torch's ``_new_process_group_helper``, which wraps it twice more
(``"<group_name>/"``, then ``"<device>/"``: ``cpu`` for gloo, ``cuda`` for NCCL) before building the backend.
:func:`join_group` builds the same store chain and the backend directly, so its keys meet SGLang's (a test joins
one member each way), without registering the group in torch's process-global group table: several members can
live in one process (megarl's CPU engine server joins once per emulated TP rank). The sender (rank 0) hosts the
TCP store on a socket of its own bound to the group's address only (:func:`listening_socket`; torch's TCP store
binds every interface whatever address it is given), so a group on one machine listens on loopback. The same code
joins on both sides; only the backend differs (``nccl`` on GPU, ``gloo`` on CPU).
"""

from __future__ import annotations

import datetime
from typing import Any

GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""Rendezvous and collective limit of a weight-update group."""
BACKENDS = ("gloo", "nccl")


def listening_socket(host: str) -> tuple[int, int]:
    """A TCP socket listening on ``host`` only, at a port the system picks: ``(file descriptor, port)``. The
    descriptor is handed to :func:`join_group` (its store then owns and closes it)."""
    import socket

    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    port = listener.getsockname()[1]
    return listener.detach(), port


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, *,
               backend: str = "gloo", timeout: datetime.timedelta = GROUP_TIMEOUT,
               listen_fd: int | None = None) -> Any:
    """Join weight-update group ``group_name`` as ``rank`` of ``world_size`` (blocks until every member joined);
    returns the process group (call ``broadcast(tensor, 0).wait()`` on it). ``listen_fd`` (rank 0): the socket
    from :func:`listening_socket` its store serves on, else the store binds ``master_port`` on every interface."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, rendezvous

    if backend not in BACKENDS:
        raise ValueError(f"weight-update group {group_name!r}: backend must be one of {BACKENDS}, got {backend!r}")
    if listen_fd is not None:
        if rank != 0:
            raise ValueError(f"weight-update group {group_name!r}: only rank 0 hosts the store (listen_fd), "
                             f"not rank {rank}")
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=True, master_listen_fd=listen_fd)
    else:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    device = "cpu" if backend == "gloo" else "cuda"
    prefixed = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
