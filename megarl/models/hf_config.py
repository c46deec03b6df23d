"""Reading a model directory's HF config as megarl does.

:func:`read_hf_config` is transformers' ``AutoConfig`` but for checkpoints whose ``model_type`` transformers has no
config class for and a family reads with another's (:attr:`megarl.models.family.ModelFamily.config_aliases`: Kimi-K2's
``kimi_k2`` as DeepSeek-V3's); :func:`load_hf_config` is megarl's view of it (a vision-language model's text config,
:func:`megarl.models.vision.model_config`).
"""

from __future__ import annotations

import json
from pathlib import Path

from megarl.models.family import FAMILIES
from megarl.models.vision import model_config


def load_hf_config(path, *, trust_remote_code: bool = False):
    """The HF config in ``path`` as megarl reads it (:func:`model_config` of :func:`read_hf_config`)."""
    return model_config(read_hf_config(path, trust_remote_code=trust_remote_code))


def read_hf_config(path, *, trust_remote_code: bool = False):
    """The transformers config of the HF model directory ``path``.

    A ``model_type`` transformers does not know that a family names in its :attr:`ModelFamily.config_aliases` is read
    with the config class it names (the repository's own config code needs ``trust_remote_code``, and is then used
    instead); the directory's ``config.json`` stays as it is (conversions and exports copy it)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = Path(path) / "config.json"
    if not trust_remote_code and file.is_file():
        fields = json.loads(file.read_text())
        model_type = fields.get("model_type") if isinstance(fields, dict) else None
        alias = config_alias(model_type) if model_type and model_type not in CONFIG_MAPPING else None
        if alias is not None:
            fields = {k: v for k, v in fields.items() if k not in ("model_type", "auto_map")}
            return CONFIG_MAPPING[alias].from_dict(fields)
    return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def config_alias(model_type: str) -> str | None:
    """The transformers ``model_type`` a family reads ``model_type`` checkpoints as (None: no family does; importing
    this module imports ``megarl.models``, which registers every family)."""
    for family in FAMILIES.values():
        for name, alias in family.config_aliases:
            if name == model_type:
                return alias
    return None
