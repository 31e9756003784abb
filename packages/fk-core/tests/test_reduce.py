"""fk.core.reduce.sum_rows: the fp32 sum of partial rows, rounded once to the gradient's dtype,
against a float64 sum; on the GPU where there is one, else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.reduce import sum_rows, sum_rows_pair
from fk.core.testing import DTYPES, dtype_name

# One unit in the last place of the output dtype (Triton's interpreter truncates fp32 -> bf16/fp16
# where the GPU rounds to nearest, so a whole ulp), plus fp32 summation error.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _check_sum(got: torch.Tensor, partials: torch.Tensor, dtype: torch.dtype) -> None:
    want = partials.double().sum(0).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    bound = want.abs() * ULP[dtype] + partials.abs().double().sum(0).cpu() * partials.shape[0] * 2.0**-24 + 1e-30
    err = (got.double().cpu() - want).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("shape", [(1, 1), (7, 17), (301, 1000), (1056, 1024), (5, 16385)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_float64_sum(device: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    partials = testing.random_tensor(shape, torch.float32, device, seed=sum(shape))
    _check_sum(sum_rows(partials, dtype), partials, dtype)


@pytest.mark.parametrize("shape", [(2, 1, 3), (2, 33, 100), (2, 264, 16400)])
def test_pair_matches_float64_sums(device: str, shape: tuple[int, int, int]) -> None:
    partials = testing.random_tensor(shape, torch.float32, device, seed=sum(shape))
    dw, db = sum_rows_pair(partials, torch.bfloat16, torch.float32)
    assert dw.data_ptr() != db.data_ptr()
    _check_sum(dw, partials[0], torch.bfloat16)
    _check_sum(db, partials[1], torch.float32)


def test_every_column_and_group_is_its_own(device: str) -> None:
    # Distinct integers per (group, column): a wrong offset or mask cannot give the right sum.
    rows, cols = 70, 45
    base = torch.arange(2 * cols, dtype=torch.float32, device=device).view(2, 1, cols)
    partials = (base + 1000 * torch.arange(rows, dtype=torch.float32, device=device).view(1, rows, 1)).contiguous()
    want = rows * base.view(2, cols) + 1000 * rows * (rows - 1) / 2
    got = sum_rows_pair(partials, torch.float32, torch.float32)
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=0)
    torch.testing.assert_close(sum_rows(partials[1].contiguous(), torch.float32), want[1], rtol=0, atol=0)


def test_no_rows_gives_zeros(device: str) -> None:
    zeros = torch.zeros(9, device=device, dtype=torch.bfloat16)
    assert torch.equal(sum_rows(torch.empty(0, 9, device=device), torch.bfloat16), zeros)
    assert all(torch.equal(t, zeros) for t in sum_rows_pair(torch.empty(2, 0, 9, device=device), *[torch.bfloat16] * 2))


def test_bad_partials(device: str) -> None:
    with pytest.raises(ValueError, match="partials must be a contiguous float32"):
        sum_rows(torch.ones(4, 8, device=device, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(ValueError, match="partials must be a contiguous float32"):
        sum_rows(torch.ones(8, 4, device=device).t(), torch.float32)
    with pytest.raises(ValueError, match="partials must be a contiguous float32"):
        sum_rows(torch.ones(8, device=device), torch.float32)
    with pytest.raises(ValueError, match="partials must have 2 groups"):
        sum_rows_pair(torch.ones(3, 4, 8, device=device), torch.float32, torch.float32)
