"""The LoRA dropout's ``A`` gradients: ``dA_t = f_t (s G_t)^T (x * m_t)`` for projections that share ``x``.

With LoRA dropout ``p`` (mask ``m``, bool; ``f = 1 / (1 - p)``), a projection's LoRA input is
``f x * m``, so ``dA = f (s G)^T (x * m)``: ``s G = s dy B`` ``[M, r]`` is rank-sized, ``x * m`` is as
large as ``x`` ``[M, K]``. With torch ops that is a masked copy of ``x`` written and read again by a
matmul, once per projection: for q, k and v, three reads of ``x`` and of their masks, three
``[M, K]`` buffers written and read. This kernel reads ``x`` once for all the projections given and
each mask once, forms ``x * m_t`` in registers (exact: the mask's zeros and ones change no value),
and adds ``(s G_t)^T (x * m_t)`` with ``tl.dot`` into fp32 accumulators; nothing ``[M, K]``-sized is
written.

Math, per projection ``t`` with rank ``r_t`` (the ``s G_t`` stacked side by side into ``[M, R]``,
``R = sum r_t``; ``t`` owns the stack's columns ``[start_t, start_t + r_t)``):
``dA[k, j] = f_t sum_i sG[i, k] x[i, j] m_t[i, j]`` for ``k`` in ``t``'s columns. A program owns a
strip of columns and every P-th tile of rows (P row groups) and writes one fp32 partial
``[R, strip]`` block; :func:`fk.core.reduce.sum_rows` adds the P blocks and rounds once to the
gradient's dtype. For each projection the dot runs over the whole stack with the other
projections' columns of ``s G`` zeroed: ``T`` dots of ``R`` rows where ``T`` of ``r_t`` rows
would do, which the tensor cores absorb (the pass is bound by the reads of ``x`` and the masks).
There is no backward: this runs inside fk.lora's backward.

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
from fk.core.launch import as_rows, column_strip_grid, next_power_of_2
from fk.core.matmul import scaled_mm
from fk.core.reduce import sum_rows
from fk.core.tiles import dot_16bit
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
def _masked_a_grads_kernel(
    x_ptr,  # [M, K] in c (16-bit)
    gs_ptr,  # [M, R] the projections' s G side by side, in c
    mask_ptrs,  # a tuple: each projection's [M, K] bool mask
    mask_row_strides,  # a tuple, one per mask
    rank_starts,  # a tuple: the first column of each projection's s G in the stack
    rank_ends,  # a tuple: one past its last
    factors,  # a tuple: each projection's f
    partials_ptr,  # [P, R, K] fp32 out, contiguous: one partial block per row group
    n_rows,
    n_cols,
    n_ranks,
    x_row_stride,
    gs_row_stride,
    N_TERMS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    group, groups = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    ks = tl.arange(0, BLOCK_RANK)  # the stack's columns, padded to BLOCK_RANK with zeros
    k_ok = ks < n_ranks
    acc = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=ok, other=0.0)
        gs = tl.load(gs_ptr + rows[:, None] * gs_row_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        for t in tl.static_range(N_TERMS):
            keep = tl.load(mask_ptrs[t] + rows[:, None] * mask_row_strides[t] + cols[None, :], mask=ok, other=0)
            x_kept = tl.where(keep != 0, x, tl.zeros_like(x))
            own = (ks >= rank_starts[t]) & (ks < rank_ends[t])
            gs_own = tl.where(own[None, :], gs, tl.zeros_like(gs))
            acc += dot_16bit(tl.trans(gs_own), x_kept)  # fp32 sums, as torch's 16-bit matmul
    factor = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
    for t in tl.static_range(N_TERMS):
        factor = tl.where((ks >= rank_starts[t]) & (ks < rank_ends[t]), factors[t], factor)
    acc *= factor[:, None]
    out = partials_ptr + (group.to(tl.int64) * n_ranks + ks[:, None]) * n_cols + cols[None, :]
    tl.store(out, acc, mask=k_ok[:, None] & col_ok[None, :])


class LaunchParams(NamedTuple):
    block_rows: int  # rows of x per step: one tl.dot's reduction depth
    block_cols: int  # columns of a program's strip (the accumulator is [padded R, block_cols] fp32)
    num_warps: int
    programs_per_sm: int  # row groups x strips, about this many per multiprocessor


MAX_STACKED_RANK = 128
"""The widest stack of ``s G`` one launch takes (its accumulator is that many rows); wider stacks are
split into launches, each reading ``x`` again, and a single wider rank takes the torch expression."""

# By the stack's padded rank: the fp32 accumulator (rank x block_cols) stays at 8192 elements, 32 a
# thread over 8 warps, beside an x tile and a mask tile in flight. A few programs per multiprocessor
# keep the reads of x and the masks going. Not tuned on a GPU yet.
LAUNCH = {
    64: LaunchParams(block_rows=64, block_cols=128, num_warps=8, programs_per_sm=4),
    128: LaunchParams(block_rows=64, block_cols=64, num_warps=8, programs_per_sm=4),
}


# --- 3. Launchers ---------------------------------------------------------------------------------


def _takes_kernel(x: torch.Tensor) -> bool:
    return (
        uses_kernel(x)
        and not torch.compiler.is_compiling()
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.numel() > 0
    )


def _stacks(terms: Sequence[MaskedA]) -> list[list[int]]:
    """The projections, in order, cut into launches of at most :data:`MAX_STACKED_RANK` stacked ranks."""
    stacks: list[list[int]] = []
    width = 0
    for i, term in enumerate(terms):
        rank = term.gs.shape[1]
        if not stacks or width + rank > MAX_STACKED_RANK:
            stacks.append([])
            width = 0
        stacks[-1].append(i)
        width += rank
    return stacks


def _launch(x: torch.Tensor, terms: Sequence[MaskedA]) -> list[torch.Tensor]:
    """One kernel launch (and one sum of its partials) for ``terms``, whose stacked rank fits."""
    ranks = [t.gs.shape[1] for t in terms]
    n_ranks = sum(ranks)
    n_rows, n_cols = x.shape
    params = LAUNCH[max(64, next_power_of_2(n_ranks))]
    gs = torch.cat([t.gs for t in terms], dim=1) if len(terms) > 1 else as_rows(terms[0].gs)
    masks = tuple(as_rows(t.mask) for t in terms)
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    groups, strips = column_strip_grid(
        n_rows, n_cols, params.block_rows, params.block_cols, x.device, params.programs_per_sm
    )
    partials = torch.empty((groups, n_ranks, n_cols), dtype=torch.float32, device=x.device)
    _masked_a_grads_kernel[(groups, strips)](
        x, gs, masks, tuple(m.stride(0) for m in masks), tuple(starts),
        tuple(s + r for s, r in zip(starts, ranks, strict=True)), tuple(float(t.factor) for t in terms),
        partials, n_rows, n_cols, n_ranks, x.stride(0), gs.stride(0),
        N_TERMS=len(terms), BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols,
        BLOCK_RANK=max(64, next_power_of_2(n_ranks)), num_warps=params.num_warps,
    )  # fmt: skip
    dtypes = {t.dtype for t in terms}
    one_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    stacked = sum_rows(partials.view(groups, n_ranks * n_cols), one_dtype).view(n_ranks, n_cols)
    return [stacked.narrow(0, s, r).to(t.dtype) for s, r, t in zip(starts, ranks, terms, strict=True)]


def masked_a_grads(x: torch.Tensor, terms: Sequence[MaskedA]) -> list[torch.Tensor]:
    """``[f_t (s G_t)^T (x * m_t)]``, each ``[r_t, K]`` in its ``dtype``, for the projections
    ``terms`` that share ``x`` ``[M, K]`` (``s G_t`` in ``x``'s dtype).

    For fp16/bf16 ``x`` on Triton's path (outside ``torch.compile``) one kernel a stack of
    :data:`MAX_STACKED_RANK` ranks, reading ``x`` once for all of them, its sums in fp32, each
    gradient rounded once; elsewhere (fp32 ``x``, where an IEEE fp32 dot over the stack would
    cost more than the pass it saves; a rank wider than the stack) :func:`masked_a_grads_torch`.
    """
    if not terms:
        return []
    if not _takes_kernel(x):
        return masked_a_grads_torch(x, terms)
    x = as_rows(x)
    grads: list[torch.Tensor] = [torch.empty(0)] * len(terms)
    for stack in _stacks(terms):
        if len(stack) == 1 and terms[stack[0]].gs.shape[1] > MAX_STACKED_RANK:
            (grads[stack[0]],) = masked_a_grads_torch(x, [terms[stack[0]]])
            continue
        for i, grad in zip(stack, _launch(x, [terms[i] for i in stack]), strict=True):
            grads[i] = grad
    return grads
