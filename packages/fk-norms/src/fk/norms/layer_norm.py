"""LayerNorm: ``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last dimension.

As ``torch.nn.functional.layer_norm``: the mean and the (biased) variance are computed in fp32,
so is the affine transform, and the result is rounded once to the dtype of ``x``. ``weight`` and
``bias`` are each optional; their gradients have their own dtypes. The kernels accumulate in fp32.

This file holds, in order: the reference, the Triton kernels, the launchers registered as custom
ops, the functional API :func:`layer_norm` and the module :class:`LayerNorm`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import RowTiling, as_rows, cdiv, looped_rows_tiling, row_reduction_grid, row_tiling
from fk.core.matmul import column_sum
from fk.core.ops import define_autograd_op
from fk.core.reduce import sum_weight_and_bias_rows
from fk.core.tiles import load_row_tile
from fk.norms.launch_params import ForwardParams, NarrowBackwardParams, forward_tiling, narrow_backward
from fk.norms.norm_strips import StripParams, launch_strips_backward

# --- 1. Reference ---------------------------------------------------------------------------------


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Plain PyTorch LayerNorm over the last dimension (computes in fp32, or fp64 for fp64 input).

    This is the definition the kernels are tested against; it equals
    ``torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)``.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    y = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Notation, per row of H elements: mu = mean(x), r = 1 / sqrt(mean((x - mu)^2) + eps) (both saved
# by the forward, fp32), xhat = (x - mu) * r, y = xhat * w + b.
#
# Backward, with g = dy * w:
#   dxhat_j/dx_i = r (delta_ij - 1/H - xhat_i xhat_j / H)
#   dx_i         = sum_j g_j dxhat_j/dx_i = r * (g_i - mean(g) - xhat_i * mean(g * xhat))
#   dw_j         = sum over rows of dy_j * xhat_j
#   db_j         = sum over rows of dy_j
#
# The weight and bias gradients are column sums over all rows. The backward runs a persistent grid:
# program p strides over row tiles p, p+P, ... and keeps its share of dw and db in fp32 registers
# (or, for rows too wide for one tile, in its own row of the fp32 partial buffers), then writes one
# row of each [P, H] partial buffer that a final sum reduces. No atomics, a bounded number of
# partial rows, and no work or memory at all for a gradient that is not needed: COMPUTE_DX,
# COMPUTE_DW and COMPUTE_DB are constexpr, so Triton drops the dead code. Rows from
# BACKWARD.strips_min_cols on, with a weight gradient, take the two-pass backward of
# fk.norms.norm_strips instead (the same math, with a = mean(g) and c = mean(g * xhat) summed first).
#
# Rows too wide for one tile (WIDE_FORWARD says which) take _layer_norm_fwd_wide_kernel: three passes
# over column tiles, as torch.compile's generated code does: the mean, the variance about it, then y.
# The same two-pass statistics as the one-tile kernel's, so no E[x^2] - E[x]^2 cancellation when
# |mean| >> std. The first two passes ask L2 to keep the row (evict_last), so that only the first
# reads it from memory. The width is a compile-time constant there: its loops' trip counts and masks
# known, Triton unrolls them, and the passes ran 0.52 against 0.61 ms at 32768 columns with the width
# an argument (benchmarks/experiments/INDEX.md#layer_norm_forward_stats). One compilation per width.


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,  # [M, H] input, row stride x_row_stride, unit column stride
    w_ptr,  # [H] weight (unused when HAS_WEIGHT is False)
    b_ptr,  # [H] bias (unused when HAS_BIAS is False)
    y_ptr,  # [M, H] output, contiguous
    mean_ptr,  # [M] fp32 output: mean of the row, saved for the backward
    rstd_ptr,  # [M] fp32 output: 1 / sqrt(var + eps), saved for the backward
    n_rows,
    n_cols,
    x_row_stride,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,  # >= n_cols: the whole row in one tile
    ROWS: tl.constexpr,  # rows per program
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * n_cols
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_fwd_wide_kernel(
    x_ptr,  # [M, H] input, row stride x_row_stride, unit column stride
    w_ptr,  # [H] weight (unused when HAS_WEIGHT is False)
    b_ptr,  # [H] bias (unused when HAS_BIAS is False)
    y_ptr,  # [M, H] output, contiguous
    mean_ptr,  # [M] fp32 output
    rstd_ptr,  # [M] fp32 output
    x_row_stride,
    eps,
    N_COLS: tl.constexpr,  # H, a constant (see above)
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,  # the column tile each pass walks
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * N_COLS
    cols = tl.arange(0, BLOCK_COLS)
    total = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for start in range(0, N_COLS, BLOCK_COLS):
        c = start + cols
        total += tl.load(x_row + c, mask=c < N_COLS, other=0.0, eviction_policy="evict_last").to(tl.float32)
    mean = tl.sum(total, axis=0) / N_COLS
    squares = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for start in range(0, N_COLS, BLOCK_COLS):
        c = start + cols
        col_mask = c < N_COLS
        x = tl.load(x_row + c, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        centered = tl.where(col_mask, x - mean, 0.0)
        squares += centered * centered
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / N_COLS + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N_COLS, BLOCK_COLS):
        c = start + cols
        col_mask = c < N_COLS
        x = tl.load(x_row + c, mask=col_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        y = (x - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + c, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + c, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr,  # [M, H] upstream gradient, row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H] forward input, row stride x_row_stride, unit column stride
    w_ptr,  # [H] weight (unused when HAS_WEIGHT is False)
    mean_ptr,  # [M] fp32, from the forward
    rstd_ptr,  # [M] fp32, from the forward
    dx_ptr,  # [M, H] output, contiguous (unused when COMPUTE_DX is False)
    dw_partial_ptr,  # [P, H] fp32 output, one row per program (unused when COMPUTE_DW is False)
    db_partial_ptr,  # [P, H] fp32 output, one row per program (unused when COMPUTE_DB is False)
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per tile
    LOOPED: tl.constexpr,  # the row is wider than BLOCK_COLS: two passes over column tiles
    ACC_2D: tl.constexpr,  # accumulate dw and db in [ROWS, BLOCK_COLS] tiles (tiles of many short rows)
    PREFETCH: tl.constexpr,  # load the next tile's dy and x before computing this one's
    REVERSE_TILES: tl.constexpr,  # one-tile rows, last tile first (never with PREFETCH)
):
    tl.static_assert(not (PREFETCH and REVERSE_TILES), "the prefetch walks the tiles forwards")
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_COLS)
    dw_row = dw_partial_ptr + pid.to(tl.int64) * n_cols
    db_row = db_partial_ptr + pid.to(tl.int64) * n_cols
    if not LOOPED:
        n_tiles = tl.cdiv(n_rows, ROWS)
        col_mask = cols < n_cols
        w = tl.full([BLOCK_COLS], 1.0, tl.float32)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if ACC_2D:  # one sum over the tile's rows at the end, not a cross-warp sum at every tile
            dw_acc_2d = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
            db_acc_2d = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
        else:
            dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        # Software prefetch: each step loads the next tile's dy (and x) before it computes its own,
        # so the loads of one tile are always in flight (one program per SM keeps memory busy).
        if PREFETCH:
            dy_next = load_row_tile(dy_ptr, pid, n_rows, dy_row_stride, cols, col_mask, ROWS)
            if COMPUTE_DX or COMPUTE_DW:
                x_next = load_row_tile(x_ptr, pid, n_rows, x_row_stride, cols, col_mask, ROWS)
        for step in range(pid, n_tiles, n_programs):
            # Reversed, the first programs take the rows the forward wrote last, which the L2 may
            # still hold when the backward follows the forward at once.
            tile = step
            if REVERSE_TILES:
                tile = n_tiles - 1 - step
            if PREFETCH:
                dy = dy_next
                dy_next = load_row_tile(dy_ptr, tile + n_programs, n_rows, dy_row_stride, cols, col_mask, ROWS)
                if COMPUTE_DX or COMPUTE_DW:
                    x = x_next
                    x_next = load_row_tile(x_ptr, tile + n_programs, n_rows, x_row_stride, cols, col_mask, ROWS)
            else:
                dy = load_row_tile(dy_ptr, tile, n_rows, dy_row_stride, cols, col_mask, ROWS)
                if COMPUTE_DX or COMPUTE_DW:
                    x = load_row_tile(x_ptr, tile, n_rows, x_row_stride, cols, col_mask, ROWS)
            dy = dy.to(tl.float32)
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            if COMPUTE_DX or COMPUTE_DW:
                x = x.to(tl.float32)
                mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                if COMPUTE_DX:
                    g = dy * w[None, :]
                    mean_g = tl.sum(g, axis=1) / n_cols
                    mean_gx = tl.sum(g * xhat, axis=1) / n_cols
                    dx = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
                    tl.store(dx_ptr + rows64 * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if COMPUTE_DW:
                    if ACC_2D:
                        dw_acc_2d += dy * xhat
                    else:
                        dw_acc += tl.sum(dy * xhat, axis=0)
            if COMPUTE_DB:
                if ACC_2D:
                    db_acc_2d += dy
                else:
                    db_acc += tl.sum(dy, axis=0)
        if ACC_2D:
            dw_acc = tl.sum(dw_acc_2d, axis=0)
            db_acc = tl.sum(db_acc_2d, axis=0)
        if COMPUTE_DW:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)
        if COMPUTE_DB:
            tl.store(db_row + cols, db_acc, mask=col_mask)
    else:
        # Rows wider than one tile, ROWS of them at a time: pass 1 sums over the column tiles, pass 2
        # re-reads the rows (mostly from L2) and writes dx. The program's partial rows are read and
        # written once per pass-2 tile, so ROWS > 1 divides that L2 traffic.
        n_tiles = tl.cdiv(n_rows, ROWS)
        n_col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            x_rows = x_ptr + rows64 * x_row_stride
            dy_rows = dy_ptr + rows64 * dy_row_stride
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            if COMPUTE_DX:
                # Pass 1: mean(g) and mean(g * xhat). Pass 2 re-reads the rows, mostly from L2.
                sum_g = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
                sum_gx = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK_COLS):
                    c_idx = start + cols
                    col_m = c_idx < n_cols
                    m = row_mask[:, None] & col_m[None, :]
                    # evict_last: keep the rows in L2 for pass 2.
                    x = tl.load(x_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_last")
                    dy = tl.load(dy_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_last")
                    g = dy.to(tl.float32)
                    if HAS_WEIGHT:
                        g = g * tl.load(w_ptr + c_idx, mask=col_m, other=0.0).to(tl.float32)[None, :]
                    sum_g += g
                    sum_gx += g * tl.where(m, (x.to(tl.float32) - mean) * rstd, 0.0)
                mean_g = (tl.sum(sum_g, axis=1) / n_cols)[:, None]
                mean_gx = (tl.sum(sum_gx, axis=1) / n_cols)[:, None]
            # Pass 2 walks the tiles backwards: the ones pass 1 read last are likeliest in L2.
            for back in range(0, n_col_tiles):
                c_idx = (n_col_tiles - 1 - back) * BLOCK_COLS + cols
                col_m = c_idx < n_cols
                m = row_mask[:, None] & col_m[None, :]
                # Last use of x and dy: evict_first. dx streams out without displacing them.
                dy = tl.load(dy_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_first")
                dy = dy.to(tl.float32)
                if COMPUTE_DX or COMPUTE_DW:
                    x = tl.load(x_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_first")
                    xhat = tl.where(m, (x.to(tl.float32) - mean) * rstd, 0.0)
                    if COMPUTE_DX:
                        g = dy
                        if HAS_WEIGHT:
                            g = dy * tl.load(w_ptr + c_idx, mask=col_m, other=0.0).to(tl.float32)[None, :]
                        dx = (g - mean_g - xhat * mean_gx) * rstd
                        tl.store(dx_ptr + rows64 * n_cols + c_idx[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m,
                                 eviction_policy="evict_first")  # fmt: skip
                    if COMPUTE_DW:
                        # This program's own partial row (no other program touches it), kept in L2.
                        acc = tl.load(dw_row + c_idx, mask=col_m, other=0.0, eviction_policy="evict_last")
                        acc += tl.sum(dy * xhat, axis=0)
                        tl.store(dw_row + c_idx, acc, mask=col_m, eviction_policy="evict_last")
                if COMPUTE_DB:
                    acc = tl.load(db_row + c_idx, mask=col_m, other=0.0, eviction_policy="evict_last")
                    tl.store(db_row + c_idx, acc + tl.sum(dy, axis=0), mask=col_m, eviction_policy="evict_last")


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

# Launch parameters: one table per direction, each field with the reason for its value. The timings
# behind them are in the rows of benchmarks/experiments/INDEX.md named here and in docs/benchmarks.md
# (the norms section); benchmarks/tune_norms.py and tune_norm_backward.py sweep them on a GPU.

FORWARD = ForwardParams(
    max_block_cols=32768,  # the one-tile kernel's widest tile; WIDE_FORWARD says which rows take it
    min_tile=2048,  # against 4096 (INDEX.md#layer_norm_narrow_and_frozen_tune)
    elements_per_warp=512,
    max_warps=8,  # against 16 (INDEX.md#norm_forward_warps)
    few_warps_max_cols=16384,  # at H=32768, 16 warps stay faster (norm_forward_warps)
)


class WideLaunch(NamedTuple):
    """The three-pass forward's launch for rows up to ``max_cols`` wide (and wider than the entry before)."""

    max_cols: int
    block_cols: int  # the column tile each pass walks
    num_warps: int


class WideForward(NamedTuple):
    """Which rows the forward takes in three passes over column tiles (_layer_norm_fwd_wide_kernel)."""

    one_tile_max_cols: int  # rows up to this wide take the one-tile kernel (FORWARD's tiling)
    launches: tuple[WideLaunch, ...]  # wider rows: the first entry they fit (the last fits any)


class WideForwardTables(NamedTuple):
    """WideForward by the dtypes of x and of the parameters (one tile's registers grow with both)."""

    half: WideForward  # 16-bit x; 16-bit parameters, or none
    fp32_params: WideForward  # 16-bit x; an fp32 weight or bias (mixed precision's master weights)
    fp32_x: WideForward  # fp32 (or fp64) x


ANY_WIDTH = 1 << 62
# GPU times at 16384 rows, each against torch.compile's in the same run
# (benchmarks/experiments/INDEX.md#layer_norm_forward_stats).
WIDE_FORWARD = WideForwardTables(
    # One tile up to 16384 (93-95% of copy). At 32768 one tile holds one row an SM (128 registers a
    # thread on 16 warps): 0.644 ms against the passes' 0.522, torch.compile's 0.544.
    half=WideForward(one_tile_max_cols=16384, launches=(WideLaunch(ANY_WIDTH, 8192, 32),)),
    # fp32 weight and bias double one tile's registers (122 a thread at 8192 columns) and took 1.2x
    # the passes' time at 2048, 1.6x at 8192, 2.1x at 16384, 2.5x at 32768 (where it spilled).
    fp32_params=WideForward(
        one_tile_max_cols=1024,  # 0.0231 ms against the passes' best 0.0249
        launches=(
            WideLaunch(2048, 2048, 4),  # 0.0396 ms, one tile 0.0487
            WideLaunch(8192, 1024, 8),  # 0.0688 and 0.1355 ms at 4096 and 8192
            WideLaunch(16384, 2048, 16),  # 0.2699 ms
            WideLaunch(ANY_WIDTH, 4096, 32),  # 0.5934 ms at 32768
        ),
    ),
    # fp32 x (any parameters): the passes beat one tile from 1024 columns (0.0357 against 0.0374 ms)
    # to 16384 (0.509 against 0.587); at 32768 both trail torch.compile (1.186 and 1.150 against 1.107).
    fp32_x=WideForward(
        one_tile_max_cols=512,
        launches=(
            WideLaunch(1024, 1024, 4),
            WideLaunch(2048, 1024, 8),
            WideLaunch(4096, 4096, 16),
            WideLaunch(8192, 8192, 16),
            WideLaunch(16384, 4096, 32),
            WideLaunch(ANY_WIDTH, 8192, 32),
        ),
    ),
)


class BackwardParams(NamedTuple):
    """The backward that keeps fp32 partial rows (for dw, or for a db summed in the kernel): a
    persistent grid whose programs each keep one partial row of each."""

    programs_per_sm: int  # for one-tile rows
    looped_programs_per_sm: int  # for wider rows
    max_block_cols: int  # the widest row held in one tile; wider rows loop over column tiles this wide
    prefetch_max_cols: int  # one-tile rows up to this wide load the next tile before computing this one,
    min_tile: int  # and are grouped into tiles of at least this many elements,
    elements_per_warp: int  # with one warp per this many elements of a tile;
    wide_min_tile: int  # wider rows, tiles of at least this many elements,
    wide_elements_per_warp: int  # with one warp per this many (also for the widest rows' tiles)
    acc_2d_rows: int  # tiles of at least this many rows sum dw and db in 2-D, across the rows once at the end
    looped_db_column_sum: bool  # rows that loop leave db to one column sum of dy: partial rows of dw only
    widest_min_cols: int  # rows at least this wide, with a weight gradient, are taken several at a time:
    widest_rows: int  # this many rows a tile,
    widest_block_cols: int  # in column tiles this wide,
    widest_max_warps: int  # with one warp per wide_elements_per_warp of the tile, at most this many
    strips_min_cols: int  # rows at least this wide, with a weight gradient, take the backward of fk.norms.norm_strips


BACKWARD = BackwardParams(
    programs_per_sm=1,  # Liger's count of partial rows (INDEX.md#norm_backward_prefetch)
    looped_programs_per_sm=1,  # few programs, so the rows they re-read stay in L2
    max_block_cols=16384,  # against 8192 at H=16384 and 32768 (tune_norms.py, docs/benchmarks.md)
    prefetch_max_cols=4096,  # rows of 8192 were slower with it (norm_backward_prefetch)
    min_tile=8192,  # norm_backward_prefetch
    elements_per_warp=1024,  # norm_backward_prefetch
    wide_min_tile=4096,
    wide_elements_per_warp=512,
    acc_2d_rows=8,  # norm_backward_prefetch
    looped_db_column_sum=True,  # dw's and db's partial rows together outgrow L2 (docs/benchmarks.md)
    widest_min_cols=16384,  # against one tile a row at 16384, one row a time above (INDEX.md#norm_looped_rows)
    widest_rows=4,  # divides the L2 reads and writes of the program's partial rows (norm_looped_rows)
    widest_block_cols=4096,  # norm_looped_rows
    widest_max_warps=16,
    strips_min_cols=16384,  # 633 against 783 us at 16384 (one tile a row loses here, unlike RMSNorm's; INDEX.md#layer_norm_strips)
)

# Rows up to 4096 columns: as RMSNorm's (2-4 programs an SM, tiles of 4096 elements), 0.79-0.85x the
# time of BACKWARD's own fields at 1024-4096 columns (INDEX.md#norm_narrow_trainable).
BACKWARD_NARROW = (
    NarrowBackwardParams(max_cols=1024, programs_per_sm=3, min_tile=4096, elements_per_warp=1024),
    NarrowBackwardParams(max_cols=4096, programs_per_sm=2, min_tile=4096, elements_per_warp=512),
)


# The two-pass backward of fk.norms.norm_strips (from BACKWARD.strips_min_cols on, with a weight
# gradient): the best of 8 settings near RMSNorm's at 16384 and 32768 columns (1256 against 1756 us
# for the one-kernel backward at 32768; INDEX.md#layer_norm_strips). Wider strips and fewer programs
# than RMSNorm's: pass 2 also reads the row's mean and a, and sums db in a second fp32 tile.
STRIPS = StripParams(
    dot_rows=1, dot_block_cols=2048, dot_num_warps=8,
    block_rows=2, block_cols=1024, num_warps=4, programs_per_sm=4,
)  # fmt: skip


class FrozenBackwardParams(NamedTuple):
    """The backward that keeps no partial rows (no dw, and no db or a db left to a column sum): more
    programs in flight, and no prefetch."""

    programs_per_sm: int  # for one-tile rows wider than narrow_cols
    narrow_cols: int  # rows up to this wide take narrow_programs_per_sm and narrow_min_tile
    narrow_programs_per_sm: int
    narrow_min_tile: int
    min_tile: int  # wider rows are grouped into tiles of at least this many elements
    elements_per_warp: int  # one warp per this many elements of a tile
    max_block_cols: int  # the widest row held in one tile; wider rows loop,
    looped_block_cols: int  # over column tiles this wide,
    looped_programs_per_sm: int  # with this many programs per SM
    narrow_reverse_tiles: bool  # rows up to narrow_cols wide are taken last tile first


BACKWARD_FROZEN = FrozenBackwardParams(
    programs_per_sm=8,  # against 2 (INDEX.md#layer_norm_narrow_and_frozen_tune)
    narrow_cols=1024,
    # One tile a program at 16384 rows of 1024 (8448 programs, 8192 tiles): 29.1 against 29.7 us for
    # 32 an SM's persistent loop (INDEX.md#layer_norm_narrow_backward); 32 against 4 before
    # (INDEX.md#norm_frozen_narrow_tune).
    narrow_programs_per_sm=64,
    narrow_min_tile=2048,  # norm_frozen_narrow_tune
    min_tile=4096,
    elements_per_warp=512,
    max_block_cols=16384,  # as BACKWARD's
    looped_block_cols=8192,  # with 4 per SM, at H=32768 (tune_norms.py, docs/benchmarks.md)
    looped_programs_per_sm=4,
    # The rows the forward wrote last may still be in L2: 2-4% less time at H=1024, none at 2048 and
    # 4096, and at 8192 up to 37% more (INDEX.md#norm_reverse_tiles).
    narrow_reverse_tiles=True,
)


@functools.lru_cache(maxsize=256)
def _fwd_tiling(n_cols: int, x_size: int = 2, param_size: int = 2) -> RowTiling:
    """The forward's tiling for rows of ``n_cols`` elements of ``x_size`` bytes with parameters of
    ``param_size`` bytes (2 without any): one tile, or ``looped`` for the three-pass kernel."""
    table = WIDE_FORWARD.fp32_x if x_size >= 4 else WIDE_FORWARD.fp32_params if param_size >= 4 else WIDE_FORWARD.half
    if n_cols <= table.one_tile_max_cols:
        tiling = forward_tiling(n_cols, FORWARD)
        if not tiling.looped:
            return tiling
    launch = next(entry for entry in table.launches if n_cols <= entry.max_cols)
    return RowTiling(block_cols=launch.block_cols, looped=True, rows_per_tile=1, num_warps=launch.num_warps)


def _widest(n_cols: int, compute_dw: bool) -> bool:
    """Whether the backward takes several rows at a time in column tiles (BACKWARD.widest_*)."""
    return compute_dw and n_cols >= BACKWARD.widest_min_cols


def _keeps_partials(n_cols: int, compute_dw: bool, compute_db: bool) -> bool:
    """Whether the backward keeps fp32 partial rows: for dw, or for a db summed in the kernel (rows
    that loop leave db to a column sum, see BACKWARD.looped_db_column_sum)."""
    looped = n_cols > BACKWARD.max_block_cols or _widest(n_cols, compute_dw)
    return compute_dw or (compute_db and not (looped and BACKWARD.looped_db_column_sum))


@functools.lru_cache(maxsize=256)
def _bwd_tiling(n_cols: int, keeps_partials: bool = True, compute_dw: bool = True) -> RowTiling:
    if keeps_partials:
        params = BACKWARD
        if _widest(n_cols, compute_dw):
            return looped_rows_tiling(params.widest_block_cols, params.widest_rows,
                                      elements_per_warp=params.wide_elements_per_warp,
                                      max_warps=params.widest_max_warps)  # fmt: skip
        by_width = narrow_backward(n_cols, BACKWARD_NARROW)
        if by_width is not None:
            return row_tiling(n_cols, max_block_cols=params.max_block_cols, min_tile_elements=by_width.min_tile,
                              elements_per_warp=by_width.elements_per_warp, name="x")  # fmt: skip
        narrow = n_cols <= params.prefetch_max_cols
        return row_tiling(n_cols, max_block_cols=params.max_block_cols,
                          min_tile_elements=params.min_tile if narrow else params.wide_min_tile,
                          elements_per_warp=params.elements_per_warp if narrow else params.wide_elements_per_warp,
                          name="x")  # fmt: skip
    frozen = BACKWARD_FROZEN
    min_tile = frozen.narrow_min_tile if n_cols <= frozen.narrow_cols else frozen.min_tile
    max_cols = frozen.max_block_cols if n_cols <= frozen.max_block_cols else frozen.looped_block_cols
    return row_tiling(n_cols, max_block_cols=max_cols, min_tile_elements=min_tile,
                      elements_per_warp=frozen.elements_per_warp, name="x")  # fmt: skip


def _layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward launcher: returns (y with x's shape and dtype, mean and rstd fp32 with shape x.shape[:-1])."""
    n_cols = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    x_rows = as_rows(x)
    n_rows = x_rows.shape[0]
    if n_rows == 0:
        return y, mean, rstd
    param_size = max((p.element_size() for p in (weight, bias) if p is not None), default=2)
    tiling = _fwd_tiling(n_cols, x.element_size(), param_size)
    w_arg = weight if weight is not None else x_rows
    b_arg = bias if bias is not None else x_rows
    if tiling.looped:
        _layer_norm_fwd_wide_kernel[(n_rows,)](
            x_rows, w_arg, b_arg, y, mean, rstd, x_rows.stride(0), eps, N_COLS=n_cols,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_COLS=tiling.block_cols,
            num_warps=tiling.num_warps,
        )  # fmt: skip
        return y, mean, rstd
    _layer_norm_fwd_kernel[(cdiv(n_rows, tiling.rows_per_tile),)](
        x_rows, w_arg, b_arg, y, mean, rstd, n_rows, n_cols, x_rows.stride(0), eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, num_warps=tiling.num_warps,
    )  # fmt: skip
    return y, mean, rstd


def _layer_norm_fwd_fake(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    return y, mean, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def partial_rows(
    n_rows: int, n_cols: int, device: torch.device, compute_dw: bool = True, compute_db: bool = True
) -> int:
    """Programs of the one-kernel backward's grid, which is also the number of rows of each fp32
    partial buffer (dw, db) it allocates, when it allocates one. A backward that keeps no partial rows
    (no dw, and no db or a db left to a column sum) runs the frozen settings. Rows from
    ``BACKWARD.strips_min_cols`` on, with dw, take :mod:`fk.norms.norm_strips`, whose grid is its own."""
    keeps_partials = _keeps_partials(n_cols, compute_dw, compute_db)
    if keeps_partials:
        narrow = narrow_backward(n_cols, BACKWARD_NARROW)
        per_sm = narrow.programs_per_sm if narrow is not None else BACKWARD.programs_per_sm
        looped_per_sm = BACKWARD.looped_programs_per_sm
    else:
        frozen = BACKWARD_FROZEN
        per_sm = frozen.narrow_programs_per_sm if n_cols <= frozen.narrow_cols else frozen.programs_per_sm
        looped_per_sm = frozen.looped_programs_per_sm
    return row_reduction_grid(n_rows, _bwd_tiling(n_cols, keeps_partials, compute_dw), device, per_sm, looped_per_sm)


def _layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: returns (dx, dw, db); each one not computed is an empty tensor.

    ``bias`` is not read: it gives db its dtype (and says whether there is one).
    """
    n_cols = x.shape[-1]
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if compute_dx else x.new_empty(0)
    x_rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows = x_rows.shape[0]
    if n_rows == 0 or not (compute_dx or compute_dw or compute_db):
        dw = torch.zeros_like(weight) if compute_dw and weight is not None else x.new_empty(0)
        db = torch.zeros_like(bias) if compute_db and bias is not None else x.new_empty(0)
        return dx, dw, db
    if compute_dw and n_cols >= BACKWARD.strips_min_cols:
        assert weight is not None
        dx_rows = dx.view(n_rows, n_cols) if compute_dx else None
        dw, db_or_none = launch_strips_backward(dy_rows, x_rows, weight, rstd, 0.0, dx_rows, None, STRIPS, mean=mean,
                                                bias=bias if compute_db else None)  # fmt: skip
        return dx, dw, (db_or_none if db_or_none is not None else x.new_empty(0))
    keeps_partials = _keeps_partials(n_cols, compute_dw, compute_db)
    tiling = _bwd_tiling(n_cols, keeps_partials, compute_dw)
    n_programs = partial_rows(n_rows, n_cols, x.device, compute_dw, compute_db)
    alloc = torch.zeros if tiling.looped else torch.empty
    db_in_kernel = compute_db and not (tiling.looped and BACKWARD.looped_db_column_sum)
    # A partial buffer that is not needed is never read or written: its COMPUTE_* flag is False.
    # dw's and db's partial rows in one buffer when both are summed (one sum_rows launch for both).
    n_partials = int(compute_dw) + int(db_in_kernel)
    partials = alloc((n_partials, n_programs, n_cols), dtype=torch.float32, device=x.device) if n_partials else rstd
    dw_partial = partials[0] if compute_dw else rstd
    db_partial = partials[n_partials - 1] if db_in_kernel else rstd
    one_tile = not tiling.looped
    _layer_norm_bwd_kernel[(n_programs,)](
        dy_rows, x_rows, weight if weight is not None else x_rows, mean, rstd,
        dx if compute_dx else x_rows, dw_partial, db_partial,
        n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0),
        HAS_WEIGHT=weight is not None, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, COMPUTE_DB=db_in_kernel,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped,
        ACC_2D=one_tile and keeps_partials and tiling.rows_per_tile >= BACKWARD.acc_2d_rows,
        PREFETCH=one_tile and keeps_partials and tiling.block_cols <= BACKWARD.prefetch_max_cols,
        REVERSE_TILES=one_tile and not keeps_partials and n_cols <= BACKWARD_FROZEN.narrow_cols
        and BACKWARD_FROZEN.narrow_reverse_tiles,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    dw_sum, db_sum = sum_weight_and_bias_rows(partials, weight if compute_dw else None, bias if db_in_kernel else None)
    if compute_db and bias is not None and not db_in_kernel:
        db_sum = column_sum(dy_rows).to(bias.dtype)
    return dx, (dw_sum if dw_sum is not None else x.new_empty(0)), (db_sum if db_sum is not None else x.new_empty(0))


def _layer_norm_bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if compute_dx else x.new_empty(0)
    dw = torch.empty_like(weight) if compute_dw and weight is not None else x.new_empty(0)
    db = torch.empty_like(bias) if compute_db and bias is not None else x.new_empty(0)
    return dx, dw, db


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    x, weight, bias, _eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None, _dmean: Any, _drstd: Any) -> tuple[Any, ...]:
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if dy is None or not (need_dx or need_dw or need_db):
        return None, None, None, None
    dx, dw, db = run_backward(dy, x, weight, bias, mean, rstd, need_dx, need_dw, need_db)
    return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), None


_layer_norm = define_autograd_op(
    __name__, "layer_norm",
    forward=_layer_norm_fwd, forward_fake=_layer_norm_fwd_fake,
    backward_launcher=_layer_norm_bwd, backward_fake=_layer_norm_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x``: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Equals ``torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)``.

    Args:
        x: input of shape ``(..., H)``, fp32/fp16/bf16, any strides.
        weight: ``(H,)`` scale, or None.
        bias: ``(H,)`` shift, or None.
        eps: added to the variance before the square root; > 0.

    Returns a tensor of x's shape and dtype. The weight and bias gradients are computed only when
    they require grad: a frozen weight or bias costs no backward work or memory.
    """
    validate.check_tensor("x", x)
    validate.check_dtype("x", x)
    validate.check_min_ndim("x", x, 1)
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    # (weight before eps: a call written for F.layer_norm(x, normalized_shape, weight, bias, eps)
    # is then told that its shape is not a weight, not that its bias is not an eps)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            validate.check_tensor(name, param)
            validate.check_dtype(name, param)
            validate.check_shape(name, param, (x.shape[-1],))
            validate.check_same_device(name, param, "x", x)
    eps = validate.check_positive_float("eps", eps)
    if not uses_kernel(x):
        return layer_norm_ref(x, weight, bias, eps)
    y, _, _ = _layer_norm(x, weight, bias, eps)
    return y


# --- 5. Module ------------------------------------------------------------------------------------


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` (same constructor and state_dict) running fk's kernels.

    A multi-dimensional ``normalized_shape`` normalizes over all of its trailing dimensions;
    ``elementwise_affine=False`` and ``bias=False`` work as in PyTorch.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        if tuple(x.shape[x.ndim - len(shape) :]) != shape:
            raise ValueError(f"x must end with the dimensions {shape}, got shape {tuple(x.shape)}")
        weight, bias = self.weight, self.bias
        if len(shape) != 1:
            x_flat = x.reshape(*x.shape[: x.ndim - len(shape)], -1)
            w_flat = weight.reshape(-1) if weight is not None else None
            b_flat = bias.reshape(-1) if bias is not None else None
            return layer_norm(x_flat, w_flat, b_flat, self.eps).reshape(x.shape)
        return layer_norm(x, weight, bias, self.eps)
