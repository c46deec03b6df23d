"""Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection of the tokens or
sequences whose rollout policy is too far from the training policy.

The engine samples with its own kernels and precision (FP8 rollout, another backend, stale weights), so the
behaviour policy ``π_rollout`` (``rollout_log_probs``) differs from the ``π_old`` the trainer recomputes
(``old_log_probs``). With ``log r = log π_old − log π_rollout`` per token:

- **IS** (``rollout_is``): importance weights multiplying each token's policy-gradient term, ``token``: ``r_t``,
  ``sequence``: ``∏_t r_t`` over the row's tokens; truncated above at ``rollout_is_threshold`` (TIS), after a safety
  clamp of ``log r`` to [−20, 20]; 0 on padding; optionally normalised to mean 1 over the batch's tokens (sequences).
- **RS** (``rollout_rs``, comma-separated, all applied): rejection of tokens or whole sequences by a statistic of
  the per-token estimators ``k1 = −log r`` (``log π_rollout/π_old``), ``k2 = ½ (log r)²``, ``k3 = r − 1 − log r``:
  ``token_k*`` per token, ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k*`` per sequence. ``k1`` options keep a
  statistic within ``[log lower, log upper]`` (``rollout_rs_threshold`` ``"lower_upper"``, or one number ``u``
  meaning ``1/u_u``): ``token_k1`` is IcePop's two-sided token mask, ``seq_mean_k1`` bounds the geometric mean ratio;
  ``k2``/``k3`` options keep a statistic at most the threshold. Rejected tokens leave the loss mask.

Metrics (``rollout_corr/*``, verl's names): the gap before correction (``kl``, ``k3_kl``, ``chi2_token``,
``chi2_seq``, ``training_ppl``, ``rollout_ppl``, ``log_ppl_diff``, ``ppl_ratio``), the weights
(``rollout_is_mean/std/min/max``, ``rollout_is_ratio_fraction_high/low``, ``rollout_is_eff_sample_size``,
``rollout_is_batch_norm_factor``), the rejection (``rollout_rs_masked_fraction``, ``rollout_rs_seq_masked_fraction``,
``rollout_rs_<option>_masked_fraction``), and the gap that remains over the kept tokens, with the weights applied
(``kept_kl``, ``kept_k3_kl``: the correction's effect).

Shape legend: ``B`` rows, ``T`` response tokens.
"""

from __future__ import annotations

import math

import torch

from megarl.algo.masked import masked_mean, masked_sum

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""The rejection statistics ``rollout_rs`` may name (verl's)."""
SAFETY_BOUND = 20.0
"""``log r`` is clamped to ``[-20, 20]`` before it is exponentiated."""


def parse_rs(options: str | None, thresholds: str | float | None, key: str = "algorithm.rollout_correction"
             ) -> list[tuple[str, float | None, float]]:
    """``(option, lower, upper)`` per rejection option of ``rollout_rs`` (``lower`` for ``k1`` options, None
    otherwise), from ``rollout_rs_threshold``: one spec shared by all options or one per option, comma-separated;
    errors name ``key``."""
    if not options:
        return []
    names = list(dict.fromkeys(part.strip() for part in str(options).split(",") if part.strip()))
    unknown = [name for name in names if name not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"{key}.rollout_rs names {unknown}; use some of {list(RS_OPTIONS)}, comma-separated")
    if thresholds is None:
        raise ValueError(f"{key}.rollout_rs={options!r} needs {key}.rollout_rs_threshold")
    specs = [part.strip() for part in str(thresholds).split(",") if part.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"{key}.rollout_rs_threshold={thresholds!r}: give one threshold for all of rollout_rs or one "
                         f"per option ({len(names)})")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, spec in zip(names, specs):
        try:
            if name.endswith("k1"):
                lower, _, upper = spec.partition("_")
                upper_value = float(upper) if upper else float(lower)
                lower_value = float(lower) if upper else 1.0 / upper_value
            else:
                if "_" in spec:
                    raise ValueError
                lower_value, upper_value = None, float(spec)
        except ValueError:
            raise ValueError(f"{key}.rollout_rs_threshold {spec!r} for {name}: k1 options take 'lower_upper' ratio "
                             f"bounds (or one upper bound u, meaning 1/u_u), k2/k3 options one upper bound") from None
        if upper_value <= 0 or (lower_value is not None and not 0 < lower_value <= upper_value):
            raise ValueError(f"{key}.rollout_rs_threshold {spec!r} for {name}: bounds must be positive, lower <= upper")
        out.append((name, lower_value, upper_value))
    return out


def _log_ratio(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    log_ratio_BT = (old_logp_BT.float() - rollout_logp_BT.float()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.where(mask_BT.bool(), log_ratio_BT, torch.zeros_like(log_ratio_BT))


def _valid_rows(mask_BT: torch.Tensor) -> torch.Tensor:
    return mask_BT.sum(dim=-1) > 0


@torch.no_grad()
def is_weights(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *, level: str,
               threshold: float, batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``[B, T]`` (module docstring) and their metrics."""
    log_ratio_BT = _log_ratio(old_logp_BT, rollout_logp_BT, mask_BT)
    if level == "sequence":
        log_ratio_BT = masked_sum(log_ratio_BT, mask_BT, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        log_ratio_BT = log_ratio_BT.unsqueeze(-1).expand_as(mask_BT)
    elif level != "token":
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}; use one of {IS_LEVELS} or null")
    valid = mask_BT.bool()
    raw_BT = log_ratio_BT.exp()
    weights_BT = torch.where(valid, raw_BT.clamp(max=threshold), torch.zeros_like(raw_BT))
    metrics = {"rollout_is_ratio_fraction_high": float(masked_mean((raw_BT > threshold).float(), mask_BT)),
               "rollout_is_ratio_fraction_low": float(masked_mean((raw_BT < 1.0 / threshold).float(), mask_BT))}
    if batch_normalize:
        if level == "sequence":
            rows = _valid_rows(mask_BT)
            mean = weights_BT[:, 0][rows].mean() if bool(rows.any()) else torch.tensor(1.0)
        else:
            mean = masked_mean(weights_BT, mask_BT)
        factor = 1.0 / float(mean) if float(mean) > 0 else 1.0
        weights_BT = weights_BT * factor
        metrics["rollout_is_batch_norm_factor"] = factor
    values = weights_BT[valid]
    if values.numel():
        metrics |= {"rollout_is_mean": float(values.mean()), "rollout_is_std": float(values.std(unbiased=False)),
                    "rollout_is_min": float(values.min()), "rollout_is_max": float(values.max()),
                    # Kish's effective sample size of the weights, as a share of the tokens.
                    "rollout_is_eff_sample_size": float(values.sum() ** 2 / (values.pow(2).sum() * values.numel()))}
    return weights_BT, metrics


@torch.no_grad()
def rejection_mask(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                   options: list[tuple[str, float | None, float]]) -> tuple[torch.Tensor, dict[str, float]]:
    """The kept tokens ``[B, T]`` (1 kept, 0 rejected or padding) after every option of :func:`parse_rs`, and the
    rejection's metrics."""
    log_ratio_BT = _log_ratio(old_logp_BT, rollout_logp_BT, mask_BT)
    stats = {"k1": -log_ratio_BT, "k2": 0.5 * log_ratio_BT ** 2, "k3": log_ratio_BT.exp() - 1.0 - log_ratio_BT}
    valid = mask_BT.bool()
    keep_BT = valid.clone()
    metrics: dict[str, float] = {}
    for name, lower, upper in options:
        level, estimator = name.rsplit("_", 1)
        stat = stats[estimator]
        if level == "seq_sum":
            stat = masked_sum(stat, mask_BT, dim=-1).unsqueeze(-1)
        elif level == "seq_mean":
            stat = masked_mean(stat, mask_BT, dim=-1).unsqueeze(-1)
        elif level == "seq_max":
            stat = stat.masked_fill(~valid, float("-inf")).max(dim=-1).values.unsqueeze(-1)
        if lower is not None:
            passed = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            passed = stat <= upper
        passed = passed.expand_as(mask_BT)
        metrics[f"rollout_rs_{name}_masked_fraction"] = float(masked_mean((~passed).float(), mask_BT))
        keep_BT &= passed
    rows = _valid_rows(mask_BT)
    rejected_rows = (valid & ~keep_BT).any(dim=-1) & rows
    metrics["rollout_rs_masked_fraction"] = float(masked_mean((~keep_BT).float(), mask_BT))
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected_rows.sum()) / max(int(rows.sum()), 1)
    return keep_BT.to(mask_BT.dtype), metrics


@torch.no_grad()
def offpolicy_metrics(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor
                      ) -> dict[str, float]:
    """The gap between the two policies on ``mask_BT``'s tokens (module docstring; before any correction)."""
    if not bool(mask_BT.bool().any()):
        return {}
    log_ratio_BT = _log_ratio(old_logp_BT, rollout_logp_BT, mask_BT)
    rows = _valid_rows(mask_BT)
    training_log_ppl = -masked_mean(old_logp_BT.float(), mask_BT, dim=-1)[rows]
    rollout_log_ppl = -masked_mean(rollout_logp_BT.float(), mask_BT, dim=-1)[rows]
    seq_log_ratio = masked_sum(log_ratio_BT, mask_BT, dim=-1)[rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "kl": float(masked_mean(-log_ratio_BT, mask_BT)),
        "k3_kl": float(masked_mean(log_ratio_BT.exp() - 1.0 - log_ratio_BT, mask_BT)),
        "chi2_token": float(masked_mean(log_ratio_BT.exp() ** 2, mask_BT) - 1.0),
        "chi2_seq": float((seq_log_ratio.exp() ** 2).mean() - 1.0),
        "training_ppl": float(training_log_ppl.exp().mean()), "rollout_ppl": float(rollout_log_ppl.exp().mean()),
        "training_log_ppl": float(training_log_ppl.mean()), "rollout_log_ppl": float(rollout_log_ppl.mean()),
        "log_ppl_diff": float((rollout_log_ppl - training_log_ppl).mean()),
        "log_ppl_abs_diff": float((rollout_log_ppl - training_log_ppl).abs().mean()),
        "ppl_ratio": float((training_log_ppl - rollout_log_ppl).exp().mean()),
    }


@torch.no_grad()
def kept_gap(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
             weights_BT: torch.Tensor | None) -> dict[str, float]:
    """The gap left over the kept tokens, each weighted by its IS weight when there are weights: ``kept_kl`` and
    ``kept_k3_kl`` (0 when every token was rejected)."""
    log_ratio_BT = _log_ratio(old_logp_BT, rollout_logp_BT, mask_BT)
    weight_BT = mask_BT.float() if weights_BT is None else weights_BT.float() * mask_BT.float()
    total = float(weight_BT.sum())
    if total <= 0:
        return {"kept_kl": 0.0, "kept_k3_kl": 0.0}
    k3_BT = log_ratio_BT.exp() - 1.0 - log_ratio_BT
    return {"kept_kl": float((-log_ratio_BT * weight_BT).sum()) / total,
            "kept_k3_kl": float((k3_BT * weight_BT).sum()) / total}
