"""PolyNorm's backward with frozen weight and bias: which tile and warps per row are fastest.

Without dw and db the backward runs one program per row tile and sums nothing across rows, so its
tiling need not be the trainable one's. For each width this times forward+backward (16384 rows,
bf16, GPU time alone, ``bench.time_ms(gpu_only=True)``) with the module's own backward tiling and
with each candidate: one tile per row (several rows for narrow rows) with 4, 8 or 16 warps, and
column tiles of 2048, 4096 and 8192 looped over the row with 2, 4 or 8 warps. Prints the module's
tiling and the six fastest.

Run on a GPU:  python benchmarks/experiments/poly_norm_frozen_tiles.py
Output of runs on an H200: poly_norm_frozen_tiles_h200.txt beside this file.
"""

from __future__ import annotations

import importlib

import torch

import fk.norms
from fk.core import bench
from fk.core.launch import RowTiling

ROWS = 16384
WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def candidates(width: int) -> list[RowTiling]:
    found = []
    if width <= 16384:
        for rows in (1, 2, 4) if width <= 2048 else (1,):
            found += [RowTiling(block_cols=width, looped=False, rows_per_tile=rows, num_warps=w) for w in (4, 8, 16)]
    for cols in (2048, 4096, 8192):
        if cols < width:
            found += [RowTiling(block_cols=cols, looped=True, rows_per_tile=1, num_warps=w) for w in (2, 4, 8)]
    return found


def main() -> None:
    module = importlib.import_module("fk.norms.poly_norm")
    own = module._bwd_tiling
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  rows {ROWS}  bf16  fwd+bwd GPU ms, frozen")
    for width in WIDTHS:
        x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        w = torch.full((3,), 1 / 3, device="cuda", dtype=torch.bfloat16)
        b = torch.ones(1, device="cuda", dtype=torch.bfloat16)

        def forward_backward() -> None:
            torch.autograd.backward(fk.norms.poly_norm(x, w, b), dy)  # noqa: B023 (called in this iteration)

        results = []
        for tiling in [None, *candidates(width)]:
            module._bwd_tiling = own if tiling is None else (lambda n_cols, sums=True, tiling=tiling: tiling)
            ms = bench.time_ms(forward_backward, warmup=5, rep=30, grad_to_none=[x], gpu_only=True)
            results.append((ms, f"module's {own(width, False)}" if tiling is None else str(tiling)))
        module._bwd_tiling = own
        print(f"H={width}")
        for ms, label in [r for r in results if r[1].startswith("module")] + sorted(results)[:6]:
            print(f"  {ms:.4f}  {label}")


if __name__ == "__main__":
    main()
