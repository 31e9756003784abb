"""The LoRA dropout's input-gradient term: ``dx += (G A) * m * f`` in one pass over ``dx``.

With LoRA dropout ``p``, the gradient of a projection's input holds, besides ``dy W``, the term
``s (G A) * m / (1 - p)``: ``G = dy B`` ``[M, r]`` and ``A`` ``[r, K]`` are rank-sized, but their
product is ``[M, K]``, as large as ``dx``, and ``m`` (the dropout mask, bool) is applied
element by element, so the product cannot be folded into ``dx`` by one ``addmm_``. With torch
ops that is a matmul writing ``G A``, a masked copy, and an add: ``G A`` written once and read
twice, ``dx`` read and written. This kernel forms each tile of ``G A`` in registers from the
rank-sized operands (``tl.dot`` in fp32), and reads ``dx`` and the mask once and writes
``dx`` once, rounding once. Here ``G`` arrives already scaled by ``s`` and ``f = 1 / (1 - p)``.

Math, per element: ``dx[i, j] += f * m[i, j] * (t[i, j] + sum_k G[i, k] A[k, j])``, where ``t`` is an
optional ``[M, K]`` term that the same mask and factor apply to (DoRA's ``dy_ms1 W``, the gradient
that reaches the dropped input through ``zd``), read in the same pass; summed in fp32, rounded once.
There is no backward: this runs inside fk.lora's backward.

This file holds the reference, the kernel, and :func:`add_masked_low_rank_`, which takes the kernel
on Triton's path (a GPU, or the interpreter) and torch ops elsewhere and under ``torch.compile``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import as_rows, cdiv, writable_rows
from fk.core.tiles import round_to


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
    g_ptr,  # [M, r]
    a_ptr,  # [r, K]
    mask_ptr,  # [M, K] bool
    addend_ptr,  # [M, K] t (read only when HAS_ADDEND)
    n_rows,
    n_cols,
    rank,
    dx_row_stride,
    g_row_stride,
    a_row_stride,
    mask_row_stride,
    addend_row_stride,
    factor,
    HAS_ADDEND: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    rows64 = rows.to(tl.int64)
    product = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_RANK):  # the rank, padded to BLOCK_RANK with zeros
        ks = k0 + tl.arange(0, BLOCK_RANK)
        k_ok = ks < rank
        g = tl.load(
            g_ptr + rows64[:, None] * g_row_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        a = tl.load(a_ptr + ks[:, None].to(tl.int64) * a_row_stride + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        # In fp32 (IEEE, not TF32): exact products of bf16/fp16 operands, fp32 ones as torch.mm forms
        # them. The FMAs are few (r per element of dx) next to the pass over dx and the mask.
        product += tl.dot(g.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    ok = row_ok[:, None] & col_ok[None, :]
    if HAS_ADDEND:
        addend = tl.load(addend_ptr + rows64[:, None] * addend_row_stride + cols[None, :], mask=ok, other=0.0)
        product += addend.to(tl.float32)
    keep = tl.load(mask_ptr + rows64[:, None] * mask_row_stride + cols[None, :], mask=ok, other=0)
    dx_at = dx_ptr + rows64[:, None] * dx_row_stride + cols[None, :]
    dx = tl.load(dx_at, mask=ok, other=0.0).to(tl.float32)
    dx += tl.where(keep != 0, product * factor, 0.0)
    tl.store(dx_at, round_to(dx, dx_ptr.dtype.element_ty), mask=ok)


# Tile of dx per program, and the rank step (tl.dot's smallest). The work is a pass over dx and the
# mask; G and A are rank-sized and come from L2 for every tile.
BLOCK_ROWS = 64
BLOCK_COLS = 128
BLOCK_RANK = 16
NUM_WARPS = 4


def add_masked_low_rank_(
    dx: torch.Tensor,
    g: torch.Tensor,
    a: torch.Tensor,
    mask: torch.Tensor,
    factor: float,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx += (addend + g @ a) * mask * factor`` in place (``addend`` 0 when None); returns ``dx``.

    ``dx`` and ``addend`` ``[M, K]``, ``g`` ``[M, r]`` and ``a`` ``[r, K]`` in one dtype, ``mask``
    ``[M, K]`` bool. On Triton's path (outside ``torch.compile``) one kernel, which sums in fp32 and
    rounds ``dx`` once; elsewhere, and where ``dx`` cannot be written as rows in place, a matmul,
    :func:`masked` and an add (each term rounded to the dtype).
    """
    dx_rows = writable_rows(dx)
    if dx_rows is None or not uses_kernel(dx) or torch.compiler.is_compiling() or dx.numel() == 0:
        if addend is not None:
            dx.add_(masked(addend, mask, factor))
        return dx.add_(masked(torch.mm(g, a), mask, factor))
    g, a, mask = as_rows(g), as_rows(a), as_rows(mask)
    addend_rows = as_rows(addend) if addend is not None else mask
    n_rows, n_cols = dx_rows.shape
    grid = (cdiv(n_rows, BLOCK_ROWS), cdiv(n_cols, BLOCK_COLS))
    _add_masked_low_rank_kernel[grid](
        dx_rows, g, a, mask, addend_rows, n_rows, n_cols, g.shape[1],
        dx_rows.stride(0), g.stride(0), a.stride(0), mask.stride(0), addend_rows.stride(0), factor,
        HAS_ADDEND=addend is not None, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, BLOCK_RANK=BLOCK_RANK,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return dx
