"""LoRA adapters on SGLang's wire (``/load_lora_adapter_from_tensors``): PEFT's names, its ``adapter_config.json``
and the checksums every engine rank checks. The trainer's side is :mod:`megarl.sync.adapters`; megarl's CPU engine
server's is :mod:`megarl.engines.cpu_engine.lora`.

Tensors travel whole, PEFT-named (``base_model.model.<HF module>.lora_A.weight`` ``[rank, in]`` and
``.lora_B.weight`` ``[out, rank]``): every engine TP rank takes the whole adapter and slices its part itself
(SGLang's ``slice_lora_a_weights`` / ``slice_lora_b_weights``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

ADAPTER_NAME = "megarl-actor"
"""The name a run's adapter has in its engines (``lora_name``; every generation request's ``lora_path``)."""
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, as SGLang's TP worker computes it for ``expected_checksums``."""
    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_checksum(tensor) for name, tensor in tensors.items()}


def check_checksums(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, str], *, where: str) -> None:
    """SGLang's check of a received adapter: every expected tensor there with its bytes, nothing else."""
    mismatch = [n for n, want in expected.items() if n in tensors and tensor_checksum(tensors[n]) != want]
    missing = [n for n in expected if n not in tensors]
    extra = [n for n in tensors if n not in expected]
    if mismatch or missing or extra:
        raise RuntimeError(f"{where}: adapter sync MISMATCH of {len(expected)} expected: {len(mismatch)} value-diff "
                           f"{mismatch[:5]}, {len(missing)} missing {missing[:5]}, {len(extra)} extra {extra[:5]}")


def module_of(name: str) -> tuple[str, str]:
    """``(HF module path, "A" | "B")`` of a PEFT tensor name; ``ValueError`` for another name."""
    for suffix in LORA_SUFFIXES:
        if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
            return name[len(PEFT_PREFIX):-len(suffix)], suffix[len(".lora_")]
    raise ValueError(f"{name!r} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>{LORA_SUFFIXES[0]} or "
                     f"{LORA_SUFFIXES[1]})")
