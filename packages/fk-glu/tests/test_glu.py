"""SwiGLU and GeGLU against their float64 references and torch.nn.functional: on the GPU where
there is one, else in Triton's interpreter."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fk.core import testing
from fk.core.testing import AWKWARD_ROWS, AWKWARD_WIDTHS, DTYPES, WIDE_WIDTHS, dtype_name
from fk.glu import (
    ACTIVATIONS,
    GatedMLP,
    gated_act,
    gated_act_fused,
    gated_act_fused_ref,
    gated_act_ref,
    geglu,
    geglu_fused,
    swiglu,
    swiglu_fused,
)

# Triton's interpreter evaluates exp(-k) of large |k| in numpy, which warns about the (intended) inf.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _activation(t: torch.Tensor) -> torch.Tensor:
    """An op's output with ``t``'s values and strides (not a leaf; its gradient reaches ``t``): what
    ``inplace_grad`` may write over, which a leaf is not."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _fk(act: str, inplace: bool = False) -> Callable[..., torch.Tensor]:
    if inplace:
        return lambda a, b: gated_act(_activation(a), _activation(b), act, inplace_grad=True)
    return lambda a, b: gated_act(a, b, act)


def _ref(act: str) -> Callable[..., torch.Tensor]:
    return lambda a, b: gated_act_ref(a, b, act)


def _fk_fused(act: str, inplace: bool = False) -> Callable[..., torch.Tensor]:
    if inplace:
        return lambda gu: gated_act_fused(_activation(gu), act, inplace_grad=True)
    return lambda gu: gated_act_fused(gu, act)


def _ref_fused(act: str) -> Callable[..., torch.Tensor]:
    return lambda gu: gated_act_fused_ref(gu, act)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    # scale 3: the gate covers the activation's curved part and both tails.
    a = testing.random_tensor(shape, dtype, device, seed=seed, scale=3.0, requires_grad=True)
    b = testing.random_tensor(shape, dtype, device, seed=seed + 1, requires_grad=True)
    return [a, b]


def _fused_input(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    a, b = _inputs(shape, dtype, device, seed)
    return torch.cat([a.detach(), b.detach()], dim=-1).requires_grad_()


@pytest.mark.parametrize("width", AWKWARD_WIDTHS)
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, act: str, width: int) -> None:
    args = _inputs((7, width), dtype, device, seed=width)
    result = testing.compare_with_reference(_fk(act), _ref(act), args, arg_names=["gate", "up"])
    assert result.names == ["output0", "grad of gate", "grad of up"]


@pytest.mark.parametrize("width", WIDE_WIDTHS)
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_wide_rows_match_reference(device: str, dtype: torch.dtype, act: str, width: int) -> None:
    args = _inputs((2, width), dtype, device, seed=width)
    testing.compare_with_reference(_fk(act), _ref(act), args, arg_names=["gate", "up"])


@pytest.mark.parametrize("rows", AWKWARD_ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_row_counts_and_leading_dims(device: str, dtype: torch.dtype, rows: int) -> None:
    args = _inputs((rows, 3, 96), dtype, device, seed=rows)
    testing.compare_with_reference(_fk("silu"), _ref("silu"), args, arg_names=["gate", "up"])


@pytest.mark.parametrize("width", [1, 17, 1000, 4097])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_fused_matches_reference(device: str, dtype: torch.dtype, act: str, width: int) -> None:
    gu = _fused_input((5, width), dtype, device, seed=width + 3)
    result = testing.compare_with_reference(_fk_fused(act), _ref_fused(act), [gu], arg_names=["gate_up"])
    assert result.names == ["output0", "grad of gate_up"]


def _strided(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "sliced_rows":  # every other row of a taller buffer, rows sliced from wider ones
        data = t.detach()
        tall = torch.randn(data.shape[0] * 2, data.shape[1] + 5, dtype=data.dtype, device=data.device)
        tall[::2, : data.shape[1]] = data
        return tall[::2, : data.shape[1]].requires_grad_(t.requires_grad)
    return testing.with_layout(t, layout)


@pytest.mark.parametrize("layout", ["row_strided", "transposed", "sliced_rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_strided_inputs(device: str, dtype: torch.dtype, layout: str) -> None:
    a, b = _inputs((33, 300), dtype, device, seed=5)
    args = [_strided(a, layout), _strided(b, "row_strided" if layout == "transposed" else "contiguous")]
    testing.compare_with_reference(_fk("gelu_tanh"), _ref("gelu_tanh"), args, arg_names=["gate", "up"])


@pytest.mark.parametrize("layout", ["row_strided", "transposed", "sliced_rows"])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_fused_strided_input(device: str, act: str, layout: str) -> None:
    gu = _strided(_fused_input((9, 130), torch.bfloat16, device, seed=6), layout)
    testing.compare_with_reference(_fk_fused(act), _ref_fused(act), [gu], arg_names=["gate_up"])


def test_fused_is_a_view_of_gate_up(device: str) -> None:
    # The halves of one projection, given separately, are the same computation as the fused form.
    gu = _fused_input((4, 6, 64), torch.float32, device, seed=7)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu_fused(gu), swiglu(gate, up), rtol=0, atol=0)
    torch.testing.assert_close(geglu_fused(gu, "none"), geglu(gate, up, "none"), rtol=0, atol=0)


@pytest.mark.parametrize("frozen", ["gate", "up"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_frozen_input(device: str, act: str, frozen: str) -> None:
    a, b = _inputs((7, 1000), torch.bfloat16, device, seed=8)
    (a if frozen == "gate" else b).requires_grad_(False)
    result = testing.compare_with_reference(_fk(act), _ref(act), [a, b], arg_names=["gate", "up"])
    trained = "up" if frozen == "gate" else "gate"
    assert result.names == ["output0", f"grad of {trained}"]


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_matches_torch_functional(device: str, dtype: torch.dtype, act: str) -> None:
    a, b = _inputs((17, 513), dtype, device, seed=9)
    dy = testing.random_tensor((17, 513), dtype, device, seed=10)
    torch_act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}[act]
    expected = torch_act(a) * b
    exp_da, exp_db = torch.autograd.grad(expected, (a, b), dy)
    y = gated_act(a, b, act)
    da, db = torch.autograd.grad(y, (a, b), dy)
    # torch rounds act(gate) to the dtype before the product; fk rounds once (one extra rounding).
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, got, want in (("output", y, expected), ("grad of gate", da, exp_da), ("grad of up", db, exp_db)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[misc]


def test_the_tests_tell_the_gelu_forms_apart(device: str) -> None:
    # The tanh approximation is within ~1e-3 of exact GELU: the fp32 comparison must see that.
    args = _inputs((7, 1000), torch.float32, device, seed=11)
    testing.compare_with_reference(_fk("gelu_tanh"), _ref("gelu_tanh"), args)
    with pytest.raises(AssertionError, match="max error"):
        testing.compare_with_reference(_fk("gelu_tanh"), _ref("gelu"), args)
    with pytest.raises(AssertionError, match="max error"):
        testing.compare_with_reference(_fk("gelu"), _ref("gelu_tanh"), args)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_inplace_grad_writes_into_the_inputs(device: str, act: str) -> None:
    a, b = _inputs((5, 3, 200), torch.bfloat16, device, seed=12)
    dy = testing.random_tensor((5, 3, 200), torch.bfloat16, device, seed=13)
    y_ref = gated_act(a, b, act)
    want_da, want_db = torch.autograd.grad(y_ref, (a, b), dy)
    a2, b2 = (_activation(t.detach().requires_grad_()) for t in (a, b))
    y = gated_act(a2, b2, act, inplace_grad=True)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    da, db = torch.autograd.grad(y, (a2, b2), dy)
    assert da.data_ptr() == a2.data_ptr() and db.data_ptr() == b2.data_ptr()
    torch.testing.assert_close(da, want_da, rtol=0, atol=0)
    torch.testing.assert_close(db, want_db, rtol=0, atol=0)
    torch.testing.assert_close(a2.detach(), want_da, rtol=0, atol=0)  # the buffer holds the gradient


def test_inplace_grad_refuses_leaves(device: str) -> None:
    a, b = _inputs((5, 200), torch.float32, device, seed=12)  # leaves that require grad
    with pytest.raises(ValueError, match="inplace_grad=True cannot overwrite gate: it is a leaf"):
        swiglu(a, b, inplace_grad=True)
    with pytest.raises(ValueError, match="inplace_grad=True cannot overwrite gate_up: it is a leaf"):
        swiglu_fused(torch.cat([a, b], -1).detach().requires_grad_(), inplace_grad=True)
    with pytest.raises(ValueError, match="inplace_grad=True cannot overwrite up: it is a view of a leaf"):
        swiglu(a.clone(), b[:, :], inplace_grad=True)
    with torch.no_grad():  # nothing is written without autograd
        swiglu(a, b, inplace_grad=True)
    swiglu(a.detach()[:, :], b.detach(), inplace_grad=True)  # no gradient asked of them: allowed


def test_inplace_grad_fused(device: str) -> None:
    gu = _fused_input((7, 300), torch.float16, device, seed=14)
    dy = testing.random_tensor((7, 300), torch.float16, device, seed=15)
    (want,) = torch.autograd.grad(geglu_fused(gu), gu, dy)
    gu2 = _activation(gu.detach().requires_grad_())
    (grad,) = torch.autograd.grad(geglu_fused(gu2, inplace_grad=True), gu2, dy)
    assert grad.data_ptr() == gu2.data_ptr()
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_inplace_grad_of_intermediates_matches_reference(device: str) -> None:
    # The use it is meant for: gate and up are intermediate activations (as in an MLP).
    def run(inplace: bool) -> Callable[..., torch.Tensor]:
        return lambda x: gated_act(x * 2.0, x - 1.0, "silu", inplace_grad=inplace)

    x = testing.random_tensor((6, 257), torch.float32, device, seed=16, requires_grad=True)
    testing.compare_with_reference(run(True), lambda x: gated_act_ref(x * 2.0, x - 1.0), [x])


@pytest.mark.parametrize("fused", [False, True])
def test_inplace_grad_refuses_a_second_backward(device: str, fused: bool) -> None:
    gu = _fused_input((4, 64), torch.float32, device, seed=17)
    x = gu * 1.0  # an intermediate, as in a model
    y = swiglu_fused(x, inplace_grad=True) if fused else swiglu(*x.chunk(2, dim=-1), inplace_grad=True)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"modified inplace|modified by an inplace operation"):
        y.sum().backward()


def test_inplace_grad_falls_back_where_it_cannot_write(device: str) -> None:
    # A transposed gate (no unit column stride), and gate and up as one buffer: allocated gradients.
    a, b = _inputs((40, 24), torch.float32, device, seed=18)
    at = testing.with_layout(a, "transposed")
    testing.compare_with_reference(_fk("silu", inplace=True), _ref("silu"), [at, b], arg_names=["gate", "up"])

    def same_buffer(x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        return swiglu(h, h, inplace_grad=True)

    x = testing.random_tensor((6, 50), torch.float32, device, seed=19, requires_grad=True)
    testing.compare_with_reference(same_buffer, lambda x: gated_act_ref(x, x), [x])


def test_zero_elements(device: str) -> None:
    for shape in [(0, 64), (4, 0)]:
        a = torch.empty(shape, device=device, requires_grad=True)
        b = torch.empty(shape, device=device, requires_grad=True)
        y = swiglu(a, b)
        assert y.shape == shape
        y.sum().backward()
        assert a.grad is not None and a.grad.shape == shape and b.grad is not None
    gu = torch.empty(3, 0, device=device, requires_grad=True)
    y = swiglu_fused(gu)
    assert y.shape == (3, 0)
    y.sum().backward()
    assert gu.grad is not None and gu.grad.shape == (3, 0)


def test_every_output_element_is_written(device: str) -> None:
    # Poison the allocator's memory: outputs must not keep NaNs from earlier tensors.
    for _ in range(3):
        torch.full((7, 3001), float("nan"), device=device)
    a, b = _inputs((7, 3001), torch.bfloat16, device, seed=20)
    y = geglu(a, b)
    y.backward(torch.ones_like(y))
    assert torch.isfinite(y).all() and a.grad is not None and b.grad is not None
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()


@pytest.mark.parametrize("fused", [False, True])
def test_upstream_gradient_with_zero_strides(device: str, fused: bool) -> None:
    # loss.sum() sends back an expanded gradient (every stride 0).
    gu = _fused_input((5, 130), torch.float32, device, seed=21)
    gate, up = (t.detach().requires_grad_() for t in gu.chunk(2, dim=-1))
    inputs = [gu] if fused else [gate, up]
    (swiglu_fused(gu) if fused else swiglu(gate, up)).sum().backward()
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    (gated_act_fused_ref(*ref_inputs) if fused else gated_act_ref(*ref_inputs)).sum().backward()
    for t, r in zip(inputs, ref_inputs, strict=True):
        assert t.grad is not None and r.grad is not None
        torch.testing.assert_close(t.grad.double(), r.grad, rtol=1e-5, atol=1e-6)


def test_bad_inputs(device: str) -> None:
    a = torch.randn(4, 8, device=device)
    b = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match=r"gate must be a torch\.Tensor"):
        swiglu([1.0], b)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"up must be a torch\.Tensor"):
        swiglu(a, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gate must have dtype in"):
        swiglu(a.to(torch.int32), b.to(torch.int32))
    with pytest.raises(TypeError, match=r"up must have the dtype of gate \(float32\), got bfloat16"):
        swiglu(a, b.bfloat16())
    with pytest.raises(ValueError, match=r"up must have shape \(4, 8\), got \(4, 7\)"):
        swiglu(a, b[:, :7])
    with pytest.raises(ValueError, match="up must be on the device of gate"):
        swiglu(a, torch.randn(4, 8, device="meta"))
    with pytest.raises(ValueError, match="gate must have at least 1 dimension"):
        swiglu(torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="approximate must be one of 'tanh', 'none'"):
        geglu(a, b, approximate="erf")
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_act(a, b, "relu")
    with pytest.raises(TypeError, match="inplace_grad must be a bool"):
        swiglu(a, b, inplace_grad=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"gate_up must have an even last dimension.*\(4, 7\)"):
        swiglu_fused(a[:, :7])
    with pytest.raises(TypeError, match="gate_up must have dtype in"):
        geglu_fused(a.to(torch.float64))
    with pytest.raises(ValueError, match="gate_up must have at least 1 dimension"):
        swiglu_fused(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        GatedMLP(8, 16, hidden_act="relu")


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_torch_compile_fullgraph(device: str, fused: bool) -> None:
    gu = _fused_input((6, 257), torch.float32 if fused else torch.bfloat16, device, seed=22)

    def loss(gu: torch.Tensor) -> torch.Tensor:
        x = gu * 2.0
        y = geglu_fused(x, inplace_grad=True) if fused else swiglu(*x.chunk(2, dim=-1), inplace_grad=True)
        return (y * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [gu])


S = testing.strategies()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=S.dtypes, layout=S.layouts, rows=S.rows(24), width=S.widths(3000), act=st.sampled_from(ACTIVATIONS),
       fused=st.booleans(), inplace=st.booleans())  # fmt: skip
def test_property_any_shape_dtype_layout(
    device: str, dtype: torch.dtype, layout: str, rows: int, width: int, act: str, fused: bool, inplace: bool
) -> None:
    seed = rows * 7919 + width
    if fused:
        gu = testing.with_layout(_fused_input((rows, width), dtype, device, seed), layout)
        testing.compare_with_reference(_fk_fused(act, inplace), _ref_fused(act), [gu], arg_names=["gate_up"])
    else:
        a, b = (testing.with_layout(t, layout) for t in _inputs((rows, width), dtype, device, seed))
        testing.compare_with_reference(_fk(act, inplace), _ref(act), [a, b], arg_names=["gate", "up"])


# --- module ---------------------------------------------------------------------------------------


def _eager_mlp(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    # Hugging Face's LlamaMLP / GemmaMLP forward, as written in transformers.
    act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}[mlp.activation]
    return mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x))


@pytest.mark.parametrize(("hidden_act", "bias"), [("silu", False), ("gelu_pytorch_tanh", True), ("gelu", False)])
def test_mlp_matches_eager(device: str, hidden_act: str, bias: bool) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(32, 88, hidden_act, bias=bias, device=device)
    keys = {
        f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in (("weight", "bias") if bias else ("weight",))
    }
    assert set(mlp.state_dict()) == keys
    assert mlp.gate_proj.weight.shape == (88, 32) and mlp.down_proj.weight.shape == (32, 88)
    x = testing.random_tensor((2, 5, 32), torch.float32, device, seed=23, requires_grad=True)
    y = mlp(x)
    y.backward(torch.ones_like(y))
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    x2 = x.detach().clone().requires_grad_()
    mlp.zero_grad()
    y2 = _eager_mlp(mlp, x2)
    y2.backward(torch.ones_like(y2))
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, [x2.grad] + [p.grad for p in mlp.parameters()], strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_mlp_from_config_and_state_dict_round_trip(device: str) -> None:
    llama = SimpleNamespace(hidden_size=16, intermediate_size=40, hidden_act="silu", mlp_bias=False)
    gemma = SimpleNamespace(
        hidden_size=16, intermediate_size=40, hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"
    )
    assert GatedMLP.from_config(llama).activation == "silu"
    mlp = GatedMLP.from_config(gemma, device=device)
    assert mlp.activation == "gelu_tanh" and mlp.gate_proj.bias is None
    # A Hugging Face-style module with the same attribute names loads into GatedMLP and back.
    hf_like = torch.nn.Module()
    for name, (i, o) in {"gate_proj": (16, 40), "up_proj": (16, 40), "down_proj": (40, 16)}.items():
        setattr(hf_like, name, torch.nn.Linear(i, o, bias=False, device=device))
    mlp.load_state_dict(hf_like.state_dict())
    hf_like.load_state_dict(mlp.state_dict())
    assert "gelu_pytorch_tanh" in repr(mlp)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_mlp_matches_hugging_face_mlp(device: str, family: str) -> None:
    """The real transformers modules, not a stand-in: the same state_dict keys in the same order,
    and the same function (where transformers is installed; fk-glu does not depend on it)."""
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, hidden_act="silu")
        hf = transformers.models.llama.modeling_llama.LlamaMLP(config)
    else:
        config = transformers.GemmaConfig(hidden_size=32, intermediate_size=88, hidden_activation="gelu_pytorch_tanh")
        hf = transformers.models.gemma.modeling_gemma.GemmaMLP(config)
    hf = hf.to(device)
    mlp = GatedMLP.from_config(config, device=device)
    assert list(mlp.state_dict()) == list(hf.state_dict())
    mlp.load_state_dict(hf.state_dict())
    x = testing.random_tensor((5, 32), torch.float32, device, seed=40)
    torch.testing.assert_close(mlp(x), hf(x), rtol=1e-5, atol=1e-6)


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.glu import swiglu, geglu_fused, gated_act_ref, gated_act_fused_ref;"
        "from fk.core import backend;"
        "a = torch.randn(3, 10, dtype=torch.bfloat16); b = torch.randn(3, 10, dtype=torch.bfloat16);"
        "assert backend.kernel_path(a) is backend.KernelPath.REFERENCE;"
        "assert torch.equal(swiglu(a, b), gated_act_ref(a, b, 'silu'));"
        "gu = torch.randn(3, 20); assert torch.equal(geglu_fused(gu), gated_act_fused_ref(gu, 'gelu_tanh'));"
        "print('ok')"
    )


# --- GPU, at training sizes -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 14336), (2, 2048, 11008)])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gpu_training_shapes(shape: tuple[int, ...], act: str) -> None:
    args = _inputs(shape, torch.bfloat16, "cuda", seed=shape[-1])
    testing.compare_with_reference(_fk(act), _ref(act), args, arg_names=["gate", "up"])


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gpu_fused_inplace_training_shape(act: str) -> None:
    gu = _fused_input((4096, 14336), torch.bfloat16, "cuda", seed=24)
    testing.compare_with_reference(_fk_fused(act, inplace=True), _ref_fused(act), [gu], arg_names=["gate_up"])


@pytest.mark.gpu
@pytest.mark.serial  # (its separate case read a peak of 0 bytes after other tests in the same xdist worker)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_gpu_inplace_grad_saves_memory(fused: bool) -> None:
    def peak(inplace: bool) -> int:
        x = torch.randn(4096, 2 * 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        h = x * 1.0  # intermediates, as the outputs of projections
        inputs = [h] if fused else [t.contiguous() for t in h.chunk(2, dim=-1)]
        y = swiglu_fused(h, inplace_grad=inplace) if fused else swiglu(*inputs, inplace_grad=inplace)
        dy = torch.randn_like(y)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = torch.autograd.grad(y, inputs, dy)
        del grads
        return torch.cuda.max_memory_allocated() - base

    tensor_bytes = 4096 * 14336 * 2
    assert peak(True) < 0.1 * tensor_bytes
    assert peak(False) >= 1.9 * tensor_bytes
