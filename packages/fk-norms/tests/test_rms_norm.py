"""RMSNorm against its float64 reference: on the GPU where there is one, else in Triton's interpreter."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fk.core import testing
from fk.core.testing import AWKWARD_ROWS, AWKWARD_WIDTHS, DTYPES, WIDE_WIDTHS, dtype_name
from fk.norms import RMSNorm, rms_norm, rms_norm_and_input, rms_norm_ref
from fk.norms.norm_strips import strip_grid
from fk.norms.rms_norm import BACKWARD, _bwd_tiling, dw_partial_rows

RMS_NORM_MODULE = importlib.import_module("fk.norms.rms_norm")  # (fk.norms.rms_norm is the function)

MODES = ("llama", "gemma")
EPS = 1e-6


def _fk(mode: str, eps: float = EPS) -> Callable[..., torch.Tensor]:
    return lambda x, w=None: rms_norm(x, w, eps, casting_mode=mode)


def _ref(mode: str, eps: float = EPS) -> Callable[..., torch.Tensor]:
    return lambda x, w=None: rms_norm_ref(x, w, eps, mode)


# With one column, dx = r * (g - xhat^2 g) is zero up to eps: pure cancellation between terms of
# size |g|, so its error is judged against |g| (up to ~10 here), not against dx.
WIDTH_ONE_ATOLS = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-4}


def _atols(width: int) -> dict[torch.dtype, float] | None:
    return WIDTH_ONE_ATOLS if width == 1 else None


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, weight_grad: bool = True) -> list[Any]:
    x = testing.random_tensor(shape, dtype, device, seed=seed, scale=2.0, requires_grad=True)
    w = testing.random_tensor(
        shape[-1:], dtype, device, seed=seed + 1, offset=1.0, scale=0.5, requires_grad=weight_grad
    )
    return [x, w]


@pytest.mark.parametrize("width", AWKWARD_WIDTHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, mode: str, width: int) -> None:
    args = _inputs((7, width), dtype, device, seed=width)
    testing.compare_with_reference(_fk(mode), _ref(mode), args, arg_names=["x", "weight"], atols=_atols(width))


@pytest.mark.parametrize("width", WIDE_WIDTHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_rows_match_reference(device: str, dtype: torch.dtype, mode: str, width: int) -> None:
    args = _inputs((3, width), dtype, device, seed=width)
    testing.compare_with_reference(_fk(mode), _ref(mode), args, arg_names=["x", "weight"])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_one_tile_rows_match_reference(device: str, dtype: torch.dtype) -> None:
    # Rows of one 16384-column tile, more than the backward's programs: with dw the weight is loaded for
    # every tile (BACKWARD.weight_per_tile_cols) and the loop does not prefetch (prefetch_max_cols).
    args = _inputs((9, 9000), dtype, device, seed=9000)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), args, arg_names=["x", "weight"])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_widest_rows_several_at_a_time(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows of at least BACKWARD.widest_min_cols with a weight gradient: the looped backward (not the
    # two-pass one) takes several rows a tile (widest_rows), every program two tiles or more, the
    # last one partial.
    width = BACKWARD.widest_min_cols
    monkeypatch.setattr(RMS_NORM_MODULE, "BACKWARD", BACKWARD._replace(strips_min_cols=width + 1))
    tiling = _bwd_tiling(width)
    assert tiling.looped and tiling.rows_per_tile > 1 and width % tiling.block_cols != 0
    rows = (2 * dw_partial_rows(1 << 30, width, torch.device(device)) + 1) * tiling.rows_per_tile - 1
    args = _inputs((rows, width), dtype, device, seed=7)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), args, arg_names=["x", "weight"])


def partial_buffer_bytes(rows: int, width: int, device: str) -> int:
    """Bytes of the fp32 partial rows of dw that RMSNorm's backward allocates at this shape: one row
    per program of the one-kernel grid, or per row group of the strips (fk.norms.norm_strips)."""
    if width >= BACKWARD.strips_min_cols:
        return strip_grid(rows, width, torch.device(device), RMS_NORM_MODULE.STRIPS)[0] * width * 4
    return dw_partial_rows(rows, width, torch.device(device)) * width * 4


def strips_from(
    monkeypatch: pytest.MonkeyPatch,
    width: int,
    device: str,
    residual: bool = False,
    module: ModuleType = RMS_NORM_MODULE,
) -> int:
    """Make rows from ``width`` columns on take the two-pass backward (fk.norms.norm_strips) of
    ``module`` (fk.norms.rms_norm, or fk.norms.layer_norm: the same table names) with small strips;
    returns a row count that gives every row group of pass 2 two row tiles and a partial third.
    Shared with test_fused_add_rms_norm.py and test_layer_norm.py."""
    field = "strips_min_cols_residual" if residual else "strips_min_cols"
    monkeypatch.setattr(module, "BACKWARD", module.BACKWARD._replace(**{field: width}))
    table = "STRIPS_RESIDUAL" if residual else "STRIPS"
    params = getattr(module, table)._replace(block_cols=256, block_rows=4, dot_block_cols=512, dot_rows=2)
    monkeypatch.setattr(module, table, params)
    groups, _ = strip_grid(1 << 30, width, torch.device(device), params)
    return (2 * groups + 1) * params.block_rows - 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_strips_backward_matches_reference(
    device: str, dtype: torch.dtype, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The two-pass backward: 1100 columns are 5 strips of 256 (the last partial) and 3 column
    # tiles of pass 1 (the last partial); rows in partial tiles of both passes.
    rows = strips_from(monkeypatch, 1100, device)
    calls = []
    original = RMS_NORM_MODULE.launch_strips_backward
    monkeypatch.setattr(RMS_NORM_MODULE, "launch_strips_backward", lambda *a: calls.append(1) or original(*a))
    args = _inputs((rows, 1100), dtype, device, seed=1100)
    testing.compare_with_reference(_fk(mode), _ref(mode), args, arg_names=["x", "weight"])
    assert calls  # the path under test ran


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_strips_backward_in_place_and_frozen(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # dx written over dy (each element read before it is written), and a frozen weight (the
    # one-kernel backward: no weight gradient to sum in strips).
    rows = strips_from(monkeypatch, 700, device)
    fk_fn = lambda x, w: rms_norm(x, w, EPS, in_place_backward=True)  # noqa: E731
    testing.compare_with_reference(
        fk_fn, _ref("llama"), _inputs((rows, 700), dtype, device, seed=70), arg_names=["x", "weight"]
    )
    frozen = _inputs((rows, 700), dtype, device, seed=71, weight_grad=False)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), frozen, arg_names=["x", "weight"])


@pytest.mark.parametrize("dw_first", [False, True], ids=["dw_after_dx", "dw_before_dx"])
@pytest.mark.parametrize("width", [100, 1500])  # 64 rows a tile (dw summed in 2-D), and 4
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_every_program_takes_several_tiles(
    device: str, dtype: torch.dtype, width: int, dw_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a weight gradient, every program of the backward's persistent grid gets three row tiles
    # or more, the last one partial: its loop computes tiles it prefetched, and prefetches one
    # past the end. The tile's dw is added after dx or before it (BACKWARD.dw_first_*).
    order = {"dw_first_min_cols": 1 if dw_first else 1 << 30, "dw_first_prefetched_min_rows": 1}
    monkeypatch.setattr(RMS_NORM_MODULE, "BACKWARD", BACKWARD._replace(**order))

    rows = (3 * dw_partial_rows(1 << 30, width, torch.device(device)) + 1) * _bwd_tiling(width).rows_per_tile - 1
    args = _inputs((rows, width), dtype, device, seed=width)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), args, arg_names=["x", "weight"])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_backward_in_blocks_of_consecutive_tiles(
    device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each program a block of consecutive row tiles (BACKWARD.contiguous_min_cols): three or more
    # tiles a program, the last tile partial, and the last program's block short.
    monkeypatch.setattr(RMS_NORM_MODULE, "BACKWARD", BACKWARD._replace(contiguous_min_cols=300))
    width = 300
    tiles = 3 * dw_partial_rows(1 << 30, width, torch.device(device)) + 2
    rows = tiles * _bwd_tiling(width).rows_per_tile - 1
    args = _inputs((rows, width), dtype, device, seed=19)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), args, arg_names=["x", "weight"])


@pytest.mark.parametrize("rows", AWKWARD_ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_row_counts_and_leading_dims(device: str, dtype: torch.dtype, rows: int) -> None:
    args = _inputs((rows, 2, 96), dtype, device, seed=rows)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), args, arg_names=["x", "weight"])


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_non_contiguous_input(device: str, dtype: torch.dtype, layout: str) -> None:
    x, w = _inputs((33, 300), dtype, device, seed=5)
    x = testing.with_layout(x, layout)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), [x, w], arg_names=["x", "weight"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_weight_matches_reference(device: str, dtype: torch.dtype, mode: str) -> None:
    args = _inputs((7, 1000), dtype, device, seed=11, weight_grad=False)
    result = testing.compare_with_reference(_fk(mode), _ref(mode), args, arg_names=["x", "weight"])
    assert result.names == ["output0", "grad of x"]


@pytest.mark.parametrize("width", [100, 20000])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_no_weight(device: str, dtype: torch.dtype, width: int) -> None:
    x = testing.random_tensor((5, width), dtype, device, seed=3, requires_grad=True)
    testing.compare_with_reference(_fk("llama"), _ref("llama"), [x])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_input_trainable_weight(device: str, dtype: torch.dtype) -> None:
    x, w = _inputs((9, 200), dtype, device, seed=4)
    x.requires_grad_(False)
    result = testing.compare_with_reference(_fk("llama"), _ref("llama"), [x, w], arg_names=["x", "weight"])
    assert result.names == ["output0", "grad of weight"]


def test_offset_argument(device: str) -> None:
    x, w = _inputs((6, 64), torch.float32, device, seed=8)
    fk_fn = lambda x, w: rms_norm(x, w, EPS, casting_mode="llama", offset=0.5)  # noqa: E731
    ref_fn = lambda x, w: rms_norm_ref(x, w, EPS, "llama", 0.5)  # noqa: E731
    testing.compare_with_reference(fk_fn, ref_fn, [x, w], arg_names=["x", "weight"])


def test_llama_mode_matches_torch_rms_norm(device: str) -> None:
    x, w = _inputs((17, 513), torch.float32, device, seed=9)
    expected = torch.nn.functional.rms_norm(x.detach(), (513,), w.detach(), EPS)
    torch.testing.assert_close(rms_norm(x.detach(), w.detach(), EPS), expected, rtol=1e-5, atol=1e-5)


def test_gemma_mode_applies_one_plus_weight(device: str) -> None:
    x, w = _inputs((4, 32), torch.float32, device, seed=10)
    expected = rms_norm(x.detach(), w.detach() + 1.0, EPS, casting_mode="llama")
    torch.testing.assert_close(rms_norm(x.detach(), w.detach(), EPS, casting_mode="gemma"), expected)


def test_zero_rows(device: str) -> None:
    x = torch.empty(0, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 64)
    assert w.grad is not None and torch.equal(w.grad, torch.zeros(64, device=device))


def test_every_output_element_is_written(device: str) -> None:
    # Poison the allocator's memory: outputs must not keep NaNs from earlier tensors.
    for _ in range(3):
        torch.full((7, 3000), float("nan"), device=device)
    x, w = _inputs((7, 3000), torch.bfloat16, device, seed=12)
    y = rms_norm(x, w)
    y.backward(torch.ones_like(y))
    assert torch.isfinite(y).all() and x.grad is not None and torch.isfinite(x.grad).all()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_upstream_gradient_with_zero_strides(device: str) -> None:
    # loss.sum() sends back an expanded gradient (every stride 0).
    x, w = _inputs((5, 130), torch.float32, device, seed=13)
    rms_norm(x, w).sum().backward()
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))
    rms_norm_ref(xr, wr, EPS).sum().backward()
    assert x.grad is not None and w.grad is not None and xr.grad is not None and wr.grad is not None
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", [1000, 20000])
def test_frozen_weight_allocates_no_partial_buffer(device: str, width: int) -> None:
    # Enough rows that the grid is capped by the device, not by the rows (fewer in the interpreter).
    rows = {("cuda", 1000): 8192, ("cuda", 20000): 600, ("cpu", 1000): 63, ("cpu", 20000): 40}[(device, width)]
    partial_bytes = partial_buffer_bytes(rows, width, device)
    dx_bytes = rows * width * 2
    assert testing.count_buffers([dx_bytes], partial_bytes, device) == 0  # the sizes are told apart
    for weight_grad in (True, False):
        x, w = _inputs((rows, width), torch.bfloat16, device, seed=14, weight_grad=weight_grad)
        y = rms_norm(x, w)
        dy = torch.randn_like(y)
        sizes = testing.allocation_sizes(lambda: y.backward(dy))  # noqa: B023
        assert testing.count_buffers(sizes, dx_bytes, device) == 1, sizes  # the profiler sees the backward
        assert testing.count_buffers(sizes, partial_bytes, device) == weight_grad, sizes
        if not weight_grad:
            assert max(sizes) < dx_bytes + testing.CUDA_UNSPLIT_SLACK, sizes  # nothing but dx is that large
        assert (w.grad is not None) == weight_grad


def test_module_matches_torch_module(device: str) -> None:
    torch_norm = torch.nn.RMSNorm(96, eps=1e-5, device=device)
    with torch.no_grad():
        torch_norm.weight.normal_()
    fk_norm = RMSNorm(96, eps=1e-5, device=device)
    assert fk_norm.state_dict().keys() == torch_norm.state_dict().keys()
    fk_norm.load_state_dict(torch_norm.state_dict())
    x = testing.random_tensor((3, 5, 96), torch.float32, device, seed=15)
    torch.testing.assert_close(fk_norm(x), torch_norm(x), rtol=1e-5, atol=1e-5)
    assert isinstance(fk_norm, torch.nn.RMSNorm)


@pytest.mark.parametrize("affine", [True, False])
def test_module_options(device: str, affine: bool) -> None:
    torch_norm = torch.nn.RMSNorm((4, 24), elementwise_affine=affine, device=device)  # eps=None
    fk_norm = RMSNorm((4, 24), elementwise_affine=affine, device=device)
    if affine:
        with torch.no_grad():
            torch_norm.weight.normal_()
        fk_norm.load_state_dict(torch_norm.state_dict())
    x = testing.random_tensor((3, 4, 24), torch.float32, device, seed=16)
    torch.testing.assert_close(fk_norm(x), torch_norm(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"x must end with the dimensions \(4, 24\)"):
        fk_norm(x[..., :10])


def test_bad_inputs(device: str) -> None:
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        rms_norm([1.0], w)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x must have dtype in"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="weight must have dtype in"):
        rms_norm(x, w.to(torch.int64))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\), got \(7,\)"):
        rms_norm(x, w[:7])
    with pytest.raises(ValueError, match="weight must be on the device of x"):
        rms_norm(x, torch.randn(8, device="meta"))
    with pytest.raises(ValueError, match="eps must be > 0"):
        rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="casting_mode must be one of"):
        rms_norm(x, w, casting_mode="llama3")
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        rms_norm(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        rms_norm(torch.randn(4, 0, device=device))
    with pytest.raises(TypeError, match="offset must be a float"):
        rms_norm(x, w, offset="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="casting_mode must be one of"):
        RMSNorm(8, casting_mode="gema")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_torch_compile_fullgraph(device: str, dtype: torch.dtype) -> None:
    x, w = _inputs((6, 257), dtype, device, seed=17)

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x * 2.0, w, EPS) * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [x, w])


S = testing.strategies()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=S.dtypes, layout=S.layouts, rows=S.rows(40), width=S.widths(3000), mode=st.sampled_from(MODES))
def test_property_any_shape_dtype_layout(
    device: str, dtype: torch.dtype, layout: str, rows: int, width: int, mode: str
) -> None:
    x, w = _inputs((rows, width), dtype, device, seed=rows * 7919 + width)
    x = testing.with_layout(x, layout)
    testing.compare_with_reference(_fk(mode), _ref(mode), [x, w], arg_names=["x", "weight"], atols=_atols(width))


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.norms import rms_norm, rms_norm_ref; from fk.core import backend;"
        "x = torch.randn(3, 10, dtype=torch.bfloat16); w = torch.randn(10, dtype=torch.bfloat16);"
        "assert backend.kernel_path(x) is backend.KernelPath.REFERENCE;"
        "assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)); print('ok')"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1024, 4096, 8192, 32768, 65536])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_training_shapes(width: int, mode: str) -> None:
    args = _inputs((4096 if width <= 8192 else 512, width), torch.bfloat16, "cuda", seed=width)
    testing.compare_with_reference(_fk(mode), _ref(mode), args, arg_names=["x", "weight"])


# --- in_place_backward: dx written over dy ----------------------------------------------------------


@pytest.mark.parametrize("width", [*AWKWARD_WIDTHS, *WIDE_WIDTHS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_in_place_backward_matches_reference(device: str, dtype: torch.dtype, width: int) -> None:
    rows = 3 if width > 5000 else 7
    args = _inputs((rows, width), dtype, device, seed=width + 1)
    fk_fn = lambda x, w: rms_norm(x, w, EPS, in_place_backward=True)  # noqa: E731
    testing.compare_with_reference(fk_fn, _ref("llama"), args, arg_names=["x", "weight"], atols=_atols(width))


@pytest.mark.parametrize("weight_grad", [True, False], ids=["trainable", "frozen"])
@pytest.mark.parametrize("width", [300, 20000])
def test_in_place_backward_writes_over_dy_and_allocates_no_dx(device: str, width: int, weight_grad: bool) -> None:
    rows = 40 if device == "cpu" else 600
    x, w = _inputs((rows, width), torch.bfloat16, device, seed=21, weight_grad=weight_grad)
    y = rms_norm(x, w, EPS, in_place_backward=True)
    dy = testing.random_tensor((rows, width), torch.bfloat16, device, seed=22)
    dy_copy = dy.clone()
    leaves = (x, w) if weight_grad else (x,)
    grads: list[Any] = []
    sizes = testing.allocation_sizes(lambda: grads.extend(torch.autograd.grad(y, leaves, dy)))
    dx = grads[0]
    assert dx.data_ptr() == dy.data_ptr()  # dy now holds dx
    assert testing.count_buffers(sizes, rows * width * 2, device) == 0, sizes  # no dx-sized buffer
    partial_bytes = partial_buffer_bytes(rows, width, device)
    assert testing.count_buffers(sizes, partial_bytes, device) == weight_grad, sizes  # the profiler saw it
    # The same gradients as the out-of-place backward.
    x2, w2 = (t.detach().requires_grad_(t.requires_grad) for t in (x, w))
    want = torch.autograd.grad(rms_norm(x2, w2, EPS), (x2, w2) if weight_grad else (x2,), dy_copy)
    for g, e in zip(grads, want, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_in_place_backward_falls_back_where_dy_is_not_writable(device: str) -> None:
    # loss.sum() sends an expanded gradient (stride 0): there is nothing to write over.
    x, w = _inputs((5, 130), torch.float32, device, seed=23)
    rms_norm(x, w, EPS, in_place_backward=True).sum().backward()
    assert x.grad is not None and w.grad is not None
    x2, w2 = (t.detach().requires_grad_() for t in (x, w))
    rms_norm(x2, w2, EPS).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=0)


def test_in_place_backward_is_unsafe_when_dy_is_shared(device: str) -> None:
    # Why it is off by default: a sandwich norm's output is added to the residual, and autograd
    # hands the same gradient tensor to both branches of the add. Written over, the residual
    # branch would see dx instead of dy. This test documents the hazard.
    x, w = _inputs((4, 64), torch.float32, device, seed=24)
    residual = testing.random_tensor((4, 64), torch.float32, device, seed=25, requires_grad=True)
    dy = testing.random_tensor((4, 64), torch.float32, device, seed=26)
    (residual + rms_norm(x, w, EPS, in_place_backward=True)).backward(dy)
    assert residual.grad is not None and not torch.equal(residual.grad, dy)  # corrupted, as documented
    residual.grad = None
    (residual + rms_norm(x, w, EPS)).backward(dy)
    assert residual.grad is not None and torch.equal(residual.grad, dy)  # the default is safe


def test_in_place_backward_module_and_compile(device: str) -> None:
    norm = RMSNorm(257, eps=EPS, device=device, in_place_backward=True)
    assert "in_place_backward=True" in repr(norm)
    x = testing.random_tensor((6, 257), torch.float32, device, seed=27, requires_grad=True)

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x * 2.0, w, EPS, in_place_backward=True) * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [x, norm.weight])
    with pytest.raises(TypeError, match="in_place_backward must be a bool"):
        rms_norm(x, norm.weight, in_place_backward=1)  # type: ignore[arg-type]


# --- rms_norm_and_input: (rms_norm(x), x), x's second gradient added inside the backward kernel ----


def _fk_and_input(mode: str) -> Callable[..., Any]:
    return lambda x, w=None: rms_norm_and_input(x, w, EPS, casting_mode=mode)


def _ref_and_input(mode: str) -> Callable[..., Any]:
    # x * 1 (not x): an output that is an input would get no upstream gradient of its own.
    return lambda x, w=None: (rms_norm_ref(x, w, EPS, mode), x * 1)


@pytest.mark.parametrize("width", [1, 17, 1000, 4097, 16385])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_and_input_matches_reference(device: str, dtype: torch.dtype, mode: str, width: int) -> None:
    args = _inputs((7, width), dtype, device, seed=width + 31)
    testing.compare_with_reference(
        _fk_and_input(mode), _ref_and_input(mode), args, arg_names=["x", "weight"], atols=_atols(width)
    )


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
def test_and_input_non_contiguous_frozen_and_no_weight(device: str, layout: str) -> None:
    x, w = _inputs((9, 130), torch.bfloat16, device, seed=33, weight_grad=False)
    x = testing.with_layout(x, layout)
    testing.compare_with_reference(_fk_and_input("llama"), _ref_and_input("llama"), [x, w], arg_names=["x", "weight"])
    testing.compare_with_reference(_fk_and_input("gemma"), _ref_and_input("gemma"), [x], arg_names=["x"])


def test_and_input_hands_on_x_without_a_copy(device: str) -> None:
    x, w = _inputs((5, 64), torch.float32, device, seed=34)
    h = x * 1.0
    y, h_on = rms_norm_and_input(h, w, EPS)
    assert h_on.data_ptr() == h.data_ptr() and h_on.shape == h.shape and h_on.stride() == h.stride()
    assert h_on.grad_fn is not None and h_on.grad_fn is y.grad_fn
    torch.testing.assert_close(y, rms_norm(h, w, EPS), rtol=0, atol=0)


@pytest.mark.parametrize("used", ["y_only", "x_only"])
def test_and_input_one_output_unused(device: str, used: str) -> None:
    x, w = _inputs((5, 200), torch.float32, device, seed=35)
    y, x_on = rms_norm_and_input(x, w, EPS)
    out = y if used == "y_only" else x_on
    dy = testing.random_tensor(out.shape, torch.float32, device, seed=36)
    got = torch.autograd.grad(out, (x, w), dy, allow_unused=True)
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))
    want_out = rms_norm_ref(xr, wr, EPS) if used == "y_only" else xr * 1
    want = torch.autograd.grad(want_out, (xr, wr), dy.double(), allow_unused=True)
    for g, e in zip(got, want, strict=True):
        assert (g is None) == (e is None)
        if g is not None and e is not None:
            torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5)


def test_and_input_in_a_residual_block(device: str) -> None:
    # The use it is made for: h -> (norm(h), h), then h + f(norm(h)); gradients as with rms_norm.
    x, w = _inputs((6, 96), torch.float32, device, seed=37)

    def block(norm_and_input: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
        h = x * 1.5
        y, residual = norm_and_input(h)
        out = residual + torch.tanh(y) * 0.5
        return (out, *torch.autograd.grad((out * out).sum(), (x, w)))

    got = block(lambda h: rms_norm_and_input(h, w, EPS))
    want = block(lambda h: (rms_norm(h, w, EPS), h))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_and_input_bad_inputs_and_compile(device: str) -> None:
    x, w = _inputs((6, 257), torch.float32, device, seed=38)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_and_input(x, w[:-1])
    with pytest.raises(ValueError, match="casting_mode must be one of"):
        rms_norm_and_input(x, w, casting_mode="gema")

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y, x_on = rms_norm_and_input(x * 2.0, w, EPS)
        return (y * 3.0 + x_on).sum()

    testing.assert_compile_matches_eager(loss, [x, w])
