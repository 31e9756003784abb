"""LayerNorm against its float64 reference: on the GPU where there is one, else in Triton's interpreter."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fk.core import testing
from fk.core.testing import AWKWARD_ROWS, AWKWARD_WIDTHS, DTYPES, WIDE_WIDTHS, dtype_name
from fk.norms import LayerNorm, layer_norm, layer_norm_ref
from fk.norms.layer_norm import BACKWARD, BACKWARD_FROZEN, _bwd_tiling, _fwd_tiling, partial_rows
from fk.norms.norm_strips import launch_strips_backward, strip_grid

sys.path.insert(0, str(Path(__file__).parent))
from test_rms_norm import strips_from

LAYER_NORM_MODULE = importlib.import_module("fk.norms.layer_norm")  # (fk.norms.layer_norm is the function)

EPS = 1e-5
NAMES = ["x", "weight", "bias"]


def _fk(eps: float = EPS) -> Callable[..., torch.Tensor]:
    return lambda x, w=None, b=None: layer_norm(x, w, b, eps)


def _ref(eps: float = EPS) -> Callable[..., torch.Tensor]:
    return lambda x, w=None, b=None: layer_norm_ref(x, w, b, eps)


# With one column, x - mean is zero, and with two, xhat = (+1, -1): either way dx = r * (g - mean(g)
# - xhat * mean(g * xhat)) is zero in exact arithmetic, and what PyTorch computes there is cancellation between terms of size r * |g| (r is
# 1/sqrt(eps) ~ 316). Its error is judged against that, not against dx.
WIDTH_ONE_ATOLS = {torch.float32: 1e-3, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _atols(width: int) -> dict[torch.dtype, float] | None:
    return WIDTH_ONE_ATOLS if width <= 2 else None


def _inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    seed: int,
    weight_grad: bool = True,
    bias_grad: bool = True,
) -> list[Any]:
    # A mean away from zero, so that a kernel that forgets to centre the row is caught.
    x = testing.random_tensor(shape, dtype, device, seed=seed, scale=2.0, offset=0.5, requires_grad=True)
    w = testing.random_tensor(
        shape[-1:], dtype, device, seed=seed + 1, offset=1.0, scale=0.5, requires_grad=weight_grad
    )
    b = testing.random_tensor(shape[-1:], dtype, device, seed=seed + 2, scale=0.5, requires_grad=bias_grad)
    return [x, w, b]


@pytest.mark.parametrize("width", AWKWARD_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, width: int) -> None:
    args = _inputs((7, width), dtype, device, seed=width)
    result = testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES, atols=_atols(width))
    assert result.names == ["output0", "grad of x", "grad of weight", "grad of bias"]


@pytest.mark.parametrize("width", WIDE_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_rows_match_reference(device: str, dtype: torch.dtype, width: int) -> None:
    args = _inputs((3, width), dtype, device, seed=width)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("width", [1000, 40000])  # one tile, and the forward's three passes
def test_large_mean_small_spread(device: str, width: int) -> None:
    # |mean| >> std: a variance taken as E[x^2] - E[x]^2 in fp32 would lose most of its digits.
    x = testing.random_tensor((4, width), torch.float32, device, seed=21, scale=0.01, offset=300.0)
    x.requires_grad_(True)
    testing.compare_with_reference(_fk(), _ref(), [x])


# One tile; then the three passes over one column tile, over several with the last one partial, and
# over tiles of 4096 (WIDE_FORWARD.fp32_params).
@pytest.mark.parametrize("width", [1000, 2048, 5000, 20000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_fp32_parameters_with_16_bit_input(device: str, dtype: torch.dtype, width: int) -> None:
    # Mixed precision: 16-bit activations, fp32 weight and bias (master weights).
    x = _inputs((3, width), dtype, device, seed=width)[0]
    _, w, b = _inputs((3, width), torch.float32, device, seed=width + 1)
    testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES)


def test_forward_takes_three_passes_where_its_table_says() -> None:
    # (x's element size, the parameters'): the widest one-tile row, then the three passes.
    for sizes, widest in (((2, 2), 16384), ((2, 4), 1024), ((4, 4), 512), ((4, 2), 512)):
        assert not _fwd_tiling(widest, *sizes).looped, sizes
        tiling = _fwd_tiling(widest + 1, *sizes)
        assert tiling.looped and tiling.rows_per_tile == 1, sizes
    assert _fwd_tiling(5000, 2, 4).block_cols == 1024 and _fwd_tiling(40000, 2, 4).block_cols == 4096


def test_wide_forward_loads_and_stores_vectors() -> None:
    # Compiled for sm_90 on the CPU: the three passes read x, the weight and the bias as 16-byte
    # vectors (with cache hints) and write y so; only the row's mean and rstd are single words.
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "mean_ptr": "*fp32",
                 "rstd_ptr": "*fp32", "x_row_stride": "i32", "eps": "fp32", "N_COLS": "", "HAS_WEIGHT": "",
                 "HAS_BIAS": "", "BLOCK_COLS": ""}  # fmt: skip
    constexprs = {"N_COLS": 40000, "HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK_COLS": 8192}
    compiled = testing.compile_kernel("fk.norms.layer_norm", "_layer_norm_fwd_wide_kernel", signature, constexprs,
                                      num_warps=32)  # fmt: skip
    counts = compiled.memory_instructions
    loads = [op for op in counts if op.startswith("ld.global")]
    assert loads and all(op.endswith(".v4.b32") for op in loads), counts
    assert counts.get("st.global.b32") == 2 and counts.get("st.global.v4.b32", 0) > 0, counts
    assert compiled.spill_bytes == 0, compiled


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_one_tile_rows_match_reference(device: str, dtype: torch.dtype) -> None:
    # Rows of one 16384-column tile, more than the backward's programs (no prefetch at that width).
    args = _inputs((9, 9000), dtype, device, seed=9000)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("bias_grad", [True, False], ids=["trainable", "bias-frozen"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_widest_rows_several_at_a_time(
    device: str, dtype: torch.dtype, bias_grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows of at least BACKWARD.widest_min_cols with a weight gradient: the looped backward (not the
    # two-pass one) takes several rows a tile (widest_rows), every program two tiles or more, the
    # last one partial.
    width = BACKWARD.widest_min_cols + 1
    monkeypatch.setattr(LAYER_NORM_MODULE, "BACKWARD", BACKWARD._replace(strips_min_cols=width + 1))
    tiling = _bwd_tiling(width)
    assert tiling.looped and tiling.rows_per_tile > 1 and width % tiling.block_cols != 0
    rows = (2 * partial_rows(1 << 30, width, torch.device(device)) + 1) * tiling.rows_per_tile - 1
    args = _inputs((rows, width), dtype, device, seed=17, bias_grad=bias_grad)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_narrow_rows_several_tiles_a_program(device: str, dtype: torch.dtype) -> None:
    # Weight and bias frozen, rows up to BACKWARD_FROZEN.narrow_cols: the backward's programs walk
    # the tiles last first; here every program takes two tiles or more, the first of them partial.
    width = BACKWARD_FROZEN.narrow_cols - 24
    tiling = _bwd_tiling(width, False, False)
    assert not tiling.looped and tiling.rows_per_tile > 1
    rows = (2 * partial_rows(1 << 30, width, torch.device(device), False, False) + 1) * tiling.rows_per_tile - 1
    args = _inputs((rows, width), dtype, device, seed=23, weight_grad=False, bias_grad=False)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


def _count_strips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each launch of the two-pass backward (fk.norms.norm_strips)."""
    calls: list[int] = []
    original = LAYER_NORM_MODULE.launch_strips_backward
    monkeypatch.setattr(
        LAYER_NORM_MODULE, "launch_strips_backward", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    return calls


@pytest.mark.parametrize(
    ("x_grad", "bias_grad", "with_bias"),
    [(True, True, True), (True, False, True), (True, False, False), (False, True, True)],
    ids=["trainable", "bias_frozen", "no_bias", "input_frozen"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_strips_backward_matches_reference(
    device: str, dtype: torch.dtype, x_grad: bool, bias_grad: bool, with_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The two-pass backward with a weight gradient: 1100 columns are 5 strips of 256 (the last
    # partial) and 3 column tiles of pass 1 (the last partial); rows in partial tiles of both
    # passes. dx, dw and db (summed in pass 2), or dw without db, or dw and db without dx (no pass 1).
    rows = strips_from(monkeypatch, 1100, device, module=LAYER_NORM_MODULE)
    calls = _count_strips(monkeypatch)
    x, w, b = _inputs((rows, 1100), dtype, device, seed=1100, bias_grad=bias_grad)
    x.requires_grad_(x_grad)
    args, names = ([x, w, b], NAMES) if with_bias else ([x, w], NAMES[:2])
    result = testing.compare_with_reference(_fk(), _ref(), args, arg_names=names)
    db = with_bias and bias_grad
    assert result.names == ["output0"] + ["grad of x"] * x_grad + ["grad of weight"] + ["grad of bias"] * db
    assert calls  # the path under test ran


@pytest.mark.parametrize("weight", ["frozen", "none"])
def test_strips_backward_only_with_a_weight_gradient(device: str, weight: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A frozen weight, or none: at the strips' widths the one-kernel backward runs (the frozen path).
    rows = strips_from(monkeypatch, 1100, device, module=LAYER_NORM_MODULE)
    calls = _count_strips(monkeypatch)
    x, w, b = _inputs((rows, 1100), torch.bfloat16, device, seed=1101, weight_grad=False)
    if weight == "frozen":
        testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES)
    else:
        fk_fn = lambda x, b: layer_norm(x, None, b, EPS)  # noqa: E731
        ref_fn = lambda x, b: layer_norm_ref(x, None, b, EPS)  # noqa: E731
        testing.compare_with_reference(fk_fn, ref_fn, [x, b], arg_names=["x", "bias"])
    assert not calls


def test_strips_backward_large_mean_small_spread(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # |mean| >> std through the whole op, as test_large_mean_small_spread for the one-kernel backward.
    rows = strips_from(monkeypatch, 1100, device, module=LAYER_NORM_MODULE)
    _, w, b = _inputs((rows, 1100), torch.float32, device, seed=1102)
    x = testing.random_tensor((rows, 1100), torch.float32, device, seed=1103, scale=0.01, offset=300.0)
    x.requires_grad_(True)
    testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES)


def test_strips_backward_centres_each_element(device: str) -> None:
    # |mean| >> std, with the mean and rstd given (fp32, taken as exact by the float64 formula): the
    # passes form xhat from x - mean element by element (x - mean is exact here), so dx, dw and db
    # keep fp32's precision. r (sum g x - mean sum g) in pass 1 would cancel: 600x the error in dx.
    x = testing.random_tensor((19, 1100), torch.float32, device, seed=1105, scale=0.01, offset=300.0)
    dy, w, b = _inputs((19, 1100), torch.float32, device, seed=1106)
    w, b = w.detach(), b.detach()
    x64 = x.double()
    mean = x64.mean(1).float()
    rstd = ((x64 - x64.mean(1, keepdim=True)).pow(2).mean(1) + EPS).rsqrt().float()
    dx = torch.empty_like(x)
    params = LAYER_NORM_MODULE.STRIPS._replace(block_cols=256, block_rows=4, dot_block_cols=512, dot_rows=2)
    dw, db = launch_strips_backward(dy.detach(), x, w, rstd, 0.0, dx, None, params, mean=mean, bias=b)
    xhat = (x64 - mean.double()[:, None]) * rstd.double()[:, None]
    g = dy.double() * w.double()
    r = rstd.double()[:, None]
    want_dx = r * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    for name, got, want in (
        ("dx", dx, want_dx),
        ("dw", dw, (dy.double() * xhat).sum(0)),
        ("db", db, dy.double().sum(0)),
    ):
        assert got is not None
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < testing.FLOOR[torch.float32], f"{name}: error {error:.2e} of the largest value"


def test_strips_backward_strided_rows_and_expanded_gradient(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # x rows sliced from a wider buffer, and the gradient of loss.sum() (every stride 0).
    rows = strips_from(monkeypatch, 1100, device, module=LAYER_NORM_MODULE)
    calls = _count_strips(monkeypatch)
    x, w, b = _inputs((rows, 1100), torch.float32, device, seed=1104)
    x = testing.with_layout(x, "row_strided")
    testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES)
    assert calls
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    calls.clear()
    layer_norm(*leaves).sum().backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    layer_norm_ref(*ref_leaves, EPS).sum().backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)
    assert calls == [1]


@pytest.mark.parametrize(("weight_grad", "bias_grad"), [(True, True), (False, True)], ids=["trainable", "bias-only"])
@pytest.mark.parametrize("width", [100, 1500])  # 64 rows a tile (dw and db summed in 2-D), and 4
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_every_program_takes_several_tiles(
    device: str, dtype: torch.dtype, width: int, weight_grad: bool, bias_grad: bool
) -> None:
    # Every program of the backward's persistent grid gets three row tiles or more, the last one
    # partial: its loop computes tiles it prefetched, and prefetches one past the end. With the
    # weight frozen (and x needing no gradient) the loop prefetches dy alone.
    rows = (3 * partial_rows(1 << 30, width, torch.device(device)) + 1) * _bwd_tiling(width).rows_per_tile - 1
    args = _inputs((rows, width), dtype, device, seed=width, weight_grad=weight_grad, bias_grad=bias_grad)
    if not weight_grad:
        args[0].requires_grad_(False)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("rows", AWKWARD_ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_row_counts_and_leading_dims(device: str, dtype: torch.dtype, rows: int) -> None:
    args = _inputs((rows, 2, 96), dtype, device, seed=rows)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_non_contiguous_input(device: str, dtype: torch.dtype, layout: str) -> None:
    x, w, b = _inputs((33, 300), dtype, device, seed=5)
    x = testing.with_layout(x, layout)
    testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES)


def test_non_contiguous_wide_rows(device: str) -> None:
    x, w, b = _inputs((3, 16385), torch.float32, device, seed=6)
    x = testing.with_layout(x, "row_strided")
    testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES)


FROZEN = [(False, True), (True, False), (False, False)]


@pytest.mark.parametrize(("weight_grad", "bias_grad"), FROZEN, ids=["frozen_w", "frozen_b", "frozen_both"])
@pytest.mark.parametrize("width", [1000, 20000])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_params_match_reference(
    device: str, dtype: torch.dtype, width: int, weight_grad: bool, bias_grad: bool
) -> None:
    args = _inputs((5, width), dtype, device, seed=11, weight_grad=weight_grad, bias_grad=bias_grad)
    result = testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)
    expected = ["output0", "grad of x"] + ["grad of weight"] * weight_grad + ["grad of bias"] * bias_grad
    assert result.names == expected
    # And the frozen ones come back as None from autograd itself.
    x, w, b = (t.detach().requires_grad_(t.requires_grad) for t in args)
    layer_norm(x, w, b).sum().backward()
    assert (w.grad is not None, b.grad is not None) == (weight_grad, bias_grad)


@pytest.mark.parametrize("width", [200, 20000])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_input_trainable_params(device: str, dtype: torch.dtype, width: int) -> None:
    x, w, b = _inputs((9, width), dtype, device, seed=4)
    x.requires_grad_(False)
    result = testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES)
    assert result.names == ["output0", "grad of weight", "grad of bias"]


@pytest.mark.parametrize("width", [100, 20000])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_no_affine(device: str, dtype: torch.dtype, width: int) -> None:
    x = testing.random_tensor((5, width), dtype, device, seed=3, offset=1.0, requires_grad=True)
    testing.compare_with_reference(_fk(), _ref(), [x])


@pytest.mark.parametrize("width", [100, 20000])
@pytest.mark.parametrize("which", ["weight_only", "bias_only"])
def test_weight_or_bias_alone(device: str, which: str, width: int) -> None:
    x, w, b = _inputs((5, width), torch.float32, device, seed=7)
    if which == "weight_only":
        testing.compare_with_reference(lambda x, w: layer_norm(x, w, None, EPS), _ref(), [x, w], arg_names=NAMES[:2])
    else:
        fk_fn = lambda x, b: layer_norm(x, None, b, EPS)  # noqa: E731
        ref_fn = lambda x, b: layer_norm_ref(x, None, b, EPS)  # noqa: E731
        testing.compare_with_reference(fk_fn, ref_fn, [x, b], arg_names=["x", "bias"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_matches_torch_layer_norm(device: str, dtype: torch.dtype) -> None:
    x, w, b = _inputs((17, 513), dtype, device, seed=9)
    dy = testing.random_tensor((17, 513), dtype, device, seed=99)
    expected = torch.nn.functional.layer_norm(x, (513,), w, b, EPS)
    expected_grads = torch.autograd.grad(expected, (x, w, b), dy)
    got = layer_norm(x, w, b, EPS)
    got_grads = torch.autograd.grad(got, (x, w, b), dy)
    # Two roundings to bf16 (PyTorch's and fk's) may differ by a unit in the last place of the
    # largest value: column sums (dw, db) are judged against their largest element.
    ulps = 1e-5 if dtype == torch.float32 else 2 * 2**-8
    for name, g, e in zip(["output", *NAMES], [got, *got_grads], [expected, *expected_grads], strict=True):
        atol = ulps * float(e.detach().abs().max())
        torch.testing.assert_close(g, e, rtol=ulps, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def test_zero_rows(device: str) -> None:
    x = torch.empty(0, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    b = torch.zeros(64, device=device, requires_grad=True)
    y = layer_norm(x, w, b)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 64)
    assert w.grad is not None and torch.equal(w.grad, torch.zeros(64, device=device))
    assert b.grad is not None and torch.equal(b.grad, torch.zeros(64, device=device))


@pytest.mark.parametrize("width", [3000, 20000])
def test_every_output_element_is_written(device: str, width: int) -> None:
    # Poison the allocator's memory: outputs must not keep NaNs from earlier tensors.
    for _ in range(3):
        torch.full((7, width), float("nan"), device=device)
    x, w, b = _inputs((7, width), torch.bfloat16, device, seed=12)
    y = layer_norm(x, w, b)
    y.backward(torch.ones_like(y))
    assert torch.isfinite(y).all() and x.grad is not None and torch.isfinite(x.grad).all()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    assert b.grad is not None and torch.isfinite(b.grad).all()


def test_upstream_gradient_with_zero_strides(device: str) -> None:
    # loss.sum() sends back an expanded gradient (every stride 0).
    x, w, b = _inputs((5, 130), torch.float32, device, seed=13)
    layer_norm(x, w, b).sum().backward()
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    layer_norm_ref(xr, wr, br, EPS).sum().backward()
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def _profiled_rows(device: str, width: int) -> int:
    """Enough rows that the grid is capped by the device, not by the rows (fewer in the interpreter)."""
    return {("cuda", 1000): 8192, ("cuda", 20000): 600, ("cpu", 1000): 72, ("cpu", 20000): 40}[(device, width)]


def partial_buffer_bytes(rows: int, width: int, device: str) -> int:
    """Bytes of one gradient's fp32 partial rows (dw's or db's) in LayerNorm's backward with a weight
    gradient at this shape: one row per program of the one-kernel grid, or per row group of the
    strips (fk.norms.norm_strips)."""
    if width >= BACKWARD.strips_min_cols:
        return strip_grid(rows, width, torch.device(device), LAYER_NORM_MODULE.STRIPS)[0] * width * 4
    return partial_rows(rows, width, torch.device(device)) * width * 4


def partial_buffers(width: int, weight_grad: bool, bias_grad: bool) -> int:
    """How many gradients' partial rows the backward keeps (in one fp32 buffer): the strips sum dw
    and db in pass 2; the one-kernel backward leaves looped rows' db to a column sum of dy."""
    if weight_grad and width >= BACKWARD.strips_min_cols:
        return 1 + bias_grad
    return weight_grad + (bias_grad and not _bwd_tiling(width).looped)


@pytest.mark.parametrize(("weight_grad", "bias_grad"), [(True, True), *FROZEN])
@pytest.mark.parametrize("width", [1000, 20000])
def test_frozen_params_allocate_no_partial_buffer(device: str, width: int, weight_grad: bool, bias_grad: bool) -> None:
    rows = _profiled_rows(device, width)
    partial_bytes = partial_buffer_bytes(rows, width, device)
    dx_bytes = rows * width * 2
    assert testing.count_buffers([dx_bytes], partial_bytes, device) == 0  # the sizes are told apart
    assert testing.count_buffers([dx_bytes], 2 * partial_bytes, device) == 0
    x, w, b = _inputs((rows, width), torch.bfloat16, device, seed=14, weight_grad=weight_grad, bias_grad=bias_grad)
    y = layer_norm(x, w, b)
    dy = torch.randn_like(y)
    sizes = testing.allocation_sizes(lambda: y.backward(dy))
    assert testing.count_buffers(sizes, dx_bytes, device) == 1, sizes  # the profiler sees the backward's buffers
    # Partial rows for each trainable parameter, none for a frozen one (wide rows without the strips:
    # db is a column sum of dy, no partial rows), in one fp32 buffer.
    n_partials = partial_buffers(width, weight_grad, bias_grad)
    assert testing.count_buffers([2 * partial_bytes], partial_bytes, device) == 0  # the sizes are told apart
    assert testing.count_buffers(sizes, max(n_partials, 1) * partial_bytes, device) == (n_partials > 0), sizes
    if n_partials == 2:
        assert testing.count_buffers(sizes, partial_bytes, device) == 0, sizes
    if not (weight_grad or bias_grad):
        assert max(sizes) < dx_bytes + testing.CUDA_UNSPLIT_SLACK, sizes  # nothing but dx is that large
    assert (w.grad is not None, b.grad is not None) == (weight_grad, bias_grad)


@pytest.mark.parametrize("width", [1000, 20000])
def test_frozen_input_allocates_no_dx(device: str, width: int) -> None:
    rows = _profiled_rows(device, width)
    x, w, b = _inputs((rows, width), torch.bfloat16, device, seed=15)
    x.requires_grad_(False)
    y = layer_norm(x, w, b)
    dy = torch.randn_like(y)
    sizes = testing.allocation_sizes(lambda: y.backward(dy))
    partial_bytes = partial_buffer_bytes(rows, width, device)
    n_partials = partial_buffers(width, weight_grad=True, bias_grad=True)
    assert testing.count_buffers([rows * width * 2], n_partials * partial_bytes, device) == 0  # told apart
    assert testing.count_buffers(sizes, n_partials * partial_bytes, device) == 1, sizes  # the profiler sees it
    assert testing.count_buffers(sizes, rows * width * 2, device) == 0, sizes  # but no dx-sized buffer
    assert x.grad is None and w.grad is not None and b.grad is not None


def test_module_matches_torch_module(device: str) -> None:
    torch_norm = torch.nn.LayerNorm(96, eps=1e-6, device=device)
    with torch.no_grad():
        torch_norm.weight.normal_()
        torch_norm.bias.normal_()
    fk_norm = LayerNorm(96, eps=1e-6, device=device)
    assert isinstance(fk_norm, torch.nn.LayerNorm)
    assert fk_norm.state_dict().keys() == torch_norm.state_dict().keys()
    fk_norm.load_state_dict(torch_norm.state_dict())
    x = testing.random_tensor((3, 5, 96), torch.float32, device, seed=15, requires_grad=True)
    y_fk, y_torch = fk_norm(x), torch_norm(x)
    torch.testing.assert_close(y_fk, y_torch, rtol=1e-5, atol=1e-5)
    dy = testing.random_tensor((3, 5, 96), torch.float32, device, seed=16)
    got = torch.autograd.grad(y_fk, (x, fk_norm.weight, fk_norm.bias), dy)
    want = torch.autograd.grad(y_torch, (x, torch_norm.weight, torch_norm.bias), dy)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("affine", "bias"),
    [(True, True), (True, False), (False, True), (False, False)],
    ids=["weight_bias", "weight", "none", "none_no_bias"],
)
def test_module_options(device: str, affine: bool, bias: bool) -> None:
    kwargs = {"elementwise_affine": affine, "bias": bias, "device": device, "dtype": torch.bfloat16}
    torch_norm = torch.nn.LayerNorm((4, 24), **kwargs)
    fk_norm = LayerNorm((4, 24), **kwargs)
    assert fk_norm.state_dict().keys() == torch_norm.state_dict().keys()
    assert (fk_norm.weight is None, fk_norm.bias is None) == (torch_norm.weight is None, torch_norm.bias is None)
    if affine:
        with torch.no_grad():
            torch_norm.weight.normal_()
            if torch_norm.bias is not None:
                torch_norm.bias.normal_()
        fk_norm.load_state_dict(torch_norm.state_dict())
    x = testing.random_tensor((3, 4, 24), torch.bfloat16, device, seed=16)
    torch.testing.assert_close(fk_norm(x), torch_norm(x), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"x must end with the dimensions \(4, 24\)"):
        fk_norm(x[..., :10])


def test_module_multi_dim_gradients(device: str) -> None:
    fk_norm = LayerNorm((3, 8), device=device)
    with torch.no_grad():
        fk_norm.weight.normal_()
        fk_norm.bias.normal_()
    x = testing.random_tensor((5, 3, 8), torch.float32, device, seed=17, requires_grad=True)
    leaves = (x, fk_norm.weight, fk_norm.bias)
    dy = testing.random_tensor((5, 3, 8), torch.float32, device, seed=18)
    torch_y = torch.nn.functional.layer_norm(x, (3, 8), fk_norm.weight, fk_norm.bias, fk_norm.eps)
    want = torch.autograd.grad(torch_y, leaves, dy)
    got = torch.autograd.grad(fk_norm(x), leaves, dy)
    for g, e in zip(got, want, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_bad_inputs(device: str) -> None:
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    b = torch.randn(8, device=device)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        layer_norm([1.0], w, b)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"weight must be a torch\.Tensor, got tuple"):  # F.layer_norm's order
        layer_norm(x, (8,), w, b)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x must have dtype in"):
        layer_norm(x.to(torch.int32), w, b)
    with pytest.raises(TypeError, match="weight must have dtype in"):
        layer_norm(x, w.to(torch.int64), b)
    with pytest.raises(TypeError, match="bias must have dtype in"):
        layer_norm(x, w, b.to(torch.int64))
    with pytest.raises(TypeError, match=r"bias must be a torch\.Tensor"):
        layer_norm(x, w, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\), got \(7,\)"):
        layer_norm(x, w[:7], b)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\), got \(1, 8\)"):
        layer_norm(x, w, b[None])
    with pytest.raises(ValueError, match="weight must be on the device of x"):
        layer_norm(x, torch.randn(8, device="meta"), b)
    with pytest.raises(ValueError, match="bias must be on the device of x"):
        layer_norm(x, w, torch.randn(8, device="meta"))
    with pytest.raises(ValueError, match="eps must be > 0"):
        layer_norm(x, w, b, eps=0.0)
    with pytest.raises(TypeError, match="eps must be a float"):
        layer_norm(x, w, b, eps="1e-5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        layer_norm(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        layer_norm(torch.randn(4, 0, device=device))


def test_torch_compile_fullgraph(device: str) -> None:
    x, w, b = _inputs((6, 257), torch.float32, device, seed=19)

    def loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (layer_norm(x * 2.0, w, b, EPS) * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [x, w, b])


def test_torch_compile_fullgraph_frozen_weight(device: str) -> None:
    x, w, b = _inputs((6, 257), torch.bfloat16, device, seed=20, weight_grad=False)

    def loss(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (layer_norm(x * 2.0, w, b, EPS) * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [x, b])
    assert w.grad is None


S = testing.strategies()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=S.dtypes,
    layout=S.layouts,
    rows=S.rows(40),
    width=S.widths(3000),
    weight_grad=st.booleans(),
    bias_grad=st.booleans(),
)
def test_property_any_shape_dtype_layout(
    device: str, dtype: torch.dtype, layout: str, rows: int, width: int, weight_grad: bool, bias_grad: bool
) -> None:
    x, w, b = _inputs(
        (rows, width), dtype, device, seed=rows * 7919 + width, weight_grad=weight_grad, bias_grad=bias_grad
    )
    x = testing.with_layout(x, layout)
    testing.compare_with_reference(_fk(), _ref(), [x, w, b], arg_names=NAMES, atols=_atols(width))


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.norms import layer_norm, layer_norm_ref, LayerNorm; from fk.core import backend;"
        "x = torch.randn(3, 10, dtype=torch.bfloat16); w = torch.randn(10, dtype=torch.bfloat16);"
        "b = torch.randn(10, dtype=torch.bfloat16);"
        "assert backend.kernel_path(x) is backend.KernelPath.REFERENCE;"
        "assert torch.equal(layer_norm(x, w, b), layer_norm_ref(x, w, b));"
        "m = LayerNorm(10); torch.testing.assert_close(m(x.float()), torch.nn.LayerNorm(10)(x.float()));"
        "print('ok')"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1024, 4096, 8192, 32768, 65536])
@pytest.mark.parametrize(("weight_grad", "bias_grad"), [(True, True), (False, False)], ids=["trainable", "frozen"])
def test_gpu_training_shapes(width: int, weight_grad: bool, bias_grad: bool) -> None:
    args = _inputs(
        (4096 if width <= 8192 else 512, width), torch.bfloat16, "cuda", seed=width,
        weight_grad=weight_grad, bias_grad=bias_grad,
    )  # fmt: skip
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.gpu
def test_gpu_matches_torch_layer_norm_fp32() -> None:
    x, w, b = _inputs((2048, 4096), torch.float32, "cuda", seed=20)
    torch.testing.assert_close(
        layer_norm(x, w, b, EPS), torch.nn.functional.layer_norm(x, (4096,), w, b, EPS), rtol=1e-5, atol=1e-5
    )
