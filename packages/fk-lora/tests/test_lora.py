"""fk.lora's functions against their float64 references (dropout 0) and their input checks: on the
GPU where there is one, else on CPU (the MLP's activation in Triton's interpreter)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from fk.core import testing
from fk.core.testing import dtype_name
from fk.lora import LoRAWeights, lora_linear, lora_linear_ref, lora_mlp, lora_mlp_ref, lora_qkv
from fk.lora.lora import module_mlp

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

K, N, INTER, R = 48, 40, 96, 4  # hidden, projection width, MLP intermediate width, rank


def _t(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, grad: bool, scale: float = 1.0
) -> torch.Tensor:
    return testing.random_tensor(shape, dtype, device, seed=seed, scale=scale, requires_grad=grad)


def _linear_args(
    dtype: torch.dtype, device: str, *, n: int = N, k: int = K, seed: int = 0, lora_dtype: torch.dtype | None = None,
    bias: bool = True, lora_bias: bool = True, train_base: bool = False,
) -> list[Any]:  # fmt: skip
    """x, W, b, A, B, lora_bias with the scales of a real layer (outputs of order one)."""
    ld = lora_dtype or dtype
    x = _t((3, 5, k), dtype, device, seed, True)
    w = _t((n, k), dtype, device, seed + 1, train_base, scale=k**-0.5)
    b = _t((n,), dtype, device, seed + 2, train_base, scale=0.1) if bias else None
    a = _t((R, k), ld, device, seed + 3, True, scale=k**-0.5)
    bb = _t((n, R), ld, device, seed + 4, True, scale=0.5)
    lb = _t((n,), ld, device, seed + 5, True, scale=0.1) if lora_bias else None
    return [x, w, b, a, bb, lb]


@pytest.mark.parametrize("train_base", [False, True], ids=["frozen_base", "trainable_base"])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=dtype_name)
def test_lora_linear_matches_reference(device: str, dtype: torch.dtype, train_base: bool) -> None:
    args = _linear_args(dtype, device, train_base=train_base)
    result = testing.compare_with_reference(
        lambda *a: lora_linear(*a[:5], 2.0, 0.0, a[5]),
        lambda *a: lora_linear_ref(*a[:5], 2.0, 0.0, a[5]),
        args,
        arg_names=["x", "weight", "bias", "lora_A", "lora_B", "lora_bias"],
    )
    expected = ["grad of x", "grad of lora_A", "grad of lora_B", "grad of lora_bias"]
    if train_base:
        expected[1:1] = ["grad of weight", "grad of bias"]
    assert result.names == ["output0", *expected]


def test_lora_linear_fp32_lora_weights_with_bf16_activations(device: str) -> None:
    args = _linear_args(torch.bfloat16, device, lora_dtype=torch.float32)
    out = lora_linear(*args[:5], 0.5, 0.0, args[5])
    assert out.dtype == torch.bfloat16
    out.backward(torch.ones_like(out))
    assert args[3].grad is not None and args[3].grad.dtype == torch.float32
    testing.compare_with_reference(
        lambda *a: lora_linear(*a[:5], 0.5, 0.0, a[5]),
        lambda *a: lora_linear_ref(*a[:5], 0.5, 0.0, a[5]),
        args,
        # fk runs the LoRA backward in bf16 (rank-sized results rounded to bf16, then cast to fp32):
        # allow bf16 rounding of the fp32 gradients.
        floors={torch.float32: testing.FLOOR[torch.bfloat16]},
        arg_names=["x", "weight", "bias", "lora_A", "lora_B", "lora_bias"],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_lora_qkv_matches_three_linears(device: str, dtype: torch.dtype) -> None:
    q = _linear_args(dtype, device, n=48, seed=0)
    k = _linear_args(dtype, device, n=24, seed=10, lora_bias=False)
    v = _linear_args(dtype, device, n=24, seed=20, bias=False)
    x = q[0]
    flat = [x, *q[1:], *k[1:], *v[1:]]

    def parts(a: list[Any]) -> tuple[LoRAWeights, ...]:
        return tuple(LoRAWeights(*a[1 + 5 * i : 5 + 5 * i], 1.5 + i, 0.0, a[5 + 5 * i]) for i in range(3))

    def fk(*a: Any) -> tuple[torch.Tensor, ...]:
        return lora_qkv(a[0], *parts(list(a)))

    def ref(*a: Any) -> tuple[torch.Tensor, ...]:
        return tuple(lora_linear_ref(a[0], *p) for p in parts(list(a)))

    names = ["x"] + [f"{p}.{n}" for p in "qkv" for n in ("weight", "bias", "lora_A", "lora_B", "lora_bias")]
    result = testing.compare_with_reference(fk, ref, flat, arg_names=names)
    assert result.names[:4] == ["output0", "output1", "output2", "grad of x"]


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_lora_qkv_mixed_dropout_and_an_unused_output(device: str, x_dtype: torch.dtype) -> None:
    """q and v without dropout share one matmul for their LoRA inputs (and their dA and dx terms),
    k draws its mask in between, and k's output gets no gradient: all as three separate linears.
    (bf16 x: fp32 LoRA weights next to bf16 activations, PEFT's default.)"""
    q, k, v = (_linear_args(x_dtype, device, n=n, seed=seed, lora_dtype=torch.float32) for n, seed in ((48, 0), (24, 10), (24, 20)))  # fmt: skip
    x = q[0]
    parts = [LoRAWeights(*t[1:5], 1.5 + i, (0.0, 0.3, 0.0)[i], t[5]) for i, t in enumerate((q, k, v))]
    leaves = [x] + [t for p in parts for t in p if isinstance(t, torch.Tensor) and t.requires_grad]

    def run(fn: Any) -> list[torch.Tensor]:
        torch.manual_seed(5)
        outs = fn(x, *parts)
        loss = outs[0].square().sum() + (outs[2] * torch.linspace(-1, 1, 24, device=device)).sum()
        return [outs[0], outs[1], outs[2], *torch.autograd.grad(loss, leaves, allow_unused=True)]

    got = run(lora_qkv)
    want = run(lambda x, *ps: tuple(lora_linear_ref(x, *p) for p in ps))
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert a is None or not a.abs().max() > 0, i
            continue
        assert a is not None and a.dtype == w.dtype, i
        # the same products summed in other orders: a few roundings of the inputs' dtype apart
        tol = (1e-5 if x_dtype == torch.float32 else 0.02) * float(w.abs().max())
        torch.testing.assert_close(a, w, rtol=0.0, atol=tol, msg=lambda m, i=i: f"result {i}: {m}")


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row_chunks"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=dtype_name)
def test_lora_mlp_matches_reference(
    device: str, dtype: torch.dtype, activation: str, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunked:  # h formed 4 rows (bf16/fp16) or 2 rows (fp32) at a time, of 15
        monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * 2)
    g = _linear_args(dtype, device, n=INTER, seed=0, train_base=dtype == torch.float32)
    u = _linear_args(dtype, device, n=INTER, seed=10, lora_bias=False)
    d = _linear_args(dtype, device, n=K, k=INTER, seed=20, bias=False, train_base=dtype == torch.float32)
    flat = [g[0], *g[1:], *u[1:], *d[1:]]

    def parts(a: list[Any]) -> tuple[LoRAWeights, ...]:
        return tuple(LoRAWeights(*a[1 + 5 * i : 5 + 5 * i], 2.0, 0.0, a[5 + 5 * i]) for i in range(3))

    testing.compare_with_reference(
        lambda *a: lora_mlp(a[0], *parts(list(a)), activation=activation),
        lambda *a: lora_mlp_ref(a[0], *parts(list(a)), activation=activation),
        flat,
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row_chunks"])
def test_lora_mlp_fp32_lora_weights_with_bf16_activations(
    device: str, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEFT's default: fp32 LoRA weights next to a bf16 model. On a GPU the LoRA inputs go through
    fk.core.matmul.mm_bf16_fp32 (in row chunks, against one split of the down projection's A), and
    the chunks' dA's add up in fp32; the base weights are trainable here, so dW's do too."""
    if chunked:
        monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * 2)
    bf, f32 = torch.bfloat16, torch.float32
    g = _linear_args(bf, device, n=INTER, seed=0, lora_dtype=f32, train_base=True)
    u = _linear_args(bf, device, n=INTER, seed=10, lora_dtype=f32, lora_bias=False)
    d = _linear_args(bf, device, n=K, k=INTER, seed=20, lora_dtype=f32, bias=False, train_base=True)
    flat = [g[0], *g[1:], *u[1:], *d[1:]]

    def parts(a: list[Any]) -> tuple[LoRAWeights, ...]:
        return tuple(LoRAWeights(*a[1 + 5 * i : 5 + 5 * i], 2.0, 0.0, a[5 + 5 * i]) for i in range(3))

    testing.compare_with_reference(
        lambda *a: lora_mlp(a[0], *parts(list(a))),
        lambda *a: lora_mlp_ref(a[0], *parts(list(a))),
        flat,
        floors={f32: testing.FLOOR[bf]},  # the rank-sized LoRA backward runs in bf16, as for one projection
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row_chunks"])
def test_lora_mlp_with_only_the_down_projection_trainable(
    device: str, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No gradient for x, gate or up: the backward recomputes h for the down projection's
    gradients alone, and leaves gate and up alone."""
    if chunked:
        monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * 4)
    g, u, d = (
        _linear_args(torch.float32, device, n=n, k=k, seed=seed, bias=False, lora_bias=False)
        for n, k, seed in ((INTER, K, 0), (INTER, K, 10), (K, INTER, 20))
    )
    x = g[0].detach()
    for t in (*g[3:5], *u[3:5]):
        t.requires_grad_(False)
    d[1].requires_grad_(True)
    result = testing.compare_with_reference(
        lambda *a: lora_mlp(a[0], *(LoRAWeights(*a[1 + 4 * i : 5 + 4 * i], 2.0) for i in range(3))),
        lambda *a: lora_mlp_ref(a[0], *(LoRAWeights(*a[1 + 4 * i : 5 + 4 * i], 2.0) for i in range(3))),
        [x, *g[1:5], *u[1:5], *d[1:5]],
        arg_names=["x"] + [f"{p}.{n}" for p in ("gate", "up", "down") for n in ("weight", "bias", "lora_A", "lora_B")],
    )
    assert result.names == ["output0", "grad of down.weight", "grad of down.lora_A", "grad of down.lora_B"]


def test_lora_mlp_backward_keeps_no_intermediate_sized_activation(device: str) -> None:
    """The forward keeps x, gate and up (and rank-sized tensors), not act(gate) * up."""
    g = _linear_args(torch.float32, device, n=INTER, seed=0, bias=False, lora_bias=False)
    u = _linear_args(torch.float32, device, n=INTER, seed=10, bias=False, lora_bias=False)
    d = _linear_args(torch.float32, device, n=K, k=INTER, seed=20, bias=False, lora_bias=False)
    x = g[0]
    out = lora_mlp(x, *(LoRAWeights(*p[1:5], 2.0) for p in (g, u, d)))
    inter = x.numel() // K * INTER
    saved = [t for t in out.grad_fn.saved_tensors if isinstance(t, torch.Tensor)]  # type: ignore[union-attr]
    assert sum(t.numel() == inter for t in saved) == 2  # gate and up only


def test_lora_mlp_in_row_chunks_forms_no_intermediate_sized_buffer(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With h formed a few rows at a time, neither the forward nor the backward allocates an
    [M, I] buffer beyond gate and up (whose gradients are written over them)."""
    monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * 4)
    g, u, d = (
        _linear_args(torch.float32, device, n=n, k=k, seed=seed, bias=False, lora_bias=False)
        for n, k, seed in ((INTER, K, 0), (INTER, K, 10), (K, INTER, 20))
    )
    x = g[0]
    weights = [LoRAWeights(*p[1:5], 2.0) for p in (g, u, d)]
    inter_bytes = x.numel() // K * INTER * 4
    sizes = testing.allocation_sizes(lambda: lora_mlp(x, *weights))
    assert testing.count_buffers(sizes, inter_bytes, device) == 2, sizes  # gate and up
    out = lora_mlp(x, *weights)
    sizes = testing.allocation_sizes(lambda: out.backward(torch.ones_like(out)))
    assert testing.count_buffers(sizes, inter_bytes, device) == 0, sizes
    assert testing.count_buffers(sizes, 4 * INTER * 4, device) >= 1, sizes  # the chunks are seen
    testing.compare_with_reference(
        lambda *a: lora_mlp(a[0], *(LoRAWeights(*a[1 + 4 * i : 5 + 4 * i], 2.0) for i in range(3))),
        lambda *a: lora_mlp_ref(a[0], *(LoRAWeights(*a[1 + 4 * i : 5 + 4 * i], 2.0) for i in range(3))),
        [x, *g[1:5], *u[1:5], *d[1:5]],
    )


def test_frozen_base_weight_gets_no_gradient_and_no_buffer(device: str) -> None:
    x, w, b, a, bb, _ = _linear_args(torch.float32, device, n=56, k=40, bias=True)
    out = lora_linear(x, w, b, a, bb, 2.0)
    dy = torch.ones_like(out)
    sizes = testing.allocation_sizes(lambda: out.backward(dy))
    assert w.grad is None and b is not None and b.grad is None
    assert testing.count_buffers(sizes, w.numel() * 4, device) == 0
    assert x.grad is not None and a.grad is not None and bb.grad is not None


def test_no_input_gradient_when_x_needs_none(device: str) -> None:
    x, w, b, a, bb, lb = _linear_args(torch.float32, device)
    x.requires_grad_(False)
    lora_linear(x, w, b, a, bb, 2.0, 0.0, lb).sum().backward()
    assert x.grad is None and a.grad is not None


def test_dropout_uses_the_global_generator_like_peft(device: str) -> None:
    x, w, b, a, bb, lb = _linear_args(torch.float32, device)
    torch.manual_seed(3)
    got = lora_linear(x, w, b, a, bb, 2.0, 0.4, lb)
    torch.manual_seed(3)
    want = lora_linear_ref(x, w, b, a, bb, 2.0, 0.4, lb)  # F.dropout, as PEFT's nn.Dropout
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.manual_seed(4)
    assert not torch.allclose(lora_linear(x, w, b, a, bb, 2.0, 0.4, lb), want)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_autocast_casts_like_autocast(device: str, x_dtype: torch.dtype) -> None:
    """Under bf16 autocast with fp32 weights, :func:`lora_linear` and :func:`lora_mlp` compute what
    their references (PEFT's forward in plain PyTorch) compute under the same autocast: bf16
    outputs, the same dropout masks (drawn on ``x`` cast to fp32), gradients in the leaves' dtypes.
    """
    args = _linear_args(torch.float32, device, train_base=True)
    args[0] = args[0].detach().to(x_dtype).requires_grad_()
    g = _linear_args(torch.float32, device, n=INTER, seed=10)
    u = _linear_args(torch.float32, device, n=INTER, seed=20)
    d = _linear_args(torch.float32, device, n=K, k=INTER, seed=30)
    mlp_parts = [LoRAWeights(*p[1:5], 0.5, 0.3, p[5]) for p in (g, u, d)]
    leaves = [t for t in args if t is not None and t.requires_grad]
    leaves += [t for p in mlp_parts for t in p if isinstance(t, torch.Tensor) and t.requires_grad]

    def run(linear: Any, mlp: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(7)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            outs = [linear(*args[:5], 2.0, 0.3, args[5]), mlp(args[0], *mlp_parts)]
        dys = [testing.random_tensor(o.shape, torch.float32, device, seed=3 + i).to(o.dtype) for i, o in enumerate(outs)]  # fmt: skip
        return outs, list(torch.autograd.grad(outs, leaves, dys))

    got, got_grads = run(lora_linear, lora_mlp)
    want, want_grads = run(lora_linear_ref, lora_mlp_ref)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    for a, w in zip(got + got_grads, want + want_grads, strict=True):
        a, w = a.detach(), w.detach()
        assert a.dtype == w.dtype, (a.dtype, w.dtype)
        # bf16 matmuls on both sides, summed in other orders: a few bf16 rounding steps apart
        torch.testing.assert_close(a.float(), w.float(), rtol=0.0, atol=0.03 * float(w.abs().max()))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row_chunks"])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "bf16_autocast"])
def test_compile_fullgraph_matches_eager(
    device: str, autocast: bool, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunked: the MLP forms h a few rows at a time, in the traced forward too (its chunks written
    # into y); the traced backward is not chunked (it would write gradients over saved tensors), so
    # the down projection's dA sums its rows in another order than eager's chunks: fp32 summation
    # differences, not exactness, for the gradients.
    #
    # bf16 autocast: the traced functions are plain PyTorch with bf16 intermediates, which Inductor may
    # round at other points than eager (on one H200 of two, a few outputs one bf16 step apart): equal
    # to bf16 rounding, not bit for bit.
    tolerance: dict[str, Any] = {"grad_rtol": 1e-4, "grad_atol": 1e-5} if chunked else {}
    if autocast:
        tolerance = {"bf16_rounding": True}
    if chunked:
        monkeypatch.setattr(importlib.import_module("fk.lora.lora"), "MLP_CHUNK_BYTES", 4 * INTER * 4)
    lin = _linear_args(torch.float32, device, n=48)
    kv = _linear_args(torch.float32, device, n=24, seed=30)
    g = _linear_args(torch.float32, device, n=INTER, seed=0)
    u = _linear_args(torch.float32, device, n=INTER, seed=10)
    d = _linear_args(torch.float32, device, n=K, k=INTER, seed=20)
    x = lin[0]
    leaves = [x, lin[3], lin[4], g[3], g[4], u[3], u[4], d[3], d[4]]
    # Dynamo cannot trace an autograd.Function given one tensor twice: q, k and v have their own.
    q_parts = LoRAWeights(*lin[1:5], 2.0, 0.0, lin[5])
    k_parts = LoRAWeights(*kv[1:5], 1.0)
    v_parts = LoRAWeights(kv[1].detach().clone(), None, kv[3].detach().clone(), kv[4].detach().clone(), 0.5)

    def loss(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *mlp_lora: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            q, k, v = lora_qkv(x, q_parts._replace(lora_A=a, lora_B=b), k_parts, v_parts)
            parts = [LoRAWeights(p[1], p[2], mlp_lora[2 * i], mlp_lora[2 * i + 1], 2.0) for i, p in enumerate((g, u, d))]  # fmt: skip
            h = lora_mlp(x, *parts)
        q, k, v, h = (t.float() for t in (q, k, v, h))
        return q.square().sum() + (k * v).sum() + h.square().sum()

    testing.assert_compile_matches_eager(loss, leaves, **tolerance)


def test_reference_path_without_the_interpreter() -> None:
    testing.run_on_reference_path(
        "import torch\n"
        "from fk.lora import LoRAWeights, lora_mlp, lora_mlp_ref\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(4, 16, requires_grad=True)\n"
        "P = lambda n, k: LoRAWeights(torch.randn(n, k) / 4, None, torch.randn(2, k, requires_grad=True), torch.randn(n, 2, requires_grad=True), 2.0)\n"
        "g, u, d = P(24, 16), P(24, 16), P(16, 24)\n"
        "for act in ('swiglu', 'geglu', 'gelu'):\n"
        "    y = lora_mlp(x, g, u, d, act); yr = lora_mlp_ref(x, g, u, d, act)\n"
        "    torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)\n"
        "    gy = torch.autograd.grad(y.sum(), [x, g.lora_A, d.lora_B]); gr = torch.autograd.grad(yr.sum(), [x, g.lora_A, d.lora_B])\n"
        "    [torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3) for a, b in zip(gy, gr)]\n"
        "print('ok')\n"
    )


def test_bad_inputs_name_the_argument(device: str) -> None:
    x, w, b, a, bb, lb = _linear_args(torch.float32, device)
    with pytest.raises(TypeError, match=r"^x must be a torch.Tensor"):
        lora_linear(x.tolist(), w, b, a, bb, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^weight must have the dtype of x"):
        lora_linear(x, w.half(), b, a, bb, 2.0)
    with pytest.raises(ValueError, match=r"^weight must have shape \(40, 48\)"):
        lora_linear(x, w[:, :10], b, a, bb, 2.0)
    with pytest.raises(ValueError, match=r"^lora_A must have shape \(4, 48\)"):
        lora_linear(x, w, b, a[:, :5], bb, 2.0)
    with pytest.raises(ValueError, match=r"^lora_B must have shape \(40, 4\)"):
        lora_linear(x, w, b, a, bb[:, :3], 2.0)
    with pytest.raises(TypeError, match=r"^lora_B must have the dtype of lora_A"):
        lora_linear(x, w, b, a, bb.half(), 2.0)
    with pytest.raises(ValueError, match=r"^bias must have shape \(40,\)"):
        lora_linear(x, w, b[:3], a, bb, 2.0)  # type: ignore[index]
    with pytest.raises(TypeError, match=r"^lora_bias must have the dtype of lora_B"):
        lora_linear(x, w, b, a, bb, 2.0, 0.0, lb.half())  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"^dropout_p must be < 1.0"):
        lora_linear(x, w, b, a, bb, 2.0, 1.0)
    with pytest.raises(TypeError, match=r"^scaling must be a float"):
        lora_linear(x, w, b, a, bb, "2")  # type: ignore[arg-type]
    parts = LoRAWeights(w, b, a, bb, 2.0)
    with pytest.raises(ValueError, match=r"^k_parts.lora_A must have shape"):
        lora_qkv(x, parts, parts._replace(lora_A=a[:, :7]), parts)
    with pytest.raises(ValueError, match=r"^activation must be one of"):
        lora_mlp(x, parts, parts, parts, activation="relu")
    with pytest.raises(ValueError, match=r"^down_parts.weight must have shape \(40, 40\)"):
        lora_mlp(x, parts, parts, parts)
    # The patched forwards' entry point checks only widths, without a tensor for the intermediate.
    with pytest.raises(ValueError, match=r"^down_parts.weight takes 48 input features, gate_parts.weight gives 40"):
        module_mlp(x, parts, parts, parts, "swiglu", from_module=True)
    if device == "cuda":
        with pytest.raises(ValueError, match=r"^lora_A must be on the device of x"):
            lora_linear(x, w, b, a.cpu(), bb, 2.0)
