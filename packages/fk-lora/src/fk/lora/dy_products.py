"""A LoRA projection's two products of its output gradient, from one read of it: ``s G = s dy B``
(``[M, r]``: what ``dx``'s and ``dA``'s terms are formed from) and ``dB = s dy^T xa`` (``[N, r]``).

With torch ops they are two matmuls, each reading ``dy`` ``[M, N]`` whole, for a rank-sized result:
at Llama-3.1-8B's gate or up at 16384 tokens each read is 470 MB. This kernel reads each tile of
``dy`` once and feeds it to both products' MMAs: ``G`` needs the whole row of ``dy`` (a sum over
``N``), ``dB`` the whole column (a sum over ``M``), so one of them must go through partial sums. A
program owns ``BLOCK_ROWS`` rows and one range of columns: it keeps ``G``'s rows in an fp32
accumulator over its range (fp32 partials summed by :func:`fk.core.reduce.sum_rows` where the
columns are split into several ranges), and writes each column tile's ``dy^T xa`` for its rows as
one fp32 partial block of ``dB``, which ``sum_rows`` then adds over the row blocks. Wider row
blocks mean fewer, smaller ``dB`` partials (``M / BLOCK_ROWS`` blocks of ``[N, r]`` fp32).

Math: ``sG[i, q] = s sum_j dy[i, j] B[j, q]`` and ``dB[j, q] = s sum_i dy[i, j] xa[i, q]``, exact
products summed in fp32, rounded once (``s G`` to ``dy``'s dtype, ``dB`` to the LoRA weights').
There is no backward: this runs inside fk.lora's backward (:func:`dy_products`, which takes torch's
two matmuls where the kernel does not apply).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, dot_size, reduction_splits
from fk.core.matmul import scaled_mm
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, round_to

# --- 1. Reference ---------------------------------------------------------------------------------


def dy_products_ref(
    dy: torch.Tensor, lora_b: torch.Tensor, xa: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``s dy B``, ``s dy^T xa``) in float64: what the kernel computes (before its rounding)."""
    dy64 = dy.double()
    return scaling * (dy64 @ lora_b.double()), scaling * (dy64.t() @ xa.double())


# --- 2. Kernel ------------------------------------------------------------------------------------


@triton.jit
def _dy_products_kernel(
    dy_ptr,  # [M, N] 16-bit, contiguous
    b_ptr,  # B [N, r], unit column stride
    xa_ptr,  # [M, r], unit column stride
    g_ptr,  # s G [M, r] in dy's dtype, or [splits, M, R] fp32 partials (G_PARTIALS), contiguous
    db_ptr,  # [row blocks, N, R] fp32 partials of dB, contiguous
    scaling,
    n_rows,
    n_cols,
    rank,
    b_row_stride,
    xa_row_stride,
    g_row_stride,
    cols_per_split,  # a multiple of BLOCK_COLS
    G_PARTIALS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    row_block, split = tl.program_id(0), tl.program_id(1)
    rows = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    ranks = tl.arange(0, BLOCK_RANK)
    row_ok = rows < n_rows
    rank_ok = ranks < rank
    xa = tl.load(xa_ptr + rows[:, None] * xa_row_stride + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :],
                 other=0.0)  # fmt: skip
    g = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    first = split * cols_per_split
    for start in range(first, tl.minimum(first + cols_per_split, n_cols), BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = cols < n_cols
        dy = tl.load(dy_ptr + rows[:, None] * n_cols + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                     other=0.0)  # fmt: skip
        b = tl.load(b_ptr + cols[:, None] * b_row_stride + ranks[None, :], mask=col_ok[:, None] & rank_ok[None, :],
                    other=0.0)  # fmt: skip
        g += exact_dot(dy, b)
        db = exact_dot(tl.trans(dy), xa) * scaling  # this row block's share of dB's column tile
        db_out = db_ptr + (row_block.to(tl.int64) * n_cols + cols[:, None]) * BLOCK_RANK + ranks[None, :]
        tl.store(db_out, db, mask=col_ok[:, None])
    g = g * scaling
    ok = row_ok[:, None] & rank_ok[None, :]
    if G_PARTIALS:
        tl.store(g_ptr + (split.to(tl.int64) * n_rows + rows[:, None]) * BLOCK_RANK + ranks[None, :], g,
                 mask=row_ok[:, None])  # fmt: skip
    else:
        tl.store(g_ptr + rows[:, None] * g_row_stride + ranks[None, :], round_to(g, g_ptr.dtype.element_ty), mask=ok)


class LaunchParams(NamedTuple):
    block_rows: int  # rows a program owns: dB's partials are [n_rows / block_rows, N, R] fp32
    block_cols: int  # columns of dy a step
    num_warps: int
    programs_per_sm: int  # the columns are split into ranges until the grid has about this many programs an SM


MAX_RANK = 64
"""The widest rank the kernel takes (``G``'s accumulator is ``[BLOCK_ROWS, r]`` fp32)."""

LAUNCH = LaunchParams(block_rows=256, block_cols=128, num_warps=8, programs_per_sm=2)
"""Within 3% of the fastest of an H200 sweep at Llama-3.1-8B's gate/up output gradients of 4096 and 16384
rows and its q/O ones of 16384, r = 16 (at q/O's of 4096 rows the sweep printed only the four fastest,
27.0-27.2 us on 1 program an SM; benchmarks/experiments/INDEX.md#dy_products_tune)."""
MIN_ROWS = MIN_COLS = 4096
"""On a GPU the kernel is taken only for ``dy`` of at least this many rows and columns: below them it
lost to the two matmuls in the same sweep (``[1024, 4096]`` 1.04x, ``[4096, 1024]`` 1.03x,
``[16384, 1024]`` 1.10x at the best launch), at and above them it took 0.73-0.86x their time."""


# --- 3. Launchers ---------------------------------------------------------------------------------


def dy_products_apply(dy: torch.Tensor, lora_b: torch.Tensor, xa: torch.Tensor) -> bool:
    """Whether :func:`dy_products` takes the kernel: :func:`kernel_takes`, and on a GPU ``dy`` of
    at least :data:`MIN_ROWS` rows and :data:`MIN_COLS` columns."""
    if dy.is_cuda and (dy.shape[0] < MIN_ROWS or dy.shape[-1] < MIN_COLS):
        return False
    return kernel_takes(dy, lora_b, xa)


def kernel_takes(dy: torch.Tensor, lora_b: torch.Tensor, xa: torch.Tensor) -> bool:
    """Whether the kernel can take these operands: 2-D contiguous fp16/bf16 ``dy`` on Triton's path,
    outside ``torch.compile``, ``B`` and ``xa`` in its dtype with unit column stride and rank at
    most :data:`MAX_RANK`."""
    if not uses_kernel(dy) or torch.compiler.is_compiling() or dy.dim() != 2 or dy.numel() == 0:
        return False
    if dy.dtype not in (torch.bfloat16, torch.float16) or not dy.is_contiguous():
        return False
    return all(t.dtype == dy.dtype and t.dim() == 2 and t.stride(1) == 1 for t in (lora_b, xa)) and (
        lora_b.shape[1] <= MAX_RANK
    )


def _launch(dy: torch.Tensor, lora_b: torch.Tensor, xa: torch.Tensor, scaling: float, dtype: torch.dtype,
            params: LaunchParams) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    n_rows, n_cols = dy.shape
    rank = lora_b.shape[1]
    block_rank = dot_size(rank)
    row_blocks = cdiv(n_rows, params.block_rows)
    col_steps = cdiv(n_cols, params.block_cols)
    steps_per_split, splits = reduction_splits(row_blocks, col_steps, dy.device, params.programs_per_sm)
    if splits == 1:
        g = torch.empty((n_rows, rank), dtype=dy.dtype, device=dy.device)
    else:
        g = torch.empty((splits, n_rows, block_rank), dtype=torch.float32, device=dy.device)
    db_partials = torch.empty((row_blocks, n_cols, block_rank), dtype=torch.float32, device=dy.device)
    _dy_products_kernel[(row_blocks, splits)](
        dy, lora_b, xa, g, db_partials, float(scaling), n_rows, n_cols, rank, lora_b.stride(0), xa.stride(0),
        g.stride(-2), steps_per_split * params.block_cols, G_PARTIALS=splits > 1, BLOCK_ROWS=params.block_rows,
        BLOCK_COLS=params.block_cols, BLOCK_RANK=block_rank, num_warps=params.num_warps,
    )  # fmt: skip
    if splits > 1:
        g = _first_columns(sum_rows(g.view(splits, n_rows * block_rank), dy.dtype).view(n_rows, block_rank), rank)
    db = _first_columns(
        sum_rows(db_partials.view(row_blocks, n_cols * block_rank), dtype).view(n_cols, block_rank), rank
    )
    return g, db


def _first_columns(t: torch.Tensor, rank: int) -> torch.Tensor:
    """``t``'s first ``rank`` columns, contiguous (a copy, rank-sized, only where ``rank`` was padded)."""
    return t if t.shape[1] == rank else t[:, :rank].contiguous()


def dy_products(
    dy: torch.Tensor,
    lora_b: torch.Tensor,
    xa: torch.Tensor,
    scaling: float,
    dtype: torch.dtype,
    params: LaunchParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``s dy B`` ``[M, r]`` in ``dy``'s dtype, ``s dy^T xa`` ``[N, r]`` in ``dtype``) for ``dy``
    ``[M, N]``, ``B`` ``[N, r]`` and ``xa`` ``[M, r]`` in ``dy``'s dtype: one pass over ``dy`` where
    :func:`dy_products_apply`, else two scaled matmuls. ``params`` (for tests and probes) launches
    the kernel with them wherever :func:`kernel_takes`, whatever the size."""
    if not (kernel_takes(dy, lora_b, xa) if params is not None else dy_products_apply(dy, lora_b, xa)):
        return scaled_mm(dy, lora_b, scaling, dy.dtype), scaled_mm(dy.t(), xa, scaling, dtype)
    return _launch(dy, lora_b, xa, scaling, dtype, LAUNCH if params is None else params)
