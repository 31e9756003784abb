"""fk.hf.projections.linear_projections against F.linear in float64, and the qkv switch's group."""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fk.hf
from fk.hf.projections import linear_projections

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_patching import _batch, _model

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@torch.no_grad()
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "outs", "bias", "frozen", "unused"),
    [
        ((3, 5, 37), (19, 7, 7), False, (), None),  # odd sizes, GQA-like k/v narrower than q
        ((1, 1, 8), (8, 4, 4), True, (), None),  # one row, with biases
        ((2, 33, 48), (48, 16, 16), True, (1,), None),  # a frozen weight and bias get no gradient
        ((65, 24), (24, 24, 8), False, (), 1),  # 2-D input; one output unused in the loss
    ],
)
def test_outputs_and_gradients_match_float64(
    dtype: torch.dtype,
    shape: tuple[int, ...],
    outs: tuple[int, ...],
    bias: bool,
    frozen: tuple[int, ...],
    unused: int | None,
    device: str,
) -> None:
    """Outputs and the gradients of x, each weight and bias against F.linear in float64; a frozen
    weight or bias and the parameters of an unused output get None."""
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(shape, generator=gen, dtype=torch.float64)
    w64 = [torch.randn(n, shape[-1], generator=gen, dtype=torch.float64) / shape[-1] ** 0.5 for n in outs]
    b64 = [torch.randn(n, generator=gen, dtype=torch.float64) if bias else None for n in outs]
    dys = [torch.randn(*shape[:-1], n, generator=gen, dtype=torch.float64) for n in outs]

    def leaves(ts: list, dt: torch.dtype, dev: str) -> list:
        return [None if t is None else t.to(dev, dt).requires_grad_(i not in frozen) for i, t in enumerate(ts)]

    x = x64.to(device, dtype).requires_grad_()
    ws, bs = leaves(w64, dtype, device), leaves(b64, dtype, device)
    got = linear_projections(x, ws, bs)
    xr = x64.clone().requires_grad_()
    wr, br = leaves(w64, torch.float64, "cpu"), leaves(b64, torch.float64, "cpu")
    want = [F.linear(xr, w, b) for w, b in zip(wr, br, strict=True)]
    used = [i for i in range(len(outs)) if i != unused]
    torch.autograd.backward([got[i] for i in used], [dys[i].to(device, dtype) for i in used])
    torch.autograd.backward([want[i] for i in used], [dys[i] for i in used])
    tol = TOL[dtype]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        assert _rel(g.cpu(), w.detach()) < tol
    assert x.grad is not None and _rel(x.grad.cpu(), xr.grad) < tol
    for i in range(len(outs)):
        params = [(ws[i], wr[i])] + ([(bs[i], br[i])] if bias else [])
        for p, r in params:
            if i in frozen or i == unused:
                assert p.grad is None
            else:
                assert p.grad is not None and _rel(p.grad.cpu(), r.grad) < tol


def test_bad_arguments_raise_naming_them() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weights\\[1\\]"):
        linear_projections(x, [torch.randn(3, 8), torch.randn(3, 7)], [None, None])
    with pytest.raises(ValueError, match="weights\\[0\\]"):
        linear_projections(x, [torch.randn(3, 8, dtype=torch.float64)], [None])
    with pytest.raises(ValueError, match="biases\\[0\\]"):
        linear_projections(x, [torch.randn(3, 8)], [torch.randn(4)])
    with pytest.raises(ValueError, match="one bias"):
        linear_projections(x, [torch.randn(3, 8)], [])


def test_qkv_group_computes_once_and_splits_on_another_input(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the qkv switch, q_proj's call computes q, k and v in one function call and k_proj and
    v_proj return those; a k_proj called with another tensor computes its own output (stock's),
    and the group stops fusing."""
    import fk.hf.projections as projections

    model = _model("llama", device)
    stock = copy.deepcopy(model)
    assert fk.hf.apply(model, rms_norm=False, rope=False, swiglu=False, flce=False)["qkv"] == 6
    calls: list[int] = []
    apply = projections._LinearProjections.apply
    monkeypatch.setattr(projections._LinearProjections, "apply", lambda *a: (calls.append(1), apply(*a))[1])
    ids, labels = _batch(device)
    got = model(input_ids=ids, labels=labels).loss
    want = stock(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got, want)
    assert len(calls) == 2  # one per attention block
    attn, stock_attn = model.model.layers[0].self_attn, stock.model.layers[0].self_attn
    x = torch.randn(2, 3, 64, device=device)
    torch.testing.assert_close(attn.q_proj(x), stock_attn.q_proj(x))
    other = torch.randn(2, 3, 64, device=device)
    torch.testing.assert_close(attn.k_proj(other), stock_attn.k_proj(other))  # not q's stashed output
    group = attn.q_proj.__dict__["_fk_hf_projection_group"][0]
    assert group.split
    calls.clear()
    torch.testing.assert_close(attn.q_proj(x), stock_attn.q_proj(x))
    assert not calls  # split: each projection computes alone from now on
    assert fk.hf.revert(model) == 6 + 2 and type(attn.q_proj) is torch.nn.Linear  # the projections, the decoder layers


def _renaming(old: str, new: str) -> Any:
    """A decorator as transformers' ``deprecate_kwarg(old, new_name=new)``: a ``functools.wraps``
    closure over the function it wraps, which passes ``old=`` on as ``new=``."""

    def decorator(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorator


def test_add_norm_recognizes_both_decoder_forwards_under_wrappers() -> None:
    """The pre-norm decoder forward of transformers up to 5.23 (past_key_values) and of 5.24
    (cache, under a renamed-argument deprecation wrapper) both get add_norm; the patched forward
    keeps the wrapper, now around fk's function. A wrapper that does not hold what it wraps in its
    closure gets no patch."""
    from fk.hf import decoder, functions

    cache_form = _renaming("past_key_values", "cache")(decoder._pre_norm_decoder_forward_cache)
    for stock, fk_forward in ((decoder._pre_norm_decoder_forward, decoder.add_norm_forward),
                              (cache_form, decoder.add_norm_forward_cache)):  # fmt: skip
        patched = decoder.add_norm_forward_for(stock)
        assert patched is not None and inspect.unwrap(patched) is fk_forward
        assert (patched is fk_forward) == (stock is decoder._pre_norm_decoder_forward)
    rewrapped = decoder.add_norm_forward_for(cache_form)
    seen: dict[str, Any] = {}
    rewrapped_inner = inspect.unwrap(rewrapped)
    assert rewrapped.__code__ is cache_form.__code__ and rewrapped_inner is decoder.add_norm_forward_cache

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)

    wrapped_spy = functions.rewrapped(cache_form, spy)
    assert wrapped_spy is not None
    wrapped_spy(None, None, past_key_values="kv")  # the copied wrapper still renames the argument
    assert seen == {"cache": "kv"}

    def opaque(*args: Any, **kwargs: Any) -> Any:  # a wrapper that reaches the function another way
        return decoder._pre_norm_decoder_forward(*args, **kwargs)

    opaque.__wrapped__ = decoder._pre_norm_decoder_forward  # type: ignore[attr-defined]
    assert decoder.add_norm_forward_for(opaque) is None
    assert decoder.add_norm_forward_for(decoder.add_norm_forward) is None  # not a stock forward


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_add_norm_fuses_the_post_attention_residual_add(
    model_type: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the add_norm switch, a Llama-like decoder layer adds the attention's output to the
    residual inside fk.norms.fused_add_rms_norm (once per layer, with Gemma's casting and offset),
    with stock's loss and gradients, under gradient checkpointing too; a post-attention norm whose
    weight has another dtype takes the stock forward."""
    import fk.norms
    from fk.hf.decoder import is_pre_norm_decoder

    stock = _model(model_type, device)
    assert all(is_pre_norm_decoder(layer) for layer in stock.model.layers)  # the installed transformers' forward
    patched = copy.deepcopy(stock)
    counts = fk.hf.apply(patched, rms_norm=False, rope=False, swiglu=False, geglu=False, qkv=False, flce=False)
    assert counts["add_norm"] == 2
    calls: list[int] = []
    fused = fk.norms.fused_add_rms_norm
    monkeypatch.setattr(fk.norms, "fused_add_rms_norm", lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    ids, labels = _batch(device)
    for checkpointing in (False, True):
        for model in (stock, patched):
            model.zero_grad(set_to_none=True)
            if checkpointing:
                model.gradient_checkpointing_enable()
            model(input_ids=ids, labels=labels).loss.backward()
        grads = dict(patched.named_parameters())
        for name, p in stock.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert len(calls) == 2 + 4  # two layers; under checkpointing, forward and recomputation
    calls.clear()
    patched.model.layers[0].post_attention_layernorm.to(torch.bfloat16)
    patched(input_ids=ids, labels=labels)
    assert len(calls) == 1  # layer 0 took the stock forward


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_add_norm_adds_the_mlp_residual_in_the_down_projection(
    model_type: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With add_norm and the gated-MLP switch, a decoder layer's second residual add happens in the
    MLP's down projection (fk.glu.gated_mlp with residual=), with stock's loss and gradients; an MLP
    with a hook of its own is called as a module, and the layer adds its output as stock does."""
    import fk.glu

    stock = _model(model_type, device)
    patched = copy.deepcopy(stock)
    counts = fk.hf.apply(patched, rms_norm=False, rope=False, qkv=False, flce=False)
    assert counts["add_norm"] == 2 and counts["swiglu"] + counts["geglu"] == 2
    residuals: list[bool] = []
    fused = fk.glu.gated_mlp
    monkeypatch.setattr(
        fk.glu, "gated_mlp", lambda *a, **k: (residuals.append(k.get("residual") is not None), fused(*a, **k))[1]
    )
    ids, labels = _batch(device)
    for model in (stock, patched):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
    grads = dict(patched.named_parameters())
    for name, p in stock.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert residuals == [True, True]  # one call per layer, each adding the residual
    residuals.clear()
    seen: list[int] = []
    patched.model.layers[1].mlp.register_forward_hook(lambda *_: seen.append(1))
    torch.testing.assert_close(patched(input_ids=ids, labels=labels).loss, stock(input_ids=ids, labels=labels).loss)
    assert residuals == [True, False] and seen == [1]  # layer 1's MLP ran as a module, with its hook


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_add_norm_hands_the_layer_input_on_from_its_norm(
    model_type: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With add_norm and rms_norm, a decoder layer's input norm is fk.norms.rms_norm_and_input,
    whose backward adds the residual branch's gradient (stock's loss and gradients, Gemma's casting
    and offset too); an input norm with a hook of its own is called as a module, and with the
    rms_norm switch off the input norm stays stock."""
    import fk.norms

    stock = _model(model_type, device)
    calls: list[int] = []
    fused = fk.norms.rms_norm_and_input
    monkeypatch.setattr(fk.norms, "rms_norm_and_input", lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    ids, labels = _batch(device)
    stock.zero_grad(set_to_none=True)
    stock(input_ids=ids, labels=labels).loss.backward()
    for rms_norm in (True, False):
        patched = copy.deepcopy(stock)
        patched.zero_grad(set_to_none=True)
        counts = fk.hf.apply(patched, rms_norm=rms_norm, rope=False, qkv=False, swiglu=False, geglu=False, flce=False)
        assert counts["add_norm"] == 2
        patched(input_ids=ids, labels=labels).loss.backward()
        grads = dict(patched.named_parameters())
        for name, p in stock.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
        assert len(calls) == (2 if rms_norm else 0)
        calls.clear()
    patched = copy.deepcopy(stock)
    fk.hf.apply(patched, rope=False, qkv=False, flce=False)
    seen: list[int] = []
    patched.model.layers[1].input_layernorm.register_forward_hook(lambda *_: seen.append(1))
    torch.testing.assert_close(patched(input_ids=ids, labels=labels).loss, stock(input_ids=ids, labels=labels).loss)
    assert len(calls) == 1 and seen == [1]  # layer 1's input norm ran as a module, with its hook
