"""Run Megatron-Core without CUDA (gloo, fp32) or without TransformerEngine (the local layer spec).

Megatron-Core assumes CUDA in a handful of places that matter for TP/PP training on CPU, and
TransformerEngine in a few more. This module is the one place that deals with them. Points 1-6 and 11
apply only when CUDA is absent; points 7-10 are what the local layer spec needs, so they apply
wherever TransformerEngine is not used (every CPU run, and CUDA without TE): ``install()`` puts
9 and 10 in place on every machine (each is a no-op where TE provides the thing), and the local
spec's modules (7, 8) follow the model's device and dtype. What it changes, and why:

1. ``torch.cuda.current_device()`` is used as a ``device=`` argument when Megatron allocates
   buffers (tensor-parallel gathers, rotary tables, the global memory buffer). It returns
   the CPU device here.
2. Hard-coded ``device="cuda"`` tensors and ``.cuda()`` calls (pipeline schedules' token
   counters, the grad-norm all-reduce, DDP buckets) are redirected to the CPU by a
   ``TorchFunctionMode`` entered on the calling thread. ``pin_memory`` is dropped (it needs
   an accelerator).
3. ``Tensor.type()`` answers with the CUDA type name (``torch.cuda.FloatTensor``): the
   optimizer and grad-clipping code accept parameters by that string.
4. ``torch.cuda.synchronize()`` is a no-op (the schedules' p2p path calls it).
5. The model-parallel RNG tracker keeps CUDA generator states; here it keeps CPU generator
   states instead, so dropout inside tensor-parallel regions still draws from per-rank
   streams, exactly as on GPU.
Code of megarl's own that needs none of this and runs many small tensor operations (the weight export)
enters :func:`plain_torch`, which leaves the mode off while it runs (its per-operation dispatch costs the
export ~17 % on CPU).

6. :func:`all_gather_into_tensor` (megarl's own gathers, e.g. the weight export): gloo's all-gather stages
   the whole output in a temporary flat tensor and copies it out, doubling the memory of every large
   gather; on gloo each rank's block is broadcast straight into its place in the output instead. NCCL
   (or any other backend) runs torch's all-gather.
7. :class:`CpuRMSNorm` replaces Megatron's torch norm (which refuses sequence parallelism) in the local layer spec
   and as the block's final norm (:func:`local_block_spec`), so sequence parallelism runs without TE. Built on the
   device and in the dtype of the model's other parameters (CUDA without TE included).
8. :func:`core_attention` replaces Megatron's local core attention (which refuses both) with one that runs packed
   sequences (THD, per segment) and context parallelism (an all-gather of keys and values): TransformerEngine's
   attention does these with TE. Its plans (index tensors) live on the queries' device. It computes with torch's
   ``scaled_dot_product_attention`` (flash attention on CUDA: no ``[b, heads, s, s]`` scores stored), Megatron's math
   where that is not the same function (softmax offset, sliding window, attention dropout while training).
9. Megatron's unfused RoPE for packed sequences (what runs unless TE's fused RoPE does) selects its frequencies
   with one index per pack instead of a loop over the sequences with a host sync (``.tolist()``) per layer
   (:func:`_patch_thd_rope`; same numbers, far fewer operations). Installed on every machine.
10. Mixture-of-experts routers: ``moe_utils`` imports TransformerEngine's ``te_general_gemm`` only when TE is
   installed, yet the router's gating function tests ``te_general_gemm is not None`` unconditionally (a NameError
   without TE, CUDA or not); it is set to None, so the gating runs ``torch.mm`` (:func:`_patch_te_general_gemm`).
11. The all-to-all token dispatcher (variable token counts per rank: packed sequences) copies its split sizes to
   the host on a side CUDA stream and hands them to ``all_to_all_single`` as numpy arrays; here they are on the
   host already and become numpy arrays in place (no stream). With expert-tensor parallelism it all-gathers and
   reduce-scatters different token counts per rank, which gloo's list collectives refuse: those pad to the
   largest count and use the tensor collectives (:func:`_gather_uneven`, :func:`_reduce_scatter_uneven`).
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
   (:mod:`megarl._eager_megatron`), so nothing is decorated with ``torch.compile`` and torch's compiler stack is not
   imported with Megatron (about 4 s of CPU per process); :func:`_eager_fusions` undoes what a process that imported
   Megatron first compiled.
14. Multi-latent attention without TransformerEngine (:func:`_patch_mla_without_te`, every machine): Megatron's TE
   stand-in makes ``multi_latent_attention`` believe TE is there and fail on its mock; megarl's core attention
   takes MLA's ``k_channels`` / ``v_channels``, ``kv_layernorm`` is a :class:`CpuRMSNorm` like the others, and the
   down projections are replicated over TP (:func:`replicated_linear`: the local spec's column-parallel ones lose
   part of the shared rotary key's gradient).

Measured cost of the mode: about 8 % of a tiny model's training step.
The mode is thread-local: call ``install()`` in each thread that runs Megatron code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
import warnings

import torch
from torch.overrides import TorchFunctionMode

# Megatron announces its CPU fallbacks on import; on a machine without CUDA they are expected.
if not torch.cuda.is_available():
    for _message in (
        "Apex is not installed",
        "Transformer Engine and Apex are not installed",
        "When using async grad allreduce it is recommended",
        # Megatron's DDP reads .grad of parameter views under our device mode; harmless.
        "The .grad attribute of a Tensor that is not a leaf Tensor",
    ):
        warnings.filterwarnings("ignore", message=_message)
# Megatron 0.16 calls the collectives torch 2.13 renamed; the old names still work.
for _message in ("`torch.distributed.reduce_scatter_tensor` is deprecated",
                 "`torch.distributed.all_gather_into_tensor` is deprecated"):
    warnings.filterwarnings("ignore", category=FutureWarning, message=_message)

_PATCHED = False
"""The CPU patches (points 1, 4, 5, 11) are in place."""
_PATCHED_LOCAL_SPEC = False
"""Points 9 and 10 (every machine) are in place."""
_THREAD_STATE = threading.local()
_CPU = torch.device("cpu")


def cuda_available() -> bool:
    """True when real CUDA devices are usable (then this module changes nothing)."""
    return torch.cuda.is_available()


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer device means "cuda:<index>" to torch.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made on this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            return _backward_under(self, func, args, kwargs)
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _backward_under(mode: TorchFunctionMode, func, args, kwargs):
    """Run a backward call with ``mode`` active inside it.

    A mode is popped while its own handler runs, and backward runs Python code (Megatron's
    activation recomputation re-runs whole layers in ``CheckpointFunction.backward``), which
    would then see no redirect. So the mode is pushed back for the duration, and the engine is
    called the way ``torch.autograd.backward`` calls it, minus its torch-function dispatch
    (which would come straight back here).
    """
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if func is torch.Tensor.backward:
        tensor, *rest = args
        names = ("gradient", "retain_graph", "create_graph", "inputs")
        options = dict(zip(names, rest)) | kwargs
        tensors, grad_tensors = (tensor,), options.get("gradient")
    else:
        tensors, *rest = args
        names = ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
        options = dict(zip(names, rest)) | kwargs
        grad_tensors = options.get("grad_tensors")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = options.get("inputs")
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    create_graph = bool(options.get("create_graph") or False)
    retain_graph = options.get("retain_graph")
    torch._C._push_on_torch_function_stack(mode)
    try:
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                             inputs, allow_unreachable=True, accumulate_grad=True)
    finally:
        torch._C._pop_torch_function_stack()


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


def _cpu_current_device():
    return _CPU


def _patch_rng_tracker() -> None:
    """Point Megatron's CUDA RNG tracker at the CPU default generator."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        # Same contract as CudaRNGStatesTracker.add, on the CPU generator.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add


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


def _patch_moe() -> None:
    """Point 11."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dispatcher.cuda_dtoh_stream = "host"  # class-level: its __init__ creates a CUDA stream only while this is None
    dispatcher._maybe_dtoh_and_synchronize = _splits_on_host
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    mappings._gather_along_first_dim = functools.partial(_gather_uneven, gather)
    mappings._reduce_scatter_along_first_dim = functools.partial(_reduce_scatter_uneven, scatter)


def _splits_on_host(self, point: str, tokens_per_expert=None):
    """Point 11: ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` without CUDA streams."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _gather_uneven(original, input_, group, output_split_sizes=None, use_global_buffer=False):
    """Point 11: Megatron's ``_gather_along_first_dim``; on gloo with per-rank sizes, padded to the largest."""
    import torch.distributed as dist

    if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
        return original(input_, group, output_split_sizes, use_global_buffer)
    sizes = [int(n) for n in output_split_sizes]
    width, rest = max(sizes), tuple(input_.shape[1:])
    padded = input_.new_zeros((width, *rest))
    padded[: input_.shape[0]] = input_
    out = input_.new_empty((width * len(sizes), *rest))
    all_gather_into_tensor(out, padded, group=group)
    return torch.cat([out[i * width : i * width + n] for i, n in enumerate(sizes)])


def _reduce_scatter_uneven(original, input_, group, input_split_sizes=None, use_global_buffer=False):
    """Point 11: Megatron's ``_reduce_scatter_along_first_dim``; on gloo with per-rank sizes, padded."""
    import torch.distributed as dist

    if input_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
        return original(input_, group, input_split_sizes, use_global_buffer)
    sizes = [int(n) for n in input_split_sizes]
    width, rest = max(sizes), tuple(input_.shape[1:])
    padded = input_.new_zeros((width * len(sizes), *rest))
    for i, part in enumerate(torch.split(input_, sizes, dim=0)):
        padded[i * width : i * width + part.shape[0]] = part
    out = input_.new_empty((width, *rest))
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[: sizes[group.rank()]]


# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); torch < 2.13 has only it.
_ALL_GATHER = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``output`` (the ranks' ``input`` blocks stacked along dim 0, in group rank order) from every rank's
    ``input``; ``input`` may already be this rank's block of ``output`` (in place). On gloo by one broadcast
    per rank into the output's block (no staging copy of the whole output: point 6 above)."""
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        _ALL_GATHER(output, input, group=group)
        return
    world = dist.get_world_size(group)
    blocks = output.view(world, -1)
    mine = blocks[dist.get_rank(group)]
    if input.data_ptr() != mine.data_ptr():
        mine.copy_(input.reshape(-1))
    for rank in range(world):
        dist.broadcast(blocks[rank], src=dist.get_global_rank(group, rank), group=group)


def install() -> None:
    """Make Megatron-Core runnable without TransformerEngine (points 9, 10, 12-14: on every machine) and, without CUDA,
    on CPU in this process and on the calling thread.

    Idempotent.
    """
    global _PATCHED, _PATCHED_LOCAL_SPEC
    if not _PATCHED_LOCAL_SPEC:
        _eager_fusions()
        _patch_thd_rope()
        _patch_te_general_gemm()
        _patch_mla_without_te()
        _patch_gloo_device()
        _PATCHED_LOCAL_SPEC = True
    if cuda_available():
        return
    if not _PATCHED:
        torch.cuda.current_device = _cpu_current_device
        torch.cuda.synchronize = lambda device=None: None
        _patch_rng_tracker()
        _patch_moe()
        _PATCHED = True
    if not getattr(_THREAD_STATE, "mode", None):
        mode = _CudaToCpuMode()
        mode.__enter__()
        _THREAD_STATE.mode = mode


def uninstall_thread_mode() -> None:
    """Leave the device-redirect mode on the calling thread (the process patches stay)."""
    mode = getattr(_THREAD_STATE, "mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
        _THREAD_STATE.mode = None


@contextlib.contextmanager
def plain_torch():
    """Torch without the device-redirect mode (point 2) on the calling thread while the block runs: for code of
    megarl's own that names no CUDA device (a no-op with CUDA, where the mode is never entered)."""
    if getattr(_THREAD_STATE, "mode", None) is None:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


@contextlib.contextmanager
def cpu_support():
    """Context manager form of :func:`install` for code that must not leave the mode entered."""
    entered = cuda_available() or getattr(_THREAD_STATE, "mode", None) is not None
    install()
    try:
        yield
    finally:
        if not entered:
            uninstall_thread_mode()


# ----------------------------------------------------------------------- local layer spec
def local_block_spec(spec, config, *, vp_stage: int | None = None):
    """The transformer block of this rank's pipeline stage (``vp_stage``) from Megatron's local layer ``spec`` (one
    for every layer, or a list with one per layer of the model: dense and mixture-of-experts layers):
    :func:`local_spec` layers and a :class:`CpuRMSNorm` final norm (Megatron's default final norm for the local
    spec is its torch norm, which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if not isinstance(spec, list):
        return TransformerBlockSubmodules(layer_specs=[local_spec(spec)] * layers, layer_norm=CpuRMSNorm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = {id(s): local_spec(s) for s in spec}  # each distinct spec once (local_spec edits it in place)
    return TransformerBlockSubmodules(layer_specs=[local[id(s)] for s in spec[offset:offset + layers]],
                                      layer_norm=CpuRMSNorm)


def local_spec(spec):
    """Megatron's local layer ``spec`` with megarl's core attention (:func:`core_attention`: packed
    sequences and context parallelism) and RMSNorms that support sequence parallelism (:class:`CpuRMSNorm`).
    Parameter names do not change. Used wherever TransformerEngine is not (every CPU run)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = CpuRMSNorm
    if getattr(layer.mlp, "module", None) is MoELayer:
        # TransformerEngine's MoE layer keeps its pre-MLP norm under its own name (nothing to fuse it into):
        # checkpoints of either spec hold the same keys.
        layer.sharded_state_dict_keys_map = {k: v for k, v in layer.sharded_state_dict_keys_map.items()
                                             if k != "pre_mlp_layernorm."}
    attention = layer.self_attention.submodules
    attention.core_attention = core_attention()
    for name in ("linear_q_down_proj", "linear_kv_down_proj"):  # multi-latent attention's (point 14)
        if hasattr(attention, name):
            setattr(attention, name, replicated_linear())
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # (kv_layernorm: multi-latent attention's)
        if getattr(attention, name, IdentityOp) is not IdentityOp:
            setattr(attention, name, CpuRMSNorm)
    return spec


class CpuRMSNorm(torch.nn.RMSNorm):
    """7. Megatron's torch norm (``WrappedTorchNorm``) refuses sequence parallelism; this RMSNorm marks its weight
    ``sequence_parallel`` as TransformerEngine's norms do, so Megatron all-reduces its gradient over the TP
    group (each TP rank normalises its own slice of the sequence). Same arguments as ``WrappedTorchNorm``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"CpuRMSNorm: normalization {config.normalization!r}; megarl's families use RMSNorm")
        # On the model's device and in its dtype, as Megatron builds every other parameter: on CUDA without
        # TransformerEngine this spec is the one in use, and nothing moves or casts the norms later.
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(normalized_shape=hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _packed_attention(attention, base, query, key, value, packed_seq_params, attn_mask_type):
    """``CpuCoreAttention`` over a THD pack: causal attention within each segment, ``base`` (Megatron's local
    attention) run on batches of segments of like length; with CP, the keys and values gathered first."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"CpuCoreAttention: packed qkv_format {packed_seq_params.qkv_format!r}; use 'thd'")
    from torch.nn.utils.rnn import pad_sequence

    from megarl.parallel.packing import host_bounds, segment_batches

    bounds = packed_seq_params.cu_seqlens_q_padded
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    bounds = host_bounds(bounds)  # no device sync per layer: the host copy recorded with the pack
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # Attention.forward squeezed the batch dimension of THD: [t, heads, dim]. Views per segment (a split's
    # backward is one concatenation; a slice's, a zero tensor of the whole pack per segment).

    rank = torch.distributed.get_rank(attention.cp_group) if attention.cp > 1 else 0
    if attention.cp > 1:
        key, value = attention._gather(key, value, lengths)
    queries = query.split([n // attention.cp for n in lengths])
    keys, values = key.split(lengths), value.split(lengths)
    plan = segment_batches(lengths, heads=query.shape[-2], cp=attention.cp, rank=rank, device=query.device)
    outs = []
    for batch in plan.batches:
        picked = batch.segments
        if len(picked) == 1 and batch.query_positions is None:
            (i,) = picked
            out = base(queries[i].unsqueeze(1), keys[i].unsqueeze(1), values[i].unsqueeze(1), None,
                       attn_mask_type=attn_mask_type)
            outs.append(out.squeeze(1))
            continue
        q, k, v = (pad_sequence([parts[i] for i in picked]) for parts in (queries, keys, values))
        mask = None  # cp == 1: as many queries as keys, Megatron's causal mask
        if batch.query_positions is not None:
            keys_k = torch.arange(k.shape[0], device=k.device)
            mask = (keys_k[None, None, :] > batch.query_positions[:, :, None])[:, None]
        out = base(q, k, v, mask, attn_mask_type=attn_mask_type)  # [Lq, n, h·d]
        outs.append(out.transpose(0, 1).reshape(-1, out.shape[-1]).index_select(0, batch.output_index))
    return torch.cat(outs).index_select(0, plan.restore).unsqueeze(1)


@functools.cache
def core_attention():
    """:class:`CpuCoreAttention` (built on first use: it subclasses Megatron's local attention, and this module is
    imported before Megatron)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CpuCoreAttention(DotProductAttention):
        """8. Megatron's local core attention with packed sequences and context parallelism (TransformerEngine's
        attention does both on GPU; Megatron's local one refuses them).

        - Packed (THD, ``PackedSeqParams``): causal attention within each segment (bounds from
          ``cu_seqlens_q_padded``), Megatron's own math per segment: cost Σ len², no block mask over the pack.
        - Context parallel (``cp > 1``): the keys and values of the CP group are all-gathered (autograd: the
          backward reduce-scatters their gradients to their owners), put back in sequence order, and each local
          query attends causally by its global position in the 2·cp zigzag split
          (:func:`megarl.parallel.packing.zigzag_index`): of the padded row, or of each segment when packed.
          TransformerEngine's ``all_gather`` CP communication, in plain torch.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
            # k_channels / v_channels: multi-latent attention's query-key and value widths (TransformerEngine's
            # attention takes them; Megatron's local one does not). Attention here reads them off the tensors;
            # its output is heads × kv_channels wide, which an MLA family sets to the value width.
            import copy

            self.cp = config.context_parallel_size
            local = copy.copy(config)
            local.context_parallel_size = 1  # the base class accepts only that; the CP split is handled here
            super().__init__(local, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self.cp_group = None
            if self.cp > 1:
                self.cp_group = getattr(pg_collection, "cp", None)
                if self.cp_group is None:
                    from megatron.core import parallel_state

                    self.cp_group = parallel_state.get_context_parallel_group()

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            base = self._attend
            if packed_seq_params is None:
                if self.cp == 1:
                    return base(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias)
                length = query.shape[0] * self.cp
                keys, values = self._gather(key, value, [length])
                return base(query, keys, values, self._causal(length, query.device), attn_mask_type=attn_mask_type)
            return _packed_attention(self, base, query, key, value, packed_seq_params, attn_mask_type)

        def _attend(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None):
            """Megatron's local attention (``[s, b, heads, dim]`` in, ``[s, b, heads·dim]`` out; ``attention_mask``
            True where masked, else causal) computed by torch's ``scaled_dot_product_attention``: one kernel that
            stores no ``[b, heads, s, s]`` scores (flash attention on CUDA), the same function. Megatron's own math
            where SDPA is not the same: a softmax offset, a sliding window, an attention bias, or attention dropout
            while training (whose randomness Megatron draws from its TP-aware RNG tracker)."""
            from megatron.core.transformer.enums import AttnMaskType

            softmax = self.scale_mask_softmax
            if (attention_bias is not None or self.softmax_offset is not None or softmax.window_size is not None
                    or (self.training and self.attention_dropout.p > 0)):
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
            groups = q.shape[1] // k.shape[1]
            if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads, in order
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            # Megatron's mask type is the layer's (the argument is unused there too); causal needs no mask tensor.
            causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and q.shape[2] > 1
            keep = None if attention_mask is None else ~attention_mask.to(torch.bool)
            scale = self.softmax_scale * (softmax.scale or 1.0)  # query-key layer scaling: divided, then multiplied
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal,
                                                                   scale=scale)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

        def _gather(self, key, value, lengths):
            """The CP group's keys and values in sequence order (sequences of ``lengths`` tokens, end to end)."""
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            from megarl.parallel.packing import cp_inverse

            inverse = cp_inverse(lengths, self.cp, key.device)
            return [gather_from_sequence_parallel_region(t.contiguous(), group=self.cp_group).index_select(0, inverse)
                    for t in (key, value)]

        def _causal(self, length: int, device: torch.device) -> torch.Tensor:
            """The mask (True: masked) of this rank's queries of one sequence of ``length`` tokens over all its keys,
            on ``device``."""
            from megarl.parallel.packing import zigzag_index

            rank = torch.distributed.get_rank(self.cp_group)
            mine = zigzag_index([length], self.cp, rank).to(device)
            return (torch.arange(length, device=device)[None, :] > mine[:, None])[None, None]

    return CpuCoreAttention
