from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from fk.core.ops import define_autograd_op, define_op, fake_from, op_namespace


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, x * factor, mask=mask)


def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    calls.append("launcher")
    x = x.contiguous()
    y = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 128),)](x, y, x.numel(), factor, BLOCK=128)
    return y


def _scale_fake(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


calls: list[str] = []


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.factor = inputs[1]


def _backward(run_backward: Any, ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    return run_backward(dy, ctx.factor), None


scale_op = define_op(__name__, "scale", _scale, fake=_scale_fake)
scale = define_autograd_op(
    __name__, "scale", forward=_scale, forward_fake=_scale_fake, backward_launcher=_scale,
    backward_fake=_scale_fake, setup_context=_setup, backward=_backward,
)  # fmt: skip


def test_namespace_comes_from_the_module_name() -> None:
    assert op_namespace("fk.norms.rms_norm") == "fk_norms_rms_norm"
    assert op_namespace("trainer._vendor.fk.norms.rms_norm") == "trainer__vendor_fk_norms_rms_norm"
    namespace = getattr(torch.ops, op_namespace(__name__))
    assert hasattr(namespace, "scale") and hasattr(namespace, "scale_fwd") and hasattr(namespace, "scale_bwd")


def test_define_op_runs_eager(device: str) -> None:
    x = torch.randn(300, device=device)
    torch.testing.assert_close(scale_op(x, 3.0), x * 3.0)


def test_autograd_op_eager_path_calls_the_launchers(device: str) -> None:
    x = torch.randn(300, device=device, requires_grad=True)
    calls.clear()
    y = scale(x, 3.0)
    torch.testing.assert_close(y, x.detach() * 3.0)
    y.backward(torch.ones_like(y))
    assert calls == ["launcher", "launcher"]  # forward and backward, no custom-op dispatch
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_autograd_op_under_compile_fullgraph(device: str) -> None:
    x = torch.randn(300, device=device, requires_grad=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return scale(x * 2.0, 0.5).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    graphs: list[str] = []
    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(x)
    graphs.append(str(explained.graphs[0].code))
    assert explained.graph_break_count == 0
    assert "scale_fwd" in graphs[0]  # the custom op, not the eager autograd.Function
    compiled(x).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_fake_from_passes_the_arguments_it_names() -> None:
    def launcher(x: torch.Tensor, factor: float, rows: int, flag: bool) -> torch.Tensor:
        raise AssertionError("the fake never runs the launcher")

    def outputs(rows: int, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(rows)

    fake = fake_from(launcher, outputs)
    x = torch.empty(3)
    assert fake(x, 2.0, 5, True).shape == (5,)
    assert fake(x, 2.0, rows=4, flag=False).shape == (4,)

    def stray(x: torch.Tensor, other: int) -> torch.Tensor:
        return x

    with pytest.raises(TypeError, match="other"):
        fake_from(launcher, stray)
