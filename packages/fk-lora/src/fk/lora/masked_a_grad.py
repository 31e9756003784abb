"""The LoRA dropout's ``A`` gradients: ``dA_t = f_t (s G_t)^T (x * m_t)`` for projections that share ``x``.

With LoRA dropout ``p`` (mask ``m``, bool; ``f = 1 / (1 - p)``), a projection's LoRA input is
``f x * m``, so ``dA = f (s G)^T (x * m)``: ``s G = s dy B`` ``[M, r]`` is rank-sized, ``x * m`` is as
large as ``x`` ``[M, K]``. With torch ops that is a masked copy of ``x`` written and read again by a
matmul, once per projection: for q, k and v, three reads of ``x`` and of their masks, three
``[M, K]`` buffers written and read. This kernel reads ``x`` once for all the projections given and
each mask once, forms ``x * m_t`` in registers (exact: the mask's zeros and ones change no value),
and adds ``(s G_t)^T (x * m_t)`` with ``tl.dot`` into fp32 accumulators; nothing ``[M, K]``-sized is
written.

Math, per projection ``t`` with rank ``r_t``: ``dA_t[k, j] = f_t sum_i sG_t[i, k] x[i, j] m_t[i, j]``.
A program owns a strip of columns and every P-th tile of rows (P row groups), keeps one fp32
accumulator ``[r_t, strip]`` per projection (up to :data:`TERMS_PER_LAUNCH`), and writes them as
one partial block of the stacked ``[R, K]`` (``R = sum r_t``); :func:`fk.core.reduce.sum_rows`
adds the P blocks and rounds once to the gradients' dtype. There is no backward: this runs inside
fk.lora's backward.

This file holds the reference, the kernel, and :func:`masked_a_grads`, which takes the kernel for
16-bit ``x`` on Triton's path and torch ops elsewhere and under ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import as_rows, column_strip_grid, dot_size
from fk.core.matmul import scaled_mm
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot
from fk.lora.masked_low_rank import masked


class MaskedA(NamedTuple):
    """One projection's share of :func:`masked_a_grads`."""

    gs: torch.Tensor
    """``s G`` ``[M, r]``, in ``x``'s dtype."""
    mask: torch.Tensor
    """The dropout mask ``[M, K]``, bool."""
    factor: float
    """``f = 1 / (1 - p)``."""
    dtype: torch.dtype
    """``dA``'s dtype (the LoRA weights')."""


# --- 1. Reference ---------------------------------------------------------------------------------


def masked_a_grads_ref(x: torch.Tensor, terms: Sequence[MaskedA]) -> list[torch.Tensor]:
    """``[f_t (s G_t)^T (x * m_t)]`` in float64: what the kernel computes (before its rounding)."""
    return [t.factor * (t.gs.double().t() @ (x.double() * t.mask.double())) for t in terms]


def masked_a_grads_torch(x: torch.Tensor, terms: Sequence[MaskedA]) -> list[torch.Tensor]:
    """The torch expression: per projection ``x * m`` written, then one scaled matmul reading it."""
    return [scaled_mm(t.gs.t(), masked(x, t.mask, 1.0), t.factor, t.dtype) for t in terms]


# --- 2. Kernel ------------------------------------------------------------------------------------


@triton.jit
def _add_masked_product(acc, x, gs_ptr, gs_row_stride, rank, mask_ptr, mask_row_stride, rows, row_ok, cols, ok,
                        BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``acc + (s G)^T (x * m)`` over one row tile: ``acc`` ``[BLOCK_RANK, cols]`` fp32, ``x`` the tile."""
    ks = tl.arange(0, BLOCK_RANK)
    gs = tl.load(gs_ptr + rows[:, None] * gs_row_stride + ks[None, :], mask=row_ok[:, None] & (ks < rank)[None, :], other=0.0)  # fmt: skip
    keep = tl.load(mask_ptr + rows[:, None] * mask_row_stride + cols[None, :], mask=ok, other=0)
    return acc + exact_dot(tl.trans(gs), tl.where(keep != 0, x, tl.zeros_like(x)))


@triton.jit
def _store_partial(acc, factor, partials_ptr, group, rank_start, rank, n_ranks, n_cols, cols, col_ok,
                   BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``factor * acc`` into rows ``[rank_start, rank_start + rank)`` of this group's partial block."""
    ks = tl.arange(0, BLOCK_RANK)
    out = partials_ptr + (group.to(tl.int64) * n_ranks + rank_start + ks[:, None]) * n_cols + cols[None, :]
    tl.store(out, acc * factor, mask=(ks < rank)[:, None] & col_ok[None, :])


@triton.jit
def _masked_a_grads_kernel(
    x_ptr,  # [M, K] in c (16-bit)
    gs_ptrs,  # a tuple: each projection's s G [M, r_t], in c
    gs_row_strides,  # a tuple
    mask_ptrs,  # a tuple: each projection's [M, K] bool mask
    mask_row_strides,  # a tuple
    ranks,  # a tuple: r_t
    rank_starts,  # a tuple: the first row of each projection's dA in the stacked [R, K]
    factors,  # a tuple: f_t
    partials_ptr,  # [P, R, K] fp32 out, contiguous: one partial block per row group
    n_rows,
    n_cols,
    n_ranks,
    x_row_stride,
    N_TERMS: tl.constexpr,  # 1 to 3: one accumulator each
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    group, groups = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    acc0 = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=ok, other=0.0)
        acc0 = _add_masked_product(acc0, x, gs_ptrs[0], gs_row_strides[0], ranks[0], mask_ptrs[0], mask_row_strides[0], rows, row_ok, cols, ok, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 1:
            acc1 = _add_masked_product(acc1, x, gs_ptrs[1], gs_row_strides[1], ranks[1], mask_ptrs[1], mask_row_strides[1], rows, row_ok, cols, ok, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 2:
            acc2 = _add_masked_product(acc2, x, gs_ptrs[2], gs_row_strides[2], ranks[2], mask_ptrs[2], mask_row_strides[2], rows, row_ok, cols, ok, BLOCK_RANK)  # fmt: skip
    _store_partial(acc0, factors[0], partials_ptr, group, rank_starts[0], ranks[0], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 1:
        _store_partial(acc1, factors[1], partials_ptr, group, rank_starts[1], ranks[1], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 2:
        _store_partial(acc2, factors[2], partials_ptr, group, rank_starts[2], ranks[2], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip


class LaunchParams(NamedTuple):
    block_rows: int  # rows of x per step: one tl.dot's reduction depth
    block_cols: int  # columns of a program's strip (each accumulator is [padded r, block_cols] fp32)
    num_warps: int
    programs_per_sm: int  # row groups x strips, about this many per multiprocessor


TERMS_PER_LAUNCH = 3
"""Projections one launch takes (q, k and v): one accumulator each; more are split into launches."""
MAX_RANK = 64
"""The widest rank the kernel takes; a wider one takes the torch expression."""

# By the projections' padded rank: the accumulators (3 x rank x block_cols fp32) stay at 12288
# elements or fewer, beside an x tile and a mask tile in flight. A few programs per multiprocessor
# keep the reads of x and the masks going. Rank 16: the fastest of an H200 sweep of 72 launches at
# q/k/v's three terms and at one (0.128 and 0.071 ms against 0.136 and 0.084 for 32 x 256 on 4
# warps, 4 an SM; benchmarks/experiments/INDEX.md#masked_dropout_kernels); 32 and 64 are first guesses.
LAUNCH = {
    16: LaunchParams(block_rows=16, block_cols=128, num_warps=2, programs_per_sm=8),
    32: LaunchParams(block_rows=64, block_cols=128, num_warps=8, programs_per_sm=4),
    64: LaunchParams(block_rows=64, block_cols=64, num_warps=8, programs_per_sm=4),
}


# --- 3. Launchers ---------------------------------------------------------------------------------


def _takes_kernel(x: torch.Tensor) -> bool:
    return (
        uses_kernel(x)
        and not torch.compiler.is_compiling()
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.numel() > 0
    )


def _launches(terms: Sequence[MaskedA]) -> list[list[int]]:
    """The projections the kernel takes (rank up to :data:`MAX_RANK`), in order, in launches of at
    most :data:`TERMS_PER_LAUNCH`."""
    kernel = [i for i, term in enumerate(terms) if term.gs.shape[1] <= MAX_RANK]
    return [kernel[i : i + TERMS_PER_LAUNCH] for i in range(0, len(kernel), TERMS_PER_LAUNCH)]


def _launch(x: torch.Tensor, terms: Sequence[MaskedA]) -> list[torch.Tensor]:
    """One kernel launch (and one sum of its partials) for up to three ``terms``."""
    ranks = [t.gs.shape[1] for t in terms]
    n_ranks = sum(ranks)
    n_rows, n_cols = x.shape
    block_rank = dot_size(max(ranks))
    params = LAUNCH[block_rank]
    gss, masks = tuple(as_rows(t.gs) for t in terms), tuple(as_rows(t.mask) for t in terms)
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    groups, strips = column_strip_grid(
        n_rows, n_cols, params.block_rows, params.block_cols, x.device, params.programs_per_sm
    )
    partials = torch.empty((groups, n_ranks, n_cols), dtype=torch.float32, device=x.device)
    _masked_a_grads_kernel[(groups, strips)](
        x, gss, tuple(g.stride(0) for g in gss), masks, tuple(m.stride(0) for m in masks), tuple(ranks),
        tuple(starts), tuple(float(t.factor) for t in terms), partials, n_rows, n_cols, n_ranks, x.stride(0),
        N_TERMS=len(terms), BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, BLOCK_RANK=block_rank,
        num_warps=params.num_warps,
    )  # fmt: skip
    dtypes = {t.dtype for t in terms}
    one_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    stacked = sum_rows(partials.view(groups, n_ranks * n_cols), one_dtype).view(n_ranks, n_cols)
    return [stacked.narrow(0, s, r).to(t.dtype) for s, r, t in zip(starts, ranks, terms, strict=True)]


def masked_a_grads(x: torch.Tensor, terms: Sequence[MaskedA]) -> list[torch.Tensor]:
    """``[f_t (s G_t)^T (x * m_t)]``, each ``[r_t, K]`` in its ``dtype``, for the projections
    ``terms`` that share ``x`` ``[M, K]`` (``s G_t`` in ``x``'s dtype).

    For fp16/bf16 ``x`` on Triton's path (outside ``torch.compile``) one kernel for every three
    projections, reading ``x`` once for them, its sums in fp32, each gradient rounded once;
    elsewhere (fp32 ``x``, whose IEEE fp32 dots would cost more than the pass saves; a rank above
    :data:`MAX_RANK`) :func:`masked_a_grads_torch`.
    """
    if not terms:
        return []
    if not _takes_kernel(x):
        return masked_a_grads_torch(x, terms)
    x = as_rows(x)
    grads: list[torch.Tensor | None] = [None] * len(terms)
    for launch in _launches(terms):
        for i, grad in zip(launch, _launch(x, [terms[i] for i in launch]), strict=True):
            grads[i] = grad
    for i, term in enumerate(terms):
        if grads[i] is None:
            (grads[i],) = masked_a_grads_torch(x, [term])
    return grads  # type: ignore[return-value]
