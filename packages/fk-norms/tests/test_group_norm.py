"""GroupNorm against its float64 reference: on the GPU where there is one, else in Triton's interpreter."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.norms import GroupNorm, group_norm, group_norm_ref

EPS = 1e-5
NAMES = ["x", "weight", "bias"]

# (shape, num_groups): group sizes (channels per group x spatial) from 1 to 65536, no spatial
# dimension, several spatial dimensions, odd sample counts.
SHAPES = [
    ((3, 2), 2),  # one element per group
    ((1, 6, 17), 3),
    ((5, 12), 4),
    ((7, 8, 3, 5), 2),
    ((2, 6, 100), 1),
    ((3, 4, 257), 4),
    ((2, 32, 33), 8),
    ((300, 48), 3),  # no spatial extent: the rows kernels, tiles of many samples
    ((1, 4096), 1),  # one sample, one wide group (rows kernels)
    ((2, 20000), 2),  # groups of 10000 channels: too wide for the rows kernels, the general ones
]
WIDE_SHAPES = [((2, 4, 8193), 2), ((1, 2, 65536), 2)]  # groups of 16386 and 65536 elements


def _fk(num_groups: int) -> Callable[..., torch.Tensor]:
    return lambda x, w=None, b=None: group_norm(x, num_groups, w, b, EPS)


def _ref(num_groups: int) -> Callable[..., torch.Tensor]:
    return lambda x, w=None, b=None: group_norm_ref(x, num_groups, w, b, EPS)


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, weight_grad: bool = True, bias_grad: bool = True
) -> list[Any]:
    # A mean away from zero, so that a kernel that forgets to centre the group is caught.
    x = testing.random_tensor(shape, dtype, device, seed=seed, scale=2.0, offset=0.5, requires_grad=True)
    w = testing.random_tensor(
        shape[1:2], dtype, device, seed=seed + 1, offset=1.0, scale=0.5, requires_grad=weight_grad
    )
    b = testing.random_tensor(shape[1:2], dtype, device, seed=seed + 2, scale=0.5, requires_grad=bias_grad)
    return [x, w, b]


def _atols(shape: tuple[int, ...], num_groups: int) -> dict[torch.dtype, float] | None:
    # Groups of one element: x - mean is zero and dx is pure cancellation of terms ~ |dy| / sqrt(eps).
    group = (shape[1] // num_groups) * int(torch.tensor(shape[2:]).prod()) if len(shape) > 2 else shape[1] // num_groups
    return {torch.float32: 1e-3, torch.float16: 1e-3, torch.bfloat16: 1e-2} if group == 1 else None


@pytest.mark.parametrize(("shape", "num_groups"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...], num_groups: int) -> None:
    args = _inputs(shape, dtype, device, seed=sum(shape))
    result = testing.compare_with_reference(
        _fk(num_groups), _ref(num_groups), args, arg_names=NAMES, atols=_atols(shape, num_groups)
    )
    assert result.names == ["output0", "grad of x", "grad of weight", "grad of bias"]


@pytest.mark.parametrize(("shape", "num_groups"), WIDE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_groups_match_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...], num_groups: int) -> None:
    args = _inputs(shape, dtype, device, seed=7)
    testing.compare_with_reference(_fk(num_groups), _ref(num_groups), args, arg_names=NAMES)


def test_matches_torch_group_norm(device: str) -> None:
    x, w, b = _inputs((5, 12, 9), torch.float32, device, seed=3)
    dy = testing.random_tensor((5, 12, 9), torch.float32, device, seed=4)
    want = torch.nn.functional.group_norm(x, 3, w, b, EPS)
    got = group_norm(x, 3, w, b, EPS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, e in zip(torch.autograd.grad(got, (x, w, b), dy), torch.autograd.grad(want, (x, w, b), dy), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_large_mean_small_spread(device: str) -> None:
    x = testing.random_tensor((2, 4, 3000), torch.float32, device, seed=5, scale=0.01, offset=300.0)
    x.requires_grad_(True)
    testing.compare_with_reference(_fk(2), _ref(2), [x])


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_non_contiguous_input(device: str, dtype: torch.dtype, layout: str) -> None:
    x, w, b = _inputs((3, 6, 40), dtype, device, seed=6)
    x = testing.with_layout(x, layout)
    testing.compare_with_reference(_fk(3), _ref(3), [x, w, b], arg_names=NAMES)


FROZEN = [(False, True), (True, False), (False, False)]


@pytest.mark.parametrize(("weight_grad", "bias_grad"), FROZEN, ids=["frozen_w", "frozen_b", "frozen_both"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_params_match_reference(device: str, dtype: torch.dtype, weight_grad: bool, bias_grad: bool) -> None:
    args = _inputs((3, 8, 50), dtype, device, seed=11, weight_grad=weight_grad, bias_grad=bias_grad)
    result = testing.compare_with_reference(_fk(4), _ref(4), args, arg_names=NAMES)
    assert result.names == ["output0", "grad of x"] + ["grad of weight"] * weight_grad + ["grad of bias"] * bias_grad
    x, w, b = (t.detach().requires_grad_(t.requires_grad) for t in args)
    group_norm(x, 4, w, b).sum().backward()
    assert (w.grad is not None, b.grad is not None) == (weight_grad, bias_grad)


def test_frozen_input_and_no_affine(device: str) -> None:
    x, w, b = _inputs((3, 8, 50), torch.float32, device, seed=12)
    x.requires_grad_(False)
    result = testing.compare_with_reference(_fk(2), _ref(2), [x, w, b], arg_names=NAMES)
    assert result.names == ["output0", "grad of weight", "grad of bias"]
    x.requires_grad_(True)
    testing.compare_with_reference(_fk(2), _ref(2), [x])


@pytest.mark.parametrize(("weight_grad", "bias_grad"), [(True, True), *FROZEN])
def test_frozen_params_allocate_no_partial_buffer(device: str, weight_grad: bool, bias_grad: bool) -> None:
    n, c, s = (6, 16, 50) if device == "cpu" else (64, 320, 1024)
    partial_bytes = n * c * 4
    dx_bytes = n * c * s * 2
    x, w, b = _inputs((n, c, s), torch.bfloat16, device, seed=14, weight_grad=weight_grad, bias_grad=bias_grad)
    y = group_norm(x, 8, w, b)
    dy = torch.randn_like(y)
    sizes = testing.allocation_sizes(lambda: y.backward(dy))
    assert testing.count_buffers(sizes, dx_bytes, device) == 1, sizes  # the profiler sees the backward's buffers
    assert testing.count_buffers(sizes, partial_bytes, device) == weight_grad + bias_grad, sizes
    assert (w.grad is not None, b.grad is not None) == (weight_grad, bias_grad)


def test_bounded_partial_buffers(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many samples: the backward runs in launches of a few samples each, its partial-sum buffers
    hold that many rows (not one per sample), and the gradients are unchanged."""
    n, c, s = 7, 160, 30  # 2 and 7 rows of partial sums round to different CUDA granules
    module = importlib.import_module("fk.norms.group_norm")
    monkeypatch.setattr(module, "PARTIAL_BYTES", 2 * c * 4)  # two samples per launch: 4 launches
    assert module.samples_per_launch(c) == 2
    x, w, b = _inputs((n, c, s), torch.float32, device, seed=15)
    testing.compare_with_reference(_fk(4), _ref(4), [x, w, b])
    y = group_norm(x, 4, w, b)
    sizes = testing.allocation_sizes(lambda: y.backward(torch.ones_like(y)))
    assert testing.count_buffers(sizes, 2 * c * 4, device) == 2, sizes  # dw and db: 2 rows each
    assert testing.count_buffers(sizes, n * c * 4, device) == 0, sizes


@pytest.mark.parametrize(
    ("weight_grad", "bias_grad"), [(True, True), (True, False), (False, False)], ids=["trainable", "weight", "frozen"]
)
def test_rows_kernels_over_several_row_tiles(
    device: str, monkeypatch: pytest.MonkeyPatch, weight_grad: bool, bias_grad: bool
) -> None:
    """(N, C) input in tiles of 4 samples, 3 tiles a backward program (the last one partly past
    the end): the rows kernels. The backward's only [N, C] buffer is dx; its dw and db partials
    have one row per program (in one buffer for both)."""
    n, c, groups = 103, 48, 3  # 16 channels a group
    module = importlib.import_module("fk.norms.group_norm")
    monkeypatch.setattr(module, "ROWS_TILE_ELEMENTS", 64)  # 4 samples a tile: 26 tiles
    monkeypatch.setattr(module, "ROWS_PARTIALS_TILE_ELEMENTS", 64)  # (the backward with dw, db)
    monkeypatch.setattr(module, "ROWS_PER_PROGRAM", 12)  # 3 tiles a program: 9 programs
    monkeypatch.setattr(module, "multiprocessor_count", lambda device: 4)  # the same split on any device
    assert module._rows_tile(c // groups)[1] == module._rows_tile(c // groups, partials=True)[1] == 4
    x, w, b = _inputs((n, c), torch.float32, device, seed=21, weight_grad=weight_grad, bias_grad=bias_grad)
    testing.compare_with_reference(_fk(groups), _ref(groups), [x, w, b], arg_names=NAMES)
    y = group_norm(x, groups, w, b)
    dy = torch.ones_like(y)
    sizes = testing.allocation_sizes(lambda: y.backward(dy))
    assert testing.count_buffers(sizes, n * c * 4, device) == 1, sizes  # dx
    n_partials = weight_grad + bias_grad  # the partial rows of both, in one buffer
    assert testing.count_buffers(sizes, max(n_partials, 1) * 9 * c * 4, device) == (n_partials > 0), sizes


def test_rows_backward_bounds_its_partial_rows(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows kernels' dw and db partial rows within ROWS_PARTIAL_BYTES: programs take more tiles
    (here 7 of 4 samples where ROWS_PER_PROGRAM says 3) so that there are 4 partial rows of each."""
    n, c, groups = 103, 48, 3
    module = importlib.import_module("fk.norms.group_norm")
    monkeypatch.setattr(module, "ROWS_TILE_ELEMENTS", 64)
    monkeypatch.setattr(module, "ROWS_PARTIALS_TILE_ELEMENTS", 64)  # 4 samples a tile: 26 tiles
    monkeypatch.setattr(module, "ROWS_PER_PROGRAM", 12)
    monkeypatch.setattr(module, "multiprocessor_count", lambda device: 4)
    monkeypatch.setattr(module, "ROWS_PARTIAL_BYTES", 2 * 4 * c * 4)
    x, w, b = _inputs((n, c), torch.float32, device, seed=22)
    testing.compare_with_reference(_fk(groups), _ref(groups), [x, w, b], arg_names=NAMES)
    y = group_norm(x, groups, w, b)
    sizes = testing.allocation_sizes(lambda: y.backward(torch.ones_like(y)))
    assert testing.count_buffers(sizes, 2 * 4 * c * 4, device) == 1, sizes  # dw's and db's 4 rows each
    assert testing.count_buffers(sizes, 2 * 9 * c * 4, device) == 0, sizes  # not 9 programs' worth


def test_rows_kernels_save_no_statistics(device: str) -> None:
    """(N, C) input: the forward keeps no (N, G) mean and rstd for the backward, which recomputes
    them as the forward does (here with a mean far from zero, where a careless formula loses digits)."""
    n, c, groups = 256, 96, 4
    x = testing.random_tensor((n, c), torch.float32, device, seed=6, scale=0.01, offset=300.0, requires_grad=True)
    w = testing.random_tensor((c,), torch.float32, device, seed=7, offset=1.0, requires_grad=True)
    b = testing.random_tensor((c,), torch.float32, device, seed=8, requires_grad=True)
    testing.compare_with_reference(_fk(groups), _ref(groups), [x, w, b], arg_names=NAMES)
    sizes = testing.allocation_sizes(lambda: group_norm(x, groups, w, b))
    assert testing.count_buffers([n * c * 4], n * groups * 4, device) == 0  # the sizes are told apart
    assert testing.count_buffers(sizes, n * c * 4, device) == 1, sizes  # y: the profiler sees the forward
    assert testing.count_buffers(sizes, n * groups * 4, device) == 0, sizes  # no mean, no rstd


def test_zero_samples(device: str) -> None:
    x = torch.empty(0, 4, 3, device=device, requires_grad=True)
    w = torch.ones(4, device=device, requires_grad=True)
    y = group_norm(x, 2, w)
    assert y.shape == (0, 4, 3)
    y.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.zeros(4, device=device))


@pytest.mark.parametrize("affine", [True, False])
def test_module_matches_torch_module(device: str, affine: bool) -> None:
    torch_norm = torch.nn.GroupNorm(4, 12, eps=1e-6, affine=affine, device=device)
    fk_norm = GroupNorm(4, 12, eps=1e-6, affine=affine, device=device)
    assert isinstance(fk_norm, torch.nn.GroupNorm)
    assert fk_norm.state_dict().keys() == torch_norm.state_dict().keys()
    if affine:
        with torch.no_grad():
            torch_norm.weight.normal_()
            torch_norm.bias.normal_()
        fk_norm.load_state_dict(torch_norm.state_dict())
    x = testing.random_tensor((3, 12, 5, 4), torch.float32, device, seed=15, requires_grad=True)
    y_fk, y_torch = fk_norm(x), torch_norm(x)
    torch.testing.assert_close(y_fk, y_torch, rtol=1e-5, atol=1e-5)
    leaves = [x, *fk_norm.parameters()]
    dy = testing.random_tensor(x.shape, torch.float32, device, seed=16)
    got = torch.autograd.grad(y_fk, leaves, dy)
    want = torch.autograd.grad(y_torch, [x, *torch_norm.parameters()], dy)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"x must have shape \(N, 12, \*\)"):
        fk_norm(x[:, :6])


def test_bad_inputs(device: str) -> None:
    x = torch.randn(4, 6, 5, device=device)
    w = torch.randn(6, device=device)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        group_norm([1.0], 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x must have dtype in"):
        group_norm(x.int(), 2)
    with pytest.raises(ValueError, match="x must have at least 2 dimension"):
        group_norm(x[0, 0], 2)
    with pytest.raises(ValueError, match="num_groups must be >= 1 and divide the 6 channels"):
        group_norm(x, 4)
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        group_norm(x, 0)
    with pytest.raises(TypeError, match="num_groups must be an int"):
        group_norm(x, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"weight must have shape \(6,\), got \(5,\)"):
        group_norm(x, 2, w[:5])
    with pytest.raises(TypeError, match="bias must have dtype in"):
        group_norm(x, 2, w, w.long())
    with pytest.raises(ValueError, match="bias must be on the device of x"):
        group_norm(x, 2, w, torch.randn(6, device="meta"))
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_norm(x, 2, w, eps=-1.0)
    with pytest.raises(ValueError, match="non-empty spatial dimensions"):
        group_norm(torch.randn(4, 6, 0, device=device), 2)


@pytest.mark.parametrize("weight_grad", [True, False], ids=["trainable", "frozen"])
def test_torch_compile_fullgraph(device: str, weight_grad: bool) -> None:
    x, w, b = _inputs((3, 6, 37), torch.float32, device, seed=19, weight_grad=weight_grad, bias_grad=weight_grad)

    def loss(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return (group_norm(x * 2.0, 3, w, b, EPS) * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [x, w, b] if weight_grad else [x])


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.norms import group_norm, group_norm_ref, GroupNorm;"
        "x = torch.randn(3, 6, 10); w = torch.randn(6); b = torch.randn(6);"
        "assert torch.equal(group_norm(x, 2, w, b), group_norm_ref(x, 2, w, b));"
        "torch.testing.assert_close(GroupNorm(3, 6)(x), torch.nn.GroupNorm(3, 6)(x)); print('ok')"
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "num_groups"), [((16, 512, 64, 64), 32), ((64, 4096, 1), 8), ((8, 256, 65536), 4), ((8192, 4096), 32)]
)
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_gpu_training_shapes(shape: tuple[int, ...], num_groups: int, frozen: bool) -> None:
    args = _inputs(shape, torch.bfloat16, "cuda", seed=1, weight_grad=not frozen, bias_grad=not frozen)
    testing.compare_with_reference(_fk(num_groups), _ref(num_groups), args, arg_names=NAMES)
