"""Cross entropy on logits: a drop-in for ``F.cross_entropy`` on 2-D logits, one streaming pass per row.

Per token n with label y (not ``ignore_index``), logits x (V classes), optional logit softcap c
(``z = c * tanh(x / c)``, Gemma 2; else ``z = x``), log-sum-exp ``lse = log sum_v exp(z_v)``, class
weights w (all ones when not given), label smoothing eps and z-loss scale s::

    loss_n = (1 - eps) * w_y * (lse - z_y)                       # weighted negative log-likelihood
           + (eps / V) * sum_v w_v * (lse - z_v)                 # label smoothing, as PyTorch defines it
           + s * lse^2                                           # z-loss (PaLM), "lse_square_scale"

An ignored token has loss 0 and gradient 0. ``reduction="mean"`` divides the sum over tokens by
``D = sum of w_y over the tokens not ignored`` (the count of those tokens without class weights),
as ``F.cross_entropy`` does, or by ``num_items`` when the caller gives it (gradient accumulation).
When ``D`` is 0 (every token ignored) the mean is 0 with zero gradients, where PyTorch gives NaN.

Bad labels: a label outside ``[0, V)`` other than ``ignore_index`` raises a ``ValueError`` on CPU
tensors that names the first one by its position in the labels as given and its value, e.g.
``target[1, 7] = 300000 is outside [0, 300) and is not ignore_index (-100)``. On a GPU, checking
would make the host wait for the GPU every step, so by default nothing is checked there: the kernel
gives such a token a NaN loss (a reduced loss is then NaN) and NaN gradients, and never reads or
writes out of bounds (the label's logit and class weight are loaded under a mask). The environment
variable ``FK_CHECK_LABELS=1`` checks on the GPU too, with one host synchronization per call, and
raises the same error; ``FK_CHECK_LABELS=0`` checks nowhere (see
:func:`fk.core.validate.labels_checked_on`). While ``torch.compile`` traces, nothing is checked: the
check depends on the labels' values, which a graph cannot branch on.

The same kernel serves :mod:`fk.flce.linear_cross_entropy`, which calls it on chunks of logits and
has it write the gradient over the logits in place.

This file holds, in order: the reference, the Triton kernel, the launchers registered as custom
ops, and the functional API :func:`cross_entropy` and module :class:`CrossEntropyLoss`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import multiprocessor_count, next_power_of_2
from fk.core.ops import define_autograd_op, fake_from, mark_overwritten

REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (torch.int64, torch.int32)


class CrossEntropyOutput(NamedTuple):
    """What :func:`cross_entropy` returns when an extra output is asked for.

    - ``loss``: reduced as asked (a scalar, or one value per token for ``"none"``).
    - ``lse``: fp32 log-sum-exp of each token's (softcapped) logits, or None.
    - ``z_loss``: the z-loss part of ``loss``, reduced the same way, or None.
    - ``accuracy``: fp32 per token, 1.0 where the argmax of the logits is the label, 0.0 otherwise
      and for ignored tokens; or None.
    """

    loss: torch.Tensor
    lse: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    accuracy: torch.Tensor | None = None


# --- 1. Reference ---------------------------------------------------------------------------------


def cross_entropy_ref(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items: torch.Tensor | float | None = None,
) -> CrossEntropyOutput:
    """Plain PyTorch cross entropy with every fk option (computes in fp32, or fp64 for fp64 input).

    This is the definition the kernels are tested against; without softcap, z-loss and
    ``num_items`` it equals ``F.cross_entropy`` (except that a mean over no items is 0, not NaN).
    """
    compute = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(compute)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    n_classes = z.shape[-1]
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_classes)
    safe_target = torch.where(valid & in_range, target, 0).long()
    w = weight.to(compute) if weight is not None else torch.ones(n_classes, dtype=compute, device=z.device)
    w_y = w[safe_target] * valid
    nll = lse - z.gather(-1, safe_target[:, None])[:, 0]
    nll = torch.where(in_range | ~valid, nll, torch.nan)  # a label outside [0, V): NaN, as the kernel gives
    smooth = (w.sum() * lse - z @ w) * valid
    z_loss = lse_square_scale * lse.square() * valid
    loss = (1 - label_smoothing) * w_y * nll + (label_smoothing / n_classes) * smooth + z_loss
    accuracy = ((z.argmax(-1) == target) & valid).to(torch.float32)
    if reduction == "none":
        return CrossEntropyOutput(loss.to(logits.dtype), lse.float(), z_loss.to(logits.dtype), accuracy)
    if reduction == "sum":
        denominator = torch.ones((), dtype=compute, device=z.device)
    elif num_items is not None:
        denominator = torch.as_tensor(num_items, dtype=compute, device=z.device)
    else:
        denominator = w_y.sum() if weight is not None else valid.sum().to(compute)
    denominator = torch.where(denominator != 0, denominator, 1)
    return CrossEntropyOutput(
        (loss.sum() / denominator).to(logits.dtype),
        lse.float(),
        (z_loss.sum() / denominator).to(logits.dtype),
        accuracy,
    )


# --- 2. Kernel ------------------------------------------------------------------------------------
#
# Backward, per token, with p_v = exp(z_v - lse) and W = sum_v w_v (V without class weights):
#   d loss_n / d z_v = (1 - eps) * w_y * (p_v - [v == y])
#                    + (eps / V) * (W * p_v - w_v)
#                    + 2 * s * lse * p_v
#                    = a * p_v - (1 - eps) * w_y * [v == y] - (eps / V) * w_v,
#   with a = (1 - eps) * w_y + (eps / V) * W + 2 * s * lse.
# Softcap: d z_v / d x_v = 1 - tanh(x_v / c)^2 = 1 - (z_v / c)^2.
# The reduction multiplies every gradient by the upstream gradient and by 1 / D for the mean: the
# kernel reads that factor from ``grad_scale_ptr`` (one value, or one per row for "none"), so
# nothing waits for the host.
#
# Vocabulary-parallel mode (SHARDED, for fk.flce.vocab_parallel): the logits are one shard of the
# vocabulary and the labels are shard-local (a label outside [0, V_shard) belongs to another shard
# and is not an error). Pass 1 stores the shard's own lse, the label's logit z_y (0 when another
# shard holds it) in ``loss_ptr`` and sum_v z_v in ``z_loss_ptr``, for the caller to combine across
# shards; pass 2 reads the combined lse (LSE_GIVEN). ``weight_sum_ptr`` then holds the size of the
# whole vocabulary (the sum of all-one class weights over every shard), which smoothing divides by.
#
# One program handles rows pid, pid + P, ... (P a few per SM). Pass 1 streams the row once with an
# online softmax (running max m and sum s of exp(z - m), per lane); pass 2 streams it again to
# write the gradient. With few programs in flight, a row read by pass 1 is still in L2 for pass 2.


@triton.jit
def _softcapped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1), exact at both ends (exp overflow gives 1).
        return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
    return x


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,  # [N, V] logits, row stride logits_row_stride, unit column stride
    target_ptr,  # [N] int32/int64 labels
    class_weight_ptr,  # [V] class weights (unused when HAS_WEIGHT is False)
    weight_sum_ptr,  # [1] fp32: sum of the class weights (unused when HAS_WEIGHT is False)
    lse_ptr,  # [N] fp32 log-sum-exp: written by pass 1, or read when LSE_GIVEN
    loss_ptr,  # [N] fp32 per-token loss (written when COMPUTE_LOSS)
    z_loss_ptr,  # [N] fp32 per-token z-loss (written when STORE_Z_LOSS)
    correct_ptr,  # [N] fp32 1.0 where argmax == label (written when STORE_ACCURACY)
    grad_ptr,  # [N, V] gradient of the logits (written when COMPUTE_GRAD); may be logits_ptr
    grad_scale_ptr,  # fp32 factor on the gradient: [1], or [N] when ROW_SCALE
    n_rows,
    n_cols,
    logits_row_stride,
    grad_row_stride,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    LSE_GIVEN: tl.constexpr,  # skip pass 1: the forward saved lse
    COMPUTE_LOSS: tl.constexpr,
    STORE_Z_LOSS: tl.constexpr,
    STORE_ACCURACY: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    SHARDED: tl.constexpr,  # vocabulary-parallel mode (see above); never with HAS_WEIGHT or STORE_ACCURACY
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inv_classes = 1.0 / n_cols
    weight_sum = n_cols * 1.0
    if HAS_WEIGHT or SHARDED:
        weight_sum = tl.load(weight_sum_ptr)
    if SHARDED:
        inv_classes = 1.0 / weight_sum
    for row in range(pid, n_rows, n_programs):
        row64 = tl.cast(row, tl.int64)
        x_row = logits_ptr + row64 * logits_row_stride
        label = tl.load(target_ptr + row).to(tl.int64)
        ignored = label == ignore_index
        in_range = (label >= 0) & (label < n_cols)
        bad_label = (label != ignore_index) & ((label < 0) | (label >= n_cols))
        label_ok = (label != ignore_index) & in_range
        # Compare with the int32 column indices in int32 (V < 2^31): no 64-bit compare per element.
        label32 = tl.where(label_ok, label, -1).to(tl.int32)
        w_y = 1.0
        if HAS_WEIGHT:
            w_y = tl.load(class_weight_ptr + label, mask=label_ok, other=0.0).to(tl.float32)
        # Pass 1: online log-sum-exp, sum_v w_v z_v (smoothing) and the argmax (accuracy).
        if LSE_GIVEN:
            lse = tl.load(lse_ptr + row)
        else:
            # Per-lane accumulators, reduced once after the loop: no cross-warp reduction (and
            # barrier) per block, so the loads stream. Each lane keeps its own running max m and
            # sum s of exp(z - m); the lanes are combined as lse = M + log(sum s * exp(m - M)).
            # m starts finite so a lane that has seen only -inf (or nothing) never computes
            # exp(-inf + inf).
            m = tl.full([BLOCK], -1e30, tl.float32)
            s = tl.zeros([BLOCK], tl.float32)
            sum_wz = tl.zeros([BLOCK], tl.float32)
            best = tl.full([BLOCK], -float("inf"), tl.float32)
            best_idx = tl.full([BLOCK], n_cols, tl.int32)
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                mask = c < n_cols
                # evict_last: keep the row in L2 for pass 2.
                x = tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                # Columns past the end get -inf after the softcap (which would map -inf to -softcap).
                z = tl.where(mask, _softcapped(x, softcap, HAS_SOFTCAP), -float("inf"))
                # One exp per element: exp(-|z - m|) rescales the old sum when z is the new
                # maximum, and is the new term otherwise.
                e = tl.exp(-tl.abs(z - m))
                s = tl.where(z > m, s * e + 1.0, s + e)
                m = tl.maximum(m, z)
                if HAS_SMOOTHING:
                    if HAS_WEIGHT:
                        w = tl.load(class_weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
                        sum_wz += tl.where(mask, w * z, 0.0)
                    else:
                        sum_wz += tl.where(mask, z, 0.0)
                if STORE_ACCURACY:
                    # Strictly greater: within a lane the first of equal values stays.
                    better = z > best
                    best_idx = tl.where(better, c, best_idx)
                    best = tl.where(better, z, best)
            m_row = tl.max(m, axis=0)
            lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
            # The label's logit: one load, not a compare per element.
            x_y = tl.load(x_row + label, mask=label_ok, other=0.0).to(tl.float32)
            z_y = _softcapped(x_y, softcap, HAS_SOFTCAP)
            sum_wz = tl.sum(sum_wz, axis=0)
            tl.store(lse_ptr + row, lse)
            if SHARDED:
                # The parts the caller combines across shards (z_y is 0 for a label outside the shard).
                tl.store(loss_ptr + row, z_y)
                if HAS_SMOOTHING:
                    tl.store(z_loss_ptr + row, sum_wz)
            elif COMPUTE_LOSS:
                loss = (1.0 - label_smoothing) * w_y * (lse - z_y)
                if HAS_SMOOTHING:
                    loss += label_smoothing * inv_classes * (weight_sum * lse - sum_wz)
                z_loss = 0.0
                if HAS_Z_LOSS:
                    z_loss = lse_square_scale * lse * lse
                    loss += z_loss
                loss = tl.where(ignored, 0.0, loss)
                loss = tl.where(bad_label, float("nan"), loss)
                tl.store(loss_ptr + row, loss)
                if STORE_Z_LOSS:
                    tl.store(z_loss_ptr + row, tl.where(ignored, 0.0, z_loss))
            if STORE_ACCURACY:
                # The first index holding the row's maximum, as torch.argmax.
                argmax = tl.min(tl.where(best == tl.max(best, axis=0), best_idx, n_cols), axis=0)
                tl.store(correct_ptr + row, tl.where(argmax == label32, 1.0, 0.0))
        # Pass 2: the gradient, scaled by the reduction's factor.
        if COMPUTE_GRAD:
            g_row = grad_ptr + row64 * grad_row_stride
            scale = tl.load(grad_scale_ptr + row) if ROW_SCALE else tl.load(grad_scale_ptr)
            scale = tl.where(ignored, 0.0, scale)
            if not SHARDED:
                scale = tl.where(bad_label, float("nan"), scale)
            nll_coef = (1.0 - label_smoothing) * w_y
            a = nll_coef
            if HAS_SMOOTHING:
                a += label_smoothing * inv_classes * weight_sum
            if HAS_Z_LOSS:
                a += 2.0 * lse_square_scale * lse
            # Walk the blocks backwards: the ones pass 1 read last are likeliest still in L2.
            n_blocks = tl.cdiv(n_cols, BLOCK)
            for back in range(0, n_blocks):
                c = (n_blocks - 1 - back) * BLOCK + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                z = _softcapped(x, softcap, HAS_SOFTCAP)
                dz = a * tl.exp(z - lse) - tl.where(c == label32, nll_coef, 0.0)
                if HAS_SMOOTHING:
                    if HAS_WEIGHT:
                        w = tl.load(class_weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
                        dz -= label_smoothing * inv_classes * w
                    else:
                        dz -= label_smoothing * inv_classes
                if HAS_SOFTCAP:
                    zc = z / softcap
                    dz = dz * (1.0 - zc * zc)
                tl.store(g_row + c, (dz * scale).to(grad_ptr.dtype.element_ty), mask=mask)


# --- 3. Launchers, registered as custom ops -------------------------------------------------------


class LaunchParams(NamedTuple):
    programs_per_sm: int
    max_block: int  # columns per load
    num_warps: int  # for rows of 4096 columns or more (4 below)


# Launch parameters per use of the kernel (benchmarks/tune_flce.py sweeps each on a GPU): the
# forward reads the logits once, the backward (lse given) reads them and writes the gradient, and
# the fused pass of linear cross entropy reads each row twice and writes it once. On an H100 the
# fused pass gains most from wide loads (65% -> 72% of copy at 8192 x 128256); fewer rows in flight
# (one program per SM) did not pay: the SM then idles at each row's reductions.
LAUNCH = {
    "forward": LaunchParams(programs_per_sm=8, max_block=2048, num_warps=8),
    "backward": LaunchParams(programs_per_sm=8, max_block=2048, num_warps=8),
    "fused": LaunchParams(programs_per_sm=8, max_block=8192, num_warps=32),
}


class LossOptions(NamedTuple):
    """The options of the loss, as the kernels take them (validated by the functional APIs)."""

    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float  # 0.0: no softcap


def launch_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    options: LossOptions,
    *,
    lse: torch.Tensor,
    loss: torch.Tensor | None = None,
    z_loss: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    lse_given: bool = False,
    sharded: bool = False,
) -> None:
    """Run the kernel on 2-D ``logits`` (unit column stride): fills ``lse`` (or reads it when
    ``lse_given``), and each of ``loss``, ``z_loss``, ``correct`` and ``grad`` that is given.
    ``grad`` may be ``logits`` itself (the gradient overwrites the logits); ``grad_scale`` (fp32,
    one value or one per row) multiplies the gradient. ``sharded``: the vocabulary-parallel mode
    described above the kernel (``weight_sum`` then holds the whole vocabulary's size)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    dummy = lse
    params = LAUNCH["backward" if lse_given else "fused" if grad is not None else "forward"]
    grid = (min(n_rows, multiprocessor_count(logits.device) * params.programs_per_sm),)
    _cross_entropy_kernel[grid](
        logits, target,
        class_weight if class_weight is not None else dummy,
        weight_sum if weight_sum is not None else dummy,
        lse,
        loss if loss is not None else dummy,
        z_loss if z_loss is not None else dummy,
        correct if correct is not None else dummy,
        grad if grad is not None else logits,
        grad_scale if grad_scale is not None else dummy,
        n_rows, n_cols, logits.stride(0), grad.stride(0) if grad is not None else 0,
        options.ignore_index, options.label_smoothing, options.lse_square_scale, options.softcap,
        HAS_WEIGHT=class_weight is not None, HAS_SMOOTHING=options.label_smoothing > 0,
        HAS_SOFTCAP=options.softcap > 0, HAS_Z_LOSS=options.lse_square_scale != 0,
        LSE_GIVEN=lse_given, COMPUTE_LOSS=loss is not None, STORE_Z_LOSS=z_loss is not None,
        STORE_ACCURACY=correct is not None, COMPUTE_GRAD=grad is not None,
        ROW_SCALE=grad_scale is not None and grad_scale.numel() == n_rows and n_rows != 1, SHARDED=sharded,
        BLOCK=min(params.max_block, next_power_of_2(n_cols)), num_warps=params.num_warps if n_cols >= 4096 else 4,
    )  # fmt: skip


def mean_denominator(
    target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int, num_items: torch.Tensor | None
) -> torch.Tensor:
    """D of the mean reduction, as an fp32 0-dim tensor on the device (no host synchronization):
    ``num_items`` if given, else the summed class weights (or the count) of the tokens not ignored;
    1 where that is 0, so a mean over no items is 0."""
    if num_items is not None:
        d = num_items.to(torch.float32)
    else:
        valid = target != ignore_index
        if class_weight is not None:  # (a label outside [0, V) is not looked up: its loss is NaN)
            safe = torch.where(valid & (target >= 0) & (target < class_weight.shape[0]), target, 0)
            d = (class_weight.float()[safe] * valid).sum()
        else:
            d = valid.sum().to(torch.float32)
    return torch.where(d != 0, d, torch.ones_like(d))


def class_weight_sum(class_weight: torch.Tensor | None) -> torch.Tensor | None:
    return class_weight.float().sum().reshape(1) if class_weight is not None else None


def row_values(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized fp32 buffer with one value per row of ``t`` (loss, lse, accuracy, ...)."""
    return torch.empty(t.shape[0], dtype=torch.float32, device=t.device)


def _cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    num_items: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    store_accuracy: bool,
    inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward launcher: (loss, z_loss, lse, accuracy, denominator). loss and z_loss are reduced (a
    0-dim tensor, or one fp32 value per row for "none"); accuracy is empty unless asked for."""
    options = LossOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    lse, loss, z_loss = row_values(logits), row_values(logits), row_values(logits)
    correct = row_values(logits) if store_accuracy else logits.new_empty(0, dtype=torch.float32)
    launch_cross_entropy(
        logits, target, class_weight, class_weight_sum(class_weight), options,
        lse=lse, loss=loss, z_loss=z_loss if lse_square_scale != 0 else None,
        correct=correct if store_accuracy else None,
    )  # fmt: skip
    if lse_square_scale == 0:
        z_loss.zero_()
    denominator = mean_denominator(target, class_weight, ignore_index, num_items)
    if reduction == "none":
        return loss, z_loss, lse, correct, denominator
    if reduction == "sum":
        return loss.sum(), z_loss.sum(), lse, correct, denominator
    return loss.sum() / denominator, z_loss.sum() / denominator, lse, correct, denominator


def _cross_entropy_fwd_fake(
    logits: torch.Tensor, reduction: str, store_accuracy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = row_values(logits)
    reduced = rows if reduction == "none" else logits.new_empty((), dtype=torch.float32)
    correct = row_values(logits) if store_accuracy else logits.new_empty(0, dtype=torch.float32)
    return (
        reduced,
        torch.empty_like(reduced),
        torch.empty_like(rows),
        correct,
        logits.new_empty((), dtype=torch.float32),
    )


def _cross_entropy_bwd(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    denominator: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    inplace: bool,
) -> torch.Tensor:
    """Backward launcher: the gradient of the logits, written over ``logits`` when ``inplace``
    (the op then returns a new tensor only when it had to make logits contiguous)."""
    options = LossOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    src = logits if logits.stride(-1) == 1 else logits.contiguous()
    grad = src if inplace and src is logits else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    scale = grad_loss.float()
    if reduction == "mean":
        scale = scale / denominator
    launch_cross_entropy(
        src, target, class_weight, class_weight_sum(class_weight), options,
        lse=lse, grad=grad, grad_scale=scale.reshape(-1).contiguous(), lse_given=True,
    )  # fmt: skip
    return grad


def _cross_entropy_bwd_fake(logits: torch.Tensor) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    logits, target, class_weight, _num_items, *options, reduction, _accuracy, inplace_backward = inputs
    _loss, _z_loss, lse, _correct, denominator = output
    ctx.save_for_backward(logits, target, class_weight, lse, denominator)
    ctx.options = tuple(options)
    ctx.reduction = reduction
    ctx.inplace_backward = inplace_backward
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, grad_loss: torch.Tensor | None, *_rest: Any) -> tuple[Any, ...]:
    logits, target, class_weight, lse, denominator = ctx.saved_tensors
    none = (None,) * 10
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return (None, *none)
    # In place only in eager mode: a custom op (the torch.compile path) may not return its input.
    inplace = ctx.inplace_backward and run_backward is _cross_entropy_bwd
    grad = run_backward(grad_loss, logits, target, class_weight, lse, denominator, *ctx.options, ctx.reduction, inplace)
    if inplace:
        mark_overwritten(grad, logits)
    return (grad, *none)


_cross_entropy = define_autograd_op(
    __name__, "cross_entropy",
    forward=_cross_entropy_fwd, forward_fake=fake_from(_cross_entropy_fwd, _cross_entropy_fwd_fake),
    backward_launcher=_cross_entropy_bwd, backward_fake=fake_from(_cross_entropy_bwd, _cross_entropy_bwd_fake),
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip
# No mutates_args: the custom ops (the torch.compile path) never write in place; only the eager
# path does, which calls the launcher directly. Declaring logits as mutated makes AOT autograd
# refuse a leaf logits tensor (torch 2.11).


# --- 4. Functional API ----------------------------------------------------------------------------


def check_loss_options(
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
) -> LossOptions:
    """Validate the options shared by :func:`cross_entropy` and ``linear_cross_entropy``."""
    validate.check_int("ignore_index", ignore_index)
    validate.check_choice("reduction", reduction, REDUCTIONS)
    for name, value in (("label_smoothing", label_smoothing), ("lse_square_scale", lse_square_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite float, got {value!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if lse_square_scale < 0:
        raise ValueError(f"lse_square_scale must be >= 0, got {lse_square_scale}")
    cap = 0.0 if softcap is None else validate.check_positive_float("softcap", softcap)
    if not math.isfinite(cap):
        raise ValueError(f"softcap must be finite, got {softcap}")
    return LossOptions(ignore_index, float(label_smoothing), float(lse_square_scale), cap)


def check_target(target: object, expected_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Labels: an int32/int64 tensor of ``expected_shape`` on ``device``. Their values are checked
    apart, by :func:`fk.core.validate.check_labels` (see the module docstring)."""
    target = validate.check_tensor("target", target)
    validate.check_dtype("target", target, LABEL_DTYPES)
    if tuple(target.shape) != expected_shape:
        raise ValueError(f"target must have shape {expected_shape}, got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"target must be on the device of the logits ({device}), got {target.device}")
    return target


def check_class_weight(class_weight: torch.Tensor | None, n_classes: int, name: str, device: torch.device) -> None:
    if class_weight is None:
        return
    validate.check_tensor(name, class_weight)
    validate.check_dtype(name, class_weight)
    validate.check_shape(name, class_weight, (n_classes,))
    if class_weight.device != device:
        raise ValueError(f"{name} must be on the device of the logits ({device}), got {class_weight.device}")


def check_num_items(num_items: object, reduction: str, device: torch.device) -> torch.Tensor | None:
    """``num_items_in_batch``: a positive number or a one-element tensor; only with reduction="mean"."""
    if num_items is None:
        return None
    if reduction != "mean":
        raise ValueError(
            f"num_items_in_batch replaces the mean's denominator; it needs reduction='mean', got {reduction!r}"
        )
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items_in_batch must have one element, got shape {tuple(num_items.shape)}")
        if num_items.device.type == "cpu" and device.type != "cpu":
            # read on the host (no GPU synchronization; a host-to-device copy would wait for the
            # GPU), unchecked like a device tensor
            return torch.full((), float(num_items.item()), dtype=torch.float32, device=device)
        # (on another GPU, as under nn.DataParallel: a device-to-device copy, no host wait)
        return num_items.reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not num_items > 0:
        raise ValueError(f"num_items_in_batch must be a positive number or a tensor, got {num_items!r}")
    # torch.full fills on the device: torch.tensor(..., device=cuda) would copy from the host and
    # make the host wait for the GPU
    return torch.full((), float(num_items), dtype=torch.float32, device=device)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    return_lse: bool = False,
    return_z_loss: bool = False,
    return_accuracy: bool = False,
    inplace_backward: bool = False,
) -> Any:
    """Cross entropy of 2-D ``logits`` ``(N, V)`` and labels ``target`` ``(N,)``, as ``F.cross_entropy``.

    Every argument after ``weight`` is keyword-only: ``F.cross_entropy`` has its deprecated
    ``size_average`` and ``reduce`` in between, so a positional call written for it would bind its
    arguments to other parameters here.

    Args:
        logits: ``(N, V)`` fp32/fp16/bf16; any row stride.
        target: ``(N,)`` int64/int32 class indices, or ``ignore_index``. A label outside ``[0, V)``
            raises a ``ValueError`` on the CPU; on a GPU it gives that token a NaN loss and NaN
            gradients unless ``FK_CHECK_LABELS=1`` (see the module docstring).
        weight: optional ``(V,)`` class weights, as in ``F.cross_entropy``.
        ignore_index, reduction, label_smoothing: as in ``F.cross_entropy``.
        lse_square_scale: z-loss scale ``s``: adds ``s * lse^2`` to each token's loss.
        softcap: if given, the logits are replaced by ``softcap * tanh(logits / softcap)`` first.
        num_items_in_batch: the mean's denominator instead of the count of tokens (gradient
            accumulation: pass the number of items in the whole batch); reduction must be "mean".
        return_lse, return_z_loss, return_accuracy: also return these (see :class:`CrossEntropyOutput`).
            The z-loss output is for logging: it is part of ``loss`` and not differentiable itself.
        inplace_backward: write the gradient over ``logits`` in the backward instead of allocating
            a new ``(N, V)`` buffer (eager mode only). Use it only when nothing else reads the logits
            after the backward, e.g. logits made for the loss alone. The logits' version is bumped,
            so an op that saved them for its own backward raises instead of reading the gradient;
            a leaf that requires grad is refused (``ValueError``).

    Returns the loss in the dtype of ``logits``, or a :class:`CrossEntropyOutput` when any
    ``return_*`` is set. The forward reads the logits once; the backward reads them once more and
    writes their gradient, from the saved log-sum-exp.
    """
    validate.check_tensor("logits", logits)
    validate.check_dtype("logits", logits)
    validate.check_ndim("logits", logits, 2)
    if logits.shape[1] == 0:
        raise ValueError(f"logits must have at least one class, got shape {tuple(logits.shape)}")
    options = check_loss_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    target = check_target(target, (logits.shape[0],), logits.device)
    validate.check_labels("target", target, logits.shape[1], ignore_index)
    check_class_weight(weight, logits.shape[1], "weight", logits.device)
    num_items = check_num_items(num_items_in_batch, reduction, logits.device)
    if inplace_backward and torch.is_grad_enabled():
        validate.check_overwritable("logits", logits, "inplace_backward")
    if not uses_kernel(logits):
        out = cross_entropy_ref(logits, target, weight, ignore_index=ignore_index, reduction=reduction,
                                label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
                                num_items=num_items)  # fmt: skip
    else:
        loss, z_loss, lse, correct, _ = _cross_entropy(logits, target, weight, num_items, *options, reduction,
                                                       return_accuracy, inplace_backward)  # fmt: skip
        out = CrossEntropyOutput(loss.to(logits.dtype), lse, z_loss.to(logits.dtype), correct)
    if not (return_lse or return_z_loss or return_accuracy):
        return out.loss
    return CrossEntropyOutput(
        out.loss,
        out.lse if return_lse else None,
        out.z_loss if return_z_loss else None,
        out.accuracy if return_accuracy else None,
    )


# --- 5. Module ------------------------------------------------------------------------------------


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` on 2-D logits, running fk's kernel.

    Extra keyword arguments ``lse_square_scale`` and ``softcap`` are as in :func:`cross_entropy`.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
    ) -> None:
        super().__init__(weight=weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        check_loss_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(
            input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale, softcap=self.softcap,
        )  # fmt: skip
