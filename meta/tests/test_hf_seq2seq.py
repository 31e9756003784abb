"""fk.hf's fused loss on encoder-decoder LMs' heads (``fk.hf.seq2seq_head``): loss and every
gradient equal to stock's in training, with the BART family's ``final_logits_bias`` and T5's
rescaled, tied head; evaluation's logits and loss stock's; the stock path wherever fk's does not
apply. fp32 on the CPU through Triton's interpreter."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fk.hf  # noqa: E402
from fk.hf import coverage  # noqa: E402

FUSED = ("bart", "mbart", "marian", "pegasus", "m2m_100", "t5", "mt5", "longt5", "umt5", "plbart", "blenderbot")
"""Widely trained types whose head fk fuses: each must build tiny, patch its head and agree."""


@pytest.mark.parametrize("model_type", FUSED)
def test_widely_trained_heads_are_fused(model_type: str) -> None:
    transformers.logging.set_verbosity_error()
    row = coverage.check(model_type, "seq2seq_lm")
    assert row.status == "patched" and row.patched.get("flce") == 1, (row.status, row.detail, row.stock)


def _tiny(model_type: str) -> Any:
    transformers.logging.set_verbosity_error()
    model = coverage._build(model_type, "seq2seq_lm")
    bias = getattr(model, "final_logits_bias", None)
    if bias is not None:  # (zeros by default: made to matter)
        bias.normal_(generator=torch.Generator().manual_seed(3))
    return model


def _step(model: Any, **kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, coverage.VOCAB, (2, 9), generator=gen)
    labels = torch.randint(3, coverage.VOCAB, (2, 7), generator=gen)
    labels[0, 4:] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("model_type", ["bart", "t5", "m2m_100"])
def test_training_loss_and_gradients_equal_stock(model_type: str) -> None:
    """BART adds its ``final_logits_bias`` (random here) after the head; T5 rescales the hidden
    states before its tied head; M2M100 (NLLB) makes its decoder inputs with its module's
    ``shift_tokens_right``. The patched forward builds no logits."""
    stock = _tiny(model_type)
    patched = copy.deepcopy(stock)
    assert fk.hf.apply(patched)["flce"] == 1
    want, want_grads = _step(stock, **_batch())
    got, got_grads = _step(patched, **_batch())
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_evaluation_and_the_paths_fk_leaves_to_stock() -> None:
    """In evaluation, with positional arguments, ``return_dict=False`` or decoder inputs given,
    the output (logits included) is stock's; ``skip_logits=True`` without labels raises."""
    stock = _tiny("bart")
    patched = copy.deepcopy(stock)
    fk.hf.apply(patched)
    batch = _batch()
    with torch.no_grad():
        for model in (stock, patched):
            model.eval()
        want, got = stock(**batch), patched(**batch)
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.loss, want.loss)
        for model in (stock, patched):
            model.train()
        torch.manual_seed(1)
        want = stock(**batch, return_dict=False)
        torch.manual_seed(1)
        got = patched(**batch, return_dict=False)
        torch.testing.assert_close(got[1], want[1])
        decoder = {"decoder_input_ids": batch["labels"].clamp(min=1)}
        torch.manual_seed(1)
        want = stock(**batch, **decoder)
        torch.manual_seed(1)
        got = patched(**batch, **decoder)
        torch.testing.assert_close(got.logits, want.logits)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        patched(input_ids=batch["input_ids"], skip_logits=True)


def test_reverted_model_is_stock() -> None:
    model = _tiny("t5")
    stock_forward = type(model).forward
    fk.hf.apply(model)
    assert fk.hf.patched_modules(model)["flce"] == 1
    fk.hf.revert(model)
    assert fk.hf.patched_modules(model)["flce"] == 0 and type(model).forward is stock_forward
    assert model(**_batch()).logits is not None
