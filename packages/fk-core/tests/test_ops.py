from __future__ import annotations

import torch
import triton
import triton.language as tl

from fk.core.ops import define_op, op_namespace


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, x * factor, mask=mask)


def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 128),)](x, y, x.numel(), factor, BLOCK=128)
    return y


def _scale_fake(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


scale = define_op(__name__, "scale", _scale, fake=_scale_fake)
scale.register_autograd(
    lambda ctx, dy: (scale(dy, ctx.factor), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "factor", inputs[1]),
)


def test_namespace_comes_from_the_module_name() -> None:
    assert op_namespace("fk.norms.rms_norm") == "fk_norms_rms_norm"
    assert op_namespace("trainer._vendor.fk.norms.rms_norm") == "trainer__vendor_fk_norms_rms_norm"
    assert hasattr(getattr(torch.ops, op_namespace(__name__)), "scale")


def test_op_runs_eager_and_under_compile_fullgraph() -> None:
    x = torch.randn(300, requires_grad=True)
    torch.testing.assert_close(scale(x, 3.0), x * 3.0)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return scale(x * 2.0, 0.5).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled(x).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.ones_like(x))
