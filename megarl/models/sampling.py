"""Seeded sampling from a transformers causal LM: megarl's one sampling loop.

Row ``i`` of a call seeded with ``seed`` samples from ``derive_row_seed(seed, i)`` (:mod:`megarl.seeds`,
where every random stream of a run is listed).

This module owns the sampling loop, :func:`sample_continuations`: left-padded prompts
(:func:`left_pad`, position ids from the mask), one prefill then one token per step with a KV
cache (:func:`last_logits`, fp32 logits), temperature or greedy, top-k / top-p
(:func:`truncate_probs`), an exponential race with one ``torch.Generator`` per row
(:func:`sample_tokens`), stop ids, per-row token budgets and per-token log-probs
``log_softmax(logits / T)`` before truncation. Its callers:

- ``megarl.engines.cpu_engine.hf_engine.HFEngine`` (the CPU rollout engine) runs it for every batch and keeps
  the engine's concerns: batching and locking, weight updates, sessions, row seeds drawn from its
  generator, ``GenerateOutput`` assembly;
- :func:`generate`, a plain token-ids front for code below the rollout engines: the tiny model's
  warm start (:mod:`megarl.warmstart.sft`) measures its sampled reward with it, and so gets the
  tokens ``HFEngine.generate`` returns for the same seed (``tests/unit/test_tiny_sft.py`` checks it).

Shape legend: ``B`` rows, ``L`` tokens (padded prompt plus generated so far), ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import torch

from megarl.seeds import derive_row_seed


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """The ids generation stops at: the tokenizer's EOS, then those of the model's config and generation
    config (chat models often list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``), as SGLang does.
    The first one pads prompts."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    generation_config = model.generation_config
    for configured in (getattr(model.config.get_text_config(), "eos_token_id", None),
                       None if generation_config is None else generation_config.eos_token_id):
        for eos in [] if configured is None else [configured] if isinstance(configured, int) else configured:
            if int(eos) not in ids:
                ids.append(int(eos))
    if not ids:
        raise ValueError("sampling needs an EOS token id: pass a tokenizer with eos_token set or a model whose "
                         "config has eos_token_id")
    return tuple(ids)


def truncate_probs(probs_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``probs_BV`` with the tokens outside top-k, then outside the top-p nucleus, set to 0.

    Top-p keeps a token when the probability mass strictly before it (in descending order)
    is at most ``top_p``, so the most likely token is always kept (SGLang's rule). The result
    is not renormalised; sampling from it is proportional. ``top_k=-1`` and ``top_p=1`` return
    ``probs_BV`` itself.
    """
    if top_k == -1 and top_p >= 1.0:
        return probs_BV
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    keep_BV = torch.ones_like(sorted_BV, dtype=torch.bool)
    if top_k != -1:
        keep_BV[:, top_k:] = False
    if top_p < 1.0:
        keep_BV &= (sorted_BV.cumsum(dim=-1) - sorted_BV) <= top_p
    return torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV * keep_BV)


def sample_tokens(logits_BV: torch.Tensor, *, temperature: float, top_k: int = -1, top_p: float = 1.0,
                  generators: Sequence[torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-prob ``log_softmax(logits / T)`` (``T = 1`` when greedy).

    ``temperature=0`` is greedy (argmax; ``generators`` unused). Otherwise row ``b`` draws from
    ``softmax(logits / T)`` truncated by :func:`truncate_probs` with an exponential race: the
    argmax of ``p_i / E_i`` with ``E_i ~ Exp(1)`` samples ``i`` with probability proportional to
    ``p_i``, and the noise of row ``b`` comes from ``generators[b]``, so every row's stream is
    its own. The log-prob is that of the full tempered distribution, before truncation: the
    number the trainer recomputes as ``old_log_probs``.
    """
    if temperature == 0:
        tokens_B = logits_BV.argmax(dim=-1)
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    else:
        logprobs_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
        probs_BV = truncate_probs(logprobs_BV.exp(), top_k, top_p)
        noise_BV = torch.stack([torch.empty(logits_BV.shape[-1], device=logits_BV.device).exponential_(generator=g)
                                for g in generators])
        tokens_B = (probs_BV / noise_BV.clamp(min=torch.finfo(noise_BV.dtype).tiny)).argmax(dim=-1)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids_BL, attention_mask_BL, position_ids_BL)`` of the prompts left-padded to the longest.

    Padding holds ``pad_token_id`` under mask 0; position ids count the real tokens from 0 (padding
    gets 0), so a row's positions do not depend on how much it was padded.
    """
    num_rows, width = len(prompts), max(len(p) for p in prompts)
    input_ids_BL = torch.full((num_rows, width), int(pad_token_id), dtype=torch.long)
    attention_mask_BL = torch.zeros((num_rows, width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids_BL[row, width - len(ids):] = torch.tensor([int(t) for t in ids], dtype=torch.long)
        attention_mask_BL[row, width - len(ids):] = 1
    input_ids_BL, attention_mask_BL = input_ids_BL.to(device), attention_mask_BL.to(device)
    position_ids_BL = (attention_mask_BL.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids_BL, attention_mask_BL, position_ids_BL


def last_logits(model: torch.nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor,
                position_ids_BL: torch.Tensor, cache: Any, **inputs: torch.Tensor) -> torch.Tensor:
    """``logits_BV`` (fp32) at the last position of one forward that extends the KV ``cache``.

    ``attention_mask_BL`` covers the cached tokens plus ``input_ids_BL``; ``position_ids_BL`` only
    the new ones (a vision-language model's ``[3, B, L]``); ``inputs``: more model inputs (pixel values).
    """
    return model(input_ids=input_ids_BL, attention_mask=attention_mask_BL, position_ids=position_ids_BL,
                 past_key_values=cache, use_cache=True, logits_to_keep=1, **inputs).logits[:, -1].float()


@dataclasses.dataclass
class VisionPrompts:
    """A batch's images for a vision-language model (:class:`megarl.models.vision.VisionSpec`): each prompt's
    ``[L_i, 3]`` multimodal positions and the rows' vision inputs (``pixel_values`` and ``image_grid_thw`` of every
    image, rows in order; None when no row has one), which the prefill (and a rebuild) feeds the model."""

    positions: list[torch.Tensor]
    inputs: dict[str, torch.Tensor] | None

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {} if self.inputs is None else {k: v.to(device) for k, v in self.inputs.items()}


class RoutingCapture:
    """The experts a mixture-of-experts model routes each token to, captured while :func:`sample_continuations`
    runs: forward hooks on the HF routers (transformers' MoE routers return ``(logits, weights, indices)``, the
    indices ``[tokens, top_k]``), collected per forward as ``[B, L_new, num_layers, top_k]``. Layers without a
    router (dense layers of a mixed model) hold zeros, as SGLang's capture buffer does.

    ``routers``: ``(layer index, router module)`` pairs; ``num_layers``: the model's decoder layers.
    """

    def __init__(self, routers: Sequence[tuple[int, torch.nn.Module]], num_layers: int) -> None:
        if not routers:
            raise ValueError("RoutingCapture needs at least one (layer, router) pair: the model has no MoE router")
        self.routers, self.num_layers = list(routers), int(num_layers)
        self._pending: dict[int, torch.Tensor] = {}
        self._columns: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "RoutingCapture":
        for layer, router in self.routers:
            self._handles.append(router.register_forward_hook(functools.partial(self._hook, layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._pending[layer] = output[2].detach()

    def collect(self, rows: int, new_tokens: int, *, restart: bool = False) -> None:
        """File the routing of the forward that just ran over ``rows × new_tokens`` tokens (``restart``: it
        recomputed every token so far, so earlier forwards' routing is replaced)."""
        if set(self._pending) != {layer for layer, _ in self.routers}:
            raise RuntimeError(f"RoutingCapture: routers of layers {sorted({layer for layer, _ in self.routers} - set(self._pending))} "
                               f"did not run in the last forward")
        topk = next(iter(self._pending.values())).shape[-1]
        out = torch.zeros((rows, new_tokens, self.num_layers, topk), dtype=torch.int32)
        for layer, indices in self._pending.items():
            out[:, :, layer] = indices.reshape(rows, new_tokens, topk).to("cpu", torch.int32)
        self._pending.clear()
        if restart:
            self._columns.clear()
        self._columns.append(out)

    def row(self, row: int, start: int, end: int) -> np.ndarray:
        """Row ``row``'s routing at columns ``start:end`` of everything fed so far: ``[end - start, num_layers,
        top_k]`` int32."""
        return torch.cat(self._columns, dim=1)[row, start:end].numpy()


@dataclasses.dataclass
class Continuation:
    """One row's sampled continuation."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    """Sampled ids, ending with the stop id when one was sampled."""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """``log_softmax(logits / T)`` at each sampled id (``T = 1`` when greedy), see :func:`sample_tokens`."""
    stopped: bool = False
    """True when the row ended on a stop id, False when it used up its token budget."""
    aborted: bool = False
    """True when the loop's ``control`` aborted the row before it finished."""
    routed_experts: np.ndarray | None = None
    """With a :class:`RoutingCapture`: the experts of every token the model was fed for this row, the prompt's
    and each sampled one but the last (``[len(prompt) + len(token_ids) - 1, num_layers, top_k]`` int32, SGLang's
    ``routed_experts``)."""


ABORT, REBUILD = "abort", "rebuild"
"""What a sampling loop's ``control`` callback may answer between steps (None: go on)."""


class _Decoder:
    """The model side of the sampling loop: the left-padded batch, its KV cache, the tokens fed so far and
    the routing capture, giving the next logits after a prefill, a one-token step or a rebuild."""

    def __init__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], pad_token_id: int,
                 routing: RoutingCapture | None, vision: VisionPrompts | None = None) -> None:
        from transformers import DynamicCache

        self._new_cache = lambda: DynamicCache(config=model.config)
        self.model, self.routing = model, routing
        self.device = next(model.parameters()).device
        self.input_ids_BL, self.attention_mask_BL, self.position_ids_BL = left_pad(prompts, pad_token_id, self.device)
        self.num_rows, self.width = self.input_ids_BL.shape
        self.fed_BT = self.input_ids_BL.new_zeros((self.num_rows, 0))
        self.next_position_B1 = self.position_ids_BL[:, -1:] + 1
        self.vision_inputs = {}
        if vision is not None:  # multimodal positions [3, B, L]; a row's text goes on from its largest position
            self.position_ids_BL = torch.zeros((3, self.num_rows, self.width), dtype=torch.long, device=self.device)
            for row, positions in enumerate(vision.positions):
                self.position_ids_BL[:, row, self.width - len(positions):] = positions.T.to(self.device)
            self.next_position_B1 = torch.stack([p.max() + 1 for p in vision.positions])[:, None].to(self.device)
            self.vision_inputs = vision.model_inputs(self.device)
        self.cache = self._new_cache()

    def _positions(self, positions_B1: torch.Tensor) -> torch.Tensor:
        """``positions_B1`` as the model takes them (every multimodal axis alike for generated text)."""
        return positions_B1 if self.position_ids_BL.dim() == 2 else positions_B1[None].expand(3, -1, -1)

    def prefill(self) -> torch.Tensor:
        logits_BV = last_logits(self.model, self.input_ids_BL, self.attention_mask_BL, self.position_ids_BL,
                                self.cache, **self.vision_inputs)
        if self.routing is not None:
            self.routing.collect(self.num_rows, self.width, restart=True)
        return logits_BV

    def feed(self, tokens_B: torch.Tensor, *, rebuild: bool) -> torch.Tensor:
        """The logits after ``tokens_B``; ``rebuild``: recompute the KV cache of every token so far first."""
        self.fed_BT = torch.cat([self.fed_BT, tokens_B[:, None]], dim=1)
        self.attention_mask_BL = torch.cat([self.attention_mask_BL,
                                            self.attention_mask_BL.new_ones((self.num_rows, 1))], dim=1)
        if rebuild:
            self.cache = self._new_cache()
            steps_T = torch.arange(self.fed_BT.shape[1], device=self.device)
            generated_BT = self._positions(self.next_position_B1 - self.fed_BT.shape[1] + 1 + steps_T)
            if self.vision_inputs:
                # The prompt with its images, then the tokens so far: a generated placeholder token is text, which
                # the model reads as such only without the images' pixel values.
                last_logits(self.model, self.input_ids_BL, self.attention_mask_BL[:, :self.width],
                            self.position_ids_BL, self.cache, **self.vision_inputs)
                logits_BV = last_logits(self.model, self.fed_BT, self.attention_mask_BL, generated_BT, self.cache)
            else:
                positions_BL = torch.cat([self.position_ids_BL, generated_BT], dim=-1)
                logits_BV = last_logits(self.model, torch.cat([self.input_ids_BL, self.fed_BT], dim=1),
                                        self.attention_mask_BL, positions_BL, self.cache)
            if self.routing is not None:
                self.routing.collect(self.num_rows, self.width + self.fed_BT.shape[1], restart=True)
        else:
            logits_BV = last_logits(self.model, tokens_B[:, None], self.attention_mask_BL,
                                    self._positions(self.next_position_B1), self.cache)
            if self.routing is not None:
                self.routing.collect(self.num_rows, 1)
        self.next_position_B1 = self.next_position_B1 + 1
        return logits_BV

    def file_routing(self, prompts: Sequence[Sequence[int]], rows: list[Continuation]) -> list[Continuation]:
        """``rows`` with each one's routed experts filed (with a routing capture)."""
        if self.routing is not None:
            for row, (prompt, continuation) in enumerate(zip(prompts, rows, strict=True)):
                continuation.routed_experts = self.routing.row(row, self.width - len(prompt),
                                                               self.width + len(continuation.token_ids) - 1)
        return rows


def _file_tokens(rows: list[Continuation], finished: list[bool], tokens: list[int], logprobs: list[float],
                 stop_ids: set[int], max_new_tokens: Sequence[int]) -> None:
    """Append each unfinished row's sampled token; a row finishes on a stop id or at its token budget."""
    for row, continuation in enumerate(rows):
        if finished[row]:
            continue
        continuation.token_ids.append(tokens[row])
        continuation.logprobs.append(logprobs[row])
        continuation.stopped = tokens[row] in stop_ids
        finished[row] = continuation.stopped or len(continuation.token_ids) == max_new_tokens[row]


def _apply_control(action: Any, rows: list[Continuation], finished: list[bool]) -> Any:
    """Apply a ``control`` answer's aborts to the rows; the action left for the model (None or REBUILD)."""
    if action == ABORT:
        action = set(range(len(rows)))
    if isinstance(action, (set, frozenset)):  # abort these rows, go on with the others
        for row in action:
            rows[row].aborted, finished[row] = not finished[row], True
        return None
    if action not in (None, REBUILD):
        raise ValueError(f"sampling control answered {action!r}; expected None, {ABORT!r} or {REBUILD!r}")
    return action


@torch.no_grad()
def sample_continuations(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: Sequence[int], row_seeds: Sequence[int], stop_token_ids: Collection[int],
                         pad_token_id: int, temperature: float, top_k: int = -1,
                         top_p: float = 1.0, control: Callable[[], Any] | None = None,
                         routing: RoutingCapture | None = None, vision: VisionPrompts | None = None
                         ) -> list[Continuation]:
    """The sampling loop: one continuation per prompt, the prompts sampled together.

    One prefill over the batch left-padded with ``pad_token_id`` (:func:`left_pad`), then one
    token per step with a KV cache, until every row has sampled one of ``stop_token_ids`` or its
    ``max_new_tokens[row]`` tokens. Row ``row`` samples (:func:`sample_tokens`) from a
    ``torch.Generator`` seeded with ``row_seeds[row]``; ``temperature=0`` is greedy. Prompts are
    not checked (callers do: non-empty, ids in the vocabulary, within the model's context).

    ``control`` (an engine's pause/abort hook) runs between steps and may block (a pause that
    keeps the rows in place); it answers None to go on, :data:`ABORT` to end the unfinished rows
    now (``aborted``, keeping their tokens), a set of row indices to end only those, or
    :data:`REBUILD` to recompute the KV cache of every row's tokens so far with the model's
    current weights before the next step (a retracted pause resumed after a weight update).

    ``routing`` (an entered :class:`RoutingCapture`): each row's routed experts are filed in its
    ``routed_experts`` (after a REBUILD, the rebuilt forward's: every token routed by the current weights).
    Finished rows keep being fed (their outputs are ignored) so the batch stays rectangular.

    ``vision`` (a vision-language model): the prompts' multimodal positions and images (:class:`VisionPrompts`).
    """
    decoder = _Decoder(model, prompts, pad_token_id, routing, vision)
    generators = None
    if temperature != 0:
        generators = [torch.Generator(device=decoder.device).manual_seed(int(seed)) for seed in row_seeds]
    stop_ids = {int(t) for t in stop_token_ids}
    rows = [Continuation() for _ in prompts]
    finished = [False] * len(rows)
    logits_BV = decoder.prefill()
    while True:
        tokens_B, logprobs_B = sample_tokens(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p,
                                             generators=generators)
        _file_tokens(rows, finished, tokens_B.tolist(), logprobs_B.tolist(), stop_ids, max_new_tokens)
        if not all(finished) and control is not None:
            action = _apply_control(control(), rows, finished)
        else:
            action = None
        if all(finished):
            return decoder.file_routing(prompts, rows)
        logits_BV = decoder.feed(tokens_B, rebuild=action == REBUILD)


def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
             seed: int, stop_token_ids: Sequence[int], vision: VisionPrompts | None = None) -> list[list[int]]:
    """One continuation per prompt (token ids, ending with the stop token when one was sampled).

    :func:`sample_continuations` with every row limited to ``max_new_tokens``, padding with
    ``stop_token_ids[0]`` and row ``i`` seeded with ``derive_row_seed(seed, i)``: the tokens
    ``HFEngine.generate`` returns for ``SamplingParams(max_new_tokens, temperature, seed)`` with
    these stop ids as its EOS ids. ``temperature=0`` is greedy. ``vision``: a vision-language model's images
    (:class:`VisionPrompts`).
    """
    if max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"generate needs max_new_tokens >= 1 and temperature >= 0, got {max_new_tokens} and "
                         f"{temperature}")
    if not prompts or not all(prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    context = int(model.config.get_text_config().max_position_embeddings)  # a vision-language model's: its text's
    if max(len(p) for p in prompts) + max_new_tokens > context:
        raise ValueError(f"generate: a prompt of {max(len(p) for p in prompts)} tokens plus max_new_tokens="
                         f"{max_new_tokens} exceeds the model's context of {context} (max_position_embeddings)")
    continuations = sample_continuations(
        model, prompts, max_new_tokens=[max_new_tokens] * len(prompts),
        row_seeds=[derive_row_seed(seed, row) for row in range(len(prompts))], stop_token_ids=stop_token_ids,
        pad_token_id=stop_token_ids[0], temperature=temperature, vision=vision)
    return [continuation.token_ids for continuation in continuations]
