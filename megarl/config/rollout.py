"""Generation engines and sampling (``actor_rollout_ref.rollout.*``).

:class:`megarl.rollout.RolloutManager`, the multi-turn :class:`megarl.rollout.AgentLoop` and
the rollout workers take :class:`RolloutConfig` as it is. The prompt and response widths
``P`` and ``R`` default to ``data.*``: :meth:`megarl.config.RunConfig.rollout_widths` resolves
them, and the manager receives them next to the section.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import ClassVar

from megarl.config.common import DTYPES, check_choice, check_micro_batches, check_positive, check_sampling

ROLLOUT_NAMES = ("hf", "sglang")
_USE_SGLANG = ("set actor_rollout_ref.rollout.name=sglang (verl's engine settings carry over: tensor_model_parallel_size, "
               "gpu_memory_utilization, n, sampling); hf is the CPU engine of the tests and the tiny recipe")
FOREIGN_ENGINES = {
    "vllm": f"megarl generates with SGLang, not vLLM: {_USE_SGLANG}",
    "trtllm": f"megarl generates with SGLang, not TensorRT-LLM: {_USE_SGLANG}",
}
"""Other frameworks' engines (verl's ``rollout.name`` values) and what megarl runs instead."""
ENGINE_LAYOUTS = ("per_replica", "per_tp_group")
ROUTER_POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
"""sglang-router's ``--policy`` choices megarl offers (``rollout.router_policy``)."""
SANITY_CHECK_MODES = ("strict", "warn", "off")
"""``multi_turn.tokenization_sanity_check``: a mismatch FAILS the request, is logged and counted, or is not checked."""
TOOL_PARSER_INSTALL = ("install sglang as the README does (pip install --no-deps sglang==0.5.23) next to megarl's own "
                       "dependencies (openai, partial_json_parser, xgrammar: pip install -e .)")
"""What installs SGLang's function-call parsers (the README's commands do)."""
_FORMATS_NEEDING_ARGUMENTS = ("response_template",)
"""SGLang parser names that need more than a name (a response template): not offered as ``multi_turn.format``."""


@functools.cache
def tool_call_formats() -> tuple[str, ...] | None:
    """The tool-call formats ``multi_turn.format`` may name: SGLang's ``--tool-call-parser`` names, read from its
    dependency-free ``sglang/srt/function_call/parser_names.py``; None when sglang is not installed.

    The file is loaded by path because importing any ``sglang`` module first runs the package's ``__init__``, which
    imports torch and transformers and patches the latter (4 s on 2 cores): too much for building a config.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "srt" / "function_call" / "parser_names.py"
    if not path.is_file():
        raise ImportError(f"sglang at {path.parents[2]} has no {path.name}; megarl needs sglang 0.5.23: "
                          f"{TOOL_PARSER_INSTALL}")
    module_spec = importlib.util.spec_from_file_location("_megarl_sglang_parser_names", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return tuple(name for name in module.TOOL_CALL_PARSER_NAMES if name not in _FORMATS_NEEDING_ARGUMENTS)


WEIGHT_TRANSPORTS = ("auto", "tensor", "distributed")
QUANTIZATIONS = ("fp8",)
"""``rollout.quantization``: what the engines serve besides their ``dtype`` (block FP8)."""
LORA_SYNCS = ("adapters", "merged")
"""``rollout.lora_sync``: what a LoRA run's weight sync moves."""
"""``rollout.weight_transport``: ``auto`` or a transport of :mod:`megarl.sync`."""


def resolve_transport(name: str, *, colocated: bool, device: str = "cpu") -> str:
    """The transport ``rollout.weight_transport=name`` means: ``auto`` → ``tensor`` when the engines share the
    actor's GPUs, else ``distributed``; ``tensor`` needs colocated engines, and ``distributed`` on GPUs
    (``device="cuda"``) engines on GPUs of their own: colocated, the sending rank and its engine's first TP rank are
    on one GPU, and NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected"; gloo, on CPU,
    allows it)."""
    if name == "auto":
        return "tensor" if colocated else "distributed"
    if name not in WEIGHT_TRANSPORTS:
        raise ValueError(f"actor_rollout_ref.rollout.weight_transport={name!r}: use one of {list(WEIGHT_TRANSPORTS)}")
    if name == "tensor" and not colocated:
        raise ValueError("actor_rollout_ref.rollout.weight_transport=tensor needs the engines on the actor's GPUs "
                         "(actor_rollout_ref.hybrid_engine=true); disaggregated engines receive weights by "
                         "broadcast: set actor_rollout_ref.rollout.weight_transport=distributed or auto")
    if name == "distributed" and colocated and device == "cuda":
        raise ValueError("actor_rollout_ref.rollout.weight_transport=distributed with the engines on the actor's GPUs "
                         "(actor_rollout_ref.hybrid_engine=true) would put the sending rank and its engine's first TP "
                         "rank on one GPU in one NCCL group, which NCCL refuses: set "
                         "actor_rollout_ref.rollout.weight_transport=tensor or auto (colocated engines get their "
                         "weights by CUDA IPC), or actor_rollout_ref.hybrid_engine=false")
    return name


@dataclasses.dataclass(kw_only=True)
class ValKwargs:
    """Validation sampling (``actor_rollout_ref.rollout.val_kwargs.*``)."""

    n: int = 1
    """Samples per validation prompt (verl's ``val_kwargs.n``): with more than one, validation reports verl's
    ``mean@N``, ``best@k``, ``worst@k`` and ``maj@k`` per data source. Needs ``do_sample``."""

    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """-1 disables top-k."""
    do_sample: bool = False
    """False means greedy whatever the temperature."""

    def __post_init__(self) -> None:
        check_sampling("actor_rollout_ref.rollout.val_kwargs", self.temperature, self.top_p, self.top_k)
        check_positive("actor_rollout_ref.rollout.val_kwargs.n", self.n)
        if self.n > 1 and (not self.do_sample or self.temperature == 0):
            raise ValueError(f"actor_rollout_ref.rollout.val_kwargs.n={self.n} with greedy validation gives {self.n} "
                             f"copies of one response: set val_kwargs.do_sample=true and val_kwargs.temperature > 0, "
                             f"or val_kwargs.n=1")


TRUNCATE_SIDES = ("left", "right", "middle")
"""``multi_turn.tool_response_truncate_side`` choices."""


@dataclasses.dataclass(kw_only=True)
class MultiTurnConfig:
    """Request-level multi-turn rollouts with tools (``actor_rollout_ref.rollout.multi_turn.*``)."""

    enable: bool = False
    """Roll out through the agent loop (tools, interactions); needs ``data.return_raw_chat``."""
    max_turns: int = 5
    """Assistant generations per request."""
    max_user_turns: int | None = None
    """Tool-response turns plus interaction replies per request; None: no limit."""
    tool_config_path: str | None = None
    """YAML listing the tools (e.g. ``configs/tools/gsm8k_tool_config.yaml``); None: no tools."""
    interaction_config_path: str | None = None
    """YAML listing the interactions (simulated users); None: none."""
    format: str = "hermes"
    """Tool-call format of the model: the name of one of SGLang's function-call parsers (its
    ``--tool-call-parser``), e.g. ``hermes``, ``qwen25``, ``qwen3_coder``, ``llama3``, ``mistral``, ``deepseekv3``,
    ``glm45``, ``kimi_k2``, ``gpt-oss``, ``pythonic`` (:func:`tool_call_formats` lists them)."""
    tool_timeout_s: float | None = 30.0
    """Limit of every tool and interaction hook call (create, execute, calc_reward, release, ...): an ``execute``
    that takes longer answers the model with a timeout error, any other hook fails its request; each expiry is
    counted (``multi_turn/num_timeouts/<hook>``). None: no limit."""
    tokenization_sanity_check: str = "warn"
    """``strict``, ``warn`` or ``off``: compare incremental tokenization with a full re-tokenization."""
    max_tool_response_length: int = 256
    """Characters of a tool's reply kept in the conversation (verl's key and default); a longer reply is cut
    as ``tool_response_truncate_side`` says, marked ``...(truncated)`` and counted
    (``multi_turn/num_tool_responses_truncated``)."""
    tool_response_truncate_side: str = "middle"
    """What a cut keeps of a long reply: ``left`` (its start), ``right`` (its end) or ``middle`` (both ends)."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout.multi_turn"
        check_positive(f"{p}.max_tool_response_length", self.max_tool_response_length)
        check_choice(f"{p}.tool_response_truncate_side", self.tool_response_truncate_side, TRUNCATE_SIDES)
        check_positive(f"{p}.max_turns", self.max_turns)
        formats = tool_call_formats()
        if formats is not None:
            check_choice(f"{p}.format", self.format, formats)
        elif self.enable:
            raise ValueError(f"{p}.enable=true parses tool calls with SGLang's function-call parsers, and sglang is "
                             f"not installed: {TOOL_PARSER_INSTALL}")
        check_choice(f"{p}.tokenization_sanity_check", self.tokenization_sanity_check, SANITY_CHECK_MODES)
        check_positive(f"{p}.tool_timeout_s", self.tool_timeout_s, allow_none=True)
        if self.max_user_turns is not None and self.max_user_turns < 0:
            raise ValueError(f"{p}.max_user_turns must be >= 0 or null, got {self.max_user_turns}")


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    """The engine servers of a set of engines behind one sglang-router: the policy's rollout engines
    (:class:`RolloutConfig`) and a generative judge's (:class:`megarl.config.judge.JudgeRolloutConfig`). ``KEY``: the
    section's key, which its errors name."""

    KEY: ClassVar[str] = "actor_rollout_ref.rollout"
    name: str = "hf"
    """Engine: ``hf`` (HF transformers, one process per engine; CPU or GPU) or ``sglang`` (GPU)."""
    tensor_model_parallel_size: int | None = None
    """GPUs per SGLang engine; None: the actor's ``parallel.tp`` (TP-matched engines). The ``hf`` engine is
    never sharded: leave it null there."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory the engine may take (weights + KV cache)."""
    dtype: str = "bfloat16"
    """Engine weights' dtype."""
    enforce_eager: bool = True
    """SGLang: no CUDA graphs (``disable_cuda_graph``). The ``hf`` engine never captures graphs: leave it true."""
    free_cache_engine: bool = True
    """Release the KV cache after generation so training gets the memory back. SGLang keeps its CUDA graphs across
    release/resume (``cuda_graph`` memory tag), so this goes with ``enforce_eager=false`` too."""
    router_policy: str = "round_robin"
    """sglang-router's policy for generation requests: ``round_robin``, ``cache_aware``, ``power_of_two`` or
    ``random``."""
    engine_startup_timeout_s: float = 600.0
    """How long an engine server may take to answer ``/health`` after it starts (loading the model included)."""
    engine_timeout_s: float = 120.0
    """How long a running engine may go without answering: each control call (weights, memory, pause, reads) gets
    this long, and while a rollout generates every engine is asked for its load (``/v1/loads``) every few seconds;
    one that answers nothing for this long (frozen, hung in a collective) fails the step naming it. An engine
    that answers again sooner goes on."""

    def __post_init__(self) -> None:
        p = self.KEY
        check_choice(f"{p}.router_policy", self.router_policy, ROUTER_POLICIES)
        check_positive(f"{p}.engine_startup_timeout_s", self.engine_startup_timeout_s)
        check_positive(f"{p}.engine_timeout_s", self.engine_timeout_s)
        if self.name in FOREIGN_ENGINES:
            raise ValueError(f"{p}.name={self.name}: {FOREIGN_ENGINES[self.name]}")
        check_choice(f"{p}.name", self.name, ROLLOUT_NAMES)
        check_choice(f"{p}.dtype", self.dtype, DTYPES)
        check_positive(f"{p}.tensor_model_parallel_size", self.tensor_model_parallel_size, allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{p}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclasses.dataclass(kw_only=True)
class RolloutConfig(EngineConfig):
    """Generation engines and sampling (``actor_rollout_ref.rollout.*``)."""

    n: int = 1
    """Samples per prompt in training (GRPO's group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """-1 disables top-k."""
    do_sample: bool = True
    """False means greedy (one sample per prompt); a batch's ``meta["do_sample"]`` overrides it."""
    ignore_eos: bool = False
    """Training samples run past the end-of-sequence token to ``response_length`` (SGLang's ``ignore_eos``;
    generation-bound benchmarks). Validation always stops at it."""
    prompt_length: int | None = None
    """Prompt width ``P``; None: ``data.max_prompt_length``."""
    response_length: int | None = None
    """Response width ``R``; None: ``data.max_response_length``."""
    max_model_len: int | None = None
    """Engine context cap; None: ``P + R``."""
    seed: int | None = None
    """Base seed of the engines' sampling (each call's seed is derived from it and the step); None:
    ``trainer.seed``."""
    calculate_log_probs: bool = True
    """Return the engines' log-probs (mismatch diagnostics and ``actor.tis_cap``)."""
    log_prob_micro_batch_size_per_gpu: int | None = 16
    """Trajectories per forward of the actor's log-prob recompute on one rank."""
    log_prob_use_dynamic_bsz: bool = False
    """Pack the recompute's micro-batches by token count (``log_prob_max_token_len_per_gpu``)."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one recompute micro-batch on one rank, with ``log_prob_use_dynamic_bsz``."""
    engine_layout: str = "per_replica"
    """TP-matched SGLang engines with pipeline parallelism: ``per_replica`` (one engine per actor DP replica,
    on its first TP group) or ``per_tp_group`` (one on every TP group: every GPU generates, each holds the
    whole model at the engine TP)."""
    pool_nodes: list[int] | None = None
    """Disaggregated rollout (with ``hybrid_engine=false``): the engines' own pool, GPUs per node (on cpu:
    worker slots on this machine), e.g. ``[8, 8]``; None: engines share the actor's GPUs."""
    bucket_mb: int = 512
    """Weight sync: MiB of HF tensors per bucket streamed from the actor into the engines."""
    weight_transport: str = "auto"
    """Weight sync (:mod:`megarl.sync`): ``tensor`` (colocated engines open handles to the actor's bucket
    buffers: CUDA IPC / shared memory), ``distributed`` (one broadcast per bucket from the stage that built it:
    NCCL / gloo), or ``auto`` (``tensor`` when colocated, ``distributed`` when ``hybrid_engine=false``)."""
    lora_sync: str = "adapters"
    """Weight sync of a LoRA run (``actor_rollout_ref.model.lora_rank`` > 0): ``adapters`` (the adapters alone,
    loaded into engines serving LoRA, SGLang's ``--enable-lora``, by ``/load_lora_adapter_from_tensors``; every
    request names the adapter; every tensor's checksum checked by every engine rank) or ``merged`` (the base
    plus scaled ``B A`` through ``weight_transport``, into engines without LoRA)."""
    verify_weights: int = 8
    """Weight sync: tensors read back from every engine (``/get_weights_by_name``) and compared bit for bit with
    the trainer's after every sync (a seeded sample, plus the last tensor; each whole up to 1 M values, a larger
    one by its leading rows up to that); -1: all of them, 0: off."""
    val_kwargs: ValKwargs = dataclasses.field(default_factory=ValKwargs)
    """Validation sampling."""
    multi_turn: MultiTurnConfig = dataclasses.field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools."""
    quantization: str | None = None
    """``fp8``: the engines serve the policy in block FP8 (SGLang's FP8 linear layers; megarl's CPU engine computes
    with the dequantized weights): they start from an FP8 checkpoint written from ``model.path`` and every weight sync
    sends the linear weights quantized (:mod:`megarl.models.fp8`), verified on the quantized bits. null: the engines'
    ``dtype``."""
    max_failed_frac: float = 0.5
    """A training step or validation round in which more than this share of the rollouts FAILED (finish reason
    ``abort``: an overlong prompt, a tool's set-up or reward error or time-out, an engine abort) stops the run,
    naming the most common reasons. Below it, failed rollouts train with an all-zero loss mask. 1.0: never stop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        p = self.KEY
        if not 0 <= self.max_failed_frac <= 1:
            raise ValueError(f"{p}.max_failed_frac must be in [0, 1], got {self.max_failed_frac}")
        check_positive(f"{p}.n", self.n)
        if self.quantization is not None:
            check_choice(f"{p}.quantization", self.quantization, QUANTIZATIONS)
        check_sampling(p, self.temperature, self.top_p, self.top_k)
        for key in ("prompt_length", "response_length", "max_model_len"):
            check_positive(f"{p}.{key}", getattr(self, key), allow_none=True)
        check_positive(f"{p}.bucket_mb", self.bucket_mb)
        check_choice(f"{p}.weight_transport", self.weight_transport, WEIGHT_TRANSPORTS)
        check_choice(f"{p}.lora_sync", self.lora_sync, LORA_SYNCS)
        check_choice(f"{p}.engine_layout", self.engine_layout, ENGINE_LAYOUTS)
        if self.pool_nodes is not None and (not self.pool_nodes or any(n < 1 for n in self.pool_nodes)):
            raise ValueError(f"{p}.pool_nodes={self.pool_nodes} must list a positive number per node, e.g. [8]")
        if self.verify_weights < -1:
            raise ValueError(f"{p}.verify_weights must be -1 (all), 0 (off) or a count, got {self.verify_weights}")
        check_micro_batches(f"{p}.log_prob", self.log_prob_micro_batch_size_per_gpu, self.log_prob_use_dynamic_bsz,
                            self.log_prob_max_token_len_per_gpu)
        if self.max_model_len is not None and self.prompt_length is not None and \
                self.max_model_len <= self.prompt_length:
            raise ValueError(f"{p}.max_model_len={self.max_model_len} leaves no room for a response after "
                             f"{p}.prompt_length={self.prompt_length}: raise it or leave it null")
