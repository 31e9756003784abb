"""DoRA's row norm ``||W + s B A||`` (fk.lora.dora_norm) against float64: the kernel, which reads
``W`` once in column ranges, and the torch expression, which forms a chunk of rows at a time."""

from __future__ import annotations

import pytest
import torch

import fk.lora.dora_norm
from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.lora.dora_norm import dora_weight_norm, dora_weight_norm_ref, dora_weight_norm_torch

SHAPES = [(1, 1, 1), (29, 37, 3), (33, 600, 16), (70, 300, 33), (5, 1100, 5)]  # (N, K, r): awkward widths
"""Ranks below, at and above one rank step of 16; K up to nine column tiles (several ranges)."""

SCALING = 1.5


def _weights(n: int, k: int, r: int, dtype: torch.dtype, lora_dtype: torch.dtype, device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    w = testing.random_tensor((n, k), dtype, device, seed=seed, scale=k**-0.5)
    a = testing.random_tensor((r, k), lora_dtype, device, seed=seed + 1, scale=k**-0.5)
    b = testing.random_tensor((n, r), lora_dtype, device, seed=seed + 2, scale=r**-0.5)
    return w, a, b


@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_norm_matches_reference(device: str, dtype: torch.dtype, n: int, k: int, r: int) -> None:
    """In fp32 before its rounding to the dtype asked for: within fp32's error of float64."""
    w, a, b = _weights(n, k, r, dtype, dtype, device)
    got = dora_weight_norm(w, a, b, SCALING, torch.float32)
    baseline = dora_weight_norm_torch(w, a, b, SCALING)
    assert got.dtype == torch.float32 and got.shape == (n,)
    testing.assert_close(got, dora_weight_norm_ref(w, a, b, SCALING), baseline, name="norm")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_norm_is_rounded_to_the_dtype_asked_for(device: str, dtype: torch.dtype) -> None:
    """PEFT computes the norm in the LoRA branch's dtype: the result is the fp32 norm rounded to it
    (at most one rounding from the float64 norm), returned in fp32."""
    w, a, b = _weights(70, 300, 16, torch.bfloat16, torch.float32, device, seed=3)
    got = dora_weight_norm(w, a, b, SCALING, dtype)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.to(dtype).float())
    want = dora_weight_norm_ref(w, a, b, SCALING)
    torch.testing.assert_close(got.double(), want, rtol=torch.finfo(dtype).eps, atol=0.0)


def test_norm_reads_a_weight_with_a_row_stride(device: str) -> None:
    """A W that is rows of a wider buffer (and LoRA factors in another dtype than W's)."""
    wide, a, b = _weights(33, 700, 16, torch.bfloat16, torch.float32, device, seed=5)
    w = wide[:, :600]
    got = dora_weight_norm(w, a[:, :600], b, SCALING, torch.float32)
    testing.assert_close(got, dora_weight_norm_ref(w, a[:, :600], b, SCALING),
                         dora_weight_norm_torch(w.contiguous(), a[:, :600], b, SCALING), name="norm")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_torch_expression_in_row_chunks_is_the_direct_norm(
    device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch expression (torch.compile's path), five rows at a time, is the float64 norm within
    fp32's error."""
    w, a, b = _weights(29, 37, 3, dtype, dtype, device, seed=7)
    monkeypatch.setattr(fk.lora.dora_norm, "DORA_NORM_CHUNK_ELEMENTS", 5 * 37)
    got = dora_weight_norm_torch(w, a, b, SCALING)
    assert got.dtype == torch.float32 and got.shape == (29,)
    torch.testing.assert_close(got.double(), dora_weight_norm_ref(w, a, b, SCALING), rtol=1e-6, atol=0.0)
