"""fk.core.tiles: the Triton helpers row-wise kernels share, called from a test kernel."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fk.core.testing import dtype_name
from fk.core.tiles import exact_dot, exact_dot_add, grouped_tile_offsets, load_row_tile


@triton.jit
def _copy_tiles_kernel(src_ptr, dst_ptr, n_rows, n_cols, src_row_stride, tile_offset, BLOCK_COLS: tl.constexpr,
                       ROWS: tl.constexpr):  # fmt: skip
    """dst's tile t = src's tile t + tile_offset (dst contiguous, [n_rows, n_cols])."""
    tile = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    values = load_row_tile(src_ptr, tile + tile_offset, n_rows, src_row_stride, cols, col_mask, ROWS)
    rows = tile * ROWS + tl.arange(0, ROWS)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    tl.store(dst_ptr + rows[:, None] * n_cols + cols[None, :], values, mask=mask)


@pytest.mark.parametrize("tile_offset", [0, 1])
def test_load_row_tile_reads_its_rows_and_zeros_past_the_end(device: str, tile_offset: int) -> None:
    rows, cols, tile_rows = 11, 5, 4  # three tiles, the last one partial; columns padded to 8
    wide = torch.arange(rows * 9, dtype=torch.float32, device=device).view(rows, 9) + 1
    src = wide[:, 2 : 2 + cols]  # row stride 9
    dst = torch.full((rows, cols), -1.0, device=device)
    _copy_tiles_kernel[(3,)](src, dst, rows, cols, src.stride(0), tile_offset, BLOCK_COLS=8, ROWS=tile_rows)
    expected = torch.zeros(rows, cols, device=device)
    shifted = tile_offset * tile_rows
    expected[: rows - shifted] = src[shifted:]  # tiles past the last row read as zeros
    torch.testing.assert_close(dst, expected, rtol=0, atol=0)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, ADD: tl.constexpr):
    # ADD: exact_dot_add onto out's values, the product in two halves of K (a K loop's steps)
    m, k, n = tl.arange(0, M), tl.arange(0, K // 2), tl.arange(0, N)
    out_at = out_ptr + m[:, None] * N + n[None, :]
    a0 = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b0 = tl.load(b_ptr + k[:, None] * N + n[None, :])
    a1 = tl.load(a_ptr + m[:, None] * K + K // 2 + k[None, :])
    b1 = tl.load(b_ptr + (K // 2 + k[:, None]) * N + n[None, :])
    if ADD:
        tl.store(out_at, exact_dot_add(a1, b1, exact_dot_add(a0, b0, tl.load(out_at))))
    else:
        tl.store(out_at, exact_dot(a0, b0) + exact_dot(a1, b1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_name)
def test_exact_dot_and_exact_dot_add_sum_exact_products_in_fp32(device: str, dtype: torch.dtype) -> None:
    # (Triton 3.6's interpreter gets a plain bf16 tl.dot wrong by orders of magnitude; fp32 tiles
    # must not take TF32, whose 10-bit mantissa errs by about 1e-3.)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=gen).to(dtype).to(device)
    b = torch.randn(64, 16, generator=gen).to(dtype).to(device)
    out = torch.empty(32, 16, device=device)
    _dot_kernel[(1,)](a, b, out, M=32, K=64, N=16, ADD=False)
    want = a.double() @ b.double()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    start = torch.randn(32, 16, generator=gen).to(device)
    out = start.clone()
    _dot_kernel[(1,)](a, b, out, M=32, K=64, N=16, ADD=True)
    want = want + start.double()
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())


@triton.jit
def _tile_offsets_kernel(out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    tile = tl.program_id(0)
    off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    tl.store(out_ptr + 2 * tile, off_m)
    tl.store(out_ptr + 2 * tile + 1, off_n)


def test_grouped_tile_offsets_visit_every_tile_once_in_groups(device: str) -> None:
    # 7 row blocks (the last group of 3 is short) by 5 column blocks, groups of 4 row blocks.
    n_rows, n_cols, block_m, block_n, group_m = 7 * 16 - 5, 5 * 32 - 9, 16, 32, 4
    out = torch.full((35, 2), -1, dtype=torch.int32, device=device)
    _tile_offsets_kernel[(35,)](out, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m)
    offsets = [tuple(row) for row in out.cpu().tolist()]
    assert sorted(offsets) == [(m * block_m, n * block_n) for m in range(7) for n in range(5)]
    # the first group: row blocks 0-3 down column block 0, then column block 1, ...
    assert offsets[:6] == [(0, 0), (16, 0), (32, 0), (48, 0), (0, 32), (16, 32)]
    # the short last group (row blocks 4-6): down each column of it
    assert offsets[20:24] == [(64, 0), (80, 0), (96, 0), (64, 32)]
