"""The memory model's formulas for what a layer keeps for its backward and for a micro-batch's worst-case shape.

:mod:`megarl.plan.memory`'s module docstring says what each counts (its **activations** and **micro-batch
tokens**); these are the pure functions, no config.
"""

from __future__ import annotations

import dataclasses
import math

from megarl.parallel.packing import round_up


def activation_bytes_per_layer(*, tokens: int, seq: int, hidden: int, heads: int, tp: int,
                               sequence_parallel: bool, recompute: str | None, fused_attention: bool = True,
                               attention: int | None = None, latent: int = 0) -> int:
    """Bytes one transformer layer keeps for its backward (Korthikanti et al. 2022, Table 2; 16-bit).

    ``tokens`` = micro-batch rows × ``seq``. ``recompute="full"``: the layer's input only.
    ``fused_attention``: the attention kernel stores no ``a × s²`` scores (flash attention, which
    TransformerEngine's layers use), so no recompute costs what selective recompute does.
    ``attention``: elements per token of what attention keeps split over TP: its queries, keys and values and the
    output projection's input (None: ``4 h``, Table 2's count, as for multi-head attention; a multi-latent
    attention's are wider: :attr:`megarl.models.sizes.Architecture.attention_activations`). ``latent``: elements per
    token of a multi-latent attention's compressed query and key-value latents kept whole on every TP rank (each
    norm's input and output; split like the layer's input under sequence parallelism).
    """
    split = tp if sequence_parallel else 1
    if recompute == "full":
        return math.ceil(2 * tokens * hidden / split)
    attention = 4 * hidden if attention is None else attention
    rest = 26 * tokens * hidden / tp if sequence_parallel else tokens * hidden * (10 + 16 / tp)
    base = rest + 2 * tokens * attention / tp + 2 * tokens * latent / split
    if recompute == "selective" or fused_attention:
        return math.ceil(base)
    return math.ceil(base + 5 * heads * seq * tokens / tp)


def moe_layer_activation_bytes(*, tokens: int, seq: int, hidden: int, heads: int, tp: int, sequence_parallel: bool,
                               recompute: str | None, experts: int, topk: int, expert_ffn: int, etp: int,
                               fused_attention: bool = True, attention: int | None = None, latent: int = 0) -> int:
    """Bytes one mixture-of-experts layer keeps for its backward (16-bit; balanced routing; see the module
    docstring): the dense layer's count without its MLP's ``16 T h / t``, plus the router's fp32 scores and
    the routed copies' expert activations. ``recompute="full"``: the layer's input only, as a dense layer."""
    kwargs = {"tokens": tokens, "seq": seq, "hidden": hidden, "heads": heads, "tp": tp,
              "sequence_parallel": sequence_parallel, "fused_attention": fused_attention, "attention": attention,
              "latent": latent}
    if recompute == "full":
        return activation_bytes_per_layer(recompute="full", **kwargs)
    local = tokens / tp if sequence_parallel else tokens  # tokens this rank routes
    # Each copy: the expert's input (2h), gate/up output (4 f/etp), down input (2 f/etp), output (2h/etp; kept
    # for the routing weights' gradient); the etp ranks of an expert all take every copy of their group.
    routed = local * topk * (2 * hidden * (etp + 1) + 6 * expert_ffn)
    dense_mlp = 16 * tokens * hidden / tp
    return math.ceil(activation_bytes_per_layer(recompute=recompute, **kwargs) - dense_mlp + routed
                     + 8 * local * experts)



def chunks_in_flight(*, pp: int, vpp: int | None, pp_rank: int, num_micro_batches: int) -> int:
    """Model chunks whose activations pipeline rank ``pp_rank`` holds at once under (interleaved) 1F1B."""
    chunks = vpp or 1
    if chunks == 1:
        return min(pp - pp_rank, num_micro_batches)
    return min(2 * (pp - pp_rank - 1) + (chunks - 1) * pp + 1, num_micro_batches * chunks)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Worst-case shape of one micro-batch on one rank."""

    tokens: int
    seq: int
    count: int
    """Micro-batches per mini-batch on one rank (the 1F1B cap)."""


def micro_batch(*, seq: int, rows: int | None, dynamic: bool, budget: int, packed: bool, cp: int = 1,
                align: tuple[int, int] = (1, 1), rows_per_rank: int = 1) -> MicroBatch:
    """The largest micro-batch of rows of ``seq`` tokens before the CP split (see the module docstring).

    ``rows`` per micro-batch, or with ``dynamic`` a token ``budget`` per GPU (a micro-batch spans the ``cp`` GPUs
    of a CP group: ``budget × cp`` tokens). ``packed``: THD, every row a segment of ``round_up(seq, seg)``, the
    pack rounded up to ``total``; else every row padded to ``round_up(seq, total)`` columns. ``align``: ``(seg,
    total)`` of :func:`~megarl.parallel.packing.pack_alignment`. ``count``: micro-batches of ``rows_per_rank``.
    """
    seg, total = align
    width = round_up(seq, seg) if packed else round_up(seq, total)
    if not dynamic:
        tokens = round_up(rows * width, total) if packed else rows * width
        return MicroBatch(tokens, width, math.ceil(rows_per_rank / rows))
    pack = budget * cp
    if packed:
        per_micro = max(pack // width, 1)
        return MicroBatch(round_up(max(pack, width), total), width, math.ceil(rows_per_rank / per_micro))
    # Padded: full-width rows round their columns up; narrower rows fill the budget itself.
    per_micro = max(pack // seq, 1)
    return MicroBatch(max(pack, per_micro * width), width, math.ceil(rows_per_rank / per_micro))
