"""#32, a kernel probed and not taken (``masked_lora_inputs_tune.py``, INDEX.md#masked_lora_inputs_tune):
the LoRA dropout's input products ``xa_t = f_t (x * m_t) A_t^T`` for projections that share ``x``.

With LoRA dropout ``p`` (mask ``m``, bool; ``f = 1 / (1 - p)``) a projection's rank-sized LoRA input
is ``xa = d(x) A^T`` ``[M, r]`` with ``d(x) = f x * m``. fk draws each mask as PEFT does
(``torch.native_dropout``, which writes ``d(x)`` beside the mask), and ``torch.mm`` then reads
``d(x)`` ``[M, K]``: for q, k and v three reads of an ``[M, K]`` tensor. This kernel reads ``x`` once
for all the projections given and each mask once (``2 + 3`` bytes an element for three bf16 terms
against ``3 x 2``), forms ``x * m_t`` in registers (exact: the mask's zeros and ones change no
value), and adds ``(x * m_t) A_t^T`` with ``tl.dot`` into fp32 accumulators; the dropped inputs are
freed as soon as they are drawn.

Math, per projection ``t``: ``xa_t[i, q] = f_t sum_j x[i, j] m_t[i, j] A_t[q, j]``, summed in fp32 and
rounded once to ``x``'s dtype (``torch.mm`` on ``d(x)`` rounds ``f x`` to 16 bits first).
A program owns ``BLOCK_ROWS`` rows and one range of ``K`` (the ranges split ``K`` where the row
blocks alone would leave SMs idle) and keeps one ``[BLOCK_ROWS, r]`` accumulator a projection (up to
:data:`TERMS_PER_LAUNCH`); with one range the results are stored directly, else as fp32 partial
sums that :func:`fk.core.reduce.sum_rows` adds and rounds once. (The backward's counterpart, taken, is :mod:`fk.lora.masked_a_grad`.)

Measured on an H200 against ``torch.mm`` on each dropped input: 50.7 against 47.5 us for q/k/v at
4096 tokens (its best launch at 39% of a copy's speed for its bytes), 106.9 against 113.9 at 16384,
and slower for two masks at both sizes: too little to keep a kernel for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, multiprocessor_count, next_power_of_2
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, round_to
from fk.lora.masked_low_rank import masked


class MaskedInput(NamedTuple):
    """One projection's share of :func:`masked_lora_inputs`."""

    lora_a: torch.Tensor
    """``A`` ``[r, K]``, in ``x``'s dtype."""
    mask: torch.Tensor
    """The dropout mask ``[M, K]``, bool."""
    factor: float
    """``f = 1 / (1 - p)``."""


# --- 1. Reference ---------------------------------------------------------------------------------


def masked_lora_inputs_ref(x: torch.Tensor, terms: Sequence[MaskedInput]) -> list[torch.Tensor]:
    """``[f_t (x * m_t) A_t^T]`` in float64: what the kernel computes (before its rounding)."""
    return [t.factor * ((x.double() * t.mask.double()) @ t.lora_a.double().t()) for t in terms]


def masked_lora_inputs_torch(x: torch.Tensor, terms: Sequence[MaskedInput]) -> list[torch.Tensor]:
    """The torch expression: per projection ``f x * m`` written, then a matmul reading it."""
    return [torch.mm(masked(x, t.mask, t.factor), t.lora_a.t()) for t in terms]


# --- 2. Kernel ------------------------------------------------------------------------------------


@triton.jit
def _add_masked_input(acc, x, a_ptr, a_row_stride, rank, mask_ptr, mask_row_stride, rows, cols, col_ok, ok,
                      BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``acc + (x * m) A^T`` over one column tile: ``acc`` ``[rows, BLOCK_RANK]`` fp32, ``x`` the tile."""
    ranks = tl.arange(0, BLOCK_RANK)
    keep = tl.load(mask_ptr + rows[:, None] * mask_row_stride + cols[None, :], mask=ok, other=0)
    a_t = tl.load(a_ptr + ranks[None, :] * a_row_stride + cols[:, None],
                  mask=(ranks < rank)[None, :] & col_ok[:, None], other=0.0)  # fmt: skip
    return acc + exact_dot(tl.where(keep != 0, x, tl.zeros_like(x)), a_t)


@triton.jit
def _store(acc, factor, out_ptr, split, n_rows, out_row_stride, rank_start, rank, rows, row_ok,
           PARTIALS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``factor * acc`` into columns ``[rank_start, rank_start + rank)`` of the output (or of this
    range's fp32 partial block ``[M, R]``)."""
    ranks = tl.arange(0, BLOCK_RANK)
    ok = row_ok[:, None] & (ranks < rank)[None, :]
    if PARTIALS:
        out = out_ptr + (split.to(tl.int64) * n_rows + rows[:, None]) * out_row_stride + rank_start + ranks[None, :]
        tl.store(out, acc * factor, mask=ok)
    else:
        out = out_ptr + rows[:, None] * out_row_stride + rank_start + ranks[None, :]
        tl.store(out, round_to(acc * factor, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _masked_lora_inputs_kernel(
    x_ptr,  # [M, K] in c (16-bit)
    a_ptrs,  # a tuple: each projection's A [r_t, K] in c, unit column stride
    a_row_strides,  # a tuple
    mask_ptrs,  # a tuple: each projection's [M, K] bool mask
    mask_row_strides,  # a tuple
    ranks,  # a tuple: r_t
    rank_starts,  # a tuple: each projection's first column in the stacked [M, R]
    factors,  # a tuple: f_t
    out_ptr,  # [M, R] in c, or [splits, M, R] fp32 partials (PARTIALS), contiguous
    n_rows,
    n_cols,
    x_row_stride,
    out_row_stride,
    cols_per_split,  # a multiple of BLOCK_COLS
    N_TERMS: tl.constexpr,  # 1 to 3: one accumulator each
    PARTIALS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    split = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    acc0 = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    first = split * cols_per_split
    for start in range(first, tl.minimum(first + cols_per_split, n_cols), BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = cols < n_cols
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=ok, other=0.0)
        acc0 = _add_masked_input(acc0, x, a_ptrs[0], a_row_strides[0], ranks[0], mask_ptrs[0], mask_row_strides[0], rows, cols, col_ok, ok, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 1:
            acc1 = _add_masked_input(acc1, x, a_ptrs[1], a_row_strides[1], ranks[1], mask_ptrs[1], mask_row_strides[1], rows, cols, col_ok, ok, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 2:
            acc2 = _add_masked_input(acc2, x, a_ptrs[2], a_row_strides[2], ranks[2], mask_ptrs[2], mask_row_strides[2], rows, cols, col_ok, ok, BLOCK_RANK)  # fmt: skip
    _store(acc0, factors[0], out_ptr, split, n_rows, out_row_stride, rank_starts[0], ranks[0], rows, row_ok, PARTIALS, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 1:
        _store(acc1, factors[1], out_ptr, split, n_rows, out_row_stride, rank_starts[1], ranks[1], rows, row_ok, PARTIALS, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 2:
        _store(acc2, factors[2], out_ptr, split, n_rows, out_row_stride, rank_starts[2], ranks[2], rows, row_ok, PARTIALS, BLOCK_RANK)  # fmt: skip


class LaunchParams(NamedTuple):
    block_rows: int  # rows a program owns (each accumulator is [block_rows, padded r] fp32)
    block_cols: int  # columns of x a step: one tl.dot's reduction depth
    num_warps: int
    num_stages: int  # the loads of x and the masks in flight
    programs_per_sm: int  # K is split into ranges until the grid has about this many programs an SM


TERMS_PER_LAUNCH = 3
"""Projections one launch takes (q, k and v): one accumulator each; more are split into launches."""
MAX_RANK = 64
"""The widest rank the kernel takes; a wider one takes the torch expression."""

# By the projections' padded rank: first guesses (the sweep: masked_lora_inputs_tune.py).
LAUNCH = {
    16: LaunchParams(block_rows=64, block_cols=128, num_warps=4, num_stages=3, programs_per_sm=2),
    32: LaunchParams(block_rows=64, block_cols=128, num_warps=4, num_stages=3, programs_per_sm=2),
    64: LaunchParams(block_rows=64, block_cols=64, num_warps=4, num_stages=3, programs_per_sm=2),
}


# --- 3. Launchers ---------------------------------------------------------------------------------


def one_pass_applies(x: torch.Tensor, lora_as: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`masked_lora_inputs` takes the kernel for ``x`` and these ``A``\\ s (given masks
    of ``x``'s shape, bool, with unit column stride, as ``torch.native_dropout`` draws them): fp16/bf16
    ``x`` with unit column stride on Triton's path, outside ``torch.compile``, ``A``\\ s in ``x``'s
    dtype with unit column stride and rank at most :data:`MAX_RANK`."""
    if not uses_kernel(x) or torch.compiler.is_compiling() or x.numel() == 0 or x.dim() != 2:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1:
        return False
    return all(a.dtype == x.dtype and a.stride(1) == 1 and a.shape[0] <= MAX_RANK for a in lora_as)


def _masks_fit(x: torch.Tensor, terms: Sequence[MaskedInput]) -> bool:
    return all(t.mask.dtype == torch.bool and t.mask.shape == x.shape and t.mask.stride(1) == 1 for t in terms)


def _launch(x: torch.Tensor, terms: Sequence[MaskedInput], params: LaunchParams | None = None) -> list[torch.Tensor]:
    """One kernel launch (and, where ``K`` is split, one sum of its partials) for up to three
    ``terms``; ``params`` other than the table's only for probes."""
    ranks = [t.lora_a.shape[0] for t in terms]
    n_ranks = sum(ranks)
    n_rows, n_cols = x.shape
    block_rank = max(16, next_power_of_2(max(ranks)))
    params = LAUNCH[block_rank] if params is None else params
    row_blocks = cdiv(n_rows, params.block_rows)
    col_steps = cdiv(n_cols, params.block_cols)
    wanted = params.programs_per_sm * multiprocessor_count(x.device)
    steps_per_split = cdiv(col_steps, min(col_steps, max(1, cdiv(wanted, row_blocks))))
    splits = cdiv(col_steps, steps_per_split)
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    shape = (n_rows, n_ranks) if splits == 1 else (splits, n_rows, n_ranks)
    out = torch.empty(shape, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    _masked_lora_inputs_kernel[(row_blocks, splits)](
        x, tuple(t.lora_a for t in terms), tuple(t.lora_a.stride(0) for t in terms), tuple(t.mask for t in terms),
        tuple(t.mask.stride(0) for t in terms), tuple(ranks), tuple(starts), tuple(float(t.factor) for t in terms),
        out, n_rows, n_cols, x.stride(0), n_ranks, steps_per_split * params.block_cols, N_TERMS=len(terms),
        PARTIALS=splits > 1, BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, BLOCK_RANK=block_rank,
        num_warps=params.num_warps, num_stages=params.num_stages,
    )  # fmt: skip
    if splits > 1:
        out = sum_rows(out.view(splits, n_rows * n_ranks), x.dtype).view(n_rows, n_ranks)
    return [out.narrow(1, start, rank) for start, rank in zip(starts, ranks, strict=True)]


def masked_lora_inputs(x: torch.Tensor, terms: Sequence[MaskedInput]) -> list[torch.Tensor]:
    """``[f_t (x * m_t) A_t^T]``, each ``[M, r_t]`` in ``x``'s dtype (column blocks of one buffer), for
    the projections ``terms`` that share ``x`` ``[M, K]``: where :func:`one_pass_applies`, one kernel for every
    three projections, reading ``x`` once for them, its sums in fp32, each result rounded once;
    elsewhere :func:`masked_lora_inputs_torch`."""
    if not terms:
        return []
    if not (one_pass_applies(x, [t.lora_a for t in terms]) and _masks_fit(x, terms)):
        return masked_lora_inputs_torch(x, terms)
    out: list[torch.Tensor] = []
    for first in range(0, len(terms), TERMS_PER_LAUNCH):
        out += _launch(x, terms[first : first + TERMS_PER_LAUNCH])
    return out
