"""QLoRA: fk.lora's fused projections on a 4-bit (NF4, FP4; nested absmax or not) bitsandbytes base
weight, against PEFT's own bitsandbytes LoRA layer (``peft.tuners.lora.bnb.Linear4bit``), and what
the fused path keeps for the backward (never the dequantized weight). Skipped without bitsandbytes."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import fk.lora
from fk.core import testing
from fk.lora.quant import QuantizedWeight, from_bnb

bnb = pytest.importorskip("bitsandbytes")
peft_bnb = pytest.importorskip("peft.tuners.lora.bnb")
from peft import LoraConfig  # noqa: E402

# Blocksize 64 with 100 input features: blocks span rows. (Not 96: bitsandbytes 0.50.2's native CPU
# dequantize_4bit is wrong for K = 96, blocksize 64 -- its own round trip is off by ~1.5 while
# fk.lora.quant's dequantization of the same bytes is within half a code step -- so PEFT's CPU
# output would be the wrong reference there.)
IN, OUT, RANK = 100, 40, 4
BLOCKSIZE = 64
QUANT = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]
QUANT_IDS = ["nf4", "nf4_nested", "fp4", "fp4_nested"]


def _peft_layer(quant_type: str, nested: bool, compute: torch.dtype, dropout: float, seed: int, out: int = OUT) -> Any:
    """PEFT's LoRA layer for a bitsandbytes ``Linear4bit`` base ``[out, IN]`` with a bias, in training
    mode, with a random (non-zero) ``lora_B``; LoRA weights in fp32 (PEFT's default)."""
    base = bnb.nn.Linear4bit(IN, out, bias=True, compute_dtype=compute, quant_type=quant_type)
    w = testing.random_tensor((out, IN), torch.float32, "cpu", seed=seed)
    base.weight = bnb.nn.Params4bit(
        w, requires_grad=False, quant_type=quant_type, blocksize=BLOCKSIZE, compress_statistics=nested
    )
    base = base.to("cpu")
    with torch.no_grad():
        base.bias.copy_(testing.random_tensor((out,), torch.float32, "cpu", seed=seed + 1))
    config = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=dropout)
    layer = peft_bnb.Linear4bit(base, "default", config, r=RANK, lora_alpha=8, lora_dropout=dropout)
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(testing.random_tensor((out, RANK), torch.float32, "cpu", seed=seed + 2))
    return layer.train()


def _parts(layer: Any, compute: torch.dtype, dropout: float) -> fk.lora.LoRAWeights:
    base = layer.base_layer
    return fk.lora.LoRAWeights(
        from_bnb(base), base.bias.to(compute), layer.lora_A["default"].weight, layer.lora_B["default"].weight,
        layer.scaling["default"], dropout,
    )  # fmt: skip


def _grads(layer: Any) -> list[torch.Tensor]:
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.base_layer.bias]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def _tol(compute: torch.dtype) -> dict[str, float]:
    # bf16: PEFT adds the fp32 LoRA branch cast to bf16, fk adds xa B^T in bf16 into the base output
    # (and Triton's interpreter rounds the dequantized bf16 weight toward zero, bitsandbytes to nearest).
    return {"rtol": 1e-5, "atol": 1e-5} if compute == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("quant_type", "nested"), QUANT, ids=QUANT_IDS)
def test_lora_linear_on_4bit_base_matches_peft_bnb(quant_type: str, nested: bool, compute: torch.dtype, dropout: float) -> None:  # fmt: skip
    layer = _peft_layer(quant_type, nested, compute, dropout, seed=1)
    x = testing.random_tensor((2, 5, IN), compute, "cpu", seed=9).requires_grad_(True)
    dy = testing.random_tensor((2, 5, OUT), compute, "cpu", seed=10)
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
    torch.testing.assert_close(got, want, **_tol(compute))
    scale = max(float(w.abs().max()) for w in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=_tol(compute)["rtol"], atol=_tol(compute)["atol"] * scale)


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qkv_on_4bit_bases_matches_peft_bnb(compute: torch.dtype, dropout: float) -> None:
    """q, k, v (NF4 nested, FP4, NF4; k narrower) in one fused call: outputs and the one dx."""
    layers = [
        _peft_layer("nf4", True, compute, dropout, seed=1),
        _peft_layer("fp4", False, compute, dropout, seed=4, out=24),
        _peft_layer("nf4", False, compute, dropout, seed=7),
    ]
    x = testing.random_tensor((3, IN), compute, "cpu", seed=11).requires_grad_(True)
    dys = [testing.random_tensor((3, layer.base_layer.out_features), compute, "cpu", seed=12 + i) for i, layer in enumerate(layers)]  # fmt: skip
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
        torch.testing.assert_close(g, w, **_tol(compute))
    scale = max(float(w.abs().max()) for w in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=_tol(compute)["rtol"], atol=_tol(compute)["atol"] * scale)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_does_not_keep_the_dequantized_weight(compute: torch.dtype) -> None:
    """No tensor of the weight's shape in the compute dtype is saved for the backward (with a dense
    base weight, that tensor is saved: the hook sees it)."""
    layer = _peft_layer("nf4", True, compute, 0.25, seed=1)
    parts = _parts(layer, compute, 0.25)
    x = testing.random_tensor((2, 5, IN), compute, "cpu", seed=9).requires_grad_(True)

    def saved(weight: torch.Tensor | QuantizedWeight) -> list[tuple[tuple[int, ...], torch.dtype]]:
        seen: list[tuple[tuple[int, ...], torch.dtype]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fk.lora.lora_linear(x, *parts._replace(weight=weight)).sum().backward()
        return seen

    assert ((OUT, IN), compute) not in saved(parts.weight)
    assert ((OUT, IN), compute) in saved(fk.lora.quant.dequantize(parts.weight, dtype=compute))


def test_quantized_base_is_refused_where_not_fused() -> None:
    layer = _peft_layer("nf4", False, torch.float32, 0.0, seed=1)
    parts = _parts(layer, torch.float32, 0.0)
    x = testing.random_tensor((3, IN), torch.float32, "cpu", seed=2)
    with pytest.raises(ValueError, match="DoRA on a quantized base"):
        fk.lora.lora_linear(x, *parts._replace(magnitude=torch.ones(OUT)))
    with pytest.raises(ValueError, match="lora_mlp does not take a QuantizedWeight"):
        fk.lora.lora_mlp(x, parts, parts, parts)


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
        self.up_proj = bnb.nn.Linear4bit(IN, 64, bias=False, compute_dtype=compute)
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


def _qlora_model(compute: torch.dtype, dropout: float) -> Any:
    from peft import get_peft_model

    torch.manual_seed(3)
    block = _Block(compute).to("cpu")  # (quantizes the weights)
    config = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    model = get_peft_model(block, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    return model.train()


def _model_loss(model: Any, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    loss = model(x).float().square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_patch_fuses_4bit_projections_and_matches_peft(
    compute: torch.dtype, dropout: float, caplog: pytest.LogCaptureFixture
) -> None:
    """q/k/v as one group, o and the MLP's projections alone (lora_mlp takes no 4-bit base yet):
    the loss and every LoRA gradient as PEFT + bitsandbytes give them."""
    model = _qlora_model(compute, dropout)
    x = testing.random_tensor((2, 3, IN), compute, "cpu", seed=5)
    want = _model_loss(model, x, seed=1)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        report = fk.lora.patch(model)
        try:
            got = _model_loss(model, x, seed=1)
        finally:
            fk.lora.unpatch(model)
    assert not report.skipped and not report.mlp
    assert [[n.rsplit(".", 1)[-1] for n in group] for group in report.qkv] == [["q_proj", "k_proj", "v_proj"]]
    assert sorted(n.rsplit(".", 1)[-1] for n in report.linear) == ["down_proj", "gate_proj", "o_proj", "up_proj"]
    assert "runs PEFT's forward" not in caplog.text  # every call took the fused path
    tol = _tol(compute)
    torch.testing.assert_close(got[0], want[0], rtol=tol["rtol"], atol=tol["atol"] * float(want[0]))
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=tol["rtol"], atol=tol["atol"] * float(w.abs().max()))


def test_patch_leaves_int8_and_mismatched_inputs_to_peft(caplog: pytest.LogCaptureFixture) -> None:
    """Linear8bitLt (int8: bitsandbytes quantizes the activations too) is left to PEFT at patch time;
    a 4-bit layer called on an input unlike its compute_dtype runs PEFT's forward, with a log line."""
    from peft import get_peft_model

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = bnb.nn.Linear4bit(IN, OUT, bias=False, compute_dtype=torch.bfloat16)
            self.fc = bnb.nn.Linear8bitLt(IN, OUT, bias=False, has_fp16_weights=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o_proj(x)

    model = get_peft_model(Net().to("cpu"), LoraConfig(r=RANK, target_modules=["o_proj", "fc"])).train()
    x = testing.random_tensor((3, IN), torch.float32, "cpu", seed=5)
    want = model(x)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        report = fk.lora.patch(model)
        try:
            got = model(x)
        finally:
            fk.lora.unpatch(model)
    (reason,) = report.skipped.values()
    assert "Linear8bitLt quantizes the activations" in reason
    assert "differs from the 4-bit base's compute_dtype" in caplog.text
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.0)
