"""fk.hf.vision_language: the vision-language models bench_e2e trains. Each family builds at a
benchmark shape with its released tower, its tiny model trains on image batches laid out as its
processor does, and fk's patched model gives stock's loss and every gradient on them."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import fk.hf
from fk.hf import training, vision_language

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_hf_patching import _assert_same_loss_and_grads

TINY = training.SHAPES["tiny"]


def _tiny(family: str, device: str = "cpu") -> torch.nn.Module:
    return training.build_model(TINY, dtype=torch.float32, device=device, model_type=family)


def test_released_towers_at_a_benchmark_shape() -> None:
    """At Llama-3.2-1B's shape: Qwen2.5-VL-3B's tower projecting to the text width, its rotary
    sections half of a 64-wide head; Gemma 3 4B's SigLIP, 256 tokens an image."""
    shape = training.SHAPES["llama-3.2-1b"]
    qwen = shape.config(model_type="qwen2_5_vl")
    vision = qwen.vision_config
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (32, 1280, 2048)
    assert qwen.text_config.rope_parameters["mrope_section"] == [8, 12, 12]
    assert (qwen.text_config.hidden_size, qwen.text_config.vocab_size, qwen.tie_word_embeddings) == (2048, 128256, True)
    gemma = shape.config(model_type="gemma3")
    siglip = gemma.vision_config
    assert (siglip.num_hidden_layers, siglip.hidden_size, siglip.image_size) == (27, 1152, 896)
    assert gemma.mm_tokens_per_image == 256 and gemma.text_config.num_hidden_layers == 16
    assert gemma.image_token_index == 128255 and gemma.boi_token_index == 128253


@pytest.mark.parametrize("family", sorted(vision_language.FAMILIES))
def test_image_laid_out_as_the_processor_does(family: str) -> None:
    """After the first token: the begin marker, the image's tokens (an eighth of the sequence),
    the end marker; the labels leave those out; the rest is the corpus' text."""
    model = _tiny(family)
    tokens = training.MarkovCorpus(TINY.vocab, active=32).batch(0, 2, 32)
    feed = vision_language.image_inputs(model.config, tokens)
    ids, labels = feed["input_ids"], feed["labels"]
    image = ids[0, 2]
    assert (ids[:, 2:6] == image).all() and int((ids == image).sum()) == 2 * 4
    assert len({int(ids[0, 1]), int(image), int(ids[0, 6])}) == 3 and int(ids[:, 1:7].min()) >= TINY.vocab - 4
    assert (labels[:, :7] == -100).all() and torch.equal(labels[:, 7:], tokens[:, 7:])
    assert torch.equal(ids[:, 7:], tokens[:, 7:]) and torch.equal(ids[:, 0], tokens[:, 0])
    assert torch.isfinite(model(**feed).loss)  # the model finds as many image features as tokens


@pytest.mark.parametrize("family", sorted(vision_language.FAMILIES))
def test_patched_loss_and_gradients_match_stock_with_images(family: str, device: str) -> None:
    """fk's patched model (its fused head, vision tower included) trains on the image batch with
    stock's loss and every gradient, the tower's included."""
    stock = _tiny(family, device).train()
    model = copy.deepcopy(stock)
    assert fk.hf.apply(model)["flce"] == 1
    tokens = training.MarkovCorpus(TINY.vocab, active=32).batch(0, 2, 32)
    feed = {name: value.to(device) for name, value in vision_language.image_inputs(stock.config, tokens).items()}
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):  # (Qwen's Conv3d)
        want, got = _assert_same_loss_and_grads(stock, model, **feed)
    assert got.logits is None and want.logits is not None


def test_bad_input_named() -> None:
    model = _tiny("qwen2_5_vl")
    with pytest.raises(ValueError, match="tokens: a sequence of 7 tokens is too short"):
        vision_language.image_inputs(model.config, torch.zeros(1, 7, dtype=torch.long))
    gemma = _tiny("gemma3")
    with pytest.raises(ValueError, match="tokens: a sequence of 6 tokens cannot hold an image of 4"):
        vision_language.image_inputs(gemma.config, torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="config: 'llama' is not one of"):
        vision_language.image_inputs(TINY.config(), torch.zeros(1, 64, dtype=torch.long))
