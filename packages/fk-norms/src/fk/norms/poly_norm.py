"""PolyNorm (the PolyCom activation): ``y = w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b``.

``norm(u) = u / sqrt(mean(u^2) + eps)`` over the last dimension: an RMS normalization without its
own weight. ``weight`` has shape ``(3,)`` (initialized to 1/3 each in the PolyCom paper) and
``bias`` shape ``(1,)`` (initialized to 1); a 0-dimensional bias is accepted too. The kernels
compute in fp32 and round once to the dtype of ``x``; the parameter gradients have the
parameters' dtypes.

This file holds, in order: the reference, the Triton kernels, the launchers registered as custom
ops, the functional API :func:`poly_norm` and the module :class:`PolyNorm`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import RowTiling, as_rows, cdiv, row_reduction_grid, row_tiling
from fk.core.ops import define_autograd_op
from fk.norms.launch_params import ForwardParams, NarrowBackwardParams, forward_tiling, narrow_backward

# --- 1. Reference ---------------------------------------------------------------------------------


def poly_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain PyTorch PolyNorm over the last dimension (computes in fp32, or fp64 for fp64 input).

    This is the definition the kernels are tested against.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    w = weight.to(compute)

    def norm(u: torch.Tensor) -> torch.Tensor:
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    y = w[0] * norm(xf.pow(3)) + w[1] * norm(xf.pow(2)) + w[2] * norm(xf) + bias.to(compute).reshape(())
    return y.to(x.dtype)


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Notation, per row of H elements, for p = 1, 2, 3: r_p = 1 / sqrt(mean(x^(2p)) + eps) (saved by the
# forward, fp32, as an [M, 3] array), n_p = x^p r_p, and the weight of n_p is a_p: a_3 = w0,
# a_2 = w1, a_1 = w2. y = sum_p a_p n_p + b.
#
# Backward. As in RMSNorm, d n_p / d u (u = x^p) maps a gradient g to r_p (g - n_p mean(g n_p)); with
# g = a_p dy and du/dx = p x^(p-1):
#   c_p  = mean(dy * n_p)                                   (one fp32 number per row and p)
#   dx   = sum_p a_p p x^(p-1) r_p (dy - n_p c_p)
#   d a_p = sum over rows of sum_j dy_j n_pj = sum over rows of H c_p
#   db   = sum over all elements of dy
# The c_p are needed for dx anyway, so the weight gradient costs three scalar accumulators per
# program; the bias gradient one more row sum. Each program of the persistent grid writes one row
# of a [P, 4] fp32 partial buffer (d w0, d w1, d w2, db), summed at the end; a frozen weight or bias
# leaves its columns alone (COMPUTE_DW / COMPUTE_DB are constexpr), and when both are frozen the
# buffer is not allocated.
#
# Both kernels hold a row (or several narrow rows) in one tile when it fits (LOOPED False): x and dy
# are read from memory once. Wider rows are walked in column tiles twice (sums, then outputs), the
# second pass reading mostly from L2.


@triton.jit
def _poly_norm_fwd_kernel(
    x_ptr,  # [M, H] input, row stride x_row_stride, unit column stride
    w_ptr,  # [3] weight
    b_ptr,  # [1] bias
    y_ptr,  # [M, H] output, contiguous
    rstd_ptr,  # [M, 3] fp32 output: r_1, r_2, r_3 (see above), saved for the backward
    n_rows,
    n_cols,
    x_row_stride,
    eps,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program (1 when LOOPED)
    LOOPED: tl.constexpr,  # the row is wider than BLOCK_COLS: two passes over column tiles
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * n_cols
    cols = tl.arange(0, BLOCK_COLS)
    if not LOOPED:
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = x * x
        s2 = tl.sum(x2, axis=1)
        s4 = tl.sum(x2 * x2, axis=1)
        s6 = tl.sum(x2 * x2 * x2, axis=1)
    else:
        acc2 = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
        acc4 = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
        acc6 = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_COLS):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            xt = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            xt2 = xt * xt
            acc2 += xt2
            acc4 += xt2 * xt2
            acc6 += xt2 * xt2 * xt2
        s2 = tl.sum(acc2, axis=1)
        s4 = tl.sum(acc4, axis=1)
        s6 = tl.sum(acc6, axis=1)
    r1 = tl.rsqrt(s2 / n_cols + eps)
    r2 = tl.rsqrt(s4 / n_cols + eps)
    r3 = tl.rsqrt(s6 / n_cols + eps)
    tl.store(rstd_ptr + rows * 3, r1, mask=row_mask)
    tl.store(rstd_ptr + rows * 3 + 1, r2, mask=row_mask)
    tl.store(rstd_ptr + rows * 3 + 2, r3, mask=row_mask)
    # Coefficients of x, x^2 and x^3 per row.
    k1 = (tl.load(w_ptr + 2).to(tl.float32) * r1)[:, None]
    k2 = (tl.load(w_ptr + 1).to(tl.float32) * r2)[:, None]
    k3 = (tl.load(w_ptr).to(tl.float32) * r3)[:, None]
    b = tl.load(b_ptr).to(tl.float32)
    if not LOOPED:
        y = ((k3 * x + k2) * x + k1) * x + b
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        for start in range(0, n_cols, BLOCK_COLS):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            xt = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            y = ((k3 * xt + k2) * xt + k1) * xt + b
            tl.store(y_rows + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _poly_norm_dx(x, dy, k1, k2, k3, m1, m2, m3):
    """dx = sum_p a_p p x^(p-1) r_p (dy - x^p r_p c_p), with k_p = p a_p r_p and m_p = r_p c_p."""
    x2 = x * x
    return k1 * (dy - x * m1) + k2 * x * (dy - x2 * m2) + k3 * x2 * (dy - x2 * x * m3)


@triton.jit
def _poly_norm_bwd_kernel(
    dy_ptr,  # [M, H] upstream gradient, row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H] forward input, row stride x_row_stride, unit column stride
    w_ptr,  # [3] weight
    rstd_ptr,  # [M, 3] fp32, from the forward
    dx_ptr,  # [M, H] output, contiguous (unused when COMPUTE_DX is False)
    partial_ptr,  # [P, 4] fp32 output: d w0, d w1, d w2, db per program (unused unless COMPUTE_DW/DB)
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per tile (1 when LOOPED)
    LOOPED: tl.constexpr,  # the row is wider than BLOCK_COLS: two passes over column tiles
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    a1 = tl.load(w_ptr + 2).to(tl.float32)
    a2 = tl.load(w_ptr + 1).to(tl.float32)
    a3 = tl.load(w_ptr).to(tl.float32)
    acc1 = tl.zeros([ROWS], dtype=tl.float32)
    acc2 = tl.zeros([ROWS], dtype=tl.float32)
    acc3 = tl.zeros([ROWS], dtype=tl.float32)
    acc_b = tl.zeros([ROWS], dtype=tl.float32)
    for tile in range(pid, n_tiles, n_programs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
        dy_rows = dy_ptr + rows.to(tl.int64)[:, None] * dy_row_stride
        dx_rows = dx_ptr + rows.to(tl.int64)[:, None] * n_cols
        r1 = tl.load(rstd_ptr + rows * 3, mask=row_mask, other=0.0)
        r2 = tl.load(rstd_ptr + rows * 3 + 1, mask=row_mask, other=0.0)
        r3 = tl.load(rstd_ptr + rows * 3 + 2, mask=row_mask, other=0.0)
        # Pass 1: the sums of dy x^p (c_p = r_p * that / H) and of dy.
        if not LOOPED:
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dyx = dy * x
            sum1 = tl.sum(dyx, axis=1)
            sum2 = tl.sum(dyx * x, axis=1)
            sum3 = tl.sum(dyx * x * x, axis=1)
            if COMPUTE_DB:
                acc_b += tl.sum(dy, axis=1)
        else:
            t1 = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
            t2 = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
            t3 = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
            tb = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                # evict_last: keep the row in L2 for pass 2.
                xt = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                dyt = tl.load(dy_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
                dyt = dyt.to(tl.float32)
                dyx = dyt * xt
                t1 += dyx
                t2 += dyx * xt
                t3 += dyx * xt * xt
                if COMPUTE_DB:
                    tb += dyt
            sum1 = tl.sum(t1, axis=1)
            sum2 = tl.sum(t2, axis=1)
            sum3 = tl.sum(t3, axis=1)
            if COMPUTE_DB:
                acc_b += tl.sum(tb, axis=1)
        c1 = sum1 * r1 / n_cols
        c2 = sum2 * r2 / n_cols
        c3 = sum3 * r3 / n_cols
        if COMPUTE_DW:
            acc1 += sum1 * r1
            acc2 += sum2 * r2
            acc3 += sum3 * r3
        if COMPUTE_DX:
            # Pass 2: dx (see _poly_norm_dx).
            k1 = (a1 * r1)[:, None]
            k2 = (2.0 * a2 * r2)[:, None]
            k3 = (3.0 * a3 * r3)[:, None]
            m1 = (r1 * c1)[:, None]
            m2 = (r2 * c2)[:, None]
            m3 = (r3 * c3)[:, None]
            if not LOOPED:
                dx = _poly_norm_dx(x, dy, k1, k2, k3, m1, m2, m3)
                tl.store(dx_rows + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            else:
                for start in range(0, n_cols, BLOCK_COLS):
                    c = start + cols
                    mask = row_mask[:, None] & (c < n_cols)[None, :]
                    xt = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
                    dyt = tl.load(dy_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
                    dx = _poly_norm_dx(xt.to(tl.float32), dyt.to(tl.float32), k1, k2, k3, m1, m2, m3)
                    tl.store(dx_rows + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if COMPUTE_DW:
        tl.store(partial_ptr + pid * 4, tl.sum(acc3, axis=0))
        tl.store(partial_ptr + pid * 4 + 1, tl.sum(acc2, axis=0))
        tl.store(partial_ptr + pid * 4 + 2, tl.sum(acc1, axis=0))
    if COMPUTE_DB:
        tl.store(partial_ptr + pid * 4 + 3, tl.sum(acc_b, axis=0))


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

# Launch parameters: one table per direction, each field with the reason for its value. The timings
# behind them are in the rows of benchmarks/experiments/INDEX.md named here and in docs/benchmarks.md
# (the norms section); benchmarks/tune_norms.py and tune_norm_backward.py sweep them on a GPU.

# The forward's values and the trainable backward's tiles are tune_norms.py --op poly_norm's best,
# against PolyNorm's first settings (RMSNorm's then; docs/benchmarks.md).
FORWARD = ForwardParams(
    max_block_cols=32768,  # x is read from memory once, up to 32768 columns
    min_tile=2048,
    elements_per_warp=1024,
    max_warps=16,  # at every width
    few_warps_max_cols=32768,
)


class BackwardParams(NamedTuple):
    """The backward that sums dw or db: a persistent grid whose programs each keep a 16-byte row of
    partial sums (dw's three and db)."""

    programs_per_sm: int  # for one-tile rows
    looped_programs_per_sm: int  # for wider rows
    max_block_cols: int  # the widest row held in one tile (x and dy: two fp32 tiles); wider rows loop,
    looped_block_cols: int  # over column tiles this wide
    min_tile: int  # narrow rows are grouped into tiles of at least this many elements
    elements_per_warp: int  # one warp per this many elements of a tile


BACKWARD = BackwardParams(
    programs_per_sm=8,  # 2 per SM took 1.1-1.4x the time at H <= 4096 (INDEX.md#poly_norm_backward_tune)
    looped_programs_per_sm=4,  # poly_norm_backward_tune
    max_block_cols=16384,  # one tile stayed best at H=16384 (tune_norms.py, docs/benchmarks.md)
    looped_block_cols=4096,  # narrower tiles once a row no longer fits one (tune_norms.py, docs/benchmarks.md)
    min_tile=2048,
    elements_per_warp=512,
)

# Rows up to 8192 columns: one warp per 1024 elements, and fewer programs an SM as rows widen;
# 0.85-0.99x the time of BACKWARD's own fields at 1024-8192 columns (INDEX.md#norm_narrow_trainable).
BACKWARD_NARROW = (
    NarrowBackwardParams(max_cols=2048, programs_per_sm=8, min_tile=2048, elements_per_warp=1024),
    NarrowBackwardParams(max_cols=4096, programs_per_sm=4, min_tile=2048, elements_per_warp=1024),
    NarrowBackwardParams(max_cols=8192, programs_per_sm=2, min_tile=4096, elements_per_warp=1024),
)


class FrozenBackwardParams(NamedTuple):
    """The backward without dw and db: no partial sums, one program per row tile."""

    max_block_cols: int  # the widest row held in one tile; wider rows loop,
    looped_block_cols: int  # over column tiles this wide,
    looped_cols_per_warp: int  # with one warp per this many columns of the row (at most 16)
    min_tile: int  # narrow rows are grouped into tiles of at least this many elements
    elements_per_warp: int  # one warp per this many elements of a one-tile row's tile,
    min_warps: int  # and at least this many


BACKWARD_FROZEN = FrozenBackwardParams(
    max_block_cols=8192,  # INDEX.md#poly_norm_frozen_tiles
    looped_block_cols=4096,  # poly_norm_frozen_tiles
    looped_cols_per_warp=4096,  # poly_norm_frozen_tiles
    min_tile=2048,  # as BACKWARD's
    elements_per_warp=1024,  # poly_norm_frozen_tiles
    min_warps=4,  # poly_norm_frozen_tiles
)


@functools.lru_cache(maxsize=256)
def _fwd_tiling(n_cols: int) -> RowTiling:
    return forward_tiling(n_cols, FORWARD)


@functools.lru_cache(maxsize=256)
def _bwd_tiling(n_cols: int, sums: bool = True) -> RowTiling:
    """The backward's tiling; ``sums``: it sums dw or db across rows (else frozen parameters)."""
    if not sums:
        frozen = BACKWARD_FROZEN
        if n_cols > frozen.max_block_cols:
            warps = min(16, max(1, n_cols // frozen.looped_cols_per_warp))
            return RowTiling(block_cols=frozen.looped_block_cols, looped=True, rows_per_tile=1, num_warps=warps)
        return row_tiling(n_cols, max_block_cols=frozen.max_block_cols, min_tile_elements=frozen.min_tile,
                          elements_per_warp=frozen.elements_per_warp, min_warps=frozen.min_warps,
                          name="x")  # fmt: skip
    params = BACKWARD
    narrow = narrow_backward(n_cols, BACKWARD_NARROW)
    if narrow is not None:
        return row_tiling(n_cols, max_block_cols=params.max_block_cols, min_tile_elements=narrow.min_tile,
                          elements_per_warp=narrow.elements_per_warp, name="x")  # fmt: skip
    max_block_cols = params.max_block_cols if n_cols <= params.max_block_cols else params.looped_block_cols
    return row_tiling(n_cols, max_block_cols=max_block_cols, min_tile_elements=params.min_tile,
                      elements_per_warp=params.elements_per_warp, name="x")  # fmt: skip


def partial_rows(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Programs of the backward, and rows of its [P, 4] fp32 partial buffer when it allocates one."""
    narrow = narrow_backward(n_cols, BACKWARD_NARROW)
    per_sm = narrow.programs_per_sm if narrow is not None else BACKWARD.programs_per_sm
    return row_reduction_grid(n_rows, _bwd_tiling(n_cols), device, per_sm, BACKWARD.looped_programs_per_sm)


def _poly_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher: returns (y with x's shape and dtype, rstd fp32 of shape x.shape[:-1] + (3,))."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty((*x.shape[:-1], 3), dtype=torch.float32, device=x.device)
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    if n_rows == 0:
        return y, rstd
    tiling = _fwd_tiling(n_cols)
    _poly_norm_fwd_kernel[(cdiv(n_rows, tiling.rows_per_tile),)](
        x_rows, weight, bias, y, rstd, n_rows, n_cols, x_rows.stride(0), eps,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped, num_warps=tiling.num_warps,
    )  # fmt: skip
    return y, rstd


def _poly_norm_fwd_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, torch.empty((*x.shape[:-1], 3), dtype=torch.float32, device=x.device)


def _poly_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    rstd: torch.Tensor,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: returns (dx, dw, db); each one not computed is an empty tensor.

    ``bias`` is not read: it gives db its dtype and shape.
    """
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if compute_dx else x.new_empty(0)
    x_rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows, n_cols = x_rows.shape
    if n_rows == 0 or not (compute_dx or compute_dw or compute_db):
        dw = torch.zeros_like(weight) if compute_dw else x.new_empty(0)
        db = torch.zeros_like(bias) if compute_db else x.new_empty(0)
        return dx, dw, db
    tiling = _bwd_tiling(n_cols, compute_dw or compute_db)
    if compute_dw or compute_db:
        n_programs = partial_rows(n_rows, n_cols, x.device)
        partial = torch.empty((n_programs, 4), dtype=torch.float32, device=x.device)
    else:  # nothing to sum across rows: one program per row tile
        n_programs, partial = cdiv(n_rows, tiling.rows_per_tile), rstd
    _poly_norm_bwd_kernel[(n_programs,)](
        dy_rows, x_rows, weight, rstd, dx if compute_dx else x_rows, partial,
        n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0),
        COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped, num_warps=tiling.num_warps,
    )  # fmt: skip
    dw = partial[:, :3].sum(0).to(weight.dtype) if compute_dw else x.new_empty(0)
    db = partial[:, 3].sum().reshape(bias.shape).to(bias.dtype) if compute_db else x.new_empty(0)
    return dx, dw, db


def _poly_norm_bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    rstd: torch.Tensor,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if compute_dx else x.new_empty(0)
    dw = torch.empty_like(weight) if compute_dw else x.new_empty(0)
    db = torch.empty_like(bias) if compute_db else x.new_empty(0)
    return dx, dw, db


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, bias, _eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None, _drstd: Any) -> tuple[Any, ...]:
    x, weight, bias, rstd = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if dy is None or not (need_dx or need_dw or need_db):
        return None, None, None, None
    dx, dw, db = run_backward(dy, x, weight, bias, rstd, need_dx, need_dw, need_db)
    return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), None


_poly_norm = define_autograd_op(
    __name__, "poly_norm",
    forward=_poly_norm_fwd, forward_fake=_poly_norm_fwd_fake,
    backward_launcher=_poly_norm_bwd, backward_fake=_poly_norm_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def poly_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PolyNorm over the last dimension: ``w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b``.

    Args:
        x: input of shape ``(..., H)``, fp32/fp16/bf16, any strides.
        weight: ``(3,)``: the weights of norm(x^3), norm(x^2) and norm(x), in that order.
        bias: ``(1,)`` (or 0-dimensional) bias.
        eps: added to each mean square before the square root; > 0.

    Returns a tensor of x's shape and dtype. The weight and bias gradients are computed only when
    they require grad.
    """
    validate.check_tensor("x", x)
    validate.check_dtype("x", x)
    validate.check_min_ndim("x", x, 1)
    eps = validate.check_positive_float("eps", eps)
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    validate.check_tensor("weight", weight)
    validate.check_dtype("weight", weight)
    validate.check_shape("weight", weight, (3,))
    validate.check_same_device("weight", weight, "x", x)
    validate.check_tensor("bias", bias)
    validate.check_dtype("bias", bias)
    if tuple(bias.shape) not in ((1,), ()):
        raise ValueError(f"bias must have shape (1,) or (), got {tuple(bias.shape)}")
    validate.check_same_device("bias", bias, "x", x)
    if not uses_kernel(x):
        return poly_norm_ref(x, weight, bias, eps)
    y, _ = _poly_norm(x, weight, bias, eps)
    return y


# --- 5. Module ------------------------------------------------------------------------------------


class PolyNorm(torch.nn.Module):
    """PolyNorm with its parameters: ``weight`` ``(3,)`` initialized to 1/3 and ``bias`` ``(1,)``
    initialized to 1, as in the PolyCom paper. There is no ``torch.nn`` counterpart."""

    def __init__(self, eps: float = 1e-6, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.eps = validate.check_positive_float("eps", eps)
        self.weight = torch.nn.Parameter(torch.empty(3, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(1, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0 / 3.0)
            self.bias.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return poly_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
