"""fk.lora.quant_matmul: the two products of a QLoRA base layer (``x W^T + b`` and ``dy W``) with the
4-bit weight dequantized tile by tile inside the GEMM, against the float64 reference (the weight from
``dequantize_ref``, then a matmul), and the rule that picks this path over dequantize + cuBLAS.

Shapes are small and awkward (no dimension a multiple of the launch's blocks; quantization blocks that
span rows; an odd ``N * K``: a padded last byte) and run with small blocks, so that several programs,
several reduction steps and every boundary mask take part: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.lora import quant_matmul
from fk.lora.quant import QuantizedWeight, quantize_ref
from fk.lora.quant_matmul import (
    LAUNCH,
    LaunchParams,
    linear_4bit,
    linear_4bit_ref,
    matmul_4bit,
    matmul_4bit_ref,
    tile_dequant_applies,
)

SMALL = LaunchParams(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)
"""Tiles smaller than the test shapes (tl.dot's smallest), two row tiles per group."""

# (quant_type, nested, blocksize, the weight's own dtype, compute dtype, (M, N, K)). bitsandbytes takes
# blocksizes 32..4096 (powers of two) and any shape: its blocks run over the flattened weight. The last
# two have rows of whole blocks (the kernels' aligned path: a scale per row of a tile), the first two not.
CASES = [
    ("nf4", True, 64, torch.bfloat16, torch.bfloat16, (37, 45, 100)),
    ("nf4", False, 32, torch.float16, torch.float16, (20, 33, 99)),
    ("fp4", True, 128, torch.float32, torch.float16, (33, 19, 256)),
    ("fp4", False, 64, torch.float32, torch.bfloat16, (17, 40, 64)),
]
CASE_IDS = ["nf4_nested_bf16", "nf4_fp16_odd", "fp4_nested_fp32w_fp16_aligned", "fp4_fp32w_bf16_aligned"]


def _weight(case: tuple, device: str) -> QuantizedWeight:
    quant_type, nested, blocksize, w_dtype, _, (_, n, k) = case
    w = testing.random_tensor((n, k), torch.float32, device, seed=3).to(w_dtype)
    return quantize_ref(w, quant_type, blocksize, nested=nested, nested_blocksize=4)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_linear_4bit_matches_dequantize_then_matmul(device: str, case: tuple) -> None:
    compute, (m, n, k) = case[4], case[5]
    q = _weight(case, device)
    x = testing.random_tensor((m, k), compute, device, seed=1)
    bias = testing.random_tensor((n,), compute, device, seed=2)
    testing.compare_with_reference(
        lambda x, b: linear_4bit(x, q, b, params=SMALL), lambda x, b: linear_4bit_ref(x, q, b, compute), [x, bias]
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matmul_4bit_matches_dequantize_then_matmul(device: str, case: tuple) -> None:
    compute, (m, n, _) = case[4], case[5]
    q = _weight(case, device)
    dy = testing.random_tensor((m, n), compute, device, seed=1)
    testing.compare_with_reference(
        lambda g: matmul_4bit(g, q, params=SMALL), lambda g: matmul_4bit_ref(g, q, compute), [dy]
    )


def test_products_accumulate_into_strided_outputs(device: str) -> None:
    """``accumulate`` adds to what ``out`` holds (as ``addmm_``), with strided inputs and outputs and
    the default launch (tiles larger than the whole problem)."""
    case = CASES[0]
    compute, (m, n, k) = case[4], case[5]
    q = _weight(case, device)
    x = testing.random_tensor((k, m), compute, device, seed=1).t()  # column-major
    dy = testing.random_tensor((m, 2 * n), compute, device, seed=2)[:, ::2]
    y0 = testing.random_tensor((m, n + 3), compute, device, seed=4)[:, 1 : n + 1]
    dx0 = testing.random_tensor((m, k), compute, device, seed=5)
    ref_y = y0.double() + linear_4bit_ref(x.double(), q, None, compute)
    ref_dx = dx0.double() + matmul_4bit_ref(dy.double(), q, compute)
    y, dx = y0.clone(), dx0.clone()
    assert linear_4bit(x, q, out=y, accumulate=True) is y
    assert matmul_4bit(dy, q, out=dx, accumulate=True) is dx
    for got, want, start in ((y, ref_y, y0), (dx, ref_dx, dx0)):
        baseline = (start.float() + (want - start.double()).float()).to(compute)
        testing.assert_close(got, want, baseline, name="accumulated", factor=4.0)


def test_rule_tiles_half_precision_up_to_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_matmul, "TILE_DEQUANT_MAX_ROWS", 100)
    assert tile_dequant_applies(100, torch.bfloat16) and tile_dequant_applies(1, torch.float16)
    assert not tile_dequant_applies(101, torch.bfloat16)
    assert not tile_dequant_applies(1, torch.float32)  # (tl.dot would run TF32: fp32 stays on cuBLAS)
    assert set(LAUNCH) == {"forward", "input_grad"}


def test_bad_operands_are_refused(device: str) -> None:
    q = _weight(CASES[0], device)
    x = testing.random_tensor((4, 100), torch.bfloat16, device, seed=1)
    with pytest.raises(TypeError, match="x must have dtype"):
        linear_4bit(x.float(), q)
    with pytest.raises(ValueError, match=r"x must have 100 columns"):
        linear_4bit(x[:, :99], q)
    with pytest.raises(ValueError, match=r"dy must have 45 columns"):
        matmul_4bit(x, q)
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        matmul_4bit(x[:, :45], q, accumulate=True)
    with pytest.raises(ValueError, match="out must have shape"):
        linear_4bit(x, q, out=torch.empty(4, 44, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="4-bit"):
        linear_4bit(x, quantize_ref(torch.ones(45, 100, device=device), "int8"))
