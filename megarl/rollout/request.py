"""One multi-turn rollout request: its messages, its token sequence built turn by turn, its state.

An :class:`AsyncRolloutRequest` holds a conversation and the token ids the engine sees,
grown incrementally:

- ``initialize`` renders the prompt messages (with the request's tool schemas) through the
  tokenizer's chat template, with the assistant generation prompt: the *prompt* part;
- ``add_assistant_message`` appends one generated turn: the generation prompt of that turn
  (except the first, whose generation prompt ends the prompt), the engine's output ids *as
  generated*, and the template's end-of-turn text (``"\\n"`` after ``<|im_end|>`` for Qwen);
- ``add_tool_response_messages`` / ``add_user_message`` append what the template renders for
  tool results (Qwen: a user turn of ``<tool_response>`` blocks) or a simulated user turn.

Every appended piece is the *difference* between the template's rendering of the whole
conversation after and before the new messages, so scaffolding (role headers, tags, newlines)
is exactly the template's; ``finalize`` checks that the incremental ids equal the tokenised
rendering of all messages (the tokenization sanity check).

Loss mask: 1 on tokens the engine generated (assistant text, its tool calls and its stop
token), 0 on the prompt, generation prompts, end-of-turn scaffolding, tool responses and user
turns. Attention mask is 1 everywhere (padding is added only when batching); position ids are
``0..len-1``.

The assistant message stored in ``messages`` is structured (``content`` plus ``tool_calls``)
when the template renders that structure back to exactly the generated text; otherwise (the
model wrote its JSON differently from the template, put text after a call, or wrote a broken
call) the generated text is kept verbatim as ``content``, which the template renders back as
is. Either way the messages re-render to the generated tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from megarl.config.rollout import SANITY_CHECK_MODES
from megarl.data.chat import encode_prompt, render_prompt
from megarl.rollout.tool_parser import ToolCall, ToolCallError

logger = logging.getLogger(__name__)

_SENTINEL = "\x00megarl-content\x00"  # stands for an assistant message's content when measuring the template


def output_text(tokenizer: Any, output_ids: Sequence[int]) -> str:
    """The text of generated ids without a final EOS token (special tokens such as ``<tool_call>`` kept)."""
    ids = list(output_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class RequestState(str, enum.Enum):
    """Where a request is in its loop (the agent loop's states, plus INTERACTING)."""

    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    INTERACTING = "interacting"
    COMPLETED = "completed"
    FAILED = "failed"


class FinishReasonType(str, enum.Enum):
    """Why a request's conversation ended (the ``finish_reason`` batch field)."""

    STOP = "stop"
    """The model ended its turn without a tool call, or the interaction ended the conversation."""
    LENGTH = "length"
    """The response budget (``response_length``) or ``max_model_len`` ran out; outputs are truncated."""
    MAX_TURNS = "max_turns"
    """A turn limit (``max_turns`` / ``max_user_turns``) stopped a conversation that wanted to go on."""
    ABORT = "abort"
    """The request FAILED (engine abort, tool set-up or reward error, overlong prompt...)."""


@dataclasses.dataclass
class Message:
    """A chat message; ``tool_calls`` only on assistant messages with structured calls."""

    role: str
    content: str | list[dict[str, Any]]
    """Text, or content parts (``{"type": "image"}`` / ``{"type": "text", "text"}``: a message with images)."""
    tool_calls: list[ToolCall] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other keys of a prompt message (e.g. ``name``), passed to the template unchanged."""

    @classmethod
    def from_dict(cls, message: Mapping[str, Any]) -> Message:
        """A prompt message ``{role, content, [tool_calls], ...}`` (OpenAI form)."""
        calls = message.get("tool_calls")
        parsed = None
        if calls:
            parsed = [ToolCall(name=c["function"]["name"], arguments=c["function"]["arguments"], index=i)
                      for i, c in enumerate(calls)]
        extra = {k: v for k, v in message.items() if k not in ("role", "content", "tool_calls")}
        return cls(role=message["role"], content=message.get("content", ""), tool_calls=parsed, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The message as the chat template (and the ``messages`` batch field) takes it."""
        out = {"role": self.role, "content": self.content, **self.extra}
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return out


@dataclasses.dataclass(kw_only=True)
class AsyncRolloutRequest:
    """One trajectory of one prompt: conversation, incremental tokens and masks, state, results."""

    batch_data_id: int
    """Row of the prompt in the input batch."""
    rollout_offset: int
    """Which of the ``n`` samples of that prompt (0..n-1)."""
    messages: list[Message]
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    """Also the instance id of this request's tools and interaction."""
    index: Any = None
    """The dataset's ``index`` of the prompt row (carried along)."""
    state: RequestState = RequestState.PENDING
    tools_kwargs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """``{tool_name: {create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs}}`` of the row."""
    interaction_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    tool_schemas: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """OpenAI function schemas shown to the model (``tools=`` of the chat template)."""

    input_ids: list[int] = dataclasses.field(default_factory=list)
    attention_mask: list[int] = dataclasses.field(default_factory=list)
    position_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    response_log_probs: list[float] | None = dataclasses.field(default_factory=list)
    """One per response token: the engine's log-prob on generated tokens, 0 elsewhere; None
    once any turn came back without log-probs."""
    prompt_len: int = 0
    """Number of prompt tokens (the first ``prompt_len`` entries of every sequence)."""
    max_prompt_len: int = 0
    max_response_len: int = 0
    max_model_len: int = 0

    finish_reason: FinishReasonType | None = None
    reward_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    """Final reward per tool (``calc_reward``) and per interaction (``calculate_score``)."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Numeric counters (turns, tool calls, each kind of tool error, truncation, mismatch...)."""
    tool_metrics: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    """Per tool, one dict per executed call: ``step_reward`` plus the tool's own metrics."""
    interaction_scores: list[float] = dataclasses.field(default_factory=list)
    """Score of every interaction reply, in order."""
    error: str | None = None
    """Why the request FAILED."""
    instance_ids: dict[str, str] = dataclasses.field(default_factory=dict)
    """Tool or interaction name -> the instance id its ``create`` / ``start_interaction`` returned."""
    pending_tool_calls: list[ToolCall | ToolCallError] = dataclasses.field(default_factory=list)
    """The call blocks of the last assistant turn (well-formed or not), in order, awaiting responses."""

    num_assistant_turns: int = 0
    num_user_turns: int = 0
    """Tool-response turns plus interaction (simulated user) turns."""

    images: list = dataclasses.field(default_factory=list)
    """The conversation's images in order (RGB): the prompt's, then those tools returned."""
    image_inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The model's inputs of those images (``pixel_values``, ``image_grid_thw``), one dict per tokenised chunk."""
    image_processor: Any = None
    """A vision-language policy's :class:`~megarl.data.images.ImageProcessor` (expands each image's placeholder)."""
    image_uris: list[str] = dataclasses.field(default_factory=list)
    """Those images as the engine takes them (base64 PNGs), encoded once each."""

    _text: str = dataclasses.field(default="", init=False, repr=False)
    """The template's rendering of ``messages`` without a generation prompt."""
    _generation_prompt: tuple[int, str] = dataclasses.field(default=(-1, ""), init=False, repr=False)
    """``(len(messages), text)``: the generation prompt last rendered, and for how many messages."""
    _generation_prompt_in_ids: bool = dataclasses.field(default=False, init=False, repr=False)
    """True while the ids end with a generation prompt no assistant turn has answered yet."""
    _cut_turn_start: int | None = dataclasses.field(default=None, init=False, repr=False)
    """Where the output of an assistant turn cut by max_new_tokens starts (None: no cut turn)."""

    # ------------------------------------------------------------------------------ views

    @property
    def prompt_ids(self) -> list[int]:
        """Prompt token ids (prompt messages, tool schemas, first generation prompt)."""
        return self.input_ids[:self.prompt_len]

    @property
    def prompt_attention_mask(self) -> list[int]:
        """Attention mask of the prompt (all 1)."""
        return self.attention_mask[:self.prompt_len]

    @property
    def prompt_position_ids(self) -> list[int]:
        """Position ids of the prompt (0..prompt_len-1)."""
        return self.position_ids[:self.prompt_len]

    @property
    def prompt_loss_mask(self) -> list[int]:
        """Loss mask of the prompt (all 0)."""
        return self.loss_mask[:self.prompt_len]

    @property
    def response_ids(self) -> list[int]:
        """Everything after the prompt: assistant turns, tool responses, user turns, scaffolding."""
        return self.input_ids[self.prompt_len:]

    @property
    def response_attention_mask(self) -> list[int]:
        """Attention mask of the response (all 1; padding comes with batching)."""
        return self.attention_mask[self.prompt_len:]

    @property
    def response_position_ids(self) -> list[int]:
        """Position ids of the response (continuing the prompt's)."""
        return self.position_ids[self.prompt_len:]

    @property
    def response_loss_mask(self) -> list[int]:
        """Loss mask of the response: 1 on generated tokens, 0 elsewhere."""
        return self.loss_mask[self.prompt_len:]

    def message_dicts(self) -> list[dict[str, Any]]:
        """``messages`` as plain dicts (the ``messages`` batch field, interaction input)."""
        return [message.to_dict() for message in self.messages]

    # ------------------------------------------------------------------------------ template

    def _render(self, tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return render_prompt(tokenizer, [m.to_dict() for m in messages], add_generation_prompt=add_generation_prompt,
                             tools=self.tool_schemas or None)

    def _delta(self, tokenizer: Any, new_messages: Sequence[Message]) -> str:
        """What the template adds to ``self._text`` when ``new_messages`` follow."""
        text = self._render(tokenizer, [*self.messages, *new_messages], add_generation_prompt=False)
        if not text.startswith(self._text):
            raise ValueError(f"the chat template renders the earlier turns differently once "
                             f"{[m.role for m in new_messages]} messages follow them, so the conversation cannot "
                             f"be tokenised turn by turn; use a template whose rendering only appends")
        return text[len(self._text):]

    def _generation_prompt_text(self, tokenizer: Any) -> str:
        """What the template appends to the messages so far to open an assistant turn."""
        if self._generation_prompt[0] != len(self.messages):
            text = self._render(tokenizer, self.messages, add_generation_prompt=True)
            if not text.startswith(self._text):
                raise ValueError("the chat template's generation prompt changes the earlier turns; the conversation "
                                 "cannot be tokenised turn by turn")
            self._generation_prompt = (len(self.messages), text[len(self._text):])
        return self._generation_prompt[1]

    def _end_of_turn_text(self, tokenizer: Any) -> str:
        """What the template writes after an assistant message's content (Qwen: ``<|im_end|>\\n``)."""
        rendered = self._delta(tokenizer, [Message("assistant", _SENTINEL)])
        return rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]

    def _encode(self, tokenizer: Any, text: str, images: Sequence = ()) -> list[int]:
        """Token ids of rendered ``text`` whose image placeholders are those of ``images`` (new to the
        conversation): each expanded to its merged patches, their inputs kept for the model."""
        ids = encode_prompt(tokenizer, text)
        if not images:
            return ids
        if self.image_processor is None:
            raise ValueError(f"request {self.request_id} has images but no image processor (a text policy)")
        pixels = self.image_processor.pixels(list(images))
        self.image_inputs.append(pixels)
        return self.image_processor.expand(ids, pixels["image_grid_thw"])

    def vision_inputs(self) -> dict[str, Any] | None:
        """The model's inputs of every image of the conversation (None without images)."""
        from megarl.parallel.pipeline import vision_inputs

        return vision_inputs(self.image_inputs)

    def _append(self, ids: Sequence[int], loss: int, log_probs: Sequence[float] | None = None) -> None:
        """Append response ids with their masks, positions and log-probs (0 where none)."""
        self._extend(ids, loss)
        if self.response_log_probs is not None:
            self.response_log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    def _extend(self, ids: Sequence[int], loss: int) -> None:
        start = len(self.input_ids)
        self.input_ids.extend(ids)
        self.attention_mask.extend([1] * len(ids))
        self.position_ids.extend(range(start, start + len(ids)))
        self.loss_mask.extend([loss] * len(ids))

    # ------------------------------------------------------------------------------ turns

    def fail(self, error: str) -> None:
        """Mark the request FAILED with the reason (it keeps the tokens it has)."""
        self.state = RequestState.FAILED
        self.error = error
        self.metrics["failed"] = 1.0

    def count(self, key: str, amount: float = 1.0) -> None:
        """Add ``amount`` to the counter ``metrics[key]``."""
        self.metrics[key] = self.metrics.get(key, 0.0) + amount

    def initialize(self, tokenizer: Any, *, max_prompt_len: int, max_response_len: int, max_model_len: int) -> None:
        """PENDING -> RUNNING: tokenise the prompt (messages, tool schemas, generation prompt).

        A prompt longer than ``max_prompt_len`` tokens (tool schemas included) is cut to its
        last ``max_prompt_len`` tokens and the request FAILS: the rollout of the other
        requests goes on, and this row keeps a zero loss mask.
        """
        if self.state is not RequestState.PENDING:
            raise ValueError(f"request {self.request_id} is {self.state.value}; only PENDING requests initialize")
        if not self.messages:
            raise ValueError(f"request {self.request_id} (batch row {self.batch_data_id}) has no prompt messages")
        self.max_prompt_len, self.max_response_len, self.max_model_len = max_prompt_len, max_response_len, max_model_len
        self._text = self._render(tokenizer, self.messages, add_generation_prompt=False)
        ids = self._encode(tokenizer, self._text + self._generation_prompt_text(tokenizer), self.images)
        self.prompt_len = min(len(ids), max_prompt_len)
        self._extend(ids[len(ids) - self.prompt_len:], loss=0)
        self._generation_prompt_in_ids = True
        self.state = RequestState.RUNNING
        if len(ids) > max_prompt_len:
            self.count("prompt_truncated")
            self.fail(f"the prompt has {len(ids)} tokens (tool schemas included), more than prompt_length="
                      f"{max_prompt_len}; raise the prompt length or filter such prompts (with the same tools)")

    def pending_generation_prompt_ids(self, tokenizer: Any) -> list[int]:
        """The generation-prompt ids the next assistant turn needs before its output ([] on turn 1)."""
        if self._generation_prompt_in_ids:
            return []
        return encode_prompt(tokenizer, self._generation_prompt_text(tokenizer))

    def generation_prompt_ids(self, tokenizer: Any) -> list[int]:
        """The ids to send to the engine: the sequence plus the pending generation prompt."""
        return self.input_ids + self.pending_generation_prompt_ids(tokenizer)

    def max_new_tokens(self, tokenizer: Any) -> int:
        """How many tokens the next assistant turn may generate (<= 0: the budget is spent).

        The response (everything after the prompt, this turn's generation prompt included)
        must fit ``max_response_len`` and the whole sequence ``max_model_len``.
        """
        pending = len(self.pending_generation_prompt_ids(tokenizer))
        response_room = self.max_response_len - (len(self.input_ids) - self.prompt_len) - pending
        model_room = self.max_model_len - len(self.input_ids) - pending
        return min(response_room, model_room)

    def add_assistant_message(self, tokenizer: Any, output_ids: Sequence[int], *,
                              log_probs: Sequence[float] | None = None, complete: bool = True,
                              content: str | None = None, tool_calls: list[ToolCall] | None = None) -> Message:
        """Append one generated turn; return the message stored for it.

        Args:
            output_ids: the engine's output, as generated (loss mask 1).
            log_probs: the engine's log-prob per output id, or None.
            complete: the turn ended with a stop token; False when ``max_new_tokens`` cut it
                (then no end-of-turn text is appended: the conversation ends there).
            content, tool_calls: the parsed turn (normal text and calls). Kept only if the
                template renders them back to exactly the generated text; otherwise the
                generated text becomes the content.
        """
        if log_probs is not None and len(log_probs) != len(output_ids):
            raise ValueError(f"the engine returned {len(log_probs)} log-probs for {len(output_ids)} output ids")
        generation_prompt = self._generation_prompt_text(tokenizer)
        generation_prompt_ids = self.pending_generation_prompt_ids(tokenizer)
        generated = tokenizer.decode(list(output_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        eos = tokenizer.eos_token
        ends_with_eos = bool(output_ids) and output_ids[-1] == tokenizer.eos_token_id
        body = output_text(tokenizer, output_ids)
        tail = ""
        if complete:
            tail = self._end_of_turn_text(tokenizer)
            if ends_with_eos and tail.startswith(eos):
                tail = tail[len(eos):]
        expected = generation_prompt + generated + tail
        candidates = [Message("assistant", body)]
        if tool_calls or content is not None:
            candidates.insert(0, Message("assistant", body if content is None else content, tool_calls or None))
        chosen, chosen_delta = candidates[-1], None
        for candidate in candidates:
            delta = self._delta(tokenizer, [candidate])
            if delta == expected or (not complete and delta.startswith(expected)):
                chosen, chosen_delta = candidate, delta
                break
        if chosen_delta is None:
            chosen_delta = self._delta(tokenizer, [chosen])
            self.count("template_mismatch_turns")
        self._append(generation_prompt_ids, loss=0)
        self._cut_turn_start = None if complete else len(self.input_ids)
        self._append(list(output_ids), loss=1, log_probs=None if log_probs is None else list(log_probs))
        if log_probs is None:
            self.response_log_probs = None
        self._append(encode_prompt(tokenizer, tail) if tail else [], loss=0)
        self.messages.append(chosen)
        self._text += chosen_delta
        self._generation_prompt_in_ids = False
        self.num_assistant_turns += 1
        return chosen

    def _add_messages(self, tokenizer: Any, new_messages: list[Message], images: Sequence = ()) -> None:
        """Append non-model messages (loss mask 0) with the template's scaffolding."""
        if self._generation_prompt_in_ids:
            raise ValueError(f"request {self.request_id}: {new_messages[0].role} messages cannot follow an "
                             f"unanswered generation prompt; add the assistant turn first")
        delta = self._delta(tokenizer, new_messages)
        self._append(self._encode(tokenizer, delta, images), loss=0)
        self.messages.extend(new_messages)
        self.images.extend(images)
        self._text += delta
        self.num_user_turns += 1

    def add_tool_response_messages(self, tokenizer: Any, contents: Sequence[str | tuple[str, list]]) -> None:
        """Append one ``tool`` message per call of the last turn, in call order (loss mask 0); a content
        ``(text, images)`` puts the images (RGB) before the text, as content parts."""
        if not contents:
            raise ValueError(f"request {self.request_id}: add_tool_response_messages needs at least one response")
        messages, images = [], []
        for content in contents:
            text, shown = content if isinstance(content, tuple) else (str(content), [])
            parts = [{"type": "image"} for _ in shown] + [{"type": "text", "text": text}]
            messages.append(Message("tool", parts if shown else text))
            images.extend(shown)
        self._add_messages(tokenizer, messages, images)

    def add_user_message(self, tokenizer: Any, content: str) -> None:
        """Append a (simulated) user turn from an interaction (loss mask 0)."""
        self._add_messages(tokenizer, [Message("user", content)])

    # ------------------------------------------------------------------------------ end

    def check_tokenization(self, tokenizer: Any) -> int | None:
        """The first position where the ids differ from tokenising all messages at once, or None.

        The reference is the chat template applied to ``messages`` (with the tool schemas, and
        the generation prompt while no assistant turn has answered it). When the last turn was
        cut by ``max_new_tokens``, only the ids before its output are compared: the template
        closes the cut turn (``<|im_end|>``), and the model's partial last word need not be
        the tokenizer's own split of that text.
        """
        text = self._render(tokenizer, self.messages, add_generation_prompt=self._generation_prompt_in_ids)
        reference = encode_prompt(tokenizer, text)
        if self.images:
            reference = self.image_processor.expand(reference, self.vision_inputs()["image_grid_thw"])
        ids = self.input_ids
        if self._cut_turn_start is not None:
            ids, reference = ids[:self._cut_turn_start], reference[:self._cut_turn_start]
        for position, (mine, theirs) in enumerate(zip(ids, reference, strict=False)):
            if mine != theirs:
                return position
        return None if len(ids) == len(reference) else min(len(ids), len(reference))

    def finalize(self, tokenizer: Any, *, finish_reason: FinishReasonType,
                 reward_scores: Mapping[str, float] | None = None, sanity_check: str = "warn") -> None:
        """Store the outcome, run the tokenization sanity check, truncate, and complete.

        Truncation: the response is cut to ``max_response_len`` tokens and the whole sequence
        to ``max_model_len`` (the budget can run out inside a tool response, whose tokens are
        appended whole). ``sanity_check`` is one of :data:`SANITY_CHECK_MODES`; under
        ``strict`` a mismatch FAILS the request.
        """
        if sanity_check not in SANITY_CHECK_MODES:
            raise ValueError(f"tokenization_sanity_check={sanity_check!r} is unknown; use one of {SANITY_CHECK_MODES}")
        self.finish_reason = finish_reason
        self.reward_scores.update(reward_scores or {})
        if self.state is not RequestState.FAILED and sanity_check != "off":
            position = self.check_tokenization(tokenizer)
            if position is not None:
                self.count("tokenization_mismatch")
                message = (f"request {self.request_id} (batch row {self.batch_data_id}): the turn-by-turn token ids "
                           f"differ from tokenising the whole conversation with the chat template at position "
                           f"{position} (tokens {self.input_ids[position:position + 8]})")
                if sanity_check == "strict":
                    self.fail(message)
                else:
                    logger.warning(message)
        self._truncate()
        self.metrics["num_assistant_turns"] = float(self.num_assistant_turns)
        self.metrics["num_user_turns"] = float(self.num_user_turns)
        if self.state is RequestState.FAILED:
            self.finish_reason = FinishReasonType.ABORT
        else:
            self.state = RequestState.COMPLETED

    def _truncate(self) -> None:
        limit = min(self.prompt_len + self.max_response_len, self.max_model_len)
        if len(self.input_ids) <= limit:
            return
        if self.images:  # never inside an image: cut before it (and its vision-start token), and drop the images after
            runs = self.image_processor.image_runs(self.input_ids)
            kept = sum(1 for _, end in runs if end <= limit)
            if kept < len(runs):
                limit = min(limit, runs[kept][0] - 1)
                self._keep_images(kept)
        self.count("response_truncated")
        del self.input_ids[limit:], self.attention_mask[limit:], self.position_ids[limit:], self.loss_mask[limit:]
        if self.response_log_probs is not None:
            del self.response_log_probs[limit - self.prompt_len:]

    def _keep_images(self, count: int) -> None:
        """Keep the conversation's first ``count`` images (their inputs too)."""
        inputs = self.vision_inputs()
        grids = inputs["image_grid_thw"][:count]
        del self.images[count:]
        self.image_inputs = [] if count == 0 else [{"pixel_values": inputs["pixel_values"][:int(grids.prod(-1).sum())],
                                                    "image_grid_thw": grids}]
