"""The LoRA dropout's input-gradient term: ``dx += (G A) * m * f`` in one pass over ``dx``.

With LoRA dropout ``p``, the gradient of a projection's input holds, besides ``dy W``, the term
``s (G A) * m / (1 - p)``: ``G = dy B`` ``[M, r]`` and ``A`` ``[r, K]`` are rank-sized, but their
product is ``[M, K]``, as large as ``dx``, and ``m`` (the dropout mask, bool) is applied
element by element, so the product cannot be folded into ``dx`` by one ``addmm_``. With torch
ops that is a matmul writing ``G A``, a masked copy, and an add: ``G A`` written once and read
twice, ``dx`` read and written. This kernel forms each tile of ``G A`` in registers from the
rank-sized operands (``tl.dot``, exact products summed in fp32), reads ``dx`` and the mask once
and writes ``dx`` once, rounding once. Here ``G`` arrives already scaled by ``s`` and
``f = 1 / (1 - p)``.

Math, per element: ``dx[i, j] += f * m[i, j] * (t[i, j] + sum_k G[i, k] A[k, j])``, where ``t`` is an
optional ``[M, K]`` term that the same mask and factor apply to (DoRA's ``dy_ms1 W``, the gradient
that reaches the dropped input through ``zd``), read in the same pass; summed in fp32, rounded once.
Projections that share an input (q, k and v; gate and up) each add such a term, with their own
mask, to the same ``dx``: one launch takes up to three of them (``dx += sum_t f_t m_t (G_t A_t)``),
so ``dx`` is read and written once, not once per projection.
There is no backward: this runs inside fk.lora's backward.

This file holds the reference, the kernel, and :func:`add_masked_low_ranks_` (any number of terms)
and :func:`add_masked_low_rank_` (one), which take the kernel on Triton's path (a GPU, or the
interpreter) and torch ops elsewhere and under ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import as_rows, cdiv, writable_rows
from fk.core.tiles import exact_dot, grid_tile, round_to


class MaskedLowRank(NamedTuple):
    """One term of :func:`add_masked_low_ranks_`: ``f m (G A)``."""

    g: torch.Tensor
    """``G`` ``[M, r]`` (already scaled by ``s``)."""
    a: torch.Tensor
    """``A`` ``[r, K]``."""
    mask: torch.Tensor
    """The dropout mask ``[M, K]``, bool."""
    factor: float
    """``f = 1 / (1 - p)``."""


def add_masked_low_ranks_ref(
    dx: torch.Tensor, terms: Sequence[MaskedLowRank], addend: torch.Tensor | None = None
) -> torch.Tensor:
    """``dx + sum_t f_t m_t (G_t A_t)`` (``addend`` inside the first term) in float64 (a new tensor)."""
    out = dx.double()
    for i, (g, a, mask, factor) in enumerate(terms):
        out = out + add_masked_low_rank_ref(torch.zeros_like(dx), g, a, mask, factor, addend if i == 0 else None)
    return out


def add_masked_low_rank_ref(
    dx: torch.Tensor,
    g: torch.Tensor,
    a: torch.Tensor,
    mask: torch.Tensor,
    factor: float,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx + (addend + g @ a) * mask * factor`` in float64 (a new tensor): what the kernel computes."""
    product = g.double() @ a.double()
    if addend is not None:
        product = product + addend.double()
    return dx.double() + product * mask.double() * factor


def masked(t: torch.Tensor, mask: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * mask * factor``, a new tensor: dropout's backward kernel, which reads the bool mask as
    it is. (``t * mask`` and ``addcmul_(t, mask)`` promote the bool mask element by element; on an
    H200 at 16384 x 14336 bf16 they took 0.78 and 1.00 ms where this takes 0.27 ms.)"""
    return torch.ops.aten.native_dropout_backward.default(t, mask, factor)


@triton.jit
def _low_rank_tile(g_ptr, a_ptr, rank, g_row_stride, a_row_stride, rows, cols, row_ok, col_ok,
                   BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr,
                   RANK_STEPS: tl.constexpr):  # fmt: skip
    """``G A`` over one tile of dx, fp32: the rank in ``RANK_STEPS`` steps of ``BLOCK_RANK``, padded
    with zeros. (Unrolled: a loop over the rank took a third more registers, and spilled on 2 warps.)"""
    product = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for step in tl.static_range(RANK_STEPS):
        ks = step * BLOCK_RANK + tl.arange(0, BLOCK_RANK)
        k_ok = ks < rank
        g = tl.load(g_ptr + rows[:, None] * g_row_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_ptr + ks[:, None].to(tl.int64) * a_row_stride + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        # Exact products summed in fp32, as torch.mm forms them (16-bit operands on the tensor cores:
        # IEEE fp32 FMAs, r * terms an element, made this pass compute-bound on an H200).
        product += exact_dot(g, a)
    return product


@triton.jit
def _add_masked_low_rank_kernel(
    dx_ptr,  # [M, K], updated in place
    g_ptrs,  # a tuple, one [M, r_t] per term
    a_ptrs,  # a tuple, one [r_t, K] per term
    mask_ptrs,  # a tuple, one [M, K] bool per term
    ranks,  # a tuple: r_t
    g_row_strides,  # a tuple, one per term
    a_row_strides,  # a tuple, one per term
    mask_row_strides,  # a tuple, one per term
    factors,  # a tuple: f_t
    addend_ptr,  # [M, K] t, the first term's (read only when HAS_ADDEND)
    n_rows,
    n_cols,
    dx_row_stride,
    addend_row_stride,
    N_TERMS: tl.constexpr,  # 1 to TERMS_PER_LAUNCH
    HAS_ADDEND: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
    RANK_STEPS: tl.constexpr,  # the widest rank of the launch, in steps of BLOCK_RANK
):
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    # Every [M, K] tile is loaded before any product is formed, so that all of its reads are in
    # flight at once (loaded term by term, after each product, the pass ran at 45% of copy for
    # q/k/v, 68% so: INDEX.md#masked_dropout_kernels).
    dx_at = dx_ptr + rows[:, None] * dx_row_stride + cols[None, :]
    total = tl.load(dx_at, mask=ok, other=0.0).to(tl.float32)
    keep0 = tl.load(mask_ptrs[0] + rows[:, None] * mask_row_strides[0] + cols[None, :], mask=ok, other=0)
    keep1 = keep0  # (placeholders where there are fewer terms; read only under the same conditions)
    keep2 = keep0
    if N_TERMS > 1:
        keep1 = tl.load(mask_ptrs[1] + rows[:, None] * mask_row_strides[1] + cols[None, :], mask=ok, other=0)
    if N_TERMS > 2:
        keep2 = tl.load(mask_ptrs[2] + rows[:, None] * mask_row_strides[2] + cols[None, :], mask=ok, other=0)
    addend = keep0
    if HAS_ADDEND:
        addend = tl.load(addend_ptr + rows[:, None] * addend_row_stride + cols[None, :], mask=ok, other=0.0)
    product0 = _low_rank_tile(g_ptrs[0], a_ptrs[0], ranks[0], g_row_strides[0], a_row_strides[0], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK, RANK_STEPS)  # fmt: skip
    if HAS_ADDEND:
        product0 += addend.to(tl.float32)
    total += tl.where(keep0 != 0, product0 * factors[0], 0.0)
    if N_TERMS > 1:
        product1 = _low_rank_tile(g_ptrs[1], a_ptrs[1], ranks[1], g_row_strides[1], a_row_strides[1], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK, RANK_STEPS)  # fmt: skip
        total += tl.where(keep1 != 0, product1 * factors[1], 0.0)
    if N_TERMS > 2:
        product2 = _low_rank_tile(g_ptrs[2], a_ptrs[2], ranks[2], g_row_strides[2], a_row_strides[2], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK, RANK_STEPS)  # fmt: skip
        total += tl.where(keep2 != 0, product2 * factors[2], 0.0)
    tl.store(dx_at, round_to(total, dx_ptr.dtype.element_ty), mask=ok)


TERMS_PER_LAUNCH = 3
"""Terms one launch takes (q, k and v): their masks are all loaded first; more are split into launches."""

# Tile of dx per program, and the rank step (tl.dot's smallest). The work is a pass over dx and the
# masks; the G's and A's are rank-sized and come from L2 for every tile. 32 x 128 on 2 warps: the
# fastest of an H200 sweep at q/k/v's three terms (0.175 ms against 0.266 for the kernel before on
# 4 warps), and within 3% of the fastest with one (benchmarks/experiments/INDEX.md#masked_dropout_kernels).
BLOCK_ROWS = 32
BLOCK_COLS = 128
BLOCK_RANK = 16
NUM_WARPS = 2
# Ranks above BLOCK_RANK take several unrolled rank steps, which spill on 2 warps (compiled for
# sm_90 at three terms: 12 bytes a thread at two steps, 504 at sixteen) and nothing on 4.
NUM_WARPS_SEVERAL_RANK_STEPS = 4


def add_masked_low_ranks_(
    dx: torch.Tensor, terms: Sequence[MaskedLowRank], addend: torch.Tensor | None = None
) -> torch.Tensor:
    """``dx += sum_t f_t m_t (G_t A_t)`` in place (with ``addend`` added to the first term's
    ``G A`` inside its mask); returns ``dx``.

    ``dx`` and ``addend`` ``[M, K]``, each term's ``g`` ``[M, r]`` and ``a`` ``[r, K]`` in ``dx``'s
    dtype, its ``mask`` ``[M, K]`` bool. On Triton's path (outside ``torch.compile``) one kernel for
    every :data:`TERMS_PER_LAUNCH` terms: ``dx`` read and written once a launch, the sum in fp32,
    rounded once a launch. Elsewhere, and
    where ``dx`` cannot be written as rows in place, per term a matmul, :func:`masked` and an add
    (each term rounded to the dtype).
    """
    dx_rows = writable_rows(dx)
    if dx_rows is None or not uses_kernel(dx) or torch.compiler.is_compiling() or dx.numel() == 0 or not terms:
        for i, (g, a, mask, factor) in enumerate(terms):
            if i == 0 and addend is not None:
                dx.add_(masked(addend, mask, factor))
            dx.add_(masked(torch.mm(g, a), mask, factor))
        return dx
    n_rows, n_cols = dx_rows.shape
    grid = (cdiv(n_rows, BLOCK_ROWS), cdiv(n_cols, BLOCK_COLS))
    for first in range(0, len(terms), TERMS_PER_LAUNCH):
        launch = terms[first : first + TERMS_PER_LAUNCH]
        gs, as_, masks = (tuple(as_rows(getattr(t, name)) for t in launch) for name in ("g", "a", "mask"))
        addend_rows = as_rows(addend) if addend is not None and first == 0 else None
        rank_steps = cdiv(max(g.shape[1] for g in gs), BLOCK_RANK)
        _add_masked_low_rank_kernel[grid](
            dx_rows, gs, as_, masks, tuple(g.shape[1] for g in gs), tuple(g.stride(0) for g in gs),
            tuple(a.stride(0) for a in as_), tuple(m.stride(0) for m in masks), tuple(float(t.factor) for t in launch),
            masks[0] if addend_rows is None else addend_rows, n_rows, n_cols, dx_rows.stride(0),
            0 if addend_rows is None else addend_rows.stride(0), N_TERMS=len(launch),
            HAS_ADDEND=addend_rows is not None, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, BLOCK_RANK=BLOCK_RANK,
            RANK_STEPS=rank_steps, num_warps=NUM_WARPS if rank_steps == 1 else NUM_WARPS_SEVERAL_RANK_STEPS,
        )  # fmt: skip
    return dx


def add_masked_low_rank_(
    dx: torch.Tensor,
    g: torch.Tensor,
    a: torch.Tensor,
    mask: torch.Tensor,
    factor: float,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx += (addend + g @ a) * mask * factor`` in place (``addend`` 0 when None); returns ``dx``:
    :func:`add_masked_low_ranks_` with one term."""
    return add_masked_low_ranks_(dx, [MaskedLowRank(g, a, mask, factor)], addend)
