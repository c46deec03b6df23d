"""Chat messages and the tokenizer's chat template: checking, rendering, encoding.

A prompt is a list of chat messages, each a dict with a ``role`` and a ``content`` string, or a list of
content parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``: a vision-language model's prompt;
tool-calling messages may carry more keys, e.g. ``tool_calls``). Rendering applies the
tokenizer's own chat template with the generation prompt; encoding tokenises the rendered text
without adding special tokens again (the template already placed them), as verl does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def row_tool_names(configured: Sequence[str], tools_kwargs: Mapping[str, Any] | None) -> list[str]:
    """The tools a row's conversation is given: those its ``tools_kwargs`` names, or every configured tool
    when it names none (in the order of ``configured``). The agent loop shows their schemas to the model, and
    the prompt-length filter counts them."""
    if not tools_kwargs:
        return list(configured)
    return [name for name in configured if name in tools_kwargs]


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` as a list of message dicts, or ``ValueError`` naming ``where`` and the fault.

    Keys whose value is ``None`` are dropped from each message: parquet stores a list of
    messages as a list of structs with the union of all keys, filling absent ones with nulls,
    and chat templates test for a key's presence (``tool_calls``), not its value.
    """
    if isinstance(messages, str) or not isinstance(messages, Sequence):
        raise ValueError(f"{where}: the prompt must be a list of chat messages {{'role', 'content'}}, got "
                         f"{type(messages).__name__}; wrap plain text as [{{'role': 'user', 'content': text}}]")
    if len(messages) == 0:
        raise ValueError(f"{where}: the prompt has no messages")
    checked = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: message {position} is a {type(message).__name__}, not a dict with "
                             f"'role' and 'content'")
        message = {key: value for key, value in message.items() if value is not None}
        if not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {position} has no string 'role' (keys {sorted(message)})")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: text, and images for a vision-language model
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                    raise ValueError(f"{where}: message {position} ({message['role']}) has a content part "
                                     f"{part!r}; parts are {{'type': 'text', 'text': ...}} or {{'type': 'image'}}")
        elif not isinstance(content, str):
            raise ValueError(f"{where}: message {position} ({message['role']}) has 'content' of type "
                             f"{type(content).__name__}; give a string or a list of text and image parts")
        checked.append(message)
    return checked


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                  **template_kwargs: Any) -> str:
    """The prompt text: the tokenizer's chat template applied to ``messages``.

    ``template_kwargs`` go to ``apply_chat_template`` (e.g. ``tools=[schema, ...]``,
    ``enable_thinking=False``).
    """
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; set "
                         f"`tokenizer.chat_template` (a Jinja string) or use an instruct model's tokenizer")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)


def encode_prompt(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of rendered prompt text, without adding special tokens a second time (``add_special_tokens``:
    with the tokenizer's own, e.g. a BOS, for text no chat template rendered)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_prompts(tokenizer: Any, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
    """Token ids of many prompts in one (fast, batched) tokenizer call (``add_special_tokens``: as
    :func:`encode_prompt`)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
