"""Distillation on the fused head against the full-logits reference in float64, TRL's
``generalized_jsd_loss`` and autograd: on the GPU where there is one, else in Triton's interpreter
(small vocabularies, V = 1003: not a power of two)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from fk.align import distill
from fk.align.budget import HEAD_DTYPE_SUM_CHUNKS
from fk.align.distill import (
    FORWARD_KL,
    JSD,
    REVERSE_KL,
    TVD,
    DistillOptions,
    LinearDistillLoss,
    distill_logits_grad_ref,
    distill_loss_ref,
    divergence_code,
    fused_linear_distill,
    fused_linear_distill_from_logits,
    fused_linear_distill_ref,
    launch_distill,
)
from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.flce import linear_cross_entropy

H, H_T, V = 24, 40, 1003  # the teacher's hidden size differs from the student's
ONE_CHUNK = 1 << 30
SMALL_CHUNKS = 6 * V * 8  # 6 tokens a chunk in fp32 (student and teacher logits), 12 in half precision

# (loss, beta): every divergence, and TRL's two special cases of the JSD.
DIVERGENCES = [("jsd", 0.5), ("jsd", 0.2), ("jsd", 0.0), ("jsd", 1.0), ("forward_kl", 0.5), ("reverse_kl", 0.5),
               ("tvd", 0.5)]  # fmt: skip
DIVERGENCE_IDS = [f"{loss}-{beta}" for loss, beta in DIVERGENCES]


def _labels(shape: tuple[int, ...], device: str, seed: int, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, shape, generator=g)
    t.view(-1)[::4] = -100
    return t.to(device)


class Head(NamedTuple):
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


def _heads(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    seed: int,
    *,
    bias: bool = False,
    vocab: int = V,
    hidden: int = H,
    teacher_hidden: int = H_T,
) -> tuple[Head, Head]:
    """(student, teacher): the student's leaves require grad; logits of spread about 3, so both
    distributions are peaked."""
    rand = testing.random_tensor
    student = Head(
        rand((*shape, hidden), dtype, device, seed=seed, requires_grad=True),
        rand((vocab, hidden), dtype, device, seed=seed + 1, scale=3 * hidden**-0.5, requires_grad=True),
        rand((vocab,), dtype, device, seed=seed + 2, requires_grad=True) if bias else None,
    )
    teacher = Head(
        rand((*shape, teacher_hidden), dtype, device, seed=seed + 3),
        rand((vocab, teacher_hidden), dtype, device, seed=seed + 4, scale=3 * teacher_hidden**-0.5),
        rand((vocab,), dtype, device, seed=seed + 5) if bias else None,
    )
    return student, teacher


def _fk(teacher: Head, target: torch.Tensor | None, **kw: Any) -> Callable[..., torch.Tensor]:
    def fk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, student_bias=b,
                                    teacher_bias=teacher.bias, **kw)  # fmt: skip

    return fk


def _ref(teacher: Head, target: torch.Tensor | None, **kw: Any) -> Callable[..., torch.Tensor]:
    """The reference on the student's dtype: the teacher cast along (float64 for the exact run)."""
    kw = {k: v for k, v in kw.items() if k not in ("memory_budget", "accum_dtype")}

    def ref(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        tb = teacher.bias.to(h.device, h.dtype) if teacher.bias is not None else None
        out = fused_linear_distill_ref(h, w, teacher.hidden.to(h.device, h.dtype), teacher.weight.to(h.device, h.dtype),
                                       target.to(h.device) if target is not None else None, student_bias=b,
                                       teacher_bias=tb, **kw)  # fmt: skip
        return out if out.dtype == torch.float64 else out.float()  # fk's loss is fp32 for every dtype

    return ref


def _compare(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, *, bias: bool = False,
             target: bool = True, **kw: Any) -> None:  # fmt: skip
    student, teacher = _heads(shape, dtype, device, seed, bias=bias)
    labels = _labels(shape, device, seed + 10) if target else None
    testing.compare_with_reference(_fk(teacher, labels, **kw), _ref(teacher, labels, **kw), list(student),
                                   arg_names=["student_hidden", "student_weight", "student_bias"])  # fmt: skip


# --- The backward math, and the kernel on its own --------------------------------------------------


def _logits(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    student = testing.random_tensor((n, V), torch.float32, "cpu", seed=seed, scale=3.0).to(dtype)
    teacher = testing.random_tensor((n, V), torch.float32, "cpu", seed=seed + 1, scale=3.0).to(dtype)
    return student, teacher


@pytest.mark.parametrize(("loss", "beta"), DIVERGENCES, ids=DIVERGENCE_IDS)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("weight_hard", [0.0, 0.4])
def test_closed_form_gradient_is_autograds(loss: str, beta: float, temperature: float, weight_hard: float) -> None:
    """The derivation above the kernel, checked: the closed forms of distill_logits_grad_ref equal
    autograd of the full-logits reference in float64."""
    student, teacher = _logits(6, torch.float64, seed=1)
    target = _labels((6,), "cpu", seed=2)
    options = DistillOptions(divergence_code(loss, beta), beta, temperature, -100, 0.7, weight_hard)
    rows, grad = distill_logits_grad_ref(student, teacher, target, options)
    x = student.clone().requires_grad_()
    total = distill_loss_ref(x, teacher, target, loss=loss, beta=beta, temperature=temperature, reduction="sum",
                             weight_soft_loss=0.7, weight_hard_loss=weight_hard)  # fmt: skip
    total.backward()
    torch.testing.assert_close(rows.sum(), total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-13)


TRANSFORMS = {"plain": (1.0, 0.0, 1.0, 0.0), "scaled_softcapped": (0.8, 4.0, 1.3, 5.0)}
"""(student scale, student softcap, teacher scale, teacher softcap): the heads' logit transforms."""


@pytest.mark.parametrize(("loss", "beta"), DIVERGENCES, ids=DIVERGENCE_IDS)
def test_closed_form_gradient_through_scale_and_softcap(loss: str, beta: float) -> None:
    student, teacher = _logits(5, torch.float64, seed=30)
    target = _labels((5,), "cpu", seed=31)
    transform = TRANSFORMS["scaled_softcapped"]
    options = DistillOptions(divergence_code(loss, beta), beta, 2.0, -100, 0.7, 0.4, *transform)
    rows, grad = distill_logits_grad_ref(student, teacher, target, options)
    x = student.clone().requires_grad_()
    total = distill_loss_ref(x, teacher, target, loss=loss, beta=beta, temperature=2.0, reduction="sum",
                             weight_soft_loss=0.7, weight_hard_loss=0.4, student_logit_scale=transform[0],
                             student_softcap=transform[1], teacher_logit_scale=transform[2],
                             teacher_softcap=transform[3])  # fmt: skip
    total.backward()
    torch.testing.assert_close(rows.sum(), total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-13)


def _check_kernel(device: str, divergence: int, dtype: torch.dtype, n: int, transform: str = "plain") -> None:
    student, teacher = _logits(n, dtype, seed=3)
    target = _labels((n,), "cpu", seed=4)
    options = DistillOptions(divergence, 0.3, 1.7, -100, 0.8, 0.25, *TRANSFORMS[transform])
    scale = torch.linspace(0.5, 2.0, n)
    want_rows, want_grad = distill_logits_grad_ref(student.double(), teacher.double(), target, options)
    base_rows, base_grad = distill_logits_grad_ref(student, teacher, target, options)
    rows = torch.empty(n, device=device)
    grad = student.to(device)
    launch_distill(grad, teacher.to(device), target.to(device), options, loss=rows, grad_scale=scale.to(device))
    testing.assert_close(rows, want_rows, base_rows, name="loss")
    testing.assert_close(grad, want_grad * scale[:, None], (base_grad * scale[:, None]).to(dtype), name="gradient")
    assert not grad[target.to(device) == -100].any(), "an ignored row's gradient must be 0"


@pytest.mark.parametrize("divergence", [FORWARD_KL, REVERSE_KL, JSD, TVD])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_kernel_matches_closed_form(device: str, divergence: int, dtype: torch.dtype, transform: str) -> None:
    """The kernel alone, on chunks of logits: its per-row loss and the gradient it writes over the
    student logits (one upstream gradient per row, a hard loss, an untempered log-sum-exp; the
    heads' scales and softcaps)."""
    _check_kernel(device, divergence, dtype, n=7, transform=transform)


@pytest.mark.parametrize("divergence", [FORWARD_KL, REVERSE_KL, JSD, TVD])
def test_kernel_loops_over_column_blocks_and_rows(
    device: str, divergence: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows wider than one load (the tiled loop over V, its last block partial: 1003 = 3 * 256 +
    235) and more rows than programs (each program strides over several)."""
    monkeypatch.setattr(distill, "LAUNCH", distill.LaunchParams(programs_per_sm=1, max_block=256, num_warps=4))
    _check_kernel(device, divergence, torch.float32, n=11 if device == "cpu" else 300)


# --- Against the reference: values and gradients of hidden, weight and bias ------------------------


@pytest.mark.parametrize(("loss", "beta"), DIVERGENCES, ids=DIVERGENCE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, loss: str, beta: float, dtype: torch.dtype) -> None:
    _compare((23,), dtype, device, seed=5, bias=True, loss=loss, beta=beta, temperature=2.0,
             memory_budget=SMALL_CHUNKS)  # fmt: skip


@pytest.mark.parametrize("tokens_a_chunk", [12, 2], ids=["head_dtype_sum", "fp32_sum"])
def test_weight_gradient_sum_in_either_dtype(device: str, tokens_a_chunk: int) -> None:
    """bf16 heads, ``accum_dtype=None``: 23 tokens in 2 chunks sum ``dW`` in bf16, in 12 chunks (more
    than ``fk.align.budget.HEAD_DTYPE_SUM_CHUNKS``) in fp32; both against the reference."""
    assert 2 <= HEAD_DTYPE_SUM_CHUNKS < 12
    _compare((23,), torch.bfloat16, device, seed=12, loss="jsd", beta=0.5, memory_budget=tokens_a_chunk * V * 4)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("budget", [ONE_CHUNK, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
def test_reductions(device: str, reduction: str, budget: int) -> None:
    _compare((3, 5), torch.float32, device, seed=6, loss="jsd", beta=0.4, reduction=reduction, memory_budget=budget)


@pytest.mark.parametrize("reduction", ["batchmean", "mean", "none"])
def test_without_target_every_token_counts(device: str, reduction: str) -> None:
    """batchmean without labels divides by the first dimension (the batch), as TRL and F.kl_div do."""
    _compare((2, 7), torch.float32, device, seed=7, target=False, loss="reverse_kl", reduction=reduction)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_ignored_rows_are_left_out_before_the_heads(
    device: str, reduction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``skip_ignored`` (the default): only the scored rows reach the op, and the loss and
    gradients are those of every row computed (and of the reference: every other test here)."""
    import fk.align.distill as module

    rows = testing.rows_reaching(monkeypatch, module, "_fused_linear_distill")
    student, teacher = _heads((3, 7), torch.float32, device, seed=13, bias=True)
    labels = _labels((3, 7), device, seed=14)

    def run(skip: bool) -> tuple[torch.Tensor, ...]:
        loss = fused_linear_distill(*student[:2], teacher.hidden, teacher.weight, labels, student_bias=student.bias,
                                    teacher_bias=teacher.bias, reduction=reduction, memory_budget=SMALL_CHUNKS,
                                    skip_ignored=skip)  # fmt: skip
        return (loss, *torch.autograd.grad(loss, list(student)))

    every, scored = run(False), run(True)
    assert rows == [21, int((labels != -100).sum())] and rows[1] < rows[0]
    for got, want in zip(scored, every, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [1, 2, 13])
def test_token_counts(device: str, n: int) -> None:
    _compare((n,), torch.float32, device, seed=8, loss="tvd", memory_budget=SMALL_CHUNKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_hard_loss_mixed_in_as_liger_does(device: str, dtype: torch.dtype) -> None:
    _compare((11,), dtype, device, seed=9, bias=True, loss="jsd", temperature=3.0, weight_soft_loss=0.5,
             weight_hard_loss=0.5, memory_budget=SMALL_CHUNKS)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize(("loss", "beta"), [("jsd", 0.5), ("reverse_kl", 0.5), ("tvd", 0.5)])
def test_logit_scale_and_softcap(device: str, dtype: torch.dtype, loss: str, beta: float) -> None:
    _compare((9,), dtype, device, seed=32, bias=True, loss=loss, beta=beta, temperature=1.5, weight_hard_loss=0.3,
             student_logit_scale=0.8, student_softcap=4.0, teacher_logit_scale=1.3, teacher_softcap=5.0,
             memory_budget=SMALL_CHUNKS)  # fmt: skip


def test_hard_loss_alone_is_fk_flce_cross_entropy(device: str) -> None:
    student, teacher = _heads((17,), torch.float32, device, seed=10, bias=True)
    h, w, b = student
    assert b is not None
    target = _labels((17,), device, seed=11)
    ours = fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, student_bias=b, weight_soft_loss=0.0,
                                weight_hard_loss=1.0, temperature=2.0)  # fmt: skip
    theirs = linear_cross_entropy(h, w, target, b)
    torch.testing.assert_close(ours, theirs)
    mine, flce = torch.autograd.grad(ours, [h, w, b]), torch.autograd.grad(theirs, [h, w, b])
    for a, e in zip(mine, flce, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_all_ignored_gives_zero_loss_and_gradients(device: str) -> None:
    student, teacher = _heads((9,), torch.float32, device, seed=12, bias=True)
    target = torch.full((9,), -100, device=device)
    leaves = [t for t in student if t is not None]
    for reduction in ("batchmean", "mean", "sum", "none"):
        out = _fk(teacher, target, reduction=reduction, memory_budget=SMALL_CHUNKS)(*student)
        grads = torch.autograd.grad(out.sum(), leaves)
        assert not out.any(), reduction
        assert all(not g.any() for g in grads), reduction


@pytest.mark.parametrize("reduction", ["batchmean", "mean", "sum", "none"])
@pytest.mark.parametrize("with_target", [True, False], ids=["target", "no_target"])
def test_zero_tokens(device: str, reduction: str, with_target: bool) -> None:
    student, teacher = _heads((0, 4), torch.float32, device, seed=28)
    target = torch.zeros((0, 4), dtype=torch.long, device=device) if with_target else None
    out = _fk(teacher, target, reduction=reduction)(*student)
    assert out.shape == ((0, 4) if reduction == "none" else ()) and not out.isnan().any()
    grads = torch.autograd.grad(out.sum(), [student.hidden, student.weight])
    assert grads[0].shape == (0, 4, H) and not grads[1].any()


def test_teacher_logits_variant_equals_teacher_head(device: str) -> None:
    """What TRL's GKD trainer passes (the teacher's logits), bf16 teacher under an fp32 student."""
    student, teacher = _heads((2, 6), torch.float32, device, seed=13)
    h, w = student.hidden, student.weight
    th, tw = teacher.hidden.to(torch.bfloat16), teacher.weight.to(torch.bfloat16)
    target = _labels((2, 6), device, seed=14)
    kw: dict[str, Any] = {"loss": "jsd", "beta": 0.7, "temperature": 0.5, "memory_budget": SMALL_CHUNKS}
    head = fused_linear_distill(h, w, th, tw, target, **kw)
    logits = fused_linear_distill_from_logits(h, w, th @ tw.t(), target, **kw)
    torch.testing.assert_close(logits, head)
    for a, e in zip(torch.autograd.grad(logits, [h, w]), torch.autograd.grad(head, [h, w]), strict=True):
        torch.testing.assert_close(a, e)


def test_teacher_gets_no_gradient_and_a_frozen_student_weight_none(device: str) -> None:
    student, teacher = _heads((5,), torch.float32, device, seed=15)
    h, w = student.hidden, student.weight.detach()
    th, tw = teacher.hidden.requires_grad_(), teacher.weight.requires_grad_()
    out = fused_linear_distill(h, w, th, tw, loss="forward_kl")
    out.backward()
    assert h.grad is not None and th.grad is None and tw.grad is None
    h_ref = h.detach().double().requires_grad_()
    fused_linear_distill_ref(h_ref, w.double(), th.double(), tw.double(), loss="forward_kl").backward()
    assert h_ref.grad is not None
    torch.testing.assert_close(h.grad, h_ref.grad.float(), rtol=1e-4, atol=1e-7)


def test_gradient_accumulation_with_num_items_equals_one_big_batch(device: str) -> None:
    student, teacher = _heads((12,), torch.float32, device, seed=16)
    h, w = student.hidden, student.weight
    target = _labels((12,), device, seed=17)
    n_items = int((target != -100).sum())
    whole = fused_linear_distill(h, w, teacher.hidden, teacher.weight, target)
    parts = [fused_linear_distill(h[rows], w, teacher.hidden[rows], teacher.weight, target[rows],
                                  num_items_in_batch=n_items) for rows in (slice(0, 5), slice(5, 12))]  # fmt: skip
    torch.testing.assert_close(parts[0] + parts[1], whole)
    whole_grads = torch.autograd.grad(whole, [h, w])
    parts_grads = torch.autograd.grad(parts[0] + parts[1], [h, w])
    for a, e in zip(parts_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, e)


def test_module(device: str) -> None:
    student, teacher = _heads((4,), torch.float32, device, seed=18)
    module = LinearDistillLoss(loss="reverse_kl", temperature=2.0)
    got = module(student.hidden, student.weight, teacher.hidden, teacher.weight)
    want = fused_linear_distill(student.hidden, student.weight, teacher.hidden, teacher.weight, loss="reverse_kl",
                                temperature=2.0)  # fmt: skip
    torch.testing.assert_close(got, want)
    assert "reverse_kl" in repr(module)
    with pytest.raises(TypeError, match="unknown option"):
        LinearDistillLoss(alpha=0.5)


def test_compile_matches_eager(device: str) -> None:
    student, teacher = _heads((10,), torch.float32, device, seed=19, bias=True)
    target = _labels((10,), device, seed=20)
    testing.assert_compile_matches_eager(
        lambda h, w, b: fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, student_bias=b,
                                             teacher_bias=teacher.bias, memory_budget=SMALL_CHUNKS) * 3.0,
        [t for t in student if t is not None],
    )  # fmt: skip


def test_compile_reduction_none(device: str) -> None:
    """Reduction "none": the backward recomputes both heads' logits, under torch.compile too."""
    student, teacher = _heads((9,), torch.float32, device, seed=25)
    target = _labels((9,), device, seed=26)
    row_weights = torch.arange(9, device=device, dtype=torch.float32)
    testing.assert_compile_matches_eager(
        lambda h, w: (fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, loss="tvd", reduction="none",
                                           memory_budget=SMALL_CHUNKS) * row_weights).sum(),
        [student.hidden, student.weight],
    )  # fmt: skip


def test_out_of_range_labels_unchecked_give_nan_with_a_hard_loss(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Labels outside [0, V), unchecked (on a GPU by default, everywhere with FK_CHECK_LABELS=0):
    with a hard loss, NaN loss and gradient for those tokens only, as fk-flce gives; without one
    the labels only mask, so any value but ignore_index is a scored token."""
    monkeypatch.setenv("FK_CHECK_LABELS", "0")
    student, teacher = _heads((6,), torch.float32, device, seed=27)
    h, w = student.hidden, student.weight
    target = torch.tensor([1, V, -100, -3, 2, V + 7], device=device)
    loss = fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, weight_hard_loss=0.5, reduction="none")
    assert torch.isfinite(loss[[0, 2, 4]]).all() and torch.isnan(loss[[1, 3, 5]]).all()
    (grad,) = torch.autograd.grad(loss, [h], torch.ones_like(loss))
    assert torch.isfinite(grad[[0, 2, 4]]).all() and torch.isnan(grad[[1, 3, 5]]).all()
    soft = fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, reduction="none")
    assert torch.isfinite(soft).all() and soft[2] == 0 and (soft[[0, 1, 3, 4, 5]] > 0).all()


# --- Against TRL's GKD trainer --------------------------------------------------------------------


# trl's imports warn: torch.jit's deprecation, and that trl.experimental may change.
TRL_IMPORT_WARNINGS = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:You are importing from 'trl")
# (fk-align's testing extra brings trl; a GPU machine without it skips these three)
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (fk-align[testing])")


@needs_trl
@TRL_IMPORT_WARNINGS
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_is_trls_generalized_jsd_loss(beta: float, temperature: float) -> None:
    from trl.experimental.gkd.gkd_trainer import GKDTrainer  # (fk-align's testing extra: trl)

    trl_jsd = GKDTrainer.generalized_jsd_loss
    student, teacher = _logits(12, torch.float64, seed=21)
    student, teacher = student.reshape(3, 4, V), teacher.reshape(3, 4, V)
    target = _labels((3, 4), "cpu", seed=22)
    kw: dict[str, Any] = {"beta": beta, "temperature": temperature}
    for reduction in ("batchmean", "sum", "mean"):
        for labels in (target, None):
            want = trl_jsd(student, teacher, labels=labels, reduction=reduction, **kw)
            got = distill_loss_ref(student, teacher, labels, reduction=reduction, **kw)
            torch.testing.assert_close(got, want, msg=f"{reduction}, labels {labels is not None}")
    want = trl_jsd(student, teacher, labels=target, num_items_in_batch=torch.tensor(20), **kw)
    torch.testing.assert_close(distill_loss_ref(student, teacher, target, num_items_in_batch=20, **kw), want)
    # "none": TRL keeps the per-class terms; summed over the vocabulary they are ours.
    want = trl_jsd(student, teacher, reduction="none", **kw).sum(-1)
    torch.testing.assert_close(distill_loss_ref(student, teacher, reduction="none", **kw), want)


@needs_trl
@TRL_IMPORT_WARNINGS
@pytest.mark.parametrize(("beta", "temperature"), [(0.0, 1.0), (0.5, 2.0), (1.0, 0.5), (0.25, 1.0)])
def test_kernel_matches_trl_on_logits(device: str, beta: float, temperature: float) -> None:
    """fk on a head whose logits are handed to TRL: value and the student hidden's gradient."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    student, teacher = _heads((2, 5), torch.float32, device, seed=23)
    h, w = student.hidden, student.weight
    target = _labels((2, 5), device, seed=24)
    got = fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, beta=beta, temperature=temperature,
                               memory_budget=SMALL_CHUNKS)  # fmt: skip
    h64 = h.detach().double().requires_grad_()
    teacher_logits = teacher.hidden.double() @ teacher.weight.double().t()
    want = GKDTrainer.generalized_jsd_loss(h64 @ w.detach().double().t(), teacher_logits, labels=target,
                                               beta=beta, temperature=temperature)  # fmt: skip
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(got, [h])
    want.backward()
    # The gradient reaches ~0.9 here: fp32's rounding of its largest terms is ~1e-7 absolute, which an
    # element near 0 cannot meet relatively (on an H200 one of 240 was 1.8e-7 off, 2e-7 of the largest).
    torch.testing.assert_close(grad.double(), h64.grad, rtol=1e-4, atol=1e-6)


@needs_trl
@TRL_IMPORT_WARNINGS
@pytest.mark.parametrize(("beta", "temperature"), [(0.0, 1.0), (0.4, 2.0), (1.0, 0.5)])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_matches_trls_fused_distillation_trainer_loss(device: str, beta: float, temperature: float,
                                                      transform: str) -> None:  # fmt: skip
    """TRL's own fused-head loss (``DistillationTrainer``'s ``_chunked_divergence_loss``: the
    completion mask is ``target != -100``, the sum divided by its count), values and gradients."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    student, teacher = _heads((2, 5), torch.float32, device, seed=33, bias=True)
    h, w, b = student
    assert b is not None
    target = _labels((2, 5), device, seed=34)
    s_scale, s_cap, t_scale, t_cap = TRANSFORMS[transform]
    want, _entropy, _count = _chunked_divergence_loss(
        h, teacher.hidden, w, teacher.weight, (target != -100).long(), beta, student_lm_head_bias=b,
        teacher_lm_head_bias=teacher.bias, student_logit_scale=s_scale, teacher_logit_scale=t_scale,
        student_final_logit_softcapping=s_cap or None, teacher_final_logit_softcapping=t_cap or None,
        temperature=temperature,
    )  # fmt: skip
    got = fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, student_bias=b, teacher_bias=teacher.bias,
                               beta=beta, temperature=temperature, student_logit_scale=s_scale,
                               student_softcap=s_cap or None, teacher_logit_scale=t_scale,
                               teacher_softcap=t_cap or None, memory_budget=SMALL_CHUNKS)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Two fp32 computations: equal to a few units of fp32 rounding of the largest gradient.
    for mine, theirs in zip(torch.autograd.grad(got, [h, w, b]), torch.autograd.grad(want, [h, w, b]), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * float(theirs.abs().max()))


# --- Bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss": "kl"}, ValueError, "loss must be one of"),
        ({"beta": 1.5}, ValueError, r"beta must be in \[0, 1\]"),
        ({"beta": -0.1}, ValueError, r"beta must be in \[0, 1\]"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be > 0"),
        ({"temperature": math.inf}, ValueError, "temperature must be finite"),
        ({"student_softcap": 0.0}, ValueError, "student_softcap must be > 0"),
        ({"teacher_logit_scale": -1.0}, ValueError, "teacher_logit_scale must be > 0"),
        ({"reduction": "max"}, ValueError, "reduction must be one of"),
        ({"student_weight": torch.zeros(7, 4)}, ValueError, r"student_weight must have shape \(V, 5\)"),
        ({"teacher_weight": torch.zeros(7, 5)}, ValueError, r"teacher_weight must have shape \(V, 6\)"),
        ({"teacher_weight": torch.zeros(8, 6)}, ValueError, "teacher_weight must have 7 rows"),
        ({"teacher_hidden": torch.zeros(4, 6)}, ValueError, "teacher_hidden must have shape"),
        ({"student_bias": torch.zeros(6)}, ValueError, "student_bias must have shape"),
        ({"teacher_bias": torch.zeros(6)}, ValueError, "teacher_bias must have shape"),
        ({"target": torch.zeros(4, dtype=torch.long)}, ValueError, "target must have shape"),
        ({"target": torch.zeros(3)}, TypeError, "target must have dtype"),
        ({"student_hidden": torch.zeros(3, 5, dtype=torch.int32)}, TypeError, "student_hidden must have dtype"),
        ({"teacher_weight": torch.zeros(7, 6, dtype=torch.float16)}, TypeError, "teacher_weight must have the dtype"),
        ({"weight_hard_loss": 0.5}, ValueError, "weight_hard_loss=0.5 needs target"),
        ({"weight_hard_loss": 0.5, "target": torch.full((3,), 7)}, ValueError, r"target\[0\] = 7 is outside"),
        ({"num_items_in_batch": 4, "reduction": "sum"}, ValueError, "num_items_in_batch .* needs reduction"),
        ({"memory_budget": 0}, ValueError, "memory_budget must be a positive"),
        ({"accum_dtype": torch.float16}, ValueError, "accum_dtype must be"),
        ({"skip_ignored": 1}, TypeError, "skip_ignored must be a bool"),
    ],
)
def test_bad_input_is_named(device: str, kwargs: dict[str, Any], error: type[Exception], match: str,
                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FK_CHECK_LABELS", "1")  # (labels are checked on CUDA only when asked)
    args: dict[str, Any] = {"student_hidden": torch.zeros(3, 5), "student_weight": torch.zeros(7, 5),
                            "teacher_hidden": torch.zeros(3, 6), "teacher_weight": torch.zeros(7, 6)}  # fmt: skip
    args.update(kwargs)
    args = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in args.items()}
    heads = [args.pop(k) for k in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")]
    with pytest.raises(error, match=match):
        fused_linear_distill(*heads, **args)


def test_bad_teacher_logits_shape_is_named(device: str) -> None:
    with pytest.raises(ValueError, match=r"teacher_logits must have shape \(3, 7\)"):
        fused_linear_distill_from_logits(torch.zeros(3, 5, device=device), torch.zeros(7, 5, device=device),
                                         torch.zeros(3, 8, device=device))  # fmt: skip


def test_reference_path_without_triton() -> None:
    testing.run_on_reference_path(
        "import torch\n"
        "from fk.align.distill import fused_linear_distill, fused_linear_distill_ref\n"
        "h = torch.randn(4, 8, requires_grad=True); w = torch.randn(11, 8)\n"
        "th = torch.randn(4, 6); tw = torch.randn(11, 6)\n"
        "got = fused_linear_distill(h, w, th, tw, loss='tvd')\n"
        "torch.testing.assert_close(got, fused_linear_distill_ref(h, w, th, tw, loss='tvd'))\n"
        "got.backward(); assert h.grad is not None\n"
        "print('ok')\n"
    )


# --- On a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize(("vocab", "loss"), [(128256, "jsd"), (128256, "tvd"), (262144, "reverse_kl")])
def test_large_vocabularies(dtype: torch.dtype, vocab: int, loss: str) -> None:
    """Llama 3's and Gemma 3's vocabularies: the kernel's loop over V, several chunks."""
    shape, beta = (257,), 0.5
    student, teacher = _heads(shape, dtype, "cuda", seed=40, bias=True, vocab=vocab, hidden=256, teacher_hidden=384)
    labels = _labels(shape, "cuda", seed=41, vocab=vocab)
    kw: dict[str, Any] = {"loss": loss, "beta": beta, "temperature": 2.0, "weight_hard_loss": 0.3,
                          "memory_budget": 1 << 27}  # fmt: skip
    testing.compare_with_reference(_fk(teacher, labels, **kw), _ref(teacher, labels, **kw), list(student),
                                   arg_names=["student_hidden", "student_weight", "student_bias"])  # fmt: skip


@pytest.mark.gpu
def test_no_host_synchronization() -> None:
    student, teacher = _heads((300,), torch.bfloat16, "cuda", seed=42, bias=True, vocab=5000, hidden=64)
    h, w, b = student
    target = _labels((300,), "cuda", seed=43, vocab=5000)

    def step(**kw: Any) -> None:
        fused_linear_distill(h, w, teacher.hidden, teacher.weight, target, student_bias=b, skip_ignored=False,
                             **kw).backward()  # fmt: skip

    step()  # compile and warm up first
    # Built before the check: copying a Python number to the GPU is itself a synchronizing copy.
    counts = (250, torch.tensor(250, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for budget in (1 << 30, 1 << 20):
            for loss in ("jsd", "forward_kl", "reverse_kl", "tvd"):
                step(loss=loss, memory_budget=budget, weight_hard_loss=0.5)
        for num_items in counts:
            step(num_items_in_batch=num_items)
        step(reduction="mean")
    finally:
        torch.cuda.set_sync_debug_mode("default")
