"""A tiny Qwen2-architecture model (or a tiny Qwen3-MoE) and its tokenizer, built by project code (no model hub).

The tokenizer is a byte-level BPE trained, deterministically, on a small built-in corpus
(arithmetic, English, JSON for tool calls), with every digit its own token (``" 82"`` is
``" 8"``, ``"2"``), with Qwen2.5's special tokens and a Qwen2.5-style
chat template that renders tool schemas, ``<tool_call>`` blocks and tool responses. The model
is a randomly initialised ``Qwen2ForCausalLM`` sized for CPU tests and the tiny recipe.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Qwen2.5's chat template, reduced to what megarl uses: system/user/assistant/tool turns, tool
# schemas in the system turn, structured tool calls, tool responses grouped in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus() -> list[str]:
    lines = [f"What is {a} + {b}? The answer is {a + b}." for a in range(0, 100, 7) for b in range(3, 100, 11)]
    lines += [f"#### {n}" for n in range(0, 200, 3)]
    lines += [
        "You are a helpful assistant. Solve the question step by step.",
        "Let's think step by step and output the final answer after ####.",
        'Reason step by step before any tool call. {"name": "calc_gsm8k_reward", "arguments": {"answer": "42"}}',
        "Current parsed answer=42 reward=1.0 The quick brown fox jumps over the lazy dog.",
        "system user assistant tool function arguments name description parameters type object string",
    ]
    return lines


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer that splits digits, with Qwen2.5's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    # Digits are split into single tokens before the byte-level step, so every number is spelled
    # digit by digit: with merged multi-digit tokens the tiny model learns 2-digit addition far
    # more slowly (12 % greedy accuracy after 600 SFT steps, against 85 % with split digits).
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def _dense_config(config_class, architecture: str, tokenizer, *, hidden_size: int, num_layers: int, num_heads: int,
                  num_kv_heads: int, intermediate_size: int, max_position_embeddings: int, **fields):
    """A dense decoder's config for ``tokenizer`` (vocabulary, special ids) with these sizes and ``fields``."""
    return config_class(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        max_position_embeddings=max_position_embeddings, bos_token_id=None,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        architectures=[architecture], **fields)


def tiny_qwen2_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 512):
    """A Qwen2 config for ``tokenizer`` (vocabulary, special ids), tied embeddings."""
    from transformers import Qwen2Config

    return _dense_config(Qwen2Config, "Qwen2ForCausalLM", tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=True)


def tiny_llama_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 512,
                      tie_word_embeddings: bool = True):
    """A Llama config for ``tokenizer`` (no biases, GQA): the family whose SGLang model reads weights back."""
    from transformers import LlamaConfig

    return _dense_config(LlamaConfig, "LlamaForCausalLM", tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=tie_word_embeddings)


def tiny_qwen3_moe_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, head_dim: int = 16, moe_intermediate_size: int = 64,
                          num_experts: int = 4, num_experts_per_tok: int = 2, max_position_embeddings: int = 512):
    """A Qwen3-MoE config for ``tokenizer``: every layer sparse (``num_experts`` experts, top-``num_experts_per_tok``,
    renormalised weights as Qwen3-30B-A3B), untied embeddings."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * moe_intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3MoeForCausalLM"],
    )


def tiny_deepseek_v3_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                            moe_intermediate_size: int = 32, num_experts: int = 8, num_experts_per_tok: int = 2,
                            max_position_embeddings: int = 512):
    """A DeepSeek-V3 config for ``tokenizer``: multi-latent attention (low-rank queries and keys/values, a decoupled
    rotary part, YaRN), the first layer dense, then ``num_experts`` experts in 2 groups (top-``num_experts_per_tok``
    from the best group, sigmoid scores with a bias, scaled by 2.5) and one shared expert; untied embeddings."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * moe_intermediate_size,
        moe_intermediate_size=moe_intermediate_size, n_routed_experts=num_experts, n_shared_experts=1,
        num_experts_per_tok=num_experts_per_tok, n_group=2, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": max_position_embeddings // 4, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=["DeepseekV3ForCausalLM"],
    )


def tiny_qwen3_5_moe_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                            num_kv_heads: int = 2, head_dim: int = 16, moe_intermediate_size: int = 32,
                            num_experts: int = 8, num_experts_per_tok: int = 2, max_position_embeddings: int = 512):
    """A Qwen3.5-MoE text config for ``tokenizer`` (Qwen3.5-35B-A3B's shape, scaled down): Gated DeltaNet linear
    attention in three of every four layers and gated full attention in the fourth, ``num_experts`` experts
    (top-``num_experts_per_tok``, softmax, renormalised) beside a gated shared expert in every layer, zero-centred
    norms, rotary on a quarter of each head; untied embeddings."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        linear_conv_kernel_dim=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        linear_num_key_heads=num_kv_heads, linear_num_value_heads=2 * num_kv_heads,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        moe_intermediate_size=moe_intermediate_size, shared_expert_intermediate_size=moe_intermediate_size,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3_5MoeForCausalLM"],
    )


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen2.5-VL's vision special tokens: an image is ``<|vision_start|>``, one ``<|image_pad|>`` per merged patch,
``<|vision_end|>``."""


# The chat template with content parts (Qwen2.5-VL's): an image part is <|vision_start|><|image_pad|><|vision_end|>.
_RENDER_CONTENT = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
VL_CHAT_TEMPLATE = _RENDER_CONTENT + (
    CHAT_TEMPLATE.replace("messages[0].content", "render(messages[0].content)")
    .replace("+ message.content", "+ render(message.content)")
    .replace("message.content +", "render(message.content) +")
)


def build_tiny_vl_tokenizer(vocab_size: int = 512):
    """The tiny tokenizer (:func:`build_tiny_tokenizer`) with Qwen2.5-VL's vision special tokens after its
    vocabulary, and a chat template that renders image parts."""
    tokenizer = build_tiny_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:] + VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def tiny_image_processor(*, patch_size: int = 14, max_patches: int = 64):
    """Qwen2-VL's image processor (transformers' PIL backend) for the tiny vision tower: ``patch_size`` pixels per
    patch, 2 × 2 merging, at most ``max_patches`` patches per image (images are resized to whole merged patches
    within that)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    unit = (2 * patch_size) ** 2
    return Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": unit, "longest_edge": unit * max_patches // 4})


def _mrope_section(head_dim: int) -> list[int]:
    """Rotary frequencies per axis (temporal, height, width) for a tiny head: an eighth, three sixteenths, the rest."""
    return [head_dim // 8, 3 * head_dim // 16, head_dim // 2 - head_dim // 8 - 3 * head_dim // 16]


def _vision_token_ids(tokenizer) -> dict[str, int]:
    """The vision special tokens' ids in ``tokenizer`` (:func:`build_tiny_vl_tokenizer`), as configs name them."""
    token = tokenizer.convert_tokens_to_ids
    return {"image_token_id": token("<|image_pad|>"), "video_token_id": token("<|video_pad|>"),
            "vision_start_token_id": token("<|vision_start|>"), "vision_end_token_id": token("<|vision_end|>")}


def tiny_qwen2_5_vl_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                           num_kv_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 512,
                           vision_depth: int = 2, vision_hidden: int = 32, patch_size: int = 14,
                           tie_word_embeddings: bool = True, initializer_range: float = 0.02):
    """A Qwen2.5-VL config for ``tokenizer`` (:func:`build_tiny_vl_tokenizer`): a tiny Qwen2 language model with
    multimodal RoPE (head dimension 16: sections 2, 3, 3) and a tiny vision tower (``vision_depth`` blocks, the
    last with full attention, the others windowed; 2 × 2 patch merging, two frames per temporal patch).
    ``initializer_range``: the random weights' scale (larger: a random model's greedy outputs vary)."""
    from transformers import Qwen2_5_VLConfig

    section = _mrope_section(hidden_size // num_heads)
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section},
            initializer_range=initializer_range,
        ),
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
            out_hidden_size=hidden_size, patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2,
            window_size=4 * patch_size, fullatt_block_indexes=[vision_depth - 1], initializer_range=initializer_range,
        ),
        **_vision_token_ids(tokenizer), tie_word_embeddings=tie_word_embeddings,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )


def tiny_qwen3_vl_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                         num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                         max_position_embeddings: int = 512, vision_depth: int = 3, vision_hidden: int = 32,
                         patch_size: int = 16, deepstack: tuple[int, ...] = (0, 1), tie_word_embeddings: bool = True,
                         initializer_range: float = 0.02):
    """A Qwen3-VL config for ``tokenizer`` (:func:`build_tiny_vl_tokenizer`): a tiny Qwen3 language model (q/k norms)
    with interleaved multimodal RoPE, and a tiny vision tower (``vision_depth`` blocks, learned position embeddings
    on an 8 × 8 grid, DeepStack features of blocks ``deepstack`` into the first ``len(deepstack)`` layers)."""
    from transformers import Qwen3VLConfig

    section = _mrope_section(head_dim)
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
            bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section,
                             "mrope_interleaved": True},
            initializer_range=initializer_range,
        ),
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
            out_hidden_size=hidden_size, patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2,
            deepstack_visual_indexes=list(deepstack), num_position_embeddings=64, initializer_range=initializer_range,
        ),
        **_vision_token_ids(tokenizer), tie_word_embeddings=tie_word_embeddings,
        architectures=["Qwen3VLForConditionalGeneration"],
    )


TINY_ARCHS = {"qwen2": tiny_qwen2_config, "llama": tiny_llama_config, "qwen3_moe": tiny_qwen3_moe_config,
              "deepseek_v3": tiny_deepseek_v3_config, "qwen3_5_moe": tiny_qwen3_5_moe_config,
              "qwen2_5_vl": tiny_qwen2_5_vl_config}
"""The tiny models megarl builds, by ``actor_rollout_ref.model.tiny_arch`` name: their config functions."""


def build_tiny_model(tokenizer, *, seed: int = 0, arch: str = "qwen2", **sizes):
    """A randomly initialised tiny model of architecture ``arch`` (:data:`TINY_ARCHS`) in fp32."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny model architecture {arch!r} is unknown; use one of {sorted(TINY_ARCHS)}")
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch in VISION_ARCHS else AutoModelForCausalLM
    return auto.from_config(TINY_ARCHS[arch](tokenizer, **sizes)).float().eval()


VISION_ARCHS = ("qwen2_5_vl",)
"""The tiny architectures that read images (their tokenizer: :func:`build_tiny_vl_tokenizer`; their image
processor: :func:`tiny_image_processor`)."""


def tiny_tokenizer(arch: str):
    """The tokenizer of the tiny architecture ``arch``."""
    return build_tiny_vl_tokenizer() if arch in VISION_ARCHS else build_tiny_tokenizer()


def save_tiny_vl(directory: str | os.PathLike, *, seed: int = 0, arch: str = "qwen2_5_vl", **sizes) -> Path:
    """Write a tiny random Qwen2.5-VL (``arch="qwen3_vl"``: Qwen3-VL) in fp32, its tokenizer and its image processor
    as an HF directory."""
    from transformers import AutoModelForImageTextToText

    directory = Path(directory)
    tokenizer = build_tiny_vl_tokenizer()
    torch.manual_seed(seed)
    config = (tiny_qwen3_vl_config if arch == "qwen3_vl" else tiny_qwen2_5_vl_config)(tokenizer, **sizes)
    model = AutoModelForImageTextToText.from_config(config).float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    tiny_image_processor(patch_size=model.config.vision_config.patch_size).save_pretrained(directory)
    return directory


def save_tiny(directory: str | os.PathLike, *, seed: int = 0, arch: str = "qwen2", **sizes) -> Path:
    """Write a tiny model and its tokenizer as an HF directory (config, safetensors, tokenizer)."""
    directory = Path(directory)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, arch=arch, **sizes)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
