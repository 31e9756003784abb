"""fk.lora's DoRA elementwise kernels against float64: the forward's ``y = ms z + b`` without dropout,
its ``y`` and ``z`` with dropout, and the backward's ``dmag``, ``db``, ``dy_ms`` and ``dy_ms1`` from
one pass over ``dy``."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.backend import uses_kernel
from fk.core.testing import DTYPES, dtype_name
from fk.lora.dora_elementwise import (
    LowRank,
    dora_dropout_output,
    dora_dropout_output_ref,
    dora_dropout_output_torch,
    dora_grad_terms,
    dora_grad_terms_ref,
    dora_grad_terms_torch,
    dora_scaled_output,
    dora_scaled_output_ref,
    dora_scaled_output_torch,
)

SHAPES = [(1, 1), (7, 130), (37, 257), (45, 600)]  # (M, N): odd rows, widths not a power of two
RANKS = {1: 1, 130: 5, 257: 16, 600: 33}  # r per N: below, at and above one rank step of 16

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def _scale(n: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ms, n)`` fp32 ``[N]``: ms around 1 (DoRA's start), the norm positive."""
    ms = testing.random_tensor((n,), torch.float32, device, seed=seed, scale=0.3, offset=1.0)
    norm = testing.random_tensor((n,), torch.float32, device, seed=seed + 1, scale=0.2, offset=2.0)
    return ms, norm


def _forward_inputs(
    m: int, n: int, r: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, LowRank]:
    base, zd = (testing.random_tensor((m, n), dtype, device, seed=seed + i) for i in range(2))
    xa = testing.random_tensor((m, r), dtype, device, seed=seed + 2)
    B = testing.random_tensor((n, r), dtype, device, seed=seed + 3, scale=r**-0.5)
    return base, zd, LowRank(xa, B, 2.0)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_scaled_output_matches_reference(device: str, dtype: torch.dtype, m: int, n: int, with_bias: bool) -> None:
    z = testing.random_tensor((m, n), dtype, device, seed=1)
    ms, _ = _scale(n, device, seed=2)
    bias = testing.random_tensor((n,), dtype, device, seed=3) if with_bias else None
    y = dora_scaled_output(z, ms, bias)
    baseline = dora_scaled_output_torch(z, ms, bias)
    assert y.dtype == dtype and y.shape == z.shape and y.data_ptr() != z.data_ptr()
    testing.assert_close(y, dora_scaled_output_ref(z, ms, bias), baseline, name="y")
    if bias is None:  # one fp32 product rounded once to the dtype, as torch.mul rounds it: the same bits
        assert torch.equal(y, baseline)


def test_scaled_output_reads_rows_of_a_wider_buffer(device: str) -> None:
    # z as a column slice of a wider buffer (row stride 300) and with a leading batch dimension
    wide = testing.random_tensor((2, 19, 300), torch.bfloat16, device, seed=4)
    z = wide[..., :257]
    ms, _ = _scale(257, device, seed=5)
    y = dora_scaled_output(z, ms, None)
    assert y.shape == z.shape
    assert torch.equal(y, dora_scaled_output_torch(z.contiguous(), ms, None))


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_dropout_output_matches_reference(device: str, dtype: torch.dtype, m: int, n: int, with_bias: bool) -> None:
    base, zd, low_rank = _forward_inputs(m, n, RANKS[n], dtype, device)
    ms, _ = _scale(n, device, seed=5)
    bias = testing.random_tensor((n,), dtype, device, seed=7) if with_bias else None
    want_y, want_z = dora_dropout_output_ref(base, zd, low_rank, ms, bias)
    base_y, base_z = dora_dropout_output_torch(base.clone(), zd.clone(), low_rank, ms, bias)
    y, z = dora_dropout_output(base.clone(), zd.clone(), low_rank, ms, bias)
    assert y.dtype == z.dtype == dtype
    testing.assert_close(y, want_y, base_y, name="y")
    testing.assert_close(z, want_z, base_z, name="z")


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each value of the float64 ``t`` (normal range)."""
    _, exponent = torch.frexp(t)
    return torch.ldexp(torch.ones_like(t), exponent - 1 - MANTISSA_BITS[dtype])


def _rounded_once_error(y: torch.Tensor, terms: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """How far ``y`` is beyond half a unit of ``dtype`` at the exact sum of ``terms`` (float64),
    less the fp32 roundings of the terms themselves: > 0 where ``y`` was not rounded once."""
    exact = sum(terms, torch.zeros_like(terms[0]))
    fp32_slack = 4 * 2.0**-24 * sum((t.abs() for t in terms), torch.zeros_like(exact))
    return (y.double() - exact).abs() - 0.5 * _ulp(exact, dtype) - fp32_slack


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
def test_dropout_output_is_summed_in_fp32_and_rounded_once(device: str, dtype: torch.dtype) -> None:
    # "Summed in fp32, rounded once" (dora.py's equations): each y is within half a unit of the
    # exact sum, up to fp32's error. Rounding each scaled term to the dtype first, as a fusion that
    # kept (ms - 1) zd or ms lr in the dtype would, breaks that bound, as the second check shows.
    # lr is rounded to the dtype (as the matmul that wrote it did): small integer factors make
    # s xa B^T exact in fp32, so that rounding is the same in the kernel and here.
    base, zd, _ = _forward_inputs(129, 300, 16, dtype, device, seed=11)
    gen = torch.Generator().manual_seed(12)
    xa, B = (torch.randint(-8, 9, shape, generator=gen).to(dtype).to(device) for shape in ((129, 16), (300, 16)))
    low_rank = LowRank(xa, B, 2.0**-6)
    lr = (low_rank.scaling * (xa.double() @ B.double().t())).to(dtype)
    ms, _ = _scale(300, device, seed=15)
    y, _ = dora_dropout_output(base.clone(), zd.clone(), low_rank, ms, None)
    ms64 = ms.double()
    terms = [base.double(), (ms64 - 1) * zd.double(), ms64 * lr.double()]
    assert float(_rounded_once_error(y, terms, dtype).max()) <= 0.0
    rounded_terms = [base.float(), ((ms - 1) * zd.float()).to(dtype).float(), (ms * lr.float()).to(dtype).float()]
    per_term = sum(rounded_terms, torch.zeros_like(rounded_terms[0])).to(dtype)
    assert float(_rounded_once_error(per_term, terms, dtype).max()) > 0.0


def test_dropout_output_writes_over_base_and_zd(device: str) -> None:
    base, zd, low_rank = _forward_inputs(37, 257, 16, torch.bfloat16, device, seed=3)
    ms, _ = _scale(257, device, seed=4)
    y, z = dora_dropout_output(base, zd, low_rank, ms, None)
    assert z.data_ptr() == zd.data_ptr()
    if uses_kernel(base):
        assert y.data_ptr() == base.data_ptr()


@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_grad_terms_match_reference(device: str, dtype: torch.dtype, m: int, n: int) -> None:
    dy = testing.random_tensor((m, n), dtype, device, seed=20)
    z = testing.random_tensor((m, n), dtype, device, seed=21)
    ms, norm = _scale(n, device, seed=22)
    dtypes, want = (torch.float32, dtype), (True, True)
    got = dora_grad_terms(dy, z, ms, norm, dtypes, want)
    torch_ops = dora_grad_terms_torch(dy, z, ms, norm, dtypes, want)
    for name, g, w, b in zip(["dmag", "db", "dy_ms", "dy_ms1"], got, dora_grad_terms_ref(dy, z, ms, norm), torch_ops, strict=True):  # fmt: skip
        assert g is not None and b is not None
        testing.assert_close(g, w, b, name=name)
    # ms * dy and (ms - 1) * dy: one fp32 product each, rounded once to the dtype, as torch.mul
    # rounds it: the same bits.
    assert torch.equal(got.dy_ms, torch_ops.dy_ms) and torch.equal(got.dy_ms1, torch_ops.dy_ms1)


def test_grad_terms_form_only_what_is_asked(device: str) -> None:
    dy = testing.random_tensor((37, 257), torch.bfloat16, device, seed=30)
    z = testing.random_tensor((37, 257), torch.bfloat16, device, seed=31)
    ms, norm = _scale(257, device, seed=32)
    want_dmag, want_db, _, _ = dora_grad_terms_ref(dy, z, ms, norm)
    only_dmag = dora_grad_terms(dy, z, ms, norm, (torch.bfloat16, None), (False, False))
    assert only_dmag.bias is None and only_dmag.dy_ms is None and only_dmag.dy_ms1 is None
    assert only_dmag.magnitude is not None and only_dmag.magnitude.dtype == torch.bfloat16
    testing.assert_close(only_dmag.magnitude, want_dmag, (dy.float() * z).sum(0).div(norm).bfloat16(), name="dmag")
    only_db = dora_grad_terms(dy, z, ms, norm, (None, torch.float32), (False, True))
    assert only_db.magnitude is None and only_db.dy_ms is None and only_db.bias is not None
    testing.assert_close(only_db.bias, want_db, dy.float().sum(0), name="db")
    assert torch.equal(only_db.dy_ms1, torch.mul(dy, ms - 1, out=torch.empty_like(dy)))


def test_grad_terms_read_an_expanded_gradient(device: str) -> None:
    # loss.sum()'s gradient reaches a backward as a stride-0 view (fk's DESIGN.md, launchers).
    dy = testing.random_tensor((1, 130), torch.bfloat16, device, seed=40).expand(33, 130)
    z = testing.random_tensor((33, 130), torch.bfloat16, device, seed=41)
    ms, norm = _scale(130, device, seed=42)
    got = dora_grad_terms(dy, z, ms, norm, (torch.float32, torch.float32), (True, True))
    torch_ops = dora_grad_terms_torch(dy.contiguous(), z, ms, norm, (torch.float32, torch.float32), (True, True))
    for name, g, w, b in zip(["dmag", "db", "dy_ms", "dy_ms1"], got, dora_grad_terms_ref(dy, z, ms, norm), torch_ops, strict=True):  # fmt: skip
        assert g is not None and b is not None
        testing.assert_close(g, w, b, name=name)
