"""#32: QLoRA's O at 4096 tokens stays at 88% of its floor (the dequantization bytes and the base
GEMMs at the matmul ceiling) and QKV with dropout at 80%. Beside the base GEMMs a LoRA layer runs
rank-16 products, each of which reads a whole ``[tokens, features]`` activation: ``x A^T`` and
``dy B`` (``[M, r]`` from ``[M, K]``), ``dA = (s G)^T x`` and ``dB = dy^T xa`` (``[r, K]``, a sum
over the M rows). cuBLAS runs them at 4096 tokens in 11-13 us each, with split-K reductions and
memsets beside them (`dora_profile_qlora_dropout_h200.txt`): about 85 us of O's 468, where reading
the activations four times at the copy speed takes 31 us. Do Triton kernels of fk's read them
closer to the copy speed?

- ``skinny``: ``out = x A^T``, ``[M, K] x [K, r]``: a program a block of rows, the K axis in steps
  of BLOCK_K, split over SPLITS programs (fp32 partials added by ``fk.core.reduce.sum_rows``)
  where the row blocks alone leave SMs idle;
- ``reduce_rows``: ``out = G^T x``, ``[r, M] x [M, K]``: programs own a strip of columns and every
  P-th block of rows, fp32 partial blocks added by ``sum_rows`` (``fk.lora.masked_a_grad``'s
  layout, without the masks);

each against ``torch.mm`` (cuBLAS) on the same operands, r = 16, bf16 in and out, fp32 sums, at
4096 and 16384 rows of 4096; GPU time (median of ``triton.testing.do_bench``, L2 flushed) and the
share of the copy speed (a bf16 copy of x, same run) that reading x once would take.

Run on a GPU:  python benchmarks/experiments/rank_products.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv, column_strip_grid, multiprocessor_count
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, round_to

K, R = 4096, 16


@triton.jit
def _skinny_kernel(x_ptr, a_ptr, out_ptr, partials_ptr, n_rows, n_cols, x_row_stride, a_row_stride, cols_per_split,
                   RANK: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    split = tl.program_id(1)
    ks = tl.arange(0, RANK)
    row_ok = rows < n_rows
    acc = tl.zeros((BLOCK_ROWS, RANK), dtype=tl.float32)
    start = split * cols_per_split
    for k0 in range(start, tl.minimum(start + cols_per_split, n_cols), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < n_cols
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)  # fmt: skip
        a_t = tl.load(a_ptr + ks[None, :] * a_row_stride + cols[:, None], mask=col_ok[:, None], other=0.0)
        acc += exact_dot(x, a_t)
    if SPLIT:
        out = partials_ptr + (split.to(tl.int64) * n_rows + rows[:, None]) * RANK + ks[None, :]
        tl.store(out, acc, mask=row_ok[:, None])
    else:
        tl.store(out_ptr + rows[:, None] * RANK + ks[None, :], round_to(acc, out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])  # fmt: skip


def skinny(x: torch.Tensor, a: torch.Tensor, block_rows: int, block_k: int, warps: int, stages: int,
           splits: int) -> torch.Tensor:  # fmt: skip
    """``x @ a.T`` for ``x`` ``[M, K]`` and ``a`` ``[r, K]`` (r a power of two, 16 or more)."""
    m, k = x.shape
    r = a.shape[0]
    cols_per_split = cdiv(cdiv(k, block_k), splits) * block_k
    splits = cdiv(k, cols_per_split)
    out = torch.empty((m, r), dtype=x.dtype, device=x.device)
    partials = torch.empty((splits, m, r), dtype=torch.float32, device=x.device) if splits > 1 else out
    _skinny_kernel[(cdiv(m, block_rows), splits)](x, a, out, partials, m, k, x.stride(0), a.stride(0), cols_per_split,
                                                  RANK=r, BLOCK_ROWS=block_rows, BLOCK_K=block_k, SPLIT=splits > 1,
                                                  num_warps=warps, num_stages=stages)  # fmt: skip
    if splits > 1:
        out = sum_rows(partials.view(splits, m * r), x.dtype).view(m, r)
    return out


@triton.jit
def _reduce_rows_kernel(g_ptr, x_ptr, partials_ptr, n_rows, n_cols, g_row_stride, x_row_stride, RANK: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):  # fmt: skip
    group, groups = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    ks = tl.arange(0, RANK)
    acc = tl.zeros((RANK, BLOCK_COLS), dtype=tl.float32)
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)  # fmt: skip
        g = tl.load(g_ptr + rows[:, None] * g_row_stride + ks[None, :], mask=row_ok[:, None], other=0.0)
        acc += exact_dot(tl.trans(g), x)
    out = partials_ptr + (group.to(tl.int64) * RANK + ks[:, None]) * n_cols + cols[None, :]
    tl.store(out, acc, mask=col_ok[None, :])


def reduce_rows(g: torch.Tensor, x: torch.Tensor, block_rows: int, block_cols: int, warps: int,
                programs_per_sm: int) -> torch.Tensor:  # fmt: skip
    """``g.T @ x`` for ``g`` ``[M, r]`` and ``x`` ``[M, K]``."""
    m, k = x.shape
    r = g.shape[1]
    groups, strips = column_strip_grid(m, k, block_rows, block_cols, x.device, programs_per_sm)
    partials = torch.empty((groups, r, k), dtype=torch.float32, device=x.device)
    _reduce_rows_kernel[(groups, strips)](g, x, partials, m, k, g.stride(0), x.stride(0), RANK=r,
                                          BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps)  # fmt: skip
    return sum_rows(partials.view(groups, r * k), x.dtype).view(r, k)


def _inputs(m: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(m + k)
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    a = (0.05 * torch.randn(R, k, device=device, generator=gen)).to(torch.bfloat16)
    g = torch.randn(m, R, device=device, generator=gen).to(torch.bfloat16)
    return x, a, g


def check(device: str) -> None:
    for m, k in ((40, 200), (17, 300)):
        x, a, g = _inputs(m, k, device)
        want = x.double() @ a.double().t()
        for splits in (1, 3):
            got = skinny(x, a, 16, 64, 1, 1, splits)
            torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
        want_t = g.double().t() @ x.double()
        torch.testing.assert_close(reduce_rows(g, x, 16, 64, 1, 1).double(), want_t, rtol=1e-2, atol=2e-2)
    print("skinny and reduce_rows: within bf16 rounding of float64")


def ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, rep=30, return_mode="median"))


def timings() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    sms = multiprocessor_count(torch.device("cuda"))
    for m in (4096, 16384):
        x, a, g = _inputs(m, K, "cuda")
        out = torch.empty_like(x)
        copy_ms = ms(lambda: out.copy_(x))  # noqa: B023
        read_ms = copy_ms / 2  # reading x once at the copy speed (a copy reads and writes)
        print(f"== {m} x {K}, r = {R}: copy of x {copy_ms:.4f} ms; reading x once at that speed {read_ms * 1e3:.1f} us")

        def row(label: str, t: float) -> None:
            print(f"  {label:48s} {t * 1e3:7.1f} us  ({read_ms / t:5.1%} of copy)", flush=True)  # noqa: B023

        row("cuBLAS x @ A^T", ms(lambda: torch.mm(x, a.t())))  # noqa: B023
        for bm, bk, warps, stages in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4)):
            for splits in sorted({1, max(1, cdiv(2 * sms, cdiv(m, bm)))}):
                try:
                    t = ms(lambda: skinny(x, a, bm, bk, warps, stages, splits))  # noqa: B023
                except triton.runtime.errors.OutOfResources:
                    continue
                row(f"skinny ({bm}, {bk}, {warps} warps, {stages} stages, {splits} splits)", t)
        row("cuBLAS G^T @ x", ms(lambda: torch.mm(g.t(), x)))  # noqa: B023
        for br, bc, warps, per_sm in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8), (4, 8)):
            if bc * warps > 1024:
                continue
            try:
                t = ms(lambda: reduce_rows(g, x, br, bc, warps, per_sm))  # noqa: B023
            except triton.runtime.errors.OutOfResources:
                continue
            row(f"reduce_rows ({br}, {bc}, {warps} warps, {per_sm} an SM)", t)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
