"""LoRA's settings (``actor_rollout_ref.model.lora_rank`` / ``lora_alpha`` / ``target_modules``, verl's names): which
of Megatron's linear layers get adapters (:mod:`megarl.models.lora` builds them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
"""Column-parallel layers an adapter can target (Megatron's names)."""
ROW_TARGETS = ("linear_proj", "linear_fc2")
"""Row-parallel layers an adapter can target."""
TARGETS = COLUMN_TARGETS + ROW_TARGETS
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
"""HF (PEFT) module names and the Megatron layer each is part of."""
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which layers get adapters, of what rank, scaled by ``alpha / rank``."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    init_b: str = "zeros"
    """``zeros`` (PEFT's: a fresh adapter leaves the model as it was) or ``random`` (tests)."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def hf_target_modules(self) -> list[str]:
        """PEFT's (and SGLang's ``--lora-target-modules``) names of the adapted modules."""
        return sorted(m for m, layer in HF_TARGETS.items() if layer in self.targets)

    def peft_config(self, base_model: str | None = None) -> dict:
        """PEFT's ``adapter_config.json`` of these adapters (plain LoRA: no bias, dropout, rsLoRA or DoRA)."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
            "target_modules": self.hf_target_modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True, "base_model_name_or_path": base_model or None,
        }


def lora_targets(target_modules: str | Sequence[str], *, setting: str = "actor_rollout_ref.model.target_modules"
                 ) -> tuple[str, ...]:
    """Megatron layer names from verl's ``target_modules``: ``all-linear``, Megatron's names (``linear_qkv``,
    ``linear_proj``, ``linear_fc1``, ``linear_fc2``) or PEFT's (``q_proj`` ... ``down_proj``). A fused layer is
    adapted whole, so PEFT names must name all of its parts (``q_proj``, ``k_proj`` and ``v_proj`` together)."""
    if isinstance(target_modules, str):
        if target_modules == ALL_LINEAR:
            return TARGETS
        target_modules = [target_modules]
    names = list(target_modules)
    if not names:
        raise ValueError(f"{setting} is empty: name the layers to adapt ({ALL_LINEAR!r}, {list(TARGETS)} or "
                         f"PEFT's {list(HF_TARGETS)})")
    unknown = [n for n in names if n not in TARGETS and n not in HF_TARGETS and n != ALL_LINEAR]
    if unknown:
        raise ValueError(f"{setting}: unknown module(s) {unknown}; use {ALL_LINEAR!r}, Megatron's {list(TARGETS)} "
                         f"or PEFT's {list(HF_TARGETS)}")
    if ALL_LINEAR in names:
        return TARGETS
    chosen = set()
    for name in names:
        layer = HF_TARGETS.get(name, name)
        if name in HF_TARGETS:
            parts = sorted(n for n, fused in HF_TARGETS.items() if fused == layer)
            missing = [p for p in parts if p not in names and layer not in names]
            if missing:
                raise ValueError(f"{setting}: {name!r} is part of Megatron's fused {layer!r} ({parts}), which is "
                                 f"adapted whole: add {missing} or name {layer!r}")
        chosen.add(layer)
    return tuple(t for t in TARGETS if t in chosen)
