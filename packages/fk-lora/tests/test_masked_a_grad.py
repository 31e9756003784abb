"""fk.lora's dropout A gradients ``dA_t = f_t (s G_t)^T (x * m_t)`` against float64: the Triton kernel
(16-bit x) on the GPU where there is one, else in the interpreter, and the torch expression."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.lora import masked_a_grad
from fk.lora.masked_a_grad import MaskedA, masked_a_grads, masked_a_grads_ref, masked_a_grads_torch
from fk.lora.masked_low_rank import masked


def _terms(m: int, k: int, ranks: list[int], dtype: torch.dtype, device: str, grad_dtypes: list[torch.dtype]) -> list[MaskedA]:  # fmt: skip
    terms = []
    for i, (r, grad_dtype) in enumerate(zip(ranks, grad_dtypes, strict=True)):
        p = (0.05, 0.3, 0.5)[i % 3]
        gs = testing.random_tensor((m, r), dtype, device, seed=10 * i + 1)
        gen = torch.Generator().manual_seed(10 * i + 2)
        mask = (torch.rand((m, k), generator=gen) >= p).to(device)
        terms.append(MaskedA(gs, mask, 1.0 / (1.0 - p), grad_dtype))
    return terms


def _check(x: torch.Tensor, terms: list[MaskedA]) -> list[torch.Tensor]:
    got = masked_a_grads(x, terms)
    for i, (g, want, base, term) in enumerate(
        zip(got, masked_a_grads_ref(x, terms), masked_a_grads_torch(x, terms), terms, strict=True)
    ):
        assert g.dtype == term.dtype and g.shape == (term.gs.shape[1], x.shape[1])
        testing.assert_close(g, want, base, name=f"dA[{i}]")
    return got


@pytest.mark.parametrize(("m", "k"), [(1, 1), (5, 130), (70, 1000), (300, 257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, m: int, k: int) -> None:
    # q, k and v: ranks that differ and are not multiples of 16; gradients in fp32 and in x's dtype.
    x = testing.random_tensor((m, k), dtype, device, seed=0)
    _check(x, _terms(m, k, [16, 8, 33], dtype, device, [torch.float32, dtype, dtype]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_one_projection_and_strided_inputs(device: str, dtype: torch.dtype) -> None:
    wide = testing.random_tensor((70, 400), dtype, device, seed=0)
    x = wide[:, 30:330]  # row stride 400
    (term,) = _terms(70, 300, [16], dtype, device, [dtype])
    gs_wide = testing.random_tensor((70, 40), dtype, device, seed=5)
    _check(x, [term._replace(gs=gs_wide[:, 4:20])])


def test_each_mask_factor_and_projection_counts(device: str) -> None:
    # A test that can fail: swapped masks, a dropped factor, or another projection's s G leaking
    # into a gradient all move the result.
    x = testing.random_tensor((129, 257), torch.bfloat16, device, seed=0)
    terms = _terms(129, 257, [16, 16, 8], torch.bfloat16, device, [torch.float32] * 3)
    got = masked_a_grads(x, terms)
    wrongs = [
        masked_a_grads_ref(x, [terms[0]._replace(mask=terms[1].mask), terms[1], terms[2]])[0],
        masked_a_grads_ref(x, [terms[0]._replace(factor=1.0), terms[1], terms[2]])[0],
        masked_a_grads_ref(x, [terms[0]._replace(gs=terms[0].gs + terms[1].gs), terms[1], terms[2]])[0],
    ]
    for wrong in wrongs:
        assert (got[0].double() - wrong).abs().max() > 1e-2


def test_launches_of_three_and_wide_ranks(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # More than three projections: launches of three; a rank above MAX_RANK: the torch expression.
    monkeypatch.setattr(masked_a_grad, "MAX_RANK", 32)
    terms = _terms(70, 300, [16, 16, 8, 40, 16, 32], torch.bfloat16, device, [torch.float32] * 6)
    assert masked_a_grad._launches(terms) == [[0, 1, 2], [4, 5]]
    x = testing.random_tensor((70, 300), torch.bfloat16, device, seed=0)
    _check(x, terms)


def test_compile_takes_torch_ops(device: str) -> None:
    x = testing.random_tensor((37, 300), torch.bfloat16, device, seed=0)
    terms = _terms(37, 300, [16, 8], torch.bfloat16, device, [torch.float32, torch.bfloat16])
    fn = torch.compile(masked_a_grads, fullgraph=True, backend="eager")
    # Under compile scaled_mm is (mm * f).to(dtype): the product rounded to bf16 first, on a GPU too.
    bf16_products = [(torch.mm(t.gs.t(), masked(x, t.mask, 1.0)) * t.factor).to(t.dtype) for t in terms]
    for got, want, base in zip(fn(x, terms), masked_a_grads_ref(x, terms), bf16_products, strict=True):
        testing.assert_close(got, want, base, name="dA")
