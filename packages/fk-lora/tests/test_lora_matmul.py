"""fk.lora.lora_matmul's one-GEMM LoRA output ``x W^T + b + s xa B^T`` and input gradient
``dy W + (s G) A`` against float64: the Triton kernel on the GPU where there is one (Hopper), else
in the interpreter; where it applies; and fk.lora's forward and backward taking it."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.backend import KernelPath, uses_kernel
from fk.core.testing import dtype_name
from fk.lora import lora_matmul, projection
from fk.lora.lora_matmul import (
    base_and_lora_grad,
    base_and_lora_grad_ref,
    base_and_lora_out,
    base_and_lora_out_ref,
    base_and_masked_lora_grad,
    base_and_masked_lora_grad_ref,
    fused_applies,
    fused_grad_applies,
    masked_grad_applies,
)

# (M, N, K, r): rows and columns across tile edges (128 x 256, K steps of 64); N and K multiples of 8,
# as TMA needs; ranks under, at and over the 16 of an MMA.
SHAPES = [(1, 8, 8, 1), (37, 40, 72, 8), (130, 264, 200, 16), (300, 520, 136, 24), (129, 256, 64, 64)]
HALF = (torch.float16, torch.bfloat16)


def _inputs(m: int, n: int, k: int, r: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    x = testing.random_tensor((m, k), dtype, device, seed=seed)
    weight = testing.random_tensor((n, k), dtype, device, seed=seed + 1, scale=k**-0.5)
    bias = testing.random_tensor((n,), dtype, device, seed=seed + 2)
    xa = testing.random_tensor((m, r), dtype, device, seed=seed + 3)
    lora_b = testing.random_tensor((n, r), dtype, device, seed=seed + 4, scale=0.3)
    return [x, weight, bias, xa, lora_b]


def _kernel_runs(device: str) -> bool:
    probe = torch.empty(1, device=device)
    hopper = device != "cuda" or torch.cuda.get_device_capability()[0] == 9
    return uses_kernel(probe) and hopper and lora_matmul.HAS_TENSOR_DESCRIPTORS


@pytest.mark.parametrize(
    ("version", "has"), [("3.6.0", True), ("3.4.0+git1234", True), ("3.3.1", False), ("2.1", False)]
)
def test_tensor_descriptors_by_triton_version(monkeypatch: pytest.MonkeyPatch, version: str, has: bool) -> None:
    monkeypatch.setattr(lora_matmul.triton, "__version__", version)
    assert lora_matmul._has_tensor_descriptors() is has


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("m", "n", "k", "r"), SHAPES)
@pytest.mark.parametrize("dtype", HALF, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, m: int, n: int, k: int, r: int, with_bias: bool) -> None:
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    x, weight, bias, xa, lora_b = _inputs(m, n, k, r, dtype, device)
    b = bias if with_bias else None
    scaling = 1.7  # not a power of two: the kernel's 1 / s and s are not exact
    want = base_and_lora_out_ref(x, weight, b, xa, lora_b, scaling)
    baseline = x @ weight.t() + scaling * (xa @ lora_b.t())
    if b is not None:
        baseline = baseline + b
    got = base_and_lora_out(x, weight, b, xa, lora_b, scaling)
    assert got.dtype == dtype and got.shape == (m, n)
    testing.assert_close(got, want, baseline, name="y")


def test_every_term_counts(device: str) -> None:
    # Leaving out the bias, the rank product, or a K step moves y far past the tolerance.
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    x, weight, bias, xa, lora_b = _inputs(130, 264, 200, 16, torch.float16, device, seed=5)
    got = base_and_lora_out(x, weight, bias, xa, lora_b, 0.5).double()
    for wrong in (
        base_and_lora_out_ref(x, weight, None, xa, lora_b, 0.5),
        base_and_lora_out_ref(x, weight, bias, xa, lora_b, 1.0),
        base_and_lora_out_ref(x[:, :192], weight[:, :192], bias, xa, lora_b, 0.5),
    ):
        assert (got - wrong).abs().max() > 0.05


def test_strided_rank_operands(device: str) -> None:
    # xa as a column slice of q/k/v's stacked product (row stride 3r), B stored transposed.
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    x, weight, bias, _, lora_b = _inputs(70, 48, 96, 16, torch.bfloat16, device, seed=9)
    stacked = testing.random_tensor((70, 48), torch.bfloat16, device, seed=10)
    xa = stacked[:, 16:32]
    lora_b = lora_b.t().contiguous().t()  # B [N, r] with column-major storage
    assert lora_b.stride() == (1, 48)
    want = base_and_lora_out_ref(x, weight, bias, xa, lora_b, 2.0)
    baseline = x @ weight.t() + 2.0 * (xa @ lora_b.t()) + bias
    testing.assert_close(base_and_lora_out(x, weight, bias, xa, lora_b, 2.0), want, baseline, name="y")


def test_rank_term_by_tma_where_tma_can_read_it(device: str) -> None:
    # SHAPES' ranks 8, 16 and 24 take the descriptors (and the flattened loop), 1 and 64 the
    # pointers (a 2-byte row; a padded rank over TMA_RANK_MAX), and so do strided operands: the
    # reference tests above run both paths.
    def take(r: int) -> bool:
        return lora_matmul.rank_by_tma(
            torch.empty(70, r, dtype=torch.bfloat16), torch.empty(48, r, dtype=torch.bfloat16)
        )

    assert [take(r) for r in (1, 8, 16, 24, 64)] == [False, True, True, True, False]
    assert lora_matmul.TMA_RANK_MAX == 32
    column_major_b = torch.empty(16, 48, dtype=torch.bfloat16).t()
    assert not lora_matmul.rank_by_tma(torch.empty(70, 16, dtype=torch.bfloat16), column_major_b)
    odd_row_stride = torch.empty(70, 20, dtype=torch.bfloat16)[:, :16]  # rows 40 bytes apart
    assert not lora_matmul.rank_by_tma(odd_row_stride, torch.empty(48, 16, dtype=torch.bfloat16))
    a_of_backward = torch.empty(16, 40, dtype=torch.bfloat16)  # A [r, K]
    assert lora_matmul.rank_by_tma(torch.empty(70, 16, dtype=torch.bfloat16), a_of_backward)


def _grad_inputs(m: int, n: int, k: int, r: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    dy = testing.random_tensor((m, n), dtype, device, seed=seed)
    weight = testing.random_tensor((n, k), dtype, device, seed=seed + 1, scale=n**-0.5)
    scaled_g = testing.random_tensor((m, r), dtype, device, seed=seed + 2)
    lora_a = testing.random_tensor((r, k), dtype, device, seed=seed + 3, scale=0.3)
    return [dy, weight, scaled_g, lora_a]


@pytest.mark.parametrize(("m", "n", "k", "r"), SHAPES)
@pytest.mark.parametrize("dtype", HALF, ids=dtype_name)
def test_grad_matches_reference(device: str, dtype: torch.dtype, m: int, n: int, k: int, r: int) -> None:
    # dx = dy W + (s G) A: W [N, K] read as stored (inner N), A's rows the rank.
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    dy, weight, scaled_g, lora_a = _grad_inputs(m, n, k, r, dtype, device)
    want = base_and_lora_grad_ref(dy, weight, scaled_g, lora_a)
    baseline = dy @ weight + scaled_g @ lora_a
    got = base_and_lora_grad(dy, weight, scaled_g, lora_a)
    assert got.dtype == dtype and got.shape == (m, k)
    testing.assert_close(got, want, baseline, name="dx")
    assert (got.double() - base_and_lora_grad_ref(dy, weight, scaled_g, 0 * lora_a)).abs().max() > 0.05


def test_grad_applies_only_where_it_can(device: str) -> None:
    # 16384 rows and an inner dimension of 4096: enough for a GPU (GRAD_MIN_ROWS, GRAD_MIN_INNER).
    dy, weight, scaled_g, lora_a = _grad_inputs(16384, lora_matmul.GRAD_MIN_INNER, 256, 16, torch.bfloat16, device)
    assert fused_grad_applies(dy, weight, scaled_g, lora_a) == _kernel_runs(device)
    if not _kernel_runs(device):
        return
    on_gpu = device == "cuda"
    half_inner = lora_matmul.GRAD_MIN_INNER // 2
    assert fused_grad_applies(dy[:, :half_inner], weight[:half_inner], scaled_g, lora_a) != on_gpu
    few_rows = lora_matmul.GRAD_MIN_ROWS // 2
    assert fused_grad_applies(dy[:few_rows], weight, scaled_g[:few_rows], lora_a) != on_gpu
    narrow = _grad_inputs(16384, 64, 252, 16, torch.bfloat16, device)  # dx's rows 504 bytes
    assert not fused_grad_applies(*narrow)
    assert not fused_grad_applies(dy, weight, scaled_g.float(), lora_a)
    assert not fused_grad_applies(dy.float(), weight.float(), scaled_g.float(), lora_a.float())


def _dropout_mask(m: int, k: int, device: str, seed: int, p: float = 0.3) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand((m, k), device=device, generator=gen) >= p


@pytest.mark.parametrize(("mask_base", "accumulate"), [(False, False), (False, True), (True, True), (True, False)],
                         ids=["lora", "lora_added", "dora_added", "dora"])  # fmt: skip
@pytest.mark.parametrize(("m", "n", "k", "r"), SHAPES)
@pytest.mark.parametrize("dtype", HALF, ids=dtype_name)
def test_masked_grad_matches_reference(
    device: str, dtype: torch.dtype, m: int, n: int, k: int, r: int, mask_base: bool, accumulate: bool
) -> None:
    # With dropout: dy W + f m (s G A) (LoRA), or f m (dy W + s G A) (DoRA's term through the dropped
    # input), into a new dx or added to one; the epilogue in two halves of each 256-column tile.
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    dy, weight, scaled_g, lora_a = _grad_inputs(m, n, k, r, dtype, device, seed=11)
    mask = _dropout_mask(m, k, device, seed=12)
    addend = testing.random_tensor((m, k), dtype, device, seed=13) if accumulate else None
    factor = 1 / 0.7
    want = base_and_masked_lora_grad_ref(dy, weight, scaled_g, lora_a, mask, factor, mask_base=mask_base, addend=addend)
    kept = factor * mask.to(dtype)
    baseline = kept * (dy @ weight + scaled_g @ lora_a) if mask_base else dy @ weight + kept * (scaled_g @ lora_a)
    if addend is not None:
        baseline = baseline + addend
    out = None if addend is None else addend.clone()
    got = base_and_masked_lora_grad(dy, weight, scaled_g, lora_a, mask, factor, mask_base=mask_base, out=out)
    assert got.dtype == dtype and got.shape == (m, k)
    assert out is None or got is out
    testing.assert_close(got, want, baseline, name="dx")


def test_masked_grad_every_term_counts(device: str) -> None:
    # The mask, the factor, the rank term, the base product's masking (DoRA) and the addend each move
    # dx far past the tolerance when left out.
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    dy, weight, scaled_g, lora_a = _grad_inputs(130, 264, 200, 16, torch.float16, device, seed=21)
    mask = _dropout_mask(130, 200, device, seed=22)
    addend = testing.random_tensor((130, 200), torch.float16, device, seed=23)
    ref = base_and_masked_lora_grad_ref
    for mask_base in (False, True):
        got = base_and_masked_lora_grad(dy, weight, scaled_g, lora_a, mask, 2.0, mask_base=mask_base,
                                        out=addend.clone()).double()  # fmt: skip
        for wrong in (
            ref(dy, weight, scaled_g, lora_a, torch.ones_like(mask), 2.0, mask_base=mask_base, addend=addend),
            ref(dy, weight, scaled_g, lora_a, mask, 1.0, mask_base=mask_base, addend=addend),
            ref(dy, weight, scaled_g, 0 * lora_a, mask, 2.0, mask_base=mask_base, addend=addend),
            ref(dy, weight, scaled_g, lora_a, mask, 2.0, mask_base=not mask_base, addend=addend),
            ref(dy, weight, scaled_g, lora_a, mask, 2.0, mask_base=mask_base),
        ):
            assert (got - wrong).abs().max() > 0.05


def test_masked_grad_applies_only_where_it_can(device: str) -> None:
    # 16384 rows and an inner dimension of 1024: enough for a GPU (GRAD_MIN_ROWS, MASKED_MIN_INNER).
    dy, weight, scaled_g, lora_a = _grad_inputs(16384, lora_matmul.MASKED_MIN_INNER, 256, 16, torch.bfloat16, device)
    mask = _dropout_mask(16384, 256, device, seed=1)
    dx = torch.empty(16384, 256, dtype=dy.dtype, device=device)
    assert masked_grad_applies(dy, weight, scaled_g, lora_a, mask) == _kernel_runs(device)
    assert masked_grad_applies(dy, weight, scaled_g, lora_a, mask, dx) == _kernel_runs(device)
    if not _kernel_runs(device):
        return
    on_gpu = device == "cuda"
    half_inner = lora_matmul.MASKED_MIN_INNER // 2
    assert masked_grad_applies(dy[:, :half_inner], weight[:half_inner], scaled_g, lora_a, mask) != on_gpu
    few = lora_matmul.GRAD_MIN_ROWS // 2
    assert masked_grad_applies(dy[:few], weight, scaled_g[:few], lora_a, mask[:few]) != on_gpu
    refused = {
        "mask not bool": [mask.to(dy.dtype), None],
        "mask's shape": [mask[:, :128], None],
        "mask's columns strided": [torch.ones(16384, 512, dtype=torch.bool, device=device)[:, ::2], None],
        "out's dtype": [mask, dx.float()],
        "out's shape": [mask, dx[:, :128]],
        "out's rows not 16-byte aligned": [mask, torch.empty(16384, 260, dtype=dy.dtype, device=device)[:, 2:258]],
    }
    for why, (m, out) in refused.items():
        assert not masked_grad_applies(dy, weight, scaled_g, lora_a, m, out), why
    assert not masked_grad_applies(dy.float(), weight.float(), scaled_g.float(), lora_a.float(), mask), "fp32"


def test_tma_gemm_runs_on_hopper_with_enough_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU branch on any machine: the path, the capability and the SM count patched (an H100 or
    # H200 has 132 SMs: 99 tiles of MIN_TILES_PER_SM = 0.75 an SM needed).
    a = torch.empty(12800, 64, dtype=torch.bfloat16)
    tile = (128, 256, 64)
    monkeypatch.setattr(lora_matmul, "HAS_TENSOR_DESCRIPTORS", True)
    monkeypatch.setattr(lora_matmul, "kernel_path", lambda t: KernelPath.TRITON)
    monkeypatch.setattr(lora_matmul, "multiprocessor_count", lambda device: 132)
    capability = [(9, 0)]
    monkeypatch.setattr(lora_matmul.torch.cuda, "get_device_capability", lambda device: capability[0])
    assert lora_matmul.tma_gemm_runs(a, 256, tile)  # 100 tiles
    assert not lora_matmul.tma_gemm_runs(a[:12288], 256, tile)  # 96
    assert lora_matmul.tma_gemm_runs(a[:6400], 512, tile)  # 50 x 2
    assert lora_matmul.tma_gemm_runs(a[:1024], 4096, (128, 128, 64))  # 8 x 32
    for other in ((8, 0), (10, 0)):
        capability[0] = other
        assert not lora_matmul.tma_gemm_runs(a, 256, tile), other
    capability[0] = (9, 0)
    monkeypatch.setattr(lora_matmul, "HAS_TENSOR_DESCRIPTORS", False)
    assert not lora_matmul.tma_gemm_runs(a, 256, tile)
    monkeypatch.setattr(lora_matmul, "HAS_TENSOR_DESCRIPTORS", True)
    monkeypatch.setattr(lora_matmul, "kernel_path", lambda t: KernelPath.INTERPRETER)
    assert lora_matmul.tma_gemm_runs(a[:1], 8, tile)  # any size in the interpreter
    monkeypatch.setattr(lora_matmul, "kernel_path", lambda t: KernelPath.REFERENCE)
    assert not lora_matmul.tma_gemm_runs(a, 256, tile)


def test_applies_only_where_it_can(device: str) -> None:
    # Rows for 128 tiles of 128 x 256: enough on a GPU of up to 170 SMs (MIN_TILES_PER_SM).
    x, weight, bias, xa, lora_b = _inputs(16384, 256, 64, 16, torch.bfloat16, device)
    assert fused_applies(x, weight, bias, xa, lora_b, 2.0) == _kernel_runs(device)
    if not _kernel_runs(device):
        return
    # Eight tiles: too few for a GPU's SMs; the interpreter takes any size.
    assert fused_applies(x[:1024], weight, bias, xa[:1024], lora_b, 2.0) == (device != "cuda")
    big = _inputs(16384, 256, 64, lora_matmul.MAX_RANK + 1, torch.bfloat16, device)
    # A column slice with 16-byte rows is fine (TMA reads K = 60 of a row stride of 64).
    assert fused_applies(x[:, :60], weight[:, :60], bias, xa, lora_b, 2.0)
    fp32 = _inputs(16384, 256, 64, 16, torch.float32, device)
    narrow_k = _inputs(16384, 256, 60, 16, torch.bfloat16, device)
    unaligned = torch.empty(16384, 68, dtype=x.dtype, device=device)[:, 2:66]
    refused = {
        "fp32": [fp32[0], fp32[1], None, fp32[3], fp32[4]],
        "x's dtype not W's": [x, weight.half(), None, xa, lora_b],
        "K not a multiple of 8": [narrow_k[0], narrow_k[1], None, xa, lora_b],
        "N not a multiple of 8": [x, weight[:252], None, xa, lora_b[:252]],
        "x's columns strided": [x[:, ::2], weight[:, :32], None, xa, lora_b],
        "x's rows not 16-byte aligned": [unaligned, weight, None, xa, lora_b],
        "r over MAX_RANK": [x, weight, None, big[3], big[4]],
        "xa's dtype": [x, weight, None, xa.float(), lora_b],
        "xa's columns strided": [x, weight, None, torch.empty_like(xa).repeat(1, 2)[:, ::2], lora_b],
        "bias strided": [x, weight, torch.empty(512, dtype=x.dtype, device=device)[::2], xa, lora_b],
        "no rows": [x[:0], weight, None, xa[:0], lora_b],
    }
    for why, args in refused.items():
        assert not fused_applies(*args, 2.0), why  # type: ignore[arg-type]
    assert not fused_applies(x, weight, bias, xa, lora_b, 0.0), "s = 0"


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=dtype_name)
def test_lora_and_base_out_takes_the_kernel_where_it_applies(
    device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = 16384 if device == "cuda" else 130  # enough tiles for a GPU's SMs (MIN_TILES_PER_SM)
    x, weight, bias, xa, lora_b = _inputs(m, 264, 200, 16, dtype, device, seed=3)
    calls = []
    fused = projection.base_and_lora_out

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return fused(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(projection, "base_and_lora_out", counted)
    got = projection.lora_and_base_out(x, weight, bias, xa, lora_b, None, 1.5)
    assert len(calls) == (1 if dtype in HALF and _kernel_runs(device) else 0)
    want = base_and_lora_out_ref(x, weight, bias, xa, lora_b, 1.5)
    baseline = x @ weight.t() + 1.5 * (xa @ lora_b.t()) + bias
    testing.assert_close(got, want, baseline, name="y", factor=3.0)
    # PEFT's lora_bias (s b_B) is the cuBLAS path's.
    calls.clear()
    lora_bias = testing.random_tensor((264,), dtype, device, seed=4)
    got = projection.lora_and_base_out(x, weight, bias, xa, lora_b, lora_bias, 1.5)
    assert not calls
    testing.assert_close(got, want + 1.5 * lora_bias.double(), baseline + 1.5 * lora_bias, name="y", factor=3.0)


# (W_TRANSPOSED, MASKED, MASK_BASE, ACCUMULATE, RANK_BY_TMA) and the padded ranks compiled: the
# forward and the backward, the rank term by pointer (r = 16 and MAX_RANK) and through descriptors
# (r = 16 and TMA_RANK_MAX); with dropout, LoRA's first term (a new dx) and DoRA's (added to dx,
# its base product masked too).
KERNEL_MODES = [((True, False, False, False, False), (16, lora_matmul.MAX_RANK)),
                ((False, False, False, False, False), (16, lora_matmul.MAX_RANK)),
                ((True, False, False, False, True), (16, lora_matmul.TMA_RANK_MAX)),
                ((False, False, False, False, True), (16, lora_matmul.TMA_RANK_MAX)),
                ((False, True, False, False, False), (16, lora_matmul.MAX_RANK)),
                ((False, True, True, True, False), (16, lora_matmul.MAX_RANK))]  # fmt: skip


def test_kernel_compiles_without_spills() -> None:
    # Compiled for sm_90 on the CPU at its launch, each mode of KERNEL_MODES at its ranks: the
    # products on the warpgroup MMAs, nothing spilled, the shared memory under the 227 KB a Hopper
    # program gets.
    tile_m, tile_n, tile_k = lora_matmul.TILE
    for (w_transposed, masked, mask_base, accumulate, by_tma), ranks in KERNEL_MODES:
        for rank in ranks:
            w_block = f"[{tile_n}, {tile_k}]" if w_transposed else f"[{tile_k}, {tile_n}]"
            out_n = tile_n // 2 if masked or by_tma else tile_n
            v_block = f"[{tile_n}, {rank}]" if w_transposed else f"[{rank}, {tile_n}]"
            signature = {
                "a_desc": f"tensordesc<bf16[{tile_m}, {tile_k}]>", "w_desc": f"tensordesc<bf16{w_block}>",
                "out_desc": f"tensordesc<bf16[{tile_m}, {out_n}]>",
                "u_desc": f"tensordesc<bf16[{tile_m}, {rank}]>" if by_tma else "",
                "v_desc": f"tensordesc<bf16{v_block}>" if by_tma else "", "u_ptr": "*bf16", "v_ptr": "*bf16",
                "bias_ptr": "*bf16", "mask_ptr": "*i1", "scaling": "fp32", "inv_scaling": "fp32", "factor": "fp32",
                "n_rows": "i32", "n_cols": "i32", "n_inner": "i32", "rank": "i32", "u_row_stride": "i32",
                "v_col_stride": "i32", "v_rank_stride": "i32", "mask_row_stride": "i32", "W_TRANSPOSED": "",
                "HAS_BIAS": "", "MASKED": "", "MASK_BASE": "", "ACCUMULATE": "", "RANK_BY_TMA": "", "BLOCK_RANK": "",
                "BLOCK_M": "", "BLOCK_N": "", "BLOCK_K": "", "GROUP_M": "", "N_PROGRAMS": "",
            }  # fmt: skip
            constexprs = {"W_TRANSPOSED": w_transposed, "HAS_BIAS": w_transposed, "MASKED": masked,
                          "MASK_BASE": mask_base, "ACCUMULATE": accumulate, "RANK_BY_TMA": by_tma,
                          "BLOCK_RANK": rank, "BLOCK_M": tile_m, "BLOCK_N": tile_n, "BLOCK_K": tile_k,
                          "GROUP_M": lora_matmul.GROUP_M, "N_PROGRAMS": 132}  # fmt: skip
            if not by_tma:
                constexprs.update(u_desc=None, v_desc=None)
            # B [N, r] and A [r, K] as PEFT stores them: the stride of 1 Triton specializes at launch
            constexprs["v_rank_stride" if w_transposed else "v_col_stride"] = 1
            compiled = testing.compile_kernel("fk.lora.lora_matmul", "_base_and_lora_kernel", signature, constexprs,
                                              num_warps=lora_matmul.NUM_WARPS)  # fmt: skip
            mode = (w_transposed, masked, mask_base, accumulate, by_tma, rank)
            assert compiled.spill_bytes == 0, (mode, compiled)
            assert compiled.sync_and_mma.get("wgmma.mma_async", 0) > 0, compiled.sync_and_mma
            assert compiled.shared_bytes <= 227 * 1024, (mode, compiled.shared_bytes)


@pytest.mark.parametrize(("dora", "dropout_p"), [(False, 0.0), (True, 0.0), (False, 0.1), (True, 0.1)],
                         ids=["lora", "dora", "lora_dropout", "dora_dropout"])  # fmt: skip
def test_lora_linear_takes_the_kernels_at_a_gpu_size(
    device: str, dora: bool, dropout_p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU the kernels run only for outputs of enough tiles (MIN_TILES_PER_SM) and, in the
    # backward, rows and an inner dimension of 4096 or more (GRAD_MIN_*; with dropout 1024,
    # MASKED_MIN_INNER), more than the other tests' models have: a layer of 16384 tokens and 4096
    # outputs, forward and backward against the reference (with dropout: with fk's mask, drawn again).
    if device != "cuda" or not _kernel_runs(device):
        pytest.skip("the size guard is a GPU's (the interpreter takes the kernels at any size)")
    from fk.lora import lora_linear, lora_linear_ref

    launches = []
    launch = lora_matmul._launch

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(1)
        return launch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lora_matmul, "_launch", counted)
    c = torch.bfloat16
    x = testing.random_tensor((16384, 256), c, device, seed=1).requires_grad_()
    weight = testing.random_tensor((4096, 256), c, device, seed=2, scale=256**-0.5)
    bias = testing.random_tensor((4096,), c, device, seed=3)
    lora_a = testing.random_tensor((16, 256), c, device, seed=4, scale=0.1).requires_grad_()
    lora_b = testing.random_tensor((4096, 16), c, device, seed=5, scale=0.1).requires_grad_()
    magnitude = (1 + 0.1 * testing.random_tensor((4096,), c, device, seed=6)).requires_grad_() if dora else None
    dy = testing.random_tensor((16384, 4096), c, device, seed=7)
    leaves = [x, lora_a, lora_b] + ([magnitude] if dora else [])
    torch.manual_seed(8)
    mask = torch.native_dropout(x.detach(), dropout_p, True)[1] if dropout_p else None

    def with_mask(t: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        # the reference's F.dropout, with fk's mask (drawn again above under the same seed)
        assert mask is not None and training and p == dropout_p
        return t * mask.to(t.dtype) / (1 - p)

    def run(fn, cast):  # type: ignore[no-untyped-def]
        inputs = [t.detach().to(cast).requires_grad_() for t in leaves]
        mag = inputs[3] if dora else None
        torch.manual_seed(8)
        with monkeypatch.context() as patched:
            if fn is not lora_linear:
                patched.setattr(torch.nn.functional, "dropout", with_mask)
            y = fn(inputs[0], weight.to(cast), bias.to(cast), inputs[1], inputs[2], 2.0, dropout_p, magnitude=mag)
        grads = torch.autograd.grad(y, inputs, dy.to(cast))
        return [y, *grads]

    got = run(lora_linear, c)
    # the forward's y and the backward's dx (DoRA with dropout: only dx, its y is fk.lora.dora_dropout_matmul's)
    assert len(launches) == (1 if dora and dropout_p else 2)
    want = run(lora_linear_ref, torch.float64)
    baseline = run(lora_linear_ref, c)
    for name, g, w, b in zip(["y", "dx", "dA", "dB", "dmagnitude"], got, want, baseline, strict=False):
        testing.assert_close(g, w, b, name=name)
