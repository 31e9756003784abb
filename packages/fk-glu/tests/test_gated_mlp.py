"""fk.glu.gated_mlp (the gated MLP that recomputes act(gate) * up in its backward) against its float64
reference and the torch.nn.functional composition: on the GPU where there is one, else in Triton's
interpreter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fk.core import testing
from fk.core.backend import uses_kernel
from fk.core.testing import DTYPES, dtype_name
from fk.glu import (
    ACTIVATIONS,
    GatedMLP,
    gated_act_backward_ref,
    gated_act_backward_with_value,
    gated_act_ref,
    gated_mlp,
    gated_mlp_ref,
)

# Triton's interpreter evaluates exp(-k) of large |k| in numpy, which warns about the (intended) inf.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

NAMES = ["x", "gate_weight", "up_weight", "down_weight"]
_TORCH_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,
}


def _inputs(
    lead: tuple[int, ...], hidden: int, inter: int, out: int, dtype: torch.dtype, device: str, seed: int
) -> list[torch.Tensor]:
    # Weights scaled so that the gate covers the activation's curved part and both tails.
    x = testing.random_tensor((*lead, hidden), dtype, device, seed=seed, requires_grad=True)
    wg = testing.random_tensor((inter, hidden), dtype, device, seed=seed + 1, scale=2.0 / hidden**0.5)
    wu = testing.random_tensor((inter, hidden), dtype, device, seed=seed + 2, scale=1.0 / hidden**0.5)
    wd = testing.random_tensor((out, inter), dtype, device, seed=seed + 3, scale=1.0 / inter**0.5)
    return [x, wg.requires_grad_(), wu.requires_grad_(), wd.requires_grad_()]


def _fk(act: str) -> Callable[..., torch.Tensor]:
    return lambda x, wg, wu, wd: gated_mlp(x, wg, wu, wd, act)


def _ref(act: str) -> Callable[..., torch.Tensor]:
    return lambda x, wg, wu, wd: gated_mlp_ref(x, wg, wu, wd, act)


def _composition(act: str) -> Callable[..., torch.Tensor]:
    fn = _TORCH_ACT[act]
    return lambda x, wg, wu, wd: F.linear(fn(F.linear(x, wg)) * F.linear(x, wu), wd)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, act: str) -> None:
    args = _inputs((2, 5), 24, 40, 16, dtype, device, seed=1)
    result = testing.compare_with_reference(_fk(act), _ref(act), args, arg_names=NAMES)
    assert result.names == ["output0", *(f"grad of {n}" for n in NAMES)]


@pytest.mark.parametrize(
    ("lead", "hidden", "inter", "out"),
    [((1,), 7, 5, 3), ((33,), 17, 100, 9), ((3, 1, 2), 1, 13, 1)],
    ids=["one-row", "odd", "4d-width-1"],
)
def test_awkward_sizes(device: str, lead: tuple[int, ...], hidden: int, inter: int, out: int) -> None:
    args = _inputs(lead, hidden, inter, out, torch.float32, device, seed=hidden)
    testing.compare_with_reference(_fk("silu"), _ref("silu"), args, arg_names=NAMES)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_matches_torch_functional(device: str, act: str) -> None:
    args = _inputs((3, 4), 24, 40, 16, torch.float32, device, seed=2)
    testing.compare_with_reference(_fk(act), _composition(act), args, arg_names=NAMES)
    hf_name = {"silu": "swish", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[act]
    x, wg, wu, wd = (t.detach() for t in args)
    torch.testing.assert_close(gated_mlp(x, wg, wu, wd, hf_name), _composition(act)(x, wg, wu, wd))


def test_output_may_be_changed_in_place(device: str) -> None:
    """A caller may add into the output in place (Llama 4's MoE block adds its routed experts into
    the shared expert's output), and the gradients are still those of the out-of-place sum."""
    extra = testing.random_tensor((3, 4, 16), torch.float32, device, seed=7, requires_grad=True)
    args = [*_inputs((3, 4), 24, 40, 16, torch.float32, device, seed=3), extra]

    def added_in_place(*a: torch.Tensor) -> torch.Tensor:
        return gated_mlp(*a[:4], "silu").add_(a[4])

    def added(*a: torch.Tensor) -> torch.Tensor:
        return _ref("silu")(*a[:4]) + a[4]

    testing.compare_with_reference(added_in_place, added, args, arg_names=[*NAMES, "extra"])


@pytest.mark.parametrize("frozen", ["x", "gate_weight", "up_weight", "down_weight", "all weights"])
def test_frozen_inputs_get_no_gradient(device: str, frozen: str) -> None:
    args = _inputs((2, 5), 24, 40, 16, torch.float32, device, seed=3)
    for name, t in zip(NAMES, args, strict=True):
        if name == frozen or (frozen == "all weights" and name != "x"):
            t.requires_grad_(False)
    result = testing.compare_with_reference(_fk("gelu_tanh"), _ref("gelu_tanh"), args, arg_names=NAMES)
    assert len(result.names) == 1 + sum(t.requires_grad for t in args)


def _backward_allocations(args: list[torch.Tensor]) -> list[int]:
    y = gated_mlp(*args)
    dy = torch.ones_like(y)
    return testing.allocation_sizes(lambda: y.backward(dy))


def test_frozen_weights_allocate_no_gradient_buffer(device: str) -> None:
    rows, hidden, inter, out = 10, 24, 40, 16  # every [.., ..] size below is distinct
    args = _inputs((rows,), hidden, inter, out, torch.float32, device, seed=4)
    item = args[0].element_size()
    sizes = {"gate/up weight": inter * hidden * item, "down weight": out * inter * item}
    trained = _backward_allocations(args)
    assert testing.count_buffers(trained, sizes["gate/up weight"], device) == 2
    assert testing.count_buffers(trained, sizes["down weight"], device) == 1
    for t in args[1:]:
        t.requires_grad_(False)
    frozen = _backward_allocations(args)
    assert args[0].grad is not None
    for size in sizes.values():
        assert testing.count_buffers(frozen, size, device) == 0
    if uses_kernel(args[0]):  # dgate and dup overwrite gate and up; h (when Wd trains) overwrites dh
        assert testing.count_buffers(frozen, rows * inter * item, device) == 1  # dh
        assert testing.count_buffers(trained, rows * inter * item, device) == 1  # dh, then h


def _saved_shapes(fn: Callable[[], Any]) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_saves_gate_and_up_but_not_their_product(device: str) -> None:
    rows, inter = 10, 40
    args = _inputs((2, 5), 24, inter, 16, torch.float32, device, seed=5)
    ours = _saved_shapes(lambda: gated_mlp(*args))
    assert sum(s in ((rows, inter), (2, 5, inter)) for s in ours) == 2  # gate and up
    stock = _saved_shapes(lambda: _composition("silu")(*args))
    assert sum(s in ((rows, inter), (2, 5, inter)) for s in stock) > 2  # the test tells them apart
    mlp = GatedMLP(24, inter, device=device)
    assert sum(s[-1] == inter and s[0] != 24 for s in _saved_shapes(lambda: mlp(args[0]))) == 2


@pytest.mark.parametrize("in_place", [False, True], ids=["new-buffers", "in-place"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_backward_with_value(device: str, dtype: torch.dtype, act: str, in_place: bool) -> None:
    """The pass the MLP's backward runs: d gate, d up and the recomputed h = act(gate) * up, each
    within the dtype's tolerance of the float64 reference; in place, they are written over gate's,
    up's and dh's buffers (where a kernel runs). Gate and up are the halves of one wider tensor."""
    rows, inter = 33, 100
    wide = testing.random_tensor((rows, 2 * inter), dtype, device, seed=11, scale=3.0)
    gate, up = wide[:, :inter], wide[:, inter:]
    dh = testing.random_tensor((rows, inter), dtype, device, seed=12)
    want_dgate, want_dup = gated_act_backward_ref(dh.double(), gate.double(), up.double(), act)
    want_h = gated_act_ref(gate.double(), up.double(), act)
    pointers = (gate.data_ptr(), up.data_ptr(), dh.data_ptr())
    got_dgate, got_dup, got_h, written = gated_act_backward_with_value(dh, gate, up, act, inplace=in_place)
    assert written == (in_place and uses_kernel(gate))
    if written:
        assert (got_dgate.data_ptr(), got_dup.data_ptr(), got_h.data_ptr()) == pointers
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for name, got, want in (("dgate", got_dgate, want_dgate), ("dup", got_dup, want_dup), ("h", got_h, want_h)):
        assert got.dtype == dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_a_second_backward_raises(device: str) -> None:
    args = _inputs((2, 5), 24, 40, 16, torch.float32, device, seed=6)
    y = gated_mlp(*args).sum()
    y.backward(retain_graph=True)
    if not uses_kernel(args[0]):
        pytest.skip("the reference path allocates the gradients: a second backward is correct there")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_bad_inputs(device: str) -> None:
    x, wg, wu, wd = (t.detach() for t in _inputs((2, 5), 24, 40, 16, torch.float32, device, seed=7))
    cases: list[tuple[tuple[Any, ...], type[Exception], str]] = [
        (([1.0], wg, wu, wd), TypeError, "x must be a torch.Tensor"),
        ((x.long(), wg, wu, wd), TypeError, "x must have dtype"),
        ((x, wg.half(), wu, wd), TypeError, "gate_weight must have the dtype of x"),
        ((x, wg, wu, wd.bfloat16()), TypeError, "down_weight must have the dtype of x"),
        ((x, wg, wu.to("meta"), wd), ValueError, "up_weight must be on the device of x"),
        ((x, wg[0], wu, wd), ValueError, "gate_weight must have 2 dimension"),
        ((x, wg[:, :-1], wu, wd), ValueError, "gate_weight must have shape"),
        ((x, wg, wu[:-1], wd), ValueError, "up_weight must have shape"),
        ((x, wg, wu, wd[:, :-1]), ValueError, "down_weight must have shape"),
        ((x[0, 0, 0], wg, wu, wd), ValueError, "x must have at least 1 dimension"),
        ((x, wg, wu, wd, "relu"), ValueError, "activation must be one of"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            gated_mlp(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_residual_matches_reference(device: str, dtype: torch.dtype) -> None:
    # y = residual + mlp(x), the residual added in the down projection's matmul; its gradient is y's.
    args = _inputs((3, 7), 24, 40, 16, dtype, device, seed=11)
    residual = testing.random_tensor((3, 7, 16), dtype, device, seed=15, scale=4.0, requires_grad=True)
    result = testing.compare_with_reference(
        lambda x, wg, wu, wd, r: gated_mlp(x, wg, wu, wd, "silu", residual=r),
        lambda x, wg, wu, wd, r: gated_mlp_ref(x, wg, wu, wd, "silu", residual=r),
        [*args, residual],
        arg_names=[*NAMES, "residual"],
    )
    assert result.names == ["output0", *(f"grad of {n}" for n in [*NAMES, "residual"])]


@pytest.mark.parametrize("trainable", ["residual only", "x and residual", "nothing but weights"])
def test_residual_gradients_follow_requires_grad(device: str, trainable: str) -> None:
    x, wg, wu, wd = _inputs((2, 5), 24, 40, 16, torch.float32, device, seed=12)
    residual = testing.random_tensor((2, 5, 16), torch.float32, device, seed=16)
    x.requires_grad_(trainable == "x and residual")
    residual.requires_grad_(trainable != "nothing but weights")
    for w in (wg, wu, wd):
        w.requires_grad_(trainable != "residual only")
    testing.compare_with_reference(
        lambda x, wg, wu, wd, r: gated_mlp(x, wg, wu, wd, "gelu_tanh", residual=r),
        lambda x, wg, wu, wd, r: gated_mlp_ref(x, wg, wu, wd, "gelu_tanh", residual=r),
        [x, wg, wu, wd, residual],
        arg_names=[*NAMES, "residual"],
    )


def test_bad_residual(device: str) -> None:
    x, wg, wu, wd = (t.detach() for t in _inputs((2, 5), 24, 40, 16, torch.float32, device, seed=13))
    cases: list[tuple[Any, type[Exception], str]] = [
        ([1.0], TypeError, "residual must be a torch.Tensor"),
        (torch.zeros(2, 5, 16, dtype=torch.int32, device=device), TypeError, "residual must have dtype"),
        (torch.zeros(2, 5, 16, dtype=torch.float16, device=device), TypeError, "residual must have the dtype of x"),
        (torch.zeros(2, 5, 24, device=device), ValueError, "residual must have shape"),
        (torch.zeros(10, 16, device=device), ValueError, "residual must have shape"),
    ]
    for residual, error, match in cases:
        with pytest.raises(error, match=match):
            gated_mlp(x, wg, wu, wd, residual=residual)


def test_autocast_casts_as_f_linear(device: str) -> None:
    args = _inputs((2, 5), 24, 40, 16, torch.float32, device, seed=8)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        y = gated_mlp(*args)
        want = _composition("silu")(*(t.detach() for t in args))
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in args)


def test_torch_compile_fullgraph(device: str) -> None:
    args = _inputs((2, 3), 24, 40, 16, torch.float32, device, seed=9)

    def loss(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        return (gated_mlp(x * 2.0, wg, wu, wd, "gelu_tanh") * 3.0).sum()

    testing.assert_compile_matches_eager(loss, args)


def test_module_falls_back_with_a_hook(device: str) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(16, 40, "gelu", device=device)
    x = testing.random_tensor((3, 16), torch.float32, device, seed=10)
    fused = mlp(x)
    seen: list[torch.Tensor] = []
    mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o))
    torch.testing.assert_close(mlp(x), fused)
    assert len(seen) == 1


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; import torch.nn.functional as F; from fk.glu import gated_mlp;"
        "from fk.core import backend;"
        "torch.manual_seed(0);"
        "x = torch.randn(2, 3, 8, requires_grad=True); wg = torch.randn(20, 8, requires_grad=True);"
        "wu = torch.randn(20, 8, requires_grad=True); wd = torch.randn(6, 20, requires_grad=True);"
        "assert backend.kernel_path(x) is backend.KernelPath.REFERENCE;"
        "ws = [x, wg, wu, wd]; y = gated_mlp(x, wg, wu, wd); y.backward(torch.ones_like(y));"
        "got = [t.grad for t in ws]; [setattr(t, 'grad', None) for t in ws];"
        "z = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd); z.backward(torch.ones_like(z));"
        "torch.testing.assert_close(y, z);"
        "[torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5) for g, t in zip(got, ws)];"
        "print('ok')"
    )


# --- GPU, at a training size ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gpu_training_shape(act: str) -> None:
    args = _inputs((2, 1024), 2048, 8192, 2048, torch.bfloat16, "cuda", seed=11)
    testing.compare_with_reference(_fk(act), _ref(act), args, arg_names=NAMES)


@pytest.mark.gpu
def test_gpu_keeps_no_product_between_forward_and_backward() -> None:
    rows, hidden, inter = 8192, 2048, 8192
    args = _inputs((rows,), hidden, inter, hidden, torch.bfloat16, "cuda", seed=12)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = gated_mlp(*args)
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    product = rows * inter * 2
    assert abs(kept - 2 * product) < product / 2  # gate and up (and a cuBLAS workspace), not h
