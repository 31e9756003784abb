"""fk.lora's DoRA (a magnitude vector, PEFT ``use_dora=True``) against the float64 evaluation of
:func:`fk.lora.lora_linear_ref`, PEFT's definition (the norm detached): outputs and the gradients
of x, the base weight and bias, lora_A, lora_B and the magnitude, with and without dropout (the
reference replays the mask fk drew). PEFT's own DoRA layers are compared in ``test_peft.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fk.core import testing
from fk.core.testing import dtype_name
from fk.lora import LoRAWeights, lora_linear, lora_linear_ref, lora_mlp, lora_mlp_ref, lora_qkv
from fk.lora.dora_norm import dora_weight_norm

K, N, R = 37, 29, 3  # awkward widths: hidden, projection width, rank
SCALING = 1.5
NAMES = ["x", "weight", "bias", "lora_A", "lora_B", "magnitude"]


def _args(
    dtype: torch.dtype, device: str, *, n: int = N, seed: int = 0, lora_dtype: torch.dtype | None = None,
    train_base: bool = True,
) -> list[Any]:  # fmt: skip
    """x, W, b, A, B, m with the scales of a real layer; m is the norm PEFT initializes it to,
    moved by up to 30% per row (so that m / n is not 1)."""
    ld = lora_dtype or dtype
    x = testing.random_tensor((2, 7, K), dtype, device, seed=seed, requires_grad=True)
    w = testing.random_tensor((n, K), dtype, device, seed=seed + 1, scale=K**-0.5, requires_grad=train_base)
    b = testing.random_tensor((n,), dtype, device, seed=seed + 2, scale=0.1, requires_grad=train_base)
    a = testing.random_tensor((R, K), ld, device, seed=seed + 3, scale=K**-0.5, requires_grad=True)
    bb = testing.random_tensor((n, R), ld, device, seed=seed + 4, scale=0.5, requires_grad=True)
    norm = torch.linalg.norm(w.detach().double() + SCALING * bb.detach().double() @ a.detach().double(), dim=1)
    moved = 1 + 0.3 * testing.random_tensor((n,), torch.float64, device, seed=seed + 5)
    m = (norm * moved).to(ld).requires_grad_()
    return [x, w, b, a, bb, m]


def _drawn_masks(shape: torch.Size, dtype: torch.dtype, device: torch.device, ps: list[float], seed: int) -> list[torch.Tensor]:  # fmt: skip
    """The dropout masks fk draws, one per probability in turn, after ``torch.manual_seed(seed)`` on
    an input of ``shape`` in ``dtype``."""
    torch.manual_seed(seed)
    return [torch.native_dropout(torch.ones(shape, dtype=dtype, device=device), p, True)[1] for p in ps]


def _drawn_mask(shape: torch.Size, dtype: torch.dtype, device: torch.device, p: float, seed: int) -> torch.Tensor:
    """The dropout mask fk draws after ``torch.manual_seed(seed)`` on an input of ``shape`` in ``dtype``."""
    return _drawn_masks(shape, dtype, device, [p], seed)[0]


@contextlib.contextmanager
def _replayed_dropout(masks: list[torch.Tensor]) -> Iterator[None]:
    """``F.dropout`` (the reference's) applies ``masks`` in turn instead of drawing."""
    queue = list(masks)

    def replay(t: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        mask = queue.pop(0).to(t.device).reshape(t.shape)
        return t * mask / (1 - p)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "dropout", replay)
        yield


def _seeded_fk_and_reference(p: float, seed: int = 11) -> tuple[Any, Any]:
    def fk_fn(x: torch.Tensor, w: Any, b: Any, a: Any, bb: Any, m: Any) -> torch.Tensor:
        torch.manual_seed(seed)
        return lora_linear(x, w, b, a, bb, SCALING, p, None, m)

    def ref_fn(x: torch.Tensor, w: Any, b: Any, a: Any, bb: Any, m: Any) -> torch.Tensor:
        if p == 0:
            return lora_linear_ref(x, w, b, a, bb, SCALING, 0.0, None, m)
        mask = _drawn_mask(x.shape, a.dtype, x.device, p, seed)
        with _replayed_dropout([mask]):
            return lora_linear_ref(x, w, b, a, bb, SCALING, p, None, m)

    return fk_fn, ref_fn


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=dtype_name)
def test_dora_linear_matches_reference(device: str, dtype: torch.dtype, p: float) -> None:
    fk_fn, ref_fn = _seeded_fk_and_reference(p)
    result = testing.compare_with_reference(fk_fn, ref_fn, _args(dtype, device), arg_names=NAMES)
    assert result.names == ["output0", *(f"grad of {n}" for n in NAMES)]


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=dtype_name)
def test_dora_linear_with_dropout_and_frozen_base_matches_reference(device: str, dtype: torch.dtype) -> None:
    """A frozen base with dropout (PEFT's case; ``dW``, which needs ``(ms - 1) * dy`` for itself, not
    formed): the output and the gradients of x, A, B and the magnitude."""
    fk_fn, ref_fn = _seeded_fk_and_reference(0.3)
    args = _args(dtype, device, train_base=False)
    result = testing.compare_with_reference(fk_fn, ref_fn, args, arg_names=NAMES)
    assert result.names == ["output0", *(f"grad of {n}" for n in ("x", "lora_A", "lora_B", "magnitude"))]


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_dora_fp32_adapter_with_bf16_activations(device: str, p: float) -> None:
    """PEFT's default: LoRA weights and magnitude in fp32 next to bf16 activations (the norm is
    then fp32, and the gradients come back in fp32)."""
    args = _args(torch.bfloat16, device, lora_dtype=torch.float32)
    fk_fn, ref_fn = _seeded_fk_and_reference(p)
    out = fk_fn(*args)
    assert out.dtype == torch.bfloat16
    out.sum().backward()
    assert args[3].grad.dtype == args[5].grad.dtype == torch.float32
    # the LoRA backward runs in bf16 (rank-sized results rounded to bf16, then cast to fp32)
    floors = {torch.float32: testing.FLOOR[torch.bfloat16]}
    testing.compare_with_reference(fk_fn, ref_fn, args, floors=floors, arg_names=NAMES)


def _compare_qkv(dtype: torch.dtype, device: str, drops: list[float]) -> testing.Comparison:
    """fk's DoRA q/k/v (widths 40, 16, 16) against three PEFT DoRA layers of one ``x``, dropout
    ``drops[i]`` on each (the masks fk draws after ``torch.manual_seed(7)``, replayed)."""
    q, k, v = (_args(dtype, device, n=n, seed=s) for n, s in ((40, 0), (16, 10), (16, 20)))
    flat = [q[0], *q[1:], *k[1:], *v[1:]]

    def parts(a: list[Any]) -> list[LoRAWeights]:
        return [LoRAWeights(*a[1 + 5 * i : 5 + 5 * i], SCALING + i, drops[i], None, a[5 + 5 * i]) for i in range(3)]

    def fk_fn(*a: Any) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(7)
        return lora_qkv(a[0], *parts(list(a)))

    def ref_fn(*a: Any) -> tuple[torch.Tensor, ...]:
        x = a[0]
        masks = _drawn_masks(x.shape, a[4].dtype, x.device, [p for p in drops if p > 0], 7)
        with _replayed_dropout(masks):
            return tuple(lora_linear_ref(x, *part) for part in parts(list(a)))

    names = ["x"] + [f"{p}.{n}" for p in "qkv" for n in NAMES[1:]]
    return testing.compare_with_reference(fk_fn, ref_fn, flat, arg_names=names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_dora_qkv_matches_three_references(device: str, dtype: torch.dtype) -> None:
    """q and v without dropout (their LoRA inputs from one matmul), k with dropout between them:
    each as PEFT's DoRA layer, and one dx."""
    result = _compare_qkv(dtype, device, [0.0, 0.3, 0.0])
    assert result.names[:4] == ["output0", "output1", "output2", "grad of x"]
    assert "grad of k.magnitude" in result.names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_dora_qkv_with_dropout_forms_the_three_dA_in_one_pass(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """q, k and v all with dropout: as three PEFT DoRA layers under the same masks, with their dA from
    one masked_a_grads call of three terms (x and the three masks read once)."""
    from fk.lora import projection

    launches: list[int] = []
    original = projection.masked_a_grads

    def counted(x: torch.Tensor, terms: list[Any]) -> list[torch.Tensor]:
        launches.append(len(terms))
        return original(x, terms)

    monkeypatch.setattr(projection, "masked_a_grads", counted)
    result = _compare_qkv(dtype, device, [0.3, 0.2, 0.1])
    assert {"grad of q.lora_A", "grad of k.lora_A", "grad of v.lora_A"} <= set(result.names)
    assert launches and set(launches) == {3}


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_dora_mlp_matches_reference(device: str, dtype: torch.dtype, p: float) -> None:
    """DoRA on gate, up and down (intermediate width 29), dropout on all three: masks drawn in the
    order gate, up, down, the down projection's on the activation."""
    gate, up = (_args(dtype, device, seed=s) for s in (0, 10))
    down_bias = testing.random_tensor((K,), dtype, device, seed=30, scale=0.1, requires_grad=True)
    down_w = testing.random_tensor((K, N), dtype, device, seed=31, scale=N**-0.5, requires_grad=True)
    down_a = testing.random_tensor((R, N), dtype, device, seed=32, scale=N**-0.5, requires_grad=True)
    down_b = testing.random_tensor((K, R), dtype, device, seed=33, scale=0.5, requires_grad=True)
    down_m = testing.random_tensor((K,), dtype, device, seed=34, scale=0.2).add(1.0).requires_grad_()
    down = [None, down_w, down_bias, down_a, down_b, down_m]
    flat = [gate[0], *gate[1:], *up[1:], *down[1:]]

    def parts(a: list[Any]) -> list[LoRAWeights]:
        return [LoRAWeights(*a[1 + 5 * i : 5 + 5 * i], SCALING, p, None, a[5 + 5 * i]) for i in range(3)]

    def fk_fn(*a: Any) -> torch.Tensor:
        torch.manual_seed(7)
        return lora_mlp(a[0], *parts(list(a)))

    def ref_fn(*a: Any) -> torch.Tensor:
        x = a[0]
        if p == 0:
            return lora_mlp_ref(x, *parts(list(a)))
        torch.manual_seed(7)
        masks = [torch.native_dropout(torch.ones(shape, dtype=dtype, device=x.device), p, True)[1] for shape in (x.shape, x.shape, (*x.shape[:-1], N))]  # fmt: skip
        with _replayed_dropout(masks):
            return lora_mlp_ref(x, *parts(list(a)))

    names = ["x"] + [f"{proj}.{n}" for proj in ("gate", "up", "down") for n in NAMES[1:]]
    result = testing.compare_with_reference(fk_fn, ref_fn, flat, arg_names=names)
    assert "grad of down.magnitude" in result.names and "grad of gate.magnitude" in result.names


def test_dora_at_its_initial_magnitude_is_lora(device: str) -> None:
    """PEFT starts m at the norm, so that m / n = 1: DoRA's output is then plain LoRA's."""
    x, w, b, a, bb, _ = _args(torch.float32, device)
    m = dora_weight_norm(w, a, bb, SCALING, torch.float32)
    got = lora_linear(x, w, b, a, bb, SCALING, 0.0, None, m)
    torch.testing.assert_close(got, lora_linear(x, w, b, a, bb, SCALING), rtol=1e-5, atol=1e-6)


def test_dora_frozen_tensors_get_no_gradient(device: str) -> None:
    x, w, b, a, bb, m = _args(torch.float32, device, train_base=False)
    x.requires_grad_(False)
    m.requires_grad_(False)
    lora_linear(x, w, b, a, bb, SCALING, 0.3, None, m).square().sum().backward()
    assert x.grad is None and w.grad is None and b.grad is None and m.grad is None
    assert a.grad is not None and bb.grad is not None


def test_dora_bad_inputs_name_the_argument(device: str) -> None:
    x, w, b, a, bb, m = _args(torch.float32, device)
    with pytest.raises(ValueError, match=r"^magnitude must have shape \(29,\)"):
        lora_linear(x, w, b, a, bb, SCALING, 0.0, None, m[:5])
    with pytest.raises(TypeError, match=r"^magnitude must have dtype in"):
        lora_linear(x, w, b, a, bb, SCALING, 0.0, None, m.double())
    with pytest.raises(ValueError, match=r"^magnitude \(DoRA\) cannot be combined with lora_bias"):
        lora_linear(x, w, b, a, bb, SCALING, 0.0, torch.zeros_like(m), m)
    dora = LoRAWeights(w, b, a, bb, SCALING, 0.0, None, m)
    with pytest.raises(ValueError, match=r"^either every projection of one input has a magnitude"):
        lora_qkv(x, dora, dora._replace(magnitude=None), dora)
    with pytest.raises(ValueError, match=r"^k_parts.magnitude must have shape"):
        lora_qkv(x, dora, dora._replace(magnitude=m[:3]), dora)
    wide = LoRAWeights(w.new_ones(K, K), None, a, bb.new_ones(K, R), SCALING)
    with pytest.raises(ValueError, match=r"^either every projection of one input has a magnitude"):
        lora_mlp(x, wide._replace(magnitude=m.new_ones(K)), wide, wide)
    with pytest.raises(ValueError, match=r"^down_parts.magnitude must have shape \(37,\)"):
        lora_mlp(x, wide, wide, wide._replace(magnitude=m))


def test_dora_compile_fullgraph_matches_eager(device: str) -> None:
    """DoRA's launchers (the norm's row loop included) trace without a graph break and give eager's
    value and gradients (no dropout: compiled masks come from the compiler's random stream)."""
    x, w, b, a, bb, m = _args(torch.float32, device, train_base=False)
    gate, up = (_args(torch.float32, device, seed=s, train_base=False) for s in (10, 20))
    down_a = testing.random_tensor((R, N), torch.float32, device, seed=30, scale=N**-0.5)
    down_b = testing.random_tensor((K, R), torch.float32, device, seed=31, scale=0.5)
    down_m = testing.random_tensor((K,), torch.float32, device, seed=32, scale=0.2).add(1.0)

    def loss(x: torch.Tensor, a: torch.Tensor, bb: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        y = lora_linear(x, w, b, a, bb, SCALING, 0.0, None, m)
        parts = [LoRAWeights(*p[1:5], SCALING, 0.0, None, p[5].detach()) for p in (gate, up)]
        down = LoRAWeights(w.t().contiguous(), None, down_a, down_b, SCALING, 0.0, None, down_m)
        h = lora_mlp(x, *parts, down)
        return y.square().sum() + h.square().sum()

    # Inductor fuses the elementwise passes and sums in other orders: fp32 roundings of gradients
    # that reach 2e3 here (the MLP's square), not exactness.
    testing.assert_compile_matches_eager(loss, [x, a, bb, m], grad_rtol=1e-4, grad_atol=1e-3)


def test_dora_mlp_without_dropout_keeps_two_intermediate_sized_tensors(device: str) -> None:
    """Without dropout the DoRA MLP keeps what DoRA's gate and up scale (for their magnitudes'
    gradients), not the gate and up outputs nor act(gate) * up (recomputed in the backward)."""
    projections = [_args(torch.float32, device, seed=s) for s in (0, 10)]
    x = projections[0][0]
    down_w = testing.random_tensor((K, N), torch.float32, device, seed=31, scale=N**-0.5)
    down_a = testing.random_tensor((R, N), torch.float32, device, seed=32, requires_grad=True)
    down_b = testing.random_tensor((K, R), torch.float32, device, seed=33, requires_grad=True)
    down_m = testing.random_tensor((K,), torch.float32, device, seed=34).requires_grad_()
    parts = [LoRAWeights(*p[1:5], SCALING, 0.0, None, p[5]) for p in projections]
    out = lora_mlp(x, *parts, LoRAWeights(down_w, None, down_a, down_b, SCALING, 0.0, None, down_m))
    inter = x.numel() // K * N
    saved = [t for t in out.grad_fn.saved_tensors if isinstance(t, torch.Tensor)]  # type: ignore[union-attr]
    assert sum(t.numel() == inter for t in saved) == 2


def test_dora_mlp_with_dora_on_the_down_projection_only(device: str) -> None:
    """DoRA on down but not on gate and up: the composed path, as PEFT's definition."""
    gate, up = (_args(torch.float32, device, seed=s) for s in (0, 10))
    down_w = testing.random_tensor((K, N), torch.float32, device, seed=31, scale=N**-0.5)
    down_a = testing.random_tensor((R, N), torch.float32, device, seed=32, scale=N**-0.5, requires_grad=True)
    down_b = testing.random_tensor((K, R), torch.float32, device, seed=33, scale=0.5, requires_grad=True)
    down_m = testing.random_tensor((K,), torch.float32, device, seed=34, scale=0.2).add(1.0).requires_grad_()
    flat = [gate[0], *gate[1:5], *up[1:5], down_w, down_a, down_b, down_m]

    def parts(a: list[Any]) -> list[LoRAWeights]:
        return [
            LoRAWeights(*a[1:5], SCALING),
            LoRAWeights(*a[5:9], SCALING),
            LoRAWeights(a[9], None, a[10], a[11], SCALING, 0.0, None, a[12]),
        ]

    result = testing.compare_with_reference(
        lambda *a: lora_mlp(a[0], *parts(list(a))), lambda *a: lora_mlp_ref(a[0], *parts(list(a))), flat
    )
    assert len(result.names) == 1 + 1 + 4 + 4 + 3


@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
def test_dora_dropout_forms_no_masked_copy_of_x(device: str, lora_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """With bf16 adapters the dropped-input product takes the dropout's own output and dA comes from
    x and the mask: x * m is never written (kept_input is not called). With fp32 adapters the fp32
    dropped input is not kept (the product takes x * m in bf16 instead: one call)."""
    from fk.lora import dora, projection

    calls: list[torch.dtype] = []

    def counted(x2: torch.Tensor, mask: Any, dropout_dtype: torch.dtype, c: torch.dtype) -> torch.Tensor:
        calls.append(dropout_dtype)
        return projection.kept_input(x2, mask, dropout_dtype, c)

    monkeypatch.setattr(dora, "kept_input", counted)
    args = _args(torch.bfloat16, device, lora_dtype=lora_dtype, train_base=False)
    fk_fn, _ = _seeded_fk_and_reference(0.3)
    fk_fn(*args).sum().backward()
    assert calls == ([] if lora_dtype == torch.bfloat16 else [torch.float32])
    assert args[3].grad is not None and args[3].grad.abs().sum() > 0


def test_dropped_inputs_are_kept_only_in_the_compute_dtype(device: str) -> None:
    # A dropout drawn in fp32 next to bf16 activations is not held (DoRA forms its product from x * m).
    from fk.lora.projection import Settings, lora_input_products

    x2 = testing.random_tensor((14, K), torch.bfloat16, device, seed=0)
    lora_As = [testing.random_tensor((R, K), dt, device, seed=1) for dt in (torch.bfloat16, torch.float32)]
    settings = [Settings(SCALING, 0.3, a.dtype) for a in lora_As]
    _, masks, _, dropped = lora_input_products(x2, x2, lora_As, settings, keep_dropped=True)
    assert dropped[0] is not None and dropped[0].dtype == torch.bfloat16 and dropped[1] is None
    assert masks[0] is not None and not dropped[0][~masks[0]].any()  # the dropout's own output
    assert lora_input_products(x2, x2, lora_As, settings).dropped == [None, None]
