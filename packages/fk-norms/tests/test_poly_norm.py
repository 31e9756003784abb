"""PolyNorm against its float64 reference: on the GPU where there is one, else in Triton's interpreter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fk.core import testing
from fk.core.testing import AWKWARD_ROWS, AWKWARD_WIDTHS, DTYPES, WIDE_WIDTHS, dtype_name
from fk.norms import PolyNorm, poly_norm, poly_norm_ref
from fk.norms.poly_norm import partial_rows

EPS = 1e-6
NAMES = ["x", "weight", "bias"]
# With one column, each norm(x^p) is sign(x^p) up to eps: dx is pure cancellation, judged against |dy|.
WIDTH_ONE_ATOLS = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _fk(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return poly_norm(x, w, b, EPS)


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return poly_norm_ref(x, w, b, EPS)


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, weight_grad: bool = True, bias_grad: bool = True
) -> list[Any]:
    x = testing.random_tensor(shape, dtype, device, seed=seed, requires_grad=True)
    # Distinct weights, so that a kernel that swaps x and x^3 is caught.
    w = torch.tensor([0.5, -0.3, 0.8], dtype=dtype, device=device).requires_grad_(weight_grad)
    b = torch.tensor([0.25], dtype=dtype, device=device).requires_grad_(bias_grad)
    return [x, w, b]


@pytest.mark.parametrize("width", AWKWARD_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, width: int) -> None:
    args = _inputs((7, width), dtype, device, seed=width)
    atols = WIDTH_ONE_ATOLS if width == 1 else None
    result = testing.compare_with_reference(_fk, _ref, args, arg_names=NAMES, atols=atols)
    assert result.names == ["output0", "grad of x", "grad of weight", "grad of bias"]


@pytest.mark.parametrize("width", WIDE_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_rows_match_reference(device: str, dtype: torch.dtype, width: int) -> None:
    testing.compare_with_reference(_fk, _ref, _inputs((3, width), dtype, device, seed=width), arg_names=NAMES)


@pytest.mark.parametrize("rows", AWKWARD_ROWS)
def test_row_counts_and_leading_dims(device: str, rows: int) -> None:
    testing.compare_with_reference(
        _fk, _ref, _inputs((rows, 2, 96), torch.bfloat16, device, seed=rows), arg_names=NAMES
    )


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_non_contiguous_input(device: str, dtype: torch.dtype, layout: str) -> None:
    x, w, b = _inputs((33, 300), dtype, device, seed=5)
    testing.compare_with_reference(_fk, _ref, [testing.with_layout(x, layout), w, b], arg_names=NAMES)


def test_matches_polycom_formula(device: str) -> None:
    # The published definition, written out term by term.
    x = testing.random_tensor((5, 64), torch.float64, "cpu", seed=6)
    w = torch.tensor([0.5, -0.3, 0.8], dtype=torch.float64)
    b = torch.tensor([0.25], dtype=torch.float64)

    def norm(u: torch.Tensor) -> torch.Tensor:
        return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + EPS)

    want = w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b
    torch.testing.assert_close(poly_norm_ref(x, w, b, EPS), want)
    got = poly_norm(x.float().to(device), w.float().to(device), b.float().to(device), EPS)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)


FROZEN = [(False, True), (True, False), (False, False)]


@pytest.mark.parametrize(("weight_grad", "bias_grad"), FROZEN, ids=["frozen_w", "frozen_b", "frozen_both"])
@pytest.mark.parametrize("width", [1000, 16385])
def test_frozen_params_match_reference(device: str, width: int, weight_grad: bool, bias_grad: bool) -> None:
    args = _inputs((5, width), torch.float32, device, seed=11, weight_grad=weight_grad, bias_grad=bias_grad)
    result = testing.compare_with_reference(_fk, _ref, args, arg_names=NAMES)
    assert result.names == ["output0", "grad of x"] + ["grad of weight"] * weight_grad + ["grad of bias"] * bias_grad
    x, w, b = (t.detach().requires_grad_(t.requires_grad) for t in args)
    poly_norm(x, w, b).sum().backward()
    assert (w.grad is not None, b.grad is not None) == (weight_grad, bias_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_input_trainable_params(device: str, dtype: torch.dtype) -> None:
    x, w, b = _inputs((9, 200), dtype, device, seed=4)
    x.requires_grad_(False)
    result = testing.compare_with_reference(_fk, _ref, [x, w, b], arg_names=NAMES)
    assert result.names == ["output0", "grad of weight", "grad of bias"]


@pytest.mark.parametrize(("weight_grad", "bias_grad"), [(True, True), *FROZEN])
def test_frozen_params_allocate_no_partial_buffer(device: str, weight_grad: bool, bias_grad: bool) -> None:
    rows, width = (64, 1000) if device == "cpu" else (2048, 1000)
    partial_bytes = partial_rows(rows, width, torch.device(device)) * 4 * 4
    x, w, b = _inputs((rows, width), torch.bfloat16, device, seed=14, weight_grad=weight_grad, bias_grad=bias_grad)
    y = poly_norm(x, w, b)
    dy = torch.randn_like(y)
    sizes = testing.allocation_sizes(lambda: y.backward(dy))
    assert testing.count_buffers(sizes, rows * width * 2, device) == 1, sizes  # the profiler sees dx
    assert testing.count_buffers(sizes, partial_bytes, device) == (weight_grad or bias_grad), sizes
    assert (w.grad is not None, b.grad is not None) == (weight_grad, bias_grad)


def test_scalar_bias_and_zero_rows(device: str) -> None:
    x, w, b = _inputs((4, 20), torch.float32, device, seed=15)
    b0 = b.detach().reshape(()).requires_grad_()
    y = poly_norm(x, w, b0)
    y.sum().backward()
    assert b0.grad is not None and b0.grad.shape == ()
    torch.testing.assert_close(y, poly_norm_ref(x, w, b0, EPS))
    x0 = torch.empty(0, 8, device=device, requires_grad=True)
    poly_norm(x0, w, b).sum().backward()
    assert x0.grad is not None and x0.grad.shape == (0, 8)


def test_module(device: str) -> None:
    norm = PolyNorm(eps=1e-5, device=device)
    assert list(norm.state_dict().keys()) == ["weight", "bias"]
    torch.testing.assert_close(norm.weight, torch.full((3,), 1 / 3, device=device))
    torch.testing.assert_close(norm.bias, torch.ones(1, device=device))
    x = testing.random_tensor((2, 3, 40), torch.float32, device, seed=16, requires_grad=True)
    torch.testing.assert_close(norm(x), poly_norm_ref(x, norm.weight, norm.bias, 1e-5), rtol=1e-5, atol=1e-5)
    assert "eps=1e-05" in repr(norm)


def test_bad_inputs(device: str) -> None:
    x = torch.randn(4, 8, device=device)
    w = torch.randn(3, device=device)
    b = torch.randn(1, device=device)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        poly_norm([1.0], w, b)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x must have dtype in"):
        poly_norm(x.int(), w, b)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\), got \(8,\)"):
        poly_norm(x, torch.randn(8, device=device), b)
    with pytest.raises(TypeError, match=r"weight must be a torch\.Tensor"):
        poly_norm(x, None, b)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bias must have shape \(1,\) or \(\), got \(8,\)"):
        poly_norm(x, w, torch.randn(8, device=device))
    with pytest.raises(ValueError, match="bias must be on the device of x"):
        poly_norm(x, w, torch.randn(1, device="meta"))
    with pytest.raises(ValueError, match="eps must be > 0"):
        poly_norm(x, w, b, eps=0.0)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        poly_norm(torch.randn(4, 0, device=device), w, b)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_torch_compile_fullgraph(device: str, frozen: bool) -> None:
    x, w, b = _inputs((6, 257), torch.float32, device, seed=19, weight_grad=not frozen, bias_grad=not frozen)

    def loss(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return (poly_norm(x * 2.0, w, b, EPS) * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [x] if frozen else [x, w, b])


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.norms import poly_norm, poly_norm_ref, PolyNorm;"
        "x = torch.randn(3, 10); m = PolyNorm();"
        "assert torch.equal(m(x), poly_norm_ref(x, m.weight, m.bias, 1e-6)); print('ok')"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1024, 4096, 8192, 32768, 65536])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_gpu_training_shapes(width: int, frozen: bool) -> None:
    args = _inputs((4096 if width <= 8192 else 512, width), torch.bfloat16, "cuda", seed=width,
                   weight_grad=not frozen, bias_grad=not frozen)  # fmt: skip
    testing.compare_with_reference(_fk, _ref, args, arg_names=NAMES)
