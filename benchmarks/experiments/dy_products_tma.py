"""#32: ``fk.lora.dy_products`` reads ``dy`` at about half the copy speed (``dy_products_tune``:
``[16384, 4096]`` 69.1 us at its best launch, 31 us at the copy bandwidth; ``[16384, 14336]``
171.0 against 110), with tiles loaded by pointer (``cp.async``). Does loading them through a TMA
descriptor, with a pipeline depth of 2 to 4, bring it nearer the copy speed?

For Llama-3.1-8B's output gradients at 4096 and 16384 tokens (q/O 4096 columns, gate/up 14336;
r = 16, bf16), by GPU time (``fk.core.bench.time_ms(gpu_only=True)``, as bench_lora times its
rows): the two scaled matmuls, the module at its launch, and the same kernel with ``dy`` through a
descriptor at each launch (rows a program, columns a step, warps, programs an SM, stages); every
result checked against float64 before it is timed; the fraction of the copy speed for ``dy`` read
once.

Run on a GPU:  python benchmarks/experiments/dy_products_tma.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from dy_products_tune import SCALING, R, _right, gpu_operands
from triton.tools.tensor_descriptor import TensorDescriptor

from fk.core import bench
from fk.core.launch import cdiv, next_power_of_2, reduction_splits
from fk.core.matmul import scaled_mm
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, round_to
from fk.lora import dy_products as module

SHAPES = [(4096, 4096), (4096, 14336), (16384, 4096), (16384, 14336)]


class Launch(NamedTuple):
    block_rows: int
    block_cols: int
    num_warps: int
    programs_per_sm: int
    stages: int


LAUNCHES = [
    Launch(*values)
    for values in itertools.product((128, 256), (64, 128), (4, 8), (1, 2), (2, 3, 4))
    if values[4] * values[0] * values[1] * 2 <= 200 * 1024  # the stages of dy tiles in shared memory
]


@triton.jit
def _tma_kernel(dy_desc, b_ptr, xa_ptr, g_ptr, db_ptr, scaling, n_rows, n_cols, rank, b_row_stride, xa_row_stride,
                g_row_stride, cols_per_split, G_PARTIALS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    # fk.lora.dy_products' kernel with dy's tiles through a TMA descriptor (zeros past the edges).
    row_block, split = tl.program_id(0), tl.program_id(1)
    rows = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    ranks = tl.arange(0, BLOCK_RANK)
    row_ok = rows < n_rows
    rank_ok = ranks < rank
    xa = tl.load(xa_ptr + rows[:, None] * xa_row_stride + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :],
                 other=0.0)  # fmt: skip
    g = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    first = split * cols_per_split
    for start in tl.range(first, tl.minimum(first + cols_per_split, n_cols), BLOCK_COLS, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = cols < n_cols
        dy = dy_desc.load([row_block * BLOCK_ROWS, start])
        b = tl.load(b_ptr + cols[:, None] * b_row_stride + ranks[None, :], mask=col_ok[:, None] & rank_ok[None, :],
                    other=0.0)  # fmt: skip
        g += exact_dot(dy, b)
        db = exact_dot(tl.trans(dy), xa) * scaling
        db_out = db_ptr + (row_block.to(tl.int64) * n_cols + cols[:, None]) * BLOCK_RANK + ranks[None, :]
        tl.store(db_out, db, mask=col_ok[:, None])
    g = g * scaling
    if G_PARTIALS:
        tl.store(g_ptr + (split.to(tl.int64) * n_rows + rows[:, None]) * BLOCK_RANK + ranks[None, :], g,
                 mask=row_ok[:, None])  # fmt: skip
    else:
        tl.store(g_ptr + rows[:, None] * g_row_stride + ranks[None, :], round_to(g, g_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & rank_ok[None, :])  # fmt: skip


def tma_dy_products(dy: torch.Tensor, lora_b: torch.Tensor, xa: torch.Tensor, scaling: float,
                    launch: Launch) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As ``module._launch`` (same splits, partials and sums), the kernel above."""
    n_rows, n_cols = dy.shape
    rank = lora_b.shape[1]
    block_rank = max(16, next_power_of_2(rank))
    row_blocks = cdiv(n_rows, launch.block_rows)
    steps_per_split, splits = reduction_splits(
        row_blocks, cdiv(n_cols, launch.block_cols), dy.device, launch.programs_per_sm
    )
    if splits == 1:
        g = torch.empty((n_rows, rank), dtype=dy.dtype, device=dy.device)
    else:
        g = torch.empty((splits, n_rows, block_rank), dtype=torch.float32, device=dy.device)
    db_partials = torch.empty((row_blocks, n_cols, block_rank), dtype=torch.float32, device=dy.device)
    _tma_kernel[(row_blocks, splits)](
        TensorDescriptor.from_tensor(dy, [launch.block_rows, launch.block_cols]), lora_b, xa, g, db_partials,
        float(scaling), n_rows, n_cols, rank, lora_b.stride(0), xa.stride(0), g.stride(-2),
        steps_per_split * launch.block_cols, G_PARTIALS=splits > 1, BLOCK_ROWS=launch.block_rows,
        BLOCK_COLS=launch.block_cols, BLOCK_RANK=block_rank, STAGES=launch.stages, num_warps=launch.num_warps,
    )  # fmt: skip
    if splits > 1:
        g = module._first_columns(
            sum_rows(g.view(splits, n_rows * block_rank), dy.dtype).view(n_rows, block_rank), rank
        )
    db = sum_rows(db_partials.view(row_blocks, n_cols * block_rank), dy.dtype).view(n_cols, block_rank)
    return g, module._first_columns(db, rank)


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    dy, b, xa = (
        torch.randn(*shape, device=device, generator=gen).to(dtype) for shape in ((300, 200), (200, R), (300, R))
    )
    want = module.dy_products_ref(dy, b, xa, SCALING)
    for launch in (Launch(128, 64, 4, 1, 2), Launch(128, 64, 4, 64, 3)):
        assert _right(tma_dy_products(dy, b, xa, SCALING, launch), want), launch
    print("tma_dy_products (one and several column ranges): within 16-bit rounding of float64")


def timings(copy_tbps: float) -> None:
    for m, n in SHAPES:
        dy, b, xa = gpu_operands(m, n)
        want = module.dy_products_ref(dy, b, xa, SCALING)

        def of_copy(t: float) -> str:
            return f"{2 * m * n / t / 1e9 / copy_tbps:5.1%} of copy"  # noqa: B023

        two = bench.time_ms(lambda: (scaled_mm(dy, b, SCALING, dy.dtype), scaled_mm(dy.t(), xa, SCALING, dy.dtype)),  # noqa: B023
                            warmup=3, rep=30, gpu_only=True)  # fmt: skip
        now = bench.time_ms(lambda: module.dy_products(dy, b, xa, SCALING, dy.dtype, module.LAUNCH),  # noqa: B023
                            warmup=3, rep=30, gpu_only=True)  # fmt: skip
        print(f"== dy [{m}, {n}], r = {R}: two scaled matmuls {two * 1e3:7.1f} us; the module at "
              f"{tuple(module.LAUNCH)} {now * 1e3:7.1f} us ({of_copy(now)})", flush=True)  # fmt: skip
        results = []
        for launch in LAUNCHES:

            def kernel(lc: Launch = launch) -> tuple[torch.Tensor, torch.Tensor]:
                return tma_dy_products(dy, b, xa, SCALING, lc)  # noqa: B023

            try:
                right = _right(kernel(), want)
            except triton.runtime.errors.OutOfResources:
                print(f"  {tuple(launch)!s:22s} out of resources", flush=True)
                continue
            if not right:  # every launch's result checked before it is timed
                print(f"  {tuple(launch)!s:22s} WRONG", flush=True)
                continue
            results.append((bench.time_ms(kernel, warmup=3, rep=30, gpu_only=True), launch))
        for t, launch in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  tma {tuple(launch)!s:22s} {t * 1e3:7.1f} us  {of_copy(t)}  ({t / now:.3f}x the module)",
                  flush=True)  # fmt: skip


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings(copy))


if __name__ == "__main__":
    main()
