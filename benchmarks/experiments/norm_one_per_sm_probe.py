"""Can RMSNorm's trainable backward for narrow rows (H <= 4096) run one program per SM, keeping as
few fp32 partial rows of the weight gradient as Liger (its peak memory), as fast as the module's
settings (8 programs per SM at H <= 1024, 2 above)?

At one program per SM with the module's small tiles, too few loads are in flight (H=1024: 0.099
against 0.066 ms forward+backward, ``norm_partials_h200.txt``). This probe times a copy of the
module's one-tile backward kernel with two options the module's kernel does not have:

- ``ACC2D``: the weight gradient accumulates in a ``[ROWS, H]`` register tile, summed over its rows
  once at the end, instead of a cross-warp sum over the tile's rows at every step;
- ``PREFETCH``: the loop loads the next tile's x and dy before computing the current one;

over tiles of 4096 to 16384 elements and 4 to 16 warps, at one program per SM. Each variant is the
kernel plus the partial-row sum (``fk.core.reduce.sum_rows``), 20 calls captured in a CUDA graph
and replayed (GPU time only), next to the module's own ``launch_backward`` at the same shape (as of
10494ad; output in ``norm_one_per_sm_h200.txt``). The results are checked against the module's dx
(bit for bit) and dw.

Run on a GPU:  python benchmarks/experiments/norm_one_per_sm_probe.py [widths ...]
"""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.reduce import sum_rows

module = importlib.import_module("fk.norms.rms_norm")

ROWS = 16384


@triton.jit
def _bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
    BLOCK_COLS: tl.constexpr, ROWS: tl.constexpr, ACC2D: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    s = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ACC2D:
        acc2 = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
    else:
        acc1 = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    rows = pid * ROWS + tl.arange(0, ROWS)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    if PREFETCH:
        x_next = tl.load(x_ptr + offs, mask=mask, other=0.0)
        dy_next = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    for tile in range(pid, n_tiles, n_programs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        if PREFETCH:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            nrows = rows + n_programs * ROWS
            nmask = (nrows < n_rows)[:, None] & col_mask[None, :]
            noffs = nrows.to(tl.int64)[:, None] * n_cols + cols[None, :]
            x_next = tl.load(x_ptr + noffs, mask=nmask, other=0.0)
            dy_next = tl.load(dy_ptr + noffs, mask=nmask, other=0.0)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * s[None, :]
        c = tl.sum(g * xhat, axis=1) / n_cols
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if ACC2D:
            acc2 += dy * xhat
        else:
            acc1 += tl.sum(dy * xhat, axis=0)
    total = tl.sum(acc2, axis=0) if ACC2D else acc1
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, total, mask=col_mask)


def _variant(args: tuple[torch.Tensor, ...], grid: int, block: int, rows_per_tile: int, acc2d: bool,
             prefetch: bool, warps: int) -> Callable[[], torch.Tensor]:  # fmt: skip
    dy, x, w, rstd, dx = args
    partials = torch.empty(grid, x.shape[1], device="cuda", dtype=torch.float32)

    def call() -> torch.Tensor:
        _bwd_kernel[(grid,)](dy, x, w, rstd, dx, partials, x.shape[0], x.shape[1], BLOCK_COLS=block,
                             ROWS=rows_per_tile, ACC2D=acc2d, PREFETCH=prefetch, num_warps=warps)  # fmt: skip
        return sum_rows(partials, w.dtype)

    return call


def main(widths: list[int]) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    for width in widths:
        x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(width, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        dx = torch.empty_like(x)
        _, rstd = module.launch_forward(x, w, 1e-6, 0.0, False)
        ref_dw = module.launch_backward(dy, x, w, rstd, 0.0, True, dx)
        ref_dx = dx.clone()
        programs = module.dw_partial_rows(ROWS, width, x.device)
        base = bench.graph_time_us(partial(module.launch_backward, dy, x, w, rstd, 0.0, True, dx))
        print(f"H={width}: module settings ({programs} programs, {programs * width * 4 / 2**20:.2f} MiB partials) "
              f"{base:.1f} us ({5 * ROWS * width * 2 / base / 1e6:.2f} TB/s counting 5 passes over [M, H])")  # fmt: skip
        results = []
        block = triton.next_power_of_2(width)
        for tile, warps, acc2d, prefetch in itertools.product(
            (4096, 8192, 16384), (4, 8, 16), (False, True), (False, True)
        ):
            call = _variant((dy, x, w, rstd, dx), sms, block, max(1, tile // block), acc2d, prefetch, warps)
            try:
                dw = call()
                torch.cuda.synchronize()
            except Exception as exc:  # (out of resources: report and go on)
                print(f"  tile {tile} warps {warps} acc2d {acc2d} prefetch {prefetch}: {type(exc).__name__}")
                continue
            ok = torch.equal(dx, ref_dx) and torch.allclose(dw.float(), ref_dw.float(), rtol=2e-2, atol=2e-2)
            results.append((bench.graph_time_us(call), tile, warps, acc2d, prefetch, ok))
        for us, tile, warps, acc2d, prefetch, ok in sorted(results)[:12]:
            print(f"  {us:7.1f} us  x{base / us:.3f}  tile {tile:5d} warps {warps:2d} acc2d {acc2d!s:5} "
                  f"prefetch {prefetch!s:5} {'ok' if ok else 'MISMATCH'}")  # fmt: skip


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1024, 2048, 4096])
