"""The weight-update group's wire layout against the pinned SGLang: megarl's ``join_group`` (two members in this
process, as the CPU engine server's emulated TP ranks join) and SGLang's own ``init_custom_process_group`` (in a
process of its own, as an SGLang TP rank joins) meet in one group and receive rank 0's broadcast; rank 0's store
listens on the group's address only."""

from __future__ import annotations

import datetime
import multiprocessing
import threading
import types

import pytest
import torch

from megarl.engines.event_loop import run_sync
from megarl.engines.weight_group import join_group, listening_socket


def _sglang_member(port: int, rank: int, world_size: int, queue) -> None:
    from sglang.srt.utils.common import init_custom_process_group

    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size,
                                      rank=rank, group_name="megarl_weights", timeout=datetime.timedelta(seconds=60))
    received = torch.zeros(6)
    torch.distributed.broadcast(received, src=0, group=group)
    queue.put(received.tolist())


def test_join_group_meets_sglangs_init_custom_process_group():
    pytest.importorskip("sglang.srt.utils.common")
    import psutil

    listen_fd, port = listening_socket("127.0.0.1")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    sglang_rank = context.Process(target=_sglang_member, args=(port, 2, 3, queue), daemon=True)
    sglang_rank.start()
    got: dict[int, list[float]] = {}

    def ours(rank: int) -> None:
        group = join_group("127.0.0.1", port, rank, 3, "megarl_weights", timeout=datetime.timedelta(seconds=60),
                           listen_fd=listen_fd if rank == 0 else None)
        if rank == 0:  # the store serves on loopback only (torch's own binds every interface)
            got["listening"] = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp")
                                       if c.status == psutil.CONN_LISTEN and c.laddr.port == port})
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
    assert got == {0: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 1: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "listening": ["127.0.0.1"]}


def test_join_group_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('gloo', 'nccl'\), got 'mpi'"):
        join_group("127.0.0.1", 1, 0, 1, "g", backend="mpi")
    with pytest.raises(ValueError, match=r"only rank 0 hosts the store \(listen_fd\), not rank 1"):
        join_group("127.0.0.1", 1, 1, 2, "g", listen_fd=99)


class _TpSlicingEngine:
    """An engine client answering ``/get_weights_by_name`` as SGLang's Llama at TP=2 does (megarl's strict engine's
    :func:`~megarl.engines.cpu_engine.read_back.answer`, for a Llama of hidden size 4 and 2 heads): its TP rank 0's
    slice (the first half of the rows) of column-parallel tensors, the whole of the others."""

    name, url = "engine 0", "http://engine-0"
    config = types.SimpleNamespace(num_attention_heads=2, num_key_value_heads=2, hidden_size=4, intermediate_size=8,
                                   tie_word_embeddings=False)

    def __init__(self, held: dict[str, torch.Tensor], tp: int = 2) -> None:
        self.held, self.tp = held, tp

    async def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        from megarl.engines.cpu_engine.read_back import answer

        return answer(name, self.held, self.config, tp=self.tp, truncate=truncate_size)


def test_verification_counts_a_tp_slice_as_unverified_and_compares_whole_answers():
    from megarl.engines.client import EngineAddress, gather_sync
    from megarl.sync.base import merge_stats, verify_and_report, verify_engine

    generator = torch.Generator().manual_seed(0)
    sent = {"model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=generator),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 4, generator=generator),
            "model.norm.weight": torch.randn(4, generator=generator)}
    others = {f"model.layers.0.self_attn.{p}.weight": torch.randn(4, 4, generator=generator)
              for p in ("k_proj", "v_proj")}
    engine = _TpSlicingEngine({**sent, **others})  # q_proj stacks with k/v_proj
    assert len(run_sync(engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", 100))) == 2
    assert gather_sync([verify_engine(engine, sent)])[0] == ["model.layers.0.self_attn.q_proj.weight"]
    # A whole answer that differs still fails the sync; a sliced one is never compared in part.
    engine.held["model.layers.0.self_attn.o_proj.weight"] = sent["model.layers.0.self_attn.o_proj.weight"] + 1
    with pytest.raises(RuntimeError, match=r"engine 0 at http://engine-0 .*1 tensors differ.*o_proj"):
        gather_sync([verify_engine(engine, sent)])
    engine.held["model.layers.0.self_attn.o_proj.weight"] = sent["model.layers.0.self_attn.o_proj.weight"]

    class Transport:
        def client(self, target):
            return engine

    target = EngineAddress(index=0, url=engine.url, tp=2)
    stats = verify_and_report(Transport(), [target], start=0.0, bytes_sent=1, buckets=1, expected=sent, lead=True)
    merged = merge_stats([stats])
    assert (merged["weight_sync/verified_tensors"], merged["weight_sync/unverified_tensors"]) == (2, 1)
    assert merged["weight_sync/verified_engines"] == 1
    # Nothing answered whole: the engine is not counted verified.
    only_sliced = {"model.layers.0.self_attn.q_proj.weight": sent["model.layers.0.self_attn.q_proj.weight"]}
    stats = verify_and_report(Transport(), [target], start=0.0, bytes_sent=1, buckets=1, expected=only_sliced,
                              lead=True)
    assert merge_stats([stats])["weight_sync/verified_engines"] == 0


def test_verification_of_a_large_tensor_reads_its_leading_rows_only(monkeypatch):
    """A tensor over ``VERIFY_MAX_VALUES`` is kept, asked for and compared by its leading rows (JSON answers of a
    whole ``lm_head`` would take minutes); a difference there still fails the sync; small tensors stay whole."""
    from megarl.engines.client import gather_sync
    from megarl.sync import base

    monkeypatch.setattr(base, "VERIFY_MAX_VALUES", 12)
    generator = torch.Generator().manual_seed(1)
    sent = {"lm_head.weight": torch.randn(10, 4, generator=generator),
            "model.norm.weight": torch.randn(12, generator=generator),
            "wide.weight": torch.randn(2, 20, generator=generator)}
    kept = {name: base.expected_copy(tensor) for name, tensor in sent.items()}
    assert {name: tuple(t.shape) for name, t in kept.items()} == {
        "lm_head.weight": (3, 4), "model.norm.weight": (12,), "wide.weight": (1, 20)}
    assert torch.equal(kept["lm_head.weight"], sent["lm_head.weight"][:3])

    asked = []

    class Engine(_TpSlicingEngine):
        async def get_weights_by_name(self, name, truncate_size):
            asked.append((name, truncate_size))
            return await super().get_weights_by_name(name, truncate_size)

    engine = Engine({name: t.clone() for name, t in sent.items()}, tp=1)
    assert gather_sync([base.verify_engine(engine, kept)])[0] == []
    assert asked == [("lm_head.weight", 3), ("model.norm.weight", 12), ("wide.weight", 1)]
    engine.held["lm_head.weight"][2, 1] += 1
    with pytest.raises(RuntimeError, match=r"1 tensors differ.*lm_head"):
        gather_sync([base.verify_engine(engine, kept)])
