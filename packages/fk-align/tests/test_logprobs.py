"""Per-token log-probabilities on the fused head against the full logits in float64: on the GPU
where there is one, else in Triton's interpreter (small vocabularies)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fk.align import LogProbsOutput, fused_linear_logprobs, fused_linear_logprobs_ref
from fk.core import testing
from fk.core.testing import DTYPES, dtype_name

H, V = 16, 1003  # a vocabulary that is not a power of two: the last block of each row is masked
ONE_CHUNK = 1 << 30
SMALL_CHUNKS = 8 * V * 4  # 8 tokens (fp32) or 16 (half) per chunk: several chunks, fp32 dW accumulator


def _labels(shape: tuple[int, ...], device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[::5] = -100
    return t.to(device)


def _inputs(n: int, dtype: torch.dtype, device: str, seed: int, *, bias: bool) -> list[torch.Tensor | None]:
    return testing.random_head((n,), V, H, dtype, device, seed=seed, bias=bias, weight_scale=3.0)


def _pair(target: torch.Tensor, **kw: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def fk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
        return fused_linear_logprobs(h, w, target.to(h.device), bias=b, **kw)

    def ref(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
        kw_ref = {k: v for k, v in kw.items() if k not in ("memory_budget", "accum_dtype")}
        return fused_linear_logprobs_ref(h, w, target.to(h.device), bias=b, **kw_ref)

    return fk, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("budget", [ONE_CHUNK, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 0.7, "return_entropy": True}, {"return_entropy": True, "bias": True}],
    ids=["plain", "temperature_entropy", "bias_entropy"],
)
def test_matches_reference(device: str, dtype: torch.dtype, budget: int, options: dict[str, Any]) -> None:
    n = 37  # odd: the last chunk is partial
    kw = dict(options)
    args = _inputs(n, dtype, device, seed=1, bias=kw.pop("bias", False))
    fk, ref = _pair(_labels((n,), device, seed=2), memory_budget=budget, **kw)
    testing.compare_with_reference(fk, ref, args, arg_names=["hidden", "weight", "bias"])


def test_runs_the_kernel_not_the_reference(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparisons above would pass vacuously if the reference ran in place of the kernel."""
    import fk.align.logprobs as module

    monkeypatch.setattr(module, "fused_linear_logprobs_ref", None)
    h, w, _ = _inputs(5, torch.float32, device, seed=3, bias=False)
    fused_linear_logprobs(h, w, _labels((5,), device, seed=4), return_entropy=True).entropy.sum().backward()


def test_batched_shift_and_strided_hidden(device: str) -> None:
    """(B, T, H) hidden as a non-contiguous view, labels shifted inside: equal to the reference on
    the shifted labels, and the last position of each sequence is 0."""
    base = testing.random_tensor((3, 9, 2 * H), torch.float32, device, seed=5)
    h = base[..., ::2].requires_grad_(False).clone().requires_grad_(True)
    h_view = torch.cat([h, h], dim=-1)[..., :H]  # a view with row stride 2H
    w = testing.random_tensor((V, H), torch.float32, device, seed=6, scale=0.5)
    labels = _labels((3, 9), device, seed=7)
    out = fused_linear_logprobs(h_view, w, labels, shift=True)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    ref = fused_linear_logprobs_ref(h.detach(), w, shifted)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert bool((out[:, -1] == 0).all())


def test_all_ignored_gives_zeros_and_zero_gradients(device: str) -> None:
    h, w, b = _inputs(6, torch.float32, device, seed=8, bias=True)
    target = torch.full((6,), -100, device=device)
    out = fused_linear_logprobs(h, w, target, bias=b, return_entropy=True, memory_budget=SMALL_CHUNKS)
    assert bool((out.logps == 0).all()) and bool((out.entropy == 0).all())
    (out.logps.sum() + out.entropy.sum()).backward()
    for t in (h, w, b):
        assert t is not None and t.grad is not None and bool((t.grad == 0).all())


def test_frozen_head_gets_no_gradient_and_hidden_one_is_right(device: str) -> None:
    h, w, _ = _inputs(11, torch.float32, device, seed=9, bias=False)
    w.requires_grad_(False)
    target = _labels((11,), device, seed=10)
    fk, ref = _pair(target, return_entropy=True, memory_budget=SMALL_CHUNKS)
    testing.compare_with_reference(lambda h: fk(h, w, None), lambda h: ref(h, w.to(h), None), [h])
    fk(h, w, None).logps.sum().backward()
    assert w.grad is None


def test_entropy_only_gradient(device: str) -> None:
    """A loss of the entropy alone (TRL's entropy bonus): the log-prob output gets no gradient."""
    h, w, _ = _inputs(9, torch.float32, device, seed=11, bias=False)
    target = _labels((9,), device, seed=12)
    got = torch.autograd.grad(fused_linear_logprobs(h, w, target, return_entropy=True).entropy.sum(), (h, w))
    want = torch.autograd.grad(fused_linear_logprobs_ref(h, w, target, return_entropy=True).entropy.sum(), (h, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("budget", [ONE_CHUNK, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
def test_compile_matches_eager(device: str, budget: int) -> None:
    h, w, b = _inputs(13, torch.float32, device, seed=13, bias=True)
    target = _labels((13,), device, seed=14)
    g = torch.randn(13, generator=torch.Generator().manual_seed(0)).to(device)

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = fused_linear_logprobs(h, w, target, bias=b, temperature=0.9, return_entropy=True, memory_budget=budget)
        return (out.logps * g).sum() + 0.1 * out.entropy.sum()

    testing.assert_compile_matches_eager(loss, [h, w, b])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"target": "short"}, "target"),
        ({"target": "out_of_range"}, r"target\[3\]"),
        ({"weight": "wrong_width"}, "weight"),
        ({"bias": "wrong_size"}, "bias"),
        ({"memory_budget": 0}, "memory_budget"),
    ],
)
def test_bad_input_raises_naming_the_argument(device: str, change: dict[str, Any], message: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FK_CHECK_LABELS", "1")  # (labels are checked on CUDA only when asked)
    h, w, b = _inputs(7, torch.float32, device, seed=15, bias=True)
    kw: dict[str, Any] = {"bias": b, "temperature": 1.0, "memory_budget": ONE_CHUNK}
    target = _labels((7,), device, seed=16)
    for key, value in change.items():
        if key == "target":
            target = (
                target[:5] if value == "short" else target.clone().index_fill_(0, torch.tensor([3], device=device), V)
            )
        elif key == "weight":
            w = w[:, :5]
        elif key == "bias":
            kw["bias"] = b[:7]  # type: ignore[index]
        else:
            kw[key] = value
    with pytest.raises(ValueError, match=message):
        fused_linear_logprobs(h, w, target, **kw)


def test_output_type() -> None:
    assert LogProbsOutput._fields == ("logps", "entropy")


@pytest.mark.gpu
def test_no_host_synchronization() -> None:
    h, w, b = _inputs(300, torch.bfloat16, "cuda", seed=17, bias=True)
    target = _labels((300,), "cuda", seed=18)
    fused_linear_logprobs(h, w, target, bias=b).sum().backward()  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for budget in (ONE_CHUNK, SMALL_CHUNKS):
            out = fused_linear_logprobs(h, w, target, bias=b, return_entropy=True, memory_budget=budget)
            (out.logps.sum() + out.entropy.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_no_tokens(device: str) -> None:
    h, w, _ = _inputs(0, torch.float32, device, seed=19, bias=False)
    out = fused_linear_logprobs(h, w, torch.zeros(0, dtype=torch.long, device=device), return_entropy=True)
    assert out.logps.shape == (0,) and out.entropy.shape == (0,)
    (out.logps.sum() + out.entropy.sum()).backward()
    assert w.grad is not None and bool((w.grad == 0).all())


def test_int32_labels_equal_int64(device: str) -> None:
    h, w, _ = _inputs(9, torch.float32, device, seed=20, bias=False)
    target = _labels((9,), device, seed=21)
    torch.testing.assert_close(fused_linear_logprobs(h, w, target.int()), fused_linear_logprobs(h, w, target))


def test_property_shapes_dtypes_budgets(device: str) -> None:
    """Any token count and vocabulary size, any dtype, any number of chunks."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=8, deadline=None)
    @given(n=st.integers(1, 40), vocab=st.integers(1, 700), dtype=testing.strategies().dtypes,
           chunk_rows=st.integers(1, 48), temperature=st.sampled_from([1.0, 0.6, 1.7]))  # fmt: skip
    def check(n: int, vocab: int, dtype: torch.dtype, chunk_rows: int, temperature: float) -> None:
        h = testing.random_tensor((n, 8), dtype, device, seed=n, requires_grad=True)
        w = testing.random_tensor((vocab, 8), dtype, device, seed=vocab, scale=0.7, requires_grad=True)
        g = torch.Generator().manual_seed(n + vocab)
        target = torch.randint(0, vocab, (n,), generator=g)
        target[torch.rand(n, generator=g) < 0.3] = -100
        fk, ref = _pair(target.to(device), temperature=temperature, return_entropy=True,
                        memory_budget=chunk_rows * vocab * h.element_size())  # fmt: skip
        testing.compare_with_reference(lambda h, w: fk(h, w, None), lambda h, w: ref(h, w, None), [h, w])

    check()
