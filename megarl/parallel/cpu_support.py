"""Run Megatron-Core without CUDA (gloo, fp32): the CPU-only mode, in place only where CUDA is absent.

Megatron-Core assumes CUDA in a handful of places that matter for TP/PP training on CPU. This module is the one
place that deals with them; what Megatron needs on every machine (GPU runs included) is
:mod:`megarl.parallel.megatron_patches`, and the layer spec used without TransformerEngine (every CPU run) is
:mod:`megarl.models.local_spec`. What it changes, and why (points 7-10 and 12-14 are in those modules):

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
11. The all-to-all token dispatcher (variable token counts per rank: packed sequences) copies its split sizes to
   the host on a side CUDA stream and hands them to ``all_to_all_single`` as numpy arrays; here they are on the
   host already and become numpy arrays in place (no stream). With expert-tensor parallelism it all-gathers and
   reduce-scatters different token counts per rank, which gloo's list collectives refuse: those pad to the
   largest count and use the tensor collectives (:func:`_gather_uneven`, :func:`_reduce_scatter_uneven`).
Measured cost of the mode: about 8 % of a tiny model's training step.
The mode is thread-local: call ``install()`` in each thread that runs Megatron code.
"""

from __future__ import annotations

import contextlib
import functools
import threading
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

_PATCHED = False
"""The CPU patches (points 1, 4, 5, 11) are in place."""
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
    """Make Megatron-Core runnable on CPU in this process and on the calling thread, where CUDA is absent (a no-op
    with CUDA). Idempotent. Megatron's patches for every machine are :func:`megarl.parallel.megatron_patches.apply`.
    """
    global _PATCHED
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
