"""Triton helpers that row-wise kernels share (called from inside ``@triton.jit`` kernels).

A row-wise kernel with a persistent grid (see :mod:`fk.core.launch`) walks a ``[rows, cols]``
matrix in tiles of ``ROWS`` whole rows: program ``p`` takes tiles ``p, p + P, p + 2P, ...``.
:func:`load_row_tile` loads one such tile; a tile past the last row loads nothing (every element is
masked), so a loop may load the tile after its last one, as a prefetching loop does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fk.core import backend  # noqa: F401 (decides interpretation before @triton.jit below)


@triton.jit
def load_row_tile(ptr, tile, n_rows, row_stride, cols, col_mask, ROWS: tl.constexpr):
    """Rows ``[tile * ROWS, (tile + 1) * ROWS)`` of a matrix at ``ptr`` (row stride ``row_stride``,
    unit column stride) at columns ``cols``: a ``[ROWS, len(cols)]`` tile in the matrix's own
    dtype; rows from ``n_rows`` on, and columns where ``col_mask`` is False, read as 0."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    return tl.load(ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)
