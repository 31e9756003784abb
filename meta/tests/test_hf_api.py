"""fk.hf's entry points beyond patching one built model: PEFT models (fk.lora on their LoRA
layers), class patching before construction, and ``fk.hf.AutoModelForCausalLM``.

Tiny random-init models from test_hf_patching.py's helpers; on a CPU the kernels run in Triton's
interpreter, compared in fp32 with stock.
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fk.hf
import fk.hf.classes
import fk.lora

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_patching import (  # noqa: E402
    BATCH,
    SEQ,
    TOL,
    VOCAB,
    _assert_same_loss_and_grads,
    _batch,
    _expected_counts,
    _loss_and_grads,
    _model,
    weight_gradient_spy,
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model_of(base: Any) -> Any:
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    return peft.get_peft_model(base, lora).train()


def _peft_model(device: str) -> Any:
    return _peft_model_of(_model("llama", device))


def _train_lora(model: Any, device: str, steps: int = 3) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """AdamW steps on the trainable parameters: each step's loss and gradients."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, labels = _batch(device)
    losses, grads = [], []
    for _ in range(steps):
        out, step_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
        opt.step()
        losses.append(out.loss.item())
        grads.append(step_grads)
    return losses, grads


def test_peft_model_gets_fk_lora_and_matches_stock_training(
    device: str, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fk.hf.apply`` on a PEFT model with a frozen base: fk.lora fuses the LoRA layers (MLP,
    q/k/v group, o_proj per layer; the LoRA MLP is fk.lora's, not the swiglu patch), the base's
    norms, rotary embedding and loss are fk.hf's. Three AdamW steps give stock PEFT's losses and
    LoRA gradients; the frozen norms and head get no gradient; revert undoes both patches."""
    stock = _peft_model(device)
    patched = copy.deepcopy(stock)
    counts = fk.hf.apply(patched)
    assert counts == {**_expected_counts("llama"), "swiglu": 0, "qkv": 0, "lora": 6}
    assert fk.hf.patched_modules(patched) == counts
    assert fk.lora.is_patched(patched)
    trained = [n for n, p in stock.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    want_losses, want_grads = _train_lora(stock, device)
    work = weight_gradient_spy(monkeypatch)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        got_losses, got_grads = _train_lora(patched, device)
    assert work["norm"] and work["head"] and not any(work["norm"] + work["head"])  # frozen: no dw work
    assert "runs PEFT's forward" not in caplog.text  # every LoRA layer took fk.lora's fused path
    assert got_losses == pytest.approx(want_losses, rel=1e-5, abs=1e-5)
    for step, (want, got) in enumerate(zip(want_grads, got_grads, strict=True)):
        assert got.keys() == want.keys() == set(trained)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, **TOL, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
    base = patched.get_base_model()
    norms = [m.weight for n, m in base.named_modules() if n.endswith("norm")]
    assert len(norms) == 5 and all(w.grad is None and not w.requires_grad for w in norms)
    assert base.lm_head.weight.grad is None
    assert (
        fk.hf.revert(patched) == 10 + 10
    )  # fk.hf's 10 modules (2 of them decoder layers), fk.lora's 10 forwards (5 per layer)
    assert not fk.lora.is_patched(patched)
    assert not any("forward" in m.__dict__ for m in patched.modules())
    assert fk.hf.patched_modules(patched) == dict.fromkeys(fk.hf.SWITCHES, 0)
    fk.hf.apply(patched)
    assert fk.hf.apply(patched, lora=False) == {**_expected_counts("llama"), "qkv": 0}  # replaces fk.lora's patch too
    assert not fk.lora.is_patched(patched)


def test_lora_switch_on_a_model_without_lora_layers(device: str) -> None:
    """No LoRA layers: ``lora`` changes nothing, and fk.lora is not involved."""
    model = _model("llama", device)
    assert fk.hf.apply(model) == fk.hf.apply(model, lora=False) == _expected_counts("llama")
    assert not fk.lora.is_patched(model)


@pytest.fixture
def restore_classes() -> Any:
    """Restores every family's classes after the test, whatever it left patched."""
    yield
    for model_type in fk.hf.patched_classes():
        fk.hf.revert(model_type)


def test_class_patching_before_construction(device: str, restore_classes: Any, monkeypatch: Any) -> None:
    """``fk.hf.apply("llama")``: Llama models built afterwards come out patched (the causal LM
    once, its inner LlamaModel by the outer constructor; a bare LlamaModel too), and match a
    stock model of the same seed; other families are untouched. ``revert("llama")`` restores
    the classes; a model built before stays patched."""
    from transformers.models.llama import modeling_llama

    own_inits = {c: c.__dict__.get("__init__") for c in vars(modeling_llama).values() if isinstance(c, type)}
    names = fk.hf.apply("llama")
    assert {"LlamaForCausalLM", "LlamaModel", "LlamaPreTrainedModel"} <= set(names)
    assert fk.hf.patched_classes() == {"llama": names}
    built: list[str] = []
    apply_patch = fk.hf.classes.apply_patch
    monkeypatch.setattr(
        fk.hf.classes, "apply_patch", lambda m, *a: built.append(type(m).__name__) or apply_patch(m, *a)
    )
    patched = _model("llama", device)
    assert built == ["LlamaForCausalLM"]  # once, by the outermost constructor
    assert fk.hf.patched_modules(patched) == _expected_counts("llama")
    inner = modeling_llama.LlamaModel(patched.config)
    assert fk.hf.patched_modules(inner) == {**_expected_counts("llama"), "flce": 0}
    assert fk.hf.patched_modules(_model("mistral", device)) == dict.fromkeys(fk.hf.SWITCHES, 0)
    assert fk.hf.revert("llama") == len(names)
    assert fk.hf.patched_classes() == {}
    assert {c: c.__dict__.get("__init__") for c in own_inits} == own_inits
    stock = _model("llama", device)
    assert fk.hf.patched_modules(stock) == dict.fromkeys(fk.hf.SWITCHES, 0)
    _assert_same_loss_and_grads(stock, patched, **dict(zip(("input_ids", "labels"), _batch(device), strict=True)))
    assert fk.hf.revert("llama") == 0


def test_class_patching_switches_and_errors(device: str, restore_classes: Any) -> None:
    """The switches hold for every model built; a second apply replaces them; a string that is no
    causal-LM model type raises, naming it."""
    fk.hf.apply("llama", flce=False, rope=False)
    assert fk.hf.patched_modules(_model("llama", device)) == {**_expected_counts("llama"), "flce": 0, "rope": 0}
    fk.hf.apply("llama", swiglu=False)
    assert fk.hf.patched_modules(_model("llama", device)) == {**_expected_counts("llama"), "swiglu": 0}
    for call in (fk.hf.apply, fk.hf.revert):
        with pytest.raises(ValueError, match=r"'no_such_model' is not a causal-LM model type of transformers"):
            call("no_such_model")
    with pytest.raises(TypeError, match="rope must be a bool"):
        fk.hf.apply("llama", rope=None)  # type: ignore[arg-type]


def test_auto_model_from_config_and_from_pretrained(device: str, tmp_path: Any) -> None:
    """``fk.hf.AutoModelForCausalLM``: ``from_config`` builds a patched model (switches from
    ``fk_options``) with stock's weights for the seed; a ``save_pretrained`` checkpoint loads back
    patched, with the same weights, and trains as stock does."""
    stock = _model("llama", device)
    torch.manual_seed(0)
    built = fk.hf.AutoModelForCausalLM.from_config(stock.config, fk_options={"flce": False})
    assert type(built) is type(stock)
    assert fk.hf.patched_modules(built) == {**_expected_counts("llama"), "flce": 0}
    torch.manual_seed(0)
    fresh = transformers.AutoModelForCausalLM.from_config(stock.config)
    for (name, want), got in zip(fresh.state_dict().items(), built.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    stock.save_pretrained(tmp_path)
    loaded = fk.hf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).to(device).train()
    assert fk.hf.patched_modules(loaded) == _expected_counts("llama")
    for name, value in stock.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    _, got = _assert_same_loss_and_grads(
        stock, loaded, **dict(zip(("input_ids", "labels"), _batch(device), strict=True))
    )
    assert got.logits is None
    model, info = fk.hf.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and fk.hf.patched_modules(model) == _expected_counts("llama")


def test_auto_model_takes_any_type_and_names_a_wrong_switch(tmp_path: Any) -> None:
    """GPT-2 (no RMSNorm, no gated MLP, a head that takes more arguments than Llama's and hands them
    to its decoder): its LayerNorms and its head are patched, with GPT-2's loss and gradients."""
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config).train()
    model = copy.deepcopy(stock)
    report = fk.hf.apply(model)
    assert report["layer_norm"] == 3 and report["flce"] == 1 and not report.stock
    ids, labels = _batch("cpu")
    _assert_same_loss_and_grads(stock, model, input_ids=ids, labels=labels, token_type_ids=ids % 2)
    # positional arguments bind in GPT-2's order (input_ids, cache, attention_mask, token_type_ids)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch.testing.assert_close(model(ids, None, mask, ids % 2, labels=labels).loss,
                               stock(ids, None, mask, ids % 2, labels=labels).loss, **TOL)  # fmt: skip
    with pytest.raises(TypeError, match="multiple values for argument 'attention_mask'"):
        model(ids, None, mask, attention_mask=mask)
    with pytest.raises(TypeError, match=r"unknown fk\.hf switch.*rms_nrom"):
        fk.hf.AutoModelForCausalLM.from_pretrained(tmp_path, fk_options={"rms_nrom": False})
    with pytest.raises(OSError, match="from_pretrained"):
        fk.hf.AutoModelForCausalLM()


CausalLMOutputWithPast = transformers.modeling_outputs.CausalLMOutputWithPast


def test_fused_head_binds_positional_arguments_as_stock() -> None:
    """Llama's forward, called with its arguments by position up to ``labels``: the fused head binds
    them in Llama's order (the cache fourth), so the loss is stock's; one too many raises."""
    stock = _model("llama", "cpu")
    model = copy.deepcopy(stock)
    assert fk.hf.apply(model)["flce"] == 1
    ids, labels = _batch("cpu")
    mask = torch.ones_like(ids)
    # input_ids, attention_mask, position_ids, cache, inputs_embeds, labels
    args = (ids, mask, None, None, None, labels)
    torch.testing.assert_close(model(*args).loss, stock(*args).loss, **TOL)
    with pytest.raises(TypeError, match="positional arguments"):
        model(*args, None, 0, None)


class _HeadHandingOn(transformers.LlamaForCausalLM):
    """A Llama head that takes one argument more, ``extra``, only to hand it to its decoder."""

    def forward(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, cache: Any = None,
                inputs_embeds: Any = None, labels: Any = None, use_cache: Any = None, logits_to_keep: Any = 0,
                extra: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, extra=extra, **kwargs)  # fmt: skip
        logits = self.lm_head(outputs.last_hidden_state)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


class _HeadReadingToo(transformers.LlamaForCausalLM):
    """A head that hands ``extra`` to its decoder and scales the hidden states by it too."""

    def forward(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, cache: Any = None,
                inputs_embeds: Any = None, labels: Any = None, use_cache: Any = None, logits_to_keep: Any = 0,
                extra: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        hidden = self.model(input_ids=input_ids, extra=extra).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden * extra))


def test_head_arguments_are_taken_only_where_handed_to_the_decoder() -> None:
    """An argument beyond Llama's is taken where the head's forward only hands it to its decoder
    under its own name (fk's head hands it on the same way); read for anything else, the head stays
    stock and the report names the argument."""
    from fk.hf.recognize import HeadPlan, Refusal, head_candidate

    config = _model("llama", "cpu").config
    assert isinstance(head_candidate(_HeadHandingOn(config)), HeadPlan)
    refusal = head_candidate(_HeadReadingToo(config))
    assert isinstance(refusal, Refusal) and "other arguments than Llama's (extra)" in refusal.reason


class _HeadReadingShape(transformers.LlamaForCausalLM):
    """A head that reads its hidden states' ``shape`` without handing ``logits_to_keep`` to its decoder."""

    def forward(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, cache: Any = None,
                inputs_embeds: Any = None, labels: Any = None, use_cache: Any = None, logits_to_keep: Any = 0,
                **kwargs: Any) -> Any:  # fmt: skip
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, : hidden.shape[1] // 2]))


def test_head_reading_shape_is_taken_only_where_the_decoder_keeps_logits() -> None:
    """Gemma 4's head reads ``shape`` to slice only what its decoder (handed ``logits_to_keep``)
    left whole, which fk's head does too; a head that reads ``shape`` otherwise stays stock."""
    from fk.hf import coverage
    from fk.hf.recognize import HeadPlan, Refusal, head_candidate

    refusal = head_candidate(_HeadReadingShape(_model("llama", "cpu").config))
    assert isinstance(refusal, Refusal) and "does not compute (shape)" in refusal.reason
    plan = head_candidate(coverage._build("gemma4_text", "causal_lm"))
    assert isinstance(plan, HeadPlan) and plan.handed_on == ("logits_to_keep",)
    assert "shared_kv_states" in plan.output_fields


def test_gemma4_rope_and_fused_head(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 4 (text): its one-tensor rotary function and its head (which hands ``logits_to_keep``
    to its decoder and returns the decoder's ``shared_kv_states``) are fk's, with stock's loss and
    gradients; in evaluation with ``logits_to_keep`` the decoder drops the other positions itself,
    as stock's, and the logits are stock's."""
    from fk.hf import coverage

    stock = coverage._build("gemma4_text", "causal_lm").to(device)
    model = copy.deepcopy(stock)
    report = fk.hf.apply(model)
    layers = stock.config.num_hidden_layers
    assert report["rope"] == layers and report["flce"] == 1, report
    ids, labels = _batch(device)
    _, got = _assert_same_loss_and_grads(stock, model, input_ids=ids, labels=labels)
    assert got.logits is None
    seen: list[Any] = []
    inner = type(model.model).forward
    monkeypatch.setattr(type(model.model), "forward", lambda self, *a, **k: (seen.append(k.get("logits_to_keep")), inner(self, *a, **k))[1])  # fmt: skip
    stock.eval(), model.eval()
    with torch.no_grad():
        want = stock(input_ids=ids, logits_to_keep=2).logits
        seen.clear()
        last = model(input_ids=ids, logits_to_keep=2).logits
    assert seen == [2] and last.shape[1] == 2
    torch.testing.assert_close(last, want, **TOL)


def test_vision_language_head_with_images(device: str) -> None:
    """Gemma 3's vision-language model, trained on text with images (pixel values, image tokens,
    their token types): its head (vision inputs handed to its decoder, ``labels`` too, which its
    image masks read; the vocabulary in the text config; ``image_outputs`` passed on) takes the
    fused loss, with stock's loss and every gradient (vision tower and projector included); its
    input embedding is left to stock, since the decoder finds the image tokens in the input ids."""
    from fk.hf import loss_head
    from fk.hf.recognize import HeadPlan, head_candidate

    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "max_position_embeddings": 64,
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    image, begin, end = VOCAB - 1, VOCAB - 3, VOCAB - 2
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_id=image, boi_token_id=begin, eoi_token_id=end)  # fmt: skip
    torch.manual_seed(0)
    stock = transformers.Gemma3ForConditionalGeneration(config).to(device).train()
    model = copy.deepcopy(stock)
    plan = head_candidate(model)
    assert isinstance(plan, HeadPlan) and plan.handed_on == ("labels",), plan
    assert fk.hf.apply(model)["flce"] == 1
    # HF Trainer keeps the dataset's columns that the forward names: the images' among them
    shown = set(inspect.signature(model.forward).parameters)
    assert shown == set(inspect.signature(stock.forward).parameters) | {"skip_logits"}
    assert {"pixel_values", "token_type_ids"} <= shown
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 10, (BATCH, SEQ), generator=gen)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = begin, image, end  # one image of 4 tokens a sequence
    labels = ids.clone()
    labels[:, :8] = -100
    inputs = {"input_ids": ids.to(device), "labels": labels.to(device), "token_type_ids": (ids == image).long().to(device),
              "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen).to(device)}  # fmt: skip
    want, want_grads = _loss_and_grads(stock, **inputs)
    got, got_grads = _loss_and_grads(model, **inputs)
    assert got.logits is None and want.image_outputs is not None and got.image_outputs is not None
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():  # (relative to each gradient's size: the projector's are large)
        error = float((got_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert error < 1e-5, (name, error)
    assert not loss_head._tied_embedding(model)


def test_qwen2_vl_head_with_images(device: str) -> None:
    """Qwen2-VL trained on text with an image a sequence (patches, their grid, the image tokens'
    types for its 3-D rotary positions): the head takes the fused loss, and the loss and every
    gradient, the vision tower's included, are stock's."""
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}}  # fmt: skip
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    image, begin, end = VOCAB - 1, VOCAB - 3, VOCAB - 2
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image,
                                        vision_start_token_id=begin, vision_end_token_id=end, video_token_id=VOCAB - 4)  # fmt: skip
    torch.manual_seed(0)
    stock = transformers.Qwen2VLForConditionalGeneration(config).to(device).train()
    model = copy.deepcopy(stock)
    assert fk.hf.apply(model)["flce"] == 1
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 10, (BATCH, SEQ), generator=gen)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = begin, image, end  # a 4 x 4 patch grid, 4 tokens after the 2 x 2 merge
    labels = ids.clone()
    labels[:, :8] = -100
    inputs = {"input_ids": ids.to(device), "labels": labels.to(device), "mm_token_type_ids": (ids == image).int().to(device),
              "pixel_values": torch.randn(BATCH * 16, 3 * 2 * 4 * 4, generator=gen).to(device),
              "image_grid_thw": torch.tensor([[1, 4, 4]] * BATCH, device=device)}  # fmt: skip
    # The patch embedding is a Conv3d: on the GPU, cuDNN's TF32 would round its weight gradient to
    # 10 bits of mantissa (1.6e-5 apart here), so both runs take it in fp32.
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        want, want_grads = _loss_and_grads(stock, **inputs)
        got, got_grads = _loss_and_grads(model, **inputs)
    assert got.logits is None and any("visual" in name for name in got_grads)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        error = float((got_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert error < 1e-5, (name, error)


def test_paligemma2_soft_caps_as_stock(device: str) -> None:
    """PaliGemma 2 (a Gemma 2 text model) reads its soft cap as ``getattr(text_config,
    "final_logit_softcapping", None)``: fk's head soft-caps too, on the fused path (stock's loss and
    gradients) and on the logits' path."""
    from fk.hf.recognize import HeadPlan, head_candidate

    text = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
            "final_logit_softcapping": 2.0, "sliding_window": 8}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8, "projection_dim": 64}  # fmt: skip
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=VOCAB - 1)
    torch.manual_seed(0)
    stock = transformers.PaliGemmaForConditionalGeneration(config).to(device).train()
    model = copy.deepcopy(stock)
    plan = head_candidate(model)
    assert isinstance(plan, HeadPlan) and plan.softcap
    assert fk.hf.apply(model)["flce"] == 1
    ids, labels = _batch(device)
    _, got = _assert_same_loss_and_grads(stock, model, input_ids=ids, labels=labels)
    assert got.logits is None
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, skip_logits=False).logits, stock(input_ids=ids).logits, **TOL)


def test_vision_language_moe_router_loss_as_stock(device: str) -> None:
    """Qwen3-VL-MoE reads its experts' count and its load-balancing weight from its text config
    (its head has no such attributes): with ``output_router_logits`` fk's head computes the
    load-balancing loss as stock, and the loss and every gradient are stock's."""
    from fk.hf import coverage

    stock = coverage._build("qwen3_vl_moe", "image_text_to_text").to(device)
    stock.config.text_config.router_aux_loss_coef = 0.3
    model = copy.deepcopy(stock)
    assert fk.hf.apply(model)["flce"] == 1
    ids, labels = _batch(device)
    want, got = _assert_same_loss_and_grads(stock, model, input_ids=ids, labels=labels, output_router_logits=True)
    assert want.aux_loss is not None and got.aux_loss is not None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)


@pytest.mark.parametrize("model_type", ["falcon_h1", "jetmoe"])
def test_head_extras_under_other_names(model_type: str, device: str) -> None:
    """Falcon-H1 multiplies its logits by its decoder's ``lm_head_multiplier``; JetMoe weighs its
    load-balancing loss by ``aux_loss_coef``: both heads take the fused loss with stock's loss and
    gradients, each extra away from 1 so that it matters."""
    from fk.hf import coverage

    config = coverage.tiny_config(model_type)
    config.lm_head_multiplier, config.aux_loss_coef = 0.5, 0.3
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config).float().to(device).train()
    model = copy.deepcopy(stock)
    assert fk.hf.apply(model)["flce"] == 1
    ids, labels = _batch(device)
    extra = {"output_router_logits": True} if model_type == "jetmoe" else {}
    want, got = _assert_same_loss_and_grads(stock, model, input_ids=ids, labels=labels, **extra)
    if extra:
        assert got.aux_loss is not None
        torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)


def _plan_and_patched(stock: Any) -> tuple[Any, Any]:
    """The plan fk makes of ``stock``'s head (a ``HeadPlan``), and a patched copy of ``stock`` whose
    head takes the fused loss."""
    from fk.hf.recognize import HeadPlan, head_candidate

    plan = head_candidate(stock)
    assert isinstance(plan, HeadPlan), plan
    model = copy.deepcopy(stock)
    assert fk.hf.apply(model)["flce"] == 1
    return plan, model


def _assert_same_seeded_loss_and_grads(stock: Any, model: Any, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """As :func:`_assert_same_loss_and_grads`, each run from the same random state (the coverage
    check's: the same dropout masks in models that drop out in training)."""
    from fk.hf import coverage

    want_loss, want_grads = coverage._loss_and_grads(stock, ids, labels)
    got_loss, got_grads = coverage._loss_and_grads(model, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


OLDER_HEADS = {  # model type: (decoder path, return_dict handed on, position_ids taken, cast to the head's dtype)
    "falcon": ("transformer", True, True, False), "gpt_neo": ("transformer", True, True, False),
    "bloom": ("transformer", True, False, False), "mpt": ("transformer", True, False, False),
    "mamba": ("backbone", True, False, True), "opt": ("model.decoder", False, True, False),
    "xglm": ("model", False, True, False),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(OLDER_HEADS))
def test_older_heads_take_the_fused_loss(model_type: str, device: str) -> None:
    """The older causal-LM heads: Falcon's and GPT-Neo's take ``return_dict`` and hand it to their
    decoder, Bloom's and MPT's take no ``position_ids``, Mamba's casts to its head's dtype and its
    logits to fp32, OPT's calls ``self.model.decoder``, XGLM's hands ``pad_token_id`` to its loss.
    Each takes the fused loss with stock's loss and every gradient (the same dropout masks); in
    evaluation its logits are stock's, also as the tuple of ``return_dict=False``; where the forward
    has no ``position_ids``, those passed go where stock's go (its ``**kwargs``)."""
    from fk.hf import coverage

    stock = coverage._build(model_type, "causal_lm").to(device)
    plan, model = _plan_and_patched(stock)
    assert (plan.backbone, plan.decoder_return_dict, plan.position_ids, plan.cast_to_head) == OLDER_HEADS[model_type]
    assert plan.float_logits == plan.cast_to_head  # (Mamba's both)
    ids, labels = _batch(device)
    _assert_same_seeded_loss_and_grads(stock, model, ids, labels)
    stock.eval(), model.eval()
    with torch.no_grad():
        want, got = stock(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
        want_tuple, got_tuple = (m(input_ids=ids, labels=labels, return_dict=False) for m in (stock, model))
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    assert got.logits.dtype == want.logits.dtype and isinstance(got_tuple, tuple)
    torch.testing.assert_close(got_tuple[:2], want_tuple[:2], **TOL)  # (loss, logits)
    if not plan.position_ids:
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        with torch.no_grad():
            want, got = (m(input_ids=ids, labels=labels, position_ids=positions) for m in (stock, model))
        torch.testing.assert_close(got.logits, want.logits, **TOL)


UNSHIFTED_HEADS = ["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "pegasus", "plbart"]


@pytest.mark.parametrize("model_type", UNSHIFTED_HEADS)
def test_unshifted_heads_take_the_fused_loss(model_type: str, device: str) -> None:
    """The BART family's causal LMs score position t against ``labels[:, t]`` with a fresh
    ``CrossEntropyLoss()`` (their labels come shifted already): each takes the fused loss with
    stock's loss and every gradient, for labels that differ from the inputs shifted, also where
    the Trainer passes ``num_items_in_batch`` and ``shift_labels`` (which stock's loss does not
    read); in evaluation its loss and logits are stock's. Llama's plan is not unshifted."""
    from fk.hf import coverage

    stock = coverage._build(model_type, "causal_lm").to(device)
    plan, model = _plan_and_patched(stock)
    from fk.hf.recognize import head_candidate

    assert plan.unshifted_labels and not head_candidate(_model("llama", device)).unshifted_labels
    ids, _ = _batch(device)
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(5)).to(device)
    labels[0, :5] = -100
    _assert_same_seeded_loss_and_grads(stock, model, ids, labels)
    trainer_kwargs = {"num_items_in_batch": torch.tensor(7, device=device), "shift_labels": labels.roll(1, -1)}
    torch.manual_seed(1)
    want = stock(input_ids=ids, labels=labels, **trainer_kwargs).loss
    torch.manual_seed(1)
    got = model(input_ids=ids, labels=labels, **trainer_kwargs)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want, **TOL)
    stock.eval(), model.eval()
    with torch.no_grad():
        want, got = stock(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    torch.testing.assert_close((got.loss, got.logits), (want.loss, want.logits), **TOL)


@pytest.mark.parametrize(
    ("model_type", "registry", "setting"),
    [("apertus1p5_text", "causal_lm", "output_vocab_size"), ("muse_glimmer", "image_text_to_text", "output_multiplier"),
     ("hy_v4", "causal_lm", "fp32 head")],
)  # fmt: skip
def test_more_head_extras(model_type: str, registry: str, setting: str, device: str) -> None:
    """Apertus 1.5 scores against its head's pruned output vocabulary (``out_features``, here 250
    of 300 ids, the labels within it); Muse Glimmer multiplies its logits by
    ``text_config.output_multiplier`` before its soft cap; HunYuan V4 keeps its head in fp32 and
    casts the hidden states to it. Each head takes the fused loss with stock's loss and every
    gradient, and in evaluation gives stock's logits."""
    from fk.hf import coverage

    config = coverage.tiny_config(model_type)
    if setting == "output_vocab_size":
        config.output_vocab_size = VOCAB - 50
    torch.manual_seed(0)
    model_class = getattr(transformers, coverage.registries()[registry][model_type])
    stock = model_class._from_config(config).float().to(device).train()
    plan, model = _plan_and_patched(stock)
    assert (plan.vocab_from_head, plan.multiply_by_output_multiplier, plan.cast_to_head) == (
        setting == "output_vocab_size", setting == "output_multiplier", setting == "fp32 head")  # fmt: skip
    if setting == "output_vocab_size":
        assert stock.lm_head.out_features == VOCAB - 50
    ids, labels = _batch(device)
    labels = labels.clamp(max=VOCAB - 51)
    _assert_same_seeded_loss_and_grads(stock, model, ids, labels)
    stock.eval(), model.eval()
    with torch.no_grad():
        want, got = stock(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    torch.testing.assert_close((got.loss, got.logits), (want.loss, want.logits), **TOL)


@pytest.mark.parametrize("model_type", ["qwen2_5_omni_thinker", "minicpmv4_6"])
def test_heads_without_logits_to_keep(model_type: str, device: str) -> None:
    """The Qwen2.5-Omni thinker and MiniCPM-V 4.6 take no ``logits_to_keep``: their heads take the
    fused loss with stock's loss and every gradient, and in evaluation give stock's logits of every
    position."""
    from fk.hf import coverage

    stock = coverage._build(model_type, "image_text_to_text").to(device)
    plan, model = _plan_and_patched(stock)
    assert not plan.logits_to_keep, plan
    ids, labels = _batch(device)
    _assert_same_seeded_loss_and_grads(stock, model, ids, labels)
    stock.eval(), model.eval()
    with torch.no_grad():
        want, got = stock(input_ids=ids), model(input_ids=ids)
    assert got.logits.shape[1] == ids.shape[1]
    torch.testing.assert_close(got.logits, want.logits, **TOL)


def test_mamba_head_casts_to_its_dtype(device: str) -> None:
    """Mamba in bf16 with fp32 residuals: its head casts the hidden states to the head's dtype and
    its logits to fp32; fk's fused loss and its logits are stock's to bf16's rounding."""
    from fk.hf import coverage

    config = coverage.tiny_config("mamba")
    config.residual_in_fp32 = True
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16).train()
    model = copy.deepcopy(stock)
    assert fk.hf.apply(model)["flce"] == 1
    ids, labels = _batch(device)
    want, got = stock(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert got.logits is None and got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=2e-2)
    stock.eval(), model.eval()
    with torch.no_grad():
        want, got = stock(input_ids=ids), model(input_ids=ids)
    assert got.logits.dtype == want.logits.dtype == torch.float32
    torch.testing.assert_close(got.logits, want.logits, rtol=2e-2, atol=6e-2)  # (fk's bf16 norm: rounding apart)


def test_class_patching_and_from_pretrained(device: str, tmp_path: Any, restore_classes: Any) -> None:
    """A checkpoint loaded by stock transformers while the classes are patched comes out patched."""
    stock = _model("llama", device)
    stock.save_pretrained(tmp_path)
    fk.hf.apply("llama", rope=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).to(device).train()
    assert fk.hf.patched_modules(loaded) == {**_expected_counts("llama"), "rope": 0}
    _assert_same_loss_and_grads(stock, loaded, **dict(zip(("input_ids", "labels"), _batch(device), strict=True)))


def test_auto_model_loads_a_peft_adapter_fused(device: str, tmp_path: Any) -> None:
    """A saved PEFT adapter directory, which transformers loads onto its base model: the LoRA
    layers it injects are fused by fk.lora too, with PEFT's loss and LoRA gradients."""
    base = _model("llama", device)
    base.save_pretrained(tmp_path / "base")
    base.name_or_path = str(tmp_path / "base")  # what the adapter's config points at
    stock = _peft_model_of(base)
    stock.save_pretrained(tmp_path / "adapter")
    loaded = fk.hf.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter").to(device).train()
    for name, param in loaded.named_parameters():  # transformers loads an adapter frozen, for inference
        param.requires_grad_("lora_" in name)
    assert fk.hf.patched_modules(loaded) == {**_expected_counts("llama"), "swiglu": 0, "qkv": 0, "lora": 6}
    ids, labels = _batch(device)
    want, want_grads = _loss_and_grads(stock, input_ids=ids, labels=labels)
    got, got_grads = _loss_and_grads(loaded, input_ids=ids, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    lora_grads = {n.removeprefix("base_model.model.").replace(".default", ""): g for n, g in want_grads.items()}
    got_lora = {n.replace(".default", ""): g for n, g in got_grads.items() if "lora_" in n}
    assert got_lora.keys() == lora_grads.keys()
    for name, grad in lora_grads.items():
        torch.testing.assert_close(got_lora[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _fused_loss_options_spy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every fk.flce.linear_cross_entropy call from now on (fk.hf's fused
    loss looks the function up at each call)."""
    import fk.flce

    seen: list[dict[str, Any]] = []
    original = fk.flce.linear_cross_entropy

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(fk.flce, "linear_cross_entropy", spy)
    return seen


def test_loss_options_reach_the_fused_loss(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fk.hf.loss_options: the fused loss passes memory_budget and accum_dtype on, and computes
    stock's loss and gradients with them (small chunks: several per batch)."""
    stock = _model("llama", device)
    patched = copy.deepcopy(stock)
    fk.hf.apply(patched)
    assert fk.hf.loss_options(patched, memory_budget=4 * 1024 * 4, accum_dtype=torch.float32) == 1
    seen = _fused_loss_options_spy(monkeypatch)
    ids, labels = _batch(device)
    _assert_same_loss_and_grads(stock, patched, input_ids=ids, labels=labels)
    assert seen and seen[-1]["memory_budget"] == 4 * 1024 * 4 and seen[-1]["accum_dtype"] is torch.float32
    assert fk.hf.loss_options(patched) == 1  # the defaults again
    _loss_and_grads(patched, input_ids=ids, labels=labels)
    assert "memory_budget" not in seen[-1]
    with pytest.raises(TypeError, match="unknown loss option"):
        fk.hf.loss_options(patched, budget=1)


@pytest.mark.parametrize("tied", [False, True])
def test_zero3_head_takes_the_low_memory_defaults(device: str, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head whose weight is a DeepSpeed ZeRO-3 parameter (it carries ZeRO-3's ``ds_id``; here set
    by hand, DeepSpeed itself in test_deepspeed.py) gets fk.hf's ZeRO-3 loss defaults (small chunks,
    the head's gradient summed in its dtype), tied or not, with stock's loss and gradients; options
    set through fk.hf.loss_options replace them; without ds_id the defaults are fk-flce's."""
    from fk.hf.loss_head import ZERO3_MEMORY_BUDGET

    stock = _model("llama", device, tie_word_embeddings=tied)
    patched = copy.deepcopy(stock)
    fk.hf.apply(patched)
    seen = _fused_loss_options_spy(monkeypatch)
    ids, labels = _batch(device)
    _loss_and_grads(patched, input_ids=ids, labels=labels)
    assert "memory_budget" not in seen[-1] and "accum_dtype" not in seen[-1]
    patched.lm_head.weight.ds_id = 0
    _assert_same_loss_and_grads(stock, patched, input_ids=ids, labels=labels)
    assert seen[-1]["memory_budget"] == ZERO3_MEMORY_BUDGET
    assert seen[-1]["accum_dtype"] is patched.lm_head.weight.dtype
    fk.hf.loss_options(patched, memory_budget=1 << 20)
    _loss_and_grads(patched, input_ids=ids, labels=labels)
    assert seen[-1]["memory_budget"] == 1 << 20 and "accum_dtype" not in seen[-1]
