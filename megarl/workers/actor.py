"""The actor and reference roles on one rank: response log-probs and the PPO update.

Both wrap a :class:`ShardedModel`. Batches hold the fields of docs/design.md ('The batch fields'): ``input_ids`` /
``attention_mask`` are [N, P+R] (left-padded prompt ‖ right-padded response), and response
fields (``old_log_probs``, ``advantages``, ``response_mask``, ...) are [N, R]. The log-prob
of response token j sits at sequence position P+j-1 (it is predicted from what precedes it).

Legend: N rows, P prompt width, R response width, S = P+R.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megarl.algo.losses import agg_norm, policy_loss
from megarl.algo.mismatch import tis_weights
from megarl.config.actor import ActorConfig
from megarl.data.batch import Batch
from megarl.models.lora import adapters_disabled
from megarl.parallel.routing import ROUTED_EXPERTS
from megarl.workers.micro import micro_batches, mini_batches, pad_responses
from megarl.workers.sharded_model import ShardedModel, StepResult


def response_slice(logp_NS: torch.Tensor, response_length: int) -> torch.Tensor:
    """[N, S] next-token log-probs -> [N, R] log-probs of the response tokens."""
    return logp_NS[:, -response_length - 1 : -1]


class LogProbRole:
    """Frozen or trainable model that computes response log-probs (the reference uses only this)."""

    def __init__(self, model: ShardedModel, *, micro_batch_size: int = 1, max_token_len: int | None = None,
                 adapters_off: bool = False):
        self.model = model
        self.adapters_off = adapters_off
        """Compute with the model's LoRA adapters off (the reference policy of a LoRA actor)."""
        self.micro_batch_size = micro_batch_size
        self.max_token_len = max_token_len
        """Token budget of a forward micro-batch (dynamic batch size); None: ``micro_batch_size`` rows."""

    def compute_log_prob(self, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False,
                         micro_batch_size: int | None = None, max_token_len: int | None = None,
                         replay_routing: bool = False, measure_routing: bool = False):
        """``log_probs`` (and ``entropy``) [N, R] of this DP rank's rows; None off the collect rank.

        Micro-batches: ``max_token_len`` (token budget) or ``micro_batch_size`` rows, else this
        role's settings. Positions past a row's response are 0. ``replay_routing`` / ``measure_routing``
        (mixture-of-experts models, the batch's ``rollout_routed_experts``): the routers replay the rollout's
        experts / the routing that differs from them is counted, per row ``routing_counts`` [N, 3]
        (:data:`megarl.parallel.routing.COUNTS`).
        """
        R = batch["responses"].shape[1]
        budget = max_token_len or (None if micro_batch_size else self.max_token_len)
        keys = ["input_ids", "attention_mask"] + ([ROUTED_EXPERTS] if replay_routing or measure_routing else [])
        micro, widths = micro_batches(batch, keys,
                                      size=None if budget else (micro_batch_size or self.micro_batch_size),
                                      max_tokens=budget, multiple_of=self.model.micro_multiple,
                                      **self.model.token_layout)
        with adapters_disabled(self.model.module_chunks) if self.adapters_off else contextlib.nullcontext():
            out = self.model.forward_logprobs(micro, temperature=temperature, replay_routing=replay_routing,
                                              measure_routing=measure_routing)
        if out is None or not self.model.groups.is_collect_rank:
            return None
        # Back on the host: the result travels through Ray to a driver that may have no GPU.
        result = {"log_probs": pad_responses([response_slice(o["logp"], r) for o, r in zip(out, widths)], R).cpu()}
        if with_entropy:
            result["entropy"] = pad_responses([response_slice(o["entropy"], r) for o, r in zip(out, widths)],
                                              R).cpu()
        if measure_routing:
            result["routing_counts"] = self.model.last_routing_counts.float()
        return result


class ActorRole(LogProbRole):
    """The policy: log-probs and the clipped PPO update over mini- and micro-batches.

    ``config`` is the run's ``actor_rollout_ref.actor`` section; ``rollout_n`` (samples per
    prompt) turns its ``ppo_mini_batch_size`` (prompts) into trajectories. ``micro_batch_size`` /
    ``max_token_len`` size the forward-only micro-batches of :meth:`compute_log_prob` (the run's
    ``rollout.log_prob_*``); the update's micro-batches are the section's ``ppo_*`` settings.
    """

    def __init__(self, model: ShardedModel, config: ActorConfig, *, rollout_n: int = 1,
                 micro_batch_size: int | None = None, max_token_len: int | None = None):
        super().__init__(model, micro_batch_size=micro_batch_size or config.ppo_micro_batch_size_per_gpu or 1,
                         max_token_len=max_token_len)
        if model.optimizer is None:
            raise ValueError("the actor needs a trainable model: build it with optim=OptimConfig(...)")
        self.config = config
        self.mini_batch_rows = config.ppo_mini_batch_size * rollout_n
        """Trajectories per optimizer step over all DP ranks."""

    def update(self, batch: Batch, *, temperature: float = 1.0, seed: int = 0) -> list[StepResult]:
        """PPO epochs × mini-batches over this DP rank's rows; one optimizer step per mini-batch.

        Every DP rank must hold the same number of rows; each mini-batch takes
        ``ppo_mini_batch_size / dp`` of them. Losses are normalised by the mini-batch's global
        count (all DP ranks), so the step does not depend on micro-batching or the layout.
        """
        config = self.config
        keys = ["input_ids", "attention_mask", "old_log_probs", "advantages", "response_mask"]
        if config.router_replay.replay:
            keys.append(ROUTED_EXPERTS)
        if config.use_kl_loss:
            keys.append("ref_log_prob")
        if "rollout_is_weights" in batch:  # algorithm.rollout_correction.rollout_is
            keys.append("rollout_is_weights")
        if config.tis_cap is not None:
            if "rollout_log_probs" not in batch:
                raise KeyError("actor.tis_cap is set but the batch has no rollout_log_probs: set "
                               "actor_rollout_ref.rollout.calculate_log_probs=true or actor.tis_cap=null")
            keys.append("rollout_log_probs")
        return [self._step(mini, keys, temperature)
                for mini in mini_batches(batch, role="actor", mini_batch_rows=self.mini_batch_rows,
                                         dp=self.model.groups.dims.dp, epochs=config.ppo_epochs,
                                         shuffle=config.shuffle, seed=seed)]

    def _step(self, mini: Batch, keys, temperature: float) -> StepResult:
        ppo = self.config
        norm = torch.tensor(agg_norm(mini["response_mask"], ppo.loss_agg_mode), dtype=torch.float64,
                            device=self.model.device)
        dist.all_reduce(norm, group=self.model.groups.dp)  # the mini-batch's count over all DP ranks
        global_norm = float(norm)

        def loss_fn(logp_BS, entropy_BS, mb):
            response_length = mb["response_mask"].shape[1]  # this micro-batch's (trimmed) response width
            is_weights_BT, tis_metrics = mb.get("rollout_is_weights"), {}
            if ppo.tis_cap is not None:
                is_weights_BT, tis_metrics = tis_weights(mb["old_log_probs"], mb["rollout_log_probs"],
                                                         mb["response_mask"], cap=ppo.tis_cap, level=ppo.tis_level)
            loss, metrics = policy_loss(
                response_slice(logp_BS, response_length), mb["old_log_probs"], mb["advantages"], mb["response_mask"],
                loss_agg_mode=ppo.loss_agg_mode, global_norm=global_norm, policy_loss_mode=ppo.policy_loss_mode,
                clip_ratio_low=ppo.clip_range[0], clip_ratio_high=ppo.clip_range[1],
                clip_ratio_c=ppo.clip_ratio_c, entropy_BT=response_slice(entropy_BS, response_length),
                entropy_coeff=ppo.entropy_coeff, ref_logp_BT=mb.get("ref_log_prob"),
                kl_loss_coef=ppo.kl_loss_coef if ppo.use_kl_loss else 0.0, kl_loss_type=ppo.kl_loss_type,
                is_weights_BT=is_weights_BT,
            )
            return loss, {**metrics, **{k: torch.tensor(v) for k, v in tis_metrics.items()}}

        micro, _ = micro_batches(mini, keys,
                                 size=None if ppo.use_dynamic_bsz else ppo.ppo_micro_batch_size_per_gpu,
                                 max_tokens=ppo.ppo_max_token_len_per_gpu if ppo.use_dynamic_bsz else None,
                                 multiple_of=self.model.micro_multiple, **self.model.token_layout)
        result = self.model.train_step(micro, loss_fn, temperature=temperature,
                                       replay_routing=self.config.router_replay.replay)
        # pg_loss is each micro-batch's share of the mini-batch loss: the model averaged the
        # shares over all micro-batches of all DP ranks, the mini-batch value is their sum.
        if "pg_loss" in result.metrics:
            result.metrics["pg_loss"] *= self.model.last_num_micro_batches
        return result
