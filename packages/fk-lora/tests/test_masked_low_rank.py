"""fk.lora's dropout input-gradient term ``dx += (G A) * m * f`` against float64: the Triton kernel
on the GPU where there is one, else in the interpreter, and the torch-ops path."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.lora.masked_low_rank import (
    MaskedLowRank,
    add_masked_low_rank_,
    add_masked_low_rank_ref,
    add_masked_low_ranks_,
    add_masked_low_ranks_ref,
    masked,
)

SHAPES = [(1, 1, 1), (5, 130, 4), (37, 300, 16), (70, 1000, 33), (129, 257, 8)]  # (M, K, r)


def _inputs(m: int, k: int, r: int, dtype: torch.dtype, device: str, p: float, seed: int = 0) -> list[torch.Tensor]:
    dx = testing.random_tensor((m, k), dtype, device, seed=seed)
    g = testing.random_tensor((m, r), dtype, device, seed=seed + 1)
    a = testing.random_tensor((r, k), dtype, device, seed=seed + 2, scale=r**-0.5)
    gen = torch.Generator().manual_seed(seed + 3)
    mask = (torch.rand((m, k), generator=gen) >= p).to(device)
    return [dx, g, a, mask]


def _torch_ops(dx: torch.Tensor, g: torch.Tensor, a: torch.Tensor, mask: torch.Tensor, f: float) -> torch.Tensor:
    return dx + masked(torch.mm(g, a), mask, f)


@pytest.mark.parametrize("p", [0.05, 0.5])
@pytest.mark.parametrize(("m", "k", "r"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, m: int, k: int, r: int, p: float) -> None:
    dx, g, a, mask = _inputs(m, k, r, dtype, device, p)
    f = 1.0 / (1.0 - p)
    want = add_masked_low_rank_ref(dx, g, a, mask, f)
    baseline = _torch_ops(dx, g, a, mask, f)
    got = add_masked_low_rank_(dx.clone(), g, a, mask, f)
    assert got.dtype == dtype
    testing.assert_close(got, want, baseline, name="dx")
    # Where the mask drops an element, dx is unchanged, bit for bit.
    assert torch.equal(got[~mask], dx[~mask])


def test_in_place_on_a_row_slice(device: str) -> None:
    buffer = testing.random_tensor((40, 300), torch.bfloat16, device, seed=7)
    dx = buffer[:, 50:250]  # row stride 300
    before = buffer.clone()
    _, g, a, mask = _inputs(40, 200, 16, torch.bfloat16, device, 0.1, seed=8)
    want = add_masked_low_rank_ref(dx, g, a, mask, 2.0)
    baseline = _torch_ops(dx, g, a, mask, 2.0)
    out = add_masked_low_rank_(dx, g, a, mask, 2.0)
    assert out.data_ptr() == dx.data_ptr()
    testing.assert_close(dx, want, baseline, name="dx")
    assert torch.equal(buffer[:, :50], before[:, :50]) and torch.equal(buffer[:, 250:], before[:, 250:])


def test_factor_and_mask_matter(device: str) -> None:
    # The reference tells a wrong factor or an ignored mask apart (a test that can fail).
    dx, g, a, mask = _inputs(37, 300, 16, torch.float32, device, 0.3)
    got = add_masked_low_rank_(dx.clone(), g, a, mask, 1 / 0.7)
    for wrong in (
        add_masked_low_rank_ref(dx, g, a, mask, 1.0),
        add_masked_low_rank_ref(dx, g, a, torch.ones_like(mask), 1 / 0.7),
    ):
        assert (got.double() - wrong).abs().max() > 1e-2


def test_compile_takes_torch_ops(device: str) -> None:
    dx, g, a, mask = _inputs(37, 300, 16, torch.float32, device, 0.3)
    fn = torch.compile(add_masked_low_rank_, fullgraph=True, backend="eager")
    got = fn(dx.clone(), g, a, mask, 1 / 0.7)
    testing.assert_close(
        got, add_masked_low_rank_ref(dx, g, a, mask, 1 / 0.7), _torch_ops(dx, g, a, mask, 1 / 0.7), name="dx"
    )


@pytest.mark.parametrize(("m", "k", "r"), [(37, 300, 16), (129, 257, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_addend_is_masked_with_the_product(device: str, dtype: torch.dtype, m: int, k: int, r: int) -> None:
    # DoRA's dropout term: dx += f m (dy_ms1 W + G A), the [M, K] addend read in the same pass.
    dx, g, a, mask = _inputs(m, k, r, dtype, device, 0.3)
    addend = testing.random_tensor((m, k), dtype, device, seed=9)
    f = 1 / 0.7
    want = add_masked_low_rank_ref(dx, g, a, mask, f, addend)
    baseline = dx + masked(addend, mask, f) + masked(torch.mm(g, a), mask, f)
    got = add_masked_low_rank_(dx.clone(), g, a, mask, f, addend=addend)
    testing.assert_close(got, want, baseline, name="dx")
    assert torch.equal(got[~mask], dx[~mask])
    without = add_masked_low_rank_ref(dx, g, a, mask, f)
    assert (got.double() - without).abs().max() > 1e-2


def _terms(m: int, k: int, ranks: list[int], dtype: torch.dtype, device: str) -> list[MaskedLowRank]:
    terms = []
    for i, r in enumerate(ranks):
        p = (0.05, 0.3, 0.5)[i % 3]
        _, g, a, mask = _inputs(m, k, r, dtype, device, p, seed=10 * i + 20)
        terms.append(MaskedLowRank(g, a, mask, 1.0 / (1.0 - p)))
    return terms


@pytest.mark.parametrize(("m", "k"), [(5, 130), (70, 1000), (129, 257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_several_terms_in_one_pass(device: str, dtype: torch.dtype, m: int, k: int) -> None:
    # q, k and v (ranks may differ): dx += sum_t f_t m_t (G_t A_t), dx read and written once.
    dx = testing.random_tensor((m, k), dtype, device, seed=3)
    terms = _terms(m, k, [16, 8, 33], dtype, device)
    want = add_masked_low_ranks_ref(dx, terms)
    baseline = dx.clone()
    for g, a, mask, f in terms:
        baseline += masked(torch.mm(g, a), mask, f)
    got = add_masked_low_ranks_(dx.clone(), terms)
    testing.assert_close(got, want, baseline, name="dx")
    dropped_by_all = ~(terms[0].mask | terms[1].mask | terms[2].mask)
    assert torch.equal(got[dropped_by_all], dx[dropped_by_all])
    for left_out in range(3):  # each term counts, under its own mask and factor
        fewer = add_masked_low_ranks_ref(dx, [t for i, t in enumerate(terms) if i != left_out])
        assert (got.double() - fewer).abs().max() > 1e-2
    swapped = [terms[0]._replace(mask=terms[1].mask), terms[1]._replace(mask=terms[0].mask), terms[2]]
    assert (got.double() - add_masked_low_ranks_ref(dx, swapped)).abs().max() > 1e-2


def test_several_terms_with_an_addend_on_the_first(device: str) -> None:
    dx = testing.random_tensor((37, 300), torch.float32, device, seed=3)
    terms = _terms(37, 300, [16, 16], torch.float32, device)
    addend = testing.random_tensor((37, 300), torch.float32, device, seed=9)
    got = add_masked_low_ranks_(dx.clone(), terms, addend)
    baseline = dx + masked(addend, terms[0].mask, terms[0].factor)
    for g, a, mask, f in terms:
        baseline += masked(torch.mm(g, a), mask, f)
    testing.assert_close(got, add_masked_low_ranks_ref(dx, terms, addend), baseline, name="dx")
    on_second = add_masked_low_ranks_ref(dx, terms[::-1], addend)
    assert (got.double() - on_second).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_more_terms_than_one_launch_takes(device: str, dtype: torch.dtype) -> None:
    # Five terms (TERMS_PER_LAUNCH is 3: two launches), the addend on the first only.
    from fk.lora.masked_low_rank import TERMS_PER_LAUNCH

    n_terms = TERMS_PER_LAUNCH + 2
    dx = testing.random_tensor((45, 200), dtype, device, seed=3)
    terms = _terms(45, 200, [16, 8, 16, 33, 16][:n_terms], dtype, device)
    addend = testing.random_tensor((45, 200), dtype, device, seed=9)
    got = add_masked_low_ranks_(dx.clone(), terms, addend)
    baseline = dx + masked(addend, terms[0].mask, terms[0].factor)
    for g, a, mask, f in terms:
        baseline += masked(torch.mm(g, a), mask, f)
    testing.assert_close(got, add_masked_low_ranks_ref(dx, terms, addend), baseline, name="dx")
    for left_out in (0, TERMS_PER_LAUNCH, n_terms - 1):  # a term of each launch counts
        fewer = add_masked_low_ranks_ref(dx, [t for i, t in enumerate(terms) if i != left_out], addend)
        assert (got.double() - fewer).abs().max() > 1e-2
    moved = add_masked_low_ranks_ref(dx, terms[1:] + terms[:1], addend)  # the addend on another term
    assert (got.double() - moved).abs().max() > 1e-2


def test_kernel_loads_and_stores_vectors() -> None:
    # Compiled for sm_90 on the CPU at its launch for q, k and v (three terms, r = 16): dx, the masks,
    # G and A read as 16-byte vectors, dx written so, nothing spilled (a loop over the rank spilled
    # 296 bytes on 2 warps: INDEX.md#masked_dropout_kernels).
    from fk.lora import masked_low_rank

    signature = {
        "dx_ptr": "*bf16", "g_ptrs": ("*bf16",) * 3, "a_ptrs": ("*bf16",) * 3, "mask_ptrs": ("*i1",) * 3,
        "ranks": ("i32",) * 3, "g_row_strides": ("i32",) * 3, "a_row_strides": ("i32",) * 3,
        "mask_row_strides": ("i32",) * 3, "factors": ("fp32",) * 3, "addend_ptr": "*i1", "n_rows": "i32",
        "n_cols": "i32", "dx_row_stride": "i32", "addend_row_stride": "i32", "N_TERMS": "", "HAS_ADDEND": "",
        "BLOCK_ROWS": "", "BLOCK_COLS": "", "BLOCK_RANK": "", "RANK_STEPS": "",
    }  # fmt: skip
    constexprs = {"N_TERMS": 3, "HAS_ADDEND": False, "BLOCK_ROWS": masked_low_rank.BLOCK_ROWS,
                  "BLOCK_COLS": masked_low_rank.BLOCK_COLS, "BLOCK_RANK": masked_low_rank.BLOCK_RANK, "RANK_STEPS": 1}  # fmt: skip
    compiled = testing.compile_kernel("fk.lora.masked_low_rank", "_add_masked_low_rank_kernel", signature, constexprs,
                                      num_warps=masked_low_rank.NUM_WARPS)  # fmt: skip
    counts = compiled.memory_instructions
    assert counts and all(".v4." in op or ".v2." in op for op in counts), counts
    assert compiled.spill_bytes == 0, compiled
    # The rank products on the tensor cores (16-bit tl.dot), not as FMAs.
    assert compiled.sync_and_mma.get("mma.sync", 0) > 0, compiled.sync_and_mma
    # A rank of 64 (four rank steps, unrolled) on the warps the launcher gives it: no spills either.
    several = testing.compile_kernel("fk.lora.masked_low_rank", "_add_masked_low_rank_kernel", signature,
                                     {**constexprs, "RANK_STEPS": 4},
                                     num_warps=masked_low_rank.NUM_WARPS_SEVERAL_RANK_STEPS)  # fmt: skip
    assert several.spill_bytes == 0, several
