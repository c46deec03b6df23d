"""A batch of prompts into multi-turn requests (``n`` per row) and finished requests back into a batch of rollout
fields: the two ends of the agent loop (:class:`~megarl.rollout.agent_loop.AgentLoop`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.data.chat import check_messages
from megarl.rollout.request import AsyncRolloutRequest, FinishReasonType, Message, RequestState


def requests_from_batch(batch: Batch, n: int, *, prompt_key: str = "raw_prompt") -> list[AsyncRolloutRequest]:
    """One PENDING request per (prompt row, sample): ``n`` adjacent requests per row.

    Reads the non-tensor fields ``raw_prompt`` (the chat messages of each row; the dataset
    returns them with ``return_raw_chat=True``) and, when present, ``tools_kwargs``,
    ``interaction_kwargs`` and ``index``. Request ``i * n + k`` is row ``i``, sample ``k``.
    """
    if n < 1:
        raise ValueError(f"rollout.n must be >= 1, got {n}")
    if prompt_key not in batch.non_tensors:
        raise ValueError(f"multi-turn rollout needs the chat messages of each prompt in the non-tensor field "
                         f"{prompt_key!r}; build the dataset with return_raw_chat=True "
                         f"(batch has {sorted(batch.non_tensors)})")
    columns = {key: batch.non_tensors.get(key) for key in ("tools_kwargs", "interaction_kwargs", "index",
                                                             "multi_modal_data")}
    requests = []
    for row in range(len(batch)):
        raw = batch.non_tensors[prompt_key][row]
        messages = check_messages(raw if isinstance(raw, str) else list(raw), f"batch row {row} ({prompt_key})")
        tools_kwargs = columns["tools_kwargs"][row] if columns["tools_kwargs"] is not None else None
        interaction_kwargs = columns["interaction_kwargs"][row] if columns["interaction_kwargs"] is not None else None
        data = columns["multi_modal_data"][row] if columns["multi_modal_data"] is not None else None
        images = list((data or {}).get("image") or [])
        for offset in range(n):
            requests.append(AsyncRolloutRequest(
                batch_data_id=row, rollout_offset=offset,
                messages=[Message.from_dict(message) for message in messages],
                index=None if columns["index"] is None else columns["index"][row],
                tools_kwargs=copy.deepcopy(dict(tools_kwargs or {})),
                interaction_kwargs=copy.deepcopy(dict(interaction_kwargs or {})), images=list(images)))
    return requests


def batch_from_requests(requests: Sequence[AsyncRolloutRequest], prompt_length: int, response_length: int,
                        pad_token_id: int) -> Batch:
    """The rollout fields of finished requests, one row each, in the given order.

    Tensors: ``prompts`` ``[N, P]`` (left-padded), ``responses`` ``[N, R]`` (right-padded),
    ``input_ids`` / ``attention_mask`` / ``position_ids`` ``[N, P+R]`` (``attention_mask`` 1 on every token of
    the conversation, tool outputs included), ``response_mask`` ``[N, R]``: the tokens that train, the
    requests' own loss mask (1 on generated tokens, 0 on tool/user/scaffolding tokens) except on FAILED requests,
    whose response is all 0 (not trained on); and, when every request has them, ``rollout_log_probs`` ``[N, R]``
    (0 on tool/user/scaffolding tokens and padding). Prompt positions count real tokens from 0; response
    positions continue from the last prompt position over all ``R`` columns.

    Non-tensors: ``messages`` (list of message dicts), ``reward_scores`` (dict), ``finish_reason``
    (str), ``metrics`` (dict of numbers), ``rollout_error`` (why a FAILED request failed, else ``""``),
    ``num_turns`` (assistant + user turns).
    """
    if not requests:
        raise ValueError("batch_from_requests needs at least one request")
    num_rows = len(requests)
    prompts_NP = torch.full((num_rows, prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask_NP = torch.zeros((num_rows, prompt_length), dtype=torch.long)
    responses_NR = torch.full((num_rows, response_length), pad_token_id, dtype=torch.long)
    response_mask_NR = torch.zeros((num_rows, response_length), dtype=torch.long)
    response_loss_NR = torch.zeros((num_rows, response_length), dtype=torch.long)
    log_probs_NR = torch.zeros((num_rows, response_length), dtype=torch.float32)
    for row, request in enumerate(requests):
        where = f"request {request.request_id} (batch row {request.batch_data_id}, sample {request.rollout_offset})"
        if request.state not in (RequestState.COMPLETED, RequestState.FAILED):
            raise ValueError(f"{where} is {request.state.value}; run AgentLoop.run on it first")
        prompt, response = request.prompt_ids, request.response_ids
        if len(prompt) > prompt_length or len(response) > response_length:
            raise ValueError(f"{where} has {len(prompt)} prompt and {len(response)} response tokens, more than "
                             f"prompt_length={prompt_length} / response_length={response_length}; build the "
                             f"batch with the lengths the agent loop ran with")
        if prompt:
            prompts_NP[row, prompt_length - len(prompt):] = torch.tensor(prompt)
            prompt_mask_NP[row, prompt_length - len(prompt):] = 1
        if response:
            responses_NR[row, :len(response)] = torch.tensor(response)
            response_mask_NR[row, :len(response)] = 1
            if request.state is RequestState.COMPLETED:
                response_loss_NR[row, :len(response)] = torch.tensor(request.response_loss_mask)
            if request.response_log_probs is not None:
                log_probs_NR[row, :len(response)] = torch.tensor(request.response_log_probs, dtype=torch.float32)
    prompt_positions_NP = (prompt_mask_NP.cumsum(dim=1) - 1).clamp(min=0)
    response_positions_NR = prompt_positions_NP[:, -1:] + torch.arange(1, response_length + 1)
    attention_mask = torch.cat([prompt_mask_NP, response_mask_NR], dim=1)
    tensors = {
        "prompts": prompts_NP,
        "responses": responses_NR,
        "input_ids": torch.cat([prompts_NP, responses_NR], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.cat([prompt_positions_NP, response_positions_NR], dim=1),
        "response_mask": response_loss_NR,
    }
    if all(request.response_log_probs is not None for request in requests):
        tensors["rollout_log_probs"] = log_probs_NR

    def column(values: list[Any]) -> np.ndarray:
        array = np.empty(num_rows, dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        return array

    non_tensors = {}
    if any(request.images for request in requests):  # a vision-language policy's conversations with images
        non_tensors["multi_modal_inputs"] = column([request.vision_inputs() for request in requests])
        non_tensors["multi_modal_data"] = column([{"image": list(request.images)} if request.images else None
                                                  for request in requests])
    non_tensors |= {
        "messages": column([request.message_dicts() for request in requests]),
        "reward_scores": column([dict(request.reward_scores) for request in requests]),
        "finish_reason": column([(request.finish_reason or FinishReasonType.ABORT).value for request in requests]),
        "metrics": column([dict(request.metrics) for request in requests]),
        "rollout_error": column([request.error or "" for request in requests]),
        "num_turns": column([request.num_assistant_turns + request.num_user_turns for request in requests]),
    }
    return Batch(tensors=tensors, non_tensors=non_tensors)
