"""QLoRA: fk.lora's fused projections and MLP on 4-bit (NF4, FP4; nested absmax or not) bitsandbytes
base weights, plain LoRA and DoRA, against PEFT's own bitsandbytes LoRA layer
(``peft.tuners.lora.bnb.Linear4bit``, ``use_dora`` or not) on the test device (bitsandbytes' CPU
backend, or its CUDA one on a GPU), and what the fused path keeps (never a dequantized weight for the
backward; one dequantized weight at a time). The comparisons with bitsandbytes are skipped without
it, or without its 4-bit backend for the device."""

from __future__ import annotations

import copy
import gc
import importlib
import logging
import statistics
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import fk.lora
from fk.core import testing
from fk.lora.quant import QuantizedWeight, from_bnb

peft = pytest.importorskip("peft")
LoraConfig = peft.LoraConfig

try:  # (the tests against bitsandbytes take the bnb_device fixture: skipped without it)
    import bitsandbytes as bnb
    import peft.tuners.lora.bnb as peft_bnb
    from peft.utils.integrations import dequantize_module_weight
except ImportError:
    bnb = peft_bnb = dequantize_module_weight = None

# Blocksize 64 with 100 input features: blocks span rows. (Not 96: bitsandbytes 0.50.2's native CPU
# dequantize_4bit is wrong for K = 96, blocksize 64 -- its own round trip is off by ~1.5 while
# fk.lora.quant's dequantization of the same bytes is within half a code step -- so PEFT's CPU
# output would be the wrong reference there.)
IN, OUT, RANK = 100, 40, 4
INTER = 40
"""The MLP's intermediate size: the down projection's input features (blocks of 64 span its rows)."""
BLOCKSIZE = 64
QUANT = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]
QUANT_IDS = ["nf4", "nf4_nested", "fp4", "fp4_nested"]
dora_or_not = pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])


@pytest.fixture
def bnb_device(device: str) -> str:
    """The test device, where bitsandbytes has a 4-bit backend for it (else the test is skipped)."""
    testing.require_bitsandbytes_4bit(device)
    return device


def _peft_layer(
    quant_type: str, nested: bool, compute: torch.dtype, dropout: float, seed: int, device: str,
    out: int = OUT, inp: int = IN, dora: bool = False,
) -> Any:  # fmt: skip
    """PEFT's LoRA layer for a bitsandbytes ``Linear4bit`` base ``[out, inp]`` with a bias, on
    ``device`` (where bitsandbytes quantizes it), in training mode, with a random (non-zero)
    ``lora_B``; LoRA weights in fp32 (PEFT's default). With ``dora``, PEFT's DoRA (``use_dora``), the
    magnitude moved by up to 30% per row from the norm PEFT starts it at (so that ``m / n`` is not 1).
    (The base weight is quantized from fp32: bitsandbytes dequantizes it to fp32, which PEFT's DoRA
    norm then starts from, also next to a bf16 ``compute_dtype``.)"""
    base = bnb.nn.Linear4bit(inp, out, bias=True, compute_dtype=compute, quant_type=quant_type)
    w = testing.random_tensor((out, inp), torch.float32, "cpu", seed=seed)
    base.weight = bnb.nn.Params4bit(
        w, requires_grad=False, quant_type=quant_type, blocksize=BLOCKSIZE, compress_statistics=nested
    )
    base = base.to(device)
    with torch.no_grad():
        base.bias.copy_(testing.random_tensor((out,), torch.float32, device, seed=seed + 1))
    config = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=dropout, use_dora=dora)
    layer = peft_bnb.Linear4bit(base, "default", config, r=RANK, lora_alpha=8, lora_dropout=dropout, use_dora=dora)
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(testing.random_tensor((out, RANK), torch.float32, device, seed=seed + 2))
        if dora:
            layer.lora_magnitude_vector["default"].weight.mul_(1 + 0.3 * testing.random_tensor((out,), torch.float32, device, seed=seed + 3))  # fmt: skip
    return layer.to(device).train()


def _magnitude(layer: Any) -> torch.Tensor | None:
    """The layer's DoRA magnitude (None for plain LoRA)."""
    return layer.lora_magnitude_vector["default"].weight if "default" in layer.lora_magnitude_vector else None


def _parts(layer: Any, compute: torch.dtype, dropout: float) -> fk.lora.LoRAWeights:
    base = layer.base_layer
    return fk.lora.LoRAWeights(
        from_bnb(base), base.bias.to(compute), layer.lora_A["default"].weight, layer.lora_B["default"].weight,
        layer.scaling["default"], dropout, None, _magnitude(layer),
    )  # fmt: skip


def _grads(layer: Any) -> list[torch.Tensor]:
    """The gradients of lora_A, lora_B, the base bias and (DoRA) the magnitude, taken off the layer."""
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.base_layer.bias]
    params += [m for m in [_magnitude(layer)] if m is not None]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def _tol(compute: torch.dtype) -> dict[str, float]:
    # bf16: PEFT adds the fp32 LoRA branch cast to bf16 to the base output, fk's base matmul adds into xa B^T
    # (and Triton's interpreter rounds the dequantized bf16 weight toward zero, bitsandbytes to nearest).
    return {"rtol": 1e-5, "atol": 1e-5} if compute == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}


def _assert_outputs_close(got: torch.Tensor, want: torch.Tensor, compute: torch.dtype, dora: bool) -> None:
    """Plain LoRA: :func:`_tol`, its absolute part at least two roundings (one ``eps``) of the
    largest output: fk writes the rank-sized product first and the base matmul adds into it in
    fp32, while PEFT rounds the base output first and then adds the LoRA branch, so each is a
    rounding of a term as large as the output away from the exact value, on either side (fk the
    closer one in the case that needed this: 0.080 against PEFT's 0.120 off the float64 value, at
    outputs up to 35, bf16). DoRA: its absolute part relative to the largest output, as for the
    gradients. With dropout, ``(m / n - 1)`` scales the base product on the dropped input, which
    nearly cancels the base output where ``m / n`` is far from 1: PEFT rounds the base output to bf16
    and adds that product in fp32, fk rounds both to bf16, so each is a few bf16 roundings of the
    base product (not of the smaller output) away from the exact value, on either side."""
    tol = _tol(compute)
    largest = float(want.detach().abs().max())
    atol = tol["atol"] * largest if dora else max(tol["atol"], torch.finfo(compute).eps * largest)
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=atol)


@dora_or_not
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("quant_type", "nested"), QUANT, ids=QUANT_IDS)
def test_lora_linear_on_4bit_base_matches_peft_bnb(bnb_device: str, quant_type: str, nested: bool, compute: torch.dtype, dropout: float, dora: bool) -> None:  # fmt: skip
    """One projection: the output and the gradients of x, lora_A, lora_B, the bias and (DoRA) the
    magnitude. (PEFT's DoRA with dropout recomputes the base product on the dropped input.)"""
    layer = _peft_layer(quant_type, nested, compute, dropout, seed=1, device=bnb_device, dora=dora)
    x = testing.random_tensor((2, 5, IN), compute, bnb_device, seed=9).requires_grad_(True)
    dy = testing.random_tensor((2, 5, OUT), compute, bnb_device, seed=10)
    torch.manual_seed(0)
    want = layer(x)
    want.backward(dy)
    want_grads = [x.grad.clone(), *_grads(layer)]
    x.grad = None
    torch.manual_seed(0)  # the same dropout mask (fk draws it as PEFT's nn.Dropout does)
    got = fk.lora.lora_linear(x, *_parts(layer, compute, dropout))
    got.backward(dy)
    got_grads = [x.grad, *_grads(layer)]
    assert got.dtype == want.dtype == compute
    _assert_outputs_close(got, want, compute, dora)
    scale = max(float(w.abs().max()) for w in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=_tol(compute)["rtol"], atol=_tol(compute)["atol"] * scale)


@dora_or_not
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qkv_on_4bit_bases_matches_peft_bnb(bnb_device: str, compute: torch.dtype, dropout: float, dora: bool) -> None:
    """q, k, v (NF4 nested, FP4, NF4; k narrower) in one fused call: outputs and the one dx."""
    layers = [
        _peft_layer("nf4", True, compute, dropout, seed=1, device=bnb_device, dora=dora),
        _peft_layer("fp4", False, compute, dropout, seed=4, device=bnb_device, out=24, dora=dora),
        _peft_layer("nf4", False, compute, dropout, seed=7, device=bnb_device, dora=dora),
    ]
    x = testing.random_tensor((3, IN), compute, bnb_device, seed=11).requires_grad_(True)
    dys = [testing.random_tensor((3, layer.base_layer.out_features), compute, bnb_device, seed=12 + i) for i, layer in enumerate(layers)]  # fmt: skip
    torch.manual_seed(0)
    want = [layer(x) for layer in layers]  # masks drawn q, k, v
    torch.autograd.backward(want, dys)
    want_grads = [x.grad.clone(), *(g for layer in layers for g in _grads(layer))]
    x.grad = None
    torch.manual_seed(0)
    got = fk.lora.lora_qkv(x, *(_parts(layer, compute, dropout) for layer in layers))
    torch.autograd.backward(got, dys)
    got_grads = [x.grad, *(g for layer in layers for g in _grads(layer))]
    for g, w in zip(got, want, strict=True):
        _assert_outputs_close(g, w, compute, dora)
    scale = max(float(w.abs().max()) for w in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=_tol(compute)["rtol"], atol=_tol(compute)["atol"] * scale)


def _mlp_layers(
    quant_type: str, nested: bool, compute: torch.dtype, dropout: float, device: str, dora: bool = False
) -> list[Any]:
    """PEFT's LoRA layers of a LlamaMLP on 4-bit bases: gate and up ``[INTER, IN]``, down ``[IN, INTER]``."""
    return [
        _peft_layer(quant_type, nested, compute, dropout, seed=1, device=device, out=INTER, dora=dora),
        _peft_layer(quant_type, nested, compute, dropout, seed=4, device=device, out=INTER, dora=dora),
        _peft_layer(quant_type, nested, compute, dropout, seed=7, device=device, out=IN, inp=INTER, dora=dora),
    ]


def _compare_mlp_with_peft(layers: list[Any], compute: torch.dtype, dropout: float, device: str) -> None:
    """``lora_mlp`` on the layers' 4-bit bases against PEFT's forward (LlamaMLP's: masks drawn gate,
    up, down) and backward: the output, dx and every LoRA, bias and (DoRA) magnitude gradient."""
    gate, up, down = layers
    x = testing.random_tensor((2, 5, IN), compute, device, seed=9).requires_grad_(True)
    dy = testing.random_tensor((2, 5, IN), compute, device, seed=10)
    torch.manual_seed(0)
    want = down(torch.nn.functional.silu(gate(x)) * up(x))
    want.backward(dy)
    want_grads = [x.grad.clone(), *(g for layer in layers for g in _grads(layer))]
    x.grad = None
    torch.manual_seed(0)
    got = fk.lora.lora_mlp(x, *(_parts(layer, compute, dropout) for layer in layers))
    got.backward(dy)
    got_grads = [x.grad, *(g for layer in layers for g in _grads(layer))]
    assert got.dtype == want.dtype == compute
    # Three projections deep, relative to the largest value: fp32 sums in another order (fk adds the
    # LoRA branch into the base output; fk.glu's activation), bf16 rounds h and the outputs as PEFT does
    # but not at the same points.
    tol = 1e-4 if compute == torch.float32 else _tol(compute)["rtol"]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.detach().abs().max()))
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * float(w.abs().max()))


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("quant_type", "nested"), QUANT, ids=QUANT_IDS)
def test_lora_mlp_on_4bit_bases_matches_peft_bnb(bnb_device: str, quant_type: str, nested: bool, compute: torch.dtype, dropout: float) -> None:  # fmt: skip
    _compare_mlp_with_peft(_mlp_layers(quant_type, nested, compute, dropout, bnb_device), compute, dropout, bnb_device)


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("quant_type", "nested"), [("nf4", True), ("fp4", False)], ids=["nf4_nested", "fp4"])
def test_dora_mlp_on_4bit_bases_matches_peft_bnb(bnb_device: str, quant_type: str, nested: bool, compute: torch.dtype, dropout: float) -> None:  # fmt: skip
    """DoRA on gate, up and down (fk.lora.dora's MLP), each on a 4-bit base. (The four quantizations
    of one projection: test_lora_linear_on_4bit_base_matches_peft_bnb.)"""
    layers = _mlp_layers(quant_type, nested, compute, dropout, bnb_device, dora=True)
    _compare_mlp_with_peft(layers, compute, dropout, bnb_device)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_mlp_on_4bit_bases_in_row_chunks_matches_peft_bnb(
    bnb_device: str, compute: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MLP forming ``act(gate) * up`` four rows at a time (a down base dequantized once for all chunks)."""
    monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * compute.itemsize)
    _compare_mlp_with_peft(_mlp_layers("nf4", True, compute, 0.0, bnb_device), compute, 0.0, bnb_device)


def _random_4bit_parts(
    out: int, inp: int, device: str, seed: int, dropout: float, dora: bool = False
) -> fk.lora.LoRAWeights:
    """A LoRA projection on a random NF4 (nested) base ``[out, inp]`` (fk.lora.quant's own
    quantizer, from fp32), without bias, LoRA weights (and with ``dora`` a magnitude) in fp32 that
    require grad."""
    w = testing.random_tensor((out, inp), torch.float32, device, seed=seed)
    a = testing.random_tensor((RANK, inp), torch.float32, device, seed=seed + 1, requires_grad=True)
    b = testing.random_tensor((out, RANK), torch.float32, device, seed=seed + 2, requires_grad=True)
    m = testing.random_tensor((out,), torch.float32, device, seed=seed + 3).add(8.0).requires_grad_() if dora else None
    q = fk.lora.quantize_ref(w, "nf4", BLOCKSIZE, nested=True)
    return fk.lora.LoRAWeights(q, None, a, b, 2.0, dropout, None, m)


def _mlp_parts(device: str, dropout: float, dora: bool = False) -> list[fk.lora.LoRAWeights]:
    return [_random_4bit_parts(*shape, device, seed, dropout, dora) for shape, seed in (((INTER, IN), 1), ((INTER, IN), 4), ((IN, INTER), 7))]  # fmt: skip


def _saved_shapes(call: Callable[[], torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of every tensor autograd saves for the backward of ``call()``'s output."""
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call().sum().backward()
    return seen


def _densified(parts: fk.lora.LoRAWeights, compute: torch.dtype) -> fk.lora.LoRAWeights:
    assert isinstance(parts.weight, QuantizedWeight)
    return parts._replace(weight=fk.lora.dequantize(parts.weight, dtype=compute))


@dora_or_not
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", ["linear", "mlp"])
def test_backward_does_not_keep_the_dequantized_weight(bnb_device: str, block: str, compute: torch.dtype, dora: bool) -> None:  # fmt: skip
    """No tensor of a base weight's shape in the compute dtype (nor in fp32, the dtype the weights
    were quantized from, which DoRA's norm reads) is saved for the backward (with dense base
    weights, those tensors are saved: the hook sees them)."""
    x = testing.random_tensor((2, 5, IN), compute, bnb_device, seed=9).requires_grad_(True)
    if block == "linear":
        layer = _peft_layer("nf4", True, compute, 0.25, seed=1, device=bnb_device, dora=dora)
        parts = [_parts(layer, compute, 0.25)]
        call = lambda ps: fk.lora.lora_linear(x, *ps[0])  # noqa: E731
        weights = [(OUT, IN)]
    else:
        parts = _mlp_parts(bnb_device, 0.25, dora)
        call = lambda ps: fk.lora.lora_mlp(x, *ps)  # noqa: E731
        weights = [(INTER, IN), (IN, INTER)]
    quantized = _saved_shapes(lambda: call(parts))
    dense = _saved_shapes(lambda: call([_densified(p, compute) for p in parts]))
    for shape in weights:
        assert (shape, compute) not in quantized and (shape, torch.float32) not in quantized
        assert (shape, compute) in dense


@pytest.fixture
def dequantized(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Each time fk.lora dequantizes 4-bit bases, (how many it dequantized, how many weights it
    dequantized before are still alive): one by ``QuantizedBase.dense``, or several by one launch
    (``dequantized_together``); a weak reference to each. After the test, none may be alive."""
    module = importlib.import_module("fk.lora.quantized_base")
    original_dense, original_together = module.QuantizedBase.dense, module.dequantize_together
    made: list[weakref.ref[torch.Tensor]] = []
    events: list[tuple[int, int]] = []

    # (no gc.collect(): a weight freed only by the collector counts as alive)
    def dense(self: Any, **kwargs: Any) -> torch.Tensor:
        events.append((1, sum(ref() is not None for ref in made)))
        w = original_dense(self, **kwargs)
        made.append(weakref.ref(w))
        return w

    def together(qs: Any, **kwargs: Any) -> list[torch.Tensor]:
        events.append((len(qs), sum(ref() is not None for ref in made)))
        ws = original_together(qs, **kwargs)
        made.extend(weakref.ref(w) for w in ws)
        return ws

    monkeypatch.setattr(module.QuantizedBase, "dense", dense)
    monkeypatch.setattr(module, "dequantize_together", together)
    yield events
    gc.collect()
    assert all(ref() is None for ref in made), "a dequantized weight outlived the call"


@pytest.mark.parametrize("together", [True, False], ids=["small_together", "one_at_a_time"])
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("block", ["qkv", "mlp", "mlp_row_chunks", "dora_qkv", "dora_mlp"])
def test_each_weight_dequantized_once_per_pass(
    device: str,
    block: str,
    dropout: float,
    together: bool,
    dequantized: list[tuple[int, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward and backward dequantize each 4-bit base once (the forward for its base matmul, and
    DoRA's norm and dropped-input product; the backward for its dx term; the MLP's down projection
    once for all its row chunks), never while another dequantized weight is alive: plain LoRA's
    small weights that share an input (q, k, v; gate, up) together by one launch, or, above
    ``TOGETHER_MAX_ELEMENTS``, one at a time; DoRA's one at a time."""
    cap = 1 << 25 if together else 0  # (the probe's choice; 0: never)
    monkeypatch.setattr(importlib.import_module("fk.lora.quantized_base"), "TOGETHER_MAX_ELEMENTS", cap)
    x = testing.random_tensor((2, 5, IN), torch.float32, device, seed=9).requires_grad_(True)
    dora = block.startswith("dora_")
    if block.endswith("qkv"):
        parts = [_random_4bit_parts(n, IN, device, seed, dropout, dora) for n, seed in ((OUT, 1), (24, 4), (24, 7))]
        outs = fk.lora.lora_qkv(x, *parts)
        forward, backward = ([(3, 0)], [(3, 0)]) if together and not dora else ([(1, 0)] * 3, [(1, 0)] * 3)
    else:
        if block == "mlp_row_chunks":
            monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * 4)
        outs = (fk.lora.lora_mlp(x, *_mlp_parts(device, dropout, dora)),)
        # gate and up (together or not), then down; the backward: down's, then gate and up's dx
        forward, backward = ([(2, 0), (1, 0)], [(1, 0), (2, 0)]) if together and not dora else ([(1, 0)] * 3,) * 2
    assert dequantized == forward
    del dequantized[:]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    assert dequantized == backward
    assert x.grad is not None


def test_quantized_base_is_refused_where_not_fused(device: str) -> None:
    """(DoRA on a 4-bit base is fused, outside autocast and under it, as DoRA on a dense one; int8:
    test_qlora_int8.py.)"""
    gate, up, _ = _mlp_parts(device, 0.0)
    x = testing.random_tensor((3, IN), torch.float32, device, seed=2)
    with pytest.raises(ValueError, match=r"down_parts\.weight takes 100 input features"):
        fk.lora.lora_mlp(x, gate, up, gate)


# --- fk.lora.patch on a PEFT model whose linears are bitsandbytes Linear4bit -----------------------


class _Attention(torch.nn.Module):
    def __init__(self, compute: torch.dtype) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, bnb.nn.Linear4bit(IN, OUT, bias=name != "k_proj", compute_dtype=compute))
        self.o_proj = bnb.nn.Linear4bit(OUT, IN, bias=False, compute_dtype=compute, quant_type="fp4")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(torch.tanh(q * k) + v)


class _MLP(torch.nn.Module):  # LlamaMLP's forward
    def __init__(self, compute: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = bnb.nn.Linear4bit(IN, 64, bias=False, compute_dtype=compute)
        self.up_proj = bnb.nn.Linear4bit(IN, 64, bias=False, compute_dtype=compute, quant_type="fp4")
        self.down_proj = bnb.nn.Linear4bit(64, IN, bias=False, compute_dtype=compute)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class _Block(torch.nn.Module):
    def __init__(self, compute: torch.dtype) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attention(compute), _MLP(compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.self_attn(x))


def _qlora_model(
    compute: torch.dtype, dropout: float, device: str, dora: bool = False, bnb_layers: bool = False
) -> Any:
    """A PEFT model of :class:`_Block`; ``bnb_layers``: flagged as transformers flags a model loaded
    in 4 bits, so that PEFT wraps the bases in ``lora.bnb.Linear4bit`` (else in ``lora.Linear``)."""
    torch.manual_seed(3)
    block = _Block(compute).to(device)  # (quantizes the weights)
    if bnb_layers:
        block.is_loaded_in_4bit = True
    config = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=dropout, use_dora=dora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    return testing.with_random_lora_b(peft.get_peft_model(block, config))


@dora_or_not
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_patch_fuses_4bit_projections_and_matches_peft(
    bnb_device: str, compute: torch.dtype, dropout: float, dora: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """q/k/v as one group, the MLP whole (lora_mlp on its 4-bit bases), o alone, plain LoRA or DoRA:
    the loss and every LoRA (and magnitude) gradient as PEFT + bitsandbytes give them."""
    model = _qlora_model(compute, dropout, bnb_device, dora)
    x = testing.random_tensor((2, 3, IN), compute, bnb_device, seed=5)
    want = testing.seeded_loss_and_grads(model, x, seed=1)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        report = fk.lora.patch(model)
        try:
            got = testing.seeded_loss_and_grads(model, x, seed=1)
        finally:
            fk.lora.unpatch(model)
    assert not report.skipped
    assert [n.rsplit(".", 1)[-1] for n in report.mlp] == ["mlp"]
    assert [[n.rsplit(".", 1)[-1] for n in group] for group in report.qkv] == [["q_proj", "k_proj", "v_proj"]]
    assert [n.rsplit(".", 1)[-1] for n in report.linear] == ["o_proj"]
    assert "runs PEFT's forward" not in caplog.text  # every call took the fused path
    tol = _tol(compute)
    torch.testing.assert_close(got[0], want[0], rtol=tol["rtol"], atol=tol["atol"] * float(want[0]))
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=tol["rtol"], atol=tol["atol"] * float(w.abs().max()))


def test_patch_leaves_mismatched_inputs_to_peft(bnb_device: str, caplog: pytest.LogCaptureFixture) -> None:
    """A 4-bit layer called on an input unlike its compute_dtype runs PEFT's forward, with a log line.
    (int8 bases: test_qlora_int8.py.)"""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = bnb.nn.Linear4bit(IN, OUT, bias=False, compute_dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o_proj(x)

    model = peft.get_peft_model(Net().to(bnb_device), LoraConfig(r=RANK, target_modules=["o_proj"])).train()
    x = testing.random_tensor((3, IN), torch.float32, bnb_device, seed=5)
    want = model(x)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        report = fk.lora.patch(model)
        try:
            got = model(x)
        finally:
            fk.lora.unpatch(model)
    assert not report.skipped and report.n_patched == 1
    assert "differs from the 4-bit base's compute_dtype" in caplog.text
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.0)


def _lora_weights_to(model: Any, dtype: torch.dtype) -> Any:
    """``model`` with its LoRA weights cast to ``dtype`` in place (PEFT's ``autocast_adapter_dtype=False``)."""
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
    return model


def _autocast_loss_and_grads(model: Any, x: torch.Tensor) -> tuple[torch.dtype, torch.Tensor, list[torch.Tensor]]:
    """The output's dtype, the loss and the gradients of :func:`fk.core.testing.seeded_loss_and_grads`
    under bf16 autocast on ``x``'s device."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        torch.manual_seed(1)
        out_dtype = model(x).dtype
        loss, grads = testing.seeded_loss_and_grads(model, x, seed=1)
    return out_dtype, loss, grads


def _float64_replaying(model: Any, masks: dict[str, torch.Tensor]) -> Any:
    """A float64 CPU copy of the PEFT ``model`` whose 4-bit bases are dense layers of their
    dequantized weights (PEFT's own ``dequantize_module_weight``) and whose dropout modules apply
    ``masks`` (by module name) instead of drawing: the exact arithmetic of PEFT's forward."""
    reference = copy.deepcopy(model)
    for module in list(reference.modules()):
        base = getattr(module, "base_layer", None)
        if isinstance(base, bnb.nn.Linear4bit):
            dense = torch.nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(dequantize_module_weight(base).float().cpu())
                if base.bias is not None:
                    dense.bias.copy_(base.bias.float().cpu())
            dense.weight.requires_grad_(False)
            if base.bias is not None:
                dense.bias.requires_grad_(base.bias.requires_grad)
            module.base_layer = dense
    reference = reference.to("cpu", torch.float64)
    for name, m in reference.named_modules():
        if name in masks:
            m.register_forward_hook(lambda mod, inp, out, name=name: inp[0] * masks[name] / (1 - mod.p))
    return reference


def _rms_relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` (Frobenius norms, in float64 on the CPU)."""
    diff = actual.detach().cpu().double() - reference.double()
    return float(diff.norm() / reference.double().norm())


def _patched_like_peft_under_autocast(
    model: Any, x: torch.Tensor, out_dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> Any:
    """Patch ``model``, check that under bf16 autocast every call took the fused path and gave PEFT's
    output dtype (``out_dtype``) and PEFT's loss and gradients with the same masks, unpatch it;
    returns the report.

    fk and PEFT are both measured against PEFT's forward in float64 replaying PEFT's masks
    (:func:`_float64_replaying`), by the relative RMS error of the loss and of each gradient. Through
    these four bf16 layers both are off by about 1% typically and up to 7% of the largest element,
    on different elements (each rounds where the other does not), so the max-error rule of
    :func:`fk.core.testing.assert_close` (twice PEFT's error) fails by chance where neither is
    wrong: ``benchmarks/experiments/INDEX.md#qlora_autocast_noise``. The rule here: over the model,
    fk's median error is at most twice PEFT's (0.49 to 1.68 times on 42 H200 cases; a 5% error in
    every LoRA scaling gives 6.8 to 8.3 times); each tensor's error at most four times PEFT's
    (PEFT's median where larger) plus bf16's floor (a wrong mask or dtype anywhere costs that
    tensor tens of percent)."""
    masks: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, name=n: masks.__setitem__(name, (out != 0).cpu()))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Dropout)
    ]
    try:
        want = _autocast_loss_and_grads(model, x)
    finally:
        for h in hooks:
            h.remove()
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        report = fk.lora.patch(model)
        try:
            got = _autocast_loss_and_grads(model, x)
        finally:
            fk.lora.unpatch(model)
    assert "runs PEFT's forward" not in caplog.text  # every call took the fused path
    assert got[0] == want[0] == out_dtype
    ref = testing.seeded_loss_and_grads(_float64_replaying(model, masks), x.to("cpu", torch.float64), seed=1)
    names = ["loss"] + [n for n, p in model.named_parameters() if p.requires_grad]
    fk_errors, peft_errors = {}, {}
    for name, a, r, b in zip(names, [got[1], *got[2]], [ref[0], *ref[1]], [want[1], *want[2]], strict=True):
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype}, PEFT's {b.dtype}"
        fk_errors[name], peft_errors[name] = _rms_relative_error(a, r), _rms_relative_error(b, r)
    fk_median, peft_median = statistics.median(fk_errors.values()), statistics.median(peft_errors.values())
    assert fk_median <= 2 * peft_median, f"median relative error {fk_median:.2e}, PEFT's {peft_median:.2e}"
    floor = testing.floor_of(torch.bfloat16, x.device)
    for name, error in fk_errors.items():
        bound = 4 * max(peft_errors[name], peft_median) + floor
        assert error <= bound, f"{name}: relative error {error:.2e} > {bound:.2e} (PEFT's {peft_errors[name]:.2e})"
    return report


peft_layers = pytest.mark.parametrize("bnb_layers", [False, True], ids=["lora_Linear", "lora_bnb_Linear4bit"])


@dora_or_not
@peft_layers
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16_input", "fp32_input"])
@pytest.mark.parametrize(
    ("dropout", "lora_dtype"),
    [(0.0, torch.float32), (0.25, torch.bfloat16), (0.25, torch.float32)],
    ids=["no_dropout", "dropout_bf16_lora", "dropout_fp32_lora"],
)
def test_patch_fuses_4bit_under_autocast(
    bnb_device: str, x_dtype: torch.dtype, dropout: float, lora_dtype: torch.dtype, bnb_layers: bool, dora: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Under bf16 autocast (HF Trainer's ``bf16=True``), a block on 4-bit bases of compute_dtype bf16,
    its input in bf16 or in fp32 (``peft.prepare_model_for_kbit_training`` keeps the hidden states in
    fp32), LoRA weights in fp32 (PEFT's default) or bf16, with and without dropout, in PEFT's
    ``lora.Linear`` or ``lora.bnb.Linear4bit``: every LoRA layer fused; the output's dtype (PEFT's
    layers on 4-bit bases return their input's), the loss and every gradient as PEFT's under the
    same autocast, with the same masks (``lora.Linear`` draws them on the LoRA weights' dtype,
    ``lora.bnb.Linear4bit`` on the input's under CUDA autocast, which a GPU run tells apart), plain
    LoRA and DoRA (whose ``lora.bnb.Linear4bit`` returns the magnitude's wider dtype under CUDA
    autocast, adding its terms without casting back)."""
    model = _qlora_model(torch.bfloat16, dropout, bnb_device, dora, bnb_layers=bnb_layers)
    model = _lora_weights_to(model, lora_dtype)  # (the DoRA magnitude too)
    assert (type(model.base_model.model.mlp.down_proj).__module__ == "peft.tuners.lora.bnb") == bnb_layers
    x = testing.random_tensor((2, 3, IN), x_dtype, bnb_device, seed=5)
    cuda_bnb_dora = dora and bnb_layers and torch.device(bnb_device).type == "cuda"
    out_dtype = torch.promote_types(x_dtype, lora_dtype) if cuda_bnb_dora else x_dtype
    report = _patched_like_peft_under_autocast(model, x, out_dtype, caplog)
    assert not report.skipped and report.n_patched == 3  # the MLP, the q/k/v group, o_proj


@peft_layers
def test_patch_gives_a_4bit_down_proj_its_own_input_dtype_under_autocast(
    bnb_device: str, bnb_layers: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Under bf16 autocast on an fp32 input, an MLP whose gate and up have dense bf16 bases gives
    ``down_proj`` a bf16 input: the fused MLP returns bf16, as PEFT's 4-bit down_proj does there,
    and draws down's mask as PEFT's layer draws it on that input (``lora.bnb.Linear4bit`` under
    CUDA autocast: on bf16)."""
    torch.manual_seed(3)
    mlp = _MLP(torch.bfloat16)
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(IN, 64, bias=False), torch.nn.Linear(IN, 64, bias=False)
    mlp.gate_proj.to(torch.bfloat16), mlp.up_proj.to(torch.bfloat16)
    if bnb_layers:
        mlp.is_loaded_in_4bit = True
    config = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=0.25, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = testing.with_random_lora_b(peft.get_peft_model(mlp.to(bnb_device), config))
    assert (type(model.base_model.model.down_proj).__module__ == "peft.tuners.lora.bnb") == bnb_layers
    x = testing.random_tensor((2, 3, IN), torch.float32, bnb_device, seed=5)
    report = _patched_like_peft_under_autocast(model, x, torch.bfloat16, caplog)
    assert report.n_patched == 1 and len(report.mlp) == 1


@pytest.mark.parametrize(
    ("compute", "x_dtype", "reason"),
    [
        (torch.float16, torch.float16, "compute_dtype torch.float16 under autocast to torch.bfloat16"),
        (torch.bfloat16, torch.float16, "input dtype torch.float16 on a 4-bit base under autocast"),
    ],
    ids=["compute_unlike_autocast", "fp16_input"],
)
def test_patch_leaves_4bit_under_autocast_to_peft_where_it_differs(
    bnb_device: str, compute: torch.dtype, x_dtype: torch.dtype, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under bf16 autocast, a compute_dtype unlike autocast's dtype and an fp16 input run PEFT's
    forward, with a log line naming why; the output is PEFT's (the same generator state for both
    calls)."""
    model = _qlora_model(compute, 0.25, bnb_device)
    x = testing.random_tensor((2, 3, IN), x_dtype, bnb_device, seed=5)
    autocast = torch.autocast(torch.device(bnb_device).type, dtype=torch.bfloat16)
    torch.manual_seed(1)
    with autocast:
        want = model(x)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        fk.lora.patch(model)
        try:
            torch.manual_seed(1)
            with autocast:
                got = model(x)
        finally:
            fk.lora.unpatch(model)
    assert reason in caplog.text
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.0)
