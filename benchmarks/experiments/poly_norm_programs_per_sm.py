"""PolyNorm's trainable backward with fewer programs per SM: what keeping its partial sums within
Liger's costs.

The backward writes one ``[4]`` fp32 row of dw/db partial sums per program. With the module's 8
programs per SM that is 1056 rows (17 KB) on an H200, which puts fk's peak 13 KB over Liger's (Liger
keeps ``[SMs, 3]`` and ``[SMs]`` fp32 partials and sums them with torch). At most about 224 rows
(1.7 per SM) keep it at or under Liger's peak; one per SM does. For each width this times
forward+backward with trainable weight and bias (16384 rows, bf16, GPU time alone,
``bench.time_ms(gpu_only=True)``) with the module's settings and with ``--per-sm`` programs per SM
(wide rows too) over tiles of BWD_MIN_TILE in {8192, 16384, 32768} elements (2048 and 4096 too
with --narrow-tiles), BWD_ELEMENTS_PER_WARP in {256, 512, 1024} and BWD_LOOPED_BLOCK_COLS in {2048,
4096}, and prints every variant against the module's time.

Run on a GPU:  python benchmarks/experiments/poly_norm_programs_per_sm.py [--per-sm 1 2] [--narrow-tiles]
Output of runs on an H200: poly_norm_programs_per_sm_h200.txt beside this file.
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch

import fk.norms
from fk.core import bench

ROWS = 16384
WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768)
NAMES = ("BWD_PROGRAMS_PER_SM", "BWD_LOOPED_PROGRAMS_PER_SM", "BWD_MIN_TILE", "BWD_ELEMENTS_PER_WARP",
         "BWD_LOOPED_BLOCK_COLS")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1])
    parser.add_argument("--narrow-tiles", action="store_true", help="also tiles of 2048 and 4096 elements")
    args = parser.parse_args()
    module = importlib.import_module("fk.norms.poly_norm")
    own = {name: getattr(module, name) for name in NAMES}

    def configure(values: dict[str, int]) -> None:
        for name, value in {**own, **values}.items():
            setattr(module, name, value)
        module._bwd_tiling.cache_clear()

    tiles = ([2048, 4096] if args.narrow_tiles else []) + [8192, 16384, 32768]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  rows {ROWS}  bf16  fwd+bwd GPU ms, trainable")
    for width in WIDTHS:
        x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        w = torch.full((3,), 1 / 3, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.ones(1, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def forward_backward() -> None:
            torch.autograd.backward(fk.norms.poly_norm(x, w, b), dy)  # noqa: B023 (called in this iteration)

        results = []
        for per_sm, tile, per_warp, cols in itertools.product(args.per_sm, tiles, (256, 512, 1024), (2048, 4096)):
            values = dict(zip(NAMES, (per_sm, per_sm, tile, per_warp, cols), strict=True))
            configure(values)
            ms = bench.time_ms(forward_backward, warmup=5, rep=30, grad_to_none=[x, w, b], gpu_only=True)
            results.append((ms, str(values)))
        configure({})
        own_ms = bench.time_ms(forward_backward, warmup=5, rep=30, grad_to_none=[x, w, b], gpu_only=True)
        print(f"H={width} module's settings {own_ms:.4f} ms")
        for ms, label in sorted(results):
            print(f"  {ms:.4f} x{ms / own_ms:.3f} {label}")


if __name__ == "__main__":
    main()
