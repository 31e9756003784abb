"""#34, after ``layer_norm_narrow_constant_width``: at H = 1024 (16384 rows, bf16, weight and bias
frozen) fk's forward equals torch.compile's (0.0216 against 0.0217 ms GPU time) and no constant-width
launch beats fk's backward (0.0300 ms, 79.5% of copy), yet bench_norms records fk's forward+backward
2.4% behind torch.compile's. Where is the difference: which kernels does each run, for how long, and
what does Inductor's backward kernel do that fk's does not?

- each provider's forward+backward (``torch.autograd.grad``, as bench_norms), its kernels and their
  GPU times from ``torch.profiler`` (L2 flushed before each call, the flush left out);
- the source of the Triton kernels Inductor generates for torch.compile's backward;
- fk's backward kernel with one tile a program (no persistent loop) and with the tiles in order,
  against fk's launch (persistent, last tile first).

Run on a GPU:  python benchmarks/experiments/layer_norm_narrow_backward.py
Check in Triton's interpreter (tiny rows, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

# Inductor writes its generated code here, so that the backward's kernels can be printed.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_ln_"))

import torch
import triton
import triton.language as tl
from layer_norm_narrow_constant_width import _inputs  # (this folder: the same rows, the same seeds)

from fk.core import bench
from fk.core.launch import cdiv

layer_norm = importlib.import_module("fk.norms.layer_norm")

ROWS = 16384
WIDTH = 1024
EPS = 1e-5
# (rows a tile, warps, programs: "tiles" for one tile a program, else per SM; tiles reversed)
BACKWARD_LAUNCHES = [(rows, warps, programs, reverse) for rows in (1, 2, 4) for warps in (1, 2, 4, 8)
                     for programs in ("tiles", 32) for reverse in (True, False)
                     if 4 <= rows * WIDTH // (32 * warps) <= 32]  # fmt: skip


@triton.jit
def _backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, n_rows, N_COLS: tl.constexpr,
                     BLOCK_COLS: tl.constexpr, ROWS: tl.constexpr, REVERSE_TILES: tl.constexpr):  # fmt: skip
    # dx only (weight and bias frozen).
    layer_norm._layer_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, rstd_ptr, rstd_ptr, n_rows,
                                      N_COLS, N_COLS, N_COLS, True, True, False, False, BLOCK_COLS, ROWS, False,
                                      False, False, REVERSE_TILES)  # fmt: skip


def backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
             rows: int, warps: int, programs: int, reverse: bool) -> torch.Tensor:  # fmt: skip
    m, n = x.shape
    dx = torch.empty_like(x)
    grid = (min(programs, cdiv(m, rows)),)
    _backward_kernel[grid](dy, x, w, mean, rstd, dx, m, N_COLS=n, BLOCK_COLS=triton.next_power_of_2(n), ROWS=rows,
                           REVERSE_TILES=reverse, num_warps=warps)  # fmt: skip
    return dx


def check(device: str) -> None:
    for n in (100, 256):
        x, w, b, dy = _inputs(5, n, device)
        _, mean, rstd = layer_norm._layer_norm_fwd(x, w, b, EPS)
        want = layer_norm._layer_norm_bwd(dy, x, w, b, mean, rstd, True, False, False)[0]
        for rows, programs, reverse in ((1, 5, False), (2, 1, True), (2, 3, False)):
            assert torch.equal(backward(dy, x, w, mean, rstd, rows, 1, programs, reverse), want), (n, rows)
    print("backward: the same bits as fk's launcher")


def kernel_times(fn: Callable[[], object], reps: int = 50) -> list[tuple[str, float]]:
    """(kernel, mean GPU us a call) of ``fn``'s kernels, the L2 flush's left out."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
    flush_names = [name for name in totals if "fill" in name.lower() or "FillFunctor" in name]
    return [(name[:90], us / reps) for name, us in totals.items() if name not in flush_names]


def timings(args: argparse.Namespace, copy: float) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, w, b, dy = _inputs(ROWS, WIDTH, "cuda")
    share = lambda ms: bench.tbps(3 * 2 * ROWS * WIDTH, ms) / copy  # noqa: E731  (dy, x read; dx written)
    xg = x.clone().requires_grad_()
    compiled = bench.fresh_compile(lambda x, w, b: layer_norm.layer_norm_ref(x, w, b, EPS))
    runs = {"fk": lambda: torch.autograd.grad(layer_norm.layer_norm(xg, w, b, EPS), [xg], dy),
            "torch.compile": lambda: torch.autograd.grad(compiled(xg, w, b), [xg], dy)}  # fmt: skip
    print(f"{ROWS} rows x {WIDTH}, bf16, weight and bias frozen")
    print("-- forward+backward, kernels (us a call, profiler; L2 flushed before each call)")
    for name, fn in runs.items():
        total = 0.0
        for kernel, us in kernel_times(fn):
            print(f"  {name:14} {us:7.2f}  {kernel}")
            total += us
        print(f"  {name:14} {total:7.2f}  total")
    print("-- forward+backward, GPU time (ms), alternating rounds, 100 reps")
    for _ in range(3):
        for name, fn in runs.items():
            print(f"  {name:14} {bench.time_ms(fn, rep=100, gpu_only=True):.4f}")
    _, mean, rstd = layer_norm._layer_norm_fwd(x, w, b, EPS)
    fk_bwd = functools.partial(layer_norm._layer_norm_bwd, dy, x, w, b, mean, rstd, True, False, False)
    ms = bench.time_ms(fk_bwd, rep=100, gpu_only=True)
    print(f"-- backward (dx) alone: fk {ms:.4f} ({share(ms):.1%}), {layer_norm._bwd_tiling(WIDTH, False, False)}")
    for rows, warps, programs, reverse in BACKWARD_LAUNCHES:
        grid = cdiv(ROWS, rows) if programs == "tiles" else programs * sms
        fn = functools.partial(backward, dy, x, w, mean, rstd, rows, warps, grid, reverse)
        ms = bench.time_ms(fn, rep=100, gpu_only=True)
        print(
            f"  {rows} rows x {warps} warps, programs {programs!s:5}, reversed {reverse!s:5}: {ms:.4f} ({share(ms):.1%})"
        )
    print("-- Inductor's generated kernels (the backward's have 'backward' in their file's graph)")
    for path in sorted(glob.glob(os.environ["TORCHINDUCTOR_CACHE_DIR"] + "/**/*.py", recursive=True)):
        text = Path(path).read_text()
        if "@triton.jit" in text and "def triton_" in text and "async_compile" not in text:
            print(f"==== {os.path.basename(path)}")
            print(text[text.index("@triton_heuristics") if "@triton_heuristics" in text else 0 :][:3000])


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, timings)


if __name__ == "__main__":
    main()
