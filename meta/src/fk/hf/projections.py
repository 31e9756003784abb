"""Several linear projections of one input as one autograd function (the ``qkv`` switch).

An attention block computes ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` from one ``x``. Stock
autograd forms the gradient of ``x`` as three matmuls whose results are summed by two add kernels
(each reads two ``[tokens, hidden]`` tensors and writes a third). Here the three are one function:

Forward, for each projection i (as ``F.linear``):
    y_i = x W_i^T (+ b_i)
Backward, with ``dy_i`` the gradient of ``y_i`` (a projection whose output got no gradient is skipped):
    dx   = sum_i dy_i W_i      the first matmul writes dx, the others accumulate into it through
                               ``addmm_`` (the add happens in the matmul's epilogue: no add kernel,
                               no temporary; each step rounds once to x's dtype, as stock's adds do)
    dW_i = dy_i^T x            only where W_i requires grad
    db_i = sum_rows dy_i       only where b_i exists and requires grad
Only ``x`` is saved (and the parameters, which cost nothing).

fk.hf's ``qkv`` switch gives the three modules forwards that call this once (see
:func:`fk.hf.blocks.projections_forward`).
"""

from __future__ import annotations

from typing import Any

import torch


class _LinearProjections(torch.autograd.Function):
    """``(x W_0^T + b_0, x W_1^T + b_1, ...)``; the arguments after ``x`` are ``W_0, b_0, W_1, b_1, ...``
    (a bias may be None)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        rows = x.reshape(-1, x.shape[-1])
        outs = []
        for w, b in zip(params[0::2], params[1::2], strict=True):
            assert w is not None
            y = torch.mm(rows, w.t()) if b is None else torch.addmm(b, rows, w.t())
            outs.append(y.view(*x.shape[:-1], w.shape[0]))
        ctx.save_for_backward(x, *params)
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *douts: torch.Tensor | None) -> Any:
        x, *params = ctx.saved_tensors
        need_dx, *need_params = ctx.needs_input_grad
        rows = x.reshape(-1, x.shape[-1])
        dx: torch.Tensor | None = None
        grads: list[torch.Tensor | None] = [None] * len(params)
        # Last projection first: stock autograd runs the last-created linear's backward first and
        # sums in that order, so the rounding steps of dx come in the same order as stock's.
        for i in reversed(range(len(douts))):
            dy, w, b = douts[i], params[2 * i], params[2 * i + 1]
            if dy is None:
                continue
            dy_rows = dy.reshape(-1, dy.shape[-1])
            if need_dx:
                dx = torch.mm(dy_rows, w) if dx is None else dx.addmm_(dy_rows, w)
            if need_params[2 * i]:
                grads[2 * i] = torch.mm(dy_rows.t(), rows)
            if b is not None and need_params[2 * i + 1]:
                grads[2 * i + 1] = dy_rows.sum(0)
        return (dx.view(x.shape) if dx is not None else None, *grads)


def linear_projections(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))`` with one accumulation of the
    gradient of ``x`` in the backward (see the module docstring). ``x``, the weights and the biases
    share one dtype and device; each weight is ``(out_i, x.shape[-1])``."""
    if not weights or len(weights) != len(biases):
        raise ValueError(
            f"linear_projections needs one bias (or None) per weight, got {len(weights)} and {len(biases)}"
        )
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        if w.ndim != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(
                f"weights[{i}] must be (out, {x.shape[-1]}) of x's dtype {x.dtype} on {x.device}, "
                f"got {tuple(w.shape)} {w.dtype} on {w.device}"
            )
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device):
            raise ValueError(
                f"biases[{i}] must be ({w.shape[0]},) of x's dtype {x.dtype}, got {tuple(b.shape)} {b.dtype}"
            )
    params = [p for w, b in zip(weights, biases, strict=True) for p in (w, b)]
    outs: tuple[torch.Tensor, ...] = _LinearProjections.apply(x, *params)
    return outs
