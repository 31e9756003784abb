"""Cross entropy on logits against its float64 reference and F.cross_entropy: on the GPU where there
is one, else in Triton's interpreter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fk.core import testing
from fk.core.backend import uses_kernel
from fk.core.testing import AWKWARD_ROWS, DTYPES, dtype_name
from fk.flce import CrossEntropyLoss, cross_entropy, cross_entropy_ref

# Triton's interpreter evaluates exp of -inf and large arguments in numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "class_weight": {"weight": True},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.25},
    "z_loss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 3.0},
    "everything": {"weight": True, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 5.0},
}


def _labels(n: int, vocab: int, device: str, seed: int, ignore_every: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::ignore_every] = -100
    return t.to(device)


def _class_weight(vocab: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(vocab, generator=g) + 0.5).to(device)


def _kwargs(option: str, vocab: int, device: str) -> dict[str, Any]:
    kw = dict(OPTIONS[option])
    if kw.pop("weight", False):
        kw["weight"] = _class_weight(vocab, device, seed=7)
    return kw


def _fk(kw: dict[str, Any], target: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: cross_entropy(x, target.to(x.device), **kw)


def _ref(kw: dict[str, Any], target: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def ref(x: torch.Tensor) -> torch.Tensor:
        moved = {k: (v.to(x.device, torch.float64 if x.dtype == torch.float64 else v.dtype) if torch.is_tensor(v) else v)
                 for k, v in kw.items()}  # fmt: skip
        return cross_entropy_ref(x, target.to(x.device), **moved).loss

    return ref


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_reference(device: str, dtype: torch.dtype, reduction: str, option: str) -> None:
    vocab, rows = 257, 33
    x = testing.random_tensor((rows, vocab), dtype, device, seed=1, scale=3.0, requires_grad=True)
    target = _labels(rows, vocab, device, seed=2)
    kw = {**_kwargs(option, vocab, device), "reduction": reduction}
    testing.compare_with_reference(_fk(kw, target), _ref(kw, target), [x])


@pytest.mark.parametrize("rows", AWKWARD_ROWS)
@pytest.mark.parametrize("vocab", [1, 3, 100, 1000, 5000])
def test_awkward_sizes(device: str, rows: int, vocab: int) -> None:
    x = testing.random_tensor((rows, vocab), torch.bfloat16, device, seed=rows + vocab, scale=2.0, requires_grad=True)
    target = _labels(rows, vocab, device, seed=3, ignore_every=4)
    kw = {"label_smoothing": 0.1, "lse_square_scale": 1e-3}
    testing.compare_with_reference(_fk(kw, target), _ref(kw, target), [x])


@pytest.mark.parametrize("option", ["plain", "smoothing", "class_weight", "weight_smoothing"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_functional(device: str, option: str, reduction: str) -> None:
    """Where F.cross_entropy has the option, fk agrees with it (fp32, tight)."""
    vocab, rows = 300, 17
    kw = {**_kwargs(option, vocab, device), "reduction": reduction}
    x = testing.random_tensor((rows, vocab), torch.float32, device, seed=4, scale=2.0, requires_grad=True)
    target = _labels(rows, vocab, device, seed=5)
    xr = x.detach().clone().requires_grad_()
    got, want = cross_entropy(x, target, **kw), F.cross_entropy(xr, target, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    dy = torch.rand_like(want)
    got.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-7)


def test_extra_outputs(device: str) -> None:
    vocab, rows = 130, 9
    x = testing.random_tensor((rows, vocab), torch.float32, device, seed=6, scale=3.0)
    target = _labels(rows, vocab, device, seed=7)
    target[1] = x[1].argmax()  # at least one correct prediction
    kw: dict[str, Any] = {"lse_square_scale": 1e-2, "softcap": 4.0, "label_smoothing": 0.1}
    out = cross_entropy(x, target, **kw, return_lse=True, return_z_loss=True, return_accuracy=True)
    ref = cross_entropy_ref(x, target, **kw)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.lse, ref.lse)
    torch.testing.assert_close(out.z_loss, ref.z_loss)
    torch.testing.assert_close(out.accuracy, ref.accuracy)
    assert out.accuracy[1] == 1.0 and out.accuracy[0] == 0.0  # row 0 is ignored
    only_loss = cross_entropy(x, target, **kw)
    assert isinstance(only_loss, torch.Tensor)
    torch.testing.assert_close(only_loss, out.loss)
    partial = cross_entropy(x, target, return_accuracy=True)
    assert partial.lse is None and partial.z_loss is None and partial.accuracy is not None


def test_accuracy_takes_first_of_tied_maxima(device: str) -> None:
    x = torch.zeros(2, 50, device=device)
    target = torch.tensor([0, 1], device=device)
    out = cross_entropy(x, target, return_accuracy=True)
    assert out.accuracy.tolist() == [1.0, 0.0]  # argmax of equal values is the first index, as torch.argmax


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero(device: str, reduction: str) -> None:
    x = testing.random_tensor((5, 40), torch.float32, device, seed=8, requires_grad=True)
    target = torch.full((5,), -100, device=device)
    loss = cross_entropy(x, target, reduction=reduction)
    assert torch.all(loss == 0)
    loss.sum().backward()
    assert x.grad is not None and torch.all(x.grad == 0)


def test_zero_tokens(device: str) -> None:
    x = torch.empty(0, 40, device=device, requires_grad=True)
    loss = cross_entropy(x, torch.empty(0, dtype=torch.long, device=device))
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad is not None and x.grad.shape == (0, 40)


@pytest.mark.parametrize("bad", [30, -1, 2**40], ids=["V", "minus_one", "huge"])
def test_label_out_of_range_raises_naming_position(bad: int) -> None:
    """On the CPU (interpreter and reference path alike) a bad label raises, as PyTorch does."""
    x = testing.random_tensor((4, 30), torch.float32, "cpu", seed=9, requires_grad=True)
    target = torch.tensor([1, -100, bad, 2])
    message = rf"^target\[2\] = {bad} is outside \[0, 30\) and is not ignore_index \(-100\)$"
    with pytest.raises(ValueError, match=message):
        cross_entropy(x, target)
    with pytest.raises(ValueError, match=r"target\[2\]"):
        CrossEntropyLoss()(x, target)
    cross_entropy(x, torch.tensor([1, 0, bad, 2]), ignore_index=bad)  # the same label is fine as ignore_index


def test_out_of_range_label_unchecked_gives_nan_for_that_token(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU run gives by default (FK_CHECK_LABELS=0 gives it everywhere): NaN for that token's
    loss and gradient, the others untouched, and no out-of-bounds access."""
    monkeypatch.setenv("FK_CHECK_LABELS", "0")
    x = testing.random_tensor((4, 30), torch.float32, device, seed=9, requires_grad=True)
    target = torch.tensor([1, 30, -5, 2], device=device)
    loss = cross_entropy(x, target, reduction="none")
    assert torch.isfinite(loss[[0, 3]]).all() and torch.isnan(loss[[1, 2]]).all()
    loss.backward(torch.ones_like(loss))
    assert x.grad is not None
    assert torch.isfinite(x.grad[[0, 3]]).all() and torch.isnan(x.grad[[1, 2]]).all()


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_out_of_range_label_with_class_weight_gives_nan(
    device: str, reduction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class weight is looked up by label: an unchecked out-of-range label must still give NaN
    (the documented result), not an index error (or, on a GPU, a device-side assert)."""
    monkeypatch.setenv("FK_CHECK_LABELS", "0")
    x = testing.random_tensor((4, 30), torch.float32, device, seed=9, requires_grad=True)
    target = torch.tensor([1, 30, -100, 2], device=device)
    weight = torch.linspace(0.5, 1.5, 30, device=device)
    for fn in (cross_entropy, lambda *a, **k: cross_entropy_ref(*a, **k).loss):
        loss = fn(x, target, weight, reduction=reduction)
        if reduction == "none":
            assert torch.isfinite(loss[[0, 2, 3]]).all() and torch.isnan(loss[1])
        else:
            assert torch.isnan(loss)


@pytest.mark.gpu
def test_fk_check_labels_raises_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    x = testing.random_tensor((4, 30), torch.float32, "cuda", seed=9, requires_grad=True)
    target = torch.tensor([1, -100, 30, 2], device="cuda")
    monkeypatch.delenv("FK_CHECK_LABELS", raising=False)
    assert torch.isnan(cross_entropy(x, target))  # by default: not checked, no host synchronization
    monkeypatch.setenv("FK_CHECK_LABELS", "1")
    with pytest.raises(ValueError, match=r"^target\[2\] = 30 is outside \[0, 30\)"):
        cross_entropy(x, target)


def test_compiled_call_skips_the_label_check(device: str) -> None:
    """The check depends on the labels' values: torch.compile(fullgraph=True) traces past it, and the
    compiled code gives NaN for a bad label, as a GPU run does by default."""
    x = testing.random_tensor((4, 30), torch.float32, device, seed=9)
    compiled = torch.compile(lambda x, t: cross_entropy(x, t, reduction="none"), fullgraph=True)
    loss = compiled(x, torch.tensor([1, -100, 30, 2], device=device))
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()


def test_ignore_index_inside_the_vocabulary(device: str) -> None:
    x = testing.random_tensor((6, 20), torch.float32, device, seed=10, requires_grad=True)
    target = torch.tensor([0, 3, 0, 5, 0, 7], device=device)
    testing.compare_with_reference(
        lambda x: cross_entropy(x, target.to(x.device), ignore_index=0),
        lambda x: cross_entropy_ref(x, target.to(x.device), ignore_index=0).loss,
        [x],
    )


def test_num_items_in_batch(device: str) -> None:
    x = testing.random_tensor((8, 20), torch.float32, device, seed=11, requires_grad=True)
    target = _labels(8, 20, device, seed=12)
    got = cross_entropy(x, target, num_items_in_batch=13)
    want = cross_entropy(x, target, reduction="sum") / 13
    torch.testing.assert_close(got, want)
    tensor_items = cross_entropy(x, target, num_items_in_batch=torch.tensor(13, device=device))
    torch.testing.assert_close(tensor_items, want)
    cpu_items = cross_entropy(x, target, num_items_in_batch=torch.tensor(13))  # as a data loader makes it
    torch.testing.assert_close(cpu_items, want)


def test_inplace_backward_writes_into_the_logits(device: str) -> None:
    x = testing.random_tensor((7, 300), torch.bfloat16, device, seed=13, scale=2.0)
    target = _labels(7, 300, device, seed=14)
    source = x.clone().requires_grad_()
    logits = source.clone()  # not a leaf: what a model's head returns
    cross_entropy(logits, target, inplace_backward=True).backward()
    want = x.clone().requires_grad_()
    cross_entropy(want, target).backward()
    assert source.grad is not None
    torch.testing.assert_close(source.grad, want.grad)
    torch.testing.assert_close(logits.detach(), want.grad)  # the gradient went over the logits' buffer


def test_inplace_backward_refuses_a_leaf_and_guards_saved_logits(device: str) -> None:
    x = testing.random_tensor((7, 300), torch.float32, device, seed=13, scale=2.0)
    target = _labels(7, 300, device, seed=14)
    with pytest.raises(ValueError, match="inplace_backward=True cannot overwrite logits: it is a leaf"):
        cross_entropy(x.clone().requires_grad_(), target, inplace_backward=True)
    # tanh saves its output for its backward: writing the gradient over it must raise, not mislead
    logits = torch.tanh(x.clone().requires_grad_())
    loss = cross_entropy(logits, target, inplace_backward=True)
    if uses_kernel(logits):  # (the reference path writes nothing in place)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("layout", ["row_stride", "transposed"])
def test_strided_logits(device: str, layout: str) -> None:
    base = testing.random_tensor((9, 400), torch.float32, device, seed=15, scale=2.0)
    x = base[:, :130] if layout == "row_stride" else base[:, :130].t().contiguous().t()
    x.requires_grad_()
    target = _labels(9, 130, device, seed=16)
    testing.compare_with_reference(_fk({}, target), _ref({}, target), [x])


def test_options_after_weight_are_keyword_only(device: str) -> None:
    """F.cross_entropy(input, target, weight, size_average, ignore_index, ...): a positional call
    written for it must fail here, not bind size_average to ignore_index."""
    x = testing.random_tensor((3, 10), torch.float32, device, seed=20)
    target = torch.tensor([1, 2, 3], device=device)
    with pytest.raises(TypeError, match="positional"):
        cross_entropy(x, target, None, True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        CrossEntropyLoss(None, True)  # type: ignore[call-arg]


def test_module_matches_torch_module(device: str) -> None:
    weight = _class_weight(50, device, seed=17)
    ours = CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = testing.random_tensor((6, 50), torch.float32, device, seed=18, requires_grad=True)
    target = _labels(6, 50, device, seed=19)
    torch.testing.assert_close(ours(x, target), theirs(x, target), rtol=1e-5, atol=1e-6)


def test_compile_matches_eager(device: str) -> None:
    x = testing.random_tensor((5, 70), torch.float32, device, seed=20, requires_grad=True)
    target = _labels(5, 70, device, seed=21)
    testing.assert_compile_matches_eager(
        lambda x: cross_entropy(x, target, label_smoothing=0.1, softcap=4.0) * 2.0, [x]
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logits": "no"}, TypeError, "logits must be a torch.Tensor"),
        ({"logits": torch.zeros(3, 4, dtype=torch.int32)}, TypeError, "logits must have dtype"),
        ({"logits": torch.zeros(3)}, ValueError, "logits must have 2"),
        ({"logits": torch.zeros(3, 0)}, ValueError, "at least one class"),
        ({"target": torch.zeros(3)}, TypeError, "target must have dtype"),
        ({"target": torch.zeros(4, dtype=torch.long)}, ValueError, "target must have shape"),
        ({"weight": torch.ones(5)}, ValueError, "weight must have shape"),
        ({"reduction": "avg"}, ValueError, "reduction must be one of"),
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing must be in"),
        ({"lse_square_scale": -1.0}, ValueError, "lse_square_scale must be >= 0"),
        ({"softcap": 0.0}, ValueError, "softcap must be > 0"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
        ({"num_items_in_batch": 0}, ValueError, "num_items_in_batch must be a positive"),
        ({"num_items_in_batch": 3, "reduction": "sum"}, ValueError, "needs reduction='mean'"),
    ],
)
def test_bad_input_is_named(device: str, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"logits": torch.zeros(3, 4), "target": torch.zeros(3, dtype=torch.long)}
    args.update(kwargs)
    args = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in args.items()}
    logits, target = args.pop("logits"), args.pop("target")
    with pytest.raises(error, match=match):
        cross_entropy(logits, target, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_llama3_vocabulary(dtype: torch.dtype) -> None:
    vocab, rows = 128256, 33
    x = testing.random_tensor((rows, vocab), dtype, "cuda", seed=22, scale=3.0, requires_grad=True)
    target = _labels(rows, vocab, "cuda", seed=23)
    kw = {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0}
    testing.compare_with_reference(_fk(kw, target), _ref(kw, target), [x])


def test_reference_path_without_triton() -> None:
    testing.run_on_reference_path(
        "import torch\n"
        "from fk.flce import cross_entropy\n"
        "x = torch.randn(4, 10, requires_grad=True)\n"
        "t = torch.tensor([1, 2, -100, 3])\n"
        "got = cross_entropy(x, t, label_smoothing=0.1)\n"
        "want = torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1)\n"
        "assert torch.allclose(got, want), (got, want)\n"
        "got.backward()\n"
        "try:\n"
        "    cross_entropy(x, torch.tensor([1, 2, 10, 3]))\n"
        "except ValueError as e:\n"
        "    assert str(e).startswith('target[2] = 10 is outside [0, 10)'), e\n"
        "else:\n"
        "    raise AssertionError('a bad label did not raise')\n"
        "print('ok')\n"
    )
