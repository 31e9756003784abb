"""#34: LayerNorm's forward at 32768 columns runs at 78.5% of its floor, 0.85x torch.compile's time,
and no launch of fk's kernel does better (INDEX.md#norm_forward_wide). Its one-tile path reduces each
row twice, block-wide, between the row's load and its store: the mean, then the variance about it.
RMSNorm's reduces once and runs at 94%. Does one reduction of the pair (sum d, sum d^2), with d = x - K
shifted by the row's first element K (as the looped path shifts by its first tile's mean), close the gap,
at what cost in accuracy?

Variants of the one-tile forward (one row a program, the whole row in one tile, 16 warps; weight and
bias), bf16, 16384 rows:

- ``fk``: ``fk.norms.layer_norm._layer_norm_fwd`` as committed (mean, then the variance about it);
- ``one_reduce``: a 1-D kernel of the same math but the statistics, one ``tl.reduce`` over the pair
  ``(d, d * d)``: ``mean = K + mean(d)``, ``var = mean(d^2) - mean(d)^2``;
- ``two_reduce_1d``: that 1-D kernel with fk's two reductions (which of the two changes matters;
  compiled for sm_90 on the CPU, all three use 127-128 registers a thread on 16 warps and spill
  nothing; one reduction takes 2 barriers, two take 5);
- ``torch.compile``: ``F.layer_norm`` compiled (Inductor's looped Welford reduction).

Each is checked against the float64 reference (max error over the largest value, printed), also on
rows with a large mean (1000 + N(0, 1)) where the shifted sums cancel most; then timed as bench_norms
times the forward (GPU time, L2 flushed, median).

Run on a GPU:  python benchmarks/experiments/layer_norm_forward_stats.py   (output: layer_norm_forward_stats_h200.txt)
Check in Triton's interpreter (tiny rows, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import functools
import importlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fk.core import bench

layer_norm = importlib.import_module("fk.norms.layer_norm")

ROWS = 16384
WIDTHS = [8192, 16384, 32768]
WARPS = 16


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, BLOCK_COLS: tl.constexpr, ONE_REDUCE: tl.constexpr
):
    # One row a program as a 1-D tile (fk's kernel: a [ROWS, BLOCK_COLS] tile with ROWS = 1).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if ONE_REDUCE:
        shift = tl.load(x_ptr + row * n_cols).to(tl.float32)  # K: the row's first element
        d = tl.where(mask, x - shift, 0.0)
        sum_d, sum_d2 = tl.reduce((d, d * d), axis=0, combine_fn=_add_pairs)
        mean_d = sum_d / n_cols
        rstd = tl.rsqrt(tl.maximum(sum_d2 / n_cols - mean_d * mean_d, 0.0) + eps)
    else:  # fk's: the mean, then the variance about it
        shift = tl.sum(x, axis=0) / n_cols
        d = tl.where(mask, x - shift, 0.0)
        mean_d = 0.0
        rstd = tl.rsqrt(tl.sum(d * d, axis=0) / n_cols + eps)
    tl.store(mean_ptr + row, shift + mean_d)
    tl.store(rstd_ptr + row, rstd)
    y = (d - mean_d) * rstd
    y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def one_row(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, warps: int = WARPS, one_reduce: bool = True
) -> torch.Tensor:
    m, n = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    _fwd_kernel[(m,)](x, w, b, y, mean, rstd, n, eps, BLOCK_COLS=triton.next_power_of_2(n), ONE_REDUCE=one_reduce,
                      num_warps=warps)  # fmt: skip
    return y


def one_reduce(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, warps: int = WARPS) -> torch.Tensor:
    return one_row(x, w, b, eps, warps, one_reduce=True)


def two_reduce_1d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, warps: int = WARPS) -> torch.Tensor:
    return one_row(x, w, b, eps, warps, one_reduce=False)


def fk_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return layer_norm._layer_norm_fwd(x, w, b, eps)[0]


def _error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> float:
    want = F.layer_norm(x.double(), (x.shape[-1],), w.double(), b.double(), eps)
    return float((got.double() - want).abs().max() / want.abs().max())


def _inputs(m: int, n: int, device: str, large_mean: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(m, n, device=device, generator=gen) + (1000.0 if large_mean else 0.0)
    w = torch.randn(n, device=device, generator=gen)
    b = torch.randn(n, device=device, generator=gen)
    return x.to(torch.bfloat16), w.to(torch.bfloat16), b.to(torch.bfloat16)


def check(device: str) -> None:
    for n in (100, 257):
        for large_mean in (False, True):
            x, w, b = _inputs(5, n, device, large_mean)
            for name, fn in (("fk", fk_forward), ("one_reduce", one_reduce), ("two_reduce_1d", two_reduce_1d)):
                err = _error(fn(x, w, b, 1e-5) if name == "fk" else fn(x, w, b, 1e-5, 1), x, w, b, 1e-5)
                assert err < 2e-2, (name, n, large_mean, err)
    print("fk, one_reduce and two_reduce_1d: within 2e-2 of the float64 reference (bf16 out)")


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, timings)


def timings(args: argparse.Namespace, copy: float) -> None:
    print(f"{ROWS} rows, bf16, weight and bias; forward GPU time, median")
    compiled = torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5))
    for n in WIDTHS:
        print(f"-- H = {n}")
        for large_mean in (False, True):
            x, w, b = _inputs(64, n, "cuda", large_mean)
            errors = {name: _error(fn(x, w, b, 1e-5), x, w, b, 1e-5)
                      for name, fn in (("fk", fk_forward), ("one_reduce", one_reduce),
                                       ("two_reduce_1d", two_reduce_1d))}  # fmt: skip
            print(f"  error / max |y| ({'mean 1000' if large_mean else 'mean 0'}): "
                  + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))  # fmt: skip
        x, w, b = _inputs(ROWS, n, "cuda", False)
        calls = {"fk": functools.partial(fk_forward, x, w, b, 1e-5),
                 "one_reduce": functools.partial(one_reduce, x, w, b, 1e-5),
                 "two_reduce_1d": functools.partial(two_reduce_1d, x, w, b, 1e-5),
                 "torch.compile": functools.partial(compiled, x, w, b)}  # fmt: skip
        for name, fn in calls.items():
            ms = bench.time_ms(fn, rep=20, gpu_only=True)
            share = bench.tbps(4 * ROWS * n, ms) / copy
            print(f"  {name:14} {ms:.4f} ms  {share:6.1%} of copy")


if __name__ == "__main__":
    main()
