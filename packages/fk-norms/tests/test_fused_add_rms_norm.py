"""FusedAddRMSNorm against its float64 reference: on the GPU where there is one, else in Triton's interpreter."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fk.core import testing
from fk.core.testing import AWKWARD_ROWS, AWKWARD_WIDTHS, DTYPES, WIDE_WIDTHS, dtype_name
from fk.norms import FusedAddRMSNorm, fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm_ref
from fk.norms.rms_norm import BACKWARD, _bwd_tiling, dw_partial_rows

sys.path.insert(0, str(Path(__file__).parent))
from test_rms_norm import RMS_NORM_MODULE, strips_from

EPS = 1e-6
NAMES = ["x", "residual", "weight"]
# As for RMSNorm: with one column, rms_norm's dx is pure cancellation, judged against |dy|.
WIDTH_ONE_ATOLS = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-4}


def _fk(mode: str = "llama", **kwargs: Any) -> Callable[..., Any]:
    return lambda x, r, w=None: fused_add_rms_norm(x, r, w, EPS, casting_mode=mode, **kwargs)


def _ref(mode: str = "llama") -> Callable[..., Any]:
    return lambda x, r, w=None: fused_add_rms_norm_ref(x, r, w, EPS, mode)


def _inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    seed: int,
    weight_grad: bool = True,
    residual_grad: bool = True,
) -> list[Any]:
    x = testing.random_tensor(shape, dtype, device, seed=seed, scale=1.0, requires_grad=True)
    r = testing.random_tensor(shape, dtype, device, seed=seed + 1, scale=2.0, requires_grad=residual_grad)
    w = testing.random_tensor(
        shape[-1:], dtype, device, seed=seed + 2, offset=1.0, scale=0.5, requires_grad=weight_grad
    )
    return [x, r, w]


@pytest.mark.parametrize("width", AWKWARD_WIDTHS)
@pytest.mark.parametrize("mode", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, mode: str, width: int) -> None:
    args = _inputs((7, width), dtype, device, seed=width)
    atols = WIDTH_ONE_ATOLS if width == 1 else None
    result = testing.compare_with_reference(_fk(mode), _ref(mode), args, arg_names=NAMES, atols=atols)
    assert result.names == ["output0", "output1", "grad of x", "grad of residual", "grad of weight"]


@pytest.mark.parametrize(
    ("early_dres", "dw_first"),
    [(False, False), (True, False), (True, True)],
    ids=["dres_after_dx", "dres_with_x", "dres_with_x_dw_first"],
)
@pytest.mark.parametrize("width", [100, 1500])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_every_program_takes_several_tiles(
    device: str, dtype: torch.dtype, width: int, early_dres: bool, dw_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As RMSNorm's test of the same name, with the residual's gradient added to dx, loaded after dx
    # is computed or beside x and dy (BACKWARD.early_dres_min_cols), the tile's dw added after dx
    # or before it (BACKWARD.dw_first_*), in prefetched tiles of any number of rows.
    order = {"early_dres_min_cols": 1 if early_dres else 1 << 30, "dw_first_prefetched_min_rows": 1,
             "dw_first_min_cols_residual": 1 if dw_first else 1 << 30}  # fmt: skip
    monkeypatch.setattr(RMS_NORM_MODULE, "BACKWARD", BACKWARD._replace(**order))
    rows = (3 * dw_partial_rows(1 << 30, width, torch.device(device)) + 1) * _bwd_tiling(width).rows_per_tile - 1
    args = _inputs((rows, width), dtype, device, seed=width)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("width", WIDE_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_rows_match_reference(device: str, dtype: torch.dtype, width: int) -> None:
    args = _inputs((3, width), dtype, device, seed=width)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_one_tile_rows_match_reference(device: str, dtype: torch.dtype) -> None:
    # Rows of one 16384-column tile, more than the backward's programs (no prefetch at that width).
    args = _inputs((9, 9000), dtype, device, seed=9000)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


def test_widest_rows_several_at_a_time(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # As RMSNorm's test of that name: several rows a tile, the residual's gradient added to each.
    width = BACKWARD.widest_min_cols
    monkeypatch.setattr(RMS_NORM_MODULE, "BACKWARD", BACKWARD._replace(strips_min_cols_residual=width + 1))
    rows = (2 * dw_partial_rows(1 << 30, width, torch.device(device)) + 1) * _bwd_tiling(width).rows_per_tile - 1
    args = _inputs((rows, width), torch.bfloat16, device, seed=8)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_strips_backward_matches_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # As RMSNorm's test of that name (fk.norms.norm_strips), the residual's gradient added to dx;
    # RMSNorm's own threshold left where it is.
    rows = strips_from(monkeypatch, 1100, device, residual=True)
    assert RMS_NORM_MODULE.BACKWARD.strips_min_cols == BACKWARD.strips_min_cols
    args = _inputs((rows, 1100), dtype, device, seed=1101)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("rows", AWKWARD_ROWS)
def test_row_counts_and_leading_dims(device: str, rows: int) -> None:
    args = _inputs((rows, 2, 96), torch.bfloat16, device, seed=rows)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("width", [300, 16385])
def test_non_contiguous_inputs(device: str, layout: str, width: int) -> None:
    x, r, w = _inputs((5, width), torch.float32, device, seed=5)
    x = testing.with_layout(x, layout)
    r = testing.with_layout(r, "row_strided" if layout == "transposed" else "transposed")
    testing.compare_with_reference(_fk(), _ref(), [x, r, w], arg_names=NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_weight_and_no_weight(device: str, dtype: torch.dtype) -> None:
    args = _inputs((7, 1000), dtype, device, seed=11, weight_grad=False)
    result = testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)
    assert result.names == ["output0", "output1", "grad of x", "grad of residual"]
    testing.compare_with_reference(_fk(), _ref(), args[:2], arg_names=NAMES[:2])


def test_frozen_residual_and_offset(device: str) -> None:
    args = _inputs((6, 64), torch.float32, device, seed=8, residual_grad=False)
    fk_fn = lambda x, r, w: fused_add_rms_norm(x, r, w, EPS, offset=0.5)  # noqa: E731
    ref_fn = lambda x, r, w: fused_add_rms_norm_ref(x, r, w, EPS, "llama", 0.5)  # noqa: E731
    result = testing.compare_with_reference(fk_fn, ref_fn, args, arg_names=NAMES)
    assert result.names == ["output0", "output1", "grad of x", "grad of weight"]


@pytest.mark.parametrize("used", ["y_only", "s_only"])
def test_one_output_unused(device: str, used: str) -> None:
    x, r, w = _inputs((5, 200), torch.float32, device, seed=9)
    y, s = fused_add_rms_norm(x, r, w, EPS)
    out = y if used == "y_only" else s
    dy = testing.random_tensor(out.shape, torch.float32, device, seed=10)
    got = torch.autograd.grad(out, (x, r, w), dy, allow_unused=True)
    xr, rr, wr = (t.detach().double().requires_grad_() for t in (x, r, w))
    y_ref, s_ref = fused_add_rms_norm_ref(xr, rr, wr, EPS)
    want = torch.autograd.grad(y_ref if used == "y_only" else s_ref, (xr, rr, wr), dy.double(), allow_unused=True)
    for g, e in zip(got, want, strict=True):
        assert (g is None) == (e is None)
        if g is not None and e is not None:
            torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5)


def test_leaf_gradients_do_not_alias(device: str) -> None:
    # x and residual get the same gradient tensor from the backward; their .grad must not be one buffer.
    x, r, w = _inputs((4, 32), torch.float32, device, seed=12)
    y, s = fused_add_rms_norm(x, r, w, EPS)
    (y.sum() + s.sum()).backward()
    assert x.grad is not None and r.grad is not None
    torch.testing.assert_close(x.grad, r.grad)
    x.grad.add_(1.0)
    assert not torch.equal(x.grad, r.grad)


def test_frozen_weight_allocates_no_partial_buffer(device: str) -> None:
    rows, width = (63, 1000) if device == "cpu" else (2048, 3000)
    partial_bytes = dw_partial_rows(rows, width, torch.device(device)) * width * 4
    dx_bytes = rows * width * 2
    assert testing.count_buffers([dx_bytes], partial_bytes, device) == 0  # the sizes are told apart
    for weight_grad in (True, False):
        x, r, w = _inputs((rows, width), torch.bfloat16, device, seed=14, weight_grad=weight_grad)
        y, s = fused_add_rms_norm(x, r, w, EPS)
        dy, ds = torch.randn_like(y), torch.randn_like(s)
        sizes = testing.allocation_sizes(lambda: torch.autograd.backward((y, s), (dy, ds)))  # noqa: B023
        # One d_s buffer, shared by x and residual (autograd copies it for the second leaf).
        assert testing.count_buffers(sizes, dx_bytes, device) >= 1, sizes
        assert testing.count_buffers(sizes, partial_bytes, device) == weight_grad, sizes
        assert (w.grad is not None) == weight_grad


# --- in_place=True: s written over residual --------------------------------------------------------


@pytest.mark.parametrize("width", [100, 16385])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_in_place_no_grad(device: str, dtype: torch.dtype, width: int) -> None:
    x, r, w = (t.detach() for t in _inputs((5, width), dtype, device, seed=15))
    y_want, s_want = fused_add_rms_norm(x, r, w, EPS)
    ptr = r.data_ptr()
    y, s = fused_add_rms_norm(x, r, w, EPS, in_place=True)
    assert s is r and r.data_ptr() == ptr
    assert torch.equal(y, y_want) and torch.equal(r, s_want)


def test_in_place_with_grad_matches_out_of_place(device: str) -> None:
    x, r0, w = _inputs((7, 300), torch.float32, device, seed=16)
    r = r0 * 1.0  # not a leaf: the residual stream coming out of the previous layer
    y, s = fused_add_rms_norm(x, r, w, EPS, in_place=True)
    assert s is r
    dy, ds = testing.random_tensor((7, 300), torch.float32, device, seed=17), torch.ones(7, 300, device=device)
    got = torch.autograd.grad((y, s), (x, r0, w), (dy, ds))
    x2, r2, w2 = (t.detach().requires_grad_() for t in (x, r0, w))
    y2, s2 = fused_add_rms_norm(x2, r2 * 1.0, w2, EPS)
    torch.testing.assert_close(y, y2)
    want = torch.autograd.grad((y2, s2), (x2, r2, w2), (dy, ds))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_in_place_refusals(device: str) -> None:
    x, r, w = _inputs((4, 32), torch.float32, device, seed=18)
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        fused_add_rms_norm(x, r, w, in_place=True)
    with pytest.raises(ValueError, match="shares no memory with x"):
        fused_add_rms_norm(x.detach(), x.detach(), w, in_place=True)
    expanded = torch.randn(1, 32, device=device).expand(4, 32)
    with pytest.raises(ValueError, match="can be written in place"):
        fused_add_rms_norm(x.detach(), expanded, w, in_place=True)
    # An earlier op that saved the old residual: PyTorch's own in-place error, never a wrong gradient.
    r2 = r.detach().clone().requires_grad_() * 1.0
    kept = r2 * r2  # saves r2 for its backward
    fused_add_rms_norm(x, r2, w, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        kept.sum().backward()


def test_in_place_torch_compile_no_grad(device: str) -> None:
    x, r, w = (t.detach() for t in _inputs((6, 257), torch.float32, device, seed=19))
    y_want, s_want = fused_add_rms_norm(x, r, w, EPS)

    def step(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y, _ = fused_add_rms_norm(x, r, w, EPS, in_place=True)
        return y * 2.0

    torch._dynamo.reset()
    y = torch.compile(step, fullgraph=True)(x, r, w)
    torch.testing.assert_close(y, y_want * 2.0)
    torch.testing.assert_close(r, s_want)


@pytest.mark.parametrize("weight_grad", [True, False], ids=["trainable", "frozen"])
def test_torch_compile_fullgraph(device: str, weight_grad: bool) -> None:
    x, r, w = _inputs((6, 257), torch.bfloat16, device, seed=20, weight_grad=weight_grad)

    def loss(x: torch.Tensor, r: torch.Tensor, *maybe_w: torch.Tensor) -> torch.Tensor:
        y, s = fused_add_rms_norm(x * 2.0, r, w, EPS)
        return (y * 3.0).sum() + (s * s).sum()

    testing.assert_compile_matches_eager(loss, [x, r, w] if weight_grad else [x, r])
    assert (w.grad is None) != weight_grad


def test_module_matches_torch(device: str) -> None:
    torch_norm = torch.nn.RMSNorm(96, eps=1e-5, device=device)
    with torch.no_grad():
        torch_norm.weight.normal_()
    fk_norm = FusedAddRMSNorm(96, eps=1e-5, device=device)
    assert isinstance(fk_norm, torch.nn.RMSNorm)
    assert fk_norm.state_dict().keys() == torch_norm.state_dict().keys()
    fk_norm.load_state_dict(torch_norm.state_dict())
    x = testing.random_tensor((3, 5, 96), torch.float32, device, seed=21)
    r = testing.random_tensor((3, 5, 96), torch.float32, device, seed=22)
    y, s = fk_norm(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, torch_norm(x + r), rtol=1e-5, atol=1e-5)


def test_module_multi_dim_and_in_place(device: str) -> None:
    torch_norm = torch.nn.RMSNorm((4, 24), device=device)
    with torch.no_grad():
        torch_norm.weight.normal_()
    fk_norm = FusedAddRMSNorm((4, 24), device=device, in_place=True, casting_mode="llama")
    fk_norm.load_state_dict(torch_norm.state_dict())
    assert "in_place=True" in repr(fk_norm)
    x = testing.random_tensor((3, 4, 24), torch.float32, device, seed=23)
    r = testing.random_tensor((3, 4, 24), torch.float32, device, seed=24)
    want_s = x + r
    with torch.no_grad():
        y, s = fk_norm(x, r)
    assert s is r
    torch.testing.assert_close(r, want_s)
    torch.testing.assert_close(y, torch_norm(want_s), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"x must end with the dimensions \(4, 24\)"):
        fk_norm(x[..., :10], r[..., :10])


def test_bad_inputs(device: str) -> None:
    x = torch.randn(4, 8, device=device)
    r = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    with pytest.raises(TypeError, match=r"residual must be a torch\.Tensor"):
        fused_add_rms_norm(x, None, w)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="residual must have the dtype of x"):
        fused_add_rms_norm(x, r.half(), w)
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 8\), got \(1, 8\)"):
        fused_add_rms_norm(x, r[:1], w)
    with pytest.raises(ValueError, match="residual must be on the device of x"):
        fused_add_rms_norm(x, torch.randn(4, 8, device="meta"), w)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        fused_add_rms_norm(x, r, w[:3])
    with pytest.raises(TypeError, match="x must have dtype in"):
        fused_add_rms_norm(x.int(), r, w)
    with pytest.raises(ValueError, match="eps must be > 0"):
        fused_add_rms_norm(x, r, w, eps=0.0)
    with pytest.raises(ValueError, match="casting_mode must be one of"):
        fused_add_rms_norm(x, r, w, casting_mode="none")
    with pytest.raises(TypeError, match="in_place must be a bool"):
        fused_add_rms_norm(x, r, w, in_place="yes")  # type: ignore[arg-type]


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.norms import fused_add_rms_norm, fused_add_rms_norm_ref;"
        "x = torch.randn(3, 10, dtype=torch.bfloat16); r = torch.randn(3, 10, dtype=torch.bfloat16);"
        "w = torch.randn(10, dtype=torch.bfloat16);"
        "y, s = fused_add_rms_norm(x, r, w); yr, sr = fused_add_rms_norm_ref(x, r, w);"
        "assert torch.equal(y, yr) and torch.equal(s, sr);"
        "y2, s2 = fused_add_rms_norm(x, r, w, in_place=True); assert s2 is r and torch.equal(r, sr); print('ok')"
    )


def test_matches_rms_norm_of_the_sum(device: str) -> None:
    x, r, w = (t.detach() for t in _inputs((9, 513), torch.bfloat16, device, seed=25))
    y, s = fused_add_rms_norm(x, r, w, EPS)
    if device == "cuda":
        assert torch.equal(s, x + r)  # the same rounding (to nearest even) as PyTorch's addition
    else:
        # Triton's interpreter rounds fp32 -> bf16 toward zero: one unit in the last place apart.
        torch.testing.assert_close(s, x + r, rtol=2**-7, atol=0)
    torch.testing.assert_close(y, rms_norm_ref(s, w, EPS), rtol=2**-6, atol=1e-2)  # two roundings to bf16


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1024, 4096, 8192, 32768, 65536])
@pytest.mark.parametrize("weight_grad", [True, False], ids=["trainable", "frozen"])
def test_gpu_training_shapes(width: int, weight_grad: bool) -> None:
    args = _inputs((4096 if width <= 8192 else 512, width), torch.bfloat16, "cuda", seed=width, weight_grad=weight_grad)
    testing.compare_with_reference(_fk(), _ref(), args, arg_names=NAMES)
