"""Vision-language families: an HF vision tower in front of Megatron's GPTModel with multimodal RoPE.

A vision-language checkpoint (Qwen2.5-VL: ``Qwen2_5_VLForConditionalGeneration``) is a language model, a vision
tower and its merger. megarl runs the language model as every other family's, in Megatron's ``GPTModel`` (tensor,
pipeline and sequence parallel, packed or padded), with Megatron's multimodal rotary positions (``mrope``: each
token has a temporal, a height and a width position, and the head dimension's frequencies are split into those
three sections). The vision tower is the transformers module itself, replicated on every tensor-parallel rank of
the first pipeline stage (:class:`VisionGPTModel`): it turns an image's patches into one embedding per merged
patch, which replaces the image's placeholder tokens in the word embeddings before the first layer. Its
parameters are ``vision_model.<name>`` in Megatron and ``visual.<name>`` in the checkpoint (the hub's names,
which transformers writes), copied whole by loading, export and weight sync (:meth:`VisionSpec.weight_rules`).

Gradients: with or without sequence parallelism, the gradient reaching the merged embeddings is the whole one on
every tensor-parallel rank (the first layer's column-parallel projections all-reduce their input gradient), so
the replicated tower's gradients agree across TP ranks without any reduction of their own; Megatron counts them
once in the gradient norm (they have no ``tensor_model_parallel`` attribute).

Configs. transformers keeps the language model's sizes in ``text_config``; :func:`model_config` gives megarl's
view of such a config: the text config with the checkpoint's ``architectures``, ``tie_word_embeddings``,
``vision_config`` and token ids on it, and the whole config as ``multimodal_config`` (every sizing, loading and
planning path then reads one config as for a text model).

Positions: :meth:`VisionSpec.position_ids` numbers a row's tokens as the checkpoint's model does (text tokens
consecutively on all three axes; an image's merged patches at (t, h, w) grid positions after the text before it,
the text after it continuing from the largest), which is what the rollout engines number them by.

Context parallelism is refused: Megatron's multimodal RoPE splits positions into contiguous CP chunks, where
megarl's CP split is load-balanced (zigzag).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from collections.abc import Sequence

import torch

from megarl.models.weights import Split, WeightRule

_TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """The vision tower of a vision-language family and how its images reach the language model."""

    tower: str
    """``module:Class`` of the transformers vision tower (built from the checkpoint's ``vision_config``)."""
    hf_prefix: str = "visual."
    """The tower's tensor names in the checkpoint (the hub's spelling)."""
    megatron_prefix: str = "vision_model."
    """The tower's parameter names in the Megatron model (:class:`VisionGPTModel`'s attribute)."""
    checkpoint_renames: tuple[tuple[str, str], ...] = (("model.language_model.", "model."), ("model.visual.", "visual."))
    """transformers' parameter-name prefixes and the checkpoint's (Qwen2.5-VL's hub checkpoints predate
    transformers' ``model.language_model.`` layout; Qwen3-VL's use it: no renames)."""
    mrope: str = "sections"
    """How the head dimension's rotary frequencies are shared by the three axes: ``sections`` (Qwen2/2.5-VL: the
    first ``mrope_section[0]`` frequencies temporal, the next height, the last width) or ``interleaved`` (Qwen3-VL:
    frequency ``j`` height when ``j % 3 == 1`` and ``j < 3 · mrope_section[1]``, width when ``j % 3 == 2`` and
    ``j < 3 · mrope_section[2]``, else temporal)."""
    deepstack: bool = False
    """Qwen3-VL's DeepStack: the tower also returns features of some inner blocks (``deepstack_visual_indexes``),
    the ``k``-th added to the image tokens' hidden states after language-model layer ``k``."""

    def deepstack_layers(self, hf_config) -> int:
        """How many first language-model layers take DeepStack features (0 without DeepStack)."""
        return len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or []) if self.deepstack else 0

    # ------------------------------------------------------------------------------------------------- tower
    def tower_class(self):
        module, name = self.tower.split(":")
        return getattr(importlib.import_module(module), name)

    def build_tower(self, hf_config, dtype: torch.dtype, device: torch.device | str | int | None = None
                    ) -> torch.nn.Module:
        """The vision tower for ``hf_config`` (megarl's view, :func:`model_config`), randomly initialised, built on
        ``device`` (default: torch's): its buffers too (the rotary's ``inv_freq``), which nothing moves later
        (Megatron's DDP moves parameters into its CUDA buffers, not buffers)."""
        vision = copy.deepcopy(hf_config.vision_config)
        vision._attn_implementation = "sdpa"
        with torch.device(torch.get_default_device() if device is None else device):
            return self.tower_class()._from_config(vision, dtype=dtype)

    def checkpoint_shapes(self, hf_config) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint (language model and tower) by its hub name, with its shape."""
        return dict(_checkpoint_shapes(self, hf_config.multimodal_config))

    def tensor_shapes(self, hf_config) -> dict[str, tuple[int, ...]]:
        """Every tower tensor by checkpoint name, with its shape."""
        return {n: s for n, s in self.checkpoint_shapes(hf_config).items() if n.startswith(self.hf_prefix)}

    def weight_rules(self, hf_config) -> tuple[WeightRule, ...]:
        """One replicated rule per tower tensor, in the tower's order."""
        names = [n.removeprefix(self.hf_prefix) for n in self.tensor_shapes(hf_config)]
        return tuple(WeightRule(self.megatron_prefix + n, (self.hf_prefix + n,), Split.REPLICATED, first_stage=True)
                     for n in names)

    # ------------------------------------------------------------------------------------------- positions
    @staticmethod
    def mrope_section(hf_config) -> list[int]:
        """The head dimension's rotary frequencies per axis (temporal, height, width), from the text config."""
        params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        section = params.get("mrope_section")
        if not section or len(section) != 3:
            raise ValueError(f"the vision-language config's rope_parameters has mrope_section={section!r}; "
                             "it needs three sizes (temporal, height, width)")
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)
        if 2 * sum(section) != head_dim:
            raise ValueError(f"rope_parameters.mrope_section={section} covers {2 * sum(section)} of the head "
                             f"dimension {head_dim}: the three sections must cover it exactly")
        return [int(s) for s in section]

    @staticmethod
    def layout(hf_config, input_ids_S: torch.Tensor, grid_thw: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([S, 3] positions, [S] image mask)`` of one row's tokens ``input_ids_S`` (no padding), whose images have
        the patch grids ``grid_thw`` ``[images, 3]`` in order: each run of placeholder tokens right after a
        vision-start token holds an image, whole; any other placeholder (one the model generated) is text, as SGLang
        reads it. Positions: text tokens consecutively on all three axes, an image's merged patches at their (t, h, w)
        grid positions after the text before it, the text after it going on from its start + max(h, w)."""
        image = int(hf_config.image_token_id)
        start = getattr(hf_config, "vision_start_token_id", None)
        merge = int(hf_config.vision_config.spatial_merge_size)
        ids = input_ids_S.tolist()
        grids = [] if grid_thw is None else [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        out = torch.empty(len(ids), 3, dtype=torch.long)
        is_image = torch.zeros(len(ids), dtype=torch.bool)

        def opens_image(i: int) -> bool:  # a run of placeholders right after a vision-start token (SGLang's reading)
            return ids[i] == image and (start is None or (i > 0 and ids[i - 1] == int(start)))

        current, i, k = 0, 0, 0
        while i < len(ids):
            if not opens_image(i):  # text
                j = i + 1
                while j < len(ids) and not opens_image(j):
                    j += 1
                out[i:j] = torch.arange(current, current + j - i)[:, None]
                current += j - i
                i = j
                continue
            run = i
            while run < len(ids) and ids[run] == image:
                run += 1
            first = k
            while i < run:  # the run holds whole images, in order
                if k == len(grids):
                    raise ValueError(f"the {run - i} placeholder tokens (token {image}) at position {i} are left over "
                                     f"after the row's {len(grids)} image(s); each image needs grid t·h·w / "
                                     f"{merge}² placeholders")
                t, h, w = grids[k][0], grids[k][1] // merge, grids[k][2] // merge
                n = t * h * w
                if i + n > run:
                    raise ValueError(f"the {run - i} placeholder tokens at position {i} do not hold image {k} "
                                     f"(grid {list(grids[k])}: {n} tokens); images {first}..{k} of the row's grids "
                                     f"{[list(g) for g in grids]} must match its placeholder runs")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                out[i:i + n] = torch.stack([tt, hh, ww], dim=-1).reshape(n, 3) + current
                is_image[i:i + n] = True
                current += max(h, w)
                i, k = i + n, k + 1
        if k != len(grids):
            raise ValueError(f"the row has {len(grids)} image grids but {k} images (placeholder runs)")
        return out, is_image

    @classmethod
    def position_ids(cls, hf_config, input_ids_S: torch.Tensor, grid_thw: torch.Tensor | None) -> torch.Tensor:
        """``[S, 3]`` positions of one row's tokens (:meth:`layout`)."""
        return cls.layout(hf_config, input_ids_S, grid_thw)[0]

    def prompts(self, hf_config, prompts: Sequence[Sequence[int]], row_inputs: Sequence[dict | None]):
        """The :class:`~megarl.models.sampling.VisionPrompts` of ``prompts`` (each image's placeholders expanded),
        whose rows have the vision inputs ``row_inputs`` (``pixel_values``, ``image_grid_thw``; None: none)."""
        from megarl.models.sampling import VisionPrompts
        from megarl.parallel.pipeline import vision_inputs

        positions = [self.position_ids(hf_config, torch.as_tensor(list(ids)),
                                       None if not inputs else inputs["image_grid_thw"])
                     for ids, inputs in zip(prompts, row_inputs, strict=True)]
        return VisionPrompts(positions, vision_inputs(row_inputs))

    def batch_layout(self, hf_config, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor,
                     vision_inputs: Sequence[dict | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, S, 3] positions, [B, S] image mask)`` of a batch (rows with contiguous tokens; 0 / False on
        padding; :meth:`layout`)."""
        positions = torch.zeros(*input_ids_BS.shape, 3, dtype=torch.long)
        images = torch.zeros(input_ids_BS.shape, dtype=torch.bool)
        mask = attention_mask_BS.bool().cpu()
        for row, inputs in enumerate(vision_inputs):
            grid = None if not inputs else inputs.get("image_grid_thw")
            positions[row, mask[row]], images[row, mask[row]] = self.layout(hf_config, input_ids_BS[row].cpu()[mask[row]],
                                                                            grid)
        return positions.to(input_ids_BS.device), images.to(input_ids_BS.device)


_SHAPES: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {}


def _checkpoint_shapes(spec: VisionSpec, multimodal_config) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every tensor of the checkpoint for ``multimodal_config`` by its hub name, with its shape: transformers'
    model built once per config on the meta device, its names written as the hub's (:func:`hub_name`)."""
    from transformers import AutoModelForImageTextToText

    key = multimodal_config.to_json_string(use_diff=False)
    if key not in _SHAPES:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(copy.deepcopy(multimodal_config))
        shapes = [(hub_name(name, spec), tuple(tensor.shape)) for name, tensor in model.state_dict().items()]
        _SHAPES[key] = tuple(shapes)
    return _SHAPES[key]


def is_multimodal(hf_config) -> bool:
    """Whether ``hf_config`` (megarl's view) is a vision-language model's."""
    return getattr(hf_config, "multimodal_config", None) is not None


def model_config(raw_config):
    """megarl's view of an HF config: a vision-language config's text config carrying the checkpoint's
    architectures, tied embeddings, vision config and token ids (and the whole config as ``multimodal_config``);
    any other config as it is."""
    text = getattr(raw_config, "text_config", None)
    if text is None or getattr(raw_config, "vision_config", None) is None or is_multimodal(raw_config):
        return raw_config
    view = copy.deepcopy(text)
    view.architectures = list(getattr(raw_config, "architectures", None) or [])
    view.tie_word_embeddings = bool(getattr(raw_config, "tie_word_embeddings", False))
    view.vision_config = raw_config.vision_config
    for name in _TOKEN_IDS:
        setattr(view, name, getattr(raw_config, name, None))
    view.multimodal_config = raw_config
    return view


def hub_name(name: str, spec: VisionSpec) -> str:
    """A transformers vision-language model's parameter name as the hub's checkpoints (and SGLang) spell it
    (:attr:`VisionSpec.checkpoint_renames`)."""
    for old, new in spec.checkpoint_renames:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def raw_config(hf_config):
    """The HF config as transformers reads and writes it (a vision-language model's whole config, not megarl's view
    of it: :func:`model_config`)."""
    return getattr(hf_config, "multimodal_config", None) or hf_config


def build_vision_gpt_model(family, hf_config, *, pre_process: bool, **kwargs):
    """A :class:`VisionGPTModel` chunk (the tower on the first stage only); ``kwargs`` as for ``GPTModel``."""
    cls = _vision_gpt_class()
    return cls(family.vision, hf_config, pre_process=pre_process, **kwargs)


@functools.lru_cache(maxsize=1)
def _vision_gpt_class():
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    class VisionGPTModel(GPTModel):
        """Megatron's GPTModel with a vision tower before its embedding (see the module docstring).

        ``forward`` takes the micro-batch's ``vision_inputs`` (:func:`megarl.parallel.pipeline.vision_inputs`) on the
        first stage:
        the tower's embeddings replace the image placeholder tokens, in the row-major order of ``input_ids``
        (packed or padded rows keep their order and their tokens' order). ``position_ids`` are ``[3, b, t]``.
        """

        def __init__(self, spec: VisionSpec, hf_config, *, pre_process: bool, **kwargs):
            super().__init__(pre_process=pre_process, **kwargs)
            self.image_token_id = int(hf_config.image_token_id)
            # On the device Megatron builds every other parameter on (CUDA unless use_cpu_initialization).
            device = "cpu" if self.config.use_cpu_initialization else torch.cuda.current_device()
            self.vision_model = spec.build_tower(hf_config, self.config.params_dtype, device) if pre_process else None
            if spec.mrope == "interleaved":
                self.rotary_pos_emb.__class__ = _interleaved_mrope_class()
            self._deepstack: list[torch.Tensor] | None = None  # this forward's DeepStack additions, layer by layer
            for layer in range(spec.deepstack_layers(hf_config) if pre_process else 0):
                self.decoder.layers[layer].register_forward_hook(functools.partial(_add_deepstack, self, layer))

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args, vision_inputs=None,
                    **kwargs):
            self._deepstack = None
            if self.pre_process and decoder_input is None and vision_inputs is not None:
                decoder_input = self._embed_with_images(input_ids, vision_inputs)
            try:
                return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)
            finally:
                self._deepstack = None

        def _embed_with_images(self, input_ids_bt: torch.Tensor, vision_inputs: dict) -> torch.Tensor:
            # The whole [b, t, H] embeddings on every TP rank: with sequence parallelism the vocabulary-parallel
            # embedding would reduce-scatter its output over the sequence, before the images are in.
            words = self.embedding.word_embeddings
            reduce_scatter, words.reduce_scatter_embeddings = words.reduce_scatter_embeddings, False
            try:
                embeds_btH = words(input_ids_bt)
            finally:
                words.reduce_scatter_embeddings = reduce_scatter
            pixels = vision_inputs["pixel_values"].to(embeds_btH.device, self.config.params_dtype)
            grid = vision_inputs["image_grid_thw"].to(embeds_btH.device)
            tower = self.vision_model(pixels, grid_thw=grid)
            images_nH = tower.pooler_output.to(embeds_btH.dtype)
            # The placeholders that hold images (a placeholder the model generated is text): the pipeline's mask,
            # else every placeholder.
            mask_bt = vision_inputs.get("image_mask")
            mask_bt = input_ids_bt == self.image_token_id if mask_bt is None else mask_bt.to(input_ids_bt.device)
            if int(mask_bt.sum()) != images_nH.shape[0]:
                raise ValueError(f"the micro-batch has {int(mask_bt.sum())} image placeholder tokens "
                                 f"({self.image_token_id}) but its {grid.shape[0]} images make {images_nH.shape[0]} "
                                 "embeddings: each image needs grid t·h·w / merge² placeholders")
            embeds_btH = embeds_btH.masked_scatter(mask_bt[..., None], images_nH)
            embeds_tbH = embeds_btH.transpose(0, 1).contiguous()
            if self.config.sequence_parallel:
                embeds_tbH = tensor_parallel.scatter_to_sequence_parallel_region(embeds_tbH)
            deepstack = getattr(tower, "deepstack_features", None)
            if deepstack:  # each layer's additions, as the hidden states are laid out (split by SP like them)
                self._deepstack = []
                for features_nH in deepstack:
                    added_btH = torch.zeros_like(embeds_btH).masked_scatter(mask_bt[..., None],
                                                                            features_nH.to(embeds_btH.dtype))
                    added_tbH = added_btH.transpose(0, 1).contiguous()
                    if self.config.sequence_parallel:
                        added_tbH = tensor_parallel.scatter_to_sequence_parallel_region(added_tbH)
                    self._deepstack.append(added_tbH)
            return embeds_tbH

    return VisionGPTModel


def _add_deepstack(model, layer: int, module, args, output):
    """Forward hook of language-model layer ``layer``: add this forward's DeepStack features for it (Qwen3-VL) to
    the layer's output hidden states (zeros off the image tokens)."""
    if model._deepstack is None or layer >= len(model._deepstack):
        return output
    hidden, context = output
    return hidden + model._deepstack[layer], context


@functools.lru_cache(maxsize=1)
def _interleaved_mrope_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
        """Megatron's multimodal RoPE with Qwen3-VL's interleaved axes (:attr:`VisionSpec.mrope`)."""

        def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
            if self.rotary_interleaved:
                raise ValueError("interleaved multimodal RoPE takes rotate-half frequencies (rotary_interleaved=False)")
            seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            if self.seq_len_interpolation_factor is not None:
                seq = seq / self.seq_len_interpolation_factor
            freqs = seq[..., None].float() * self.inv_freq  # [3, b, s, dim / 2]
            mixed = freqs[0].clone()
            for axis in (1, 2):
                mixed[..., axis:3 * mrope_section[axis]:3] = freqs[axis, ..., axis:3 * mrope_section[axis]:3]
            emb = torch.cat((mixed, mixed), dim=-1)  # [b, s, dim]
            return emb[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, dim]

    return InterleavedMultimodalRotaryEmbedding
