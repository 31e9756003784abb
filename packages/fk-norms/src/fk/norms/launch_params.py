"""The launch-parameter types the norms share, and the tilings they give.

Each kernel file holds its own tables (``FORWARD``, ``BACKWARD``, ``BACKWARD_FROZEN``, ...), one
named tuple per direction; the forwards of RMSNorm, FusedAddRMSNorm, LayerNorm and PolyNorm differ
only in the values, so they share :class:`ForwardParams`, and their backwards with a weight
gradient take narrow rows by a table of :class:`NarrowBackwardParams` (``BACKWARD_NARROW``).
"""

from __future__ import annotations

from typing import NamedTuple

from fk.core.launch import RowTiling, row_tiling


class ForwardParams(NamedTuple):
    """How a norm's forward tiles its rows (one row, or several narrow ones, per program)."""

    max_block_cols: int  # the widest row held in one tile; wider rows loop over column tiles this wide
    min_tile: int  # narrow rows are grouped into tiles of at least this many elements
    elements_per_warp: int  # one warp per this many elements of a tile
    max_warps: int  # at most, for rows up to few_warps_max_cols wide; wider rows take up to 16
    few_warps_max_cols: int


class NarrowBackwardParams(NamedTuple):
    """The backward with a weight gradient (a persistent grid, a partial row of sums a program) for
    one-tile rows up to ``max_cols`` wide; a table of them, narrowest first, overrides the
    ``BACKWARD`` table's fields of the same names for such rows."""

    max_cols: int  # rows up to this wide (and wider than the entry before) take this entry
    programs_per_sm: int
    min_tile: int  # rows are grouped into tiles of at least this many elements,
    elements_per_warp: int  # with one warp per this many elements of a tile


def narrow_backward(n_cols: int, table: tuple[NarrowBackwardParams, ...]) -> NarrowBackwardParams | None:
    """The entry of ``table`` (narrowest first) that rows of ``n_cols`` elements take, or None."""
    return next((entry for entry in table if n_cols <= entry.max_cols), None)


def forward_tiling(n_cols: int, params: ForwardParams) -> RowTiling:
    """The tiling ``params`` gives rows of ``n_cols`` elements (:func:`fk.core.launch.row_tiling`)."""
    max_warps = params.max_warps if n_cols <= params.few_warps_max_cols else 16
    return row_tiling(n_cols, max_block_cols=params.max_block_cols, min_tile_elements=params.min_tile,
                      elements_per_warp=params.elements_per_warp, max_warps=max_warps, name="x")  # fmt: skip
