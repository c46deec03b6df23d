"""The weight-update group's wire layout against the pinned SGLang: megarl's ``join_group`` (two members in this
process, as the CPU engine server's emulated TP ranks join) and SGLang's own ``init_custom_process_group`` (in a
process of its own, as an SGLang TP rank joins) meet in one group and receive rank 0's broadcast."""

from __future__ import annotations

import datetime
import multiprocessing
import threading

import pytest
import torch

from megarl.rollout.server_process import free_port
from megarl.rollout.weight_group import join_group


def _sglang_member(port: int, rank: int, world_size: int, queue) -> None:
    from sglang.srt.utils.common import init_custom_process_group

    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size,
                                      rank=rank, group_name="megarl_weights", timeout=datetime.timedelta(seconds=60))
    received = torch.zeros(6)
    torch.distributed.broadcast(received, src=0, group=group)
    queue.put(received.tolist())


def test_join_group_meets_sglangs_init_custom_process_group():
    pytest.importorskip("sglang.srt.utils.common")
    port = free_port()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    sglang_rank = context.Process(target=_sglang_member, args=(port, 2, 3, queue), daemon=True)
    sglang_rank.start()
    got: dict[int, list[float]] = {}

    def ours(rank: int) -> None:
        group = join_group("127.0.0.1", port, rank, 3, "megarl_weights", timeout=datetime.timedelta(seconds=60))
        tensor = torch.arange(6.0) if rank == 0 else torch.zeros(6)
        group.broadcast(tensor, 0).wait()
        got[rank] = tensor.tolist()

    threads = [threading.Thread(target=ours, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    try:
        assert queue.get(timeout=90) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        sglang_rank.join(30)
        if sglang_rank.is_alive():
            sglang_rank.kill()
    assert got == {0: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 1: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}


def test_join_group_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('gloo', 'nccl'\), got 'mpi'"):
        join_group("127.0.0.1", 1, 0, 1, "g", backend="mpi")
