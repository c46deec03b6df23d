"""Bring up and tear down torch.distributed and Megatron's model-parallel groups.

This is the only module of megarl that calls ``parallel_state.initialize_model_parallel``.
Everything else receives the :class:`ProcessGroups` it returns.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megarl.config.parallel import Coordinates, ParallelDims
from megarl.parallel import cpu_support, megatron_patches
from megarl.parallel.net import RENDEZVOUS_FILE_VARIABLE
from megarl.seeds import stage_seed


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessGroups(Coordinates):
    """This rank's place in the layout (:class:`Coordinates`), and the process groups along each axis."""

    collection: "object"
    """Megatron's ``ProcessGroupCollection`` for the same groups (pass it to Megatron APIs)."""
    ep_tp_ranks: tuple[int, ...] = (0,)
    """The TP rank of each member of this rank's expert-parallel group, in group order (gathered once at set-up, so
    code that runs on one rank, e.g. listing the export's tensors, needs no collective)."""

    @property
    def tp(self) -> dist.ProcessGroup:
        """Tensor-parallel group."""
        return self.collection.tp

    @property
    def pp(self) -> dist.ProcessGroup:
        """Pipeline-parallel group."""
        return self.collection.pp

    @property
    def dp(self) -> dist.ProcessGroup:
        """Data-parallel group (without context parallelism)."""
        return self.collection.dp

    @property
    def cp(self) -> dist.ProcessGroup:
        """Context-parallel group."""
        return self.collection.cp

    @property
    def ep(self) -> dist.ProcessGroup:
        """Expert-parallel group (the ranks holding one sparse layer's experts between them)."""
        return self.collection.ep

    @property
    def expt_tp(self) -> dist.ProcessGroup:
        """Expert-tensor-parallel group (the ranks splitting one expert's matrices)."""
        return self.collection.expt_tp

    @property
    def expt_dp(self) -> dist.ProcessGroup:
        """Expert-data-parallel group (the replicas of one expert block)."""
        return self.collection.expt_dp


MIXED_BACKEND = "cpu:gloo,cuda:nccl"
"""The default group's backend on GPU: NCCL for CUDA tensors, gloo for host tensors (Megatron's groups inherit
both). A host tensor handed to a collective by code outside megarl (or a small metric of megarl's) then still
reduces; NCCL alone raises "No backend type associated with device type cpu"."""


def default_backend() -> str:
    """:data:`MIXED_BACKEND` when CUDA is usable, ``gloo`` otherwise."""
    return MIXED_BACKEND if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, *, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from the environment (RANK, WORLD_SIZE, MASTER_*, or
    ``MEGARL_RENDEZVOUS_FILE`` for ranks on one machine: a file store instead of a TCP one).

    A no-op when it is already initialised. ``nccl`` becomes :data:`MIXED_BACKEND`. On GPU it also selects
    ``LOCAL_RANK``'s device.
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if backend == "nccl":
        backend = MIXED_BACKEND
    rendezvous_file = os.environ.get(RENDEZVOUS_FILE_VARIABLE)
    for var in ("RANK", "WORLD_SIZE") if rendezvous_file else ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ValueError(
                f"environment variable {var} is not set: start the process with torchrun, Ray "
                "(megarl's worker groups set it) or megarl.parallel.launch"
            )
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if rendezvous_file:  # ranks on one machine: a file store, nothing listening
        dist.init_process_group(backend=backend, init_method=f"file://{rendezvous_file}", timeout=timeout,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend=backend, timeout=timeout)


def init_parallel(
    dims: ParallelDims, backend: str | None = None, *, seed: int | None = 1234, timeout_s: float = 600.0
) -> ProcessGroups:
    """Initialise torch.distributed (if needed) and Megatron's groups for ``dims``.

    ``dims.dp`` is derived from the world size when unset. When ``seed`` is given, the
    Python/NumPy/torch generators and Megatron's model-parallel RNG tracker are seeded the
    way Megatron's training does (``seed + 100 × pp_rank`` for the default streams).
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    megatron_patches.apply()
    cpu_support.install()
    init_distributed(backend, timeout_s=timeout_s)
    dims = dims.for_world(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        destroy_parallel()
    vpp = dims.vpp if dims.vpp and dims.vpp > 1 else None
    before = set(_live_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    _MEGATRON_GROUPS[:] = [group for group in _live_groups() if group not in before]
    groups = ProcessGroups(
        dims=dims,
        rank=dist.get_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    if dims.ep > 1:
        ep_tp_ranks = [None] * dims.ep
        dist.all_gather_object(ep_tp_ranks, groups.tp_rank, group=groups.ep)
        groups = dataclasses.replace(groups, ep_tp_ranks=tuple(ep_tp_ranks))
    if seed is not None:
        set_seed(seed, groups)
    return groups


def set_seed(seed: int, groups: ProcessGroups) -> None:
    """Seed every generator as Megatron's training does: per pipeline stage, per TP rank."""
    from megatron.core import tensor_parallel

    stage = stage_seed(seed, groups.pp_rank)
    random.seed(stage)
    np.random.seed(stage)
    # On CPU the default generator is also the "data-parallel" stream that Megatron seeds
    # with torch.cuda.manual_seed (a no-op without CUDA): torch.manual_seed covers it.
    torch.manual_seed(stage)
    tensor_parallel.model_parallel_cuda_manual_seed(stage, force_reset_rng=True)


def destroy_parallel(*, process_group: bool = False) -> None:
    """Tear down Megatron's groups so the process can initialise another layout.

    With ``process_group=True`` the default torch.distributed group is destroyed too.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    # Megatron forgets its groups but destroys only its gloo copies: the others (each with its backend's threads and
    # connections: some 1,000 threads per rank after a few layouts on gloo) would live as long as the process.
    live = set(_live_groups())
    for group in _MEGATRON_GROUPS:
        if group in live:
            dist.destroy_process_group(group)
    _MEGATRON_GROUPS.clear()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


_MEGATRON_GROUPS: list[dist.ProcessGroup] = []
"""The process groups the last ``initialize_model_parallel`` of :func:`init_parallel` created in this process."""


def _live_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process that torch.distributed has not destroyed (none before it starts)."""
    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map)
