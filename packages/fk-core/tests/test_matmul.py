"""fk.core.matmul: the bf16 split of an fp32 matrix, and the bf16 x fp32 matmul built on it (exact
against ``x.float() @ w.T`` to fp32 accumulation; on a GPU through one fp32-output bf16 matmul);
fp32 accumulation over chunks; the fp32 column sum."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.matmul import (
    accumulate_mm,
    bf16_parts,
    column_sum,
    has_fp32_out_matmul,
    mm_bf16_fp32,
    scaled_mm,
    split_bf16,
)


def test_split_parts_sum_to_the_matrix() -> None:
    w = testing.random_tensor((16, 300), torch.float32, "cpu", seed=1) * 0.03
    parts = split_bf16(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (48, 300)
    hi, mid, lo = parts.float().split(16)
    assert torch.equal(hi + mid + lo, w)  # fp32's 24 bits in 3 x 8: exact here
    assert not torch.equal(hi, w)  # the test tells a single bf16 rounding apart


def test_two_parts_hold_16_bits() -> None:
    w = testing.random_tensor((16, 300), torch.float32, "cpu", seed=1) * 0.03
    parts = split_bf16(w, n_parts=2)
    assert parts.dtype == torch.bfloat16 and parts.shape == (32, 300)
    hi, mid = parts.float().split(16)
    assert torch.equal(hi, w.to(torch.bfloat16).float())  # the first part is w in bf16
    error = ((hi + mid) - w).abs()
    assert (error <= 2.0**-16 * w.abs()).all()
    assert error.max() > 0 and ((hi - w).abs() > 2.0**-16 * w.abs()).any()  # hi alone is not enough
    with pytest.raises(ValueError, match="n_parts"):
        split_bf16(w, n_parts=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=testing.dtype_name)
def test_mm_bf16_fp32_rounds_once_into_out(device: str, dtype: torch.dtype) -> None:
    x = testing.random_tensor((300, 4100), torch.bfloat16, device, seed=7)
    w = testing.random_tensor((16, 4100), torch.float32, device, seed=8) * 4100**-0.5
    out = torch.full((300, 16), float("nan"), dtype=dtype, device=device)
    rounded = dtype != torch.float32  # two parts are enough for a result rounded to 16 bits
    got = mm_bf16_fp32(x, w, bf16_parts(w, n_parts=2 if rounded else 3), out=out)
    assert got is out
    want = x.double() @ w.double().t()
    if rounded:  # one rounding of the fp32 product (the two-part split's 2^-16 is far below it)
        ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
        torch.testing.assert_close(got.double(), want, rtol=ulp, atol=ulp * 1e-2)
        # The product of w rounded to bf16 (the split's first part alone) is outside that.
        coarse = x.double() @ w.to(torch.bfloat16).double().t()
        assert ((coarse - want).abs() > ulp * (want.abs() + 1e-2)).any()
    else:
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * 4100**0.5)


@pytest.mark.parametrize(("rows", "cols", "rank"), [(1, 7, 3), (33, 130, 16), (257, 4100, 8)])
def test_mm_bf16_fp32_is_the_fp32_product(device: str, rows: int, cols: int, rank: int) -> None:
    x = testing.random_tensor((rows, cols), torch.bfloat16, device, seed=rows)
    w = testing.random_tensor((rank, cols), torch.float32, device, seed=cols) * cols**-0.5
    got = mm_bf16_fp32(x, w)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, rank)
    # fp32 accumulation over cols terms, against float64: a few fp32 ulps of the largest partial sums.
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * cols**0.5)
    # A bf16 matmul (w rounded to bf16) is far outside that: the tolerance tells the two apart.
    rounded = (x.float() @ w.to(torch.bfloat16).float().t()).double()
    assert (rounded - want).abs().max() > 10 * 2e-6 * cols**0.5


def test_fp32_out_matmul_only_on_cuda() -> None:
    assert not has_fp32_out_matmul(torch.device("cpu"))


def test_mm_bf16_fp32_takes_the_parts_split_once(device: str) -> None:
    x = testing.random_tensor((70, 300), torch.bfloat16, device, seed=3)
    w = testing.random_tensor((16, 300), torch.float32, device, seed=4) * 0.05
    parts = bf16_parts(w)
    assert (parts is None) == (not has_fp32_out_matmul(w.device))
    whole = mm_bf16_fp32(x, w)
    # Chunks of rows against one split: the same rows as the unchunked product.
    chunked = torch.cat([mm_bf16_fp32(x[i : i + 32], w, parts) for i in range(0, 70, 32)])
    torch.testing.assert_close(chunked, whole, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("alpha", [1.0, 0.37])
@pytest.mark.parametrize("out_dtype", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=testing.dtype_name)
def test_scaled_mm(device: str, dtype: torch.dtype, out_dtype: str, alpha: float) -> None:
    a = testing.random_tensor((37, 1030), dtype, device, seed=9)
    b = testing.random_tensor((1030, 19), dtype, device, seed=10)
    want_dtype = dtype if out_dtype == "same" else torch.float32
    got = scaled_mm(a, b, alpha, want_dtype)
    assert got.dtype == want_dtype and got.shape == (37, 19)
    want = alpha * (a.double() @ b.double())
    fp32_sums = want_dtype == torch.float32 and (dtype == torch.float32 or has_fp32_out_matmul(a.device))
    if fp32_sums:  # one fp32 result: a few fp32 ulps of the 1030-term sums
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * 1030**0.5)
    else:  # a product in the inputs' dtype: one rounding of it
        ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
        torch.testing.assert_close(got.double(), want, rtol=2 * ulp, atol=2 * ulp)
    if alpha != 1.0:  # the scale is applied, not dropped
        assert not torch.allclose(got.double(), want / alpha, rtol=0.1, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accumulate_mm_sums_chunks_in_the_accumulators_dtype(device: str, dtype: torch.dtype) -> None:
    a = testing.random_tensor((5, 301), dtype, device, seed=5)
    b = testing.random_tensor((301, 37), dtype, device, seed=6)
    acc = torch.full((5, 37), float("nan"), dtype=torch.float32, device=device)  # "first" overwrites
    for i, start in enumerate(range(0, 301, 100)):
        accumulate_mm(acc, a[:, start : start + 100], b[start : start + 100], first=i == 0)
    want = a.double() @ b.double()
    torch.testing.assert_close(acc.double(), want, rtol=1e-5, atol=1e-5)
    # Rounding each chunk's product to the inputs' dtype would be outside that tolerance.
    if dtype != torch.float32:
        rounded = sum((a[:, s : s + 100] @ b[s : s + 100]).double() for s in range(0, 301, 100))
        assert (rounded - want).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=testing.dtype_name)
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (1, 7), (37, 130), (1000, 3)])
def test_column_sum_is_the_fp32_sum_of_the_rows(device: str, dtype: torch.dtype, rows: int, cols: int) -> None:
    t = testing.random_tensor((rows, cols), dtype, device, seed=rows + cols)
    got = column_sum(t)
    want = t.double().sum(0)
    assert got.dtype == torch.float32 and got.shape == (cols,)
    # fp32 sums of exact inputs: a few fp32 ulps of the largest partial sums; a bf16 or fp16 sum
    # (about 3 significant digits) is far outside this for 37 and 1000 rows.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * rows**0.5)


@pytest.mark.parametrize("layout", ["row_slice", "expanded", "transposed", "empty"])
def test_column_sum_of_any_layout(device: str, layout: str) -> None:
    base = testing.random_tensor((40, 96), torch.bfloat16, device, seed=5)
    t = {"row_slice": base[:, 10:70], "expanded": base[3].expand(40, 96), "transposed": base.t(),
         "empty": base[:0]}[layout]  # fmt: skip
    torch.testing.assert_close(column_sum(t).double(), t.double().sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_column_sum_allocates_no_staging_buffer() -> None:
    # Peak memory, not the profiler's allocations: a staging buffer freed inside the op nets zero there.
    from fk.core import bench

    t = torch.randn(16384, 32768, device="cuda", dtype=torch.bfloat16)
    column_sum(t)
    staged = bench.peak_memory_bytes(lambda: t.sum(0, dtype=torch.float32))
    if staged < 1 << 20:  # (256 MiB with torch 2.11 on an H200)
        pytest.skip("torch's own column reduction allocates no staging buffer here: nothing to tell apart")
    assert bench.peak_memory_bytes(lambda: column_sum(t)) < 1 << 20  # the 128 KiB result, the 32 KiB ones
