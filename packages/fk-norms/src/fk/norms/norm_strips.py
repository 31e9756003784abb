"""RMSNorm's backward with a weight gradient for wide rows, in two passes over the rows: one that
sums each row's ``c``, and one whose programs own column strips, write ``dx`` and keep their strip
of the weight gradient in registers.

The one-kernel backward of :mod:`fk.norms.rms_norm` (``LOOPED``) reads a wide row twice, the
second time hoping to find it in L2, and its programs add into an fp32 partial row as wide as the
weight, read and written again for every row tile. Here ``x`` and ``dy`` are read twice from
memory by design, and nothing row-wide is kept per program. Which of the two wins at which width is
``BACKWARD.strips_min_cols`` (and ``strips_min_cols_residual``) in :mod:`fk.norms.rms_norm`, whose
``STRIPS`` (and, for FusedAddRMSNorm, ``STRIPS_RESIDUAL``) table holds this launcher's parameters.

The reference is :func:`fk.norms.rms_norm.rms_norm_ref`; the tests compare both backwards with it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.launch import cdiv, column_strip_grid
from fk.core.reduce import sum_rows
from fk.core.tiles import round_to

# --- Kernels --------------------------------------------------------------------------------------
#
# Per row, with r = rstd (from the forward), s_j = w_j + offset, xhat_j = x_j r, g_j = dy_j s_j:
#     y_j = xhat_j s_j
#     dx_j = r (g_j - xhat_j c),   c = (1/H) sum_k g_k xhat_k = (r/H) sum_k dy_k s_k x_k
#     dw_j = sum over rows of dy_j xhat_j
# Pass 1 (_row_dot_kernel) writes c for every row; pass 2 (_strips_kernel) needs only the row's own
# r and c next to each element, so its programs can own column strips.


@triton.jit
def _row_dot_kernel(
    dy_ptr,  # [M, H], row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H], row stride x_row_stride, unit column stride
    w_ptr,  # [H] weight
    rstd_ptr,  # [M] fp32
    c_ptr,  # [M] fp32 output: (r/H) sum_k dy_k s_k x_k
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    offset,
    ROWS: tl.constexpr,  # rows per program
    BLOCK_COLS: tl.constexpr,  # column tile of the loop over the row
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_COLS)
    acc = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        c_idx = start + cols
        col_mask = c_idx < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows64 * x_row_stride + c_idx[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + c_idx[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(w_ptr + c_idx, mask=col_mask, other=0.0).to(tl.float32) + offset
        acc += dy * s[None, :] * x
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    tl.store(c_ptr + rows, tl.sum(acc, axis=1) * rstd / n_cols, mask=row_mask)


@triton.jit
def _strips_kernel(
    dy_ptr,  # [M, H], row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H], row stride x_row_stride, unit column stride
    dres_ptr,  # [M, H] added to dx, row stride dres_row_stride (unused unless HAS_DRES)
    w_ptr,  # [H] weight
    rstd_ptr,  # [M] fp32
    c_ptr,  # [M] fp32, from _row_dot_kernel
    dx_ptr,  # [M, H] output, row stride dx_row_stride; may be dy_ptr (each element read before written)
    dw_partial_ptr,  # [G, H] fp32 output: row g holds the sums of row group g
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    dres_row_stride,
    dx_row_stride,
    offset,
    HAS_DRES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    s = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)  # summed over its rows once, at the end
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        c = tl.load(c_ptr + rows, mask=row_mask, other=0.0)[:, None]
        xhat = x * rstd
        dx = (dy * s[None, :] - xhat * c) * rstd
        if HAS_DRES:
            dx += tl.load(dres_ptr + rows64 * dres_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
    tl.store(dw_partial_ptr + group.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


# --- Launcher -------------------------------------------------------------------------------------


class StripParams(NamedTuple):
    dot_rows: int  # rows a program of pass 1 sums
    dot_block_cols: int  # its column tile
    dot_num_warps: int
    block_rows: int  # pass 2's row tile
    block_cols: int  # pass 2's column strip: dw_acc is [block_rows, block_cols] fp32 in registers
    num_warps: int
    programs_per_sm: int  # pass 2: row groups x strips, about this many per multiprocessor


def launch_strips_backward(
    dy_rows: torch.Tensor,
    x_rows: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    dx_rows: torch.Tensor,
    dres_rows: torch.Tensor | None,
    params: StripParams,
) -> torch.Tensor:
    """Write ``dx`` (plus ``dres_rows`` when given) into ``dx_rows`` and return the weight gradient
    in the weight's dtype. All row tensors ``[M, H]`` with unit column stride and ``M > 0``;
    ``rstd`` fp32 with ``M`` contiguous elements; ``dx_rows`` may be ``dy_rows``' memory."""
    n_rows, n_cols = x_rows.shape
    c = torch.empty(n_rows, dtype=torch.float32, device=x_rows.device)
    _row_dot_kernel[(cdiv(n_rows, params.dot_rows),)](
        dy_rows, x_rows, weight, rstd, c, n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0), offset,
        ROWS=params.dot_rows, BLOCK_COLS=params.dot_block_cols, num_warps=params.dot_num_warps,
    )  # fmt: skip
    groups, strips = column_strip_grid(
        n_rows, n_cols, params.block_rows, params.block_cols, x_rows.device, params.programs_per_sm
    )
    partial = torch.empty((groups, n_cols), dtype=torch.float32, device=x_rows.device)
    dres = dres_rows if dres_rows is not None else x_rows
    _strips_kernel[(groups, strips)](
        dy_rows, x_rows, dres, weight, rstd, c, dx_rows, partial,
        n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0), dres.stride(0), dx_rows.stride(0), offset,
        HAS_DRES=dres_rows is not None, BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols,
        num_warps=params.num_warps,
    )  # fmt: skip
    return sum_rows(partial, weight.dtype)
