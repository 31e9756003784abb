"""Fused linear + cross entropy against eager F.linear + cross entropy in float64: on the GPU where
there is one, else in Triton's interpreter (small vocabularies)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.flce import LinearCrossEntropyLoss, linear_cross_entropy, linear_cross_entropy_ref
from fk.flce.linear_cross_entropy import chunk_tokens_for

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

H, V = 24, 300
ONE_CHUNK = 1 << 30  # every test size fits one chunk: the weight gradient is left to the backward
SMALL_CHUNKS = 10 * V * 4  # 10 tokens (fp32) or 20 (half) per chunk: the fp32 accumulator path

OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "smoothing_weight": {"label_smoothing": 0.1, "class_weight": True},
    "z_loss_softcap": {"lse_square_scale": 1e-3, "softcap": 5.0},
}


def _labels(shape: tuple[int, ...], device: str, seed: int, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, shape, generator=g)
    t.view(-1)[::5] = -100
    return t.to(device)


def _inputs(
    n: int, dtype: torch.dtype, device: str, seed: int, *, bias: bool = False, vocab: int = V, hidden: int = H
) -> list[torch.Tensor | None]:
    h = testing.random_tensor((n, hidden), dtype, device, seed=seed, requires_grad=True)
    w = testing.random_tensor((vocab, hidden), dtype, device, seed=seed + 1, scale=hidden**-0.5 * 3, requires_grad=True)
    b = testing.random_tensor((vocab,), dtype, device, seed=seed + 2, requires_grad=True) if bias else None
    return [h, w, b]


def _options(option: str, device: str) -> dict[str, Any]:
    kw = dict(OPTIONS[option])
    if kw.pop("class_weight", False):
        g = torch.Generator().manual_seed(3)
        kw["class_weight"] = (torch.rand(V, generator=g) + 0.5).to(device)
    return kw


def _fk(target: torch.Tensor, **kw: Any) -> Callable[..., torch.Tensor]:
    return lambda h, w, b: linear_cross_entropy(h, w, target.to(h.device), b, **kw)


def _ref(target: torch.Tensor, **kw: Any) -> Callable[..., torch.Tensor]:
    def ref(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        moved = {k: (v.to(h.device, torch.float64 if h.dtype == torch.float64 else v.dtype) if torch.is_tensor(v) else v)
                 for k, v in kw.items() if k not in ("memory_budget", "accum_dtype")}  # fmt: skip
        out = linear_cross_entropy_ref(h, w, target.to(h.device), b, **moved).loss
        return out if out.dtype == torch.float64 else out.float()  # fk's loss is fp32 for every dtype

    return ref


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("budget", [ONE_CHUNK, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_reference(device: str, dtype: torch.dtype, reduction: str, budget: int, option: str) -> None:
    n = 37
    args = _inputs(n, dtype, device, seed=1, bias=option == "plain")
    target = _labels((n,), device, seed=2)
    kw = {**_options(option, device), "reduction": reduction, "memory_budget": budget}
    testing.compare_with_reference(_fk(target, **kw), _ref(target, **kw), args)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_token_counts(device: str, n: int) -> None:
    args = _inputs(n, torch.bfloat16, device, seed=n, bias=True)
    target = _labels((n,), device, seed=4)
    target[0] = 5  # at least one token counts
    kw = {"memory_budget": SMALL_CHUNKS}
    testing.compare_with_reference(_fk(target, **kw), _ref(target, **kw), args)


@pytest.mark.parametrize("vocab", [1, 17, 1000])
def test_vocabulary_sizes(device: str, vocab: int) -> None:
    args = _inputs(9, torch.float32, device, seed=5, vocab=vocab)
    target = _labels((9,), device, seed=6, vocab=vocab)
    testing.compare_with_reference(_fk(target), _ref(target), args)


def test_accumulation_in_weight_dtype(device: str) -> None:
    """accum_dtype=bf16 rounds the weight gradient once per chunk: close, but looser than fp32."""
    args = _inputs(61, torch.bfloat16, device, seed=7)
    target = _labels((61,), device, seed=8)
    kw = {"memory_budget": SMALL_CHUNKS, "accum_dtype": torch.bfloat16}
    testing.compare_with_reference(_fk(target, **kw), _ref(target, **kw), args, factor=4.0)


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_upstream_gradient_of_one(device: str, accum_dtype: torch.dtype) -> None:
    """A plain ``loss.backward()`` (upstream gradient exactly 1): the in-place scaling of the
    gradients made in the forward is skipped on the device; they must still be the reference's."""
    n = 61
    target = _labels((n,), device, seed=8)
    kw = {"memory_budget": SMALL_CHUNKS, "accum_dtype": accum_dtype}
    fk_args = [a for a in _inputs(n, torch.bfloat16, device, seed=7, bias=True) if a is not None]
    ref_args = [a.detach().cpu().double().requires_grad_() for a in fk_args]
    _fk(target, **kw)(*fk_args).backward()
    _ref(target, **kw)(*ref_args).backward()
    for name, fk_arg, ref_arg in zip(("h", "w", "b"), fk_args, ref_args, strict=True):
        assert fk_arg.grad is not None and ref_arg.grad is not None
        expected = ref_arg.grad.float()
        error = (fk_arg.grad.float().cpu() - expected).abs().max().item()
        assert error <= 0.05 * expected.abs().max().item(), (name, error)


@pytest.mark.parametrize("budget", [ONE_CHUNK, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
def test_frozen_weight_computes_no_weight_gradient(device: str, budget: int) -> None:
    n = 40
    h, w, _ = _inputs(n, torch.bfloat16, device, seed=9)
    assert w is not None and h is not None
    w.requires_grad_(False)
    target = _labels((n,), device, seed=10)
    loss = linear_cross_entropy(h, w, target, memory_budget=budget)
    sizes = testing.allocation_sizes(lambda: loss.backward())
    assert w.grad is None and h.grad is not None
    for n_bytes in (V * H * 4, V * H * 2):  # no weight-sized buffer, fp32 or bf16
        assert testing.count_buffers(sizes, n_bytes, device) == 0, sizes
    testing.compare_with_reference(_fk(target, memory_budget=budget), _ref(target), [h, w, None])


def test_frozen_weight_forward_allocates_no_weight_buffer(device: str) -> None:
    h, w, _ = _inputs(40, torch.bfloat16, device, seed=11)
    assert w is not None
    w.requires_grad_(False)
    target = _labels((40,), device, seed=12)
    sizes = testing.allocation_sizes(lambda: linear_cross_entropy(h, w, target, memory_budget=SMALL_CHUNKS))
    assert testing.count_buffers(sizes, V * H * 4, device) == 0, sizes
    w.requires_grad_(True)
    sizes = testing.allocation_sizes(lambda: linear_cross_entropy(h, w, target, memory_budget=SMALL_CHUNKS))
    assert testing.count_buffers(sizes, V * H * 4, device) == 1, sizes  # the check can see the accumulator


def test_chunks_are_balanced_and_aligned_within_the_budget() -> None:
    """With the token count known, chunks of equal size in whole multiples of CHUNK_ALIGN where the
    budget allows (never more chunks, never over the budget); else the budget's own size."""
    vocab, mib = 128256, 1 << 20
    assert chunk_tokens_for(256 * mib, vocab, 2) == 1040  # the budget alone: 1046 rounded down to 8
    for budget, n, want in [(256, 8192, 1024), (512, 8192, 2048), (1024, 8192, 4096), (256, 1000, 1040),
                            (256, 8000, 1024), (256, 1041, 640), (256, 100000, 1040)]:  # fmt: skip
        got = chunk_tokens_for(budget * mib, vocab, 2, n)
        most = chunk_tokens_for(budget * mib, vocab, 2)
        assert got == want, (budget, n, got)
        assert got <= most and -(-n // got) == -(-n // most)  # within the budget, no more chunks


def test_one_logits_buffer_serves_every_chunk(device: str) -> None:
    """Memory is bounded by one chunk of logits, not two: the chunks share one buffer."""
    n = 61
    chunk = chunk_tokens_for(SMALL_CHUNKS, V, 4)
    assert n > 3 * chunk
    h, w, _ = _inputs(n, torch.float32, device, seed=40)
    target = _labels((n,), device, seed=41)
    sizes = testing.allocation_sizes(lambda: linear_cross_entropy(h, w, target, memory_budget=SMALL_CHUNKS))
    assert testing.count_buffers(sizes, chunk * V * 4, device) == 1, sizes


def test_frozen_hidden(device: str) -> None:
    h, w, b = _inputs(20, torch.float32, device, seed=13, bias=True)
    assert h is not None
    h.requires_grad_(False)
    target = _labels((20,), device, seed=14)
    linear_cross_entropy(h, w, target, b).backward()
    assert h.grad is None
    testing.compare_with_reference(_fk(target), _ref(target), [h, w, b])


def test_no_grad_computes_loss_only(device: str) -> None:
    h, w, _ = _inputs(20, torch.float32, device, seed=15)
    target = _labels((20,), device, seed=16)
    with torch.no_grad():
        got = linear_cross_entropy(h, w, target)
    want = linear_cross_entropy_ref(h.detach(), w.detach(), target).loss  # type: ignore[union-attr]
    torch.testing.assert_close(got, want)


def test_shift_matches_hugging_face_causal_lm_loss(device: str) -> None:
    """shift=True on (B, T, H) equals the loss of logits[:, :-1] against labels[:, 1:]."""
    b, t = 3, 11
    h = testing.random_tensor((b, t, H), torch.float32, device, seed=17, requires_grad=True)
    w = testing.random_tensor((V, H), torch.float32, device, seed=18, requires_grad=True)
    labels = _labels((b, t), device, seed=19)
    got = linear_cross_entropy(h, w, labels, shift=True)
    hr, wr = (x.detach().double().requires_grad_() for x in (h, w))
    logits = F.linear(hr, wr)[:, :-1].reshape(-1, V)
    want = F.cross_entropy(logits, labels[:, 1:].reshape(-1))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-4, atol=1e-7)


def test_gradient_accumulation_with_num_items_equals_one_big_batch(device: str) -> None:
    h, w, _ = _inputs(30, torch.float32, device, seed=20)
    assert h is not None and w is not None
    target = _labels((30,), device, seed=21)
    items = int((target != -100).sum())
    big = linear_cross_entropy(h, w, target)
    big.backward()
    grads = (h.grad.clone(), w.grad.clone())  # type: ignore[union-attr]
    h.grad = w.grad = None
    total = sum(
        linear_cross_entropy(h[s], w, target[s], num_items_in_batch=items, memory_budget=SMALL_CHUNKS)
        for s in (slice(0, 11), slice(11, 30))
    )
    total.backward()  # type: ignore[union-attr]
    torch.testing.assert_close(total, big)
    torch.testing.assert_close(h.grad, grads[0])
    torch.testing.assert_close(w.grad, grads[1])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_and_zero_tokens(device: str, reduction: str) -> None:
    for n in (0, 6):
        h, w, b = _inputs(n, torch.float32, device, seed=22, bias=True)
        assert h is not None and w is not None and b is not None
        target = torch.full((n,), -100, device=device)
        loss = linear_cross_entropy(h, w, target, b, reduction=reduction)
        assert torch.all(loss == 0)
        loss.sum().backward()
        for p in (h, w, b):
            assert p.grad is not None and torch.all(p.grad == 0), n


@pytest.mark.parametrize("bad", [V, -1, 2**40], ids=["V", "minus_one", "huge"])
def test_label_out_of_range_raises_naming_position(bad: int) -> None:
    h = testing.random_tensor((2, 8, H), torch.float32, "cpu", seed=40, requires_grad=True)
    w = testing.random_tensor((V, H), torch.float32, "cpu", seed=41, requires_grad=True)
    target = _labels((2, 8), "cpu", seed=42)
    target[1, 7] = bad
    message = rf"^target\[1, 7\] = {bad} is outside \[0, {V}\) and is not ignore_index \(-100\)$"
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(h, w, target)
    with pytest.raises(ValueError, match=message):
        LinearCrossEntropyLoss()(h, w, target)


def test_shift_reports_the_position_in_the_labels_as_given() -> None:
    """With shift=True the error names the label in ``target`` as passed (not in the shifted copy);
    the first label of each sequence is never scored, so it is not checked either."""
    h = testing.random_tensor((2, 8, H), torch.float32, "cpu", seed=43, requires_grad=True)
    w = testing.random_tensor((V, H), torch.float32, "cpu", seed=44, requires_grad=True)
    target = _labels((2, 8), "cpu", seed=45)
    target[1, 5] = V + 1
    with pytest.raises(ValueError, match=rf"^target\[1, 5\] = {V + 1} is outside \[0, {V}\)"):
        linear_cross_entropy(h, w, target, shift=True)
    target[1, 5] = 3
    target[1, 0] = V + 1  # dropped by the shift, as Hugging Face's causal-LM loss drops it
    assert torch.isfinite(linear_cross_entropy(h, w, target, shift=True))


@pytest.mark.gpu
def test_fk_check_labels_raises_on_cuda_and_otherwise_gives_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    h, w, b = _inputs(16, torch.bfloat16, "cuda", seed=46, bias=True)
    target = _labels((2, 8), "cuda", seed=47)
    target[1, 3] = V
    h3 = h.detach().reshape(2, 8, H).requires_grad_()
    monkeypatch.delenv("FK_CHECK_LABELS", raising=False)
    loss = linear_cross_entropy(h3, w, target, b, shift=True)  # unchecked: no host synchronization
    loss.backward()
    assert torch.isnan(loss) and h3.grad is not None and torch.isnan(h3.grad[1, 2]).all()
    assert torch.isfinite(h3.grad[0]).all()
    monkeypatch.setenv("FK_CHECK_LABELS", "1")
    with pytest.raises(ValueError, match=rf"^target\[1, 3\] = {V} is outside \[0, {V}\)"):
        linear_cross_entropy(h3, w, target, b, shift=True)


@pytest.mark.parametrize("class_weight", [False, True], ids=["unweighted", "class_weight"])
def test_out_of_range_labels_unchecked_give_nan_for_their_tokens(
    device: str, class_weight: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Labels outside [0, V) other than ignore_index, unchecked (on a GPU by default, everywhere
    with FK_CHECK_LABELS=0): NaN loss and gradient for those tokens only, never an error or an
    out-of-bounds access."""
    monkeypatch.setenv("FK_CHECK_LABELS", "0")
    h, w, _ = _inputs(6, torch.float32, device, seed=40)
    target = torch.tensor([1, V, -100, -3, 2, V + 7], device=device)
    weight = torch.linspace(0.5, 1.5, V, device=device) if class_weight else None
    loss = linear_cross_entropy(h, w, target, class_weight=weight, reduction="none")
    assert torch.isfinite(loss[[0, 2, 4]]).all() and torch.isnan(loss[[1, 3, 5]]).all()
    loss.backward(torch.ones_like(loss))
    assert h.grad is not None and torch.isfinite(h.grad[[0, 2, 4]]).all() and torch.isnan(h.grad[[1, 3, 5]]).all()
    assert torch.isnan(linear_cross_entropy(h, w, target, class_weight=weight))  # the mean


def test_ignore_index_other_than_minus_100(device: str) -> None:
    h, w, _ = _inputs(30, torch.float32, device, seed=41)
    target = _labels((30,), device, seed=42)
    target[target == -100] = 7  # class 7 is the ignored one now
    kw = {"ignore_index": 7, "label_smoothing": 0.1, "memory_budget": SMALL_CHUNKS}
    testing.compare_with_reference(_fk(target, **kw), _ref(target, **kw), [h, w, None])


@pytest.mark.parametrize("budget", [ONE_CHUNK, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
def test_second_backward_raises(device: str, budget: int) -> None:
    """The backward scales the gradients made in the forward in place: a second backward through
    the same loss must raise (as documented), not return scaled-twice gradients."""
    h, w, _ = _inputs(30, torch.float32, device, seed=43)
    loss = linear_cross_entropy(h, w, _labels((30,), device, seed=44), memory_budget=budget)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_extra_outputs(device: str) -> None:
    h, w, _ = _inputs(2 * 13, torch.float32, device, seed=23)
    assert h is not None and w is not None
    h3 = h.detach().reshape(2, 13, H)
    target = _labels((2, 13), device, seed=24)
    kw: dict[str, Any] = {"lse_square_scale": 1e-3, "shift": True}
    out = linear_cross_entropy(h3, w, target, return_lse=True, return_z_loss=True, return_accuracy=True, **kw)
    ref = linear_cross_entropy_ref(h3, w.detach(), target, **kw)
    assert out.lse.shape == (2, 13) and out.accuracy.shape == (2, 13)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.lse, ref.lse)
    torch.testing.assert_close(out.z_loss, ref.z_loss)
    torch.testing.assert_close(out.accuracy, ref.accuracy)


def test_strided_hidden(device: str) -> None:
    base = testing.random_tensor((16, 2 * H), torch.float32, device, seed=25)
    h = base[:, ::2].requires_grad_()  # column stride 2: copied inside, never outside the op
    w = testing.random_tensor((V, H), torch.float32, device, seed=26, requires_grad=True)
    target = _labels((16,), device, seed=27)
    testing.compare_with_reference(_fk(target), _ref(target), [h, w, None])


def test_module(device: str) -> None:
    h, w, _ = _inputs(12, torch.float32, device, seed=28)
    target = _labels((12,), device, seed=29)
    module = LinearCrossEntropyLoss(label_smoothing=0.1, memory_budget=SMALL_CHUNKS)
    torch.testing.assert_close(module(h, w, target), linear_cross_entropy(h, w, target, label_smoothing=0.1))
    assert "label_smoothing=0.1" in repr(module)
    with pytest.raises(TypeError, match="unknown option"):
        LinearCrossEntropyLoss(smoothing=0.1)


@pytest.mark.parametrize("budget", [ONE_CHUNK, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
def test_compile_matches_eager(device: str, budget: int) -> None:
    h, w, b = _inputs(13, torch.float32, device, seed=30, bias=True)
    target = _labels((13,), device, seed=31)
    testing.assert_compile_matches_eager(
        lambda h, w, b: linear_cross_entropy(h, w, target, b, softcap=5.0, memory_budget=budget) * 3.0, [h, w, b]
    )


def test_compile_reduction_none(device: str) -> None:
    h, w, _ = _inputs(9, torch.float32, device, seed=32)
    target = _labels((9,), device, seed=33)
    testing.assert_compile_matches_eager(
        lambda h, w: (linear_cross_entropy(h, w, target, reduction="none") * torch.arange(9, device=h.device)).sum(),
        [h, w],
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hidden": torch.zeros(3, 5, dtype=torch.int32)}, TypeError, "hidden must have dtype"),
        ({"weight": torch.zeros(7, 5, dtype=torch.float16)}, TypeError, "weight must have the dtype of hidden"),
        ({"weight": torch.zeros(7, 4)}, ValueError, r"weight must have shape \(V, 5\)"),
        ({"weight": torch.zeros(7)}, ValueError, "weight must have 2"),
        ({"bias": torch.zeros(6)}, ValueError, "bias must have shape"),
        ({"target": torch.zeros(4, dtype=torch.long)}, ValueError, "target must have shape"),
        ({"target": torch.zeros(3)}, TypeError, "target must have dtype"),
        ({"class_weight": torch.ones(3)}, ValueError, "class_weight must have shape"),
        ({"accum_dtype": torch.float16}, ValueError, "accum_dtype must be"),
        ({"memory_budget": 0}, ValueError, "memory_budget must be a positive"),
        ({"hidden": torch.zeros(5), "target": torch.zeros((), dtype=torch.long), "shift": True}, ValueError, "shift"),
        ({"reduction": "max"}, ValueError, "reduction must be one of"),
    ],
)
def test_bad_input_is_named(device: str, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"hidden": torch.zeros(3, 5), "weight": torch.zeros(7, 5),
                            "target": torch.zeros(3, dtype=torch.long)}  # fmt: skip
    args.update(kwargs)
    args = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in args.items()}
    hidden, weight, target = args.pop("hidden"), args.pop("weight"), args.pop("target")
    with pytest.raises(error, match=match):
        linear_cross_entropy(hidden, weight, target, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("budget", [1 << 32, 1 << 26], ids=["one_chunk", "chunks"])
def test_llama3_vocabulary(dtype: torch.dtype, budget: int) -> None:
    n, hidden, vocab = 517, 256, 128256
    args = _inputs(n, dtype, "cuda", seed=34, vocab=vocab, hidden=hidden)
    target = _labels((n,), "cuda", seed=35, vocab=vocab)
    kw = {"memory_budget": budget, "label_smoothing": 0.05, "softcap": 30.0}
    testing.compare_with_reference(_fk(target, **kw), _ref(target, **kw), args)


@pytest.mark.gpu
def test_no_host_synchronization() -> None:
    h, w, b = _inputs(300, torch.bfloat16, "cuda", seed=36, bias=True, vocab=5000, hidden=64)
    target = _labels((300,), "cuda", seed=37, vocab=5000)
    linear_cross_entropy(h, w, target, b).backward()  # compile and warm up first
    # Built before the check: copying a Python number to the GPU is itself a synchronizing copy.
    counts = (250, 250.0, torch.tensor(250), torch.tensor(250, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for budget in (1 << 30, 1 << 20):
            linear_cross_entropy(h, w, target, b, memory_budget=budget, label_smoothing=0.1).backward()
        for num_items in counts:
            linear_cross_entropy(h, w, target, b, num_items_in_batch=num_items).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_reference_path_without_triton() -> None:
    testing.run_on_reference_path(
        "import torch\n"
        "from fk.flce import linear_cross_entropy\n"
        "h = torch.randn(6, 8, requires_grad=True)\n"
        "w = torch.randn(11, 8, requires_grad=True)\n"
        "t = torch.tensor([1, 2, -100, 3, 4, 5])\n"
        "got = linear_cross_entropy(h, w, t)\n"
        "want = torch.nn.functional.cross_entropy(h @ w.t(), t)\n"
        "assert torch.allclose(got, want), (got, want)\n"
        "got.backward()\n"
        "# bf16 inputs: the loss in fp32 (as the kernel path returns it), not rounded to bf16\n"
        "hb, wb = h.detach().bfloat16(), w.detach().bfloat16()\n"
        "out = linear_cross_entropy(hb, wb, t, reduction='none', return_z_loss=True)\n"
        "assert out.loss.dtype == out.z_loss.dtype == torch.float32, out\n"
        "got = linear_cross_entropy(hb, wb, t)\n"
        "want = torch.nn.functional.cross_entropy((hb @ wb.t()).float(), t)\n"
        "assert got.dtype == torch.float32 and torch.allclose(got, want), (got, want)\n"
        "print('ok')\n"
    )
