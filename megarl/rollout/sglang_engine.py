"""The SGLang rollout engine: a thin adapter from the engine protocol to ``sglang.Engine``.

Pinned to sglang 0.5.23 (the ``gpu`` extra): its offline ``Engine`` API requires weight
updates between ``begin_weight_update()`` and ``end_weight_update()``, takes
``update_weights_from_tensor(..., load_format="flattened_bucket")`` payloads, and returns
``meta_info.finish_reason.type`` and ``meta_info.output_token_logprobs`` per output. This is
the only megarl module that imports sglang, and it does so lazily (inside functions), so the
rest of the package imports without it.

Log-probs: SGLang's default sampler returns ``log(softmax(logits / T))`` of the sampled
token before top-p / top-k truncation (raw ``log_softmax`` when greedy), the protocol's
definition. Do not set ``SGLANG_RETURN_ORIGINAL_LOGPROB``, which switches to ``T = 1``.

Event loops: ``sglang.Engine`` runs its calls on the event loop of the thread that built it
(its tokenizer manager binds to that loop), so build an engine in the thread that drives it,
one engine per such thread, and await :meth:`SGLangEngine.async_generate` on that loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from megarl.models.sampling import derive_row_seed
from megarl.rollout.engine import FinishReason, GenerateOutput, NamedTensors, SamplingParams

SGLANG_VERSION = "0.5.23"
FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's ``load_format`` for one flattened tensor per bucket plus per-tensor metadata."""


def flattened_bucket_payloads(named_tensors: NamedTensors, tp_size: int) -> list[bytes]:
    """The per-TP-rank payloads of one bucket, as ``update_weights_from_tensor`` expects them.

    The bucket's tensors are flattened into one ``uint8`` tensor with SGLang's
    ``FlattenedTensorBucket`` (mixed dtypes allowed) and ``{"flattened_tensor", "metadata"}``
    is serialised with SGLang's ``MultiprocessingSerializer``, once per engine TP rank (each
    rank deserialises only its own copy, which keeps CUDA-IPC reference counts right). The
    tensors are full HF tensors; every rank receives all of them and SGLang's loader takes
    its slice. Tensors are ordered by element size, largest first, so that every tensor
    starts at a byte offset its dtype can be viewed at (the bucket itself does not align).
    """
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if tp_size < 1:
        raise ValueError(f"flattened_bucket_payloads needs tp_size >= 1 (rollout.tensor_model_parallel_size), "
                         f"got {tp_size}")
    named_tensors = sorted(named_tensors, key=lambda pair: -pair[1].element_size())
    if not named_tensors:
        raise ValueError("flattened_bucket_payloads needs a non-empty bucket of (name, tensor) pairs")
    bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    return [MultiprocessingSerializer.serialize(payload) for _ in range(tp_size)]


def sglang_sampling_params(params: SamplingParams, num_rows: int, *, seeded: bool) -> list[dict[str, Any]]:
    """SGLang sampling-param dicts for ``num_rows`` rows of one call.

    ``seeded``: whether the engine honours per-request seeds (deterministic inference); then
    row ``i`` gets ``derive_row_seed(params.seed, i)``, as in ``HFEngine``.
    """
    base: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "ignore_eos": params.ignore_eos,
        # Keep the matched stop token at the end of the output, as the protocol requires.
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        base["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None and seeded:
        return [{**base, "sampling_seed": derive_row_seed(params.seed, i)} for i in range(num_rows)]
    return [dict(base) for _ in range(num_rows)]


def generate_output_from_sglang(result: dict[str, Any], return_logprob: bool) -> GenerateOutput:
    """One SGLang output dict (``output_ids``, ``meta_info``) as a :class:`GenerateOutput`."""
    meta = result["meta_info"]
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or "type" not in finish:
        raise RuntimeError(f"SGLang returned an unfinished output (finish_reason={finish!r})")
    logprobs = None
    if return_logprob:
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
    return GenerateOutput(output_ids=[int(t) for t in result["output_ids"]],
                          finish_reason=FinishReason(finish["type"]), output_logprobs=logprobs)


class SGLangEngine:
    """:class:`~megarl.rollout.engine.RolloutEngine` over an offline ``sglang.Engine`` (GPU).

    Args (``sglang.Engine`` / ``ServerArgs`` names, seeds-digest §4.1):
        model_path: HF model directory (tokenizer included).
        tp_size: engine tensor parallelism (``rollout.tensor_model_parallel_size``).
        mem_fraction_static: GPU memory share for weights and KV cache (``rollout.gpu_memory_utilization``).
        dtype: ``"auto"``, ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        enable_memory_saver: allows ``release_memory_occupation`` (torch_memory_saver).
        base_gpu_id, gpu_id_step, nnodes, node_rank, dist_init_addr: placement of the TP ranks.
        port: the engine's port (``30000 + global rank`` keeps seeded runs from colliding).
        load_format: ``"auto"``, or ``"dummy"`` when the real weights arrive by the first sync.
        random_seed: the engine's global sampling seed.
        enable_deterministic_inference: needed for per-request ``SamplingParams.seed``.
        engine_kwargs: any other ``ServerArgs`` field.

    Weight updates are bucketed ``flattened_bucket`` payloads of full HF-named tensors
    (see :func:`flattened_bucket_payloads`); the cache is flushed when the session ends.
    """

    def __init__(self, model_path: str, *, tp_size: int = 1, mem_fraction_static: float = 0.5,
                 dtype: str = "auto", enable_memory_saver: bool = True, base_gpu_id: int = 0,
                 gpu_id_step: int = 1, port: int = 30000, nnodes: int = 1, node_rank: int = 0,
                 dist_init_addr: str | None = None, load_format: str = "auto", trust_remote_code: bool = False,
                 random_seed: int | None = None, enable_deterministic_inference: bool = False,
                 log_level: str = "error", **engine_kwargs: Any) -> None:
        import sglang

        if sglang.__version__ != SGLANG_VERSION:
            warnings.warn(f"SGLangEngine is written for sglang {SGLANG_VERSION}; found {sglang.__version__}",
                          stacklevel=2)
        self.tp_size = tp_size
        self.seeded = enable_deterministic_inference
        self._engine = sglang.Engine(
            model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static, dtype=dtype,
            enable_memory_saver=enable_memory_saver, base_gpu_id=base_gpu_id, gpu_id_step=gpu_id_step, port=port,
            nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr, load_format=load_format,
            trust_remote_code=trust_remote_code, random_seed=random_seed,
            enable_deterministic_inference=enable_deterministic_inference, skip_tokenizer_init=True,
            log_level=log_level, **engine_kwargs)
        self._in_session = False
        self._released = False
        self._warned_seed = False

    # ----------------------------------------------------------------------------- generate

    def _check_can_generate(self, params: SamplingParams) -> None:
        if self._in_session:
            raise RuntimeError("SGLangEngine cannot generate inside a weight-update session; call "
                               "end_weight_update() first")
        if self._released:
            raise RuntimeError("SGLangEngine cannot generate while its memory is released; call "
                               "resume_memory_occupation() first")
        if params.seed is not None and not self.seeded and not self._warned_seed:
            self._warned_seed = True
            warnings.warn("SamplingParams.seed is ignored: SGLang honours per-request seeds only with "
                          "enable_deterministic_inference=True (the engine's random_seed still applies)",
                          stacklevel=3)

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: SamplingParams,
                 return_logprob: bool = False) -> list[GenerateOutput]:
        """Generate one continuation per sequence (one batched SGLang call)."""
        self._check_can_generate(sampling_params)
        rows = [[int(t) for t in ids] for ids in input_ids]
        results = self._engine.generate(
            input_ids=rows, sampling_params=sglang_sampling_params(sampling_params, len(rows), seeded=self.seeded),
            return_logprob=return_logprob)
        return [generate_output_from_sglang(result, return_logprob) for result in results]

    async def async_generate(self, input_ids: Sequence[int], sampling_params: SamplingParams,
                             return_logprob: bool = False) -> GenerateOutput:
        """Generate for one sequence; SGLang batches concurrent requests itself."""
        self._check_can_generate(sampling_params)
        result = await self._engine.async_generate(
            input_ids=[int(t) for t in input_ids],
            sampling_params=sglang_sampling_params(sampling_params, 1, seeded=self.seeded)[0],
            return_logprob=return_logprob)
        return generate_output_from_sglang(result, return_logprob)

    # ----------------------------------------------------------------------------- weights

    @staticmethod
    def _check_result(action: str, result: Any) -> None:
        success, message = result
        if not success:
            raise RuntimeError(f"SGLang {action} failed: {message}")

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session."""
        if self._in_session:
            raise RuntimeError("SGLangEngine.begin_weight_update: a session is already open; call "
                               "end_weight_update() first")
        if self._released:
            raise RuntimeError("SGLangEngine.begin_weight_update: memory is released; call "
                               "resume_memory_occupation() first")
        self._check_result("begin_weight_update", self._engine.begin_weight_update())
        self._in_session = True

    def update_weights_from_tensor(self, named_tensors: NamedTensors) -> None:
        """Send one bucket of full HF-named tensors as a flattened bucket (no cache flush yet)."""
        if not self._in_session:
            raise RuntimeError("SGLangEngine.update_weights_from_tensor must run inside a weight-update session: "
                               "call begin_weight_update() first (or use megarl.rollout.engine.update_weights)")
        payloads = flattened_bucket_payloads(named_tensors, self.tp_size)
        self._check_result("update_weights_from_tensor", self._engine.update_weights_from_tensor(
            named_tensors=payloads, load_format=FLATTENED_BUCKET, flush_cache=False))

    def end_weight_update(self) -> None:
        """Close the session and flush the prefix cache (it indexes KV computed with the old weights)."""
        if not self._in_session:
            raise RuntimeError("SGLangEngine.end_weight_update: no weight-update session is open")
        self._in_session = False
        self._check_result("end_weight_update", self._engine.end_weight_update())
        self.flush_cache()

    # ----------------------------------------------------------------------------- memory

    def release_memory_occupation(self) -> None:
        """Free the GPU memory of weights and KV cache (the engine must be idle); idempotent."""
        if self._in_session:
            raise RuntimeError("SGLangEngine.release_memory_occupation: a weight-update session is open; call "
                               "end_weight_update() first")
        if not self._released:
            self._engine.release_memory_occupation()
            self._released = True

    def resume_memory_occupation(self) -> None:
        """Take the memory back (same virtual addresses, so CUDA graphs stay valid); idempotent."""
        if self._released:
            self._engine.resume_memory_occupation()
            self._released = False

    def flush_cache(self) -> None:
        """Drop SGLang's radix (prefix) cache."""
        result = self._engine.flush_cache()
        if not result.success:
            raise RuntimeError(f"SGLang flush_cache failed: {result}")

    def shutdown(self) -> None:
        """Stop the engine's processes."""
        self._engine.shutdown()
