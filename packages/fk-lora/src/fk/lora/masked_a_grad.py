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
from fk.core.launch import as_rows, column_strip_grid, next_power_of_2, writable_rows
from fk.core.matmul import scaled_mm
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, round_to
from fk.lora.masked_low_rank import MaskedLowRank, add_masked_low_ranks_, masked


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
def _add_masked_product(acc, dx, x, gs_ptr, gs_row_stride, rank, mask_ptr, mask_row_stride, lora_a, factor, rows,
                        row_ok, cols, ok, ADD_DX: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``acc + (s G)^T (x * m)`` over one row tile: ``acc`` ``[BLOCK_RANK, cols]`` fp32, ``x`` the tile;
    with ``ADD_DX`` also ``dx + f m ((s G) A)`` on the same tile (``dx`` fp32, ``lora_a`` A's strip)."""
    ks = tl.arange(0, BLOCK_RANK)
    gs = tl.load(gs_ptr + rows[:, None] * gs_row_stride + ks[None, :], mask=row_ok[:, None] & (ks < rank)[None, :], other=0.0)  # fmt: skip
    keep = tl.load(mask_ptr + rows[:, None] * mask_row_stride + cols[None, :], mask=ok, other=0) != 0
    if ADD_DX:
        dx += tl.where(keep, factor * exact_dot(gs, lora_a), 0.0)
    return acc + exact_dot(tl.trans(gs), tl.where(keep, x, tl.zeros_like(x))), dx


@triton.jit
def _lora_a_strip(a_ptr, a_row_stride, rank, cols, col_ok, ADD_DX: tl.constexpr, BLOCK_RANK: tl.constexpr,
                  BLOCK_COLS: tl.constexpr):  # fmt: skip
    """``A``'s ``[BLOCK_RANK, cols]`` strip (zeros past the rank), loaded once a program (``ADD_DX``)."""
    ks = tl.arange(0, BLOCK_RANK)
    if ADD_DX:
        return tl.load(a_ptr + ks[:, None] * a_row_stride + cols[None, :], mask=(ks < rank)[:, None] & col_ok[None, :],
                       other=0.0)  # fmt: skip
    return tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=a_ptr.dtype.element_ty)


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
    dx_ptr,  # [M, K] in c, added to in place (ADD_DX)
    lora_a_ptrs,  # a tuple: each projection's A [r_t, K] in c (ADD_DX)
    lora_a_row_strides,  # a tuple
    n_rows,
    n_cols,
    n_ranks,
    x_row_stride,
    dx_row_stride,
    N_TERMS: tl.constexpr,  # 1 to 3: one accumulator each
    ADD_DX: tl.constexpr,  # also dx += sum_t f_t m_t (s G_t A_t), each tile of dx once
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
    a0 = _lora_a_strip(lora_a_ptrs[0], lora_a_row_strides[0], ranks[0], cols, col_ok, ADD_DX, BLOCK_RANK, BLOCK_COLS)
    a1 = a0
    a2 = a0
    if N_TERMS > 1:
        a1 = _lora_a_strip(
            lora_a_ptrs[1], lora_a_row_strides[1], ranks[1], cols, col_ok, ADD_DX, BLOCK_RANK, BLOCK_COLS
        )
    if N_TERMS > 2:
        a2 = _lora_a_strip(
            lora_a_ptrs[2], lora_a_row_strides[2], ranks[2], cols, col_ok, ADD_DX, BLOCK_RANK, BLOCK_COLS
        )
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=ok, other=0.0)
        dx = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        if ADD_DX:
            dx = tl.load(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc0, dx = _add_masked_product(acc0, dx, x, gs_ptrs[0], gs_row_strides[0], ranks[0], mask_ptrs[0], mask_row_strides[0], a0, factors[0], rows, row_ok, cols, ok, ADD_DX, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 1:
            acc1, dx = _add_masked_product(acc1, dx, x, gs_ptrs[1], gs_row_strides[1], ranks[1], mask_ptrs[1], mask_row_strides[1], a1, factors[1], rows, row_ok, cols, ok, ADD_DX, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 2:
            acc2, dx = _add_masked_product(acc2, dx, x, gs_ptrs[2], gs_row_strides[2], ranks[2], mask_ptrs[2], mask_row_strides[2], a2, factors[2], rows, row_ok, cols, ok, ADD_DX, BLOCK_RANK)  # fmt: skip
        if ADD_DX:
            dx_out = dx_ptr + rows[:, None] * dx_row_stride + cols[None, :]
            tl.store(dx_out, round_to(dx, dx_ptr.dtype.element_ty), mask=ok)
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

LAUNCH_WITH_DX = {
    16: LaunchParams(block_rows=16, block_cols=128, num_warps=4, programs_per_sm=8),
    32: LAUNCH[32],
    64: LAUNCH[64],
}
"""The launch with the masked dx terms added in the same pass: rank 16 on 4 warps (compiled for sm_90,
three terms on 2 warps spill 16 bytes; on 4, 168 registers and none); 32 and 64 as :data:`LAUNCH`."""


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


def _launch(x: torch.Tensor, terms: Sequence[MaskedA], dx: torch.Tensor | None = None,
            lora_as: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:  # fmt: skip
    """One kernel launch (and one sum of its partials) for up to three ``terms``; with ``dx`` (rows
    with unit column stride) their masked ``dx`` terms too, from ``lora_as``."""
    ranks = [t.gs.shape[1] for t in terms]
    n_ranks = sum(ranks)
    n_rows, n_cols = x.shape
    block_rank = max(16, next_power_of_2(max(ranks)))
    params = (LAUNCH if dx is None else LAUNCH_WITH_DX)[block_rank]
    gss, masks = tuple(as_rows(t.gs) for t in terms), tuple(as_rows(t.mask) for t in terms)
    as_ = tuple(as_rows(a) for a in lora_as) if dx is not None else gss
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    groups, strips = column_strip_grid(
        n_rows, n_cols, params.block_rows, params.block_cols, x.device, params.programs_per_sm
    )
    partials = torch.empty((groups, n_ranks, n_cols), dtype=torch.float32, device=x.device)
    _masked_a_grads_kernel[(groups, strips)](
        x, gss, tuple(g.stride(0) for g in gss), masks, tuple(m.stride(0) for m in masks), tuple(ranks),
        tuple(starts), tuple(float(t.factor) for t in terms), partials, x if dx is None else dx, as_,
        tuple(a.stride(0) for a in as_), n_rows, n_cols, n_ranks, x.stride(0), 0 if dx is None else dx.stride(0),
        N_TERMS=len(terms), ADD_DX=dx is not None, BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols,
        BLOCK_RANK=block_rank, num_warps=params.num_warps,
    )  # fmt: skip
    dtypes = {t.dtype for t in terms}
    one_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    stacked = sum_rows(partials.view(groups, n_ranks * n_cols), one_dtype).view(n_ranks, n_cols)
    return [stacked.narrow(0, s, r).to(t.dtype) for s, r, t in zip(starts, ranks, terms, strict=True)]


def masked_a_grads(
    x: torch.Tensor,
    terms: Sequence[MaskedA],
    dx: torch.Tensor | None = None,
    lora_as: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """``[f_t (s G_t)^T (x * m_t)]``, each ``[r_t, K]`` in its ``dtype``, for the projections
    ``terms`` that share ``x`` ``[M, K]`` (``s G_t`` in ``x``'s dtype). With ``dx`` (``[M, K]`` in
    ``x``'s dtype) and ``lora_as`` (each projection's ``A`` ``[r_t, K]`` in ``x``'s dtype) also
    ``dx += sum_t f_t m_t ((s G_t) A_t)`` in place, the dropout's input-gradient terms, in the same
    pass (each mask read once for both).

    For fp16/bf16 ``x`` on Triton's path (outside ``torch.compile``) one kernel for every three
    projections, reading ``x`` once for them, its sums in fp32, each gradient rounded once (``dx``
    read and written once a launch, rounded once); elsewhere (fp32 ``x``, whose IEEE fp32 dots would
    cost more than the pass saves; a rank above :data:`MAX_RANK`; a ``dx`` that cannot be written as
    rows in place) :func:`masked_a_grads_torch` and :func:`fk.lora.masked_low_rank.add_masked_low_ranks_`.
    """
    if not terms:
        return []
    if dx is not None and len(lora_as) != len(terms):
        raise ValueError(f"lora_as must hold one A per term ({len(terms)}), got {len(lora_as)}")
    dx_rows = None if dx is None else writable_rows(dx)
    if not _takes_kernel(x) or (dx is not None and (dx_rows is None or dx.dtype != x.dtype)):
        if dx is not None:
            add_masked_low_ranks_(
                dx, [MaskedLowRank(t.gs, a, t.mask, t.factor) for t, a in zip(terms, lora_as, strict=True)]
            )
        return masked_a_grads_torch(x, terms)
    x = as_rows(x)
    grads: list[torch.Tensor | None] = [None] * len(terms)
    for launch in _launches(terms):
        launch_as = [lora_as[i] for i in launch] if dx is not None else []
        for i, grad in zip(launch, _launch(x, [terms[i] for i in launch], dx_rows, launch_as), strict=True):
            grads[i] = grad
    rest = [i for i, grad in enumerate(grads) if grad is None]
    for i in rest:
        (grads[i],) = masked_a_grads_torch(x, [terms[i]])
    if dx is not None and rest:
        add_masked_low_ranks_(
            dx, [MaskedLowRank(terms[i].gs, lora_as[i], terms[i].mask, terms[i].factor) for i in rest]
        )
    return grads  # type: ignore[return-value]
