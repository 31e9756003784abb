"""Sweep the launch settings of fk's GroupNorm rows kernels (inputs without spatial extent, as
bench_norms.py runs GroupNorm: 32 groups of a (16384, H) bf16 input) on a GPU: the tile size
(ROWS_TILE_ELEMENTS), elements per warp (ROWS_ELEMENTS_PER_WARP) and, with trainable weight and
bias, the backward's tile and samples per program (ROWS_PARTIALS_TILE_ELEMENTS, ROWS_PER_PROGRAM,
which sets the rows of the fp32 dw/db partial buffers). Prints GPU time, the copy fraction
(bench_norms.py's bytes: 10 per element forward+backward) and peak memory, the module's settings
first and then the best five.

Run on a GPU:  python benchmarks/experiments/group_norm_rows_tune.py [widths ...]
"""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Callable

import torch

from fk.core import bench

ROWS, GROUPS = 16384, 32
# (This sweep chose fk's settings when one tile size served the forward and the backward and the
# rows kernels shared ELEMENTS_PER_WARP with the others; see group_norm_rows_tune_h200.txt. The
# names below are those of the settings since.)
SPACE = {"ROWS_TILE_ELEMENTS": [2048, 4096, 8192, 16384], "ROWS_ELEMENTS_PER_WARP": [128, 256, 512]}
TRAINABLE_SPACE = {**SPACE, "ROWS_PARTIALS_TILE_ELEMENTS": [2048, 4096], "ROWS_PER_PROGRAM": [512, 2048]}


def case(width: int, trainable: bool) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """(forward+backward of fk's GroupNorm on a fresh (ROWS, width) bf16 input, its leaves)."""
    import fk.norms

    x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=trainable)
    b = torch.zeros(width, device="cuda", dtype=torch.bfloat16, requires_grad=trainable)
    dy = torch.randn_like(x)
    return lambda: fk.norms.group_norm(x, GROUPS, w, b, 1e-6).backward(dy), [x, w, b]


def measure(fwd_bwd: Callable[[], None], leaves: list[torch.Tensor]) -> tuple[float, float]:
    """(GPU ms, peak MB above the inputs) of one forward+backward."""
    ms = bench.time_ms(fwd_bwd, warmup=5, rep=20, grad_to_none=leaves, gpu_only=True)
    for t in leaves:
        t.grad = None
    peak = bench.peak_memory_bytes(fwd_bwd) / 2**20
    for t in leaves:
        t.grad = None
    return ms, peak


def main() -> None:
    module = importlib.import_module("fk.norms.group_norm")
    defaults = {k: getattr(module, k) for k in TRAINABLE_SPACE}
    copy = bench.copy_bandwidth_tbps()
    widths = [int(w) for w in sys.argv[1:]] or [4096, 8192, 16384, 32768]
    for width, trainable in itertools.product(widths, (False, True)):
        fwd_bwd, leaves = case(width, trainable)
        space = TRAINABLE_SPACE if trainable else SPACE
        results = []
        for values in [{}, *(dict(zip(space, v, strict=True)) for v in itertools.product(*space.values()))]:
            for key, value in {**defaults, **values}.items():
                setattr(module, key, value)
            ms, peak = measure(fwd_bwd, leaves)
            results.append({"GPU ms": round(ms, 4), "copy%": round(100 * bench.tbps(10 * ROWS * width, ms) / copy, 1),
                            "MB": round(peak, 1), "variant": str(values or "module defaults")})  # fmt: skip
        for key, value in defaults.items():
            setattr(module, key, value)
        top = [results[0], *sorted(results[1:], key=lambda r: r["GPU ms"])[:5]]
        print(f"\ngroup_norm H={width} {'trainable' if trainable else 'frozen'} fwd+bwd (copy {copy:.2f} TB/s)")
        print(bench.markdown_table(top, ["GPU ms", "copy%", "MB", "variant"]), flush=True)


if __name__ == "__main__":
    main()
