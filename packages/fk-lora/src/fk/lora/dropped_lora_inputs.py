"""The LoRA dropout's forward in one pass over ``x``: each projection's mask drawn as
``torch.native_dropout`` draws it (:mod:`fk.lora.torch_dropout`), written, and its input product
``xa_t = f_t (x * m_t) A_t^T`` formed from ``x`` in registers, for projections that share ``x``.

With LoRA dropout ``p`` (``f = 1 / (1 - p)``) PEFT's projection runs ``torch.native_dropout`` on
``x`` (reading ``x``, writing the dropped input and the mask) and then ``A``'s product reads the
dropped input: for q, k and v, 3 reads of ``x``, 3 dropped inputs written and read back, 3 masks
written (11 bytes an element of ``x`` with bf16). Here one kernel reads ``x`` once, draws each
projection's mask tile with the same Philox numbers torch would (so the masks are PEFT's, bit for
bit), stores it (the backward reads it), and adds ``(x * m_t) A_t^T`` with ``tl.dot`` into an fp32
accumulator a projection: 2 + 3 bytes an element, and no dropped input exists.

Math, per projection ``t``: ``m_t`` = :func:`fk.lora.torch_dropout.keep_tile`,
``xa_t[i, q] = f_t sum_j x[i, j] m_t[i, j] A_t[q, j]``, summed in fp32 and rounded once to ``x``'s
dtype (PEFT's ``torch.mm`` on the dropped input rounds ``f x`` to 16 bits first: the two agree to
the dtype's rounding). Where PEFT drops in fp32 under autocast (an fp32 ``x`` beside 16-bit
``A``\\ s, or a 16-bit ``x`` it casts to fp32 LoRA weights' dtype first: ``dropped_in``), the masks
are fp32's (vector size 4) and ``f (x * m_t)`` is formed in fp32 and rounded to ``A``'s dtype before
the product, as autocast rounds PEFT's dropped input: ``xa_t = c(f_t (x * m_t)) A_t^T``. A program owns ``BLOCK_ROWS`` rows and one range of ``K`` (the ranges split
``K`` where the row blocks alone would leave SMs idle), keeps one ``[BLOCK_ROWS, r]`` accumulator a
projection (up to :data:`TERMS_PER_LAUNCH`); with one range the results are stored directly, else
as fp32 partial sums that :func:`fk.core.reduce.sum_rows` adds and rounds once. There is no
backward: this runs inside fk.lora's forward, whose backward reads the masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, dot_size, reduction_splits
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, round_to
from fk.lora.torch_dropout import Draw, keep_ref, keep_threshold, keep_tile


class DroppedInput(NamedTuple):
    """One projection's share of :func:`dropped_lora_inputs`."""

    lora_a: torch.Tensor
    """``A`` ``[r, K]``, in ``x``'s dtype (16-bit), or 16-bit beside an fp32 ``x``."""
    draw: Draw
    """Its ``torch.native_dropout`` call's random numbers (:func:`fk.lora.torch_dropout.reserve`)."""
    factor: float
    """``f = 1 / (1 - p)``."""


# --- 1. Reference ---------------------------------------------------------------------------------


def dropped_lora_inputs_ref(x: torch.Tensor, terms: Sequence[DroppedInput]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """(``[f_t (x * m_t) A_t^T]`` in float64, ``[m_t]``): what the kernel computes (before its rounding)."""
    masks = [keep_ref(x.numel(), t.draw, x.device).view(x.shape) for t in terms]
    xas = [t.factor * ((x.double() * m.double()) @ t.lora_a.double().t()) for t, m in zip(terms, masks, strict=True)]
    return xas, masks


# --- 2. Kernel ------------------------------------------------------------------------------------


@triton.jit
def _add_dropped_input(acc, x, a_ptr, a_row_stride, rank, mask_ptr, seed, counter, threshold, factor, threads, rows,
                       cols, first_col, groups_per_row, n_cols, col_ok, ok, SCALE_FIRST: tl.constexpr,
                       VEC: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                       BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``acc + (x * m) A^T`` over one column tile, ``m``'s tile drawn and stored; with
    ``SCALE_FIRST`` (the dropout drawn in fp32, ``A`` 16-bit) ``acc + c(f (x * m)) A^T``, ``f (x * m)``
    formed in fp32."""
    keep = keep_tile(seed, counter, threads, threshold, rows, first_col, groups_per_row, VEC, BLOCK_ROWS, BLOCK_COLS)
    tl.store(mask_ptr + rows[:, None] * n_cols + cols[None, :], keep, mask=ok)
    ranks = tl.arange(0, BLOCK_RANK)
    a_t = tl.load(a_ptr + ranks[None, :] * a_row_stride + cols[:, None],
                  mask=(ranks < rank)[None, :] & col_ok[:, None], other=0.0)  # fmt: skip
    dropped = tl.where(keep, x, tl.zeros_like(x))
    if SCALE_FIRST:  # PEFT drops x in fp32, and autocast rounds that to A's dtype for the product
        dropped = (dropped.to(tl.float32) * factor).to(a_t.dtype)
    return acc + exact_dot(dropped, a_t)


@triton.jit
def _store(acc, factor, out_ptr, split, n_rows, out_row_stride, rank_start, rank, rows, row_ok,
           SCALE_FIRST: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``factor * acc`` (``acc`` where ``SCALE_FIRST`` applied the factor already) into columns
    ``[rank_start, rank_start + rank)`` of the output (or of this range's fp32 partial block ``[M, R]``)."""
    ranks = tl.arange(0, BLOCK_RANK)
    ok = row_ok[:, None] & (ranks < rank)[None, :]
    xa = acc if SCALE_FIRST else acc * factor
    if PARTIALS:
        out = out_ptr + (split.to(tl.int64) * n_rows + rows[:, None]) * out_row_stride + rank_start + ranks[None, :]
        tl.store(out, xa, mask=ok)
    else:
        out = out_ptr + rows[:, None] * out_row_stride + rank_start + ranks[None, :]
        tl.store(out, round_to(xa, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dropped_lora_inputs_kernel(
    x_ptr,  # [M, K] in c (16-bit) or fp32, contiguous
    a_ptrs,  # a tuple: each projection's A [r_t, K] in c, unit column stride
    a_row_strides,  # a tuple
    mask_ptrs,  # a tuple: each projection's [M, K] bool mask (out), contiguous
    seeds,  # a tuple: each draw's seed
    counters,  # a tuple: each draw's counter (offset / 4)
    thresholds,  # a tuple: each draw's keep_threshold
    ranks,  # a tuple: r_t
    rank_starts,  # a tuple: each projection's first column in the stacked [M, R]
    factors,  # a tuple: f_t
    out_ptr,  # [M, R] in c, or [splits, M, R] fp32 partials (PARTIALS), contiguous
    threads,  # the draws' T (one size, one device: the same for all)
    n_rows,
    n_cols,  # a multiple of VEC
    out_row_stride,
    cols_per_split,  # a multiple of BLOCK_COLS
    N_TERMS: tl.constexpr,  # 1 to 3: one accumulator each
    SCALE_FIRST: tl.constexpr,  # dropped in fp32, the A's 16-bit (autocast): f applied before the cast to A's dtype
    VEC: tl.constexpr,
    PARTIALS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    split = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    groups_per_row = n_cols // VEC
    acc0 = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    first = split * cols_per_split
    for start in range(first, tl.minimum(first + cols_per_split, n_cols), BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = cols < n_cols
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0.0)
        acc0 = _add_dropped_input(acc0, x, a_ptrs[0], a_row_strides[0], ranks[0], mask_ptrs[0], seeds[0], counters[0], thresholds[0], factors[0], threads, rows, cols, start, groups_per_row, n_cols, col_ok, ok, SCALE_FIRST, VEC, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 1:
            acc1 = _add_dropped_input(acc1, x, a_ptrs[1], a_row_strides[1], ranks[1], mask_ptrs[1], seeds[1], counters[1], thresholds[1], factors[1], threads, rows, cols, start, groups_per_row, n_cols, col_ok, ok, SCALE_FIRST, VEC, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 2:
            acc2 = _add_dropped_input(acc2, x, a_ptrs[2], a_row_strides[2], ranks[2], mask_ptrs[2], seeds[2], counters[2], thresholds[2], factors[2], threads, rows, cols, start, groups_per_row, n_cols, col_ok, ok, SCALE_FIRST, VEC, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
    _store(acc0, factors[0], out_ptr, split, n_rows, out_row_stride, rank_starts[0], ranks[0], rows, row_ok, SCALE_FIRST, PARTIALS, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 1:
        _store(acc1, factors[1], out_ptr, split, n_rows, out_row_stride, rank_starts[1], ranks[1], rows, row_ok, SCALE_FIRST, PARTIALS, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 2:
        _store(acc2, factors[2], out_ptr, split, n_rows, out_row_stride, rank_starts[2], ranks[2], rows, row_ok, SCALE_FIRST, PARTIALS, BLOCK_RANK)  # fmt: skip


class LaunchParams(NamedTuple):
    block_rows: int  # rows a program owns (each accumulator is [block_rows, padded r] fp32)
    block_cols: int  # columns of x a step: one tl.dot's reduction depth (a multiple of 8, the widest VEC)
    num_warps: int
    programs_per_sm: int  # K is split into ranges until the grid has about this many programs an SM


TERMS_PER_LAUNCH = 3
"""Projections one launch takes (q, k and v): one accumulator each; more are split into launches."""
MAX_RANK = 64
"""The widest rank the kernel takes (its accumulators beside the Philox words)."""

# By the projections' padded rank. Rank 16: the fastest of an H200 sweep at q/k/v's three masks and
# O's one at 4096 tokens (within 0.3% of the fastest at 16384; INDEX.md#dropped_lora_inputs_tune).
# 32 and 64: the same tile on 8 warps, first guesses (on 4 their three accumulators spill: compiled
# for sm_90, 16 and 92 bytes; on 8, 144 and 189 registers and none).
LAUNCH = {
    16: LaunchParams(block_rows=64, block_cols=64, num_warps=4, programs_per_sm=4),
    32: LaunchParams(block_rows=64, block_cols=64, num_warps=8, programs_per_sm=4),
    64: LaunchParams(block_rows=64, block_cols=64, num_warps=8, programs_per_sm=4),
}


# --- 3. Launchers ---------------------------------------------------------------------------------


def dropped_inputs_apply(x: torch.Tensor, lora_as: Sequence[torch.Tensor], dropped_in: torch.dtype | None = None) -> bool:  # fmt: skip
    """Whether :func:`dropped_lora_inputs` runs for ``x`` and these ``A``\\ s, given draws of
    ``x`` from :func:`fk.lora.torch_dropout.reserve`: 2-D contiguous ``x`` on Triton's path, outside
    ``torch.compile``, ``K`` a multiple of 8 (of any draw's vector size: a draw's groups of elements
    never cross a row), ``A``\\ s with unit column stride and rank at most :data:`MAX_RANK`, all in
    one 16-bit dtype ``c`` that ``x`` has too, or ``x`` in fp32 (autocast: PEFT drops the fp32 input
    and the product casts it to ``c``); the dropout drawn in ``x``'s dtype or (``dropped_in``) in
    fp32 (PEFT drops ``x`` cast to fp32). (fp32 ``A``\\ s are not taken: IEEE fp32 dots would cost
    more than the pass saves.)"""
    if not uses_kernel(x) or torch.compiler.is_compiling() or x.dim() != 2 or x.numel() == 0 or not lora_as:
        return False
    c = lora_as[0].dtype
    if c not in (torch.bfloat16, torch.float16) or x.dtype not in (c, torch.float32):
        return False
    if dropped_in not in (None, x.dtype, torch.float32):
        return False
    if not x.is_contiguous() or x.shape[1] % 8:
        return False
    return all(a.dtype == c and a.stride(1) == 1 and a.shape[0] <= MAX_RANK for a in lora_as)


def _launch(x: torch.Tensor, terms: Sequence[DroppedInput], dropped_in: torch.dtype | None = None,
            params: LaunchParams | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """One kernel launch (and, where ``K`` is split, one sum of its partials) for up to three
    ``terms``; ``params`` other than the table's only for probes."""
    ranks = [t.lora_a.shape[0] for t in terms]
    n_ranks = sum(ranks)
    n_rows, n_cols = x.shape
    block_rank = dot_size(max(ranks))
    params = LAUNCH[block_rank] if params is None else params
    row_blocks = cdiv(n_rows, params.block_rows)
    col_steps = cdiv(n_cols, params.block_cols)
    steps_per_split, splits = reduction_splits(row_blocks, col_steps, x.device, params.programs_per_sm)
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    shape = (n_rows, n_ranks) if splits == 1 else (splits, n_rows, n_ranks)
    c = terms[0].lora_a.dtype
    out = torch.empty(shape, dtype=c if splits == 1 else torch.float32, device=x.device)
    masks = [torch.empty(x.shape, dtype=torch.bool, device=x.device) for _ in terms]
    draws = [t.draw for t in terms]
    _dropped_lora_inputs_kernel[(row_blocks, splits)](
        x, tuple(t.lora_a for t in terms), tuple(t.lora_a.stride(0) for t in terms), tuple(masks),
        tuple(d.seed for d in draws), tuple(d.counter for d in draws), tuple(keep_threshold(d.p_keep) for d in draws),
        tuple(ranks), tuple(starts), tuple(float(t.factor) for t in terms), out, draws[0].threads, n_rows, n_cols,
        n_ranks, steps_per_split * params.block_cols, N_TERMS=len(terms), SCALE_FIRST=(dropped_in or x.dtype) != c,
        VEC=draws[0].vec, PARTIALS=splits > 1,
        BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, BLOCK_RANK=block_rank,
        num_warps=params.num_warps,
    )  # fmt: skip
    if splits > 1:
        out = sum_rows(out.view(splits, n_rows * n_ranks), c).view(n_rows, n_ranks)
    return [out.narrow(1, s, r) for s, r in zip(starts, ranks, strict=True)], masks


def dropped_lora_inputs(x: torch.Tensor, terms: Sequence[DroppedInput], dropped_in: torch.dtype | None = None,
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """(``[f_t (x * m_t) A_t^T]``, each ``[M, r_t]`` in the ``A``\\ s' dtype, ``[m_t]``, each bool ``[M, K]``)
    for the projections ``terms`` that share ``x`` ``[M, K]``, their masks drawn as each term's
    ``torch.native_dropout`` call would (where :func:`dropped_inputs_apply`; the caller checks): one
    kernel for every three projections, reading ``x`` once for them. ``dropped_in``: the dtype the
    dropout is drawn in (the draws' own; ``x``'s by default): where it is wider than the ``A``\\ s'
    dtype, ``f (x * m_t)`` is rounded to theirs before the product, as autocast rounds PEFT's
    dropped input."""
    xas: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for first in range(0, len(terms), TERMS_PER_LAUNCH):
        launch_xas, launch_masks = _launch(x, terms[first : first + TERMS_PER_LAUNCH], dropped_in)
        xas += launch_xas
        masks += launch_masks
    return xas, masks
