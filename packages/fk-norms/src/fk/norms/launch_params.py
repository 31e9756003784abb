"""The launch-parameter type the norms' forwards share, and the tiling it gives.

Each kernel file holds its own tables (``FORWARD``, ``BACKWARD``, ``BACKWARD_FROZEN``, ...), one
named tuple per direction; the forwards of RMSNorm, FusedAddRMSNorm, LayerNorm and PolyNorm differ
only in the values, so they share :class:`ForwardParams`.
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


def forward_tiling(n_cols: int, params: ForwardParams) -> RowTiling:
    """The tiling ``params`` gives rows of ``n_cols`` elements (:func:`fk.core.launch.row_tiling`)."""
    max_warps = params.max_warps if n_cols <= params.few_warps_max_cols else 16
    return row_tiling(n_cols, max_block_cols=params.max_block_cols, min_tile_elements=params.min_tile,
                      elements_per_warp=params.elements_per_warp, max_warps=max_warps, name="x")  # fmt: skip
