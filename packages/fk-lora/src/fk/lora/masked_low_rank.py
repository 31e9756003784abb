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
mask, to the same ``dx``: one launch takes them all (``dx += sum_t f_t m_t (G_t A_t)``), so ``dx``
is read and written once, not once per projection.
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
    N_TERMS: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for t in tl.static_range(N_TERMS):
        product = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        for k0 in range(0, ranks[t], BLOCK_RANK):  # the rank, padded to BLOCK_RANK with zeros
            ks = k0 + tl.arange(0, BLOCK_RANK)
            k_ok = ks < ranks[t]
            g = tl.load(g_ptrs[t] + rows[:, None] * g_row_strides[t] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            a = tl.load(a_ptrs[t] + ks[:, None].to(tl.int64) * a_row_strides[t] + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            # Exact products summed in fp32, as torch.mm forms them (16-bit operands on the tensor cores:
            # IEEE fp32 FMAs, r * terms an element, made this pass compute-bound on an H200).
            product += exact_dot(g, a)
        if HAS_ADDEND and t == 0:
            addend = tl.load(addend_ptr + rows[:, None] * addend_row_stride + cols[None, :], mask=ok, other=0.0)
            product += addend.to(tl.float32)
        keep = tl.load(mask_ptrs[t] + rows[:, None] * mask_row_strides[t] + cols[None, :], mask=ok, other=0)
        total += tl.where(keep != 0, product * factors[t], 0.0)
    dx_at = dx_ptr + rows[:, None] * dx_row_stride + cols[None, :]
    dx = tl.load(dx_at, mask=ok, other=0.0).to(tl.float32) + total
    tl.store(dx_at, round_to(dx, dx_ptr.dtype.element_ty), mask=ok)


# Tile of dx per program, and the rank step (tl.dot's smallest). The work is a pass over dx and the
# masks; the G's and A's are rank-sized and come from L2 for every tile. 32 x 128 on 4 warps: the
# fastest of an H200 sweep (benchmarks/experiments/INDEX.md#masked_dropout_tune), one term or three.
BLOCK_ROWS = 32
BLOCK_COLS = 128
BLOCK_RANK = 16
NUM_WARPS = 4


def add_masked_low_ranks_(
    dx: torch.Tensor, terms: Sequence[MaskedLowRank], addend: torch.Tensor | None = None
) -> torch.Tensor:
    """``dx += sum_t f_t m_t (G_t A_t)`` in place (with ``addend`` added to the first term's
    ``G A`` inside its mask); returns ``dx``.

    ``dx`` and ``addend`` ``[M, K]``, each term's ``g`` ``[M, r]`` and ``a`` ``[r, K]`` in ``dx``'s
    dtype, its ``mask`` ``[M, K]`` bool. On Triton's path (outside ``torch.compile``) one kernel for
    all the terms: ``dx`` read and written once, the sum in fp32, rounded once. Elsewhere, and
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
    gs, as_, masks = (tuple(as_rows(getattr(t, name)) for t in terms) for name in ("g", "a", "mask"))
    addend_rows = as_rows(addend) if addend is not None else masks[0]
    n_rows, n_cols = dx_rows.shape
    grid = (cdiv(n_rows, BLOCK_ROWS), cdiv(n_cols, BLOCK_COLS))
    _add_masked_low_rank_kernel[grid](
        dx_rows, gs, as_, masks, tuple(g.shape[1] for g in gs), tuple(g.stride(0) for g in gs),
        tuple(a.stride(0) for a in as_), tuple(m.stride(0) for m in masks), tuple(float(t.factor) for t in terms),
        addend_rows, n_rows, n_cols, dx_rows.stride(0), addend_rows.stride(0),
        N_TERMS=len(terms), HAS_ADDEND=addend is not None, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
        BLOCK_RANK=BLOCK_RANK, num_warps=NUM_WARPS,
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
