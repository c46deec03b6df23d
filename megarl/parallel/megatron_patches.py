"""Megatron-Core patched on every machine: what megarl changes in Megatron itself, GPU runs included.

Each point is a no-op where the thing it fixes is absent (TransformerEngine installed, gloo not used), and each is
tested against Megatron's own function (``tests/unit/test_packing.py``, ``tests/unit/test_device_placement.py``,
``tests/distributed/test_model_parallel.py``). :func:`apply` puts them in place, once per process; the CPU-only mode
is :mod:`megarl.parallel.cpu_support`, the layer spec used without TransformerEngine :mod:`megarl.models.local_spec`.
Numbered as the points of the CPU mode (1-8, 11) they sit beside:

9. Megatron's unfused RoPE for packed sequences (what runs unless TE's fused RoPE does) selects its frequencies
   with one index per pack instead of a loop over the sequences with a host sync (``.tolist()``) per layer
   (:func:`_patch_thd_rope`; same numbers, far fewer operations). Installed on every machine.
10. Mixture-of-experts routers: ``moe_utils`` imports TransformerEngine's ``te_general_gemm`` only when TE is
   installed, yet the router's gating function tests ``te_general_gemm is not None`` unconditionally (a NameError
   without TE, CUDA or not); it is set to None, so the gating runs ``torch.mm`` (:func:`_patch_te_general_gemm`).
12. Gloo process groups of one process share one TCP device (:func:`_patch_gloo_device`, every machine). torch
   gives each gloo group a device of its own, and each device runs an event-loop thread that wakes every 10 ms
   (gloo's ``epoll_wait`` timeout) and listens on a port of its own; Megatron makes about 24 groups, so a rank
   had 24 such threads (2,400 wake-ups a second) and 24 listening ports. With a core per process (a CPU run),
   those wake-ups preempt the compute thread: the actor's update ran about 8 % slower beside a busy engine.
   Groups keep their own pairs and contexts; only the device (its loop thread and listener) is shared.
13. Megatron's fused elementwise functions (``megatron.core.jit.jit_fuser``: bias-dropout-add, SwiGLU, the
   routers' and RoPE's helpers) are ``torch.compile``d. RL micro-batches change length every call (and packing
   changes strides), so each new shape recompiles them until dynamo's recompile limit, after which they run eager
   anyway: on an H200 a 0.5B model's first PPO steps took 5-6 s, and dynamo reported the limit hit. They run eager
   here from the start (:func:`_eager_fusions`, every machine): the same math, no compilation. Importing ``megarl``
   first (every megarl process does) disables the fuser as ``megatron.core.jit`` is imported
   (:mod:`megarl._eager_megatron`, a finder that ``import megarl`` installs: it needs neither torch nor
   Megatron), so nothing is decorated with ``torch.compile`` and torch's compiler stack is not
   imported with Megatron (about 4 s of CPU per process); :func:`_eager_fusions` undoes what a process that imported
   Megatron first compiled.
14. Multi-latent attention without TransformerEngine (:func:`_patch_mla_without_te`, every machine): Megatron's TE
   stand-in makes ``multi_latent_attention`` believe TE is there and fail on its mock; megarl's core attention
   takes MLA's ``k_channels`` / ``v_channels``, ``kv_layernorm`` is a :class:`CpuRMSNorm` like the others, and the
   down projections are replicated over TP (:func:`replicated_linear`: the local spec's column-parallel ones lose
   part of the shared rotary key's gradient).
15. Gated DeltaNet (linear attention) without flash-linear-attention (:func:`_patch_gated_delta_net_without_fla`,
   every machine without it): Megatron's ``GatedDeltaNet`` refuses to build unless FLA imports, though it carries
   a pure-torch chunked delta rule (``torch_chunk_gated_delta_rule``, its deterministic path). Without FLA, the
   module's ``chunk_gated_delta_rule`` is that torch function and its ``l2norm`` a torch one (transformers' formula,
   ``x · rsqrt(Σx² + 1e-6)``): the layer builds and computes what transformers' own torch fallback computes. FLA's
   Triton kernels stay in use wherever FLA is installed.

"""

from __future__ import annotations

import functools
import os
import types
import warnings

import torch

from megarl.parallel.cpu_support import cuda_available

# Megatron 0.16 calls the collectives torch 2.13 renamed; the old names still work.
for _message in ("`torch.distributed.reduce_scatter_tensor` is deprecated",
                 "`torch.distributed.all_gather_into_tensor` is deprecated"):
    warnings.filterwarnings("ignore", category=FutureWarning, message=_message)

_APPLIED = False
"""Every point is in place in this process."""


def apply() -> None:
    """Put points 9, 10 and 12-15 in place in this process (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _eager_fusions()
    _patch_thd_rope()
    _patch_te_general_gemm()
    _patch_mla_without_te()
    _patch_gloo_device()
    _patch_gated_delta_net_without_fla()
    _APPLIED = True


def _thd_positions_on(bounds: tuple[int, ...], cp: int, rank: int, offsets: bool, device: torch.device
                      ) -> torch.Tensor:
    """:func:`_thd_positions` on ``device``, copied there once per layout (not once per layer and application)."""
    if device.type == "cpu":
        return _thd_positions(bounds, cp, rank, offsets)
    return _thd_positions_device(bounds, cp, rank, offsets, device)


@functools.lru_cache(maxsize=64)
def _thd_positions_device(bounds: tuple[int, ...], cp: int, rank: int, offsets: bool, device: torch.device
                          ) -> torch.Tensor:
    return _thd_positions(bounds, cp, rank, offsets).to(device)


@functools.lru_cache(maxsize=64)
def _thd_positions(bounds: tuple[int, ...], cp: int, rank: int, offsets: bool) -> torch.Tensor:
    """Megatron's THD RoPE positions of this CP rank's tokens: within each sequence (``bounds``: its global
    ``cu_seqlens``), the zigzag chunks' positions; plus the sequence's start when ``freqs`` covers the whole pack."""
    from megarl.parallel.packing import zigzag_index, zigzag_positions

    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    return zigzag_index(lengths, cp, rank) if offsets else zigzag_positions(lengths, cp, rank)


def _eager_fusions() -> None:
    """13. Megatron's ``jit_fuser`` off: modules imported from now on decorate with a no-op, and the functions it
    already compiled (``megatron.core`` modules imported before) are put back as the plain functions they wrap."""
    import sys

    from megatron.core import jit

    jit.disable_jit_fuser()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron.core"):
            continue
        for attr, value in list(vars(module).items()):
            if _compiled(value):
                setattr(module, attr, value.__dict__["_torchdynamo_orig_callable"])


def _compiled(value) -> bool:
    """Whether ``value`` is a function ``torch.compile`` made (it keeps the one it wraps in its ``__dict__``;
    stand-ins that answer every attribute, such as Megatron's for a missing TE, are not)."""
    return isinstance(value, types.FunctionType) and "_torchdynamo_orig_callable" in vars(value)


def compiled_megatron_functions() -> list[str]:
    """``module.name`` of every ``torch.compile``d function still bound in a loaded ``megatron.core`` module (none
    after :func:`install`)."""
    import sys

    return [f"{name}.{attr}" for name, module in list(sys.modules.items())
            if module is not None and name.startswith("megatron.core")
            for attr, value in list(vars(module).items()) if _compiled(value)]


def _patch_thd_rope() -> None:
    """9. Megatron's unfused RoPE for packed sequences (``rope_utils._apply_rotary_pos_emb_thd``) slices the
    frequency table sequence by sequence, some ten operations per sequence and application: on CPU, where each
    costs its dispatch, a quarter of a forward of 32 short rows. Here the same positions (a cached index per pack
    layout and CP rank) select the table in one operation; the rotation is Megatron's own
    (``_apply_rotary_pos_emb_bshd``), so the result is identical."""
    from megatron.core.models.common.embeddings import rope_utils

    def apply_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                  cp_group=None):
        if cp_group is None:
            raise ValueError("cp_group must be provided for THD format RoPE")
        from megarl.parallel.packing import host_bounds

        bounds = host_bounds(cu_seqlens)  # no device sync per layer: the host copy recorded with the pack
        offsets = freqs.dim() >= 1 and freqs.size(0) == bounds[-1]
        index = _thd_positions_on(bounds, cp_group.size(), cp_group.rank(), offsets, freqs.device)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs.index_select(0, index), rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    current = rope_utils._apply_rotary_pos_emb_thd
    apply_thd.megatron = getattr(current, "megatron", current)  # Megatron's own (tests compare the two)
    rope_utils._apply_rotary_pos_emb_thd = apply_thd


def _patch_mla_without_te() -> None:
    """14. Multi-latent attention on the local spec. Without TransformerEngine, Megatron's
    ``extensions.transformer_engine`` puts a mock in its place, so ``multi_latent_attention`` imports it and sets
    ``HAVE_TE`` true; building MLA with the local spec then tests ``isinstance(linear_proj, TELinear)`` against the
    mock and fails (on CPU and on a GPU without TE alike): set false there when TE is not importable. And the
    down projections become :func:`replicated_linear` (see there), which MLA accepts as its ``Linear``."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.Linear = replicated_linear()
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _patch_gated_delta_net_without_fla() -> None:
    """15. (A no-op where flash-linear-attention imports: Megatron took its kernels.)"""
    from megatron.core.ssm import gated_delta_net

    if gated_delta_net.HAVE_FLA:
        return
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
    gated_delta_net.l2norm = torch_l2norm
    gated_delta_net.HAVE_FLA = True


def torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x`` scaled to unit L2 norm along ``dim`` (transformers' torch l2norm for gated delta rules)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


@functools.cache
def replicated_linear():
    """A linear layer whose whole weight every TP rank holds, for multi-latent attention's down projections, as
    TransformerEngine's spec has them (``TELinear``, ``parallel_mode="duplicated"``). The local spec makes them
    column-parallel, and Megatron-Core 0.16.1 then all-gathers the latent and rotary key over TP, whose backward
    keeps each rank's own slice of a gradient that every rank's heads add to: the shared rotary key's gradient
    loses the other ranks' heads (a TP=2 gradient of layer 0's ``kv_a_proj_with_mqa`` off by 1.5e-4, the embedding's
    by 5.9e-4, against TP=1). With the weight replicated, MLA takes its sequence-parallel path, which all-gathers
    the rotary key over the sequence and reduce-scatters its gradient. Megatron's local ``Linear`` (marked
    ``sequence_parallel`` under SP: its gradient is all-reduced over TP), initialised by ``init_method`` on the
    model's device."""
    from megatron.core.post_training.modelopt.layers import Linear

    class ReplicatedLinear(Linear):
        def __init__(self, input_size, output_size, *, config, init_method, **kwargs):
            super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
            if cuda_available() and not config.use_cpu_initialization:
                self.to(torch.cuda.current_device())
            if config.perform_initialization:
                with torch.no_grad():
                    init_method(self.weight)

    return ReplicatedLinear


def _patch_te_general_gemm() -> None:
    """Point 10 (a no-op where TransformerEngine is installed: Megatron imported the name)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_gloo_device() -> None:
    """Point 12: ``torch.distributed`` builds its gloo groups with :class:`SharedDeviceGloo` (idempotent)."""
    from torch.distributed import distributed_c10d

    if distributed_c10d.is_gloo_available() and distributed_c10d.ProcessGroupGloo is not SharedDeviceGloo:
        distributed_c10d.ProcessGroupGloo = SharedDeviceGloo


def _gloo_devices(lazy_init: bool | None = None) -> list:
    """This process's gloo devices, made once per (process, ``GLOO_SOCKET_IFNAME``) as torch makes them for a
    group: one per interface the variable names, else the default (the host name's address)."""
    ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
    key = (os.getpid(), ifnames, os.environ.get("TORCH_GLOO_LAZY_INIT", ""))
    if key not in _GLOO_DEVICES:
        if len(ifnames) > 1:  # torch's rule: a one-character value is ignored
            devices = [_ProcessGroupGloo.create_device(interface=name, lazy_init=lazy_init)
                       for name in ifnames.split(",")]
        else:
            devices = [_ProcessGroupGloo.create_default_device(lazy_init=lazy_init)]
        _GLOO_DEVICES[key] = devices
    return _GLOO_DEVICES[key]


_GLOO_DEVICES: dict[tuple, list] = {}
try:
    from torch._C._distributed_c10d import ProcessGroupGloo as _ProcessGroupGloo
except ImportError:  # torch built without gloo
    SharedDeviceGloo = None
else:
    class SharedDeviceGloo(_ProcessGroupGloo):
        """Point 12: a gloo group on this process's shared device(s); built as torch builds one (``store, rank,
        size, timeout``) or with explicit options (kept as given)."""

        def __init__(self, store, rank: int, size: int, timeout_or_options=None, *, timeout=None) -> None:
            options = timeout_or_options
            if not isinstance(options, _ProcessGroupGloo._Options):
                timeout = timeout if timeout is not None else timeout_or_options
                options = _ProcessGroupGloo._Options()
                options._devices = _gloo_devices()
                if timeout is not None:
                    options._timeout = timeout
            super().__init__(store, rank, size, options)


