"""A rollout engine on Hugging Face transformers: the CPU stand-in for SGLang.

:class:`HFEngine` implements :class:`~megarl.engines.engine.RolloutEngine` over megarl's one
sampling loop, :func:`megarl.models.sampling.sample_continuations` (left-padded batch, attention
mask, position ids from the mask, a KV cache, fp32 logits, top-k / top-p, stop ids), so each
returned log-prob comes from the very logits that sampled the token: ``log_softmax(logits / T)``
at the sampled id, before top-k / top-p truncation (``T = 1`` when greedy). Those are the numbers
the trainer recomputes as ``old_log_probs``. This module adds the engine around the loop:
request checks, row seeds, batching of concurrent requests, locking, weight updates, sessions,
memory release and ``GenerateOutput`` assembly.

Randomness. Every row of a call samples from its own ``torch.Generator``:

- with ``SamplingParams.seed`` set, row ``i`` of a :meth:`HFEngine.generate` call uses
  :func:`derive_row_seed` ``(seed, i)``, and a request given to :meth:`HFEngine.async_generate`
  uses ``derive_row_seed(seed, 0)`` whatever it is batched with: such calls reproduce on
  their own, independently of earlier calls;
- without it, row seeds are drawn from the engine's generator (seeded by the constructor's
  ``seed``), so an engine built with the same seed and given the same sequence of calls
  reproduces every output.

What a row samples does not depend on the other rows of its batch except through
floating-point effects: a different batch pads the row differently, which can change its
logits in the last bits and, rarely, a sampled token. Outputs are therefore reproducible for
the same inputs, not promised identical across batch compositions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megarl.data.images import ImageProcessor
from megarl.engines.cpu_engine.batcher import RequestBatcher
from megarl.engines.cpu_engine.fp8 import Fp8Weights, is_fp8_checkpoint
from megarl.engines.cpu_engine.lora import applied as lora_applied
from megarl.engines.cpu_engine.model_facts import (
    StoredWeights,
    coload_partners,
    expert_biases,
    hub_views,
    reads_back,
    routers,
    vision_spec,
)
from megarl.engines.engine import FinishReason, GenerateOutput, NamedTensors, SamplingParams
from megarl.models.hf_config import read_hf_config
from megarl.models.sampling import RoutingCapture, VisionPrompts, eos_token_ids, sample_continuations
from megarl.models.vision import hub_name, is_multimodal, model_config
from megarl.seeds import MAX_SEED, derive_row_seed

logger = logging.getLogger("megarl.engine_server")


class HFEngine:
    """A single-process rollout engine over a transformers causal LM (CPU, or CUDA).

    Args:
        model_path_or_model: an HF model directory (loaded with ``AutoModelForCausalLM``) or
            a loaded model, which is used in place, not copied: weight updates write into it.
        tokenizer: supplies the EOS id (loaded from the directory when ``None`` and a path
            is given). Generation stops at it and at the EOS ids of the model's config and
            generation config.
        dtype: weights and compute dtype.
        device: ``"cpu"`` or a CUDA device.
        seed: seeds the engine generator that row seeds are drawn from when a request has
            no ``SamplingParams.seed``.
        trust_remote_code: allow model and tokenizer code from the model directory.
        weights_cpu_backup: keep the weights across a memory release (SGLang's
            ``--enable-weights-cpu-backup``); without it a release leaves them garbage (see
            :meth:`release_memory_occupation`).
        context_length: the longest prompt + response a request may reach (SGLang's ``--context-length``); None:
            the model's ``max_position_embeddings``. A larger one is refused, as SGLang refuses to start with a
            context longer than the model's.
        fp8_scale_ue8m0: an FP8 engine requantizes every weight it loads to power-of-two scales, as SGLang on
            Blackwell does (:func:`megarl.engines.cpu_engine.fp8.requantize_ue8m0`).

    Weight updates take full HF-named tensors (the names of ``model.named_parameters()``, and
    for a mixture-of-experts model the checkpoint's one-tensor-per-expert names, which SGLang
    loads) only: the engine is one process, so there is no TP-sharded layout to accept. A tied
    ``lm_head.weight`` and ``model.embed_tokens.weight`` are one tensor, so updating either
    name updates both.
    """

    def __init__(self, model_path_or_model: str | os.PathLike | torch.nn.Module, tokenizer: Any = None, *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                 trust_remote_code: bool = False, image_processor: Any = None,
                 weights_cpu_backup: bool = False, context_length: int | None = None,
                 fp8_scale_ue8m0: bool = False) -> None:
        if isinstance(model_path_or_model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

            config = read_hf_config(model_path_or_model, trust_remote_code=trust_remote_code)  # Kimi-K2's alias
            multimodal = is_multimodal(model_config(config))
            auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
            model = auto.from_pretrained(model_path_or_model, config=config, dtype=dtype,
                                         trust_remote_code=trust_remote_code)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(model_path_or_model, trust_remote_code=trust_remote_code)
            if multimodal and image_processor is None:
                image_processor = ImageProcessor.from_pretrained(model_path_or_model, tokenizer,
                                                                 model_config(model.config),
                                                                 trust_remote_code=trust_remote_code)
        elif isinstance(model_path_or_model, torch.nn.Module):
            model = model_path_or_model
        else:
            raise TypeError(f"HFEngine needs a model directory or a torch.nn.Module, got "
                            f"{type(model_path_or_model).__name__}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(self.model, tokenizer)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.hf_config = model_config(self.model.config)
        self.max_model_len = int(self.hf_config.max_position_embeddings)
        if context_length is not None:
            if not 0 < context_length <= self.max_model_len:
                raise ValueError(f"HFEngine: context_length={context_length} must be in 1..{self.max_model_len} "
                                 f"(the model's max_position_embeddings; SGLang refuses a longer --context-length "
                                 f"too): lower actor_rollout_ref.rollout.max_model_len or the prompt/response lengths")
            self.max_model_len = context_length
        self.vision = vision_spec(self.hf_config)
        """A vision-language model's :class:`~megarl.models.vision.VisionSpec` (None: a text model)."""
        self.image_processor = image_processor
        if self.vision is not None and image_processor is None:
            raise ValueError("HFEngine on a vision-language model needs its image processor (image_processor=)")
        self._pad_id = self.eos_token_ids[0]
        self._params = self._weights()
        self.fp8: Fp8Weights | None = None
        """An FP8 checkpoint's weights and scales (:mod:`megarl.engines.cpu_engine.fp8`); None: not FP8."""
        if isinstance(model_path_or_model, (str, os.PathLike)) and is_fp8_checkpoint(model_path_or_model):
            self.fp8 = Fp8Weights.from_checkpoint(model_path_or_model, self._params, scale_ue8m0=fp8_scale_ue8m0)
            self.fp8.refresh_all()
        self.reads_back = reads_back(self.model)
        """Whether ``/get_weights_by_name`` answers (SGLang's class for the model has the method: Llama's)."""
        self.coload = coload_partners(self.model, self.fp8)
        """HF name -> the names SGLang's loader takes only with it in one request (:meth:`ModelFamily.coload_groups`;
        an FP8 engine's scales too): an update that brings a name without them leaves its weight as it was."""
        self.dropped_alone = 0
        """Tensors left out of updates because a request brought them without their co-load partners."""
        self.routers = routers(self.model)
        """``(layer, router module)`` of every mixture-of-experts layer (empty for a dense model)."""
        self._seed_generator = torch.Generator().manual_seed(seed)
        # Held while generating and while changing state (sessions, release).
        self._lock = threading.RLock()
        # Guards the seed generator and the batchers; never held across a generation, so an
        # event loop submitting requests does not block on a running batch.
        self._seed_lock = threading.Lock()
        self._in_session = False
        self._released = False
        self.weights_cpu_backup = weights_cpu_backup
        self._garbage: list[str] = []
        """Weights a release without CPU backup left garbage and no update has rewritten whole since."""
        self._session_buckets = 0
        self._session_tensors = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RequestBatcher] = (
            weakref.WeakKeyDictionary())

    # ----------------------------------------------------------------------------- generate

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams,
                 return_logprob: bool = False) -> list[GenerateOutput]:
        """Generate one continuation per sequence of ``input_ids`` (a batch, sampled together)."""
        prompts = self._check_prompts(input_ids, sampling_params)
        if sampling_params.seed is None:
            row_seeds = self._draw_row_seeds(len(prompts))
        else:
            row_seeds = [derive_row_seed(sampling_params.seed, i) for i in range(len(prompts))]
        return self.generate_rows(prompts, sampling_params, return_logprob, row_seeds)

    async def async_generate(self, input_ids: Sequence[int], sampling_params: SamplingParams,
                             return_logprob: bool = False) -> GenerateOutput:
        """Generate for one sequence; concurrent requests on one event loop are batched.

        Requests submitted while the engine is busy are queued and run together as the next
        batch (grouped by sampling params up to seed and ``max_new_tokens``, which are per row,
        and by ``return_logprob``), on the engine's worker thread, so the event loop never
        blocks on the model.
        """
        prompt = self._check_prompts([input_ids], sampling_params)[0]
        if sampling_params.seed is None:
            row_seed = self._draw_row_seeds(1)[0]
        else:
            row_seed = derive_row_seed(sampling_params.seed, 0)
        loop = asyncio.get_running_loop()
        with self._seed_lock:
            batcher = self._batchers.get(loop)
            if batcher is None:
                batcher = self._batchers[loop] = RequestBatcher(self, loop)
        return await batcher.submit(prompt, sampling_params, return_logprob, row_seed)

    def _draw_row_seeds(self, num_rows: int) -> list[int]:
        with self._seed_lock:
            return torch.randint(MAX_SEED, (num_rows,), generator=self._seed_generator).tolist()

    def _check_prompts(self, input_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"HFEngine.generate needs megarl.engines.engine.SamplingParams, got "
                            f"{type(params).__name__}")
        if len(input_ids) == 0:
            raise ValueError("HFEngine.generate needs at least one input sequence")
        prompts = []
        for row, ids in enumerate(input_ids):
            ids = [int(t) for t in ids]
            if not ids:
                raise ValueError(f"HFEngine.generate: input sequence {row} is empty; a prompt needs >= 1 token")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"HFEngine.generate: input sequence {row} has token ids {bad[:5]} outside the "
                                 f"vocabulary [0, {self.vocab_size})")
            if len(ids) + params.max_new_tokens > self.max_model_len:
                raise ValueError(f"HFEngine.generate: input sequence {row} has {len(ids)} tokens; with "
                                 f"max_new_tokens={params.max_new_tokens} it exceeds the engine's context of "
                                 f"{self.max_model_len} (--context-length, or max_position_embeddings); lower "
                                 f"rollout.response_length "
                                 f"or the prompt length")
            prompts.append(ids)
        return prompts

    def _check_can_generate(self) -> None:
        if self._in_session:
            raise RuntimeError("HFEngine cannot generate inside a weight-update session; call "
                               "end_weight_update() first")
        if self._released:
            raise RuntimeError("HFEngine cannot generate while its memory is released; call "
                               "resume_memory_occupation() first")
        if self._garbage:
            raise RuntimeError(
                f"HFEngine cannot generate: {len(self._garbage)} weight tensors hold released memory (e.g. "
                f"{self._garbage[:3]}): their memory was released without a CPU backup and no weight update has "
                f"rewritten them since (SGLang frees the pages and would generate from garbage); rewrite every weight "
                f"after a release, or start the engine with --enable-weights-cpu-backup")

    def generate_rows(self, prompts: list[list[int]], params: SamplingParams, return_logprob: bool,
                      row_seeds: list[int], row_max_new_tokens: list[int] | None = None,
                      control: Callable[[], Any] | None = None,
                      return_routed_experts: bool = False, adapter: Any = None,
                      images: Sequence[list | None] | None = None) -> list[GenerateOutput]:
        """Run one batch through :func:`~megarl.models.sampling.sample_continuations`, under the engine lock.

        ``row_seeds`` seed each row's sampling stream; ``row_max_new_tokens`` (default: all
        ``params.max_new_tokens``) limits each row, so requests of different budgets share a batch.
        Generation stops at ``params.stop_token_ids`` and, unless ``params.ignore_eos``, at the
        engine's EOS ids; prompts are padded with the first EOS id. ``control`` runs between
        decoding steps (the sampling loop's pause/abort hook) with the engine lock released, so
        a paused batch lets weight updates and memory calls through; aborted rows finish with
        :attr:`FinishReason.ABORT`. ``return_routed_experts`` (mixture-of-experts models): each output carries
        the experts every token was routed to (:attr:`GenerateOutput.routed_experts`). ``adapter``: a LoRA adapter
        (:class:`megarl.engines.cpu_engine.lora.Adapter`) every row runs with. ``images``: each row's images (RGB
        images, None for none; a vision-language model's), placed at the row's image placeholders (one per image,
        or already one per merged patch).
        """
        vision = self._vision_prompts(prompts, images)
        if vision is not None:
            prompts = vision[0]
        limits = row_max_new_tokens or [params.max_new_tokens] * len(prompts)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))

        def unlocked_control() -> Any:
            self._lock.release()
            try:
                return control()
            finally:
                self._lock.acquire()

        capture = contextlib.nullcontext()
        if return_routed_experts:
            if not self.routers:
                raise ValueError("return_routed_experts: this engine's model has no mixture-of-experts router")
            capture = RoutingCapture(self.routers, self.model.config.num_hidden_layers)
        with self._lock, capture, lora_applied(self.model, adapter):
            self._check_can_generate()
            rows = sample_continuations(self.model, prompts, max_new_tokens=limits, row_seeds=row_seeds,
                                        stop_token_ids=stop_ids, pad_token_id=self._pad_id,
                                        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                        control=None if control is None else unlocked_control,
                                        routing=capture if return_routed_experts else None,
                                        vision=None if vision is None else vision[1])
        return [GenerateOutput(output_ids=row.token_ids,
                               finish_reason=(FinishReason.ABORT if row.aborted else
                                              FinishReason.STOP if row.stopped else FinishReason.LENGTH),
                               output_logprobs=row.logprobs if return_logprob else None,
                               routed_experts=row.routed_experts)
                for row in rows]

    def _vision_prompts(self, prompts: list[list[int]], images: Sequence[list | None] | None
                        ) -> tuple[list[list[int]], VisionPrompts] | None:
        """A vision-language model's prompts with each image's placeholder expanded to its merged patches, their
        multimodal positions and the images' pixel values (None for a text model given no images)."""
        if self.vision is None:
            if images is not None and any(images):
                raise ValueError("HFEngine: images were given, but the model is not a vision-language model")
            return None
        images = list(images) if images is not None else [None] * len(prompts)
        expanded, inputs = [], []
        for row, (ids, row_images) in enumerate(zip(prompts, images, strict=True)):
            pixels = None
            if row_images:
                pixels = self.image_processor.pixels(row_images)
                ids = self.image_processor.expand(ids, pixels["image_grid_thw"])
            elif self.image_processor.image_runs(ids):
                raise ValueError(f"HFEngine: prompt {row} has image placeholders but no images")
            expanded.append(ids)
            inputs.append(pixels)
        return expanded, self.vision.prompts(self.hf_config, expanded, inputs)

    # ----------------------------------------------------------------------------- weights

    def begin_weight_update(self) -> None:
        """Open a weight-update session; waits for a running generation to finish."""
        with self._lock:
            if self._in_session:
                raise RuntimeError("HFEngine.begin_weight_update: a weight-update session is already open; "
                                   "call end_weight_update() first")
            if self._released:
                raise RuntimeError("HFEngine.begin_weight_update: memory is released; call "
                                   "resume_memory_occupation() before updating weights")
            self._in_session = True
            self._session_buckets = self._session_tensors = 0

    def update_weights_from_tensor(self, named_tensors: NamedTensors) -> None:
        """Copy one bucket of full HF-named tensors into the weights, in place.

        The whole bucket is checked first (names known, shapes equal, floating-point values,
        a tensor named twice only with equal values); on any problem ``ValueError`` lists
        them all and no tensor of the bucket is copied. Buckets applied earlier in the
        session stay applied. Values are cast to the engine's dtype and device.
        """
        with self._lock:
            if not self._in_session:
                raise RuntimeError("HFEngine.update_weights_from_tensor must run inside a weight-update session: "
                                   "call begin_weight_update() first (or use megarl.engines.engine.update_weights)")
            targets = self._check_bucket(named_tensors)
            with torch.no_grad():
                for param, tensor in targets:
                    if isinstance(param, str):  # an FP8 weight or scale: its parameter is remade at the end
                        self.fp8.store(param, tensor)
                    else:
                        param.copy_(tensor)
            if self.device.type == "cuda":
                # The copies are only enqueued. The sender refills its bucket buffer once this call has answered,
                # and megarl's engine server keeps the CUDA IPC mappings open across buckets (torch's receiver
                # synchronises its stream only when it lets a mapping go): wait until the bytes are read.
                torch.cuda.current_stream(self.device).synchronize()
            self._session_buckets += 1
            self._session_tensors += len(targets)

    def _check_bucket(self, named_tensors: NamedTensors) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        problems, targets = [], []
        seen: dict[int, tuple[str, torch.Tensor]] = {}
        present = {entry[0] for entry in named_tensors if isinstance(entry, (tuple, list)) and entry}
        alone = []
        for entry in named_tensors:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], torch.Tensor)):
                problems.append(f"entry {entry!r:.80} is not a (name, tensor) pair")
                continue
            name, tensor = entry
            if name in self.coload and not present.issuperset(self.coload[name]):
                alone.append(name)  # SGLang caches it for a fused parameter this request never completes
                continue
            if self.fp8 is not None and self.fp8.owns(name):
                problem = self.fp8.problem(name, tensor)
                if problem:
                    problems.append(problem)
                else:
                    targets.append((name, tensor))
                continue
            param = self._params.get(name)
            if param is None:
                problems.append(f"unknown name {name!r}")
            elif tuple(tensor.shape) != tuple(param.shape):
                problems.append(f"{name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(param.shape)}")
            elif not tensor.is_floating_point():
                problems.append(f"{name!r} has dtype {tensor.dtype}; weights must be floating point")
            elif id(param) in seen and not torch.equal(seen[id(param)][1].cpu(), tensor.cpu()):
                problems.append(f"{name!r} and {seen[id(param)][0]!r} are the same (tied) weight but the bucket "
                                f"gives them different values")
            else:
                seen[id(param)] = (name, tensor)
                targets.append((param, tensor))
        if problems:
            applied = (f"; {self._session_buckets} earlier bucket(s) ({self._session_tensors} tensors) of this "
                       f"session stay applied" if self._session_buckets else "")
            raise ValueError(f"HFEngine.update_weights_from_tensor: bucket refused, nothing of it was copied"
                             f"{applied}: " + "; ".join(problems))
        if alone:
            self.dropped_alone += len(alone)
            logger.warning("weight update: %d tensors came without the tensors SGLang's loader fuses them with and "
                           "were not loaded, as SGLang drops them (e.g. %s, which needs %s in the same request)",
                           len(alone), alone[0], [n for n in self.coload[alone[0]] if n not in present])
        return targets

    def read_weight(self, name: str, truncate: int, tp: int = 1) -> list:
        """What ``/get_weights_by_name`` answers for weight ``name`` from an engine of ``tp`` TP ranks, as SGLang
        answers it (:mod:`megarl.engines.cpu_engine.read_back`: Llama-class models only, TP rank 0's slices): the
        first ``truncate`` rows as floats, an FP8 engine's quantized weights and scales as it stores them.
        :class:`~megarl.engines.cpu_engine.read_back.ReadBackRefused` where SGLang answers an error."""
        from megarl.engines.cpu_engine.read_back import FAILED, ReadBackRefused, answer

        if not self.reads_back:
            arch = (getattr(self.model.config, "architectures", None) or [type(self.model).__name__])[0]
            raise ReadBackRefused(f"{FAILED}: SGLang's {arch} has no get_weights_by_name (only Llama-class models "
                                  f"read weights back); the weight sync cannot verify this engine")
        with self._lock:
            return answer(name, StoredWeights(self._params, self.fp8), self.hf_config, tp=tp, truncate=truncate)

    def inspect_weight(self, name: str) -> torch.Tensor:
        """A copy of weight ``name`` as this engine holds it (whole; an FP8 engine's quantized values), whatever the
        model: megarl's tests look into the engine with it (SGLang has no such read)."""
        with self._lock:
            return StoredWeights(self._params, self.fp8)[name].detach().clone()

    def end_weight_update(self) -> None:
        """Close the session (and flush the cache, which this engine does not keep)."""
        with self._lock:
            if not self._in_session:
                raise RuntimeError("HFEngine.end_weight_update: no weight-update session is open")
            self._in_session = False
            if self.fp8 is not None:
                self.fp8.refresh()
            if self._garbage:  # what this session rewrote whole is valid again
                tensors = self._weight_tensors()
                self._garbage = [name for name in self._garbage if torch.isnan(tensors[name]).any()]
            self.flush_cache()

    # ----------------------------------------------------------------------------- memory

    def release_memory_occupation(self) -> None:
        """Stop serving until resumed; the weights' memory is given up, as SGLang's memory saver gives it up.

        Without ``weights_cpu_backup`` SGLang frees the weights' pages and maps fresh ones on resume, restoring the
        model's buffers only (its ``_export_static_state`` / ``_import_static_state``): the parameters hold garbage
        until a weight update rewrites them. This engine fills them with NaN, and refuses to generate while any
        of them is not rewritten whole (a weight-update session that brings every tensor makes it whole again).
        With ``weights_cpu_backup`` they survive (on CUDA they wait in host memory). Idempotent; generation and
        weight updates are refused until resumed.
        """
        with self._lock:
            if self._in_session:
                raise RuntimeError("HFEngine.release_memory_occupation: a weight-update session is open; "
                                   "call end_weight_update() first")
            if self._released:
                return
            if self.device.type == "cuda":
                self.model.to("cpu")
                torch.cuda.empty_cache()
            if not self.weights_cpu_backup:
                self._drop_weights()
            self._released = True

    def _drop_weights(self) -> None:
        """Make every weight garbage (NaN), as freed pages are; an FP8 engine's stored weights and scales too."""
        tensors = self._weight_tensors()
        with torch.no_grad():
            for tensor in tensors.values():
                tensor.fill_(float("nan"))
            if self.fp8 is not None:
                for stored in (*self.fp8.weights.values(), *self.fp8.scales.values()):
                    stored.fill_(float("nan"))
        self._garbage = sorted(tensors)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The model's own weights by name, each once: its parameters and a router's expert bias (a buffer in
        transformers, a parameter in SGLang's models)."""
        return dict(self.model.named_parameters()) | expert_biases(self.model)

    def resume_memory_occupation(self) -> None:
        """Take the memory back (weights back on the device; garbage unless kept by ``weights_cpu_backup``);
        idempotent."""
        with self._lock:
            if not self._released:
                return
            if self.device.type == "cuda":
                self.model.to(self.device)
                # The move gave every parameter new storage: the per-expert hub views of _params still point into
                # the freed host copies, so updates through them would never reach the model.
                self._params = self._weights()
            self._released = False

    def flush_cache(self) -> None:
        """No-op: the KV cache lives only for one generate call, nothing persists between calls."""

    def _weights(self) -> dict[str, torch.Tensor]:
        """The tensors weight updates write, by name: the model's parameters and, for a mixture-of-experts model,
        the checkpoint-named views into its fused experts (views of the parameters' current storage)."""
        params = dict(self.model.named_parameters(remove_duplicate=False)) | expert_biases(self.model)
        params.update(hub_views(self.model, params))
        if self.vision is not None:  # the checkpoint's names (SGLang's), which the trainer sends
            params.update({hub_name(name, self.vision): param for name, param in list(params.items())})
        return params
