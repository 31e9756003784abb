"""Distillation losses on the fused LM head: a student learns a frozen teacher's next-token
distribution without either model's ``[tokens, vocab]`` logits.

- :func:`fused_linear_distill` / :class:`LinearDistillLoss`: student head against teacher head
  (hidden states and LM-head weights of both; the hidden sizes may differ, the vocabulary not).
- :func:`fused_linear_distill_from_logits`: student head against the teacher's logits, as TRL's
  GKD trainer has them (only the student's logits are then spared).
- :func:`fused_linear_distill_ref` / :func:`distill_loss_ref`: the plain PyTorch definitions.

Per token, with temperature T, student logits ``x`` and teacher logits ``y`` (V classes), the
tempered log-probabilities ``log p_s = log_softmax(x / T)`` and ``log p_t = log_softmax(y / T)``,
the divergence ``loss=`` is one of (TRL's ``GKDTrainer.generalized_jsd_loss`` and Liger Kernel's
``LigerFusedLinearJSDLoss`` define the first three the same way)::

    "forward_kl":  KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)
    "reverse_kl":  KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)
    "jsd":         beta KL(p_t || m) + (1 - beta) KL(p_s || m),   m = beta p_t + (1 - beta) p_s
                   (generalized JSD; beta = 0 is "forward_kl" and beta = 1 "reverse_kl", as TRL
                   special-cases them: the formula itself tends to 0 at both ends)
    "tvd":         0.5 sum_v |p_s - p_t|   (total variation distance)

Each head's logits may first be scaled and softcapped, as the model predicts with them (Cohere's
``logit_scale``, Gemma 2's ``final_logit_softcapping``; TRL's ``DistillationTrainer`` does the same).
Optionally, as Liger's distillation losses do, a hard loss is mixed in:
``weight_soft_loss * divergence + weight_hard_loss * CE(x, target)`` (the cross entropy on the
untempered student logits). A token whose ``target`` is ``ignore_index`` counts for nothing.

Reductions, as TRL's ``generalized_jsd_loss`` defines them: ``"batchmean"`` (its default) divides
the sum over tokens by the number of tokens not ignored (at least 1) or, without ``target``, by
the first dimension of ``student_hidden`` (the batch, as ``F.kl_div`` does); ``"sum"``;
``"mean"`` divides by the number of (token, class) pairs, tokens not ignored times V (TRL takes
the mean of the per-class terms); ``"none"`` gives one loss per token (TRL returns the per-class
terms; their sum over the vocabulary is this). ``num_items_in_batch`` (``"batchmean"`` only)
replaces the denominator, as TRL's does for gradient accumulation.

How: the tokens are cut into chunks by fk-flce's chunk engine (:mod:`fk.flce.chunks`). For each
chunk, the student logits ``h_s W_s^T (+ b_s)`` and the teacher logits ``h_t W_t^T (+ b_t)`` (or
a slice of given ``teacher_logits``) are computed, and one Triton kernel streams both rows to get
each token's loss and writes ``d loss / d x`` over the student logits in place; the engine then
forms ``dh_s``, ``dW_s`` and ``db_s`` from them. Neither model's logits exist beyond one chunk.

FLOPs (N tokens, student hidden size H, teacher hidden size H_t, vocabulary V): the teacher head
costs ``2 N H_t V`` (forward only: the teacher is frozen, never differentiated), the student head
``6 N H V`` (``4 N H V`` with a frozen student weight, whose gradient is never computed), N the
scored tokens with ``target`` and a teacher head (``skip_ignored``: the others' rows are left out
first, after one host synchronization), else every token. With
``reduction="none"`` the backward recomputes both heads' logits: ``4 N H_t V + 8 N H V``. Given
``teacher_logits``, the teacher costs nothing here.

The order of the file: 1. the references (the loss on full logits, and the closed-form gradient
of one chunk), 2. the kernel with its backward math, 3. the launchers registered as custom ops,
4. the functional API, 5. the module.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fk.align.budget import ALIGN_MEMORY_BUDGET, sums_in_fp32
from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, multiprocessor_count, next_power_of_2
from fk.core.ops import define_autograd_op, fake_from
from fk.flce.chunks import (
    ChunkLoss,
    backward_fakes,
    chunk_logits,
    chunk_tokens_for,
    head_grad_fakes,
    head_grads,
    input_grads,
    row_scale,
    scale_grads,
)
from fk.flce.cross_entropy import LABEL_DTYPES, check_num_items, row_values

LOSSES = ("jsd", "forward_kl", "reverse_kl", "tvd")
REDUCTIONS = ("batchmean", "sum", "mean", "none")

# The kernel's DIVERGENCE codes; "jsd" with beta 0 or 1 runs as FORWARD_KL or REVERSE_KL.
FORWARD_KL, REVERSE_KL, JSD, TVD = 0, 1, 2, 3


class DistillOptions(NamedTuple):
    """The options of the loss, as the kernel takes them (validated by the functional API)."""

    divergence: int  # FORWARD_KL, REVERSE_KL, JSD or TVD
    beta: float  # the JSD mixture's teacher weight, strictly inside (0, 1) for JSD
    temperature: float
    ignore_index: int
    weight_soft: float  # on the divergence
    weight_hard: float  # on the cross entropy of the untempered student logits with target
    student_scale: float = 1.0  # each head's logits are multiplied by its scale (Cohere's logit_scale),
    student_softcap: float = 0.0  # then softcapped, softcap * tanh(. / softcap) (Gemma 2's; 0.0: none),
    teacher_scale: float = 1.0  # before the temperature: the logits of the model as it predicts
    teacher_softcap: float = 0.0


def transform_logits(logits: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """A head's logits as its model predicts with them: times ``scale``, then softcapped (``softcap``
    0: not)."""
    z = logits * scale if scale != 1.0 else logits
    return softcap * torch.tanh(z / softcap) if softcap else z


def divergence_code(loss: str, beta: float) -> int:
    """The kernel's divergence for ``loss`` and ``beta`` (TRL's special cases of the JSD)."""
    if loss == "jsd":
        return FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else JSD
    return {"forward_kl": FORWARD_KL, "reverse_kl": REVERSE_KL, "tvd": TVD}[loss]


# --- 1. References --------------------------------------------------------------------------------


def _divergence_rows(a: torch.Tensor, b: torch.Tensor, divergence: int, beta: float) -> torch.Tensor:
    """Per-row divergence of tempered student logits ``a`` and teacher logits ``b`` (N, V)."""
    log_ps, log_pt = a.log_softmax(-1), b.log_softmax(-1)
    ps, pt = log_ps.exp(), log_pt.exp()
    if divergence == FORWARD_KL:
        return (pt * (log_pt - log_ps)).sum(-1)
    if divergence == REVERSE_KL:
        return (ps * (log_ps - log_pt)).sum(-1)
    if divergence == TVD:
        return 0.5 * (ps - pt).abs().sum(-1)
    log_m = torch.logaddexp(log_pt + math.log(beta), log_ps + math.log1p(-beta))
    return beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)


def distill_loss_ref(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    weight_soft_loss: float = 1.0,
    weight_hard_loss: float = 0.0,
    num_items_in_batch: torch.Tensor | float | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch: the loss of full logits ``(..., V)`` in fp32 (fp64 for fp64 input), as the
    module docstring defines it. The definition the kernels are tested against."""
    compute = torch.promote_types(student_logits.dtype, torch.float32)
    rows_shape = student_logits.shape[:-1]
    n_classes = student_logits.shape[-1]
    x = transform_logits(student_logits.reshape(-1, n_classes).to(compute), student_logit_scale, student_softcap or 0.0)
    y = transform_logits(teacher_logits.reshape(-1, n_classes).to(compute), teacher_logit_scale, teacher_softcap or 0.0)
    per_row = weight_soft_loss * _divergence_rows(x / temperature, y / temperature, divergence_code(loss, beta), beta)
    if target is not None:
        labels = target.reshape(-1)
        valid = labels != ignore_index
        if weight_hard_loss != 0:
            per_row = per_row + weight_hard_loss * F.cross_entropy(x, labels.long(), ignore_index=ignore_index,
                                                                   reduction="none")  # fmt: skip
        per_row = torch.where(valid, per_row, 0.0)
        n_valid = valid.sum().to(compute)
    else:
        n_valid = torch.tensor(float(x.shape[0]), dtype=compute, device=x.device)
    if reduction == "none":
        return per_row.reshape(rows_shape)
    total = per_row.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / torch.as_tensor(num_items_in_batch, dtype=compute, device=x.device)
    if reduction == "batchmean":
        first = float(max(rows_shape[0], 1)) if len(rows_shape) else 1.0  # (TRL: at least 1)
        return total / (n_valid.clamp_min(1) if target is not None else first)
    denominator = n_valid * n_classes
    return total / torch.where(denominator != 0, denominator, 1.0)


def fused_linear_distill_ref(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    """The full logits of both heads in their inputs' dtype, then :func:`distill_loss_ref` on them
    (``options``: its keywords). The path of CPU tensors without Triton's interpreter, too."""
    student_logits = F.linear(student_hidden, student_weight, student_bias)
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden, teacher_weight, teacher_bias)
    return distill_loss_ref(student_logits, teacher_logits, target, **options)


def distill_logits_grad_ref(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None,
    options: DistillOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, d sum(loss) / d student_logits) of one chunk ``(n, V)`` from the closed
    forms the kernel implements (section 2), in plain PyTorch without autograd: the tests check
    these formulas against autograd of :func:`distill_loss_ref`, and the kernel against these."""
    compute = torch.promote_types(student_logits.dtype, torch.float32)
    x = transform_logits(student_logits.to(compute), options.student_scale, options.student_softcap)
    y = transform_logits(teacher_logits.to(compute), options.teacher_scale, options.teacher_softcap)
    temperature = options.temperature
    log_ps, log_pt = (x / temperature).log_softmax(-1), (y / temperature).log_softmax(-1)
    ps, pt = log_ps.exp(), log_pt.exp()
    div = options.divergence
    if div == FORWARD_KL:
        loss = (pt * (log_pt - log_ps)).sum(-1)
        grad = ps - pt
    elif div == REVERSE_KL:
        loss = (ps * (log_ps - log_pt)).sum(-1)
        grad = ps * (log_ps - log_pt - loss[:, None])
    elif div == JSD:
        beta = options.beta
        log_m = torch.logaddexp(log_pt + math.log(beta), log_ps + math.log1p(-beta))
        kl_s = (ps * (log_ps - log_m)).sum(-1)
        loss = beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * kl_s
        grad = (1 - beta) * ps * (log_ps - log_m - kl_s[:, None])
    else:
        sign = torch.sign(ps - pt)
        loss = 0.5 * (ps - pt).abs().sum(-1)
        grad = 0.5 * ps * (sign - (ps * sign).sum(-1, keepdim=True))
    loss, grad = options.weight_soft * loss, options.weight_soft / temperature * grad
    if target is not None:
        valid = target != options.ignore_index
        if options.weight_hard != 0:
            labels = torch.where(valid, target, 0).long()
            log_q = x.log_softmax(-1)
            loss = loss - options.weight_hard * log_q.gather(-1, labels[:, None])[:, 0]
            grad = grad + options.weight_hard * (log_q.exp() - F.one_hot(labels, x.shape[-1]).to(compute))
        loss = torch.where(valid, loss, 0.0)
        grad = torch.where(valid[:, None], grad, 0.0)
    # Through the transform: d x / d raw = scale (1 - (x / softcap)^2), or scale without a softcap.
    if options.student_softcap:
        grad = grad * (1 - (x / options.student_softcap).square())
    return loss, grad * options.student_scale


# --- 2. Kernel ------------------------------------------------------------------------------------
#
# Per token, x and y are the student's and the teacher's logits as their models predict with them:
# the head's output times its scale s, then softcapped, x = c tanh(s raw / c), so the gradient is
# multiplied last by d x / d raw = s (1 - (x / c)^2). With a = x / T and b = y / T, log p_s =
# a - lse_s and log p_t = b - lse_t. Through the softmax, a function f of p_s has
# d f / d a_j = p_j (phi_j - sum_v p_v phi_v) with phi = d f / d p_s, and d / d x = (1 / T) d / d a.
# So, per divergence (m: the JSD's mixture):
#   forward KL:  f = -sum p_t log p_s + const      ->  d f / d a = p_s - p_t
#   reverse KL:  phi = log p_s - log p_t + 1       ->  d f / d a = p_s (log p_s - log p_t - KL(p_s || p_t))
#   JSD:         f = beta sum p_t log p_t + (1 - beta) sum p_s log p_s - sum m log m,
#                phi = (1 - beta) (log p_s - log m) ->  d f / d a = (1 - beta) p_s (log p_s - log m - KL(p_s || m))
#   TVD:         phi = 0.5 sign(p_s - p_t)         ->  d f / d a = 0.5 p_s (sign - sum_v p_s sign)
# and the hard loss, CE = lse(x) - x_k for the label k, adds d / d x_v = softmax(x)_v - [v == k].
# Each row's gradient is scaled by the reduction's factor and the upstream gradient
# (``grad_scale_ptr``: one value, or one per row for reduction "none"); an ignored row gets 0.
#
# Passes over a row (each reads the student and the teacher row):
#   1. online log-sum-exp of a and of b (per lane: a running peak and mass = sum exp(. - peak), one
#      exp per element as in fk.flce's cross-entropy kernel), and the expectation its KL needs,
#      rescaled along with the mass: KL(p_s || p_t) = E_{p_s}[a - b] - lse_s + lse_t and
#      KL(p_t || p_s) = E_{p_t}[b - a] - lse_t + lse_s come out of this pass. With a hard loss and
#      T != 1, also the log-sum-exp of the untempered x. Each lse is kept as top + log_sum (top:
#      the row's peak), so log p = (a - top) - log_sum rounds as log_softmax does.
#   2. JSD and TVD only: the row's loss and the sum their gradient subtracts (KL(p_s || m), or
#      sum p_s sign), which need both log-sum-exps first.
#   3. the gradient, written over the student logits (each element after its last read).


@triton.jit
def _transformed(raw, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """A head's logits as its model predicts with them: ``raw`` times ``scale``, softcapped."""
    z = raw * scale
    if HAS_SOFTCAP:
        z = softcap * (2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0)  # softcap * tanh(z / softcap)
    return z


@triton.jit
def _log_mixture(log_ps, log_pt, log_beta, log_1m_beta):
    """log m = log(beta p_t + (1 - beta) p_s), stably (log-add-exp)."""
    from_teacher = log_pt + log_beta
    from_student = log_ps + log_1m_beta
    hi = tl.maximum(from_teacher, from_student)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(from_teacher, from_student) - hi))


@triton.jit
def _online_lse(peak, mass, z):
    """One block of an online log-sum-exp: each lane's running peak (max) and mass (sum of
    exp(z - peak)). One exp per element: exp(-|z - peak|) rescales the old mass when z is the new
    peak and is the new term otherwise."""
    e = tl.exp(-tl.abs(z - peak))
    mass = tl.where(z > peak, mass * e + 1.0, mass + e)
    return tl.maximum(peak, z), mass


@triton.jit
def _online_expectation(peak, mass, r, z, d):
    """:func:`_online_lse` and, rescaled along with the mass, r = sum exp(z - peak) d: r / mass is
    then the expectation of d under softmax(z)."""
    e = tl.exp(-tl.abs(z - peak))
    up = z > peak
    mass = tl.where(up, mass * e + 1.0, mass + e)
    r = tl.where(up, r * e + d, r + e * d)
    return tl.maximum(peak, z), mass, r


@triton.jit
def _distill_kernel(
    student_ptr,  # [N, V] student logits, row stride student_row_stride; the gradient is written over them
    teacher_ptr,  # [N, V] teacher logits, row stride teacher_row_stride
    target_ptr,  # [N] int32/int64 labels (HAS_TARGET): ignore_index rows count for nothing; the hard loss's label
    loss_ptr,  # [N] fp32 per-row loss (written)
    grad_scale_ptr,  # fp32 factor on the gradient: [1], or [N] when ROW_SCALE
    n_rows,
    n_cols,
    student_row_stride,
    teacher_row_stride,
    ignore_index,
    inv_temperature,
    beta,
    log_beta,
    log_1m_beta,
    weight_soft,
    weight_hard,
    student_scale,
    student_softcap,
    teacher_scale,
    teacher_softcap,
    DIVERGENCE: tl.constexpr,  # 0 forward KL, 1 reverse KL, 2 JSD, 3 TVD
    HAS_TARGET: tl.constexpr,
    HARD: tl.constexpr,  # a hard loss (weight_hard != 0; needs HAS_TARGET)
    RAW_LSE: tl.constexpr,  # HARD with T != 1: the untempered log-sum-exp is its own sum
    STUDENT_SOFTCAP: tl.constexpr,
    TEACHER_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    for row in range(pid, n_rows, n_programs):
        row64 = tl.cast(row, tl.int64)
        x_row = student_ptr + row64 * student_row_stride
        y_row = teacher_ptr + row64 * teacher_row_stride
        label = tl.full((), 0, tl.int64)
        ignored = False
        if HAS_TARGET:
            label = tl.load(target_ptr + row).to(tl.int64)
            ignored = label == ignore_index
        # Pass 1. The peak starts finite: a lane that has seen only -inf never takes exp(-inf + inf).
        peak_s = tl.full([BLOCK], -1e30, tl.float32)
        mass_s = tl.zeros([BLOCK], tl.float32)
        r_s = tl.zeros([BLOCK], tl.float32)
        peak_t = tl.full([BLOCK], -1e30, tl.float32)
        mass_t = tl.zeros([BLOCK], tl.float32)
        r_t = tl.zeros([BLOCK], tl.float32)
        peak_x = tl.full([BLOCK], -1e30, tl.float32)
        mass_x = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            x = _transformed(x, student_scale, student_softcap, STUDENT_SOFTCAP)
            y = tl.load(y_row + c, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            y = _transformed(y, teacher_scale, teacher_softcap, TEACHER_SOFTCAP)
            a = tl.where(mask, x * inv_temperature, -float("inf"))
            b = tl.where(mask, y * inv_temperature, -float("inf"))
            d = tl.where(mask, (x - y) * inv_temperature, 0.0)  # a - b, which the KLs average (0 past the end)
            if DIVERGENCE == 1:
                peak_s, mass_s, r_s = _online_expectation(peak_s, mass_s, r_s, a, d)
            else:
                peak_s, mass_s = _online_lse(peak_s, mass_s, a)
            if DIVERGENCE == 0:
                peak_t, mass_t, r_t = _online_expectation(peak_t, mass_t, r_t, b, -d)
            else:
                peak_t, mass_t = _online_lse(peak_t, mass_t, b)
            if RAW_LSE:
                peak_x, mass_x = _online_lse(peak_x, mass_x, tl.where(mask, x, -float("inf")))
        top_s = tl.max(peak_s, axis=0)
        fold_s = tl.exp(peak_s - top_s)
        sum_s = tl.sum(mass_s * fold_s, axis=0)
        log_sum_s = tl.log(sum_s)
        top_t = tl.max(peak_t, axis=0)
        fold_t = tl.exp(peak_t - top_t)
        sum_t = tl.sum(mass_t * fold_t, axis=0)
        log_sum_t = tl.log(sum_t)
        # kl: the divergence's own KL (reverse or forward); extra: the sum pass 3 subtracts.
        kl = 0.0
        extra = 0.0
        div = 0.0
        if DIVERGENCE == 0:
            kl = tl.sum(r_t * fold_t, axis=0) / sum_t - (top_t - top_s) - (log_sum_t - log_sum_s)
            div = kl
        elif DIVERGENCE == 1:
            kl = tl.sum(r_s * fold_s, axis=0) / sum_s - (top_s - top_t) - (log_sum_s - log_sum_t)
            div = kl
        else:
            # Pass 2 (JSD, TVD): the loss and the sum pass 3 subtracts.
            acc_loss = tl.zeros([BLOCK], tl.float32)
            acc_extra = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                x = _transformed(x, student_scale, student_softcap, STUDENT_SOFTCAP)
                y = tl.load(y_row + c, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                y = _transformed(y, teacher_scale, teacher_softcap, TEACHER_SOFTCAP)
                log_ps = (x * inv_temperature - top_s) - log_sum_s
                log_pt = (y * inv_temperature - top_t) - log_sum_t
                ps = tl.exp(log_ps)
                pt = tl.exp(log_pt)
                if DIVERGENCE == 2:
                    log_m = _log_mixture(log_ps, log_pt, log_beta, log_1m_beta)
                    acc_loss += tl.where(mask, pt * (log_pt - log_m), 0.0)
                    acc_extra += tl.where(mask, ps * (log_ps - log_m), 0.0)
                else:
                    diff = ps - pt
                    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
                    acc_loss += tl.where(mask, tl.abs(diff), 0.0)
                    acc_extra += tl.where(mask, ps * sign, 0.0)
            extra = tl.sum(acc_extra, axis=0)
            if DIVERGENCE == 2:
                div = beta * tl.sum(acc_loss, axis=0) + (1.0 - beta) * extra
            else:
                div = 0.5 * tl.sum(acc_loss, axis=0)
        loss = weight_soft * div
        top_x = top_s
        log_sum_x = log_sum_s
        label_ok = False
        bad_label = False
        if HARD:
            if RAW_LSE:
                top_x = tl.max(peak_x, axis=0)
                log_sum_x = tl.log(tl.sum(mass_x * tl.exp(peak_x - top_x), axis=0))
            label_ok = (label >= 0) & (label < n_cols) & (label != ignore_index)
            bad_label = (label != ignore_index) & ~label_ok  # unchecked on a GPU: NaN, as fk-flce gives
            x_label = tl.load(x_row + label, mask=label_ok, other=0.0).to(tl.float32)
            x_label = _transformed(x_label, student_scale, student_softcap, STUDENT_SOFTCAP)
            loss += weight_hard * (log_sum_x - (x_label - top_x))
            loss = tl.where(bad_label, float("nan"), loss)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
        # Pass 3: the gradient, scaled; blocks backwards (the last read are likeliest in L2).
        if COMPUTE_GRAD:
            scale = tl.load(grad_scale_ptr + row) if ROW_SCALE else tl.load(grad_scale_ptr)
            scale = tl.where(ignored, 0.0, scale)
            scale = tl.where(bad_label, float("nan"), scale)
            soft_scale = weight_soft * inv_temperature * scale
            label32 = tl.where(label_ok, label, -1).to(tl.int32)
            n_blocks = tl.cdiv(n_cols, BLOCK)
            for back in range(0, n_blocks):
                c = (n_blocks - 1 - back) * BLOCK + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                x = _transformed(x, student_scale, student_softcap, STUDENT_SOFTCAP)
                y = tl.load(y_row + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                y = _transformed(y, teacher_scale, teacher_softcap, TEACHER_SOFTCAP)
                log_ps = (x * inv_temperature - top_s) - log_sum_s
                log_pt = (y * inv_temperature - top_t) - log_sum_t
                ps = tl.exp(log_ps)
                if DIVERGENCE == 0:
                    g = ps - tl.exp(log_pt)
                elif DIVERGENCE == 1:
                    g = ps * (log_ps - log_pt - kl)
                elif DIVERGENCE == 2:
                    g = (1.0 - beta) * ps * (log_ps - _log_mixture(log_ps, log_pt, log_beta, log_1m_beta) - extra)
                else:
                    diff = ps - tl.exp(log_pt)
                    g = 0.5 * ps * (tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0)) - extra)
                g = g * soft_scale
                if HARD:
                    g += (weight_hard * scale) * (tl.exp((x - top_x) - log_sum_x) - tl.where(c == label32, 1.0, 0.0))
                if STUDENT_SOFTCAP:
                    x_capped = x / student_softcap
                    g = g * (1.0 - x_capped * x_capped)
                g = g * student_scale
                tl.store(x_row + c, g.to(student_ptr.dtype.element_ty), mask=mask)


# --- 3. Launchers, registered as custom ops -------------------------------------------------------


class LaunchParams(NamedTuple):
    programs_per_sm: int  # rows in flight per SM: each streams two rows (student, teacher) 2-3 times
    max_block: int  # columns per load, of each of the two rows
    num_warps: int  # for rows of 4096 columns or more (4 below)


# Not yet swept on a GPU: fk-flce's fused cross-entropy pass (8 rows per SM, 8192-column loads)
# halved, as each row here streams two logits rows and keeps twice the accumulators.
LAUNCH = LaunchParams(programs_per_sm=4, max_block=4096, num_warps=16)


def launch_distill(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None,
    options: DistillOptions,
    *,
    loss: torch.Tensor,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Run the kernel on 2-D logits (unit column stride): fills ``loss`` (fp32, one per row) and,
    when ``grad_scale`` (fp32, one value or one per row) is given, writes the scaled gradient of
    the loss over ``student_logits``."""
    n_rows, n_cols = student_logits.shape
    if n_rows == 0:
        return
    beta = options.beta
    jsd = options.divergence == JSD
    grid = (min(n_rows, multiprocessor_count(student_logits.device) * LAUNCH.programs_per_sm),)
    _distill_kernel[grid](
        student_logits, teacher_logits, target if target is not None else loss, loss,
        grad_scale if grad_scale is not None else loss,
        n_rows, n_cols, student_logits.stride(0), teacher_logits.stride(0),
        options.ignore_index, 1.0 / options.temperature, beta,
        math.log(beta) if jsd else 0.0, math.log1p(-beta) if jsd else 0.0,
        options.weight_soft, options.weight_hard,
        options.student_scale, options.student_softcap, options.teacher_scale, options.teacher_softcap,
        DIVERGENCE=options.divergence, HAS_TARGET=target is not None,
        HARD=options.weight_hard != 0, RAW_LSE=options.weight_hard != 0 and options.temperature != 1.0,
        STUDENT_SOFTCAP=options.student_softcap > 0, TEACHER_SOFTCAP=options.teacher_softcap > 0,
        COMPUTE_GRAD=grad_scale is not None,
        ROW_SCALE=grad_scale is not None and grad_scale.numel() == n_rows and n_rows != 1,
        BLOCK=min(LAUNCH.max_block, next_power_of_2(n_cols)),
        num_warps=LAUNCH.num_warps if n_cols >= 4096 else 4,
    )  # fmt: skip


class _Teacher(NamedTuple):
    """The teacher as the op takes it: a head (hidden, weight, bias) or its logits."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    logits: torch.Tensor | None


def _distill_chunks(
    teacher: _Teacher,
    target: torch.Tensor | None,
    options: DistillOptions,
    grad_scale: torch.Tensor,
    loss: torch.Tensor,
    chunk_tokens: int,
) -> ChunkLoss:
    """The kernel as each chunk's loss: the teacher's chunk of logits (computed into one buffer
    that every chunk reuses, or sliced from the given logits), then the per-row loss into
    ``loss`` and, when asked for, the gradient over the student's chunk of logits."""
    buffer = None
    if teacher.logits is None:
        assert teacher.hidden is not None and teacher.weight is not None
        n_tokens = teacher.hidden.shape[0]
        buffer = teacher.hidden.new_empty((min(chunk_tokens, n_tokens), teacher.weight.shape[0]))

    def chunk_loss(logits: torch.Tensor, rows: slice, want_grad: bool) -> None:
        if buffer is None:
            assert teacher.logits is not None
            teacher_logits = teacher.logits[rows]
        else:
            assert teacher.hidden is not None and teacher.weight is not None
            teacher_logits = chunk_logits(teacher.hidden[rows], teacher.weight, teacher.bias,
                                          out=buffer[: logits.shape[0]])  # fmt: skip
        launch_distill(logits, teacher_logits, target[rows] if target is not None else None, options,
                       loss=loss[rows], grad_scale=row_scale(grad_scale, rows) if want_grad else None)  # fmt: skip

    return chunk_loss


# (loss, dh, dw, db, dlogits): torch.library needs the arity spelled out.
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _distill_fwd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    teacher_logits: torch.Tensor | None,
    target: torch.Tensor | None,
    denominator: torch.Tensor,
    divergence: int,
    beta: float,
    temperature: float,
    ignore_index: int,
    weight_soft: float,
    weight_hard: float,
    student_scale: float,
    student_softcap: float,
    teacher_scale: float,
    teacher_softcap: float,
    reduction: str,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    """Forward launcher on 2-D ``student_hidden`` ``(N, H)`` (and 2-D teacher inputs): returns
    (loss, dh, dw, db, dlogits). ``denominator`` (fp32, 0-dim) divides the sum for "batchmean" and
    "mean". The gradients (empty when not computed) are those of the loss for an upstream gradient
    of 1, as :func:`fk.flce.chunks.head_grads` returns them."""
    options = DistillOptions(divergence, beta, temperature, ignore_index, weight_soft, weight_hard, student_scale,
                             student_softcap, teacher_scale, teacher_softcap)  # fmt: skip
    teacher = _Teacher(teacher_hidden, teacher_weight, teacher_bias, teacher_logits)
    loss = row_values(student_hidden)
    grad_scale = (1.0 / denominator).reshape(1)
    chunk_loss = _distill_chunks(teacher, target, options, grad_scale, loss, chunk_tokens)
    grads = head_grads(student_hidden, student_weight, student_bias, chunk_tokens, chunk_loss, accum_fp32,
                       compute_dh, compute_dw, compute_db)  # fmt: skip
    if reduction == "sum":
        loss = loss.sum()
    elif reduction != "none":
        loss = loss.sum() / denominator
    return (loss, *grads)


def _distill_fwd_fake(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    reduction: str,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    rows = row_values(student_hidden)
    return (
        torch.empty_like(rows) if reduction == "none" else rows.new_empty(()),
        *head_grad_fakes(student_hidden, student_weight, student_bias, chunk_tokens, accum_fp32, compute_dh,
                         compute_dw, compute_db),
    )  # fmt: skip


def _distill_bwd(
    grad_loss: torch.Tensor,
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    teacher_logits: torch.Tensor | None,
    target: torch.Tensor | None,
    dh_saved: torch.Tensor,
    dw_saved: torch.Tensor,
    db_saved: torch.Tensor,
    logits_grad: torch.Tensor,
    divergence: int,
    beta: float,
    temperature: float,
    ignore_index: int,
    weight_soft: float,
    weight_hard: float,
    student_scale: float,
    student_softcap: float,
    teacher_scale: float,
    teacher_softcap: float,
    chunk_tokens: int,
    accum_fp32: bool,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    precomputed: bool,
    inplace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: (dh, dw, db), each an empty tensor when not needed. ``precomputed``
    (every reduction but "none"): the forward's gradients scaled by ``grad_loss``
    (:func:`fk.flce.chunks.scale_grads`). Otherwise both heads' logits are recomputed chunk by
    chunk and each row's gradient is scaled by its own upstream gradient."""
    if not precomputed:
        options = DistillOptions(divergence, beta, temperature, ignore_index, weight_soft, weight_hard,
                                 student_scale, student_softcap, teacher_scale, teacher_softcap)  # fmt: skip
        teacher = _Teacher(teacher_hidden, teacher_weight, teacher_bias, teacher_logits)
        chunk_loss = _distill_chunks(teacher, target, options, grad_loss.float().reshape(-1).contiguous(),
                                     row_values(student_hidden), chunk_tokens)  # fmt: skip
        dh_saved, dw_saved, db_saved, _ = head_grads(student_hidden, student_weight, student_bias, chunk_tokens,
                                                     chunk_loss, accum_fp32, need_dh, need_dw, need_db,
                                                     recompute=True)  # fmt: skip
        grad_loss = torch.ones((), dtype=torch.float32, device=student_hidden.device)
    return scale_grads(grad_loss, student_hidden, student_weight, student_bias, dh_saved, dw_saved, db_saved,
                       logits_grad, need_dh, need_dw, need_db, inplace)  # fmt: skip


def _distill_bwd_fake(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward_fakes(student_hidden, student_weight, student_bias, need_dh, need_dw, need_db)


_N_INPUTS = 25


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, teacher_logits,
     target, _denominator, *options, _reduction, chunk_tokens, accum_fp32, compute_dh, compute_dw,
     compute_db) = inputs  # fmt: skip
    _loss, dh, dw, db, logits_grad = output
    ctx.precomputed = compute_dh or compute_dw or compute_db
    if ctx.precomputed:
        ctx.save_for_backward(student_hidden, student_weight, student_bias, dh, dw, db, logits_grad)
    else:  # reduction "none": the backward recomputes the logits
        ctx.save_for_backward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                              teacher_bias, teacher_logits, target)  # fmt: skip
    ctx.options = (*options, chunk_tokens, accum_fp32)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, grad_loss: torch.Tensor | None, *_rest: Any) -> tuple[Any, ...]:
    needs = need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_loss is None or not (need_dh or need_dw or need_db):
        return input_grads(None, needs, _N_INPUTS)
    if ctx.precomputed:
        student_hidden, student_weight, student_bias, dh, dw, db, logits_grad = ctx.saved_tensors
        teacher: tuple[Any, ...] = (None, None, None, None, None)
    else:
        student_hidden, student_weight, student_bias, *teacher = ctx.saved_tensors
        dh = dw = db = logits_grad = student_hidden.new_empty(0)
    # In place only in eager mode: a custom op (the torch.compile path) may not return its input.
    inplace = run_backward is _distill_bwd
    grads = run_backward(grad_loss, student_hidden, student_weight, student_bias, *teacher, dh, dw, db, logits_grad,
                         *ctx.options, need_dh, need_dw, need_db, ctx.precomputed, inplace)  # fmt: skip
    return input_grads(grads, needs, _N_INPUTS)


_fused_linear_distill = define_autograd_op(
    __name__, "fused_linear_distill",
    forward=_distill_fwd, forward_fake=fake_from(_distill_fwd, _distill_fwd_fake),
    backward_launcher=_distill_bwd, backward_fake=fake_from(_distill_bwd, _distill_bwd_fake),
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def check_options(
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    weight_soft_loss: float = 1.0,
    weight_hard_loss: float = 0.0,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> DistillOptions:
    """Validate the options of the distillation losses (the keywords of :func:`distill_loss_ref`
    but ``num_items_in_batch``; a ``ValueError``/``TypeError`` names the argument); returns them
    as the kernel takes them."""
    validate.check_choice("loss", loss, LOSSES)
    validate.check_choice("reduction", reduction, REDUCTIONS)
    validate.check_int("ignore_index", ignore_index)
    for name, value in (("beta", beta), ("weight_soft_loss", weight_soft_loss),
                        ("weight_hard_loss", weight_hard_loss)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite float, got {value!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    positive: dict[str, float] = {}
    named: tuple[tuple[str, float | None], ...] = (
        ("temperature", temperature), ("student_logit_scale", student_logit_scale),
        ("teacher_logit_scale", teacher_logit_scale), ("student_softcap", student_softcap),
        ("teacher_softcap", teacher_softcap),
    )  # fmt: skip
    for name, given in named:
        if given is None:  # (a softcap not given)
            positive[name] = 0.0
            continue
        positive[name] = validate.check_positive_float(name, given)
        if not math.isfinite(positive[name]):
            raise ValueError(f"{name} must be finite, got {given}")
    return DistillOptions(divergence_code(loss, beta), float(beta), positive["temperature"], ignore_index,
                          float(weight_soft_loss), float(weight_hard_loss), positive["student_logit_scale"],
                          positive["student_softcap"], positive["teacher_logit_scale"],
                          positive["teacher_softcap"])  # fmt: skip


def _check_head(prefix: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    validate.check_tensor(f"{prefix}_hidden", hidden)
    validate.check_dtype(f"{prefix}_hidden", hidden)
    validate.check_min_ndim(f"{prefix}_hidden", hidden, 1)
    validate.check_tensor(f"{prefix}_weight", weight)
    validate.check_ndim(f"{prefix}_weight", weight, 2)
    validate.check_same_dtype(f"{prefix}_weight", weight, f"{prefix}_hidden", hidden)
    validate.check_same_device(f"{prefix}_weight", weight, f"{prefix}_hidden", hidden)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{prefix}_weight must have shape (V, {hidden.shape[-1]}) to match {prefix}_hidden, "
                         f"got {tuple(weight.shape)}")  # fmt: skip
    if weight.shape[0] == 0:
        raise ValueError(f"{prefix}_weight must have at least one row (class)")
    if bias is not None:
        validate.check_tensor(f"{prefix}_bias", bias)
        validate.check_same_dtype(f"{prefix}_bias", bias, f"{prefix}_hidden", hidden)
        validate.check_shape(f"{prefix}_bias", bias, (weight.shape[0],))
        validate.check_same_device(f"{prefix}_bias", bias, f"{prefix}_hidden", hidden)


def check_inputs(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher: _Teacher,
    target: torch.Tensor | None,
    options: DistillOptions,
    reduction: str,
    num_items_in_batch: torch.Tensor | float | None,
    accum_dtype: torch.dtype | None,
    memory_budget: int,
) -> torch.Tensor | None:
    """Validate the tensors of :func:`fused_linear_distill` and its ``teacher_logits`` sibling
    against each other; returns ``num_items_in_batch`` as an fp32 0-dim tensor (or None)."""
    _check_head("student", student_hidden, student_weight, student_bias)
    rows, n_classes = tuple(student_hidden.shape[:-1]), student_weight.shape[0]
    if teacher.logits is None:
        assert teacher.hidden is not None and teacher.weight is not None
        _check_head("teacher", teacher.hidden, teacher.weight, teacher.bias)
        if tuple(teacher.hidden.shape[:-1]) != rows:
            raise ValueError(f"teacher_hidden must have shape {(*rows, 'H_t')} to match student_hidden, "
                             f"got {tuple(teacher.hidden.shape)}")  # fmt: skip
        validate.check_same_device("teacher_hidden", teacher.hidden, "student_hidden", student_hidden)
        if teacher.weight.shape[0] != n_classes:
            raise ValueError(f"teacher_weight must have {n_classes} rows (the student's vocabulary), "
                             f"got shape {tuple(teacher.weight.shape)}")  # fmt: skip
    else:
        validate.check_tensor("teacher_logits", teacher.logits)
        validate.check_dtype("teacher_logits", teacher.logits)
        validate.check_shape("teacher_logits", teacher.logits, (*rows, n_classes))
        validate.check_same_device("teacher_logits", teacher.logits, "student_hidden", student_hidden)
    if target is not None:
        validate.check_tensor("target", target)
        validate.check_dtype("target", target, LABEL_DTYPES)
        validate.check_shape("target", target, rows)
        validate.check_same_device("target", target, "student_hidden", student_hidden)
        if options.weight_hard != 0:
            validate.check_labels("target", target, n_classes, options.ignore_index)
    elif options.weight_hard != 0:
        raise ValueError(f"weight_hard_loss={options.weight_hard} needs target (the hard loss's labels)")
    if num_items_in_batch is not None and reduction != "batchmean":
        raise ValueError(f"num_items_in_batch replaces the mean's denominator; it needs reduction='batchmean', "
                         f"got {reduction!r}")  # fmt: skip
    num_items = check_num_items(num_items_in_batch, "mean", student_hidden.device)
    if accum_dtype is not None and accum_dtype not in (torch.float32, student_weight.dtype):
        raise ValueError(f"accum_dtype must be torch.float32 or student_weight's dtype ({student_weight.dtype}), "
                         f"got {accum_dtype}")  # fmt: skip
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    return num_items


def _denominator(
    rows: tuple[int, ...],
    n_classes: int,
    target: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    num_items: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """The reduction's divisor as an fp32 0-dim tensor on the device (no host synchronization);
    1 for "sum" and "none", and where a mean would divide by 0 (a mean over no tokens is 0)."""
    if num_items is not None:
        return num_items
    if target is not None:
        count = (target != ignore_index).sum().to(torch.float32)
    else:
        count = torch.full((), float(math.prod(rows)), dtype=torch.float32, device=device)
    if reduction == "batchmean":
        if target is None:  # TRL and F.kl_div: the first dimension, the batch
            return torch.full((), float(max(rows[0], 1)) if rows else 1.0, dtype=torch.float32, device=device)
        return count.clamp_min(1.0)
    if reduction == "mean":
        count = count * n_classes
        return torch.where(count != 0, count, torch.ones_like(count))
    return torch.ones((), dtype=torch.float32, device=device)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``(rows, t.shape[-1])`` tensor with unit column stride and dense rows."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 and t2d.stride(0) == t2d.shape[1] else t2d.contiguous()


def _fused_distill(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher: _Teacher,
    target: torch.Tensor | None,
    *,
    num_items_in_batch: torch.Tensor | float | None,
    accum_dtype: torch.dtype | None,
    memory_budget: int,
    skip_ignored: bool = False,
    **loss_options: Any,
) -> torch.Tensor:
    """The two functional APIs' common body; ``loss_options``: the keywords of :func:`check_options`;
    ``skip_ignored``: see :func:`fused_linear_distill`."""
    options = check_options(**loss_options)
    reduction, ignore_index = loss_options["reduction"], options.ignore_index
    num_items = check_inputs(student_hidden, student_weight, student_bias, teacher, target, options, reduction,
                             num_items_in_batch, accum_dtype, memory_budget)  # fmt: skip
    rows, n_classes = tuple(student_hidden.shape[:-1]), student_weight.shape[0]
    if not uses_kernel(student_hidden):
        teacher_logits = teacher.logits
        if teacher_logits is None:
            with torch.no_grad():
                teacher_logits = F.linear(teacher.hidden, teacher.weight, teacher.bias)  # type: ignore[arg-type]
        student_logits = F.linear(student_hidden, student_weight, student_bias)
        return distill_loss_ref(student_logits, teacher_logits.detach(), target, num_items_in_batch=num_items,
                                **loss_options).float()  # fmt: skip
    denominator = _denominator(rows, n_classes, target, ignore_index, reduction, num_items, student_hidden.device)
    hidden2d = _as_rows(student_hidden)
    teacher2d = _Teacher(
        _as_rows(teacher.hidden).detach() if teacher.hidden is not None else None,
        teacher.weight.detach() if teacher.weight is not None else None,
        teacher.bias.detach() if teacher.bias is not None else None,
        _as_rows(teacher.logits).detach() if teacher.logits is not None else None,
    )
    flat_target = target.reshape(-1) if target is not None else None
    if skip_ignored and flat_target is not None and reduction != "none" and not torch.compiler.is_compiling():
        kept = (flat_target != ignore_index).nonzero().squeeze(1)  # (the host synchronization)
        if kept.numel() < flat_target.numel():  # only the scored rows' logits; autograd scatters dh back
            hidden2d, flat_target = hidden2d.index_select(0, kept), flat_target[kept]
            assert teacher2d.hidden is not None
            teacher2d = teacher2d._replace(hidden=teacher2d.hidden.index_select(0, kept))
    itemsize = student_hidden.element_size()
    if teacher.hidden is not None:
        itemsize += teacher.hidden.element_size()  # the teacher's chunk of logits shares the budget
    in_forward = torch.is_grad_enabled() and reduction != "none"
    # (Balanced chunks in eager mode only: under torch.compile the token count may be symbolic.)
    n_tokens = None if torch.compiler.is_compiling() else hidden2d.shape[0]
    per_chunk = chunk_tokens_for(memory_budget, n_classes, itemsize, n_tokens)
    out, *_ = _fused_linear_distill(
        hidden2d, student_weight, student_bias, *teacher2d, flat_target, denominator, *options, reduction, per_chunk,
        sums_in_fp32(accum_dtype, student_weight.dtype, None if n_tokens is None else cdiv(n_tokens, per_chunk)),
        in_forward and student_hidden.requires_grad,
        in_forward and student_weight.requires_grad,
        in_forward and student_bias is not None and student_bias.requires_grad,
    )  # fmt: skip
    result: torch.Tensor = out.reshape(rows) if reduction == "none" else out
    return result


def fused_linear_distill(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    weight_soft_loss: float = 1.0,
    weight_hard_loss: float = 0.0,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = ALIGN_MEMORY_BUDGET,
    skip_ignored: bool = True,
) -> torch.Tensor:
    """The distillation loss of a student head against a frozen teacher head, without the
    ``[tokens, vocab]`` logits of either (see the module docstring for the losses and reductions).

    Args:
        student_hidden: ``(..., H)`` fp32/fp16/bf16 (any strides; made contiguous inside if not).
        student_weight: ``(V, H)`` the student's LM head, same dtype as ``student_hidden``. When it
            does not require grad (a frozen head, as in LoRA) its gradient is not computed at all.
        teacher_hidden: ``(..., H_t)``, the leading shape of ``student_hidden``; any float dtype.
        teacher_weight: ``(V, H_t)`` the teacher's head (the same vocabulary), ``teacher_hidden``'s
            dtype. The teacher gets no gradient: it is frozen (its inputs are detached).
        target: optional labels, ``student_hidden.shape[:-1]``: a token whose label is
            ``ignore_index`` counts for nothing (TRL's ``labels``); the hard loss's labels. With a
            hard loss, a label outside ``[0, V)`` raises a ``ValueError`` on the CPU and gives its
            token a NaN loss and gradient on a GPU unless ``FK_CHECK_LABELS=1``, as in
            :func:`fk.flce.linear_cross_entropy`; without one, only ``ignore_index`` is looked at.
        loss: "jsd" (generalized, weighted by ``beta``), "forward_kl", "reverse_kl" or "tvd".
        beta: the JSD's weight in [0, 1], as TRL's (0: forward KL, 1: reverse KL).
        temperature: both heads' logits are divided by it (> 0) before the softmax, as in TRL's
            ``generalized_jsd_loss`` and Liger (no ``T^2`` factor). TRL's ``GKDTrainer`` calls that
            loss with its default 1 (its ``temperature`` is the sampling one); its
            ``DistillationTrainer`` passes its ``temperature``.
        reduction: "batchmean" (TRL's default), "sum", "mean" or "none" (see the module docstring).
        student_bias, teacher_bias: optional ``(V,)``.
        weight_soft_loss, weight_hard_loss: the loss is ``weight_soft_loss * divergence +
            weight_hard_loss * cross_entropy(student logits, target)`` per token (Liger's
            ``weight_*``; their defaults are 0.5 and 0.5, TRL's GKD has no hard loss).
        student_logit_scale, teacher_logit_scale, student_softcap, teacher_softcap: each head's
            logits are multiplied by its scale (> 0; Cohere's ``logit_scale``, Granite's
            ``1 / logits_scaling``), then softcapped, ``softcap * tanh(logits / softcap)`` (Gemma 2's
            ``final_logit_softcapping``), before the temperature and the hard loss: the logits the
            model predicts with, as TRL's ``DistillationTrainer`` takes them.
        num_items_in_batch: the divisor of "batchmean" instead of the count of tokens (gradient
            accumulation: the count in the whole batch).
        accum_dtype: dtype the weight gradient is summed in across chunks: fp32, or the student
            head's dtype (into the returned gradient). None (default): the head's dtype when the
            pass has at most :data:`fk.align.budget.HEAD_DTYPE_SUM_CHUNKS` chunks, else fp32.
        memory_budget: bytes for one chunk of logits, the student's and the teacher's together
            (default :data:`fk.align.budget.ALIGN_MEMORY_BUDGET`, 1 GiB).
        skip_ignored: with ``target`` (and a reduction but "none"), compute the logits of the
            scored tokens only, as TRL's ``DistillationTrainer`` does: the rows whose label is
            ``ignore_index`` are left out before the heads (their loss and gradient are 0 either
            way). Finding them costs one host synchronization (the count of scored tokens); False
            keeps the call free of synchronization and computes every row. Not under
            ``torch.compile``.

    Returns the loss in fp32: a scalar, or one value per token (``student_hidden.shape[:-1]``)
    for reduction "none".
    """
    if not isinstance(skip_ignored, bool):
        raise TypeError(f"skip_ignored must be a bool, got {type(skip_ignored).__name__}")
    return _fused_distill(
        student_hidden, student_weight, student_bias, _Teacher(teacher_hidden, teacher_weight, teacher_bias, None),
        target, loss=loss, beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        weight_soft_loss=weight_soft_loss, weight_hard_loss=weight_hard_loss, student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale, student_softcap=student_softcap, teacher_softcap=teacher_softcap,
        num_items_in_batch=num_items_in_batch, accum_dtype=accum_dtype, memory_budget=memory_budget,
        skip_ignored=skip_ignored,
    )  # fmt: skip


def fused_linear_distill_from_logits(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    student_bias: torch.Tensor | None = None,
    weight_soft_loss: float = 1.0,
    weight_hard_loss: float = 0.0,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = ALIGN_MEMORY_BUDGET,
) -> torch.Tensor:
    """:func:`fused_linear_distill` against the teacher's precomputed logits ``(..., V)`` (what
    TRL's GKD trainer passes: ``teacher_model(...).logits``, computed under ``no_grad``), any float
    dtype and row stride. Only the student's logits are never materialized; the teacher's
    stay the caller's. Every other argument is as in :func:`fused_linear_distill`."""
    return _fused_distill(
        student_hidden, student_weight, student_bias, _Teacher(None, None, None, teacher_logits), target, loss=loss,
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        weight_soft_loss=weight_soft_loss, weight_hard_loss=weight_hard_loss, student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale, student_softcap=student_softcap, teacher_softcap=teacher_softcap,
        num_items_in_batch=num_items_in_batch, accum_dtype=accum_dtype, memory_budget=memory_budget,
    )  # fmt: skip


# --- 5. Module ------------------------------------------------------------------------------------


class LinearDistillLoss(torch.nn.Module):
    """The distillation loss of a student head against a teacher head, without their logits:
    ``forward(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None,
    student_bias=None, teacher_bias=None, num_items_in_batch=None)``. Every keyword of
    :func:`fused_linear_distill` (but the tensors) is a constructor argument."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        allowed = {"loss", "beta", "temperature", "ignore_index", "reduction", "weight_soft_loss", "weight_hard_loss",
                   "student_logit_scale", "teacher_logit_scale", "student_softcap", "teacher_softcap", "accum_dtype",
                   "memory_budget", "skip_ignored"}  # fmt: skip
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        check_options(**{k: v for k, v in options.items() if k not in ("accum_dtype", "memory_budget", "skip_ignored")})
        self.options = options

    def forward(
        self,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        target: torch.Tensor | None = None,
        student_bias: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        return fused_linear_distill(student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                                    student_bias=student_bias, teacher_bias=teacher_bias,
                                    num_items_in_batch=num_items_in_batch, **self.options)  # fmt: skip

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
