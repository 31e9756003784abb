"""Triton helpers that row-wise kernels share (called from inside ``@triton.jit`` kernels).

A row-wise kernel with a persistent grid (see :mod:`fk.core.launch`) walks a ``[rows, cols]``
matrix in tiles of ``ROWS`` whole rows: program ``p`` takes tiles ``p, p + P, p + 2P, ...``.
:func:`load_row_tile` loads one such tile; a tile past the last row loads nothing (every element is
masked), so a loop may load the tile after its last one, as a prefetching loop does.

:func:`round_to` casts an fp32 result to its output dtype rounding to nearest even on both paths:
a GPU's fp32 -> bf16 cast does, Triton's interpreter's rounds toward zero, which biases every
element the same way and shows in sums taken later over many of them (a LoRA weight gradient).

:func:`grouped_tile_offsets` is a persistent GEMM's order of output tiles (groups of row blocks).

:func:`exact_dot` is ``tl.dot`` with exact products summed in fp32, as torch's matmuls form them:
the tensor cores for two fp16 or two bf16 tiles, IEEE fp32 FMAs (not TF32) for fp32 ones. Triton
3.6's interpreter multiplies bf16 tiles wrongly (off by orders of magnitude), so there the tiles
are widened to fp32 first (exactly) and multiplied in IEEE fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fk.core import backend

ROUND_BF16_BY_BITS = tl.constexpr(backend.INTERPRETER_ON)
"""Whether :func:`round_to` rounds fp32 -> bf16 itself (in the interpreter; a GPU's cast is exact)."""
DOT_IN_FP32 = tl.constexpr(backend.INTERPRETER_ON)
"""Whether :func:`exact_dot` widens 16-bit tiles to fp32 first (in the interpreter; a GPU's dot is right)."""


@triton.jit
def load_row_tile(ptr, tile, n_rows, row_stride, cols, col_mask, ROWS: tl.constexpr):
    """Rows ``[tile * ROWS, (tile + 1) * ROWS)`` of a matrix at ``ptr`` (row stride ``row_stride``,
    unit column stride) at columns ``cols``: a ``[ROWS, len(cols)]`` tile in the matrix's own
    dtype; rows from ``n_rows`` on, and columns where ``col_mask`` is False, read as 0."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    return tl.load(ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def grid_tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's tile of a ``[n_rows, n_cols]`` matrix on a 2D grid (axis 0 over row blocks,
    axis 1 over column blocks): (row indices in int64, so that offsets may pass 2**31, column
    indices, the rows' mask, the columns' mask)."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    return rows, cols, rows < n_rows, cols < n_cols


@triton.jit
def grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row offset, column offset) of output tile number ``tile`` of a ``[n_rows, n_cols]`` GEMM
    output, tiles numbered ``GROUP_M`` row blocks at a time and down each column of a group, so
    that tiles taken together share the second operand's tiles in L2 (a persistent GEMM's order)."""
    tiles_m, tiles_n = tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % group_m) * BLOCK_M, ((tile % in_group) // group_m) * BLOCK_N


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """The fp32 tensor ``x`` cast to ``dtype``, rounded to nearest even as torch rounds (the
    interpreter's fp16 cast already does; its bf16 cast is replaced by integer rounding of the bits,
    which keeps infinities and quiet NaNs). On a GPU this is ``x.to(dtype)``."""
    if ROUND_BF16_BY_BITS and dtype == tl.bfloat16:
        # add half a bf16 unit (less one, plus the last kept bit: ties to even) and cut the low half
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def exact_dot(a, b):
    """``a @ b`` for tiles ``a`` ``[M, K]`` and ``b`` ``[K, N]`` (M, K, N at least 16), as an fp32 tile
    of exact products summed in fp32. Two fp16 or two bf16 tiles: the tensor cores' ``tl.dot``
    (in the interpreter, the same products from tiles widened to fp32); otherwise (fp32, or two
    dtypes) both widened to fp32 and multiplied in IEEE fp32."""
    if a.dtype == b.dtype and (a.dtype == tl.float16 or a.dtype == tl.bfloat16) and not DOT_IN_FP32:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def exact_dot_add(a, b, acc):
    """``acc + a @ b`` as :func:`exact_dot` forms ``a @ b``, with the products summed into the fp32
    tile ``acc`` by the MMA itself (a GEMM's K loop: no second ``[M, N]`` tile in registers)."""
    if a.dtype == b.dtype and (a.dtype == tl.float16 or a.dtype == tl.bfloat16) and not DOT_IN_FP32:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
