"""The critic role on one rank: response values and the clipped value-loss update (PPO with GAE).

Wraps a :class:`ShardedModel` built with ``value_head=True``. Batches follow the actor's
layout (megarl.workers.actor): ``input_ids`` / ``attention_mask`` [N, P+R], response fields
[N, R]. The value of response token j is the value at sequence position P+j-1: the state
before token j is generated, the same slice as the actor's log-prob of token j.

Legend: N rows, P prompt width, R response width, S = P+R.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megarl.algo.losses import agg_norm, value_loss
from megarl.config.critic import CriticConfig
from megarl.data.batch import Batch
from megarl.workers.actor import response_slice
from megarl.workers.micro import micro_batches, mini_batches, pad_responses
from megarl.workers.sharded_model import ShardedModel, StepResult


class CriticRole:
    """The value model: response values and epochs × mini-batches × micro-batches of value-loss steps.

    ``config`` is the run's ``critic`` section; ``rollout_n`` (samples per prompt) turns its
    ``ppo_mini_batch_size`` (prompts) into trajectories.
    """

    def __init__(self, model: ShardedModel, config: CriticConfig, *, rollout_n: int = 1):
        if not model.value_head:
            raise ValueError("the critic needs a value head: build its ShardedModel with value_head=True")
        self.model = model
        self.config = config
        self.mini_batch_rows = config.ppo_mini_batch_size * rollout_n
        """Trajectories per optimizer step over all DP ranks."""

    def compute_values(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        """``values`` float32 [N, R] of this DP rank's rows; None off the collect rank.

        Needs ``input_ids``, ``attention_mask`` and ``responses`` (for R). Values at padded
        response positions are whatever the model says there: mask them with ``response_mask``.
        """
        cfg = self.config
        micro, widths = micro_batches(batch, ("input_ids", "attention_mask"),
                                      size=None if cfg.use_dynamic_bsz else cfg.forward_micro_batch_size_per_gpu,
                                      max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
                                      multiple_of=self.model.micro_multiple, **self.model.token_layout)
        out = self.model.forward_values(micro)
        if out is None or not self.model.groups.is_collect_rank:
            return None
        R = batch["responses"].shape[1]
        # Back on the host: the result travels through Ray to a driver that may have no GPU.
        return {"values": pad_responses([response_slice(o["values"], r) for o, r in zip(out, widths)], R).cpu()}

    def update(self, batch: Batch, *, seed: int = 0) -> list[StepResult]:
        """Value-loss epochs × mini-batches over this DP rank's rows; one optimizer step per mini-batch.

        Needs ``input_ids``, ``attention_mask``, ``values`` (the old values of
        :meth:`compute_values`), ``returns`` and ``response_mask``, the same on every rank of a
        DP replica (every TP rank of the last stage computes the loss: different old values
        would silently split the replicated head). Every DP rank must hold the same number of
        rows; each mini-batch takes ``mini_batch_rows / dp`` of them. Losses are normalised
        by the mini-batch's global count (all DP ranks), so a step does not depend on
        micro-batching or the layout. Each result's metrics hold ``vf_loss`` (the
        mini-batch loss), ``vf_clipfrac`` and ``vpred_mean`` (micro-batch means, averaged);
        ``megarl.workers.megatron_workers.step_metrics(results, "critic")`` names them
        ``critic/*`` and adds ``critic/grad_norm`` and ``critic/lr``.
        """
        cfg = self.config
        keys = ("input_ids", "attention_mask", "values", "returns", "response_mask")
        return [self._step(mini, keys)
                for mini in mini_batches(batch, role="critic", mini_batch_rows=self.mini_batch_rows,
                                         dp=self.model.groups.dims.dp, epochs=cfg.ppo_epochs, shuffle=cfg.shuffle,
                                         seed=seed)]

    def _step(self, mini: Batch, keys) -> StepResult:
        cfg = self.config
        norm = torch.tensor(agg_norm(mini["response_mask"], cfg.loss_agg_mode), dtype=torch.float64,
                            device=self.model.device)
        dist.all_reduce(norm, group=self.model.groups.dp)  # the mini-batch's count over all DP ranks
        global_norm = float(norm)

        def loss_fn(values_BS, mb):
            response_length = mb["response_mask"].shape[1]  # this micro-batch's (trimmed) response width
            return value_loss(
                response_slice(values_BS, response_length), mb["values"], mb["returns"], mb["response_mask"],
                cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, global_norm=global_norm,
            )

        micro, _ = micro_batches(mini, keys,
                                 size=None if cfg.use_dynamic_bsz else cfg.ppo_micro_batch_size_per_gpu,
                                 max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
                                 multiple_of=self.model.micro_multiple, **self.model.token_layout)
        result = self.model.train_step(micro, loss_fn)
        # vf_loss is each micro-batch's share of the mini-batch loss: the model averaged the
        # shares over micro-batches and DP ranks; the mini-batch value is their sum (= the loss).
        metrics = {**result.metrics, "vf_loss": result.loss}
        return dataclasses.replace(result, metrics=metrics)


class RewardModelRole:
    """A reward model: one score per response, the value head's output at its last token (an HF
    sequence-classification checkpoint's ``score`` there, :func:`megarl.convert.loader.load_hf_into`; an empty
    response's at the last prompt token). ``config`` is the run's ``reward_model`` section (its micro-batches)."""

    def __init__(self, model: ShardedModel, config):
        if not model.value_head:
            raise ValueError("a reward model scores with its value head: build its ShardedModel with value_head=True")
        self.model = model
        self.config = config

    def compute_scores(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        """``rm_scores`` float32 [N] of this DP rank's rows; None off the collect rank. Needs ``input_ids``,
        ``attention_mask``, ``responses`` and ``response_mask``."""
        cfg = self.config
        micro, widths = micro_batches(batch, ("input_ids", "attention_mask"),
                                      size=None if cfg.use_dynamic_bsz else cfg.micro_batch_size_per_gpu,
                                      max_tokens=cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
                                      multiple_of=self.model.micro_multiple,
                                      **self.model.token_layout)
        out = self.model.forward_values(micro)
        if out is None or not self.model.groups.is_collect_rank:
            return None
        R = batch["responses"].shape[1]
        # Position P + j - 1 holds the value after response token j - 1 (j = 0: after the prompt).
        tail = pad_responses([o["values"][:, -r - 1:] for o, r in zip(out, widths)], R + 1)
        last = batch["response_mask"].sum(-1).long().clamp(max=R)
        return {"rm_scores": tail[torch.arange(len(last)), last].float().cpu()}
