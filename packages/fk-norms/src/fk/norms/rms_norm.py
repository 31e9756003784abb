"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dimension.

Two casting modes, as the model families that use RMSNorm define them:

- ``"llama"`` (Llama, Mistral, Qwen, ...): the inverse RMS and the normalized row are computed in
  fp32, the normalized row is rounded to the input dtype, then multiplied by the weight.
- ``"gemma"`` (Gemma): everything in fp32, with ``offset=1`` (the weight is stored as ``w`` and
  applied as ``1 + w``); the result is rounded once at the end.

The output has the dtype of ``x``; the weight gradient has the dtype of ``weight``. In both modes
the kernels accumulate in fp32.

This file holds, in order: the reference, the Triton kernels, the launchers registered as custom
ops, the functional APIs :func:`rms_norm` and :func:`rms_norm_and_input` (which also hands ``x``
on, for a residual branch) and the module :class:`RMSNorm`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import RowTiling, as_rows, cdiv, looped_rows_tiling, row_reduction_grid, row_tiling, writable_rows
from fk.core.ops import define_autograd_op
from fk.core.reduce import sum_rows
from fk.core.tiles import load_row_tile
from fk.norms.launch_params import ForwardParams, NarrowBackwardParams, forward_tiling, narrow_backward
from fk.norms.norm_strips import StripParams, launch_strips_backward

CASTING_MODES = ("llama", "gemma")


def _default_offset(casting_mode: str, offset: float | None) -> float:
    if offset is not None:
        return float(offset)
    return 1.0 if casting_mode == "gemma" else 0.0


# --- 1. Reference ---------------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    casting_mode: str = "llama",
    offset: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch RMSNorm over the last dimension (computes in fp32, or fp64 for fp64 input).

    This is the definition the kernels are tested against.
    """
    offset = _default_offset(casting_mode, offset)
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xhat.to(x.dtype)
    scale = weight.to(compute) + offset
    if casting_mode == "llama":
        # Round the normalized row to the input dtype first, as Hugging Face's LlamaRMSNorm does.
        return (xhat.to(x.dtype).to(compute) * scale).to(x.dtype)
    return (xhat * scale).to(x.dtype)


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Notation, per row of H elements: r = 1 / sqrt(mean(x^2) + eps) (rstd: saved by the forward, fp32),
# xhat = x * r, s = offset + w, y = xhat * s.
#
# Backward, with g = dy * s:
#   dr/dx_i   = -r^3 x_i / H
#   dx_i      = r g_i + sum_j g_j x_j dr/dx_i = r * (g_i - xhat_i * c),   c = (1/H) sum_j g_j xhat_j
#   dw_j      = sum over rows of dy_j * xhat_j
# In "llama" mode the rounding of xhat to the input dtype is treated as the identity, as autograd
# treats a dtype cast; the kernels use the unrounded fp32 xhat, which is closer to exact.
#
# The same two kernels serve FusedAddRMSNorm (fused_add_rms_norm.py): with HAS_RESIDUAL the forward
# normalizes x + residual (rounded to x's dtype) and writes it out, the new residual; with HAS_DRES
# the backward adds the gradient of that output, dx = dres + r * (g - xhat * c). dx may be written
# over dy (in_place_backward): each element of dy is read before the dx of the same element is
# written, by the same program.
#
# The weight gradient is a column sum over all rows. The backward runs a persistent grid: program p
# strides over row tiles p, p+P, ... and keeps its share of dw in fp32 registers (or, for rows too
# wide for one tile, in its own row of the fp32 partial buffer), then writes one row of a [P, H]
# partial buffer that a final sum reduces. No atomics, a bounded number of partial rows, and no
# weight-gradient work at all when COMPUTE_DW is False.


@triton.jit
def _add_residual(x, residual_ptrs, residual_out_ptrs, mask):
    """x + residual rounded to x's dtype (as ``residual = residual + hidden_states`` in PyTorch):
    stores it at ``residual_out_ptrs`` and returns it. ``residual_out_ptrs`` may equal
    ``residual_ptrs``: each element is read, then written, by the same thread."""
    new_residual = (x.to(tl.float32) + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    tl.store(residual_out_ptrs, new_residual, mask=mask)
    return new_residual


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # [M, H] input, row stride x_row_stride, unit column stride
    residual_ptr,  # [M, H] residual, row stride residual_row_stride (unused when HAS_RESIDUAL is False)
    residual_out_ptr,  # [M, H] output x + residual, row stride residual_out_row_stride; may be residual_ptr
    w_ptr,  # [H] weight (unused when HAS_WEIGHT is False)
    y_ptr,  # [M, H] output, contiguous
    rstd_ptr,  # [M] fp32 output: 1 / sqrt(mean(x^2) + eps), saved for the backward
    n_rows,
    n_cols,
    x_row_stride,
    residual_row_stride,
    residual_out_row_stride,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,  # normalize x + residual (rounded to x's dtype) and write it out
    HAS_WEIGHT: tl.constexpr,
    GEMMA: tl.constexpr,  # all-fp32 product (gemma) instead of rounding xhat first (llama)
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program (1 when LOOPED)
    LOOPED: tl.constexpr,  # the row is wider than BLOCK_COLS: two passes over column tiles
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    residual_rows = residual_ptr + rows.to(tl.int64)[:, None] * residual_row_stride
    residual_out_rows = residual_out_ptr + rows.to(tl.int64)[:, None] * residual_out_row_stride
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * n_cols
    cols = tl.arange(0, BLOCK_COLS)
    if not LOOPED:
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = _add_residual(x, residual_rows + cols[None, :], residual_out_rows + cols[None, :], mask)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        xhat = x * rstd[:, None]
        if HAS_WEIGHT:
            s = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
            if not GEMMA:
                xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
            xhat = xhat * s[None, :]
        tl.store(y_rows + cols[None, :], xhat.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_COLS):
            c_idx = start + cols
            mask = row_mask[:, None] & (c_idx < n_cols)[None, :]
            x = tl.load(x_rows + c_idx[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                x = _add_residual(x, residual_rows + c_idx[None, :], residual_out_rows + c_idx[None, :], mask)
            x = x.to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        if HAS_RESIDUAL:
            # Pass 2 reads back the new residual this program has just written (from L2), not x and
            # the residual.
            tl.debug_barrier()
        for start in range(0, n_cols, BLOCK_COLS):
            c_idx = start + cols
            mask = row_mask[:, None] & (c_idx < n_cols)[None, :]
            if HAS_RESIDUAL:
                x = tl.load(residual_out_rows + c_idx[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_rows + c_idx[None, :], mask=mask, other=0.0).to(tl.float32)
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                s = tl.load(w_ptr + c_idx, mask=c_idx < n_cols, other=0.0).to(tl.float32) + offset
                if not GEMMA:
                    xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
                xhat = xhat * s[None, :]
            tl.store(y_rows + c_idx[None, :], xhat.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,  # [M, H] upstream gradient, row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H] forward input, row stride x_row_stride, unit column stride
    dres_ptr,  # [M, H] gradient added to dx, row stride dres_row_stride (unused unless HAS_DRES)
    w_ptr,  # [H] weight (unused when HAS_WEIGHT is False)
    rstd_ptr,  # [M] fp32, from the forward
    dx_ptr,  # [M, H] output, row stride dx_row_stride; may be dy_ptr (dx written over dy)
    dw_partial_ptr,  # [P, H] fp32 output, one row per program (unused when COMPUTE_DW is False)
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    dres_row_stride,
    dx_row_stride,
    offset,
    HAS_DRES: tl.constexpr,  # dx += dres (FusedAddRMSNorm: the gradient of the residual output)
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per tile
    LOOPED: tl.constexpr,  # the row is wider than BLOCK_COLS: two passes over column tiles
    WEIGHT_PER_TILE: tl.constexpr,  # load the weight for every tile (from L1/L2), not once per program
    ACC_2D: tl.constexpr,  # accumulate dw in a [ROWS, BLOCK_COLS] tile (tiles of many short rows)
    PREFETCH: tl.constexpr,  # load the next tile's x and dy before computing this one's
    REVERSE_TILES: tl.constexpr,  # one-tile rows, last tile first (never with PREFETCH)
    CONTIGUOUS_TILES: tl.constexpr,  # one-tile rows, each program a block of consecutive tiles (not with PREFETCH)
    EARLY_DRES: tl.constexpr,  # one-tile rows: load dres beside x and dy, not after computing dx
    DW_FIRST: tl.constexpr,  # one-tile rows, dw in 1-D: add this tile's dw before computing dx (dy dies sooner)
):
    tl.static_assert(not (PREFETCH and (REVERSE_TILES or CONTIGUOUS_TILES)), "the prefetch takes every n-th tile")
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    partial_row = dw_partial_ptr + pid.to(tl.int64) * n_cols
    if not LOOPED:
        col_mask = cols < n_cols
        s = tl.full([BLOCK_COLS], 1.0, tl.float32)
        if HAS_WEIGHT and not WEIGHT_PER_TILE:
            s = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        if ACC_2D:  # one sum over the tile's rows at the end, not a cross-warp sum at every tile
            dw_acc_2d = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
        else:
            dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        # Software prefetch: each step loads the next tile's x and dy before it computes its own,
        # so the loads of one tile are always in flight (one program per SM keeps memory busy).
        if PREFETCH:
            x_next = load_row_tile(x_ptr, pid, n_rows, x_row_stride, cols, col_mask, ROWS)
            dy_next = load_row_tile(dy_ptr, pid, n_rows, dy_row_stride, cols, col_mask, ROWS)
        # This program's steps: every n_programs-th tile from pid, or a block of consecutive tiles.
        first, end, stride = pid, n_tiles, n_programs
        if CONTIGUOUS_TILES:
            per_program = tl.cdiv(n_tiles, n_programs)
            first = pid * per_program
            end = tl.minimum(first + per_program, n_tiles)
            stride = 1
        for step in range(first, end, stride):
            # Reversed, the first programs take the rows the forward wrote last, which the L2 may
            # still hold when the backward follows the forward at once.
            tile = step
            if REVERSE_TILES:
                tile = n_tiles - 1 - step
            if PREFETCH:
                x, dy = x_next, dy_next
                x_next = load_row_tile(x_ptr, tile + n_programs, n_rows, x_row_stride, cols, col_mask, ROWS)
                dy_next = load_row_tile(dy_ptr, tile + n_programs, n_rows, dy_row_stride, cols, col_mask, ROWS)
            else:
                x = load_row_tile(x_ptr, tile, n_rows, x_row_stride, cols, col_mask, ROWS)
                dy = load_row_tile(dy_ptr, tile, n_rows, dy_row_stride, cols, col_mask, ROWS)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            if HAS_WEIGHT and WEIGHT_PER_TILE:  # (one fewer row-wide value held across the loop)
                s = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_DRES and EARLY_DRES:  # in flight while dx is computed, one more tile held
                dres = tl.load(dres_ptr + rows64 * dres_row_stride + cols[None, :], mask=mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            xhat = x * rstd[:, None]
            if COMPUTE_DW and DW_FIRST and not ACC_2D:
                dw_acc += tl.sum(dy * xhat, axis=0)
            g = dy * s[None, :]
            c = tl.sum(g * xhat, axis=1) / n_cols
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            if HAS_DRES:
                if not EARLY_DRES:
                    dres = tl.load(dres_ptr + rows64 * dres_row_stride + cols[None, :], mask=mask, other=0.0)
                dx += dres.to(tl.float32)
            tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                if ACC_2D:
                    dw_acc_2d += dy * xhat
                elif not DW_FIRST:
                    dw_acc += tl.sum(dy * xhat, axis=0)
        if COMPUTE_DW:
            if ACC_2D:
                dw_acc = tl.sum(dw_acc_2d, axis=0)
            tl.store(partial_row + cols, dw_acc, mask=col_mask)
    else:
        # Rows wider than one tile, ROWS of them at a time: pass 1 sums g * xhat over the column
        # tiles, pass 2 re-reads the rows (mostly from L2) and writes dx. The program's partial
        # row of dw is read and written once per pass-2 tile, so ROWS > 1 divides that L2 traffic.
        rows_in_tile = tl.arange(0, ROWS)
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * ROWS + rows_in_tile
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            x_rows = x_ptr + rows64 * x_row_stride
            dy_rows = dy_ptr + rows64 * dy_row_stride
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            # Pass 1: c = (1/H) sum_j g_j xhat_j. Pass 2 re-reads the rows, mostly from L2.
            gx = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c_idx = start + cols
                m = row_mask[:, None] & (c_idx < n_cols)[None, :]
                # evict_last: keep the rows in L2 for pass 2.
                x = tl.load(x_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                dy = tl.load(dy_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_last")
                s = tl.full([BLOCK_COLS], 1.0, tl.float32)
                if HAS_WEIGHT:
                    s = tl.load(w_ptr + c_idx, mask=c_idx < n_cols, other=0.0).to(tl.float32) + offset
                gx += dy.to(tl.float32) * s[None, :] * x
            c = tl.sum(gx, axis=1) * rstd / n_cols
            # Pass 2 walks the tiles backwards: the ones pass 1 read last are likeliest in L2.
            n_col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
            for back in range(0, n_col_tiles):
                c_idx = (n_col_tiles - 1 - back) * BLOCK_COLS + cols
                col_m = c_idx < n_cols
                m = row_mask[:, None] & col_m[None, :]
                # Last use of x and dy: evict_first. dx streams out without displacing them.
                x = tl.load(x_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
                dy = tl.load(dy_rows + c_idx[None, :], mask=m, other=0.0, eviction_policy="evict_first")
                dy = dy.to(tl.float32)
                s = tl.full([BLOCK_COLS], 1.0, tl.float32)
                if HAS_WEIGHT:
                    s = tl.load(w_ptr + c_idx, mask=col_m, other=0.0).to(tl.float32) + offset
                xhat = x * rstd[:, None]
                dx = (dy * s[None, :] - xhat * c[:, None]) * rstd[:, None]
                if HAS_DRES:
                    dres = tl.load(dres_ptr + rows64 * dres_row_stride + c_idx[None, :], mask=m, other=0.0,
                                   eviction_policy="evict_first")  # fmt: skip
                    dx += dres.to(tl.float32)
                tl.store(dx_ptr + rows64 * dx_row_stride + c_idx[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m,
                         eviction_policy="evict_first")  # fmt: skip
                if COMPUTE_DW:
                    # This program's own partial row (no other program touches it), kept in L2.
                    acc = tl.load(partial_row + c_idx, mask=col_m, other=0.0, eviction_policy="evict_last")
                    acc += tl.sum(dy * xhat, axis=0)
                    tl.store(partial_row + c_idx, acc, mask=col_m, eviction_policy="evict_last")


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

# Launch parameters: one table per direction, each field with the reason for its value. The timings
# behind them are in the rows of benchmarks/experiments/INDEX.md named here and in docs/benchmarks.md
# (the norms section); benchmarks/tune_norms.py and tune_norm_backward.py sweep them on a GPU.

FORWARD = ForwardParams(
    max_block_cols=16384,  # at H=32768 two tiles of 16384 beat one (tune_norms.py, docs/benchmarks.md)
    min_tile=2048,  # 1-3% faster than 4096 at H = 1024 to 8192 (INDEX.md#norm_forward_ab)
    elements_per_warp=512,
    max_warps=8,  # against 16 (norm_forward_ab); rows that loop take up to 16
    few_warps_max_cols=16384,
)
# FusedAddRMSNorm's forward (HAS_RESIDUAL), whose second pass re-reads the sum it has just written.
FORWARD_RESIDUAL = ForwardParams(
    max_block_cols=32768,  # at H=32768 one tile beat four of 8192 (tune_norms.py, docs/benchmarks.md)
    min_tile=2048,  # as RMSNorm's (norm_forward_ab)
    elements_per_warp=512,
    max_warps=16,  # 8 were 1% slower at H=8192 and 16384 (norm_forward_ab)
    few_warps_max_cols=32768,
)


class BackwardParams(NamedTuple):
    """The backward with a weight gradient: a persistent grid whose programs each keep an fp32
    partial row of dw (in registers for one-tile rows, in the partial buffer for wider ones)."""

    programs_per_sm: int  # for one-tile rows
    looped_programs_per_sm: int  # for wider rows
    max_block_cols: int  # the widest row held in one tile; wider rows loop over column tiles this wide
    min_tile: int  # narrow rows are grouped into tiles of at least this many elements
    elements_per_warp: int  # one warp per this many elements of a tile
    prefetch_max_cols: int  # one-tile rows up to this wide load the next tile before computing this one
    acc_2d_rows: int  # tiles of at least this many rows sum dw in 2-D, across the rows once at the end
    weight_per_tile_cols: int  # one-tile rows at least this wide load the weight for every tile
    widest_min_cols: int  # rows at least this wide are taken several at a time:
    widest_rows: int  # this many rows a tile,
    widest_block_cols: int  # in column tiles this wide,
    widest_max_warps: int  # with one warp per elements_per_warp of the tile, at most this many
    strips_min_cols: int  # rows at least this wide take the two-pass backward of fk.norms.norm_strips,
    strips_min_cols_residual: int  # and FusedAddRMSNorm's (dx += the residual's gradient) from this width
    contiguous_min_cols: int  # RMSNorm's one-tile rows at least this wide: consecutive tiles a program, no prefetch,
    contiguous_elements_per_warp: int  # and one warp per this many elements of a tile
    early_dres_min_cols: int  # FusedAddRMSNorm's one-tile rows at least this wide load dres beside x and dy (with dw)
    dw_first_min_cols: int  # RMSNorm's one-tile rows at least this wide add their dw before computing dx,
    dw_first_min_cols_residual: int  # and FusedAddRMSNorm's,
    dw_first_prefetched_min_rows: int  # but prefetched tiles only with at least this many rows


BACKWARD = BackwardParams(
    programs_per_sm=1,  # partial rows as Liger's; the prefetch keeps memory busy (INDEX.md#norm_backward_prefetch)
    looped_programs_per_sm=1,  # few programs, so the rows they re-read stay in L2
    max_block_cols=16384,  # x, dy, s and dw: four fp32 tiles
    min_tile=8192,  # norm_backward_prefetch
    elements_per_warp=1024,  # norm_backward_prefetch
    prefetch_max_cols=8192,  # prefetched 16384-column tiles spill (norm_backward_prefetch)
    acc_2d_rows=8,  # norm_backward_prefetch
    weight_per_tile_cols=16384,  # held beside x, dy and dw, it spills (INDEX.md#norm_weight_per_tile_probe)
    widest_min_cols=32769,  # 4 rows a tile took 2-3% longer at 32768 (INDEX.md#norm_looped_rows)
    widest_rows=4,  # divides the L2 reads and writes of the program's partial row (norm_looped_rows)
    widest_block_cols=4096,  # norm_looped_rows
    widest_max_warps=16,
    # Rows wider than one tile (max_block_cols): at 16384 columns the one-kernel backward holds a row
    # in one tile and wins (RMSNorm 505 against 619 us, FusedAddRMSNorm 674 against 735); from 20480
    # on the strips win (RMSNorm 781 against 1171 us there, 1246 against 1481 at 32768; FusedAdd 943
    # against 1297, 1510 against 1689). INDEX.md#rms_norm_strips
    strips_min_cols=16385,
    strips_min_cols_residual=16385,
    # The rows the prefetch does not take (their tile is 16384 columns): at 16384, 462 against 515 us
    # (every n-th tile, 1024 elements a warp); FusedAddRMSNorm gained nothing (INDEX.md#norm_contiguous_tiles).
    contiguous_min_cols=8193,
    contiguous_elements_per_warp=2048,
    # The order of work in the one-tile backward (INDEX.md#norm_backward_order). FusedAddRMSNorm's
    # dres in flight beside x and dy, and dw added before dx (as Liger's backward, so dy dies
    # sooner): at 16384 columns 502 against 690 us, except that prefetched tiles of one row
    # (4097-8192 columns, next tile's x and dy held) were 4-8% slower with dw first. Early dres
    # cost 1.5% at 1024 columns and 6% in the frozen backward at 8192 (taken with dw only).
    # RMSNorm's own gained 7% at 12288 and lost 3-5% at 4096 and 16384: not taken.
    early_dres_min_cols=2048,
    dw_first_min_cols=1 << 30,
    dw_first_min_cols_residual=1,
    dw_first_prefetched_min_rows=2,
)

# Rows up to 4096 columns: 2-4 programs an SM, tiles of 4096 elements (4 warps for four rows of
# 1024, 8 for wider rows), 0.87-0.97x the time of BACKWARD's own fields (one program an SM, 8192
# elements) at 1024-4096 columns, RMSNorm and FusedAddRMSNorm alike (INDEX.md#norm_narrow_trainable).
BACKWARD_NARROW = (
    NarrowBackwardParams(max_cols=1024, programs_per_sm=3, min_tile=4096, elements_per_warp=1024),
    NarrowBackwardParams(max_cols=4096, programs_per_sm=2, min_tile=4096, elements_per_warp=512),
)


# The two-pass backward of fk.norms.norm_strips (from BACKWARD.strips_min_cols on), RMSNorm's
# and FusedAddRMSNorm's: the best of 108 settings at 8192-32768 columns (INDEX.md#rms_norm_strips).
# Narrow strips and many programs for RMSNorm; FusedAddRMSNorm also reads dres, and wide strips on
# few programs were 1-3% faster there (the narrow ones are not in its best 12).
STRIPS = StripParams(
    dot_rows=1, dot_block_cols=2048, dot_num_warps=8,
    block_rows=2, block_cols=512, num_warps=4, programs_per_sm=8,
)  # fmt: skip
STRIPS_RESIDUAL = StripParams(
    dot_rows=1, dot_block_cols=2048, dot_num_warps=8,
    block_rows=2, block_cols=2048, num_warps=4, programs_per_sm=2,
)  # fmt: skip


class FrozenBackwardParams(NamedTuple):
    """The backward without a weight gradient: no partial rows, so many programs and no prefetch
    (prefetching was slower at every width, INDEX.md#norm_backward_prefetch)."""

    programs_per_sm: int  # for rows narrower than wide_cols
    wide_cols: int  # one-tile rows at least this wide take wide_programs_per_sm
    wide_programs_per_sm: int
    looped_programs_per_sm: int  # for rows wider than max_block_cols
    max_block_cols: int  # the widest row held in one tile; wider rows loop over column tiles this wide
    min_tile: int  # narrow rows are grouped into tiles of at least this many elements,
    narrow_cols: int  # or, rows up to this wide,
    narrow_min_tile: int  # of at least this many
    elements_per_warp: int  # one warp per this many elements of a tile
    narrow_reverse_tiles: bool  # rows up to narrow_cols wide are taken last tile first


BACKWARD_FROZEN = FrozenBackwardParams(
    programs_per_sm=32,  # against 2 to 16 (INDEX.md#rms_norm_frozen_programs, #norm_frozen_narrow_tune)
    wide_cols=16384,  # from here on 2 per SM stays best (rms_norm_frozen_programs)
    wide_programs_per_sm=2,
    looped_programs_per_sm=1,  # as BACKWARD's
    max_block_cols=16384,  # no setting beat one row in 16384-column tiles (INDEX.md#norm_looped_rows)
    min_tile=4096,
    narrow_cols=1024,
    narrow_min_tile=2048,  # INDEX.md#norm_frozen_narrow_tune
    elements_per_warp=512,
    # The rows the forward wrote last may still be in L2: 2-4% less time at H=1024, none at 2048 and
    # 4096, and at 8192 up to 37% more (INDEX.md#norm_reverse_tiles).
    narrow_reverse_tiles=True,
)


@functools.lru_cache(maxsize=256)
def _fwd_tiling(n_cols: int, has_residual: bool = False) -> RowTiling:
    return forward_tiling(n_cols, FORWARD_RESIDUAL if has_residual else FORWARD)


def _contiguous(n_cols: int, compute_dw: bool, residual: bool) -> bool:
    """Whether RMSNorm's backward (with a weight gradient, no residual) gives each program a block of
    consecutive row tiles (BACKWARD.contiguous_*) for rows this wide held in one tile."""
    return compute_dw and not residual and BACKWARD.contiguous_min_cols <= n_cols <= BACKWARD.max_block_cols


def _dw_first(n_cols: int, residual: bool, prefetch: bool, rows_per_tile: int) -> bool:
    """Whether the one-tile backward adds a tile's dw before computing its dx (BACKWARD.dw_first_*)."""
    min_cols = BACKWARD.dw_first_min_cols_residual if residual else BACKWARD.dw_first_min_cols
    return n_cols >= min_cols and not (prefetch and rows_per_tile < BACKWARD.dw_first_prefetched_min_rows)


@functools.lru_cache(maxsize=256)
def _bwd_tiling(n_cols: int, compute_dw: bool = True, residual: bool = False) -> RowTiling:
    if compute_dw:
        params = BACKWARD
        narrow = narrow_backward(n_cols, BACKWARD_NARROW)
        if narrow is not None:
            return row_tiling(n_cols, max_block_cols=params.max_block_cols, min_tile_elements=narrow.min_tile,
                              elements_per_warp=narrow.elements_per_warp, name="x")  # fmt: skip
        if _contiguous(n_cols, compute_dw, residual):
            return row_tiling(n_cols, max_block_cols=params.max_block_cols, min_tile_elements=params.min_tile,
                              elements_per_warp=params.contiguous_elements_per_warp, name="x")  # fmt: skip
        if n_cols >= params.widest_min_cols:
            return looped_rows_tiling(params.widest_block_cols, params.widest_rows,
                                      elements_per_warp=params.elements_per_warp,
                                      max_warps=params.widest_max_warps)  # fmt: skip
        return row_tiling(n_cols, max_block_cols=params.max_block_cols, min_tile_elements=params.min_tile,
                          elements_per_warp=params.elements_per_warp, name="x")  # fmt: skip
    frozen = BACKWARD_FROZEN
    min_tile = frozen.narrow_min_tile if n_cols <= frozen.narrow_cols else frozen.min_tile
    return row_tiling(n_cols, max_block_cols=frozen.max_block_cols, min_tile_elements=min_tile,
                      elements_per_warp=frozen.elements_per_warp, name="x")  # fmt: skip


def launch_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    gemma: bool,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: returns (y with x's shape and dtype, rstd fp32 of shape x.shape[:-1]).

    With ``residual``, the row normalized is ``s = x + residual`` (rounded to x's dtype), written
    into ``residual_out``: a ``[rows, H]`` view with unit column stride, possibly ``residual``'s
    own memory (FusedAddRMSNorm).
    """
    n_cols = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    x_rows = as_rows(x)
    n_rows = x_rows.shape[0]
    if n_rows == 0:
        return y, rstd
    residual_rows = as_rows(residual) if residual is not None else x_rows
    residual_out_rows = residual_out if residual_out is not None else x_rows
    tiling = _fwd_tiling(n_cols, residual is not None)
    grid = (cdiv(n_rows, tiling.rows_per_tile),)
    _rms_norm_fwd_kernel[grid](
        x_rows, residual_rows, residual_out_rows, weight if weight is not None else x_rows, y, rstd,
        n_rows, n_cols, x_rows.stride(0), residual_rows.stride(0), residual_out_rows.stride(0), eps, offset,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, GEMMA=gemma,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    return y, rstd


def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool, in_place_backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher: returns (y with x's shape and dtype, rstd fp32 with shape x.shape[:-1]).

    ``in_place_backward`` is for the backward (see :func:`_backward`); the forward ignores it."""
    return launch_forward(x, weight, eps, offset, gemma)


def _rms_norm_fwd_fake(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool, in_place_backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def dw_partial_rows(n_rows: int, n_cols: int, device: torch.device, compute_dw: bool = True) -> int:
    """Programs of the one-kernel backward's grid, which is also the number of rows of the fp32
    partial buffer it allocates for the weight gradient (when ``compute_dw``). Rows from
    ``BACKWARD.strips_min_cols`` on take :mod:`fk.norms.norm_strips`, whose grid is its own."""
    if compute_dw:
        narrow = narrow_backward(n_cols, BACKWARD_NARROW)
        per_sm = narrow.programs_per_sm if narrow is not None else BACKWARD.programs_per_sm
        looped_per_sm = BACKWARD.looped_programs_per_sm
    else:
        frozen = BACKWARD_FROZEN
        per_sm = frozen.programs_per_sm if n_cols < frozen.wide_cols else frozen.wide_programs_per_sm
        looped_per_sm = frozen.looped_programs_per_sm
    return row_reduction_grid(n_rows, _bwd_tiling(n_cols, compute_dw), device, per_sm, looped_per_sm)


def launch_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    compute_dw: bool,
    dx: torch.Tensor,
    dres: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Launch the backward kernel, writing dx (plus ``dres`` when given) into ``dx``: x's shape, or
    a ``[rows, H]`` view with unit column stride (possibly dy's own memory). Returns the weight
    gradient in the weight's dtype, or None when it is not computed."""
    n_cols = x.shape[-1]
    compute_dw = compute_dw and weight is not None
    x_rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows = x_rows.shape[0]
    if n_rows == 0:
        return torch.zeros_like(weight) if compute_dw and weight is not None else None
    dx_rows = dx.view(n_rows, n_cols)
    if compute_dw and n_cols >= (BACKWARD.strips_min_cols_residual if dres is not None else BACKWARD.strips_min_cols):
        assert weight is not None
        dres_or_none = as_rows(dres) if dres is not None else None
        params = STRIPS_RESIDUAL if dres is not None else STRIPS
        dw, _ = launch_strips_backward(dy_rows, x_rows, weight, rstd, offset, dx_rows, dres_or_none, params)
        return dw
    dres_rows = as_rows(dres) if dres is not None else x_rows
    tiling = _bwd_tiling(n_cols, compute_dw, residual=dres is not None)
    n_programs = dw_partial_rows(n_rows, n_cols, x.device, compute_dw)
    if compute_dw:
        alloc = torch.zeros if tiling.looped else torch.empty
        partial = alloc((n_programs, n_cols), dtype=torch.float32, device=x.device)
    else:
        partial = rstd  # never read or written: COMPUTE_DW is False
    one_tile = not tiling.looped
    contiguous = one_tile and _contiguous(n_cols, compute_dw, dres is not None)
    prefetch = one_tile and compute_dw and tiling.block_cols <= BACKWARD.prefetch_max_cols and not contiguous
    acc_2d = one_tile and compute_dw and tiling.rows_per_tile >= BACKWARD.acc_2d_rows
    acc_1d = one_tile and compute_dw and not acc_2d  # dw summed over a tile's rows at once: dw or dx first
    dw_first = acc_1d and _dw_first(n_cols, dres is not None, prefetch, tiling.rows_per_tile)

    _rms_norm_bwd_kernel[(n_programs,)](
        dy_rows, x_rows, dres_rows, weight if weight is not None else x_rows, rstd, dx_rows, partial,
        n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0), dres_rows.stride(0), dx_rows.stride(0), offset,
        HAS_DRES=dres is not None, HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped,
        WEIGHT_PER_TILE=one_tile and compute_dw and tiling.block_cols >= BACKWARD.weight_per_tile_cols,
        ACC_2D=acc_2d,
        PREFETCH=prefetch,
        REVERSE_TILES=one_tile and not compute_dw and n_cols <= BACKWARD_FROZEN.narrow_cols
        and BACKWARD_FROZEN.narrow_reverse_tiles,
        CONTIGUOUS_TILES=contiguous,
        EARLY_DRES=one_tile and compute_dw and dres is not None and n_cols >= BACKWARD.early_dres_min_cols,
        DW_FIRST=dw_first,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    if not compute_dw:
        return None
    assert weight is not None
    return sum_rows(partial, weight.dtype)


def _rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward launcher: returns (dx with x's shape and dtype, dw, or an empty tensor when not computed)."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = launch_backward(dy, x, weight, rstd, offset, compute_dw, dx)
    return dx, (dw if dw is not None else x.new_empty(0))


def _rms_norm_bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if compute_dw and weight is not None:
        return dx, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return dx, x.new_empty(0)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, _eps, offset, _gemma, in_place_backward = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset
    ctx.in_place_backward = in_place_backward
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def writable_gradient(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """dy as ``[rows, H]`` rows the backward may overwrite with dx, or None where it must not: a
    dtype other than x's, overlapping or non-unit-stride memory (an expanded ``loss.sum()``
    gradient), or a backward that builds a graph (``create_graph=True``: dy may be needed again)."""
    if dy.dtype != x.dtype or dy.shape != x.shape or dy.requires_grad or torch.is_grad_enabled():
        return None
    return writable_rows(dy)


def _backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None, _drstd: Any) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if dy is None or not (need_dx or need_dw):
        return (None,) * 6
    # In place only on the eager path (run_backward is the launcher itself): under torch.compile the
    # backward is a functional custom op, which may not write over its inputs.
    dy_rows = writable_gradient(dy, x) if ctx.in_place_backward and run_backward is _rms_norm_bwd else None
    if dy_rows is not None:
        dw = launch_backward(dy, x, weight, rstd, ctx.offset, need_dw, dy_rows)
        return (dy if need_dx else None), (dw if need_dw else None), None, None, None, None
    dx, dw = run_backward(dy, x, weight, rstd, ctx.offset, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None, None


_rms_norm = define_autograd_op(
    __name__, "rms_norm",
    forward=_rms_norm_fwd, forward_fake=_rms_norm_fwd_fake,
    backward_launcher=_rms_norm_bwd, backward_fake=_rms_norm_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def check_rms_norm_args(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, casting_mode: str, offset: float | None
) -> float:
    """Validate the arguments :func:`rms_norm` shares with ``fused_add_rms_norm``; returns eps as a float."""
    validate.check_tensor("x", x)
    validate.check_dtype("x", x)
    validate.check_min_ndim("x", x, 1)
    validate.check_choice("casting_mode", casting_mode, CASTING_MODES)
    eps = validate.check_positive_float("eps", eps)
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, (int, float))):
        raise TypeError(f"offset must be a float or None, got {type(offset).__name__}")
    if offset is not None and not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset}")
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight is not None:
        validate.check_tensor("weight", weight)
        validate.check_dtype("weight", weight)
        validate.check_shape("weight", weight, (x.shape[-1],))
        validate.check_same_device("weight", weight, "x", x)
    return eps


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    casting_mode: str = "llama",
    offset: float | None = None,
    in_place_backward: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.

    Args:
        x: input of shape ``(..., H)``, fp32/fp16/bf16, any strides.
        weight: ``(H,)`` scale, or None for no affine transform.
        eps: added to the mean square before the square root; > 0.
        casting_mode: ``"llama"`` (round the normalized row to x's dtype before scaling) or
            ``"gemma"`` (all fp32, rounded once).
        offset: added to the weight before scaling; defaults to 1.0 for ``"gemma"`` (its weights
            are stored zero-centred) and 0.0 for ``"llama"``.
        in_place_backward: write dx over the incoming gradient dy instead of a fresh buffer (one
            activation-sized buffer less per backward). Unsafe wherever dy is used again after
            this backward: sandwich norms (Gemma 2/3's post-norms, whose output is added to the
            residual, so autograd hands the *same* gradient tensor to the residual branch) and any
            caller that reads the gradient it passed to ``backward``. Off by default. Only the
            eager path writes in place; it falls back to a fresh dx where dy is not writable
            (another dtype, an expanded ``loss.sum()`` gradient, ``create_graph=True``) and under
            ``torch.compile``.

    Returns a tensor of x's shape and dtype. The weight gradient is computed only when ``weight``
    requires grad: a frozen weight costs no backward work or memory.
    """
    eps = check_rms_norm_args(x, weight, eps, casting_mode, offset)
    if not isinstance(in_place_backward, bool):
        raise TypeError(f"in_place_backward must be a bool, got {type(in_place_backward).__name__}")
    if not uses_kernel(x):
        return rms_norm_ref(x, weight, eps, casting_mode, offset)
    offset = _default_offset(casting_mode, offset)
    y, _ = _rms_norm(x, weight, eps, offset, casting_mode == "gemma", in_place_backward)
    return y


class _RMSNormAndInput(torch.autograd.Function):
    """Eager autograd for :func:`rms_norm_and_input`: outputs ``(y, x, rstd)``, the second being
    ``x`` itself (autograd hands it on as a view of ``x`` whose gradient comes back here).

    Backward, with dy and dx_on the gradients of y and of the returned x:
        dx = rms_norm's dx(dy) + dx_on      (HAS_DRES: added inside the backward kernel)
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool) -> Any:
        y, rstd = launch_forward(x, weight, eps, offset, gemma)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)
        return y, x, rstd

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, dx_on: torch.Tensor | None, _drstd: Any) -> Any:
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if dy is None or not (need_dx or need_dw):  # y unused: x's gradient is the one handed on
            return (dx_on if need_dx else None), None, None, None, None
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dw = launch_backward(dy, x, weight, rstd, ctx.offset, need_dw, dx, dres=dx_on)
        return (dx if need_dx else None), (dw if need_dw else None), None, None, None


def rms_norm_and_input(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    casting_mode: str = "llama",
    offset: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x, weight, eps), x)``, for a residual stream that is normalized and also carried
    on, as at the input of every pre-norm decoder layer::

        y, residual = rms_norm_and_input(hidden_states, weight, eps)   # residual is hidden_states
        ...                                                            # y -> attention
        y2, residual = fused_add_rms_norm(attn_out, residual, ...)

    The second output holds ``x``'s values without a copy (a view of ``x``). What it changes is
    the backward: the gradient that reaches it is added to the norm's input gradient inside the
    RMSNorm backward kernel, so ``x``'s two gradients cost no separate add (autograd would
    otherwise add them in one more activation-sized pass).

    Arguments are as in :func:`rms_norm`. Do not modify the returned ``x`` in place: it is a view
    made by a custom autograd function, which PyTorch refuses to let you modify. Under
    ``torch.compile`` this is ``(rms_norm(x, ...), x)`` (the compiler fuses the add itself).
    """
    eps = check_rms_norm_args(x, weight, eps, casting_mode, offset)
    if not uses_kernel(x):
        return rms_norm_ref(x, weight, eps, casting_mode, offset), x
    if torch.compiler.is_compiling():
        return rms_norm(x, weight, eps, casting_mode=casting_mode, offset=offset), x
    y, x_on, _ = _RMSNormAndInput.apply(x, weight, eps, _default_offset(casting_mode, offset), casting_mode == "gemma")
    return y, x_on


# --- 5. Module ------------------------------------------------------------------------------------


def module_eps(norm: torch.nn.RMSNorm, x: torch.Tensor) -> float:
    """The eps a ``torch.nn.RMSNorm``-style module applies to ``x`` (None means
    ``torch.finfo(x.dtype).eps``, as in PyTorch), once ``x`` is checked to end with the module's
    ``normalized_shape``. Shared by :class:`RMSNorm` and ``FusedAddRMSNorm``."""
    shape = tuple(norm.normalized_shape)
    if tuple(x.shape[x.ndim - len(shape) :]) != shape:
        raise ValueError(f"x must end with the dimensions {shape}, got shape {tuple(x.shape)}")
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in for ``torch.nn.RMSNorm`` (same constructor and state_dict) running fk's kernels.

    Extra keyword arguments ``casting_mode``, ``offset`` and ``in_place_backward`` are as in
    :func:`rms_norm`. As in
    PyTorch, ``eps=None`` means ``torch.finfo(x.dtype).eps``; a multi-dimensional
    ``normalized_shape`` normalizes over all of its trailing dimensions.
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        casting_mode: str = "llama",
        offset: float | None = None,
        in_place_backward: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.casting_mode = validate.check_choice("casting_mode", casting_mode, CASTING_MODES)
        self.offset = offset
        self.in_place_backward = in_place_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        eps = module_eps(self, x)
        weight = self.weight
        if len(shape) != 1:
            x_flat = x.reshape(*x.shape[: x.ndim - len(shape)], -1)
            w_flat = weight.reshape(-1) if weight is not None else None
            y = rms_norm(x_flat, w_flat, eps, casting_mode=self.casting_mode, offset=self.offset,
                         in_place_backward=self.in_place_backward)  # fmt: skip
            return y.reshape(x.shape)
        return rms_norm(
            x, weight, eps, casting_mode=self.casting_mode, offset=self.offset, in_place_backward=self.in_place_backward
        )

    def extra_repr(self) -> str:
        extra = ", in_place_backward=True" if self.in_place_backward else ""
        return f"{super().extra_repr()}, casting_mode={self.casting_mode!r}{extra}"
