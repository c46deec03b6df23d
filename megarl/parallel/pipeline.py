"""Forward (and backward) over micro-batches through Megatron's pipeline schedule.

``forward_backward`` runs Megatron's schedule (no pipelining, 1F1B, or interleaved 1F1B,
as the layout says) over a list of micro-batches and computes, on the last pipeline stage,
the per-token log-probability of the next token and the entropy from vocabulary-sharded
logits. A ``loss_fn`` turns them into a scalar loss; without one it returns them. Chunks
whose output layer emits values (:data:`EMITS_VALUES`; megarl.models.value_head's critic head)
give per-token values instead, which a value ``loss_fn`` receives in the same way.

Process groups. Given the rank's :class:`~megarl.parallel.groups.ProcessGroups`, the schedule
runs on those groups (Megatron's ``pg_collection`` and a p2p communicator on their pipeline
group); without them it falls back to Megatron's global ``parallel_state``.

Inputs. RL batches hold left-padded prompts followed by right-padded responses. Each micro-batch reaches
the model packed (the rows' tokens end to end, one sequence per row: ``packed=True``) or padded, with each
row rotated to start at index 0, so that positions are exact (the HF models and the rollout engines number
each row from its first real token) and plain causal attention ignores the padding. Context parallelism
splits the sequence over CP ranks. :mod:`megarl.parallel.packing` builds the inputs and brings the outputs
back, so callers see their original layout.

Legend: B micro-batch size, S sequence length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from megarl.parallel.logprob import vocab_parallel_logprobs
from megarl.parallel.packing import Prepared, pack_alignment, packed_length, prepare_packed, prepare_padded, token_mask

if TYPE_CHECKING:
    from megarl.parallel.groups import ProcessGroups
    from megarl.parallel.routing import Routing

LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]
"""``loss_fn(logp_BS, entropy_BS, micro_batch) -> (loss, metrics)``; loss already normalised."""
ValueLossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]
"""``loss_fn(values_BS, micro_batch) -> (loss, metrics)`` for chunks with a value head; normalised."""

MULTIMODAL_INPUTS = "multi_modal_inputs"
"""The micro-batch field holding each row's vision inputs (verl's name): a dict with ``pixel_values``
``[patches, C·T·P·P]`` and ``image_grid_thw`` ``[images, 3]``, or None for a text-only row."""
MROPE_POSITIONS = "mrope_position_ids"
"""A micro-batch's per-token multimodal positions ``[B, S, 3]`` (temporal, height, width; 0 on padding), which the
model's multimodal RoPE takes instead of each row's 0, 1, 2, ... (:mod:`megarl.models.vision`)."""
IMAGE_TOKENS = "image_token_mask"
"""A micro-batch's ``[B, S]`` mask of the placeholder tokens that hold its images (a placeholder token the model
generated is text), which the first stage's vision model fills with image embeddings."""

EMITS_VALUES = "emits_values"
"""The attribute that marks a value output layer: a chunk whose ``output_layer`` has it set to True
returns one value per position ([S, B, 1]) where a language model returns vocabulary logits. The
model code sets it (``megarl.models.value_head.ValueHead``); this module only reads it."""


def vision_inputs(rows: Sequence[dict | None]) -> dict[str, torch.Tensor] | None:
    """A micro-batch's vision inputs for the model, rows in order (so its images come in the order their
    placeholder tokens appear): each key's tensors concatenated; None when no row has an image."""
    present = [r for r in rows if r and r.get("pixel_values") is not None]
    if not present:
        return None
    return {key: torch.cat([r[key] for r in present]) for key in present[0]}


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under Megatron's DDP / Float16Module wrappers."""
    while hasattr(module, "module"):  # Megatron DDP / Float16Module wrappers
        module = module.module
    return module


def emits_values(model_chunks: Sequence[torch.nn.Module]) -> bool:
    """True when one of these (possibly wrapped) chunks ends in an output layer marked :data:`EMITS_VALUES`."""
    return any(getattr(getattr(_unwrap(c), "output_layer", None), EMITS_VALUES, False) is True for c in model_chunks)


def forward_backward(
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[dict],
    *,
    loss_fn: LossFn | ValueLossFn | None = None,
    forward_only: bool = False,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    groups: ProcessGroups | None = None,
    tp_group=None,
    return_logits: bool = False,
    packed: bool = False,
    routing: Routing | None = None,
) -> list[dict[str, Any]]:
    """Run the pipeline schedule over ``micro_batches``; return per-micro-batch results.

    Each micro-batch is a dict with ``input_ids`` [B, S] and optionally ``attention_mask``
    [B, S] (1 for tokens), plus whatever ``loss_fn`` reads. Position t's log-prob is that of
    token t+1 given tokens up to t (the last position's value is meaningless).

    On the last pipeline stage the result list holds, per micro-batch, ``loss_fn``'s metrics
    (with ``loss``), or ``{"logp": ..., "entropy": ...}`` [B, S] when ``loss_fn`` is None.
    With ``return_logits`` (forward only) the results also hold ``logits``: this TP rank's
    vocabulary slice [B, S, V/tp], before temperature. Other stages get an empty list.
    Gradients accumulate in the chunks' parameters (or ``main_grad`` buffers with Megatron
    DDP, finalised across DP ranks at the end).

    Chunks with a value head (a critic, :func:`emits_values`): position t's value is the head's
    output on the hidden state of tokens up to t, float32 [B, S] in the caller's layout;
    ``loss_fn`` is a :data:`ValueLossFn` and forward-only results are ``{"values": ...}``.
    ``temperature`` and ``vocab_size`` do not apply.

    ``groups``: this rank's process groups (what :func:`megarl.parallel.init_parallel` returned);
    the pipeline size, TP group and the schedule's groups come from them. None: from Megatron's
    global ``parallel_state`` (the TP group from ``tp_group`` when given).

    ``packed``: each micro-batch's rows reach the model packed into one sequence (THD,
    :func:`megarl.parallel.packing.prepare_packed`; the layer spec's attention must take packed sequences), else
    padded to a rectangle. Either way the sequence is split over context-parallel ranks and results come back
    in the caller's ``[B, S]`` (:mod:`megarl.parallel.packing`).

    ``routing`` (mixture-of-experts models): a :class:`~megarl.parallel.routing.Routing` that replays and/or
    measures the rollout's routed experts (each micro-batch's ``rollout_routed_experts``); closed when the call
    ends.
    """
    from megatron.core.utils import get_model_config

    value_head = _check_request(model_chunks, micro_batches, loss_fn, forward_only, return_logits)
    config = get_model_config(model_chunks[0])
    pp, tp_group, schedule, schedule_groups = _resolve_schedule(model_chunks, config, groups, tp_group)
    _check_interleaving(len(model_chunks), len(micro_batches), pp)
    _set_finalize(config, model_chunks, forward_only)
    if value_head:
        loss_func = functools.partial(_value_loss, loss_fn)
    else:
        loss_func = functools.partial(_lm_loss, loss_fn, temperature, tp_group, vocab_size, return_logits)
    if return_logits and cp_layout(groups)[0] > 1:
        raise ValueError("return_logits=True needs parallel.cp=1 (logits stay split over context-parallel ranks)")
    prepared = _prepare_micro_batches(micro_batches, pp, packed, groups, config)
    iterators = [iter(enumerate(prepared)) for _ in range(len(model_chunks))]
    try:
        return schedule(
            forward_step_func=functools.partial(_forward_step, loss_func, routing,
                                                _padding_split(config, groups) if config.num_moe_experts else None),
            data_iterator=iterators if len(model_chunks) > 1 else iterators[0],
            model=list(model_chunks),
            num_microbatches=len(micro_batches),
            seq_length=max(p.seq_length for _, p in prepared),
            micro_batch_size=max(p.micro_batch_size for _, p in prepared),
            forward_only=forward_only,
            **schedule_groups,
        )
    finally:
        if routing is not None:
            routing.close()


def _check_request(
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[dict],
    loss_fn: LossFn | ValueLossFn | None,
    forward_only: bool,
    return_logits: bool,
) -> bool:
    """Raise ``ValueError`` on a call :func:`forward_backward` cannot run; return :func:`emits_values`."""
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    if return_logits and not forward_only:
        raise ValueError("return_logits=True is for forward_only=True runs")
    # Known on the last stage, the only one that calls the loss function.
    value_head = emits_values(model_chunks)
    if return_logits and value_head:
        raise ValueError("return_logits=True needs an LM head; these chunks end in a value head (a critic)")
    if loss_fn is None and not forward_only:
        raise ValueError("forward_backward without loss_fn computes nothing to differentiate: pass forward_only=True")
    return value_head


def _resolve_schedule(
    model_chunks: Sequence[torch.nn.Module], config, groups: ProcessGroups | None, tp_group
) -> tuple[int, Any, Callable, dict[str, Any]]:
    """The pipeline size, TP group, Megatron schedule and the schedule's group arguments.

    From ``groups`` when given (Megatron's ``pg_collection``, and with PP > 1 a p2p communicator
    on ``groups.pp``); otherwise from Megatron's global ``parallel_state`` (``tp_group`` if given).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if groups is None:
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_world_size()
        tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
        return pp, tp_group, get_forward_backward_func(), {}
    if tp_group is not None and tp_group is not groups.tp:
        raise ValueError("forward_backward: tp_group is not groups.tp; pass groups alone")
    pp, tp_group = groups.dims.pp, groups.tp
    if len(model_chunks) != groups.dims.num_virtual_stages:
        raise ValueError(f"forward_backward got {len(model_chunks)} model chunks for a layout with "
                         f"{groups.dims.num_virtual_stages} virtual pipeline stages (parallel.vpp)")
    schedule = get_forward_backward_func(pp_size=pp, vp_size=len(model_chunks) if len(model_chunks) > 1 else None)
    schedule_groups = {"pg_collection": groups.collection}
    if pp > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        schedule_groups["p2p_communicator"] = P2PCommunicator(pp_group=groups.pp, config=config)
    return pp, tp_group, schedule, schedule_groups


def _check_interleaving(num_chunks: int, num_micro_batches: int, pp: int) -> None:
    """Interleaved 1F1B (several chunks per rank) needs a multiple of ``pp`` micro-batches."""
    if num_chunks > 1 and num_micro_batches % pp != 0:
        raise ValueError(
            f"interleaved pipelining (parallel.vpp={num_chunks}) needs a multiple of "
            f"parallel.pp={pp} micro-batches, got {num_micro_batches}: split the batch into more micro-batches"
        )


def cp_layout(groups: ProcessGroups | None) -> tuple[int, int, Any]:
    """``(cp, cp_rank, cp_group)`` of this rank."""
    if groups is not None:
        return groups.dims.cp, groups.cp_rank, groups.cp if groups.dims.cp > 1 else None
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    return cp, parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group() if cp > 1 else None


def _prepare_micro_batches(micro_batches: Sequence[dict], pp: int, packed: bool, groups: ProcessGroups | None,
                           config) -> list[tuple[dict, Prepared]]:
    """Each micro-batch with its model inputs (:mod:`megarl.parallel.packing`), aligned for sequence and context
    parallelism. Pipeline stages exchange activations of one fixed shape per call (no shape exchange before
    every send), so with PP > 1 every micro-batch is padded to the largest (rows and columns, or pack length)."""
    cp, cp_rank, cp_group = cp_layout(groups)
    tp = groups.dims.tp if groups is not None else config.tensor_model_parallel_size
    seg_align, total_align = pack_alignment(cp=cp, tp=tp, sequence_parallel=config.sequence_parallel)
    split = {"cp": cp, "cp_rank": cp_rank, "cp_group": cp_group}
    if packed:
        pad_to = max(packed_length(mb, seg_align, total_align) for mb in micro_batches) if pp > 1 else None
        out = [(mb, prepare_packed(mb, seg_align=seg_align, total_align=total_align, pad_to=pad_to, **split))
               for mb in micro_batches]
    else:
        shape = None
        if pp > 1:
            shape = (max(mb["input_ids"].shape[0] for mb in micro_batches),
                     max(mb["input_ids"].shape[1] for mb in micro_batches))
        out = [(mb, prepare_padded(mb, shape=shape, total_align=total_align, **split)) for mb in micro_batches]
    for mb, prepared in out:
        if MROPE_POSITIONS in mb:  # [B, S, 3] -> the model's [3, b, t]
            prepared.position_ids = prepared.to_model(mb[MROPE_POSITIONS], 0).permute(2, 0, 1).contiguous()
    return out


def _padding_split(config, groups: ProcessGroups | None) -> tuple[int, int]:
    """``(tp_rank, tp)`` over which a sequence-parallel model splits its tokens (``(0, 1)`` without SP)."""
    if not config.sequence_parallel:
        return 0, 1
    if groups is not None:
        return groups.tp_rank, groups.dims.tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _forward_step(loss_func: Callable, routing: Routing | None, moe_split: tuple[int, int] | None, data_iterator,
                  model: torch.nn.Module):
    """Megatron's forward step: run ``model`` on the next prepared micro-batch (its routers set by ``routing``).

    Mixture-of-experts models (``moe_split``: the SP split, :func:`_padding_split`) get Megatron's ``padding_mask``
    (True on the pack's or the rectangle's padding): the routers leave those tokens out of the load-balancing and
    z losses. Megatron splits it for SP on the first stage only, so later stages get this rank's part.

    Returns the chunk's output and the loss function bound to that micro-batch's inputs, which
    Megatron calls with the output on the last stage.
    """
    index, (micro_batch, prepared) = next(data_iterator)
    if routing is not None:
        routing.before_forward(model, index, micro_batch, prepared)
    kwargs, config, z_coeff = {}, None, None
    if moe_split is not None:
        padding_bt = ~prepared.to_model(token_mask(micro_batch), False)
        tp_rank, tp = moe_split
        block = padding_bt.shape[1] // tp
        local_bt = padding_bt[:, tp_rank * block:(tp_rank + 1) * block]
        kwargs["padding_mask"] = (padding_bt if getattr(_unwrap(model), "pre_process", True) else local_bt).contiguous()
        config = _unwrap(model).config
        z_coeff = config.moe_z_loss_coeff
        if z_coeff and model.training:
            # Megatron's z-loss is each rank's mean over its tokens, its coefficient divided by TP × CP: weight this
            # rank's mean by its share of the micro-batch's tokens, so the sum over ranks is the micro-batch's mean.
            local, total = int((~local_bt).sum()), int(token_mask(micro_batch).sum())
            config.moe_z_loss_coeff = z_coeff * tp * prepared.cp * local / max(total, 1)
    if MULTIMODAL_INPUTS in micro_batch and getattr(_unwrap(model), "pre_process", False):
        kwargs["vision_inputs"] = vision_inputs(micro_batch[MULTIMODAL_INPUTS])
        if kwargs["vision_inputs"] is not None and IMAGE_TOKENS in micro_batch:
            kwargs["vision_inputs"]["image_mask"] = prepared.to_model(micro_batch[IMAGE_TOKENS], False)
    try:
        output = model(prepared.input_ids, prepared.position_ids, None,
                       packed_seq_params=prepared.packed_seq_params, **kwargs)
    finally:
        if config is not None:
            config.moe_z_loss_coeff = z_coeff
    if routing is not None:
        routing.after_forward()
    return output, functools.partial(loss_func, micro_batch, prepared)


def _lm_loss(
    loss_fn: LossFn | None,
    temperature: float,
    tp_group,
    vocab_size: int | None,
    return_logits: bool,
    micro_batch: dict,
    prepared: Prepared,
    logits_btV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron's loss function for a language model: log-probs and entropy, then ``loss_fn``.

    Returns ``(loss, count, outputs)``. Without ``loss_fn`` the loss is 0 and the outputs are the
    log-probs and entropy (and with ``return_logits`` the logits) in the caller's layout.
    """
    logp_bt, entropy_bt = vocab_parallel_logprobs(
        logits_btV, prepared.labels, temperature, tp_group=tp_group, vocab_size=vocab_size
    )
    # Back to the caller's layout (gathered over CP ranks, unpacked or unaligned, unpadded).
    logp_BS, entropy_BS = prepared.restore(logp_bt), prepared.restore(entropy_bt)
    if loss_fn is None:
        outputs = {"logp": logp_BS.detach(), "entropy": entropy_BS.detach()}
        if return_logits:
            outputs["logits"] = prepared.restore(logits_btV.detach())
        zero = logits_btV.new_zeros((), dtype=torch.float32)
        return zero, torch.tensor(0, dtype=torch.int), outputs
    loss, metrics = loss_fn(logp_BS, entropy_BS, micro_batch)
    metrics = {"loss": loss.detach(), **metrics}
    # The count returned here would make Megatron divide the loss; megarl's losses are
    # already normalised (see finalize in _set_finalize), so it is only informational.
    return loss, torch.tensor(0, dtype=torch.int), metrics


def _value_loss(
    loss_fn: ValueLossFn | None,
    micro_batch: dict,
    prepared: Prepared,
    values_bt1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron's loss function for a value head: float32 values [B, S] in the caller's layout, then ``loss_fn``.

    Returns ``(loss, count, outputs)``; without ``loss_fn`` the loss is 0 and the outputs are the values.
    """
    values_BS = prepared.restore(values_bt1.squeeze(-1).float())
    if loss_fn is None:
        zero = values_BS.new_zeros(())
        return zero, torch.tensor(0, dtype=torch.int), {"values": values_BS.detach()}
    loss, metrics = loss_fn(values_BS, micro_batch)
    return loss, torch.tensor(0, dtype=torch.int), {"loss": loss.detach(), **metrics}


def _set_finalize(config, model_chunks, forward_only: bool) -> None:
    """Finalise gradients (DP all-reduce, tied-embedding sync) without Megatron's rescaling.

    With ``calculate_per_token_loss`` Megatron sums gradients over DP ranks and would divide
    them by the token count returned by the loss function; megarl passes no count, so the
    gradient of an already-normalised loss is left as is.
    """
    if forward_only or not all(hasattr(chunk, "finish_grad_sync") for chunk in model_chunks):
        config.finalize_model_grads_func = None
        config.no_sync_func = config.grad_sync_func = None
        return
    from megatron.core.distributed import finalize_model_grads

    def finalize(model, num_tokens=None, **kwargs):
        finalize_model_grads(model, num_tokens=None, **kwargs)

    config.finalize_model_grads_func = finalize
    if model_chunks[0].ddp_config.overlap_grad_reduce:
        # As Megatron's training loop: the buckets' collectives start during the last micro-batch's backward pass
        # only (no_sync holds them before), each chunk's once its pipeline stage is done with it.
        no_sync = [chunk.no_sync for chunk in model_chunks]
        start = [chunk.start_grad_sync for chunk in model_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.grad_sync_func = start[0] if len(start) == 1 else start
