"""#34: LayerNorm frozen at H = 1024 is the one forward+backward case of norms.json more than 2% behind
the fastest peer (0.977x torch.compile; fk 0.0497 ms GPU time in the last two records, torch.compile
0.0486-0.0493). Does the width as a compile-time constant (INDEX.md#layer_norm_forward_stats: it took
LayerNorm's forward at 32768 from 0.61 to 0.52 ms) or another row count a tile help fk's one-tile
forward and its frozen backward there? And which configs did torch.compile's autotuner pick?

At 1024 columns, 16384 rows, bf16 x, weight and bias, weight and bias frozen (GPU time, L2 flushed, median):

- forward: fk as committed; fk's ``_layer_norm_fwd_kernel`` called from a kernel whose width is a
  ``tl.constexpr``, ROWS rows a program on W warps;
- backward (dx only): fk's as committed; fk's ``_layer_norm_bwd_kernel`` with a constexpr width, ROWS
  rows a tile on W warps, P programs an SM (persistent), its tiles last first as fk's are at this width;
- forward+backward as bench_norms times it (``torch.autograd.grad``): fk, and a fresh torch.compile of
  ``layer_norm_ref``, whose chosen configs are printed (Inductor's ``.best_config`` files written
  during its compile).

Run on a GPU:  python benchmarks/experiments/layer_norm_narrow_constant_width.py
Check in Triton's interpreter (tiny rows, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv

layer_norm = importlib.import_module("fk.norms.layer_norm")

ROWS = 16384
WIDTH = 1024
EPS = 1e-5
FORWARD_LAUNCHES = [
    (rows, warps) for rows in (1, 2, 4, 8) for warps in (1, 2, 4, 8) if 4 <= rows * WIDTH // (32 * warps) <= 64
]
BACKWARD_LAUNCHES = [(rows, warps, per_sm) for rows in (1, 2, 4) for warps in (2, 4, 8) for per_sm in (16, 32)
                     if 4 <= rows * WIDTH // (32 * warps) <= 32]  # fmt: skip


@triton.jit
def _forward_constant_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, eps, N_COLS: tl.constexpr,
                             BLOCK_COLS: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    layer_norm._layer_norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, N_COLS, N_COLS, eps,
                                      True, True, BLOCK_COLS, ROWS)  # fmt: skip


@triton.jit
def _backward_constant_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, n_rows, N_COLS: tl.constexpr,
                              BLOCK_COLS: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    # dx only (weight and bias frozen), tiles last first.
    layer_norm._layer_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, rstd_ptr, rstd_ptr, n_rows,
                                      N_COLS, N_COLS, N_COLS, True, True, False, False, BLOCK_COLS, ROWS, False,
                                      False, False, True)  # fmt: skip


def forward_constant(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, rows: int, warps: int) -> torch.Tensor:
    m, n = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    _forward_constant_kernel[(cdiv(m, rows),)](x, w, b, y, mean, rstd, m, EPS, N_COLS=n,
                                               BLOCK_COLS=triton.next_power_of_2(n), ROWS=rows, num_warps=warps)  # fmt: skip
    return y


def backward_constant(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                      rows: int, warps: int, programs: int) -> torch.Tensor:  # fmt: skip
    m, n = x.shape
    dx = torch.empty_like(x)
    grid = (min(programs, cdiv(m, rows)),)
    _backward_constant_kernel[grid](dy, x, w, mean, rstd, dx, m, N_COLS=n, BLOCK_COLS=triton.next_power_of_2(n),
                                    ROWS=rows, num_warps=warps)  # fmt: skip
    return dx


def _inputs(m: int, n: int, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(torch.bfloat16)
    b = (0.1 * torch.randn(n, device=device, generator=gen)).to(torch.bfloat16)
    dy = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)
    return x, w, b, dy


def check(device: str) -> None:
    for n in (100, 256):
        x, w, b, dy = _inputs(5, n, device)
        want_y, mean, rstd = layer_norm._layer_norm_fwd(x, w, b, EPS)
        want_dx = layer_norm._layer_norm_bwd(dy, x, w, b, mean, rstd, True, False, False)[0]
        for rows in (1, 2):
            assert torch.equal(forward_constant(x, w, b, rows, 1), want_y), (n, rows)
            assert torch.equal(backward_constant(dy, x, w, mean, rstd, rows, 1, 3), want_dx), (n, rows)
    print("forward_constant and backward_constant: the same bits as fk's launchers")


def _best_configs(since: float) -> list[str]:
    """Inductor's autotuning picks written after ``since`` (its local cache, one file a kernel)."""
    found = [
        p for p in glob.glob("/tmp/torchinductor_*/**/*.best_config", recursive=True) if os.path.getmtime(p) >= since
    ]
    return [Path(p).read_text().strip() for p in sorted(found, key=os.path.getmtime)]


def timings(args: argparse.Namespace, copy: float) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, w, b, dy = _inputs(ROWS, WIDTH, "cuda")
    nbytes = 2 * 2 * ROWS * WIDTH  # forward: x and y; backward: 3 x [M, H], so 1.5x this
    share = lambda ms, k=1.0: bench.tbps(k * nbytes, ms) / copy  # noqa: E731
    print(f"{ROWS} rows x {WIDTH}, bf16, weight and bias frozen; GPU time (ms, share of copy)")
    fk_fwd = bench.time_ms(functools.partial(layer_norm._layer_norm_fwd, x, w, b, EPS), rep=50, gpu_only=True)
    print(f"-- forward: fk {fk_fwd:.4f} ({share(fk_fwd):.1%}), tiling {layer_norm._fwd_tiling(WIDTH)}")
    for rows, warps in FORWARD_LAUNCHES:
        ms = bench.time_ms(functools.partial(forward_constant, x, w, b, rows, warps), rep=50, gpu_only=True)
        print(f"  constant width, {rows} rows x {warps} warps: {ms:.4f} ({share(ms):.1%})")
    _, mean, rstd = layer_norm._layer_norm_fwd(x, w, b, EPS)
    fk_bwd = functools.partial(layer_norm._layer_norm_bwd, dy, x, w, b, mean, rstd, True, False, False)
    ms = bench.time_ms(fk_bwd, rep=50, gpu_only=True)
    print(f"-- backward (dx): fk {ms:.4f} ({share(ms, 1.5):.1%}), tiling {layer_norm._bwd_tiling(WIDTH, False, False)}, "
          f"{layer_norm.partial_rows(ROWS, WIDTH, x.device, False, False)} programs")  # fmt: skip
    for rows, warps, per_sm in BACKWARD_LAUNCHES:
        fn = functools.partial(backward_constant, dy, x, w, mean, rstd, rows, warps, per_sm * sms)
        ms = bench.time_ms(fn, rep=50, gpu_only=True)
        print(f"  constant width, {rows} rows x {warps} warps, {per_sm} an SM: {ms:.4f} ({share(ms, 1.5):.1%})")
    xg = x.clone().requires_grad_()
    began = time.time()
    compiled = bench.fresh_compile(lambda x, w, b: layer_norm.layer_norm_ref(x, w, b, EPS))
    runs = {"fk": lambda: torch.autograd.grad(layer_norm.layer_norm(xg, w, b, EPS), [xg], dy),
            "torch.compile": lambda: torch.autograd.grad(compiled(xg, w, b), [xg], dy)}  # fmt: skip
    runs["torch.compile"]()
    print("-- forward+backward (torch.autograd.grad, as bench_norms)")
    for _ in range(2):  # alternating rounds
        for name, fn in runs.items():
            ms = bench.time_ms(fn, rep=50, gpu_only=True)
            print(f"  {name:14} {ms:.4f} ({share(ms, 2.5):.1%})")
    print("-- torch.compile's autotuning picks (forward and backward kernels):")
    for config in _best_configs(began):
        print(f"  {config}")


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, timings)


if __name__ == "__main__":
    main()
