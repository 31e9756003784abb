"""The vision-language models the end-to-end benchmark trains: their configs around a text model of
a benchmark shape, and training batches with one image in each sequence.

- :data:`FAMILIES`: per model type, the released model's vision tower (its sizes as published) and
  how its processor lays an image out among the text tokens;
- :func:`image_inputs`: a batch of :class:`fk.hf.training.MarkovCorpus` tokens made a training
  batch of that family: the image's tokens in place, random pixels, the labels without the image.

The image's special tokens are the last ids of the vocabulary, never among a corpus' tokens (its
first ``active`` ids). The pixels are random, as the weights are: what is measured is the work of a
training step, not what it learns. Importing this module imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TINY_BELOW = 512
"""Text widths below this (the tiny shapes, for Triton's interpreter on a CPU) get a family's
``tiny_tower`` instead of its released one."""


@dataclass(frozen=True)
class Family:
    """A vision-language model type as the benchmark builds it."""

    text_type: str
    """The model type of its text model (whose config the shape fills)."""
    tower: dict[str, Any]
    """Its vision tower's config fields, as released."""
    tiny_tower: dict[str, Any]
    """The fields that shrink the tower for a tiny shape."""
    config: Callable[[Any, dict[str, Any], bool], Any]
    """``(text config, tower fields, tiny) ->`` the model's config (:meth:`build`)."""
    inputs: Callable[[Any, torch.Tensor, torch.Generator], dict[str, torch.Tensor]]
    """``(config, tokens, generator) ->`` the model's training inputs (:func:`image_inputs`)."""

    def build(self, text: Any, tiny: bool) -> Any:
        """The model's config around ``text``, its tower as released or, ``tiny``, shrunk."""
        return self.config(text, {**self.tower, **(self.tiny_tower if tiny else {})}, tiny)


def _special_tokens(vocab: int, *names: str) -> dict[str, int]:
    """``names`` given the last ids of a ``vocab``, the first name the last id."""
    return {name: vocab - 1 - i for i, name in enumerate(names)}


def _image_side(seq: int, patches_per_token: int) -> int:
    """Patches on a side of a square image whose tokens are about an eighth of a sequence of
    ``seq`` tokens, ``patches_per_token`` patches on a side making a token."""
    side = math.isqrt(seq // 8) * patches_per_token
    if side == 0:
        raise ValueError(f"tokens: a sequence of {seq} tokens is too short to hold an image (8 at least)")
    return side


def _place_image(tokens: torch.Tensor, begin: int, image: int, end: int, image_tokens: int) -> dict[str, torch.Tensor]:
    """``input_ids``: after each sequence's first token, ``begin``, ``image_tokens`` of ``image``,
    ``end``, then the rest of the text (the sequence keeps its length); ``labels``: the same, the
    image and its two markers left out of the loss (-100)."""
    if tokens.shape[1] < image_tokens + 4:
        raise ValueError(
            f"tokens: a sequence of {tokens.shape[1]} tokens cannot hold an image of {image_tokens} and text"
        )
    ids = tokens.clone()
    ids[:, 1], ids[:, 2 : 2 + image_tokens], ids[:, 2 + image_tokens] = begin, image, end
    labels = ids.clone()
    labels[:, : 3 + image_tokens] = -100
    return {"input_ids": ids, "labels": labels}


# ------------------------------------------------------------------------------------ Qwen2.5-VL


def _qwen_vl_config(text: Any, tower: dict[str, Any], tiny: bool) -> Any:
    """Qwen2.5-VL: its 3-D rotary sections in the family's proportions (1/4, 3/8, 3/8 of half a
    head), the tower projecting to the text model's width."""
    from transformers import CONFIG_MAPPING

    half = text.head_dim // 2
    sections = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]
    text.rope_parameters = {**text.rope_parameters, "mrope_section": sections}
    tower = {**tower, "out_hidden_size": text.hidden_size}
    ids = _special_tokens(text.vocab_size, "image_token_id", "vision_end_token_id", "vision_start_token_id",
                          "video_token_id")  # fmt: skip
    config_class: Any = CONFIG_MAPPING["qwen2_5_vl"]
    return config_class(text_config=text, vision_config=tower,
                        tie_word_embeddings=text.tie_word_embeddings, **ids)  # fmt: skip


def _qwen_vl_inputs(config: Any, tokens: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """As Qwen's processor: the image cut into patches of ``3 x 2 x 14 x 14`` values (``pixel_values``
    ``[patches, 1176]``, fp32: the model casts them), each 2 x 2 patches one token, its grid in
    ``image_grid_thw``, its tokens marked in ``mm_token_type_ids`` (their 3-D rotary positions)."""
    vision = config.vision_config
    batch, seq = tokens.shape
    side = _image_side(seq, vision.spatial_merge_size)
    feed = _place_image(tokens, config.vision_start_token_id, config.image_token_id, config.vision_end_token_id,
                        (side // vision.spatial_merge_size) ** 2)  # fmt: skip
    values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    feed["mm_token_type_ids"] = (feed["input_ids"] == config.image_token_id).int()
    feed["pixel_values"] = torch.randn(batch * side * side, values, generator=gen)
    feed["image_grid_thw"] = torch.tensor([[1, side, side]] * batch)
    return feed


# ---------------------------------------------------------------------------------------- Gemma 3


def _gemma3_config(text: Any, tower: dict[str, Any], tiny: bool) -> Any:
    """Gemma 3: the SigLIP tower's patches average-pooled to ``mm_tokens_per_image`` tokens (256 at
    896 x 896 pixels as released, 4 at 56 x 56 tiny)."""
    from transformers import CONFIG_MAPPING

    ids = _special_tokens(text.vocab_size, "image_token_index", "eoi_token_index", "boi_token_index")
    config_class: Any = CONFIG_MAPPING["gemma3"]
    return config_class(text_config=text, vision_config=tower, mm_tokens_per_image=4 if tiny else 256,
                        tie_word_embeddings=text.tie_word_embeddings, **ids)  # fmt: skip


def _gemma3_inputs(config: Any, tokens: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """As Gemma 3's processor: the whole image in ``pixel_values`` ``[images, 3, side, side]`` (fp32:
    the model casts them), its tokens marked in ``token_type_ids`` (attended both ways)."""
    vision = config.vision_config
    feed = _place_image(tokens, config.boi_token_index, config.image_token_index, config.eoi_token_index,
                        config.mm_tokens_per_image)  # fmt: skip
    feed["token_type_ids"] = (feed["input_ids"] == config.image_token_index).long()
    feed["pixel_values"] = torch.randn(tokens.shape[0], vision.num_channels, vision.image_size, vision.image_size,
                                       generator=gen)  # fmt: skip
    return feed


FAMILIES: dict[str, Family] = {
    # Qwen2.5-VL-3B's tower: 32 blocks of 1280 (670M parameters), windowed attention but in four of
    # them; an image of a side of 2 x sqrt(seq / 8) patches of 14 (448 pixels at 2048 tokens).
    "qwen2_5_vl": Family(
        "qwen2_5_vl_text",
        {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
         "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
        {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "fullatt_block_indexes": [1]},
        _qwen_vl_config, _qwen_vl_inputs,
    ),
    # Gemma 3 4B's tower: SigLIP-So400m, 27 blocks of 1152 (400M parameters), 896 x 896 pixels in
    # patches of 14, a fixed 256 tokens an image.
    "gemma3": Family(
        "gemma3_text",
        {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
         "num_attention_heads": 16, "image_size": 896, "patch_size": 14, "vision_use_head": False},
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 56},
        _gemma3_config, _gemma3_inputs,
    ),
}  # fmt: skip
"""The vision-language model types the benchmark builds, by model type."""


def image_inputs(config: Any, tokens: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """The training inputs of a model of :data:`FAMILIES` (its ``config``) for ``tokens``
    ``[batch, seq]``: one square image in each sequence, about an eighth of its tokens, after its
    first token between the family's two markers, as its processor lays it out; the labels without
    the image; random pixels (``seed``). Every tensor on the CPU."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"config: {config.model_type!r} is not one of {sorted(FAMILIES)}")
    return family.inputs(config, tokens, torch.Generator().manual_seed(seed))
