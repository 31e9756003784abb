from __future__ import annotations

import pytest
import torch

from fk.core.launch import (
    MAX_TILE_ELEMENTS,
    RowTiling,
    as_rows,
    cdiv,
    column_strip_grid,
    dot_size,
    looped_rows_tiling,
    next_power_of_2,
    persistent_grid,
    reduction_splits,
    row_reduction_grid,
    row_tiling,
    writable_rows,
)


@pytest.mark.parametrize(("n", "expected"), [(1, 1), (2, 2), (3, 4), (1000, 1024), (1024, 1024), (1025, 2048)])
def test_next_power_of_2(n: int, expected: int) -> None:
    assert next_power_of_2(n) == expected


@pytest.mark.parametrize(("n", "expected"), [(1, 16), (8, 16), (16, 16), (17, 32), (24, 32), (33, 64), (128, 128)])
def test_dot_size(n: int, expected: int) -> None:
    # a LoRA rank padded for tl.dot: a power of two, never under 16
    assert dot_size(n) == expected


def test_narrow_rows_are_grouped() -> None:
    tiling = row_tiling(100, min_tile_elements=2048)
    assert tiling.block_cols == 128 and not tiling.looped
    assert tiling.rows_per_tile == 16


def test_warps_stay_within_min_and_max() -> None:
    # one warp per 1024 elements of a 2048-element tile would be 2: raised to min_warps
    assert row_tiling(1024, min_tile_elements=2048, elements_per_warp=1024, min_warps=4).num_warps == 4
    # 16 by elements: capped at max_warps
    assert row_tiling(8192, max_block_cols=8192, elements_per_warp=512, max_warps=8).num_warps == 8
    # within the bounds, one warp per elements_per_warp
    assert row_tiling(4096, max_block_cols=8192, elements_per_warp=512, min_warps=4).num_warps == 8


def test_row_that_fits_one_tile() -> None:
    tiling = row_tiling(4097, max_block_cols=8192)
    assert tiling == row_tiling(8192, max_block_cols=8192)
    assert tiling.block_cols == 8192 and not tiling.looped and tiling.rows_per_tile == 1


def test_wide_row_loops_or_raises() -> None:
    tiling = row_tiling(65537, max_block_cols=8192)
    assert tiling.looped and tiling.block_cols == 8192 and tiling.rows_per_tile == 1
    with pytest.raises(ValueError, match="logits has rows of 65537 elements"):
        row_tiling(65537, max_block_cols=8192, allow_loop=False, name="logits")


def test_tile_never_exceeds_the_limit() -> None:
    assert row_tiling(10**7, max_block_cols=10**7).block_cols == MAX_TILE_ELEMENTS


def test_empty_row_is_an_error() -> None:
    with pytest.raises(ValueError, match="x must have at least one column"):
        row_tiling(0, name="x")


def test_persistent_grid_bounds() -> None:
    cpu = torch.device("cpu")
    assert persistent_grid(1, cpu) == 1
    assert persistent_grid(0, cpu) == 1
    assert persistent_grid(10**6, cpu, 2) == 8


def test_column_strip_grid_spreads_programs_over_strips_and_row_tiles() -> None:
    cpu = torch.device("cpu")  # 4 multiprocessors off the GPU
    assert column_strip_grid(1000, 300, 32, 128, cpu, 4) == (6, 3)  # 16 programs over 3 strips
    assert column_strip_grid(40, 300, 32, 128, cpu, 4) == (2, 3)  # no more groups than row tiles
    assert column_strip_grid(1000, 5000, 32, 128, cpu, 4) == (1, 40)  # at least one group
    assert column_strip_grid(0, 1, 32, 128, cpu, 4) == (1, 1)


def test_reduction_splits_fill_the_multiprocessors_and_cover_every_step() -> None:
    cpu = torch.device("cpu")  # 4 multiprocessors off the GPU
    assert reduction_splits(1, 64, cpu, 4) == (4, 16)  # 16 programs wanted, one row block: 16 ranges
    assert reduction_splits(16, 64, cpu, 4) == (64, 1)  # the row blocks fill the grid: one range
    assert reduction_splits(3, 10, cpu, 4) == (2, 5)  # cdiv(16, 3) = 6 wanted, 5 ranges of 2 cover 10
    assert reduction_splits(1, 3, cpu, 4) == (1, 3)  # never more ranges than steps
    for row_blocks, steps in ((1, 1), (5, 7), (2, 1000)):
        per_range, ranges = reduction_splits(row_blocks, steps, cpu, 4)
        assert per_range * ranges >= steps > per_range * (ranges - 1)


def test_as_rows_keeps_row_strides_and_copies_only_when_needed() -> None:
    wide = torch.randn(6, 10)
    sliced = wide[:, :7]
    assert as_rows(sliced).data_ptr() == sliced.data_ptr() and as_rows(sliced).stride() == (10, 1)
    expanded = torch.randn(1, 7).expand(6, 7)
    assert as_rows(expanded).stride() == (0, 1)
    transposed = torch.randn(7, 6).t()
    rows = as_rows(transposed)
    assert rows.stride() == (7, 1) and torch.equal(rows, transposed)
    assert as_rows(torch.randn(2, 3, 5)).shape == (6, 5)


def test_writable_rows_refuses_copies_and_overlap() -> None:
    sliced = torch.randn(6, 10)[:, :7]
    assert writable_rows(sliced) is not None
    assert writable_rows(torch.randn(1, 7).expand(6, 7)) is None  # overlapping rows
    assert writable_rows(torch.randn(7, 6).t()) is None  # no unit column stride
    assert writable_rows(torch.randn(4, 6, 5).transpose(0, 1)) is None  # not a [rows, 5] view


@pytest.mark.parametrize(("a", "b", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16384, 2, 8192)])
def test_cdiv(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


def test_looped_rows_tiling() -> None:
    tiling = looped_rows_tiling(4096, 4, elements_per_warp=1024)
    assert tiling == RowTiling(block_cols=4096, looped=True, rows_per_tile=4, num_warps=16)
    assert looped_rows_tiling(4096, 4, elements_per_warp=512).num_warps == 16  # at most max_warps
    assert looped_rows_tiling(4096, 4, elements_per_warp=512, max_warps=32).num_warps == 32
    assert row_reduction_grid(10**6, tiling, torch.device("cpu"), 2, 1) == 4  # looped: 1 per "SM"
    with pytest.raises(ValueError, match="block_cols must be a power of two"):
        looped_rows_tiling(3000, 2, elements_per_warp=512)


def test_row_reduction_grid() -> None:
    cpu = torch.device("cpu")  # 4 "multiprocessors" off the GPU
    narrow = row_tiling(1000, min_tile_elements=2048)  # 2 rows per tile
    assert row_reduction_grid(6, narrow, cpu, 2, 1) == 3  # 3 tiles
    assert row_reduction_grid(10**6, narrow, cpu, 2, 1) == 8
    wide = row_tiling(40000, max_block_cols=8192)
    assert row_reduction_grid(10**6, wide, cpu, 2, 1) == 4
