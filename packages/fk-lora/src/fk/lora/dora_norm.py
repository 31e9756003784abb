"""DoRA's row norm ``n = ||W + s B A||`` of a base weight ``W`` ``[N, K]`` and its LoRA factors
``A`` ``[r, K]``, ``B`` ``[N, r]``, in one read of ``W``.

PEFT forms ``W + s B A`` as a whole ``[N, K]`` matrix and takes its row norms. The torch expression
here (:func:`dora_weight_norm_torch`) forms it in fp32 a chunk of rows at a time: an fp32 copy of
the chunk, the addmm, the norm, a dozen launches and five passes over ``[N, K]`` fp32 for a gated
MLP's weight. The kernel reads each tile of ``W`` once, adds ``s B A``'s tile formed in registers
(``tl.dot`` over the rank, in fp32) and keeps the squares' row sums; nothing of ``[N, K]`` size is
written. On an H200 it takes 0.32-0.37 ms for the three 14336 x 4096 weights of a Llama-3.1-8B MLP
(about 1 TB/s of W: r fp32 FMAs an element, not tuned yet), against about 1.8 ms for the torch
expression (``benchmarks/experiments/INDEX.md#dora_profile``).

The norm is detached (DoRA's paper, section 4.3), so nothing here has a backward. Off Triton's path
(a CPU tensor without the interpreter) and under ``torch.compile``, :func:`dora_weight_norm` is the
torch expression.

This file holds, in order: the float64 reference and the torch expression, the kernel, its launch
table, the launcher.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import as_rows, cdiv, multiprocessor_count
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot

# --- 1. Reference and the torch expression --------------------------------------------------------


def dora_weight_norm_ref(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``||W + s B A||`` over each row of ``W``, in float64."""
    merged = weight.detach().double() + scaling * (lora_B.detach().double() @ lora_A.detach().double())
    return torch.linalg.vector_norm(merged, dim=1)


DORA_NORM_CHUNK_ELEMENTS = 1 << 24
"""Elements of ``W + s B A`` the torch expression forms at a time, in fp32 (64 MiB): never ``[N, K]`` whole."""


def dora_weight_norm_torch(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``||W + s B A||`` over each row of ``W`` in torch ops: fp32 ``[N]``, a chunk of
    :data:`DORA_NORM_CHUNK_ELEMENTS` rows of ``W + s B A`` formed in fp32 at a time."""
    W, A32, B32 = weight.detach(), lora_A.detach().float(), lora_B.detach().float()
    norm = torch.empty(W.shape[0], dtype=torch.float32, device=W.device)
    n_rows = max(1, DORA_NORM_CHUNK_ELEMENTS // max(1, W.shape[1]))
    for start in range(0, W.shape[0], n_rows):
        rows = slice(start, start + n_rows)
        merged = torch.addmm(W[rows].float(), B32[rows], A32, alpha=scaling)  # W + s B A, these rows
        norm[rows] = torch.linalg.vector_norm(merged, dim=1)
    return norm


# --- 2. Kernel ------------------------------------------------------------------------------------
#
# Per row i, with the columns split into S ranges (a program owns BLOCK_ROWS rows and one range):
#   m[i, j]   = W[i, j] + s sum_k B[i, k] A[k, j]     fp32 (the product as fk.core.tiles.exact_dot:
#                                                     exact products summed in fp32; r an element)
#   part[t, i] = sum_{j in range t} m[i, j]^2        one fp32 partial row per range
#   n_i       = sqrt(sum_t part[t, i])               fk.core.reduce.sum_rows, then a square root


@triton.jit
def _dora_norm_kernel(
    w_ptr,  # [N, K] W, any float dtype, unit column stride
    a_ptr,  # [r, K] A, unit column stride
    b_ptr,  # [N, r] B, unit column stride
    partials_ptr,  # [S, N] fp32 out: each range's row sums of squares
    n_rows,
    n_cols,
    rank,
    w_row_stride,
    a_row_stride,
    b_row_stride,
    cols_per_range,  # a multiple of BLOCK_COLS
    scaling,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    start = tl.program_id(1) * cols_per_range
    end = tl.minimum(start + cols_per_range, n_cols)
    squares = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for c0 in range(start, end, BLOCK_COLS):
        cols = c0 + tl.arange(0, BLOCK_COLS)
        col_ok = cols < end
        w = tl.load(w_ptr + rows[:, None] * w_row_stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        product = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        for k0 in range(0, rank, BLOCK_RANK):  # the rank, padded to BLOCK_RANK with zeros
            ks = k0 + tl.arange(0, BLOCK_RANK)
            k_ok = ks < rank
            b = tl.load(b_ptr + rows[:, None] * b_row_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            a = tl.load(a_ptr + ks[:, None].to(tl.int64) * a_row_stride + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            product += exact_dot(b, a)
        merged = w.to(tl.float32) + product * scaling
        squares += merged * merged
    tl.store(partials_ptr + tl.program_id(1) * n_rows + rows, tl.sum(squares, axis=1), mask=row_ok)


# --- 3. Launch table ------------------------------------------------------------------------------


class LaunchParams(NamedTuple):
    block_rows: int  # rows of W a program owns
    block_cols: int  # columns of a tile
    block_rank: int  # the rank step of tl.dot (its smallest)
    num_warps: int
    programs_per_sm: int  # column ranges are added until the grid has this many programs per multiprocessor


# A streaming read of W: tiles of 4096 elements over 4 warps (32 an element a thread), and enough
# programs that every multiprocessor has several reads in flight: a 1024-row k/v weight has 32 row
# blocks, so its columns are split into ranges (each writes one fp32 partial row, a few KiB).
# Programs of 16 whole rows (one launch, no partial rows) were slower on an H200
# (INDEX.md#dora_profile). Tuned on an H200 (benchmarks/tune_dora.py, INDEX.md#dora_launch): 64-row
# blocks, 8 programs a multiprocessor, within 8% of the best at every projection of
# Llama-3.1-8B (the first guess, 32 rows and 4 a multiprocessor, was 10-22% slower).
LAUNCH = LaunchParams(block_rows=64, block_cols=128, block_rank=16, num_warps=4, programs_per_sm=8)


# --- 4. Launcher ----------------------------------------------------------------------------------


def dora_weight_norm(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, dtype: torch.dtype
) -> torch.Tensor:
    """DoRA's ``n = ||W + s B A||`` over each row of ``W`` ``[N, K]``, detached: formed in fp32,
    rounded to ``dtype`` (PEFT's: the LoRA branch's input dtype) and returned in fp32 ``[N]``.

    ``A`` ``[r, K]`` and ``B`` ``[N, r]`` in any float dtype (used in fp32). On Triton's path one
    kernel reads ``W`` once; elsewhere :func:`dora_weight_norm_torch`.
    """
    W, A, B = weight.detach(), lora_A.detach(), lora_B.detach()
    if not uses_kernel(W) or torch.compiler.is_compiling() or W.numel() == 0:
        return dora_weight_norm_torch(W, A, B, scaling).to(dtype).float()
    W, A, B = as_rows(W), as_rows(A), as_rows(B)
    n_rows, n_cols = W.shape
    params = LAUNCH
    row_blocks = cdiv(n_rows, params.block_rows)
    col_tiles = cdiv(n_cols, params.block_cols)
    ranges = max(1, min(col_tiles, cdiv(multiprocessor_count(W.device) * params.programs_per_sm, row_blocks)))
    cols_per_range = cdiv(col_tiles, ranges) * params.block_cols
    ranges = cdiv(n_cols, cols_per_range)
    partials = torch.empty((ranges, n_rows), dtype=torch.float32, device=W.device)
    _dora_norm_kernel[(row_blocks, ranges)](
        W, A, B, partials, n_rows, n_cols, A.shape[0], W.stride(0), A.stride(0), B.stride(0), cols_per_range, scaling,
        BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, BLOCK_RANK=params.block_rank,
        num_warps=params.num_warps,
    )  # fmt: skip
    return sum_rows(partials, torch.float32).sqrt_().to(dtype).float()
