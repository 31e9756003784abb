"""QLoRA on 8-bit bases: fk.lora's fused projections and MLP on bitsandbytes LLM.int8() layers
(``Linear8bitLt``, ``has_fp16_weights=False``, as :class:`fk.lora.Int8Base`), against PEFT's own
layer (``peft.tuners.lora.bnb.Linear8bitLt``) on the test device, and ``fk.lora.patch`` on a model of
them. The base output is the layer's own product in both, so what is compared is the LoRA branch
around it and the input gradient (``dy W`` from fk's dequantized int8 weight plus the LoRA terms).

bitsandbytes 0.50.2 runs its int8 product on CPU too: in eval mode ``MatMul8bitLt`` (int8
activations, outlier columns above ``threshold`` apart: the one CUDA runs in both modes), in
training mode ``MatMul8bitFp`` (a dequantization, then ``F.linear``). ``base_mode`` puts the base
layer (alone) in one mode or the other, so both run here. Skipped without bitsandbytes' int8 backend
for the device.

Each test runs fk's call before PEFT's: on CPU, PEFT's DoRA forward (its ``dequantize_module_weight``)
sets the layer's weight again through ``Int8Params.to`` after ``Linear8bitLt``'s first forward has
moved ``SCB`` off the weight into the layer's state, so the layer's next forward finds no ``SCB``
and fails inside bitsandbytes (0.50.2; on CUDA the weight is not set again). fk's call leaves the
layer as it finds it."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest
import torch

import fk.lora
from fk.core import testing
from fk.lora.quant import from_bnb

peft = pytest.importorskip("peft")
LoraConfig = peft.LoraConfig

try:  # (the tests against bitsandbytes take the bnb_device fixture: skipped without it)
    import bitsandbytes as bnb
    import peft.tuners.lora.bnb as peft_bnb
except ImportError:
    bnb = peft_bnb = None

IN, OUT, RANK, INTER = 100, 40, 4, 48
OUTLIERS = (3, 50, 97)
"""Input columns scaled up past a threshold of 6 (LLM.int8()'s outlier columns)."""


@pytest.fixture
def bnb_device(device: str) -> str:
    """The test device, where bitsandbytes runs Linear8bitLt on it (else the test is skipped)."""
    testing.require_bitsandbytes_int8(device)
    return device


def _int8_base(out: int, inp: int, threshold: float, dtype: torch.dtype, device: str, seed: int, bias: bool = True) -> Any:  # fmt: skip
    """A quantized ``Linear8bitLt`` ``[out, inp]`` on ``device``, its bias (trainable) in ``dtype``."""
    base = bnb.nn.Linear8bitLt(inp, out, bias=bias, has_fp16_weights=False, threshold=threshold)
    w = testing.random_tensor((out, inp), torch.float16, "cpu", seed=seed, scale=0.1)
    base.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    base = base.to(device)  # (quantizes the weight)
    if bias:
        base.bias = torch.nn.Parameter(testing.random_tensor((out,), dtype, device, seed=seed + 1))
    return base


def _peft_layer(
    threshold: float, dtype: torch.dtype, dropout: float, base_mode: str, device: str, seed: int,
    out: int = OUT, inp: int = IN, dora: bool = False,
) -> Any:  # fmt: skip
    """PEFT's ``lora.bnb.Linear8bitLt`` on :func:`_int8_base`, in training mode with its base layer in
    ``base_mode``; fp32 LoRA weights (PEFT's default), a random ``lora_B``. With ``dora``, PEFT's
    DoRA (``use_dora``), the magnitude moved by up to 30% a row from the norm PEFT starts it at (so
    that ``m / n`` is not 1)."""
    base = _int8_base(out, inp, threshold, dtype, device, seed)
    config = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=dropout, use_dora=dora)
    layer = peft_bnb.Linear8bitLt(base, "default", config, r=RANK, lora_alpha=8, lora_dropout=dropout, use_dora=dora)
    layer = layer.to(device)
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(testing.random_tensor((out, RANK), torch.float32, device, seed=seed + 2))
        if dora:
            layer.lora_magnitude_vector["default"].weight.mul_(1 + 0.3 * testing.random_tensor((out,), torch.float32, device, seed=seed + 3))  # fmt: skip
    layer.train()
    layer.base_layer.train(base_mode == "train")
    return layer


def _magnitude(layer: Any) -> torch.Tensor | None:
    """The layer's DoRA magnitude (None for plain LoRA)."""
    return layer.lora_magnitude_vector["default"].weight if "default" in layer.lora_magnitude_vector else None


def _parts(layer: Any, dropout: float) -> fk.lora.LoRAWeights:
    base = layer.base_layer
    return fk.lora.LoRAWeights(
        fk.lora.int8_base(base), base.bias, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
        layer.scaling["default"], dropout, None, _magnitude(layer),
    )  # fmt: skip


def _input(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """A random input whose :data:`OUTLIERS` columns exceed 6 in magnitude (LLM.int8()'s outliers)."""
    x = testing.random_tensor(shape, torch.float32, device, seed=seed)
    x[..., list(OUTLIERS)] *= 12.0
    return x.to(dtype).requires_grad_(True)


def _grads(layers: list[Any], x: torch.Tensor) -> list[torch.Tensor]:
    """dx, then each layer's dA, dB, bias and (DoRA) magnitude gradient; cleared for the next run."""
    params = [x]
    for layer in layers:
        params += [layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.base_layer.bias]
        params += [m for m in [_magnitude(layer)] if m is not None]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def _tol(dtype: torch.dtype) -> float:
    # fk adds the LoRA branch into the base output (and forms dx in one buffer) in the input's dtype;
    # PEFT adds the fp32 LoRA branch cast to it. Relative to the largest value: a few roundings.
    return {torch.float32: 1e-5, torch.float16: 5e-3}.get(dtype, 3e-2)


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype, tol: float | None = None) -> None:  # fmt: skip
    tol = _tol(dtype) if tol is None else tol
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * float(w.detach().abs().max()))


DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
DROPOUT = pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
DORA = pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])


@DORA
@DROPOUT
@pytest.mark.parametrize("base_mode", ["eval", "train"])
@pytest.mark.parametrize("threshold", [0.0, 6.0], ids=["no_outliers", "threshold6"])
@DTYPES
def test_lora_linear_on_int8_base_matches_peft_bnb(
    bnb_device: str, dtype: torch.dtype, threshold: float, base_mode: str, dropout: float, dora: bool
) -> None:
    """Output and the gradients of x, A, B, the base bias and (DoRA) the magnitude, with the same
    dropout mask. (PEFT's DoRA with dropout recomputes the base product on the dropped input, with
    the int8 weight dequantized; without, it scales the layer's own output less its bias.)"""
    layer = _peft_layer(threshold, dtype, dropout, base_mode, bnb_device, seed=1, dora=dora)
    x = _input((2, 5, IN), dtype, bnb_device, seed=9)
    dy = testing.random_tensor((2, 5, OUT), dtype, bnb_device, seed=10)
    torch.manual_seed(0)  # (fk first: the module's docstring) the same dropout mask as PEFT's
    got = fk.lora.lora_linear(x, *_parts(layer, dropout))
    got.backward(dy)
    got_grads = _grads([layer], x)
    torch.manual_seed(0)
    want = layer(x)
    want.backward(dy)
    assert got.dtype == want.dtype == dtype
    _assert_close([got, *got_grads], [want, *_grads([layer], x)], dtype)
    if threshold > 0 and (base_mode == "eval" or bnb_device != "cpu"):  # (MatMul8bitLt ran: it records its outliers)
        assert sorted(layer.base_layer.state.idx.tolist()) == list(OUTLIERS)


@DORA
@DROPOUT
@DTYPES
def test_qkv_on_int8_bases_matches_peft_bnb(bnb_device: str, dtype: torch.dtype, dropout: float, dora: bool) -> None:
    """q, k, v (k narrower) in one fused call, outliers on: outputs, the one dx, every LoRA, bias and
    (DoRA) magnitude gradient."""
    layers = [
        _peft_layer(6.0, dtype, dropout, "eval", bnb_device, seed=s, out=n, dora=dora)
        for s, n in ((1, OUT), (4, 24), (7, OUT))
    ]
    x = _input((3, IN), dtype, bnb_device, seed=11)
    dys = [testing.random_tensor((3, layer.base_layer.out_features), dtype, bnb_device, seed=12 + i) for i, layer in enumerate(layers)]  # fmt: skip
    torch.manual_seed(0)  # (fk first: the module's docstring)
    got = fk.lora.lora_qkv(x, *(_parts(layer, dropout) for layer in layers))
    torch.autograd.backward(got, dys)
    got_grads = _grads(layers, x)
    torch.manual_seed(0)
    want = [layer(x) for layer in layers]  # masks drawn q, k, v
    torch.autograd.backward(want, dys)
    _assert_close([*got, *got_grads], [*want, *_grads(layers, x)], dtype)


@pytest.mark.parametrize(
    ("row_chunks", "dora"), [(False, False), (True, False), (False, True)], ids=["whole", "row_chunks", "dora"]
)
@DROPOUT
@DTYPES
def test_lora_mlp_on_int8_bases_matches_peft_bnb(
    bnb_device: str, dtype: torch.dtype, dropout: float, row_chunks: bool, dora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lora_mlp`` on three int8 bases (outliers on) against PEFT's LlamaMLP forward and backward. With
    a chunk size of four rows the down projection still takes all rows at once (its outlier columns
    are found over all of them). DoRA on all three: fk.lora.dora's MLP (not chunked)."""
    if row_chunks:
        monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * dtype.itemsize)
    gate, up, down = layers = [
        _peft_layer(6.0, dtype, dropout, "eval", bnb_device, seed=1, out=INTER, dora=dora),
        _peft_layer(6.0, dtype, dropout, "eval", bnb_device, seed=4, out=INTER, dora=dora),
        _peft_layer(6.0, dtype, dropout, "eval", bnb_device, seed=7, out=IN, inp=INTER, dora=dora),
    ]
    x = _input((2, 5, IN), dtype, bnb_device, seed=9)
    dy = testing.random_tensor((2, 5, IN), dtype, bnb_device, seed=10)
    torch.manual_seed(0)  # (fk first: the module's docstring)
    got = fk.lora.lora_mlp(x, *(_parts(layer, dropout) for layer in layers))
    got.backward(dy)
    got_grads = _grads(layers, x)
    torch.manual_seed(0)
    want = down(torch.nn.functional.silu(gate(x)) * up(x))
    want.backward(dy)
    _assert_close([got, *got_grads], [want, *_grads(layers, x)], dtype)


def test_backward_keeps_no_dequantized_int8_weight(bnb_device: str) -> None:
    """Autograd saves no tensor of the base weight's shape: only the layer's int8 data stays alive."""
    layer = _peft_layer(6.0, torch.float16, 0.25, "eval", bnb_device, seed=1)
    x = _input((2, 5, IN), torch.float16, bnb_device, seed=9)
    seen: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fk.lora.lora_linear(x, *_parts(layer, 0.25)).sum().backward()
    assert seen and (OUT, IN) not in seen


def test_int8_base_is_read_before_and_after_the_layers_first_call(bnb_device: str) -> None:
    """``Linear8bitLt``'s first forward moves ``SCB`` from its weight to its ``state``: ``from_bnb``
    reads it from either, sharing the layer's tensors."""
    base = _int8_base(OUT, IN, 0.0, torch.float16, bnb_device, seed=1)
    before = from_bnb(base)
    base(_input((3, IN), torch.float16, bnb_device, seed=2))
    assert base.weight.SCB is None
    after = from_bnb(base)
    assert after.data.data_ptr() == before.data.data_ptr() and after.absmax.data_ptr() == before.absmax.data_ptr()
    with pytest.raises(TypeError, match="int8 QuantizedWeight"):
        fk.lora.Int8Base(fk.lora.quantize_ref(torch.ones(4, 64), "nf4"), base)


def test_int8_base_is_refused_where_not_fused(bnb_device: str) -> None:
    layer = _peft_layer(0.0, torch.float32, 0.0, "train", bnb_device, seed=1)
    parts = _parts(layer, 0.0)
    x = _input((3, IN), torch.float32, bnb_device, seed=2)
    with pytest.raises(ValueError, match=r"outside torch\.autocast only"), torch.autocast(bnb_device, torch.bfloat16):
        fk.lora.lora_linear(x, *parts)
    with pytest.raises(ValueError, match=r"product must return \(3, 40\) in torch.float32"):
        fk.lora.lora_linear(x, *parts._replace(weight=fk.lora.Int8Base(parts.weight.weight, lambda t: t)))


# --- fk.lora.patch on a PEFT model whose linears are bitsandbytes Linear8bitLt ---------------------


class _MLP(torch.nn.Module):  # LlamaMLP's forward
    def __init__(self, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.gate_proj = _int8_base(INTER, IN, 6.0, dtype, device, seed=40, bias=False)
        self.up_proj = _int8_base(INTER, IN, 6.0, dtype, device, seed=50)
        self.down_proj = _int8_base(IN, INTER, 6.0, dtype, device, seed=60)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class _Model(torch.nn.Module):
    """An attention's q/k/v/o and a LlamaMLP, every linear an LLM.int8() ``Linear8bitLt`` (threshold 6)."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        shapes = {"q_proj": (OUT, IN), "k_proj": (24, IN), "v_proj": (OUT, IN), "o_proj": (IN, 24)}
        bases = {n: _int8_base(*shape, 6.0, dtype, device, seed=10 * i, bias=n != "k_proj") for i, (n, shape) in enumerate(shapes.items())}  # fmt: skip
        self.self_attn = torch.nn.ModuleDict(bases)
        self.mlp = _MLP(dtype, device)
        self.is_loaded_in_8bit = True  # (PEFT then wraps each Linear8bitLt in lora.bnb.Linear8bitLt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = attn["q_proj"](x), attn["k_proj"](x), attn["v_proj"](x)
        return self.mlp(attn["o_proj"](torch.tanh(q[..., :24] * k) + v[..., :24].sum(-1, keepdim=True)))


def _peft_model(dtype: torch.dtype, dropout: float, device: str, **options: Any) -> Any:
    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=dropout, target_modules=targets, **options)
    return testing.with_random_lora_b(peft.get_peft_model(_Model(dtype, device), config))


@DORA
@DROPOUT
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_patch_fuses_int8_projections_and_matches_peft(
    bnb_device: str, dtype: torch.dtype, dropout: float, dora: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """q/k/v as one group, the MLP whole (lora_mlp on its int8 bases), o alone, plain LoRA or DoRA:
    the loss, dx and every LoRA (and DoRA magnitude) gradient as PEFT + bitsandbytes give them. In
    fp32 within 1e-5 of the largest value. DoRA with dropout in fp16 within 2e-2: PEFT forms DoRA's
    terms from the input cast to the fp32 LoRA weights' dtype, fk in fp16, and ``(m / n - 1)``
    scaling the base product on the dropped input nearly cancels the base output (a few fp16
    roundings of that product, not of the smaller output), which the model's later layers carry on
    (1.2% of the largest q_proj ``lora_B`` gradient, against 1e-6 in fp32)."""
    model = _peft_model(dtype, dropout, bnb_device, use_dora=dora)
    assert type(model.base_model.model.self_attn["q_proj"]) is peft_bnb.Linear8bitLt
    x = _input((2, 3, IN), dtype, bnb_device, seed=5)
    with caplog.at_level(logging.INFO, logger="fk.lora"):  # (fk first: the module's docstring)
        report = fk.lora.patch(model)
        got = testing.seeded_loss_and_grads(model, x, seed=1, with_input=True)
    fk.lora.unpatch(model)
    want = testing.seeded_loss_and_grads(model, x, seed=1, with_input=True)
    short = lambda names: [n.rsplit(".", 1)[-1] for n in names]  # noqa: E731
    assert (short(report.mlp), [short(g) for g in report.qkv], short(report.linear), report.skipped) == (
        ["mlp"], [["q_proj", "k_proj", "v_proj"]], ["o_proj"], {}
    )  # fmt: skip
    assert "runs PEFT's forward" not in caplog.text  # every call took the fused path
    tol = 2e-2 if dora and dropout and dtype == torch.float16 else _tol(dtype)
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=0.0)
    _assert_close(got[1], want[1], dtype, tol)


def test_patch_leaves_to_peft_what_it_cannot_match(bnb_device: str, caplog: pytest.LogCaptureFixture) -> None:
    """``has_fp16_weights=True`` is left to PEFT at patch time; a bias in another dtype than the
    input's runs PEFT's forward once (bitsandbytes casts it in place), and the next call is fused."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = bnb.nn.Linear8bitLt(IN, OUT, bias=False, has_fp16_weights=True)
            self.o_proj = _int8_base(OUT, IN, 0.0, torch.float32, bnb_device, seed=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o_proj(x)

    model = peft.get_peft_model(Net().to(bnb_device), LoraConfig(r=RANK, target_modules=["o_proj", "fc"])).train()
    x = _input((3, IN), torch.float16, bnb_device, seed=5)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        report = fk.lora.patch(model)
        try:
            got = model(x)  # (the fp32 bias: PEFT's forward, which casts it to fp16)
            assert "base bias dtype torch.float32 differs from the input's torch.float16" in caplog.text
            caplog.clear()
            again = model(x)
            assert "runs PEFT's forward" not in caplog.text
        finally:
            fk.lora.unpatch(model)
    (reason,) = report.skipped.values()
    assert "has_fp16_weights=True" in reason
    assert [n.rsplit(".", 1)[-1] for n in report.linear] == ["o_proj"]
    torch.testing.assert_close(again, got, rtol=_tol(torch.float16), atol=_tol(torch.float16))
