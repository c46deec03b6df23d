"""HF <-> Megatron conversion at any TP/PP: loading, streaming export, distributed checkpoints."""

from megarl.convert.dist_checkpoint import load_dist_checkpoint, save_dist_checkpoint
from megarl.convert.export import WeightExporter, iter_hf_shards, iter_hf_weights
from megarl.convert.loader import load_hf_into

__all__ = [
    "WeightExporter",
    "iter_hf_shards",
    "iter_hf_weights",
    "load_dist_checkpoint",
    "load_hf_into",
    "save_dist_checkpoint",
]
