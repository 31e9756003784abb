"""GroupNorm: the channels of an ``(N, C, *)`` input split into groups, each group normalized.

As ``torch.nn.functional.group_norm``: for each sample and group of ``C / num_groups`` channels,
``y = (x - mean) / sqrt(var + eps) * weight[c] + bias[c]`` with the mean and (biased) variance taken
over the group's channels and all spatial positions, in fp32; the per-channel affine transform is
in fp32 and the result is rounded once to the dtype of ``x``. ``weight`` and ``bias`` are each
optional; their gradients have their own dtypes.

This file holds, in order: the reference, the Triton kernels, the launchers registered as custom
ops, the functional API :func:`group_norm` and the module :class:`GroupNorm`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, multiprocessor_count, next_power_of_2
from fk.core.ops import define_autograd_op
from fk.core.reduce import sum_weight_and_bias_rows

# --- 1. Reference ---------------------------------------------------------------------------------


def group_norm_ref(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Plain PyTorch GroupNorm (computes in fp32, or fp64 for fp64 input).

    This is the definition the kernels are tested against; it equals
    ``torch.nn.functional.group_norm(x, num_groups, weight, bias, eps)``.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    n, c = x.shape[0], x.shape[1]
    xg = x.to(compute).reshape(n, num_groups, -1)
    centered = xg - xg.mean(-1, keepdim=True)
    y = (centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    channel_shape = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * weight.to(compute).reshape(channel_shape)
    if bias is not None:
        y = y + bias.to(compute).reshape(channel_shape)
    return y.to(x.dtype)


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Layout: x as a contiguous [N, C, S] array (S = product of the spatial sizes). Group (n, g) is the
# contiguous run of L = Cg * S elements (Cg = C / G channels) starting at (n * C + g * Cg) * S, seen
# as a [Cg, S] matrix. One program per group walks it in [BLOCK_C, BLOCK_S] tiles.
#
# Notation, per group: mu = mean(x), r = 1 / sqrt(mean((x - mu)^2) + eps) (both saved, fp32),
# xhat = (x - mu) * r, y[c, s] = xhat[c, s] * w[c] + b[c].
#
# Backward, with g[c, s] = dy[c, s] * w[c] (LayerNorm's derivation over the L elements of a group):
#   dx   = r * (g - mean(g) - xhat * mean(g * xhat))
#   dw_c = sum over n and s of dy[c, s] * xhat[c, s]
#   db_c = sum over n and s of dy[c, s]
# Each program writes its group's per-channel sums into row n of [N, C] fp32 partial buffers (every
# (n, c) belongs to exactly one program: no atomics), reduced over N at the end. A parameter that
# needs no gradient gets neither the arithmetic (COMPUTE_DW / COMPUTE_DB are constexpr) nor a buffer.
#
# The forward takes the mean in one pass and the variance around it in a second (no E[x^2] - E[x]^2
# cancellation), then writes y in a third; groups that fit in one tile re-read it from cache.
#
# Rows: with no spatial extent (S = 1: an (N, C) input, as in a language model, where a group is Cg
# contiguous channels of a token), one program per group would hold Cg elements, a few dozen. So
# for groups of at most ROWS_MAX_GROUP channels the rows kernels take [ROWS, Cg] tiles (ROWS
# samples of one group), the statistics being row sums in registers. The forward takes one tile
# per program and saves no statistics: the backward, which loads the same whole groups, recomputes
# them in the one reduction that also gives its own two row sums, so the rows path keeps no [N, G]
# fp32 mean and rstd alive between forward and backward (4 MiB at N=16384, G=32). The backward takes several
# tiles one after another (ROWS_PER_PROGRAM samples, or more for wide C: ROWS_PARTIAL_BYTES) and
# adds dy * xhat and dy into [ROWS, Cg] fp32 accumulators, summed over their rows once, after the
# loop, into one partial row per program, which the launcher sums: N / 512 partial rows where the
# general backward writes one per sample. (Summing each tile over its rows inside the loop, a
# cross-thread reduction per tile, made the backward 3 to 6x slower for groups of 128 to 1024
# channels on an H200.)


@triton.jit
def _group_norm_fwd_kernel(
    x_ptr,  # [N, C, S] input, contiguous
    w_ptr,  # [C] weight (unused when HAS_WEIGHT is False)
    b_ptr,  # [C] bias (unused when HAS_BIAS is False)
    y_ptr,  # [N, C, S] output, contiguous
    mean_ptr,  # [N * G] fp32 output: mean of each group
    rstd_ptr,  # [N * G] fp32 output: 1 / sqrt(var + eps) of each group
    n_groups,
    n_group_channels,  # Cg
    n_spatial,  # S
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    group_len = n_group_channels * n_spatial
    base = pid.to(tl.int64) * group_len
    first_channel = (pid % n_groups) * n_group_channels
    cs = tl.arange(0, BLOCK_C)
    ss = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    for c0 in range(0, n_group_channels, BLOCK_C):
        for s0 in range(0, n_spatial, BLOCK_S):
            c, s = c0 + cs, s0 + ss
            mask = (c < n_group_channels)[:, None] & (s < n_spatial)[None, :]
            offs = base + c[:, None] * n_spatial + s[None, :]
            acc += tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(tl.sum(acc, axis=1), axis=0) / group_len
    acc = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    for c0 in range(0, n_group_channels, BLOCK_C):
        for s0 in range(0, n_spatial, BLOCK_S):
            c, s = c0 + cs, s0 + ss
            mask = (c < n_group_channels)[:, None] & (s < n_spatial)[None, :]
            offs = base + c[:, None] * n_spatial + s[None, :]
            d = tl.where(mask, tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
            acc += d * d
    rstd = tl.rsqrt(tl.sum(tl.sum(acc, axis=1), axis=0) / group_len + eps)
    tl.store(mean_ptr + pid, mean)
    tl.store(rstd_ptr + pid, rstd)
    for c0 in range(0, n_group_channels, BLOCK_C):
        c = c0 + cs
        c_mask = c < n_group_channels
        w = tl.full([BLOCK_C], 1.0, tl.float32)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + first_channel + c, mask=c_mask, other=0.0).to(tl.float32)
        b = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + first_channel + c, mask=c_mask, other=0.0).to(tl.float32)
        for s0 in range(0, n_spatial, BLOCK_S):
            s = s0 + ss
            mask = c_mask[:, None] & (s < n_spatial)[None, :]
            offs = base + c[:, None] * n_spatial + s[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * w[:, None] + b[:, None]
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_norm_bwd_kernel(
    dy_ptr,  # [N, C, S] upstream gradient, contiguous
    x_ptr,  # [N, C, S] forward input, contiguous
    w_ptr,  # [C] weight (unused when HAS_WEIGHT is False)
    mean_ptr,  # [N * G] fp32, from the forward
    rstd_ptr,  # [N * G] fp32, from the forward
    dx_ptr,  # [N, C, S] output, contiguous (unused when COMPUTE_DX is False)
    dw_partial_ptr,  # [N, C] fp32 output: per-sample channel sums (unused when COMPUTE_DW is False)
    db_partial_ptr,  # [N, C] fp32 output (unused when COMPUTE_DB is False)
    n_groups,
    n_group_channels,
    n_spatial,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    group_len = n_group_channels * n_spatial
    base = pid.to(tl.int64) * group_len
    first_channel = (pid % n_groups) * n_group_channels
    # Row n of the [N, C] partial buffers, at this group's first channel: offset pid * Cg.
    partial_base = pid.to(tl.int64) * n_group_channels
    mean = tl.load(mean_ptr + pid)
    rstd = tl.load(rstd_ptr + pid)
    cs = tl.arange(0, BLOCK_C)
    ss = tl.arange(0, BLOCK_S)
    sum_g = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    sum_gx = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    # Pass 1: mean(g), mean(g * xhat), and the per-channel sums for dw and db.
    for c0 in range(0, n_group_channels, BLOCK_C):
        c = c0 + cs
        c_mask = c < n_group_channels
        w = tl.full([BLOCK_C], 1.0, tl.float32)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + first_channel + c, mask=c_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        for s0 in range(0, n_spatial, BLOCK_S):
            s = s0 + ss
            mask = c_mask[:, None] & (s < n_spatial)[None, :]
            offs = base + c[:, None] * n_spatial + s[None, :]
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if COMPUTE_DX or COMPUTE_DW:
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                if COMPUTE_DX:
                    g = dy * w[:, None]
                    sum_g += g
                    sum_gx += g * xhat
                if COMPUTE_DW:
                    dw_acc += dy * xhat
            if COMPUTE_DB:
                db_acc += dy
        if COMPUTE_DW:
            tl.store(dw_partial_ptr + partial_base + c, tl.sum(dw_acc, axis=1), mask=c_mask)
        if COMPUTE_DB:
            tl.store(db_partial_ptr + partial_base + c, tl.sum(db_acc, axis=1), mask=c_mask)
    if COMPUTE_DX:
        mean_g = tl.sum(tl.sum(sum_g, axis=1), axis=0) / group_len
        mean_gx = tl.sum(tl.sum(sum_gx, axis=1), axis=0) / group_len
        # Pass 2: dx.
        for c0 in range(0, n_group_channels, BLOCK_C):
            c = c0 + cs
            c_mask = c < n_group_channels
            w = tl.full([BLOCK_C], 1.0, tl.float32)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + first_channel + c, mask=c_mask, other=0.0).to(tl.float32)
            for s0 in range(0, n_spatial, BLOCK_S):
                s = s0 + ss
                mask = c_mask[:, None] & (s < n_spatial)[None, :]
                offs = base + c[:, None] * n_spatial + s[None, :]
                dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                xhat = (x - mean) * rstd
                dx = (dy * w[:, None] - mean_g - xhat * mean_gx) * rstd
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_norm_rows_fwd_kernel(
    x_ptr,  # [N, C] input, contiguous
    w_ptr,  # [C] weight (unused when HAS_WEIGHT is False)
    b_ptr,  # [C] bias (unused when HAS_BIAS is False)
    y_ptr,  # [N, C] output, contiguous
    n_rows,
    n_channels,
    n_group_channels,  # Cg
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_CG: tl.constexpr,
    ROWS: tl.constexpr,
):
    group = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_CG)
    row_mask, col_mask = rows < n_rows, cols < n_group_channels
    mask = row_mask[:, None] & col_mask[None, :]
    channels = group * n_group_channels + cols
    offs = rows.to(tl.int64)[:, None] * n_channels + channels[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_group_channels
    d = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, axis=1) / n_group_channels + eps)
    w = tl.full([BLOCK_CG], 1.0, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + channels, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.zeros([BLOCK_CG], dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + channels, mask=col_mask, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_4(a0, a1, a2, a3, b0, b1, b2, b3):
    """Four sums in one ``tl.reduce``."""
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _group_norm_rows_bwd_kernel(
    dy_ptr,  # [N, C] upstream gradient, contiguous
    x_ptr,  # [N, C] forward input, contiguous
    w_ptr,  # [C] weight (unused when HAS_WEIGHT is False)
    dx_ptr,  # [N, C] output, contiguous (unused when COMPUTE_DX is False)
    dw_partial_ptr,  # [programs along N, C] fp32: this program's sum of dy * xhat, per channel
    db_partial_ptr,  # [programs along N, C] fp32: this program's sum of dy, per channel
    n_rows,
    n_channels,
    n_group_channels,
    eps,
    tiles_per_program,  # [ROWS, Cg] tiles per program, one after another
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_CG: tl.constexpr,
    ROWS: tl.constexpr,
):
    block, group = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK_CG)
    col_mask = cols < n_group_channels
    channels = group * n_group_channels + cols
    w = tl.full([BLOCK_CG], 1.0, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + channels, mask=col_mask, other=0.0).to(tl.float32)
    dw_sum = tl.zeros([ROWS, BLOCK_CG], dtype=tl.float32)  # summed over rows once, after the loop
    db_sum = tl.zeros([ROWS, BLOCK_CG], dtype=tl.float32)
    for tile in range(tiles_per_program):
        rows = (block * tiles_per_program + tile) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_channels + channels[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # The forward's statistics, recomputed from the tile (it holds whole groups), and the two
        # row sums dx needs, in one reduction: sums of xs, xs^2, g and g * xs over each row, with
        # xs = x - k and k one of the row's own values (so E[xs^2] - E[xs]^2 loses no digits to a
        # mean far from zero). Then mean = k + E[xs], mean(g * xhat) = r (E[g xs] - E[xs] E[g]).
        k = tl.load(x_ptr + rows.to(tl.int64) * n_channels + group * n_group_channels, mask=row_mask, other=0.0)
        xs = tl.where(mask, x - k.to(tl.float32)[:, None], 0.0)
        g = dy * w[None, :]
        sum_xs, sum_xs2, sum_g, sum_gxs = tl.reduce((xs, xs * xs, g, g * xs), 1, _add_4)
        mean_xs = sum_xs / n_group_channels
        rstd = tl.rsqrt(tl.maximum(sum_xs2 / n_group_channels - mean_xs * mean_xs, 0.0) + eps)
        xhat = tl.where(mask, (xs - mean_xs[:, None]) * rstd[:, None], 0.0)
        if COMPUTE_DX:
            mean_g = sum_g / n_group_channels
            mean_gx = rstd * (sum_gxs / n_group_channels - mean_xs * mean_g)
            dx = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_sum += dy * xhat
        if COMPUTE_DB:
            db_sum += dy
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + block * n_channels + channels, tl.sum(dw_sum, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(db_partial_ptr + block * n_channels + channels, tl.sum(db_sum, axis=0), mask=col_mask)


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

# Launch parameters: untuned first choices.
TILE_ELEMENTS = 4096  # elements of one [BLOCK_C, BLOCK_S] tile
ELEMENTS_PER_WARP = 256
MAX_WARPS = 16


def _tile(n_group_channels: int, n_spatial: int) -> tuple[int, int, int]:
    """(BLOCK_C, BLOCK_S, num_warps) for groups of ``n_group_channels`` channels of ``n_spatial``."""
    block_s = min(next_power_of_2(n_spatial), TILE_ELEMENTS)
    block_c = min(next_power_of_2(n_group_channels), max(1, TILE_ELEMENTS // block_s))
    num_warps = max(1, min(MAX_WARPS, block_c * block_s // ELEMENTS_PER_WARP))
    return block_c, block_s, num_warps


PARTIAL_BYTES = 64 << 20  # bound on each fp32 partial-sum buffer of the backward
# The rows kernels (no spatial extent): groups of at most ROWS_MAX_GROUP channels, tiles of about
# ROWS_TILE_ELEMENTS elements (ROWS_PARTIALS_TILE_ELEMENTS in a backward that sums dw or db),
# ROWS_ELEMENTS_PER_WARP elements a warp. From benchmarks/experiments/INDEX.md#group_norm_rows_tune
# on an H200 (16384 samples, 32 groups, bf16, forward+backward GPU time), against 4096-element
# tiles and 256 elements a warp
# everywhere: frozen H=16384 0.917 -> 0.774 ms and H=32768 1.69 -> 1.51 ms (69% -> 82% and 75% ->
# 85% of copy), H=4096 and 8192 within 2%; trainable, with 2048-element tiles in the forward too,
# H=4096 0.243 -> 0.214, 8192 0.456 -> 0.404, 16384 1.01 -> 0.825, 32768 1.85 -> 1.54 ms.
ROWS_MAX_GROUP = 8192
ROWS_TILE_ELEMENTS = 4096
ROWS_PARTIALS_TILE_ELEMENTS = 2048
ROWS_ELEMENTS_PER_WARP = 512
ROWS_PER_PROGRAM = 512  # the backward's samples per program: its dw/db partials have cdiv(N, 512) rows
# ... or more samples per program, so that the dw and db partial rows take at most this many bytes
# together: at C = 16384 and 32768 (16384 samples) 512 samples a program kept 4 and 8 MiB of them,
# 2 and 6 MiB over Liger's peak. With the cap, C = 32768 leaves 8 programs per group, which need
# tiles of at least ROWS_PARTIALS_MIN_ROWS samples to keep memory busy: on an H200
# (benchmarks/experiments/INDEX.md#group_norm_partial_cap_probe; trainable
# forward+backward GPU time) 2.41 ms with tiles of 2 samples, 1.81 ms with 4, and 1.72 ms without
# the cap (at 2056 MB against 2050).
ROWS_PARTIAL_BYTES = 2 << 20
ROWS_PARTIALS_MIN_ROWS = 4


def _takes_rows(n_group_channels: int, n_spatial: int) -> bool:
    """Whether the rows kernels handle groups of this shape (see the kernels' comment)."""
    return n_spatial == 1 and next_power_of_2(n_group_channels) <= ROWS_MAX_GROUP


def _rows_tile(n_group_channels: int, partials: bool = False) -> tuple[int, int, int]:
    """(BLOCK_CG, ROWS, num_warps) of the rows kernels (``partials``: a backward that sums dw or db)."""
    block = next_power_of_2(n_group_channels)
    if partials:
        rows = max(ROWS_PARTIALS_MIN_ROWS, ROWS_PARTIALS_TILE_ELEMENTS // block)
    else:
        rows = max(1, ROWS_TILE_ELEMENTS // block)
    return block, rows, max(1, min(MAX_WARPS, block * rows // ROWS_ELEMENTS_PER_WARP))


def samples_per_launch(n_channels: int) -> int:
    """Samples per backward launch: each launch writes one fp32 partial row of ``n_channels`` per
    sample, and those rows stay within :data:`PARTIAL_BYTES`."""
    return max(1, PARTIAL_BYTES // (4 * n_channels))


def _as_ncs(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous ``[N, C, S]`` array (a copy only when ``t`` is not contiguous)."""
    return t.reshape(t.shape[0], t.shape[1], -1).contiguous()


def _group_norm_fwd(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward launcher: returns (y with x's shape and dtype, mean, rstd): fp32 of shape (N, G), or
    empty where the rows kernels take the groups (their backward recomputes them)."""
    n, c = x.shape[0], x.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean, rstd = _stats_buffers(x, num_groups)
    if x.numel() == 0:
        return y, mean, rstd
    x3 = _as_ncs(x)
    if _takes_rows(c // num_groups, x3.shape[2]):
        block_cg, rows, num_warps = _rows_tile(c // num_groups)
        _group_norm_rows_fwd_kernel[(cdiv(n, rows), num_groups)](
            x3, weight if weight is not None else x3, bias if bias is not None else x3, y,
            n, c, c // num_groups, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_CG=block_cg, ROWS=rows,
            num_warps=num_warps,
        )  # fmt: skip
        return y, mean, rstd
    block_c, block_s, num_warps = _tile(c // num_groups, x3.shape[2])
    _group_norm_fwd_kernel[(n * num_groups,)](
        x3, weight if weight is not None else x3, bias if bias is not None else x3, y, mean, rstd,
        num_groups, c // num_groups, x3.shape[2], eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_C=block_c, BLOCK_S=block_s,
        num_warps=num_warps,
    )  # fmt: skip
    return y, mean, rstd


def _stats_buffers(x: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's mean and rstd outputs: (N, G) fp32, or empty for the rows kernels."""
    spatial = math.prod(x.shape[2:])
    shape = (0,) if _takes_rows(x.shape[1] // num_groups, spatial) else (x.shape[0], num_groups)
    mean = torch.empty(shape, dtype=torch.float32, device=x.device)
    return mean, torch.empty(shape, dtype=torch.float32, device=x.device)


def _group_norm_fwd_fake(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), *_stats_buffers(x, num_groups)


def _group_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: returns (dx, dw, db); each one not computed is an empty tensor.

    ``bias`` is not read: it gives db its dtype (and says whether there is one). ``eps`` is for the
    rows kernels, which recompute the statistics (``mean`` and ``rstd`` are empty there).
    """
    n, c = x.shape[0], x.shape[1]
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if compute_dx else x.new_empty(0)
    if x.numel() == 0 or not (compute_dx or compute_dw or compute_db):
        dw = torch.zeros_like(weight) if compute_dw and weight is not None else x.new_empty(0)
        db = torch.zeros_like(bias) if compute_db and bias is not None else x.new_empty(0)
        return dx, dw, db
    x3, dy3 = _as_ncs(x), _as_ncs(dy)
    dx3 = dx.view(x3.shape) if compute_dx else x3
    if _takes_rows(c // num_groups, x3.shape[2]):
        block_cg, rows, num_warps = _rows_tile(c // num_groups, compute_dw or compute_db)
        # ROWS_PER_PROGRAM samples a program, fewer where that would leave under 4 programs an SM,
        # more where the partial rows would outgrow ROWS_PARTIAL_BYTES (wide C).
        row_tiles = cdiv(n, rows)
        spread = row_tiles * num_groups // (4 * multiprocessor_count(x.device))
        tiles = max(1, min(ROWS_PER_PROGRAM // rows, spread))
        n_partials = int(compute_dw) + int(compute_db)
        if n_partials:
            tiles = max(tiles, cdiv(row_tiles, max(1, ROWS_PARTIAL_BYTES // (n_partials * c * 4))))
        blocks = cdiv(row_tiles, tiles)
        # dw's and db's partial rows in one buffer (one sum_rows launch for both).
        partials = torch.empty((n_partials, blocks, c), dtype=torch.float32, device=x.device) if n_partials else rstd
        dw_partial = partials[0] if compute_dw else rstd
        db_partial = partials[n_partials - 1] if compute_db else rstd
        _group_norm_rows_bwd_kernel[(blocks, num_groups)](
            dy3, x3, weight if weight is not None else x3, dx3, dw_partial, db_partial,
            n, c, c // num_groups, eps, tiles,
            HAS_WEIGHT=weight is not None, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_CG=block_cg, ROWS=rows, num_warps=num_warps,
        )  # fmt: skip
        dw_sum, db_sum = sum_weight_and_bias_rows(
            partials, weight if compute_dw else None, bias if compute_db else None
        )
        return (
            dx,
            (dw_sum if dw_sum is not None else x.new_empty(0)),
            (db_sum if db_sum is not None else x.new_empty(0)),
        )
    mean2, rstd2 = mean.view(n, num_groups), rstd.view(n, num_groups)
    # The partial buffers hold one row per sample of a launch; launches of at most
    # samples_per_launch(c) samples keep them bounded, each launch's rows summed into fp32 totals.
    # A buffer that is not needed is never read or written: its COMPUTE_* flag is False.
    batch = min(n, samples_per_launch(c))
    dw_partial = torch.empty((batch, c), dtype=torch.float32, device=x.device) if compute_dw else rstd
    db_partial = torch.empty((batch, c), dtype=torch.float32, device=x.device) if compute_db else rstd
    dw_total = torch.zeros(c, dtype=torch.float32, device=x.device) if compute_dw else None
    db_total = torch.zeros(c, dtype=torch.float32, device=x.device) if compute_db else None
    block_c, block_s, num_warps = _tile(c // num_groups, x3.shape[2])
    for start in range(0, n, batch):
        end = min(start + batch, n)
        _group_norm_bwd_kernel[((end - start) * num_groups,)](
            dy3[start:end], x3[start:end], weight if weight is not None else x3,
            mean2[start:end], rstd2[start:end], dx3[start:end], dw_partial, db_partial,
            num_groups, c // num_groups, x3.shape[2],
            HAS_WEIGHT=weight is not None, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_C=block_c, BLOCK_S=block_s, num_warps=num_warps,
        )  # fmt: skip
        if dw_total is not None:
            dw_total += dw_partial[: end - start].sum(0)
        if db_total is not None:
            db_total += db_partial[: end - start].sum(0)
    dw = dw_total.to(weight.dtype) if dw_total is not None and weight is not None else x.new_empty(0)
    db = db_total.to(bias.dtype) if db_total is not None and bias is not None else x.new_empty(0)
    return dx, dw, db


def _group_norm_bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if compute_dx else x.new_empty(0)
    dw = torch.empty_like(weight) if compute_dw and weight is not None else x.new_empty(0)
    db = torch.empty_like(bias) if compute_db and bias is not None else x.new_empty(0)
    return dx, dw, db


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    x, num_groups, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.num_groups = num_groups
    ctx.eps = eps
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None, _dmean: Any, _drstd: Any) -> tuple[Any, ...]:
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need_dx, _, need_dw, need_db = ctx.needs_input_grad[:4]
    if dy is None or not (need_dx or need_dw or need_db):
        return None, None, None, None, None
    dx, dw, db = run_backward(dy, x, ctx.num_groups, weight, bias, mean, rstd, ctx.eps, need_dx, need_dw, need_db)
    return (dx if need_dx else None), None, (dw if need_dw else None), (db if need_db else None), None


_group_norm = define_autograd_op(
    __name__, "group_norm",
    forward=_group_norm_fwd, forward_fake=_group_norm_fwd_fake,
    backward_launcher=_group_norm_bwd, backward_fake=_group_norm_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """GroupNorm of an ``(N, C, *)`` input, as ``torch.nn.functional.group_norm``.

    Args:
        x: input of shape ``(N, C, *)``, fp32/fp16/bf16, any strides (copied to contiguous inside).
        num_groups: number of groups; must divide ``C``.
        weight: ``(C,)`` per-channel scale, or None.
        bias: ``(C,)`` per-channel shift, or None.
        eps: added to the variance before the square root; > 0.

    Returns a tensor of x's shape and dtype. The weight and bias gradients are computed only when
    they require grad: a frozen affine transform costs no backward work or memory.
    """
    validate.check_tensor("x", x)
    validate.check_dtype("x", x)
    validate.check_min_ndim("x", x, 2)
    eps = validate.check_positive_float("eps", eps)
    validate.check_int("num_groups", num_groups)
    channels = x.shape[1]
    if num_groups < 1 or channels % num_groups != 0:
        raise ValueError(f"num_groups must be >= 1 and divide the {channels} channels of x, got {num_groups}")
    if math.prod(x.shape[2:]) == 0:
        raise ValueError(f"x must have non-empty spatial dimensions, got shape {tuple(x.shape)}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            validate.check_tensor(name, param)
            validate.check_dtype(name, param)
            validate.check_shape(name, param, (channels,))
            validate.check_same_device(name, param, "x", x)
    if not uses_kernel(x):
        return group_norm_ref(x, num_groups, weight, bias, eps)
    y, _, _ = _group_norm(x, num_groups, weight, bias, eps)
    return y


# --- 5. Module ------------------------------------------------------------------------------------


class GroupNorm(torch.nn.GroupNorm):
    """Drop-in for ``torch.nn.GroupNorm`` (same constructor and state_dict) running fk's kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"x must have shape (N, {self.num_channels}, *), got {tuple(x.shape)}")
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
