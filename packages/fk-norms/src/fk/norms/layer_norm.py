"""LayerNorm: ``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last dimension.

As ``torch.nn.functional.layer_norm``: the mean and the (biased) variance are computed in fp32,
so is the affine transform, and the result is rounded once to the dtype of ``x``. ``weight`` and
``bias`` are each optional; their gradients have their own dtypes. The kernels accumulate in fp32.

This file holds, in order: the reference, the Triton kernels, the launchers registered as custom
ops, the functional API :func:`layer_norm` and the module :class:`LayerNorm`.
"""

from __future__ import annotations

import functools
from typing import Any

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
# COMPUTE_DW and COMPUTE_DB are constexpr, so Triton drops the dead code.
#
# The forward's looped path (rows wider than one tile, B = BLOCK_COLS < H) reads the row twice:
# pass 1 sums d = x - K and d^2 over the column tiles, with the shift K the mean of the first tile;
# then mean = K + mean(d) and var = mean(d^2) - mean(d)^2; pass 2 writes y. The shift keeps the
# sums small (no E[x^2] - E[x]^2 cancellation when |mean| >> std), and it cannot be far off: by the
# law of total variance var >= (B/H) (K - mean)^2, so mean(d)^2 <= (H/B) var and the subtraction
# loses at most log2(H/B) bits (3 bits at H = 8B).


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
    else:
        # Pass 1: sums of d = x - K and d^2, with K the mean of the first tile (see above).
        x = tl.load(x_rows + cols[None, :], mask=row_mask[:, None], other=0.0, eviction_policy="evict_last")
        x = x.to(tl.float32)  # the first tile is full: n_cols > BLOCK_COLS
        shift = tl.sum(x, axis=1) / BLOCK_COLS
        d = tl.where(row_mask[:, None], x - shift[:, None], 0.0)
        sum_d = d
        sum_d2 = d * d
        for start in range(BLOCK_COLS, n_cols, BLOCK_COLS):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            # evict_last: keep the row in L2 for pass 2.
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            d = tl.where(mask, x - shift[:, None], 0.0)
            sum_d += d
            sum_d2 += d * d
        mean_d = tl.sum(sum_d, axis=1) / n_cols
        var = tl.maximum(tl.sum(sum_d2, axis=1) / n_cols - mean_d * mean_d, 0.0)
        mean = shift + mean_d
        rstd = tl.rsqrt(var + eps)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        # Pass 2 walks the tiles backwards: the ones pass 1 read last are likeliest in L2.
        n_col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
        for back in range(0, n_col_tiles):
            c = (n_col_tiles - 1 - back) * BLOCK_COLS + cols
            col_mask = c < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            # (x - K) - mean(d), not x - mean: the fp32 rounding of mean = K + mean(d) stays out of y.
            y = ((x - shift[:, None]) - mean_d[:, None]) * rstd[:, None]
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_BIAS:
                y = y + tl.load(b_ptr + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


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
):
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
        for tile in range(pid, n_tiles, n_programs):
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

# Launch parameters. The forward holds rows of up to 32768 in one tile (on an H200, tune_norms.py,
# that beat column tiles at H=32768, unlike RMSNorm's forward). The widest row the backward holds in
# one tile (BWD_MAX_BLOCK_COLS) is from benchmarks/tune_norms.py --op layer_norm on an H200 (16384
# rows, bf16, trainable, GPU time): 16384 instead of 8192 took forward+backward from 1.52 to
# 1.22 ms at H=16384, and from 3.15 to 2.52 ms at H=32768 (column tiles of 16384 instead of 8192).
# Since then a backward with a weight gradient takes rows from BWD_WIDEST_MIN_COLS on several at a
# time in narrower column tiles (below), which beat both at those widths.
FWD_MAX_BLOCK_COLS = 32768  # widest row the forward holds in one tile
FWD_MIN_TILE = 2048  # narrow rows are grouped into tiles of at least this many elements
FWD_ELEMENTS_PER_WARP = 512
# Rows up to FWD_FEW_WARPS_MAX_COLS wide take at most FWD_MAX_WARPS warps, wider ones (one tile of
# up to 32768 columns) up to 16. tune_norms.py --op layer_norm --directions fwd on an H200 (16384
# rows, bf16, GPU time; benchmarks/experiments/INDEX.md#norm_forward_warps): 8 warps
# instead of 16 took H=8192 from 0.149 to 0.132 ms and H=16384 from 0.274 to 0.273 ms; narrower
# rows had 8 or fewer already; at H=32768, 8 warps were slower than 16's 0.646 ms.
FWD_MAX_WARPS = 8
FWD_FEW_WARPS_MAX_COLS = 16384
BWD_MAX_BLOCK_COLS = 16384
BWD_LOOPED_PROGRAMS_PER_SM = 1  # wider rows: few programs, so the rows they re-read stay in L2
# A backward that keeps partial rows (dw, or db summed in the kernel) runs one program per SM, as
# RMSNorm's (see BWD_PROGRAMS_PER_SM there): each program keeps one fp32 partial row of dw and one
# of db, as many as Liger's. For rows up to BWD_PREFETCH_MAX_COLS wide the loop prefetches the next
# tile, tiles have at least BWD_MIN_TILE elements, one warp per BWD_ELEMENTS_PER_WARP, and those of
# at least BWD_ACC_2D_ROWS rows accumulate in 2-D; wider rows take BWD_WIDE_MIN_TILE and
# BWD_WIDE_ELEMENTS_PER_WARP without prefetch. benchmarks/tune_norm_backward.py --op layer_norm on
# an H200 (the backward alone, 16384 rows, bf16; benchmarks/experiments/INDEX.md#norm_backward_prefetch),
# against the settings before (4 programs per SM up to H=1024,
# 2 up to 4096, without prefetch): H=512 52.4 -> 23.3 us, 1024 36.0 -> 39.6, 2048 67.3 -> 74.0,
# 4096 127.4 -> 132.6. Two programs per SM would have kept the narrow rows' speed (1024: 36.1 us)
# at twice the partial rows; LayerNorm's forward+backward there is still 1.17-1.24x the fastest
# peer's (norms.json, 2026-11-24T12:56). With prefetch, rows of 8192 took 279 us against 270 without.
BWD_PROGRAMS_PER_SM = 1
BWD_MIN_TILE = 8192
BWD_ELEMENTS_PER_WARP = 1024
BWD_PREFETCH_MAX_COLS = 4096
BWD_ACC_2D_ROWS = 8
BWD_WIDE_MIN_TILE = 4096
BWD_WIDE_ELEMENTS_PER_WARP = 512
# Without partial rows to keep, more programs in flight and no prefetch. tune_norms.py --op
# layer_norm --frozen on an H200 (16384 rows, bf16, forward+backward GPU time): 32 programs per SM
# at H <= 1024 took 16384 x 1024 from 0.0571 to 0.0495 ms
# (benchmarks/experiments/INDEX.md#norm_frozen_narrow_tune); 8 per SM instead of 2 took
# H=2048 from 0.106 to 0.092 ms and H=4096 from 0.195 to 0.180 ms (H=8192: 0.350 either way); at
# H=32768, 8192-column tiles and 4 programs per SM took 2.04 ms to 1.58 ms. The forward's
# FWD_MIN_TILE of 2048 (was 4096) took H=1024 from 0.0237 to 0.0215 ms and H=2048 from 0.0385 to
# 0.0378 ms.
BWD_FROZEN_NARROW_COLS = 1024
BWD_FROZEN_NARROW_MIN_TILE = 2048
BWD_FROZEN_NARROW_PROGRAMS_PER_SM = 32
BWD_FROZEN_MIN_TILE = 4096
BWD_FROZEN_ELEMENTS_PER_WARP = 512
BWD_FROZEN_PROGRAMS_PER_SM = 8
BWD_FROZEN_LOOPED_BLOCK_COLS = 8192
BWD_FROZEN_LOOPED_PROGRAMS_PER_SM = 4
# Wide rows: the backward keeps one fp32 partial row per program for dw and one for db, updated
# for every row it processes; with both, those rows and the rows in flight outgrow L2 and every
# update goes to memory. So for wide rows db = sum of dy over the rows is left to one column sum
# (one more read of dy), and the kernel keeps dw's partial rows only. On an H200, 16384 rows, bf16,
# forward+backward: H=32768 4.44 -> 3.15 ms, H=16384 1.62 -> 1.51 ms (native 3.04 / 1.50 ms).
LOOPED_DB_BY_COLUMN_SUM = True
# With a weight gradient, rows of at least BWD_WIDEST_MIN_COLS are taken BWD_WIDEST_ROWS at a time,
# in column tiles of BWD_WIDEST_BLOCK_COLS (at most 16 warps): fewer L2 reads and writes of the
# partial rows per row (see RMSNorm's setting of that name), and db left to the column sum.
# tune_norm_backward.py --op layer_norm --space looped on an H200 (the backward alone, 16384 rows,
# bf16; benchmarks/experiments/INDEX.md#norm_looped_rows), against one tile per row at
# H=16384 and one row at a time in 16384-column tiles above: H=16384 928 -> 783 us, 32768 1865 ->
# 1755 us, 65536 4776 -> 3669 us.
BWD_WIDEST_MIN_COLS = 16384
BWD_WIDEST_ROWS = 4
BWD_WIDEST_BLOCK_COLS = 4096
BWD_WIDEST_MAX_WARPS = 16


@functools.lru_cache(maxsize=256)
def _fwd_tiling(n_cols: int) -> RowTiling:
    return row_tiling(n_cols, max_block_cols=FWD_MAX_BLOCK_COLS, min_tile_elements=FWD_MIN_TILE,
                      elements_per_warp=FWD_ELEMENTS_PER_WARP,
                      max_warps=FWD_MAX_WARPS if n_cols <= FWD_FEW_WARPS_MAX_COLS else 16, name="x")  # fmt: skip


def _widest(n_cols: int, compute_dw: bool) -> bool:
    """Whether the backward takes several rows at a time in column tiles (BWD_WIDEST_*)."""
    return compute_dw and n_cols >= BWD_WIDEST_MIN_COLS


def _keeps_partials(n_cols: int, compute_dw: bool, compute_db: bool) -> bool:
    """Whether the backward keeps fp32 partial rows: for dw, or for a db summed in the kernel (wide
    rows leave db to a column sum, see LOOPED_DB_BY_COLUMN_SUM)."""
    looped = n_cols > BWD_MAX_BLOCK_COLS or _widest(n_cols, compute_dw)
    return compute_dw or (compute_db and not (looped and LOOPED_DB_BY_COLUMN_SUM))


@functools.lru_cache(maxsize=256)
def _bwd_tiling(n_cols: int, keeps_partials: bool = True, compute_dw: bool = True) -> RowTiling:
    if keeps_partials and _widest(n_cols, compute_dw):
        return looped_rows_tiling(BWD_WIDEST_BLOCK_COLS, BWD_WIDEST_ROWS, elements_per_warp=BWD_WIDE_ELEMENTS_PER_WARP,
                                  max_warps=BWD_WIDEST_MAX_WARPS)  # fmt: skip
    if keeps_partials:
        narrow = n_cols <= BWD_PREFETCH_MAX_COLS
        return row_tiling(n_cols, max_block_cols=BWD_MAX_BLOCK_COLS,
                          min_tile_elements=BWD_MIN_TILE if narrow else BWD_WIDE_MIN_TILE,
                          elements_per_warp=BWD_ELEMENTS_PER_WARP if narrow else BWD_WIDE_ELEMENTS_PER_WARP,
                          name="x")  # fmt: skip
    min_tile = BWD_FROZEN_NARROW_MIN_TILE if n_cols <= BWD_FROZEN_NARROW_COLS else BWD_FROZEN_MIN_TILE
    max_cols = BWD_MAX_BLOCK_COLS if n_cols <= BWD_MAX_BLOCK_COLS else BWD_FROZEN_LOOPED_BLOCK_COLS
    return row_tiling(n_cols, max_block_cols=max_cols, min_tile_elements=min_tile,
                      elements_per_warp=BWD_FROZEN_ELEMENTS_PER_WARP, name="x")  # fmt: skip


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
    tiling = _fwd_tiling(n_cols)
    grid = (cdiv(n_rows, tiling.rows_per_tile),)
    _layer_norm_fwd_kernel[grid](
        x_rows, weight if weight is not None else x_rows, bias if bias is not None else x_rows,
        y, mean, rstd, n_rows, n_cols, x_rows.stride(0), eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped,
        num_warps=tiling.num_warps,
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
    """Programs of the backward's grid, which is also the number of rows of each fp32 partial
    buffer (dw, db) it allocates, when it allocates one. A backward that keeps no partial rows (no
    dw, and no db or a db left to a column sum) runs the frozen settings."""
    keeps_partials = _keeps_partials(n_cols, compute_dw, compute_db)
    if keeps_partials:
        per_sm, looped_per_sm = BWD_PROGRAMS_PER_SM, BWD_LOOPED_PROGRAMS_PER_SM
    else:
        per_sm = BWD_FROZEN_NARROW_PROGRAMS_PER_SM if n_cols <= BWD_FROZEN_NARROW_COLS else BWD_FROZEN_PROGRAMS_PER_SM
        looped_per_sm = BWD_FROZEN_LOOPED_PROGRAMS_PER_SM
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
    keeps_partials = _keeps_partials(n_cols, compute_dw, compute_db)
    tiling = _bwd_tiling(n_cols, keeps_partials, compute_dw)
    n_programs = partial_rows(n_rows, n_cols, x.device, compute_dw, compute_db)
    alloc = torch.zeros if tiling.looped else torch.empty
    db_in_kernel = compute_db and not (tiling.looped and LOOPED_DB_BY_COLUMN_SUM)
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
        ACC_2D=one_tile and keeps_partials and tiling.rows_per_tile >= BWD_ACC_2D_ROWS,
        PREFETCH=one_tile and keeps_partials and tiling.block_cols <= BWD_PREFETCH_MAX_COLS,
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
