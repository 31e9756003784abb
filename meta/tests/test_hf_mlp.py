"""The patched gated MLP runs fk.glu.gated_mlp where it can (nothing of size [tokens, intermediate]
kept but gate and up) and the projections as modules where it cannot."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fk.hf

transformers = pytest.importorskip("transformers")

INTER = 96


def _mlp(device: str, act: str = "silu") -> Any:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=INTER, hidden_act=act)
    torch.manual_seed(0)
    return transformers.models.llama.modeling_llama.LlamaMLP(config).to(device)


def _run(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Output, gradients (x's, then the weights') and how many [.., INTER] tensors were saved."""
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    x = x.detach().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mlp(x)
    y.backward(torch.ones_like(y))
    grads = [x.grad, *(p.grad for p in mlp.parameters())]
    return y, grads, sum(s[-1] == INTER and s != (32, INTER) for s in saved)  # not down_proj.weight


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_patched_mlp_keeps_gate_and_up_only(device: str, act: str) -> None:
    stock = _mlp(device, act)
    model = torch.nn.Sequential(copy.deepcopy(stock))
    patched = model[0]
    counts = fk.hf.apply(model)  # any module: the MLP is recognized by structure, checked on the probe
    assert counts["swiglu" if act == "silu" else "geglu"] == 1
    x = torch.randn(2, 5, 32, device=device)
    want, want_grads, stock_saved = _run(stock, x)
    got, got_grads, patched_saved = _run(patched, x)
    assert patched_saved == 2 < stock_saved  # gate and up; stock keeps act(gate) * up too
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # A hook on a projection: it runs, through the projections as modules.
    calls: list[int] = []
    patched.down_proj.register_forward_pre_hook(lambda m, i: calls.append(1))
    got, _, saved = _run(patched, x)
    assert calls == [1] and saved > 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
