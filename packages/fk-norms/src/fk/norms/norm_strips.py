"""The backward with a weight gradient for wide rows of RMSNorm (and FusedAddRMSNorm) and of LayerNorm,
in two passes over the rows: one that sums each row's ``c`` (and, for LayerNorm, ``a``), and one
whose programs own column strips, write ``dx`` and keep their strip of the weight gradient (and of
LayerNorm's bias gradient) in registers.

The one-kernel backwards of :mod:`fk.norms.rms_norm` and :mod:`fk.norms.layer_norm` read a wide row
twice, the second time hoping to find it in L2, and their programs add into fp32 partial rows as
wide as the weight, read and written again for every row tile. Here ``x`` and ``dy`` are read twice
from memory by design, and nothing row-wide is kept per program. Which of the two wins at which
width is ``BACKWARD.strips_min_cols`` (and RMSNorm's ``strips_min_cols_residual``) in each norm's
module, whose ``STRIPS`` (and, for FusedAddRMSNorm, ``STRIPS_RESIDUAL``) table holds this
launcher's parameters.

The references are :func:`fk.norms.rms_norm.rms_norm_ref` and :func:`fk.norms.layer_norm.layer_norm_ref`;
the tests compare both backwards of each norm with them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.launch import cdiv, column_strip_grid
from fk.core.reduce import sum_weight_and_bias_rows
from fk.core.tiles import round_to

# --- Kernels --------------------------------------------------------------------------------------
#
# Per row of H elements, with r = rstd (from the forward) and g_j = dy_j s_j:
#   RMSNorm:    s_j = w_j + offset, xhat_j = x_j r,         y_j = xhat_j s_j
#   LayerNorm:  s_j = w_j,          xhat_j = (x_j - mu) r,  y_j = xhat_j s_j + b_j   (mu = mean, CENTERED)
# LayerNorm's dxhat_j/dx_i = r (delta_ij - 1/H - xhat_i xhat_j / H); RMSNorm's lacks the -1/H (no mean).
# So, summed over j:
#   dx_i = r (g_i - a - xhat_i c),  c = (1/H) sum_k g_k xhat_k,  a = (1/H) sum_k g_k (LayerNorm; 0 for RMSNorm)
#   dw_j = sum over rows of dy_j xhat_j
#   db_j = sum over rows of dy_j   (LayerNorm with a bias gradient: COMPUTE_DB)
# FusedAddRMSNorm adds the gradient of its residual output to dx (HAS_DRES).
# For RMSNorm c = (r/H) sum_k dy_k s_k x_k (r applied once per row); LayerNorm's xhat is formed from
# x - mu element by element, not as r (sum g x - mu sum g), which would cancel when |mu| >> std.
# Pass 1 (_row_dot_kernel) writes c (and a) for every row; pass 2 (_strips_kernel) needs only the
# row's own r, mu, c and a next to each element, so its programs can own column strips. Without dx
# (COMPUTE_DX False: LayerNorm's x frozen) pass 1 is not run.


@triton.jit
def _row_dot_kernel(
    dy_ptr,  # [M, H], row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H], row stride x_row_stride, unit column stride
    w_ptr,  # [H] weight
    mean_ptr,  # [M] fp32 (unused unless CENTERED)
    rstd_ptr,  # [M] fp32
    c_ptr,  # [M] fp32 output: (1/H) sum_k g_k xhat_k
    a_ptr,  # [M] fp32 output: (1/H) sum_k g_k (unused unless CENTERED)
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    offset,
    CENTERED: tl.constexpr,  # LayerNorm: xhat = (x - mu) r, and a is summed
    ROWS: tl.constexpr,  # rows per program
    BLOCK_COLS: tl.constexpr,  # column tile of the loop over the row
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_COLS)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    if CENTERED:
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
        g_acc = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
    gx_acc = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        c_idx = start + cols
        col_mask = c_idx < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows64 * x_row_stride + c_idx[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + c_idx[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(w_ptr + c_idx, mask=col_mask, other=0.0).to(tl.float32) + offset
        g = dy * s[None, :]  # 0 outside the row: dy is
        if CENTERED:
            gx_acc += g * ((x - mean) * rstd[:, None])
            g_acc += g
        else:
            gx_acc += g * x
    c = tl.sum(gx_acc, axis=1) / n_cols
    if not CENTERED:
        c = c * rstd
    tl.store(c_ptr + rows, c, mask=row_mask)
    if CENTERED:
        tl.store(a_ptr + rows, tl.sum(g_acc, axis=1) / n_cols, mask=row_mask)


@triton.jit
def _strips_kernel(
    dy_ptr,  # [M, H], row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H], row stride x_row_stride, unit column stride
    dres_ptr,  # [M, H] added to dx, row stride dres_row_stride (unused unless HAS_DRES)
    w_ptr,  # [H] weight
    mean_ptr,  # [M] fp32 (unused unless CENTERED)
    rstd_ptr,  # [M] fp32
    c_ptr,  # [M] fp32, from _row_dot_kernel (unused unless COMPUTE_DX)
    a_ptr,  # [M] fp32, from _row_dot_kernel (unused unless CENTERED and COMPUTE_DX)
    dx_ptr,  # [M, H] output, row stride dx_row_stride; may be dy_ptr (each element read before written)
    dw_partial_ptr,  # [G, H] fp32 output: row g holds the sums of row group g
    db_partial_ptr,  # [G, H] fp32 output, as dw's (unused unless COMPUTE_DB)
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    dres_row_stride,
    dx_row_stride,
    offset,
    CENTERED: tl.constexpr,  # LayerNorm: xhat = (x - mu) r, and dx subtracts a
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DB: tl.constexpr,  # LayerNorm's bias gradient
    HAS_DRES: tl.constexpr,  # FusedAddRMSNorm: dx += the residual's gradient
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    s = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    # Summed over their rows once, at the end.
    dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    if COMPUTE_DB:
        db_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if CENTERED:
            x -= tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
        xhat = x * rstd
        if COMPUTE_DX:
            c = tl.load(c_ptr + rows, mask=row_mask, other=0.0)[:, None]
            dxhat = dy * s[None, :] - xhat * c
            if CENTERED:
                dxhat -= tl.load(a_ptr + rows, mask=row_mask, other=0.0)[:, None]
            dx = dxhat * rstd
            if HAS_DRES:
                dres = tl.load(dres_ptr + rows64 * dres_row_stride + cols[None, :], mask=mask, other=0.0)
                dx += dres.to(tl.float32)
            tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat  # 0 outside the rows and strip: dy is
        if COMPUTE_DB:
            db_acc += dy
    partial_row = group.to(tl.int64) * n_cols + cols
    tl.store(dw_partial_ptr + partial_row, tl.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(db_partial_ptr + partial_row, tl.sum(db_acc, axis=0), mask=col_mask)


# --- Launcher -------------------------------------------------------------------------------------


class StripParams(NamedTuple):
    dot_rows: int  # rows a program of pass 1 sums
    dot_block_cols: int  # its column tile
    dot_num_warps: int
    block_rows: int  # pass 2's row tile
    block_cols: int  # pass 2's column strip: dw_acc (and db_acc) is [block_rows, block_cols] fp32 in registers
    num_warps: int
    programs_per_sm: int  # pass 2: row groups x strips, about this many per multiprocessor


def strip_grid(n_rows: int, n_cols: int, device: torch.device, params: StripParams) -> tuple[int, int]:
    """(row groups, column strips) of pass 2's grid. Each fp32 partial buffer (dw's, db's) has one
    row per row group."""
    return column_strip_grid(n_rows, n_cols, params.block_rows, params.block_cols, device, params.programs_per_sm)


def launch_strips_backward(
    dy_rows: torch.Tensor,
    x_rows: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    dx_rows: torch.Tensor | None,
    dres_rows: torch.Tensor | None,
    params: StripParams,
    *,
    mean: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write ``dx`` (plus ``dres_rows`` when given) into ``dx_rows`` and return the weight gradient
    and the bias gradient (None without ``bias``) in their parameters' dtypes.

    RMSNorm's backward without ``mean``; LayerNorm's with it (``offset`` 0). ``dx_rows`` None: no
    dx, and no pass 1. ``bias`` is not read: it gives db its dtype (and says whether to compute it).
    All row tensors ``[M, H]`` with unit column stride and ``M > 0``; ``rstd`` (and ``mean``) fp32
    with ``M`` contiguous elements; ``dx_rows`` may be ``dy_rows``' memory."""
    n_rows, n_cols = x_rows.shape
    centered = mean is not None
    mean_or_rstd = mean if mean is not None else rstd  # (not read unless CENTERED)
    c = a = rstd  # not read without dx
    if dx_rows is not None:
        row_sums = torch.empty((2 if centered else 1, n_rows), dtype=torch.float32, device=x_rows.device)
        c, a = row_sums[0], row_sums[-1]
        _row_dot_kernel[(cdiv(n_rows, params.dot_rows),)](
            dy_rows, x_rows, weight, mean_or_rstd, rstd, c, a,
            n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0), offset,
            CENTERED=centered, ROWS=params.dot_rows, BLOCK_COLS=params.dot_block_cols, num_warps=params.dot_num_warps,
        )  # fmt: skip
    groups, strips = strip_grid(n_rows, n_cols, x_rows.device, params)
    partials = torch.empty((1 + (bias is not None), groups, n_cols), dtype=torch.float32, device=x_rows.device)
    dres = dres_rows if dres_rows is not None else x_rows
    dx = dx_rows if dx_rows is not None else x_rows
    _strips_kernel[(groups, strips)](
        dy_rows, x_rows, dres, weight, mean_or_rstd, rstd, c, a, dx, partials[0], partials[-1],
        n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0), dres.stride(0), dx.stride(0), offset,
        CENTERED=centered, COMPUTE_DX=dx_rows is not None, COMPUTE_DB=bias is not None,
        HAS_DRES=dres_rows is not None, BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols,
        num_warps=params.num_warps,
    )  # fmt: skip
    dw, db = sum_weight_and_bias_rows(partials, weight, bias)
    assert dw is not None
    return dw, db
