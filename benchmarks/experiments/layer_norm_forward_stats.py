"""#34: LayerNorm's forward at 32768 columns ran at 78.5% of its floor, 0.85x torch.compile's time,
and no launch of fk's one-tile kernel did better (INDEX.md#norm_forward_wide). Why, and what closes it?

Section 1 (no flag): variants of a one-tile forward (one row a program, 16 warps; weight and bias),
bf16, 16384 rows, at 8192-32768 columns:

- ``fk``: ``fk.norms.layer_norm._layer_norm_fwd`` as committed;
- ``one_reduce``: a 1-D kernel whose statistics are one ``tl.reduce`` over the pair ``(d, d * d)``,
  ``d = x - K`` shifted by the row's first element: ``mean = K + mean(d)``, ``var = mean(d^2) - mean(d)^2``;
- ``two_reduce_1d``: that 1-D kernel with two reductions (the mean, then the variance about it);
- ``torch.compile``: ``F.layer_norm`` compiled afresh for each width.

Each is checked against the float64 reference (max error over the largest value), also on rows with a
large mean (1000 + N(0, 1)); then timed as bench_norms times the forward (GPU time, L2 flushed, median).

Section 2 (``--wide-only``), at 32768 columns: ``three_pass``, torch.compile's generated kernel for
``layer_norm_ref`` (bench_norms' peer; read from TORCH_LOGS=output_code): three loops over column tiles
(the sum, the squares about the mean, y), by tile width and warps, with the width an argument and a
compile-time constant (as Inductor's code has it); then fk against a fresh torch.compile of
``layer_norm_ref`` at 8192-32768 columns with bf16 and with fp32 weight and bias.

Section 3 (``--dtypes``): fp32 weight and bias with bf16 and fp32 x, 1024-32768 columns: fk, torch.compile
and ``three_pass`` (width a constant) over tile widths and warps: the data behind ``WIDE_FORWARD``.

Run on a GPU:  python benchmarks/experiments/layer_norm_forward_stats.py [--wide-only | --dtypes]
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


@triton.jit
def _three_pass_row(x_ptr, w_ptr, b_ptr, y_ptr, n_cols, eps, BLOCK_COLS: tl.constexpr):
    # Inductor's forward of layer_norm_ref (its generated code at H = 32768, this probe's second run):
    # one row a program, three loops over column tiles: the sum, the squares about the mean, then y.
    x_row = x_ptr + tl.program_id(0).to(tl.int64) * n_cols
    y_row = y_ptr + tl.program_id(0).to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK_COLS)
    acc = tl.zeros([BLOCK_COLS], tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        mask = start + cols < n_cols
        acc += tl.load(x_row + start + cols, mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    mean = tl.sum(acc, axis=0) / n_cols
    acc = tl.zeros([BLOCK_COLS], tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += tl.where(mask, (x - mean) * (x - mean), 0.0)
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK_COLS):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        b = tl.load(b_ptr + start + cols, mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_row + start + cols, ((x - mean) * rstd * w + b).to(y_ptr.dtype.element_ty), mask)


@triton.jit
def _three_pass_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n_cols, eps, BLOCK_COLS: tl.constexpr):
    _three_pass_row(x_ptr, w_ptr, b_ptr, y_ptr, n_cols, eps, BLOCK_COLS)


@triton.jit
def _three_pass_const_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N_COLS: tl.constexpr, eps, BLOCK_COLS: tl.constexpr):
    # The width as a constant, as Inductor's generated code has it (its loops' trip counts known).
    _three_pass_row(x_ptr, w_ptr, b_ptr, y_ptr, N_COLS, eps, BLOCK_COLS)


def three_pass(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, block: int = 2048,
               warps: int = 8, stages: int = 3, const: bool = False) -> torch.Tensor:  # fmt: skip
    y = torch.empty_like(x)
    kernel = _three_pass_const_kernel if const else _three_pass_kernel
    kernel[(x.shape[0],)](x, w, b, y, x.shape[1], eps, BLOCK_COLS=block, num_warps=warps, num_stages=stages)
    return y


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
            for name, fn in (("fk", fk_forward), ("one_reduce", one_reduce), ("two_reduce_1d", two_reduce_1d),
                             ("three_pass", three_pass)):  # fmt: skip
                args = () if name == "fk" else (32, 1, 3, n == 257) if name == "three_pass" else (1,)
                err = _error(fn(x, w, b, 1e-5, *args), x, w, b, 1e-5)
                assert err < 2e-2, (name, n, large_mean, err)
    print(
        "fk, one_reduce, two_reduce_1d and three_pass (width constant at 257): within 2e-2 of the float64 reference (bf16 out)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wide-only", action="store_true", help="only the column-tile sweep and rounds at 32768")
    parser.add_argument("--dtypes", action="store_true", help="only the fp32-parameter sweep (dtype_sweep)")
    bench.run_probe(parser, check, timings)


def timings(args: argparse.Namespace, copy: float) -> None:
    if args.dtypes:
        dtype_sweep(copy)
        return
    if args.wide_only:
        wide_sweep(copy)
        return
    print(f"{ROWS} rows, bf16, weight and bias; forward GPU time, median")
    for n in WIDTHS:
        print(f"-- H = {n}")
        # A fresh, static-shape compile per width (bench_norms' peer): one shared compile turns dynamic
        # on its second width, and its dynamic kernels ran 2.5x slower (this probe's first run).
        compiled = bench.fresh_compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5))
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
    wide_sweep(copy)


def wide_sweep(copy: float, n: int = 32768) -> None:
    """At ``n`` columns: Inductor's three passes over tile widths and warps,
    then fk against a fresh torch.compile at 8192-32768 columns, with bf16 parameters (bench_norms') and
    with fp32 ones."""
    x, w, b = _inputs(ROWS, n, "cuda", False)
    share = lambda ms: bench.tbps(4 * ROWS * n, ms) / copy  # noqa: E731
    print(f"-- H = {n}: column tiles (ms, share of copy), bf16 weight and bias; the width an argument, and a constant")
    print("   (Triton's 3 stages against 1 changed no time by more than 0.6%: layer_norm_forward_stages_h200.txt)")
    for name, fn in (("three_pass", three_pass),):
        for block in (4096, 8192, 16384):
            for const in (False, True):
                times = {warps: bench.time_ms(functools.partial(fn, x, w, b, 1e-5, block, warps, 3, const), rep=20,
                                              gpu_only=True)
                         for warps in (8, 16, 32)}  # fmt: skip
                print(f"  {name:10} block {block:5} {'constant' if const else 'argument'}: "
                      + "  ".join(f"{k:2} warps {v:.4f} ({share(v):.1%})" for k, v in times.items()))  # fmt: skip
    print("-- fk's forward as committed against a fresh torch.compile of layer_norm_ref (its autotuner picks anew)")
    for width in (8192, 16384, 32768):
        xw, w16, b16 = _inputs(ROWS, width, "cuda", False)
        for dtype in (torch.bfloat16, torch.float32):
            wd, bd = w16.to(dtype), b16.to(dtype)
            compiled = bench.fresh_compile(lambda x, w, b: layer_norm.layer_norm_ref(x, w, b, 1e-5))
            compiled(xw, wd, bd)
            fk_ms = bench.time_ms(functools.partial(fk_forward, xw, wd, bd, 1e-5), rep=20, gpu_only=True)
            tc_ms = bench.time_ms(functools.partial(compiled, xw, wd, bd), rep=20, gpu_only=True)
            share = bench.tbps(4 * ROWS * width, fk_ms) / copy
            print(f"  H = {width:5}, {str(dtype)[6:]:8} weight and bias: fk {fk_ms:.4f} ms ({share:.1%} of copy), "
                  f"torch.compile {tc_ms:.4f} ms ({tc_ms / fk_ms:.3f}x fk's time)")  # fmt: skip


def dtype_sweep(copy: float) -> None:
    """fk's forward against Inductor's three passes (the width a constant) by tile width and warps,
    and a fresh torch.compile, with fp32 parameters (bf16 and fp32 x) at 4096-32768 columns."""
    print("-- fp32 weight and bias: fk's forward as committed, three_pass (width a constant) by block and warps,")
    print("   torch.compile; ms and share of copy (x and y bytes only)")
    for width in (1024, 2048, 4096, 8192, 16384, 32768):
        for x_dtype in (torch.bfloat16, torch.float32):
            x, w, b = _inputs(ROWS, width, "cuda", False)
            x, w, b = x.to(x_dtype), w.float(), b.float()
            nbytes = 2 * x.element_size() * ROWS * width
            share = lambda ms: bench.tbps(nbytes, ms) / copy  # noqa: E731,B023
            compiled = bench.fresh_compile(lambda x, w, b: layer_norm.layer_norm_ref(x, w, b, 1e-5))
            compiled(x, w, b)
            times = {"fk": bench.time_ms(functools.partial(fk_forward, x, w, b, 1e-5), rep=20, gpu_only=True),
                     "torch.compile": bench.time_ms(functools.partial(compiled, x, w, b), rep=20, gpu_only=True)}  # fmt: skip
            for block in (1024, 2048, 4096, 8192):
                for warps in (4, 8, 16, 32):
                    if block <= width and block // (32 * warps) >= 2:
                        fn = functools.partial(three_pass, x, w, b, 1e-5, block, warps, 3, True)
                        times[f"{block}/{warps}"] = bench.time_ms(fn, rep=20, gpu_only=True)
            best = min((k for k in times if "/" in k), key=times.__getitem__)
            print(f"  H = {width:5}, x {str(x_dtype)[6:]:8}: fk {times['fk']:.4f} ({share(times['fk']):.1%}), "
                  f"torch.compile {times['torch.compile']:.4f} ({share(times['torch.compile']):.1%}), "
                  f"three_pass best {best} {times[best]:.4f} ({share(times[best]):.1%}); all: "
                  + " ".join(f"{k} {v:.4f}" for k, v in times.items() if "/" in k))  # fmt: skip


if __name__ == "__main__":
    main()
