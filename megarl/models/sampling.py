"""Seeded sampling from a transformers causal LM: per-row seed streams and a plain generation loop.

:func:`derive_row_seed` is the one definition of how a call's seed becomes the seed of row ``i``'s
sampling stream. The rollout engines (``HFEngine``, ``SGLangEngine``'s ``sampling_seed``), the
rollout manager and the trainer derive their seeds with it.

:func:`generate` is a small batched sampling loop (temperature or greedy; no top-k / top-p, no
stop strings, no log-probs) for code that sits below the rollout engines: the tiny model's warm
start (:mod:`megarl.warmstart.sft`) measures its sampled reward with it. For the same model,
prompts and ``SamplingParams(max_new_tokens, temperature, seed)`` it returns the tokens
``megarl.rollout.hf_engine.HFEngine.generate`` returns, bit for bit: the same left padding, position
ids, KV cache, fp32 logits, stop ids and exponential race with one ``torch.Generator`` per row
seeded with ``derive_row_seed(seed, row)`` (``tests/unit/test_tiny_sft.py`` checks it). Keep the two
in step.

Shape legend: ``B`` rows, ``L`` tokens (padded prompt plus generated so far), ``V`` vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

MAX_SEED = 2**63 - 1
"""Seeds are non-negative 63-bit integers (what ``torch.Generator.manual_seed`` and SGLang accept)."""


def derive_row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s sampling stream in a call seeded with ``seed`` (a stable hash)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(row)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


def derive_seed(seed: int, *parts: int) -> int:
    """A seed for a named stream of ``seed`` (e.g. ``(rollout seed, stream, step)``): :func:`derive_row_seed`
    applied part by part, so every tuple of parts gets its own reproducible seed."""
    for part in parts:
        seed = derive_row_seed(seed, part)
    return seed


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """The ids generation stops at: the tokenizer's EOS, then those of the model's config and generation
    config (chat models often list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``), as SGLang does.
    The first one pads prompts."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    generation_config = model.generation_config
    for configured in (model.config.eos_token_id,
                       None if generation_config is None else generation_config.eos_token_id):
        for eos in [] if configured is None else [configured] if isinstance(configured, int) else configured:
            if int(eos) not in ids:
                ids.append(int(eos))
    if not ids:
        raise ValueError("sampling needs an EOS token id: pass a tokenizer with eos_token set or a model whose "
                         "config has eos_token_id")
    return tuple(ids)


def sample_tokens(logits_BV: torch.Tensor, temperature: float,
                  generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """Next token per row: argmax when ``temperature`` is 0, else a draw from ``softmax(logits / T)``.

    The draw is an exponential race (argmax of ``p_i / E_i`` with ``E_i ~ Exp(1)``), one noise row
    per generator, so every row's stream is its own.
    """
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.log_softmax(logits_BV / temperature, dim=-1).exp()
    noise_BV = torch.stack([torch.empty(logits_BV.shape[-1], device=logits_BV.device).exponential_(generator=g)
                            for g in generators])
    return (probs_BV / noise_BV.clamp(min=torch.finfo(noise_BV.dtype).tiny)).argmax(dim=-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
             seed: int, stop_token_ids: Sequence[int]) -> list[list[int]]:
    """One continuation per prompt (token ids, ending with the stop token when one was sampled).

    The prompts are sampled together: one prefill over the left-padded batch (padded with
    ``stop_token_ids[0]``), then one token per step with a KV cache, until every row has sampled a
    stop token or ``max_new_tokens`` tokens. Row ``i`` samples from a generator seeded with
    ``derive_row_seed(seed, i)``; ``temperature=0`` is greedy.
    """
    from transformers import DynamicCache

    if max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"generate needs max_new_tokens >= 1 and temperature >= 0, got {max_new_tokens} and "
                         f"{temperature}")
    if not prompts or not all(prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    context = int(model.config.max_position_embeddings)
    if max(len(p) for p in prompts) + max_new_tokens > context:
        raise ValueError(f"generate: a prompt of {max(len(p) for p in prompts)} tokens plus max_new_tokens="
                         f"{max_new_tokens} exceeds the model's context of {context} (max_position_embeddings)")
    device = next(model.parameters()).device
    num_rows, width = len(prompts), max(len(p) for p in prompts)
    input_ids_BL = torch.full((num_rows, width), int(stop_token_ids[0]), dtype=torch.long)
    attention_mask_BL = torch.zeros((num_rows, width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids_BL[row, width - len(ids):] = torch.tensor([int(t) for t in ids], dtype=torch.long)
        attention_mask_BL[row, width - len(ids):] = 1
    input_ids_BL, attention_mask_BL = input_ids_BL.to(device), attention_mask_BL.to(device)
    position_ids_BL = (attention_mask_BL.cumsum(dim=1) - 1).clamp(min=0)
    generators = None
    if temperature != 0:
        generators = [torch.Generator(device=device).manual_seed(derive_row_seed(seed, row)) for row in range(num_rows)]
    stop_ids = {int(t) for t in stop_token_ids}

    cache = DynamicCache(config=model.config)
    logits_BV = model(input_ids=input_ids_BL, attention_mask=attention_mask_BL, position_ids=position_ids_BL,
                      past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
    next_position_B1 = position_ids_BL[:, -1:] + 1
    outputs: list[list[int]] = [[] for _ in range(num_rows)]
    finished = [False] * num_rows
    while True:
        tokens_B = sample_tokens(logits_BV, temperature, generators)
        tokens = tokens_B.tolist()
        for row in range(num_rows):
            if finished[row]:
                continue
            outputs[row].append(tokens[row])
            finished[row] = tokens[row] in stop_ids or len(outputs[row]) == max_new_tokens
        if all(finished):
            return outputs
        # Finished rows keep being fed (their tokens are ignored) so the batch stays rectangular.
        attention_mask_BL = torch.cat([attention_mask_BL, attention_mask_BL.new_ones((num_rows, 1))], dim=1)
        logits_BV = model(input_ids=tokens_B[:, None], attention_mask=attention_mask_BL,
                          position_ids=next_position_B1, past_key_values=cache, use_cache=True,
                          logits_to_keep=1).logits[:, -1].float()
        next_position_B1 = next_position_B1 + 1
