"""The critic's value head: one scalar per position in place of the vocabulary output layer.

A critic is a GPT body whose last pipeline stage ends in ``Linear(H, 1)`` instead of the LM
head. :class:`ValueHead` sits where ``GPTModel`` keeps its output layer and is called the
same way, so the model's forward returns values [B, S, 1] where it would return logits.

Legend: S sequence, B batch, H hidden.
"""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    """``Linear(H, 1)`` with a bias, replicated on every tensor-parallel rank.

    Replicated, not sharded: its input (the final norm's output) is the same on every TP rank
    when sequence parallelism is off, so every TP rank computes the same values and the same
    parameter gradients, and nothing needs reducing over TP. Its parameters carry no
    ``tensor_model_parallel`` attribute: Megatron's gradient-norm counts them once (on TP
    rank 0) and its distributed checkpoints store them as one replicated tensor.

    Initialisation: weight ~ N(0, ``init_std``²) drawn from its own generator seeded with
    ``seed``, bias 0. The private generator makes the head identical on every rank and at
    every layout (the global RNG streams differ per pipeline stage and depend on what was
    built before). A non-zero weight lets gradients reach the body from the first step (a
    zero head would block them: d value / d hidden = weight); ``init_std`` is the HF
    ``initializer_range``, as in HF's token-classification heads, which keeps the first
    values small.
    """

    emits_values = True
    """Marks this output layer as returning values, not logits (``megarl.parallel.pipeline.EMITS_VALUES``)."""

    def __init__(self, hidden_size: int, *, init_std: float, seed: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        # Drawn on the CPU whatever ``device`` is: the same values on every device.
        generator = torch.Generator().manual_seed(seed)
        weight_1H = torch.empty(1, hidden_size, dtype=torch.float32).normal_(0.0, init_std, generator=generator)
        self.weight = torch.nn.Parameter(weight_1H.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        # Megatron tags its output layer's weight so (decoupled-lr) optimizer groups find it.
        self.weight.is_embedding_or_output_parameter = True

    def forward(self, hidden_SBH: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        """Values [S, B, 1] and no separate bias (GPTModel's ``output_layer`` convention).

        ``weight`` (the tied embedding) must be None: a critic never ties its head.
        ``runtime_gather_output`` has nothing to gather (the output is not sharded).
        """
        assert weight is None, "the value head is never tied to the embedding"
        return torch.nn.functional.linear(hidden_SBH, self.weight, self.bias), None


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # Megatron DDP / Float16Module wrappers
        module = module.module
    return module


def attach_value_head(model, *, seed: int) -> None:
    """Replace the vocabulary output layer of a last-stage ``GPTModel`` chunk with a :class:`ValueHead`.

    The head goes on the device of the model's parameters, in the model's ``params_dtype``: on GPU Megatron
    builds them on the current device, and its DDP moves a parameter into its GPU buffer only with the
    distributed optimizer, so a head built on the CPU would otherwise stay there.
    """
    config = model.config
    if config.sequence_parallel:
        raise ValueError(
            "critic with parallel.sequence_parallel=true: the replicated value head expects the full "
            "sequence on every TP rank; turn sequence parallelism off for the critic"
        )
    if model.share_embeddings_and_output_weights:
        raise ValueError("a value head cannot be tied to the embedding: build the critic untied")
    model.output_layer = ValueHead(config.hidden_size, init_std=config.init_method_std, seed=seed,
                                   dtype=config.params_dtype, device=next(model.parameters()).device)


def has_value_head(model_chunks) -> bool:
    """True when one of these (possibly DDP-wrapped) chunks ends in a :class:`ValueHead`."""
    return any(isinstance(getattr(_unwrap(c), "output_layer", None), ValueHead) for c in model_chunks)


def value_head_parameter_names(model_chunks) -> set[str]:
    """Names (as in ``chunk.named_parameters()``) of the value-head parameters of these chunks."""
    names = set()
    for chunk in model_chunks:
        for module_name, module in _unwrap(chunk).named_modules():
            if isinstance(module, ValueHead):
                names |= {f"{module_name}.{p}" for p, _ in module.named_parameters()}
    return names
