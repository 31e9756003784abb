"""Fused linear + cross entropy: the loss of ``hidden @ weight.T (+ bias)`` without the full logits.

The ``[tokens, vocab]`` logits (and their fp32 copies) are the largest activation of LLM training.
Here the tokens are processed in chunks whose logits fit a memory budget, by the chunk engine of
:mod:`fk.flce.chunks`. For each chunk:

1. ``logits = h_c @ W^T (+ b)`` (one matmul, in the dtype of ``hidden``);
2. the cross-entropy kernel of :mod:`fk.flce.cross_entropy` computes the loss and log-sum-exp of
   each row and writes ``d loss / d logits`` over the logits, in place (already divided by the
   mean's denominator, which is computed on the device from the labels: no host synchronization);
3. ``dh_c = dlogits @ W`` goes straight into its rows of the hidden gradient, and
   ``dW += dlogits^T @ h_c`` accumulates into an fp32 buffer (``accum_dtype``) through
   ``torch.addmm(..., out_dtype=torch.float32)``: one kernel, no temporaries; ``db += sum(dlogits)``.

The gradients are thus ready when the forward ends; the backward multiplies them by the upstream
gradient (a scalar for "mean" and "sum") and casts the weight gradient to the weight's dtype in
one pass. That costs 6 N H V FLOPs in all (4 N H V with a frozen weight, whose gradient is never
computed). With ``reduction="none"`` the upstream gradient differs per token, so the forward only
computes the loss and the backward recomputes each chunk's logits (8 N H V FLOPs).

The order of the file: the reference, the launchers registered as custom ops (the cross-entropy
kernel on the engine's chunks; no kernel of their own), the functional API
:func:`linear_cross_entropy` and the module :class:`LinearCrossEntropyLoss`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.ops import define_autograd_op, fake_from
from fk.flce.chunks import (
    DEFAULT_MEMORY_BUDGET,
    ChunkLoss,
    backward_fakes,
    chunk_tokens_for,
    empty_output,
    head_grad_fakes,
    head_grads,
    input_grads,
    row_scale,
    scale_grads,
)
from fk.flce.cross_entropy import (
    CrossEntropyOutput,
    LossOptions,
    check_class_weight,
    check_loss_options,
    check_num_items,
    check_target,
    class_weight_sum,
    cross_entropy_ref,
    launch_cross_entropy,
    mean_denominator,
    row_values,
)

# --- 1. Reference ---------------------------------------------------------------------------------


def shift_labels(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Causal-LM labels: position t is scored against ``target[..., t + 1]``; the last position of
    each sequence against nothing (``ignore_index``). Only the small label tensor is copied."""
    return F.pad(target[..., 1:], (0, 1), value=ignore_index)


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> CrossEntropyOutput:
    """Plain PyTorch: the full logits in the dtype of ``hidden``, then :func:`cross_entropy_ref` on
    them in fp32 (fp64 for fp64 inputs), so the loss comes back in fp32 as the kernel path's does.

    This is the definition the kernels are tested against (and what eager training code does), and
    the path of CPU tensors without Triton's interpreter.
    """
    if shift:
        target = shift_labels(target, ignore_index)
    logits = F.linear(hidden, weight, bias).reshape(-1, weight.shape[0])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    out = cross_entropy_ref(logits, target.reshape(-1), class_weight, ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
                            num_items=num_items_in_batch)  # fmt: skip
    rows = target.shape
    if reduction == "none":
        return CrossEntropyOutput(out.loss.reshape(rows), out.lse.reshape(rows),  # type: ignore[union-attr]
                                  out.z_loss.reshape(rows), out.accuracy.reshape(rows))  # type: ignore[union-attr]  # fmt: skip
    return CrossEntropyOutput(out.loss, out.lse.reshape(rows), out.z_loss, out.accuracy.reshape(rows))  # type: ignore[union-attr]


# --- 2. Launchers, registered as custom ops -------------------------------------------------------

# (loss, z_loss, lse, accuracy, denominator, dh, dw, db, dlogits): torch.library needs the arity spelled out.
Outputs = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]


def _cross_entropy_chunks(
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    options: LossOptions,
    grad_scale: torch.Tensor,
    *,
    lse: torch.Tensor,
    lse_given: bool,
    loss: torch.Tensor | None = None,
    z_loss: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
) -> ChunkLoss:
    """The cross-entropy kernel as each chunk's loss: in the forward (loss, and the gradient when
    asked for) and in the recomputing backward of reduction "none" (``lse_given``; ``grad_scale``
    per row)."""
    weight_sum = class_weight_sum(class_weight)

    def chunk_loss(logits: torch.Tensor, rows: slice, want_grad: bool) -> None:
        launch_cross_entropy(
            logits, target[rows], class_weight, weight_sum, options,
            lse=lse[rows], lse_given=lse_given,
            loss=loss[rows] if loss is not None else None,
            z_loss=z_loss[rows] if z_loss is not None else None,
            correct=correct[rows] if correct is not None else None,
            grad=logits if want_grad else None, grad_scale=row_scale(grad_scale, rows),
        )  # fmt: skip

    return chunk_loss


def _lce_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    num_items: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    store_accuracy: bool,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    """Forward launcher on 2-D ``hidden`` ``(N, H)``: returns (loss, z_loss, lse, accuracy,
    denominator, dh, dw, db, dlogits). The gradients (empty when not computed) are those of the loss
    for an upstream gradient of 1, as :func:`fk.flce.chunks.head_grads` returns them."""
    options = LossOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    lse, loss = row_values(hidden), row_values(hidden)
    z_loss = row_values(hidden) if lse_square_scale != 0 else torch.zeros_like(lse)
    correct = row_values(hidden) if store_accuracy else empty_output(hidden, torch.float32)
    denominator = mean_denominator(target, class_weight, ignore_index, num_items)
    grad_scale = (1.0 / denominator if reduction == "mean" else torch.ones_like(denominator)).reshape(1)
    chunk_loss = _cross_entropy_chunks(target, class_weight, options, grad_scale, lse=lse, lse_given=False, loss=loss,
                                       z_loss=z_loss if lse_square_scale != 0 else None,
                                       correct=correct if store_accuracy else None)  # fmt: skip
    grads = head_grads(hidden, weight, bias, chunk_tokens, chunk_loss, accum_fp32, compute_dh, compute_dw, compute_db)
    if reduction == "mean":
        loss, z_loss = loss.sum() / denominator, z_loss.sum() / denominator
    elif reduction == "sum":
        loss, z_loss = loss.sum(), z_loss.sum()
    return (loss, z_loss, lse, correct, denominator, *grads)


def _lce_fwd_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    reduction: str,
    store_accuracy: bool,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    rows = row_values(hidden)
    reduced = torch.empty_like(rows) if reduction == "none" else rows.new_empty(())
    return (
        reduced, torch.empty_like(reduced), torch.empty_like(rows),
        torch.empty_like(rows) if store_accuracy else empty_output(hidden, torch.float32), rows.new_empty(()),
        *head_grad_fakes(hidden, weight, bias, chunk_tokens, accum_fp32, compute_dh, compute_dw, compute_db),
    )  # fmt: skip


def _lce_bwd(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    dh_saved: torch.Tensor,
    dw_saved: torch.Tensor,
    db_saved: torch.Tensor,
    logits_grad: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    chunk_tokens: int,
    accum_fp32: bool,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    precomputed: bool,
    inplace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: (dh, dw, db), each an empty tensor when not needed.

    ``precomputed`` (reductions "mean" and "sum"): the forward's gradients scaled by ``grad_loss``
    (:func:`fk.flce.chunks.scale_grads`, which says what ``inplace`` does). Otherwise (reduction
    "none") each chunk's logits are recomputed and each row's gradient scaled by its own upstream
    gradient (:func:`fk.flce.chunks.head_grads` with ``recompute``).
    """
    if not precomputed:
        options = LossOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
        chunk_loss = _cross_entropy_chunks(target, class_weight, options, grad_loss.float().reshape(-1).contiguous(),
                                           lse=lse, lse_given=True)  # fmt: skip
        dh_saved, dw_saved, db_saved, _ = head_grads(hidden, weight, bias, chunk_tokens, chunk_loss, accum_fp32,
                                                     need_dh, need_dw, need_db, recompute=True)  # fmt: skip
        grad_loss = torch.ones((), dtype=torch.float32, device=hidden.device)
    return scale_grads(grad_loss, hidden, weight, bias, dh_saved, dw_saved, db_saved, logits_grad,
                       need_dh, need_dw, need_db, inplace)  # fmt: skip


_N_INPUTS = 17


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    (hidden, weight, bias, target, class_weight, _num_items, ignore_index, label_smoothing, lse_square_scale,
     softcap, _reduction, _accuracy, chunk_tokens, accum_fp32, compute_dh, compute_dw, compute_db) = inputs  # fmt: skip
    _loss, _z_loss, lse, _correct, _denominator, dh, dw, db, logits_grad = output
    ctx.precomputed = compute_dh or compute_dw or compute_db
    if ctx.precomputed:
        ctx.save_for_backward(hidden, weight, bias, dh, dw, db, logits_grad)
    else:  # reduction "none": the backward recomputes the logits
        ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse)
    ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, chunk_tokens, accum_fp32)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, grad_loss: torch.Tensor | None, *_rest: Any) -> tuple[Any, ...]:
    needs = need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_loss is None or not (need_dh or need_dw or need_db):
        return input_grads(None, needs, _N_INPUTS)
    if ctx.precomputed:
        hidden, weight, bias, dh, dw, db, logits_grad = ctx.saved_tensors
        target, class_weight, lse = hidden.new_empty(0, dtype=torch.long), None, empty_output(hidden, torch.float32)
    else:
        hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
        dh = dw = db = logits_grad = hidden.new_empty(0)
    # In place only in eager mode: a custom op (the torch.compile path) may not return its input.
    inplace = run_backward is _lce_bwd
    grads = run_backward(grad_loss, hidden, weight, bias, target, class_weight, lse, dh, dw, db, logits_grad,
                         *ctx.options, need_dh, need_dw, need_db, ctx.precomputed, inplace)  # fmt: skip
    return input_grads(grads, needs, _N_INPUTS)


_linear_cross_entropy = define_autograd_op(
    __name__, "linear_cross_entropy",
    forward=_lce_fwd, forward_fake=fake_from(_lce_fwd, _lce_fwd_fake),
    backward_launcher=_lce_bwd, backward_fake=fake_from(_lce_bwd, backward_fakes),
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 3. Functional API ----------------------------------------------------------------------------


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    shift: bool,
    num_items_in_batch: torch.Tensor | float | None,
    accum_dtype: torch.dtype | None,
    memory_budget: int,
    vocab_size: int | None = None,
) -> tuple[LossOptions, torch.Tensor, torch.Tensor | None]:
    """Validate the arguments of :func:`linear_cross_entropy` (and of its vocabulary-parallel
    sibling, whose ``weight`` is a shard and which gives the whole vocabulary's ``vocab_size``, the
    labels' range; by default the weight's rows): returns the options, the labels (shifted when
    ``shift``) and ``num_items_in_batch`` as an fp32 0-dim tensor (or None)."""
    validate.check_tensor("hidden", hidden)
    validate.check_dtype("hidden", hidden)
    validate.check_min_ndim("hidden", hidden, 1)
    validate.check_tensor("weight", weight)
    validate.check_ndim("weight", weight, 2)
    validate.check_same_dtype("weight", weight, "hidden", hidden)
    validate.check_same_device("weight", weight, "hidden", hidden)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape (V, {hidden.shape[-1]}) to match hidden, got {tuple(weight.shape)}")
    n_classes = weight.shape[0]
    if n_classes == 0:
        raise ValueError("weight must have at least one row (class)")
    if bias is not None:
        validate.check_tensor("bias", bias)
        validate.check_same_dtype("bias", bias, "hidden", hidden)
        validate.check_shape("bias", bias, (n_classes,))
        validate.check_same_device("bias", bias, "hidden", hidden)
    options = check_loss_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    target = check_target(target, tuple(hidden.shape[:-1]), hidden.device)
    check_class_weight(class_weight, n_classes, "class_weight", hidden.device)
    num_items = check_num_items(num_items_in_batch, reduction, hidden.device)
    if accum_dtype is not None and accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be torch.float32 or weight's dtype ({weight.dtype}), got {accum_dtype}")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    if shift and hidden.ndim < 2:
        raise ValueError(f"shift=True needs hidden of shape (..., T, H), got {tuple(hidden.shape)}")
    # On the labels as given, so an error names a position in them; a shift never scores the first.
    validate.check_labels("target", target, n_classes if vocab_size is None else vocab_size, ignore_index,
                          scored_from=1 if shift else 0)  # fmt: skip
    if shift:
        target = shift_labels(target, ignore_index)
    return options, target, num_items


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    num_items_in_batch: torch.Tensor | float | None = None,
    return_lse: bool = False,
    return_z_loss: bool = False,
    return_accuracy: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Any:
    """Cross entropy of ``hidden @ weight.T + bias`` against ``target``, without the full logits.

    Args:
        hidden: ``(..., H)`` fp32/fp16/bf16 (any strides; made contiguous inside if it is not).
        weight: ``(V, H)`` the LM head, same dtype as ``hidden``. When it does not require grad
            (a frozen head, as in LoRA) its gradient is not computed at all.
        target: ``hidden.shape[:-1]`` int64/int32 labels (or ``ignore_index``). A label outside
            ``[0, V)`` raises a ``ValueError`` on the CPU that names its position in ``target`` as
            given (with ``shift``, too); on a GPU it gives that token a NaN loss and NaN gradients
            (NaN in the whole weight and bias gradients, which sum over the tokens) unless
            ``FK_CHECK_LABELS=1``, as :func:`fk.flce.cross_entropy` describes.
        bias: optional ``(V,)``.
        class_weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        num_items_in_batch, return_lse, return_z_loss, return_accuracy: as in
            :func:`fk.flce.cross_entropy` (``class_weight`` is its ``weight``).
        shift: causal-LM shift: position t is scored against ``target[..., t + 1]`` and the last
            position of each sequence is ignored, as Hugging Face's causal-LM loss does. No copy
            of ``hidden`` is made.
        accum_dtype: dtype the weight gradient accumulates in across chunks: fp32 by default;
            ``weight.dtype`` saves ``V * H * 4`` bytes at the cost of one rounding per chunk.
        memory_budget: bytes for one chunk of logits (see :data:`DEFAULT_MEMORY_BUDGET`).

    Returns the loss (fp32 for reduction "mean"/"sum"; one value per token for "none", shaped like
    ``target``), or a :class:`fk.flce.CrossEntropyOutput` when any ``return_*`` is set.
    """
    options, target, num_items = check_inputs(
        hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, lse_square_scale,
        softcap, shift, num_items_in_batch, accum_dtype, memory_budget,
    )  # fmt: skip
    n_classes = weight.shape[0]
    if not uses_kernel(hidden):
        out = linear_cross_entropy_ref(hidden, weight, target, bias, class_weight=class_weight,
                                       ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                                       lse_square_scale=lse_square_scale, softcap=softcap,
                                       num_items_in_batch=num_items)  # fmt: skip
    else:
        rows_shape = target.shape
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        if hidden2d.stride(-1) != 1 or hidden2d.stride(0) != hidden2d.shape[1]:
            hidden2d = hidden2d.contiguous()
        grad_on = torch.is_grad_enabled()
        in_forward = grad_on and reduction != "none"
        # (Balanced chunks in eager mode only: under torch.compile the token count may be symbolic.)
        n_tokens = None if torch.compiler.is_compiling() else hidden2d.shape[0]
        loss, z_loss, lse, correct, *_ = _linear_cross_entropy(
            hidden2d, weight, bias, target.reshape(-1), class_weight, num_items, *options, reduction,
            return_accuracy, chunk_tokens_for(memory_budget, n_classes, hidden.element_size(), n_tokens),
            accum_dtype != weight.dtype, in_forward and hidden.requires_grad, in_forward and weight.requires_grad,
            in_forward and bias is not None and bias.requires_grad,
        )  # fmt: skip
        if reduction == "none":
            loss, z_loss = loss.reshape(rows_shape), z_loss.reshape(rows_shape)
        out = CrossEntropyOutput(loss, lse.reshape(rows_shape), z_loss,
                                 correct.reshape(rows_shape) if return_accuracy else None)  # fmt: skip
    if not (return_lse or return_z_loss or return_accuracy):
        return out.loss
    return CrossEntropyOutput(out.loss, out.lse if return_lse else None, out.z_loss if return_z_loss else None,
                              out.accuracy if return_accuracy else None)  # fmt: skip


# --- 4. Module ------------------------------------------------------------------------------------


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of an LM head without its logits: ``forward(hidden, weight, target, bias=None,
    num_items_in_batch=None)``. Every keyword of :func:`linear_cross_entropy` (but the tensors)
    is a constructor argument."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        allowed = {"class_weight", "ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap",
                   "shift", "accum_dtype", "memory_budget"}  # fmt: skip
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        check_loss_options(options.get("ignore_index", -100), options.get("reduction", "mean"),
                           options.get("label_smoothing", 0.0), options.get("lse_square_scale", 0.0),
                           options.get("softcap"))  # fmt: skip
        self.options = options

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        out: torch.Tensor = linear_cross_entropy(hidden, weight, target, bias, num_items_in_batch=num_items_in_batch,
                                                 **self.options)  # fmt: skip
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items() if not isinstance(v, torch.Tensor))
