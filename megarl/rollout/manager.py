"""The rollout manager: prompts in, trajectories out, over one or more engine replicas.

:meth:`RolloutManager.generate` takes a :class:`~megarl.data.batch.Batch` of left-padded
prompts (``input_ids``, ``attention_mask``, ``position_ids`` ``[B, W]`` and per-row
non-tensors, as ``megarl.data.dataset.collate`` makes it) and returns ``N = B·n`` rows, the
``n`` samples of a prompt adjacent (row ``i·n + j`` is sample ``j`` of prompt ``i``, matching
``Batch.repeat(n, interleave=True)``), with these fields (docs/design.md, 'The batch fields'):

- ``prompts`` ``[N, P]``: the prompt, left-padded with the pad id;
- ``responses`` ``[N, R]``: the response, right-padded with the pad id;
- ``input_ids`` ``[N, P+R]``: ``prompts ‖ responses``;
- ``attention_mask`` ``[N, P+R]``: 1 on prompt tokens and on response tokens up to and
  including the first EOS (engines stop there), 0 on padding;
- ``position_ids`` ``[N, P+R]``: ``cumsum(mask) - 1`` on the prompt (0 on its padding), then
  ``last prompt position + 1 .. R`` on the response (padding included);
- ``response_mask`` ``[N, R]``: the tokens that train, the one loss mask every consumer reads (actor, critic,
  advantages, KL, metrics): here ``attention_mask[:, -R:]``; the multi-turn rollout's is 0 on tool and
  interaction tokens too (:func:`megarl.rollout.request_batch.batch_from_requests`);
- ``rollout_log_probs`` ``[N, R]`` (fp32, when ``calculate_log_probs``): the engine's
  ``log_softmax(logits / T)`` of each response token, 0 on padding;
- non-tensor ``finish_reason`` per row (``"stop"``, ``"length"``, ``"abort"``), the input's
  non-tensors repeated, and meta = the input's meta plus ``temperature`` (the ``T`` of
  ``rollout_log_probs``: the sampling temperature, 1.0 when greedy), ``do_sample`` and
  ``validate``.

Generation runs on the process's one event loop (:mod:`megarl.engines.event_loop`): :meth:`RolloutManager.generate`
hands it there and waits, :meth:`RolloutManager.agenerate` is the same as a coroutine on that loop (the
producer's groups). Rows are assembled in prompt order whatever order the engines answer in.

Engines are servers speaking SGLang's HTTP API; generation goes through ``generator`` (the
client of sglang-router in front of them). Single-turn rollouts use the batch-level path: strip
each prompt's left padding, cut the prompts into one contiguous share per engine (all ``n``
samples of a prompt in one share, so prefix caching sees them together), send every share as
one batched ``/generate`` concurrently (the router spreads them), then pad and assemble. Share
``k`` is seeded with ``derive_row_seed(call_seed, first row of k)``; its rows sample from
``derive_row_seed(share seed, i)``. Multi-turn rollouts (``multi_turn=True``) run the
request-level agent loop of ``megarl.rollout.agent_loop`` over the same generator.

Seeds go to megarl's engine only (``rollout.name=hf``), so only there do seeded runs repeat bit for bit.
SGLang 0.5.23 applies one request's ``sampling_seed`` to every row of it, and only with
``--enable-deterministic-inference`` (``sampling_batch_info.py``; a row without a seed gets 42), where
``multinomial_with_seed`` hashes (seed, position): all ``n`` samples of a prompt in one batched request would be
the same sequence. Without the flag SGLang ignores the seed. So SGLang engines get no seed and sample from their
own generators (``--random-seed``), and megarl never launches them with that flag.

A generation that fails (an engine died, the router lost it) raises
:class:`~megarl.engines.client.EngineError` naming the engines that no longer answer
``/health``, with their URLs.

Shape legend: ``B`` prompts, ``N = B·n`` trajectories, ``W`` input prompt width, ``P`` prompt
length, ``R`` response length.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megarl.config.rollout import RolloutConfig
from megarl.data.batch import Batch
from megarl.engines.client import EngineClient, EngineError
from megarl.engines.engine import GenerateOutput, SamplingParams, sampling_params_for
from megarl.engines.event_loop import run_sync
from megarl.rollout.hooks import HookRunner
from megarl.seeds import derive_row_seed

_PROMPT_TENSORS = ("input_ids", "attention_mask", "position_ids")
WATCHED_ROUTE = "/v1/loads"
"""The route :meth:`RolloutManager._watch` asks every engine while a rollout runs."""


class RolloutManager:
    """Generates trajectories for a batch of prompts over engine servers (one or more replicas).

    Args:
        generator: where generation requests go: the client of sglang-router over the engines
            (or of one engine).
        engines: a client per engine replica: the prompts are cut into one share per engine, and
            a failed generation names the engines that no longer answer.
        tokenizer: gives the pad id (``pad_token_id``, else ``eos_token_id``) and, for
            multi-turn, the chat template.
        config: the run's ``actor_rollout_ref.rollout`` section: ``n``, training and validation
            sampling, ``seed`` (the base of calls given no seed), ``calculate_log_probs``, and
            ``multi_turn`` (``enable``: roll out through the agent loop, with its settings).
        prompt_length, response_length: the widths ``P`` and ``R`` of the output
            (:meth:`megarl.config.RunConfig.rollout_widths`).
        tools, interactions: passed to each ``AgentLoop``.
        routing_shape: ``(num_hidden_layers, top_k)`` of a mixture-of-experts model whose training replays or
            compares the rollout's routing (``actor.router_replay``): training rollouts carry
            ``rollout_routed_experts`` (:meth:`assemble`). Those requests go to the engines directly, each to the
            one with the fewest rows in flight: sglang-router 0.3.2 drops ``return_routed_experts`` from the
            requests it forwards (measured), so the answers would come back without them.
    """

    def __init__(self, generator: EngineClient, engines: Sequence[EngineClient], tokenizer: Any,
                 config: RolloutConfig, *, prompt_length: int, response_length: int, tools: dict | None = None,
                 interactions: dict | None = None, routing_shape: tuple[int, int] | None = None,
                 image_processor: Any = None) -> None:
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        if prompt_length < 1 or response_length < 1:
            raise ValueError(f"rollout prompt_length and response_length must be >= 1, got {prompt_length} and "
                             f"{response_length}")
        self.generator = generator
        self.engines = list(engines)
        self.tokenizer = tokenizer
        self.config = config
        self.prompt_length, self.response_length = prompt_length, response_length
        self.tools = tools
        self.interactions = interactions
        self.image_processor = image_processor
        """A vision-language policy's :class:`~megarl.data.images.ImageProcessor` (multi-turn conversations with
        images); None: a text policy."""
        self._hooks: HookRunner | None = None
        """Runs the tool and interaction hooks of every multi-turn call (one event loop for the run)."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("RolloutManager needs a tokenizer with pad_token_id or eos_token_id to pad responses")
        self.pad_token_id = int(pad)
        if routing_shape is not None and config.multi_turn.enable:  # the config refuses it (validate)
            raise ValueError("routed experts are carried by single-turn rollouts only (rollout.multi_turn.enable)")
        self.routing_shape = routing_shape
        self._in_flight = [0] * len(self.engines)
        """Rows in flight per engine (:meth:`_direct`; every call runs on the one event loop)."""
        self._watchdog: asyncio.Task | None = None
        """The one :meth:`_watch` of every rollout running (:meth:`_naming_failures`)."""
        self._watched = 0
        self._num_calls = 0
        self._busy_s = 0.0

    def take_busy(self) -> float:
        """Seconds spent waiting for the engines' generation since the last call (the engines' compute as the
        driver sees it: the servers are other processes); resets the count."""
        busy, self._busy_s = self._busy_s, 0.0
        return busy

    def close(self) -> None:
        """Stop the thread that runs tool and interaction hooks (idempotent)."""
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None

    # ----------------------------------------------------------------------------- entry

    def generate(self, batch: Batch, *, validate: bool = False, seed: int | None = None) -> Batch:
        """Trajectories for the prompts of ``batch``: ``B·n`` rows, generated on the process's event loop (this
        thread waits; not from inside a running loop: :meth:`agenerate` there).

        ``n`` is ``config.n``, or 1 when validating (sampling from ``config.val_kwargs``) or
        when not sampling (``do_sample`` False, from the config or the batch's meta: greedy).
        ``seed`` seeds this call's sampling; ``None``: derived from ``config.seed`` and the
        number of earlier calls (the trainer passes one derived from the step, so a resumed
        run samples what the uninterrupted run sampled).
        """
        self._check_prompts(batch)
        return run_sync(self._generate(batch, validate=validate, seed=seed))

    async def agenerate(self, batch: Batch, *, validate: bool = False, seed: int | None = None) -> Batch:
        """:meth:`generate` as a coroutine of the event loop its clients use."""
        self._check_prompts(batch)
        return await self._generate(batch, validate=validate, seed=seed)

    @staticmethod
    def _check_prompts(batch: Batch) -> None:
        for key in ("input_ids", "attention_mask"):
            if key not in batch.tensors:
                raise KeyError(f"RolloutManager.generate needs the left-padded prompt tensor {key!r} "
                               f"(from megarl.data.dataset.collate); the batch has {sorted(batch.keys())}")
        extra = sorted(set(batch.tensors) - set(_PROMPT_TENSORS))
        if extra:
            warnings.warn(f"RolloutManager.generate does not carry input tensors {extra} into its output; "
                          f"pop only the prompt tensors for rollout", stacklevel=3)

    async def _generate(self, batch: Batch, *, validate: bool, seed: int | None) -> Batch:
        do_sample = bool(batch.meta.get("do_sample", self.config.val_kwargs.do_sample if validate
                                        else self.config.do_sample))
        params = sampling_params_for(self.config, max_new_tokens=self.response_length, validate=validate,
                                     do_sample=do_sample)
        n = 1 if not do_sample else self.config.val_kwargs.n if validate else self.config.n
        call_seed = seed
        if call_seed is None and self.config.seed is not None:
            call_seed = derive_row_seed(self.config.seed, self._num_calls)
        if self.config.name != "hf":
            call_seed = None  # SGLang would give every row of a request one seed (module docstring)
        if self.config.multi_turn.enable:
            generated = await self._generate_multi_turn(batch, dataclasses.replace(params, seed=call_seed), n=n)
        else:
            generated = await self._generate_batch_level(batch, params, n=n, call_seed=call_seed,
                                                         routing_shape=None if validate else self.routing_shape)
        self._num_calls += 1
        # A conversation's images (the prompt's and its tools') come with the generated rows.
        inputs = {k: v for k, v in batch.non_tensors.items() if k not in generated.non_tensors}
        repeated = Batch(non_tensors=inputs).repeat(n, interleave=True)
        output = repeated.union(generated)
        output.meta = {**batch.meta, "temperature": 1.0 if params.greedy else params.temperature,
                       "do_sample": do_sample, "validate": validate}
        return output

    # ----------------------------------------------------------------------------- batch level

    def _prompt_ids(self, batch: Batch) -> list[list[int]]:
        """Each prompt without its padding (the tokens where ``attention_mask`` is 1)."""
        input_ids_BW, attention_mask_BW = batch["input_ids"], batch["attention_mask"]
        if input_ids_BW.shape != attention_mask_BW.shape or input_ids_BW.dim() != 2:
            raise ValueError(f"RolloutManager.generate: input_ids {tuple(input_ids_BW.shape)} and attention_mask "
                             f"{tuple(attention_mask_BW.shape)} must be the same [B, W] shape")
        prompts = []
        for row in range(input_ids_BW.shape[0]):
            ids = input_ids_BW[row][attention_mask_BW[row].bool()].tolist()
            if not ids:
                raise ValueError(f"RolloutManager.generate: prompt {row} has no tokens (attention_mask all 0)")
            if len(ids) > self.prompt_length:
                raise ValueError(f"RolloutManager.generate: prompt {row} has {len(ids)} tokens, more than "
                                 f"rollout.prompt_length={self.prompt_length}; filter or truncate prompts "
                                 f"to data.max_prompt_length")
            prompts.append(ids)
        return prompts

    def _shares(self, num_prompts: int) -> list[tuple[int, int]]:
        """Contiguous ``[start, end)`` prompt ranges, one per engine, sizes differing by at most one."""
        base, extra = divmod(num_prompts, len(self.engines))
        shares, start = [], 0
        for i in range(len(self.engines)):
            end = start + base + (1 if i < extra else 0)
            shares.append((start, end))
            start = end
        return shares

    async def _generate_batch_level(self, batch: Batch, params: SamplingParams, *, n: int, call_seed: int | None,
                                    routing_shape: tuple[int, int] | None = None) -> Batch:
        prompts = self._prompt_ids(batch)
        images = prompt_images(batch)
        jobs = []
        for start, end in self._shares(len(prompts)):
            if start == end:
                continue
            rows = [prompt for prompt in prompts[start:end] for _ in range(n)]
            row_images = None if images is None else [image for image in images[start:end] for _ in range(n)]
            # Every share gets its own seed so that no two rows share a sampling stream.
            jobs.append((rows, None if call_seed is None else derive_row_seed(call_seed, start * n), row_images))
        logprob = self.config.calculate_log_probs

        async def run_all() -> list[list[GenerateOutput]]:
            if routing_shape is None:
                return list(await asyncio.gather(*(self.generator.generate_batch(rows, params, seed=seed,
                                                                                   return_logprob=logprob,
                                                                                   image_data=row_images)
                                                   for rows, seed, row_images in jobs)))
            return list(await asyncio.gather(*(self._direct(rows, params, seed, logprob, routing_shape, row_images)
                                               for rows, seed, row_images in jobs)))

        outputs: list[GenerateOutput] = []
        for (rows, _, _), share in zip(jobs, await self._naming_failures(run_all()), strict=True):  # in share order
            if len(share) != len(rows):
                raise RuntimeError(f"{self.generator.name} returned {len(share)} outputs for {len(rows)} inputs")
            outputs.extend(share)
        rows = [prompt for prompt in prompts for _ in range(n)]
        return self.assemble(rows, outputs, routed=routing_shape is not None)

    async def _direct(self, rows: list[list[int]], params: SamplingParams, seed: int | None, logprob: bool,
                      routing_shape: tuple[int, int], image_data: list | None = None) -> list[GenerateOutput]:
        """``rows`` on the engine with the fewest rows in flight (every rollout of the manager counts), bypassing
        the router (see the class docstring)."""
        index = min(range(len(self.engines)), key=lambda i: (self._in_flight[i], i))
        self._in_flight[index] += len(rows)
        try:
            return await self.engines[index].generate_batch(rows, params, seed=seed, return_logprob=logprob,
                                                            routing_shape=routing_shape, image_data=image_data)
        finally:
            self._in_flight[index] -= len(rows)

    async def _naming_failures(self, work: Any) -> Any:
        """Await ``work`` (timed as the engines' busy time) while :meth:`_watch` checks that every engine still
        answers (one watch for every rollout of the manager running at the time); when generation fails, say which
        engines no longer answer ``/health``."""
        start = time.perf_counter()
        task = asyncio.ensure_future(work)
        watch = self._join_watch()
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                watch.result()  # an engine stopped answering: its EngineError
            return task.result()
        except EngineError as error:
            if error.route == WATCHED_ROUTE:
                raise
            alive = await asyncio.gather(*(engine.health() for engine in self.engines))
            down = [engine for engine, ok in zip(self.engines, alive, strict=True) if not ok]
            if not down:
                raise
            dead = ", ".join(f"{engine.name} at {engine.url}" for engine in down)
            raise EngineError(f"generation failed: {dead} no longer answer(s) /health ({error})",
                              engine=", ".join(e.name for e in down), url=", ".join(e.url for e in down),
                              route=error.route) from error
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await self._leave_watch()
            self._busy_s += time.perf_counter() - start

    def _join_watch(self) -> asyncio.Task:
        """The running watch, started for the first rollout (or after the last one failed)."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watch())
            self._watchdog.add_done_callback(lambda watch: watch.cancelled() or watch.exception())  # retrieved
        self._watched += 1
        return self._watchdog

    async def _leave_watch(self) -> None:
        """The last rollout to leave stops the watch."""
        self._watched -= 1
        watch = self._watchdog
        if self._watched == 0 and watch is not None:
            self._watchdog = None
            if not watch.done():
                watch.cancel()
                with contextlib.suppress(BaseException):
                    await watch

    async def _watch(self) -> None:
        """Ask every engine for its load every few seconds while a rollout runs; raise :class:`EngineError` naming
        those that answered nothing for ``rollout.engine_timeout_s`` (frozen, or hung in a collective: the
        generation itself would wait for ever). An engine that answers again sooner goes on."""
        limit = self.config.engine_timeout_s
        interval = min(5.0, limit / 4)
        heard = {engine.url: time.monotonic() for engine in self.engines}

        async def probe(engine: EngineClient) -> None:
            if await engine.answers(timeout_s=interval):
                heard[engine.url] = time.monotonic()

        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(probe(engine) for engine in self.engines))
            now = time.monotonic()
            silent = [engine for engine in self.engines if now - heard[engine.url] > limit]
            if silent:
                names = ", ".join(f"{engine.name} at {engine.url}" for engine in silent)
                raise EngineError(f"generation: {names} answered nothing for {limit:g} s "
                                  f"(actor_rollout_ref.rollout.engine_timeout_s): frozen, or hung", route=WATCHED_ROUTE,
                                  engine=", ".join(e.name for e in silent), url=", ".join(e.url for e in silent))

    def assemble(self, prompts: list[list[int]], outputs: list[GenerateOutput], *, routed: bool = False) -> Batch:
        """Pad prompts left to P and responses right to R; build masks, positions and log-probs; and, when every
        token's weight version is a number (the trainer's steps), ``rollout_weight_versions`` ``[N, R]``: the
        version that sampled each token (-1 on padding). ``routed``: also ``rollout_routed_experts``
        (:func:`routed_experts_tensor`)."""
        num_rows, P, R = len(prompts), self.prompt_length, self.response_length
        prompts_NP = torch.full((num_rows, P), self.pad_token_id, dtype=torch.long)
        prompt_mask_NP = torch.zeros((num_rows, P), dtype=torch.long)
        responses_NR = torch.full((num_rows, R), self.pad_token_id, dtype=torch.long)
        response_mask_NR = torch.zeros((num_rows, R), dtype=torch.long)
        logprobs_NR = torch.zeros((num_rows, R), dtype=torch.float32)
        for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            prompts_NP[row, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask_NP[row, P - len(prompt):] = 1
            length = len(output.output_ids)
            if length > R:
                raise RuntimeError(f"an engine returned {length} tokens for row {row}, more than "
                                   f"rollout.response_length={R}")
            responses_NR[row, :length] = torch.tensor(output.output_ids, dtype=torch.long)
            response_mask_NR[row, :length] = 1
            if self.config.calculate_log_probs:
                if output.output_logprobs is None or len(output.output_logprobs) != length:
                    raise RuntimeError(f"an engine returned no per-token log-probs for row {row} although "
                                       f"they were requested")
                logprobs_NR[row, :length] = torch.tensor(output.output_logprobs, dtype=torch.float32)
        prompt_positions_NP = (prompt_mask_NP.cumsum(dim=1) - 1).clamp(min=0)
        response_positions_NR = prompt_positions_NP[:, -1:] + torch.arange(1, R + 1, dtype=torch.long)
        tensors = {
            "prompts": prompts_NP,
            "responses": responses_NR,
            "input_ids": torch.cat([prompts_NP, responses_NR], dim=1),
            "attention_mask": torch.cat([prompt_mask_NP, response_mask_NR], dim=1),
            "position_ids": torch.cat([prompt_positions_NP, response_positions_NR], dim=1),
            "response_mask": response_mask_NR,
        }
        if self.config.calculate_log_probs:
            tensors["rollout_log_probs"] = logprobs_NR
        versions = _token_versions(outputs, R)
        if versions is not None:
            tensors["rollout_weight_versions"] = versions
        if routed:
            tensors["rollout_routed_experts"] = routed_experts_tensor(prompts, outputs, prompt_width=P, response_width=R,
                                                                      shape=self.routing_shape)
        return Batch(tensors=tensors, non_tensors={"finish_reason": [o.finish_reason.value for o in outputs]})

    # ----------------------------------------------------------------------------- multi-turn

    async def _generate_multi_turn(self, batch: Batch, params: SamplingParams, *, n: int) -> Batch:
        """Request-level rollouts: one agent loop over every request, concurrently, through the generator.

        The router spreads the requests over the engines; the agent loop derives every turn's
        seed from ``params.seed`` and the request's (row, sample, turn).
        """
        # Imported here: the agent loop (tools, parsers) is only needed for multi-turn rollouts.
        from megarl.rollout import agent_loop, request_batch

        requests = request_batch.requests_from_batch(batch, n=n)
        if self._hooks is None:
            self._hooks = HookRunner(self.config.multi_turn.tool_timeout_s)
        loop = agent_loop.AgentLoop(self.generator, self.tokenizer, self.config, prompt_length=self.prompt_length,
                                    response_length=self.response_length, tools=self.tools,
                                    interactions=self.interactions, hooks=self._hooks,
                                    image_processor=self.image_processor)
        finished = sorted(await self._naming_failures(loop.run(requests, sampling_params=params)),
                          key=lambda r: (r.batch_data_id, r.rollout_offset))
        expected = [(i, j) for i in range(len(batch)) for j in range(n)]
        got = [(r.batch_data_id, r.rollout_offset) for r in finished]
        if got != expected:
            raise RuntimeError(f"the agent loop returned requests {got[:8]}... for {len(batch)} prompts x n={n}; "
                               f"expected each (batch_data_id, rollout_offset) exactly once")
        return request_batch.batch_from_requests(finished, prompt_length=self.prompt_length,
                                              response_length=self.response_length,
                                              pad_token_id=self.pad_token_id)


def prompt_images(batch: Batch) -> list[list[str] | None] | None:
    """Each prompt's images as the engines take them (``image_data``: base64 data URIs, None for a prompt
    without), from its ``multi_modal_data`` (:class:`megarl.data.PromptDataset`); None when no prompt has one."""
    if "multi_modal_data" not in batch:
        return None
    from megarl.data.images import image_uri

    out = [None if not data or not data.get("image") else [image_uri(image) for image in data["image"]]
           for data in batch["multi_modal_data"]]
    return out if any(out) else None


def routed_experts_tensor(prompts: list[list[int]], outputs: list[GenerateOutput], *, prompt_width: int,
                          response_width: int, shape: tuple[int, int]) -> torch.Tensor:
    """``[N, P + R, num_layers, top_k]``: the experts the engine routed each token of the batch's
    ``[left-padded prompt ‖ right-padded response]`` layout to; row ``i``'s ``len(prompt) + len(output) - 1``
    routed tokens start at its first prompt column (uint8 ids for up to 256 experts, else int16). Positions the
    engine did not route (padding, each row's last token) hold experts ``0..top_k-1``: a valid routing for the
    replay to use there, which no real token's log-prob depends on."""
    layers, topk = shape
    largest = max((int(o.routed_experts.max()) for o in outputs if o.routed_experts is not None
                   and o.routed_experts.size), default=0)
    dtype = torch.uint8 if largest < 256 else torch.int16
    out = torch.arange(topk, dtype=dtype).expand(len(outputs), prompt_width + response_width, layers, topk).clone()
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        routed = output.routed_experts
        expected = (len(prompt) + len(output.output_ids) - 1, layers, topk)
        if routed is None or tuple(routed.shape) != expected:
            raise RuntimeError(f"an engine returned routed experts of shape "
                               f"{None if routed is None else tuple(routed.shape)} for row {row}; expected {expected} "
                               f"(prompt {len(prompt)} + output {len(output.output_ids)} tokens - 1, layers, top-k)")
        start = prompt_width - len(prompt)
        out[row, start:start + expected[0]] = torch.from_numpy(routed.astype(np.int64)).to(dtype)
    return out


def _token_versions(outputs: list[GenerateOutput], width: int) -> torch.Tensor | None:
    """``[N, width]`` int64: each output token's weight version (-1 on padding); None unless every version is an
    integer (engines report ``default`` before the first sync)."""
    versions_NR = torch.full((len(outputs), width), -1, dtype=torch.long)
    for row, output in enumerate(outputs):
        tokens = output.token_versions()
        if any(v is None or not str(v).lstrip("-").isdigit() for v in tokens):
            return None
        versions_NR[row, :len(tokens)] = torch.tensor([int(v) for v in tokens], dtype=torch.long)
    return versions_NR
