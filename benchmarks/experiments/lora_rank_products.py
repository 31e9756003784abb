"""#32: QLoRA's O rows at 4096 tokens need about 20 us less GPU time (0.490 ms, at 86% of the floor
where 90.9% is the target), and its rank-16 products take 81 us of it (INDEX.md#qlora_profile_4096):
each reads ``x`` or ``dy`` (32 MB at 4096 x 4096, bf16: 7.5 us at the copy bandwidth) and cuBLAS
runs each in 11-14 us, with split-K reductions besides. How close to the bytes can a Triton kernel
get on each of them?

The four products of one projection (``x`` ``[M, K]``, ``dy`` ``[M, N]``, ``A`` ``[r, K]``, ``B``
``[N, r]``, r = 16, bf16 in and out, fp32 sums):

- ``xa = x A^T`` and ``gs = s dy B``: a tall matrix times a small one. ``rows``: each program owns
  ``BM`` rows and walks the long dimension (or one of ``SPLIT`` ranges of it, writing an fp32
  partial that torch sums, timed with it) in ``BK`` columns, the ``[BM, r]`` sum in registers.
- ``dB = s dy^T xa`` and ``dA = gs^T x`` (as ``(x^T gs)^T``): a sum over the M rows into a small
  output. ``cols``: programs own ``BN`` columns of the tall matrix and a range of its rows
  (``SPLIT`` ranges), each writing an fp32 partial ``[BN, r]``; one torch sum over the ranges (timed
  with it).

Each variant is checked against torch's product in fp32 (relative error under 1e-2) and timed as
fk.core.bench times (GPU time, median); ``floor`` is the tall matrix's bytes at the copy bandwidth
measured in the same run.

Run on a GPU:  python benchmarks/experiments/lora_rank_products.py   (output: lora_rank_products_h200.txt,
               run at 46426aa, before SPLIT and the stages were swept)
               python benchmarks/experiments/lora_rank_products.py --products xa gs
               (output: lora_rank_products_split_h200.txt)
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv
from fk.core.tiles import exact_dot

R = 16
SHAPES = [(4096, 4096, 4096), (4096, 4096, 1024), (16384, 4096, 4096)]  # (M, K, N): O, k/v, O at 16384 tokens
# (BM, BK, SPLIT, warps, stages): SPLIT > 1 splits K over that many programs a row block, each writing
# an fp32 partial [M, R] summed by torch (timed with it); the first run had SPLIT 1 and 3 stages only.
ROWS_SPACE = [(bm, bk, split, w, stages) for bm in (32, 64, 128) for bk in (128, 256) for split in (1, 4, 8, 16)
              for w in (4, 8) for stages in (3, 4)]  # fmt: skip
COLS_SPACE = [(bn, bm, split, w) for bn in (64, 128) for bm in (32, 64) for split in (4, 8, 16) for w in (4, 8)]


@triton.jit
def _rows_kernel(
    x_ptr,  # [M, K], row stride stride_x, unit column stride
    y_ptr,  # [R, K] as strides (stride_yr, stride_yk): A, or B^T
    out_ptr,  # [M, R] contiguous, or [SPLIT, M, R] fp32 partials
    M,
    K,
    stride_x,
    stride_yr,
    stride_yk,
    scale,
    k_per_split,  # columns of K a program takes (a multiple of BK)
    R: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    # out = scale * x y^T, BM rows and one range of K a program, the [BM, R] sum in registers over its
    # range in BK columns; program (i, s) writes partial s of rows block i.
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    r = tl.arange(0, R)
    acc = tl.zeros([BM, R], dtype=tl.float32)
    k_first = tl.program_id(1) * k_per_split
    for k0 in range(k_first, tl.minimum(k_first + k_per_split, K), BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        xt = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        yt = tl.load(y_ptr + ks[:, None] * stride_yk + r[None, :] * stride_yr, mask=k_ok[:, None], other=0.0)
        acc += exact_dot(xt, yt)  # yt: [BK, R], y^T's tile
    out = (acc * scale).to(out_ptr.dtype.element_ty)
    partial = tl.program_id(1).to(tl.int64) * M * R
    tl.store(out_ptr + partial + rows.to(tl.int64)[:, None] * R + r[None, :], out, mask=row_ok[:, None])


@triton.jit
def _cols_kernel(
    x_ptr,  # [M, N], row stride stride_x, unit column stride
    z_ptr,  # [M, R], row stride stride_z
    partial_ptr,  # [SPLIT, N, R] fp32
    M,
    N,
    stride_x,
    stride_z,
    rows_per_split,
    R: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
):
    # partial[s] = x[rows of range s]^T z[same rows]: BN columns of x and one row range a program.
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    col_ok = cols < N
    r = tl.arange(0, R)
    first = tl.program_id(1) * rows_per_split
    last = tl.minimum(first + rows_per_split, M)
    acc = tl.zeros([BN, R], dtype=tl.float32)
    for m0 in range(first, last, BM):
        ms = m0 + tl.arange(0, BM)
        m_ok = ms < last
        xt = tl.load(
            x_ptr + ms.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0
        )
        zt = tl.load(z_ptr + ms.to(tl.int64)[:, None] * stride_z + r[None, :], mask=m_ok[:, None], other=0.0)
        acc += exact_dot(tl.trans(xt), zt)
    out = partial_ptr + tl.program_id(1).to(tl.int64) * N * R + cols[:, None] * R + r[None, :]
    tl.store(out, acc, mask=col_ok[:, None])


def rows_product(
    x: torch.Tensor, y: torch.Tensor, scale: float, bm: int, bk: int, split: int, warps: int, stages: int
) -> torch.Tensor:
    """``scale * x y^T`` for ``x`` ``[M, K]`` and ``y`` ``[R, K]`` (any strides), in x's dtype."""
    m, k = x.shape
    per_split = cdiv(cdiv(k, split), bk) * bk
    out = torch.empty(m, R, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.empty(split, m, R, dtype=torch.float32, device=x.device)  # fmt: skip
    _rows_kernel[(cdiv(m, bm), split)](x, y, out, m, k, x.stride(0), y.stride(0), y.stride(1), scale, per_split,
                                       R=R, BM=bm, BK=bk, num_warps=warps, num_stages=stages)  # fmt: skip
    return out if split == 1 else out.sum(0).to(x.dtype)


def cols_product(
    x: torch.Tensor, z: torch.Tensor, scale: float, bn: int, bm: int, split: int, warps: int
) -> torch.Tensor:
    """``scale * x^T z`` ``[N, R]`` for ``x`` ``[M, N]`` and ``z`` ``[M, R]``, in x's dtype."""
    m, n = x.shape
    per_split = cdiv(cdiv(m, split), bm) * bm
    partial = torch.empty(split, n, R, dtype=torch.float32, device=x.device)
    _cols_kernel[(cdiv(n, bn), split)](x, z, partial, m, n, x.stride(0), z.stride(0), per_split,
                                       R=R, BN=bn, BM=bm, num_warps=warps)  # fmt: skip
    return (partial.sum(0) * scale).to(x.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    err = (got.float() - want.float()).abs().max()
    return bool(err <= 1e-2 * want.float().abs().max() + 1e-3)


Case = tuple[Callable[[], torch.Tensor], Callable[..., torch.Tensor], int]


def _cases(m: int, k: int, n: int, device: str) -> dict[str, Case]:
    """name: (torch's product, the Triton product taking a launch config, bytes of the tall matrix)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    x, dy, a, b = randn(m, k), randn(m, n), randn(R, k) * k**-0.5, randn(n, R) * R**-0.5
    xa, gs = x @ a.t(), dy @ b
    s = 2.0
    return {
        "xa = x A^T": (lambda: x @ a.t(), lambda *c: rows_product(x, a, 1.0, *c), m * k * 2),
        "gs = s dy B": (lambda: (dy @ b) * s, lambda *c: rows_product(dy, b.t(), s, *c), m * n * 2),
        "dB = s dy^T xa": (lambda: (dy.t() @ xa) * s, lambda *c: cols_product(dy, xa, s, *c), m * n * 2),
        "dA = gs^T x": (lambda: gs.t() @ x, lambda *c: cols_product(x, gs, 1.0, *c).t(), m * k * 2),
    }


def check(device: str) -> None:
    for m, k, n in [(40, 96, 80), (33, 130, 70)]:
        for name, (want, fk_call, _) in _cases(m, k, n, device).items():
            space = [(16, 32, 1, 1, 1), (16, 32, 3, 1, 2)] if name.startswith(("xa", "gs")) else [(16, 16, 3, 1)]
            for config in space:
                assert _close(fk_call(*config), want()), (name, m, k, n, config)
    print("rows and cols kernels: within 1e-2 of torch's products")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--products", nargs="+", default=["xa", "gs", "dB", "dA"], choices=["xa", "gs", "dB", "dA"])
    bench.run_probe(parser, check, timings)


def timings(args: argparse.Namespace, copy: float) -> None:
    print(f"r = {R}, bf16; GPU time, median (us)")
    for m, k, n in SHAPES:
        print(f"-- M = {m}, K = {k}, N = {n}")
        for name, (want, fk_call, nbytes) in _cases(m, k, n, "cuda").items():
            if name.split()[0] not in args.products:
                continue
            space = ROWS_SPACE if name.startswith(("xa", "gs")) else COLS_SPACE
            expected = want()
            torch_us = bench.time_ms(want, gpu_only=True) * 1e3
            times = {}
            for config in space:
                try:
                    got = fk_call(*config)
                except triton.runtime.errors.OutOfResources:
                    continue
                assert _close(got, expected), (name, config)
                times[config] = bench.time_ms(lambda config=config, fn=fk_call: fn(*config), gpu_only=True) * 1e3
            best = sorted(times.items(), key=lambda item: item[1])[:3]
            floor_us = nbytes / (copy * 1e12) * 1e6
            tops = ", ".join(f"{config} {us:.1f}" for config, us in best)
            print(f"  {name:16} torch {torch_us:6.1f}  floor {floor_us:5.1f}  triton best: {tops}")


if __name__ == "__main__":
    main()
