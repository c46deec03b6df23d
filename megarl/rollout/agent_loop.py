"""The multi-turn agent loop: every request runs its own state machine, all concurrently.

``AgentLoop(engine, tokenizer, config, tools, interactions).run(requests)`` drives each
:class:`~megarl.rollout.request.AsyncRolloutRequest` through::

    PENDING --initialize, create tool instances, start interaction--> RUNNING
    RUNNING --engine STOP, tool calls in the text--> TOOL_CALLING --responses appended--> RUNNING
    RUNNING --engine STOP, no tool call, interaction--> INTERACTING --user reply--> RUNNING
    RUNNING --engine STOP, no tool call, no interaction--> COMPLETED (stop)
    INTERACTING --interaction says terminate--> COMPLETED (stop)
    any --response budget or max_model_len spent--> COMPLETED (length, outputs truncated)
    TOOL_CALLING / INTERACTING --max_turns or max_user_turns reached--> COMPLETED (max_turns)
    any --engine abort, tool create/reward error, overlong prompt--> FAILED (abort)

Turns: ``max_turns`` counts assistant generations; ``max_user_turns`` counts
tool-response turns plus interaction replies. When a limit is reached after an assistant
turn, its tool calls are not executed (as in verl) and the conversation ends.

Budget: everything after the prompt (assistant tokens, tool responses, user turns, each
turn's generation prompt and scaffolding) must fit ``response_length``, and the whole
sequence ``max_model_len``. Each generation asks for at most the tokens left; a turn cut by
that limit, or tool/user tokens that leave no room for another turn, end the conversation with
``length``, and ``finalize`` truncates the outputs to the budget.

Tool calls: SGLang's function-call parser of ``multi_turn.format`` reads them
(:mod:`megarl.rollout.tool_parser`); every call of a turn gets one tool response, in order. Calls
the parser could not read and calls of tools the request was not given get an error message as
their response (counted in ``metrics``); the well-formed calls run concurrently
(``asyncio.gather``). A tool that raises or times out also answers with an error message:
the request goes on, and the model sees what went wrong. These are the containment boundaries
for tool and interaction code (user code, so any ``Exception`` is caught there): a failing
``create``/``start_interaction``, ``calc_reward``/``calculate_score`` (or a non-finite reward)
or ``generate_response`` FAILS its request only (its rewards cannot be trusted); other requests
are unaffected. Engine exceptions are not request-specific: they cancel the run and propagate
(tool instances are still released).

Every tool and interaction hook runs through a :class:`~megarl.rollout.hooks.HookRunner`: on a
thread and event loop of its own (a blocking tool cannot stall generation), each call bounded
by ``multi_turn.tool_timeout_s``. An expired call counts as ``num_timeouts/<hook>`` in the
request's metrics and is handled like an exception of that hook.

:func:`requests_from_batch` turns a prompt batch into requests (``n`` adjacent samples per
prompt) and :func:`batch_from_requests` turns finished requests into the rollout fields
(docs/design.md, 'The batch fields').

Shape legend: ``N`` trajectories, ``P`` prompt length, ``R`` response length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from megarl.config.rollout import RolloutConfig
from megarl.data.chat import row_tool_names
from megarl.engines.engine import AsyncGenerator, FinishReason, SamplingParams, sampling_params_for
from megarl.rollout.hooks import HookRunner, HookTimeout
from megarl.rollout.interaction import BaseInteraction
from megarl.rollout.request import (
    AsyncRolloutRequest,
    FinishReasonType,
    RequestState,
    output_text,
)
from megarl.rollout.tool_parser import ToolCall, ToolCallError, ToolCallParser
from megarl.rollout.tools.base import BaseTool, ToolResponse
from megarl.seeds import turn_seed

logger = logging.getLogger(__name__)

_ACTIVE_STATES = (RequestState.RUNNING, RequestState.TOOL_CALLING, RequestState.INTERACTING)


class AgentLoop:
    """Runs multi-turn, tool-calling rollouts of many requests concurrently on one engine.

    Args:
        engine: what generates (``async_generate``): the client of sglang-router or of an engine.
        tokenizer: the policy's tokenizer, with its chat template.
        config: the run's ``actor_rollout_ref.rollout`` section: ``multi_turn.*`` (turn limits,
            tool timeout, tool-call format, tokenization check), ``max_model_len``,
            ``calculate_log_probs`` and the default sampling.
        prompt_length, response_length: the widths ``P`` and ``R``
            (:meth:`megarl.config.RunConfig.rollout_widths`).
        tools: ``{function_name: tool}`` (e.g. from :func:`megarl.rollout.tools.load_tools`).
            A request sees the tools named in its row's ``tools_kwargs``, or all of them when
            the row names none.
        interactions: ``{name: interaction}``; a request with ``interaction_kwargs`` uses the
            one named by ``interaction_kwargs["name"]`` (or the only one).
        hooks: runs the tool and interaction hooks (shared by the loops of one rollout manager,
            so a tool's hooks stay on one event loop across steps); None: each :meth:`run` uses
            a runner of its own with ``multi_turn.tool_timeout_s``.
        image_processor: a vision-language policy's :class:`~megarl.data.images.ImageProcessor`: the prompt's
            images and those tools return (:class:`~megarl.rollout.tools.base.ToolResponse`) are placed in the
            conversation and sent to the engine with every turn (``image_data``).
    """

    def __init__(self, engine: AsyncGenerator, tokenizer: Any, config: RolloutConfig, *, prompt_length: int,
                 response_length: int, tools: Mapping[str, BaseTool] | None = None,
                 interactions: Mapping[str, BaseInteraction] | None = None,
                 hooks: HookRunner | None = None, image_processor: Any = None) -> None:
        if prompt_length < 1 or response_length < 1:
            raise ValueError(f"rollout prompt_length and response_length must be >= 1, got {prompt_length} and "
                             f"{response_length}")
        if config.max_model_len is not None and config.max_model_len <= prompt_length:
            raise ValueError(f"actor_rollout_ref.rollout.max_model_len={config.max_model_len} leaves no room for a "
                             f"response after prompt_length={prompt_length}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.multi_turn = config.multi_turn
        self.prompt_length, self.response_length = prompt_length, response_length
        total = prompt_length + response_length
        self.max_model_len = total if config.max_model_len is None else min(config.max_model_len, total)
        """Cap on prompt + response tokens: ``max_model_len``, or ``P + R`` when unset (or larger)."""
        self.tools = dict(tools or {})
        self.interactions = dict(interactions or {})
        for name, tool in self.tools.items():
            if tool.name != name:
                raise ValueError(f"tools[{name!r}] is the tool {tool.name!r}; key tools by their function name")
        clash = sorted(self.tools.keys() & self.interactions.keys())
        if clash:
            raise ValueError(f"names {clash} are both tools and interactions; their rewards would share "
                             f"reward_scores keys, rename the interaction")
        self.parser = ToolCallParser(config.multi_turn.format,
                                     {name: tool.get_openai_tool_schema() for name, tool in self.tools.items()})
        self.hooks = hooks
        self.image_processor = image_processor
        self._noted_ignored: set[str] = set()

    # ------------------------------------------------------------------------------ entry

    async def run(self, requests: Sequence[AsyncRolloutRequest], *,
                  sampling_params: SamplingParams | None = None) -> list[AsyncRolloutRequest]:
        """Run every (PENDING) request to COMPLETED or FAILED; return them sorted by
        ``(batch_data_id, rollout_offset)``.

        ``sampling_params`` overrides the config's sampling (e.g. greedy validation); its
        ``max_new_tokens`` caps each turn, which the budget may narrow further.
        """
        requests = list(requests)
        for request in requests:
            self._check_request(request)
        sampling = sampling_params or sampling_params_for(self.config, max_new_tokens=self.response_length,
                                                             seed=self.config.seed)
        own_hooks = self.hooks is None
        hooks = HookRunner(self.multi_turn.tool_timeout_s) if own_hooks else self.hooks
        releases: list[asyncio.Future] = []
        tasks = [asyncio.ensure_future(self._run_request(request, sampling, hooks, releases)) for request in requests]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # A cancelled request's release runs on (shielded): wait for every one before the error leaves.
            await asyncio.gather(*releases, return_exceptions=True)
            raise
        finally:
            if own_hooks:
                hooks.close()
        return sorted(requests, key=lambda r: (r.batch_data_id, r.rollout_offset))

    def _check_request(self, request: AsyncRolloutRequest) -> None:
        """Refuse requests this loop cannot run (config mistakes, not model behaviour)."""
        where = f"request {request.request_id} (batch row {request.batch_data_id})"
        if request.state is not RequestState.PENDING:
            raise ValueError(f"{where} is {request.state.value}; AgentLoop.run takes PENDING requests "
                             f"(build new ones with requests_from_batch)")
        if request.tools_kwargs and not self.tools:
            self._note_ignored("tools_kwargs", "rows carry tools_kwargs but no tools are configured; ignored")
        unknown = sorted(set(request.tools_kwargs) - set(self.tools)) if self.tools else []
        if unknown:
            raise ValueError(f"{where}: tools_kwargs names tools {unknown} that the tool config does not define "
                             f"(configured: {sorted(self.tools)}); add them to rollout.multi_turn.tool_config_path")
        if request.interaction_kwargs and not self.interactions:
            self._note_ignored("interaction_kwargs", "rows carry interaction_kwargs but no interactions are "
                                                     "configured; ignored")
        self._interaction_for(request)

    def _note_ignored(self, key: str, message: str) -> None:
        if key not in self._noted_ignored:
            self._noted_ignored.add(key)
            logger.warning(message)

    def _tool_names(self, request: AsyncRolloutRequest) -> list[str]:
        return row_tool_names(list(self.tools), request.tools_kwargs)

    def _interaction_for(self, request: AsyncRolloutRequest) -> tuple[str, BaseInteraction] | None:
        """The request's ``(name, interaction)``, or None when it has none."""
        if not self.interactions or not request.interaction_kwargs:
            return None
        name = request.interaction_kwargs.get("name")
        if name is None:
            if len(self.interactions) != 1:
                raise ValueError(f"batch row {request.batch_data_id}: interaction_kwargs has no 'name' and "
                                 f"{len(self.interactions)} interactions are configured ({sorted(self.interactions)})")
            name = next(iter(self.interactions))
        if name not in self.interactions:
            raise ValueError(f"batch row {request.batch_data_id}: interaction {name!r} is not configured "
                             f"(configured: {sorted(self.interactions)})")
        return name, self.interactions[name]

    def _turn_limit_reached(self, request: AsyncRolloutRequest) -> bool:
        limit = self.multi_turn.max_user_turns
        return (request.num_assistant_turns >= self.multi_turn.max_turns
                or (limit is not None and request.num_user_turns >= limit))

    # ------------------------------------------------------------------------------ one request

    async def _hook(self, hooks: HookRunner, request: AsyncRolloutRequest, owner: str, hook: str,
                    function: Any, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` of tool/interaction ``owner`` through ``hooks``; an expiry is counted
        as ``num_timeouts/<hook>`` and raised as :class:`HookTimeout`."""
        try:
            return await hooks.call(f"{owner!r} {hook}", function, *args, **kwargs)
        except HookTimeout:
            request.count(f"num_timeouts/{hook}")
            raise

    async def _run_request(self, request: AsyncRolloutRequest, sampling: SamplingParams, hooks: HookRunner,
                           releases: list[asyncio.Future]) -> AsyncRolloutRequest:
        request.tool_schemas = [self.tools[name].get_openai_tool_schema() for name in self._tool_names(request)]
        request.image_processor = self.image_processor
        request.initialize(self.tokenizer, max_prompt_len=self.prompt_length, max_response_len=self.response_length,
                           max_model_len=self.max_model_len)
        finish: FinishReasonType | None = None
        rewards: dict[str, float] = {}
        handlers = {RequestState.RUNNING: lambda: self._generate(request, sampling),
                    RequestState.TOOL_CALLING: lambda: self._call_tools(request, hooks),
                    RequestState.INTERACTING: lambda: self._interact(request, hooks)}
        try:
            if request.state is RequestState.RUNNING:
                await self._start_instances(request, hooks)
            while finish is None and request.state in _ACTIVE_STATES:
                finish = await handlers[request.state]()
            if request.state is not RequestState.FAILED:
                rewards = await self._final_rewards(request, hooks)
        finally:
            release = asyncio.ensure_future(self._release(request, hooks))
            releases.append(release)
            await asyncio.shield(release)
        request.finalize(self.tokenizer, finish_reason=finish or FinishReasonType.ABORT, reward_scores=rewards,
                         sanity_check=self.multi_turn.tokenization_sanity_check)
        if request.state is RequestState.FAILED:
            logger.warning("rollout request %s (batch row %d, sample %d) FAILED: %s", request.request_id,
                           request.batch_data_id, request.rollout_offset, request.error)
        return request

    async def _start_instances(self, request: AsyncRolloutRequest, hooks: HookRunner) -> None:
        """Create the request's tool instances and start its interaction, concurrently."""
        starts: dict[str, Any] = {}
        for name in self._tool_names(request):
            kwargs = request.tools_kwargs.get(name, {}).get("create_kwargs", {})
            starts[name] = self._hook(hooks, request, name, "create", self.tools[name].create, request.request_id,
                                      **kwargs)
        interaction = self._interaction_for(request)
        if interaction is not None:
            name, user = interaction
            starts[name] = self._hook(hooks, request, name, "start_interaction", user.start_interaction,
                                      request.request_id, **request.interaction_kwargs)
        outcomes = await asyncio.gather(*starts.values(), return_exceptions=True)
        errors = []
        for name, outcome in zip(starts, outcomes, strict=True):
            if isinstance(outcome, Exception):
                errors.append(f"{name}: {type(outcome).__name__}: {outcome}")
            else:
                request.instance_ids[name] = outcome
        if errors:
            request.fail(f"starting tools/interaction failed: {'; '.join(errors)}")

    async def _generate(self, request: AsyncRolloutRequest, sampling: SamplingParams) -> FinishReasonType | None:
        """RUNNING: one assistant turn."""
        budget = request.max_new_tokens(self.tokenizer)
        if budget < 1:
            return FinishReasonType.LENGTH
        params = dataclasses.replace(
            sampling, max_new_tokens=min(sampling.max_new_tokens, budget),
            seed=None if sampling.seed is None else turn_seed(sampling.seed, request.batch_data_id, request.rollout_offset,
                                                                  request.num_assistant_turns))
        images = {"image_data": self._image_data(request)} if request.images else {}
        output = await self.engine.async_generate(request.generation_prompt_ids(self.tokenizer), params,
                                                  return_logprob=self.config.calculate_log_probs, **images)
        if output.finish_reason is FinishReason.ABORT:
            request.fail(f"the engine aborted turn {request.num_assistant_turns + 1}")
            return FinishReasonType.ABORT
        if len(output.output_ids) > params.max_new_tokens:
            raise ValueError(f"the engine returned {len(output.output_ids)} tokens for max_new_tokens="
                             f"{params.max_new_tokens}")
        log_probs = output.output_logprobs if self.config.calculate_log_probs else None
        if output.finish_reason is FinishReason.LENGTH:
            request.add_assistant_message(self.tokenizer, output.output_ids, log_probs=log_probs, complete=False)
            return FinishReasonType.LENGTH
        text = output_text(self.tokenizer, output.output_ids)
        names = [schema["function"]["name"] for schema in request.tool_schemas]
        parsed = self.parser.parse(text, names) if names else None
        if parsed is not None and (parsed.calls or parsed.errors):
            structured = not parsed.errors
            request.add_assistant_message(self.tokenizer, output.output_ids, log_probs=log_probs,
                                          content=parsed.normal_text if structured else None,
                                          tool_calls=parsed.calls if structured else None)
            request.pending_tool_calls = sorted([*parsed.calls, *parsed.errors], key=lambda call: call.index)
            request.state = RequestState.TOOL_CALLING
            return None
        request.add_assistant_message(self.tokenizer, output.output_ids, log_probs=log_probs)
        if self._interaction_for(request) is not None:
            request.state = RequestState.INTERACTING
            return None
        return FinishReasonType.STOP

    @staticmethod
    def _image_data(request: AsyncRolloutRequest) -> list[str]:
        """The conversation's images as the engine takes them (base64 PNGs, each encoded once)."""
        from megarl.data.images import image_uri

        request.image_uris.extend(image_uri(image) for image in request.images[len(request.image_uris):])
        return list(request.image_uris)

    async def _call_tools(self, request: AsyncRolloutRequest, hooks: HookRunner) -> FinishReasonType | None:
        """TOOL_CALLING: answer every call of the last turn (calls run concurrently)."""
        calls, request.pending_tool_calls = request.pending_tool_calls, []
        if self._turn_limit_reached(request):
            request.count("num_tool_calls_skipped", len(calls))
            return FinishReasonType.MAX_TURNS
        responses = await asyncio.gather(*(self._answer_call(request, call, hooks) for call in calls))
        request.add_tool_response_messages(self.tokenizer, responses)
        if request.max_new_tokens(self.tokenizer) < 1:
            return FinishReasonType.LENGTH
        request.state = RequestState.RUNNING
        return None

    async def _answer_call(self, request: AsyncRolloutRequest, call: ToolCall | ToolCallError,
                           hooks: HookRunner) -> str | tuple[str, list]:
        """The tool response to one call: the tool's text (with its images: ``(text, images)``), or an error
        message for the model."""
        request.count("num_tool_calls")
        if isinstance(call, ToolCallError):
            request.count("num_tool_call_parse_errors")
            return f"Error: tool call {call.index} could not be parsed: {call.message}."
        available = [schema["function"]["name"] for schema in request.tool_schemas]
        if call.name not in available:
            request.count("num_unknown_tool_calls")
            return f"Error: unknown tool {call.name!r}; available tools: {', '.join(available)}."
        tool = self.tools[call.name]
        kwargs = request.tools_kwargs.get(call.name, {}).get("execute_kwargs", {})
        try:
            text, step_reward, metrics = await self._hook(hooks, request, call.name, "execute", tool.execute,
                                                          request.instance_ids[call.name], call.arguments, **kwargs)
            step_reward = _finite_reward(step_reward, f"tool {call.name!r} execute's step reward")
        except HookTimeout:
            return f"Error: tool {call.name!r} timed out after {self.multi_turn.tool_timeout_s} s."
        except Exception as exc:  # tool code is user code: contain its failure in this call's response
            request.count("num_tool_exceptions")
            logger.debug("tool %r raised for request %s", call.name, request.request_id, exc_info=True)
            return f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}"
        request.tool_metrics.setdefault(call.name, []).append({"step_reward": step_reward, **metrics})
        images = []
        if isinstance(text, ToolResponse):
            text, images = text.text, self._tool_images(request, call.name, text.images)
            if isinstance(images, str):  # why they cannot be shown
                return images
        if not isinstance(text, str):
            if not isinstance(text, (dict, list, int, float, bool, type(None))):
                request.count("num_tool_bad_responses")
                logger.warning("tool %r returned a %s, not text; the model is told so", call.name,
                               type(text).__name__)
                return f"Error: tool {call.name!r} returned a {type(text).__name__}, not text."
            text = json.dumps(text, ensure_ascii=False, default=str)
        limit, side = self.multi_turn.max_tool_response_length, self.multi_turn.tool_response_truncate_side
        if len(text) > limit:
            request.count("num_tool_responses_truncated")
            text = truncate_text(text, limit, side)
        return (text, images) if images else text

    def _tool_images(self, request: AsyncRolloutRequest, name: str, images: list) -> list | str:
        """A tool's images decoded for the conversation, or the error message the model gets instead (a text
        policy, or an image that cannot be read)."""
        from megarl.data.images import BadImage, load_image

        if not images:
            return []
        if self.image_processor is None:
            request.count("num_tool_images_refused")
            return f"Error: tool {name!r} returned images, which this model cannot read."
        try:
            return [load_image(image, f"tool {name!r} image {k}") for k, image in enumerate(images)]
        except BadImage as error:
            request.count("num_tool_bad_images")
            return f"Error: {error}"

    async def _interact(self, request: AsyncRolloutRequest, hooks: HookRunner) -> FinishReasonType | None:
        """INTERACTING: the simulated user judges the last turn and replies or ends the conversation."""
        name, interaction = self._interaction_for(request)
        try:
            terminate, reply, score, _ = await self._hook(
                hooks, request, name, "generate_response", interaction.generate_response,
                request.instance_ids[name], request.message_dicts(), **request.interaction_kwargs)
            score = _finite_reward(score, f"interaction {name!r} generate_response's score")
        except Exception as exc:  # interaction code is user code: fail this request only
            request.fail(f"interaction {name!r} generate_response: {type(exc).__name__}: {exc}")
            return FinishReasonType.ABORT
        request.interaction_scores.append(score)
        if terminate:
            return FinishReasonType.STOP
        if self._turn_limit_reached(request):
            return FinishReasonType.MAX_TURNS
        request.add_user_message(self.tokenizer, reply)
        if request.max_new_tokens(self.tokenizer) < 1:
            return FinishReasonType.LENGTH
        request.state = RequestState.RUNNING
        return None

    async def _final_rewards(self, request: AsyncRolloutRequest, hooks: HookRunner) -> dict[str, float]:
        """``calc_reward`` of every tool instance and ``calculate_score`` of the interaction (finite floats)."""
        scores: dict[str, Any] = {}
        for name, instance_id in request.instance_ids.items():
            if name in self.tools:
                kwargs = request.tools_kwargs.get(name, {}).get("calc_reward_kwargs", {})
                scores[name] = self._hook(hooks, request, name, "calc_reward", self.tools[name].calc_reward,
                                          instance_id, **kwargs)
            else:
                scores[name] = self._hook(hooks, request, name, "calculate_score",
                                          self.interactions[name].calculate_score, instance_id)
        outcomes = await asyncio.gather(*scores.values(), return_exceptions=True)
        rewards, errors = {}, []
        for name, outcome in zip(scores, outcomes, strict=True):
            if isinstance(outcome, Exception):
                errors.append(f"{name}: {type(outcome).__name__}: {outcome}")
                continue
            try:
                rewards[name] = _finite_reward(outcome, f"{name!r} final reward")
            except (TypeError, ValueError) as exc:
                errors.append(f"{name}: {exc}")
        if errors:
            request.fail(f"computing the final rewards failed: {'; '.join(errors)}")
        return rewards

    async def _release(self, request: AsyncRolloutRequest, hooks: HookRunner) -> None:
        """Release every tool instance and finalize the interaction (errors are logged and counted)."""
        releases = {}
        for name, instance_id in request.instance_ids.items():
            if name in self.tools:
                kwargs = request.tools_kwargs.get(name, {}).get("release_kwargs", {})
                releases[name] = self._hook(hooks, request, name, "release", self.tools[name].release,
                                            instance_id, **kwargs)
            else:
                releases[name] = self._hook(hooks, request, name, "finalize_interaction",
                                            self.interactions[name].finalize_interaction, instance_id)
        outcomes = await asyncio.gather(*releases.values(), return_exceptions=True)
        for name, outcome in zip(releases, outcomes, strict=True):
            if isinstance(outcome, Exception):
                request.count("num_release_errors")
                logger.warning("releasing %r of request %s raised %s: %s", name, request.request_id,
                               type(outcome).__name__, outcome)


def _finite_reward(value: Any, what: str) -> float:
    """``value`` as a finite float; ``TypeError``/``ValueError`` naming ``what`` otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}; rewards must be finite")
    return number


def truncate_text(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters plus a ``...(truncated)`` mark, keeping its start (``left``), its
    end (``right``) or both ends (``middle``), as verl cuts tool replies."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]
