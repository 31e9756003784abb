"""Fused linear + cross entropy: the loss of ``hidden @ weight.T (+ bias)`` without the full logits.

The ``[tokens, vocab]`` logits (and their fp32 copies) are the largest activation of LLM training.
Here the tokens are processed in chunks whose logits fit a memory budget. For each chunk:

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

The order of the file: the reference, the scale-and-cast kernel, the launchers registered as
custom ops, the functional API :func:`linear_cross_entropy` and the module
:class:`LinearCrossEntropyLoss`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import cdiv
from fk.core.matmul import accumulate_mm, column_sum
from fk.core.ops import define_autograd_op
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

DEFAULT_MEMORY_BUDGET = 4 << 30
"""Bytes for the logits of one chunk (4 GiB: 16384 tokens of a 128256-word vocabulary in bf16).
When all tokens fit one chunk, its logits' gradient is kept for the backward; with several
chunks, the fp32 weight-gradient accumulator (``V * H * 4`` bytes) comes on top. The returned
gradients come on top in both cases."""


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


# --- 2. Kernel ------------------------------------------------------------------------------------


@triton.jit
def _scale_cast_blocks(src_ptr, dst_ptr, scale, n_elements, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """This program's ``BLOCKS`` blocks of ``dst = src * scale``."""
    first = tl.program_id(0).to(tl.int64) * (BLOCK * BLOCKS)
    for i in range(BLOCKS):
        offsets = first + i * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n_elements
        src = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offsets, (src * scale).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_cast_kernel(
    src_ptr, dst_ptr, scale_ptr, n_elements, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, IN_PLACE: tl.constexpr
):
    """dst = src * scale, rounded to dst's dtype: the weight gradient in one pass over the fp32
    accumulator (two torch ops would write an fp32 temporary of the whole weight). In place
    (``IN_PLACE``: dst is src), a scale of exactly 1 leaves every element as it is, so the pass is
    skipped on the device: no host synchronization reads the scale."""
    scale = tl.load(scale_ptr)
    if IN_PLACE:
        if scale != 1.0:
            _scale_cast_blocks(src_ptr, dst_ptr, scale, n_elements, BLOCK, BLOCKS)
    else:
        _scale_cast_blocks(src_ptr, dst_ptr, scale, n_elements, BLOCK, BLOCKS)


SCALE_CAST_BLOCK = 4096
SCALE_CAST_BLOCKS = 1
"""Blocks per program of a pass into a new tensor."""
SCALE_CAST_BLOCKS_IN_PLACE = 4
"""Blocks per program of a pass in place: fewer programs make a skipped pass cheaper (14 against
43 us for the 128256 x 2048 head gradient on an H200) and a done one 3% slower
(``benchmarks/experiments/INDEX.md#scale_cast_blocks``)."""


def _scale_cast(
    src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``src * scale`` (``scale``: one fp32 value on the device) rounded to ``dtype``, into ``out``
    (contiguous, ``src``'s shape and ``dtype``; may be ``src`` itself) or a new tensor. In place
    this replaces ``src.mul_(scale)``, which for a bf16 ``src`` and an fp32 ``scale`` takes
    PyTorch's generic mixed-dtype path: 1.2 ms for the 0.5 GiB head gradient of a 128256 x 2048
    vocabulary on an H200, where this pass takes about 0.25 ms, and none when the scale is 1 (a
    plain ``loss.backward()``). Written in place, ``src``'s version counter goes up as an in-place
    op's would: a second backward that would read the scaled buffer raises autograd's in-place
    error."""
    dst = torch.empty(src.shape, dtype=dtype, device=src.device) if out is None else out
    n = src.numel()
    if n:
        blocks = SCALE_CAST_BLOCKS_IN_PLACE if dst is src else SCALE_CAST_BLOCKS
        grid = (cdiv(n, SCALE_CAST_BLOCK * blocks),)
        _scale_cast_kernel[grid](src, dst, scale, n, BLOCK=SCALE_CAST_BLOCK, BLOCKS=blocks, IN_PLACE=dst is src,
                                 num_warps=8)  # fmt: skip
    if dst is src:
        torch.autograd.graph.increment_version(src)
    return dst


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

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


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T (+ bias)`` written into ``out``."""
    return torch.addmm(bias, h, weight.t(), out=out) if bias is not None else torch.mm(h, weight.t(), out=out)


def _run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    options: LossOptions,
    chunk_tokens: int,
    grad_scale: torch.Tensor | None,
    *,
    lse: torch.Tensor,
    lse_given: bool,
    loss: torch.Tensor | None,
    z_loss: torch.Tensor | None,
    correct: torch.Tensor | None,
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    keep_logits_grad: bool = False,
) -> torch.Tensor | None:
    """The chunk loop shared by the forward (loss, and the gradients when asked for) and the
    recomputing backward of reduction "none" (``lse_given``; ``grad_scale`` per row). With
    ``keep_logits_grad`` (one chunk only) the gradient of the logits is computed and returned."""
    n_tokens = hidden.shape[0]
    weight_sum = class_weight_sum(class_weight)
    want_grad = dh is not None or dw is not None or db is not None or keep_logits_grad
    logits = None
    # One logits buffer for every chunk: a new one per chunk would hold two chunks at a time.
    buffer = hidden.new_empty((min(chunk_tokens, n_tokens), weight.shape[0]))
    for index, start in enumerate(range(0, n_tokens, chunk_tokens)):
        end = min(start + chunk_tokens, n_tokens)
        h = hidden[start:end]
        logits = _chunk_logits(h, weight, bias, out=buffer[: end - start])
        scale = grad_scale[start:end] if grad_scale is not None and grad_scale.numel() > 1 else grad_scale
        launch_cross_entropy(
            logits, target[start:end], class_weight, weight_sum, options,
            lse=lse[start:end], lse_given=lse_given,
            loss=loss[start:end] if loss is not None else None,
            z_loss=z_loss[start:end] if z_loss is not None else None,
            correct=correct[start:end] if correct is not None else None,
            grad=logits if want_grad else None, grad_scale=scale,
        )  # fmt: skip
        chunk_grads(logits, h, weight, dh[start:end] if dh is not None else None, dw, db, first=index == 0)
    return logits if keep_logits_grad else None


def chunk_grads(
    logits_grad: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    dh_rows: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    *,
    first: bool,
) -> None:
    """One chunk's share of the gradients, from its logits' gradient: ``dh_rows = dlogits @ W``,
    ``dw (=|+=) dlogits^T @ h`` (``first``: the first chunk overwrites) and ``db += sum(dlogits)``."""
    if dh_rows is not None:
        torch.mm(logits_grad, weight, out=dh_rows)
    if dw is not None:
        accumulate_mm(dw, logits_grad.t(), h, first=first)
    if db is not None:
        db += column_sum(logits_grad)


def _accum_buffers(
    hidden: torch.Tensor, weight: torch.Tensor, compute_dh: bool, compute_dw: bool, compute_db: bool, accum_fp32: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    dh = torch.empty_like(hidden) if compute_dh else None
    accum = torch.float32 if accum_fp32 else weight.dtype
    # Zeros only when no chunk will write it (no tokens); otherwise the first chunk overwrites it.
    alloc = torch.zeros if hidden.shape[0] == 0 else torch.empty
    dw = alloc(weight.shape, dtype=accum, device=weight.device) if compute_dw else None
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if compute_db else None
    return dh, dw, db


def _nothing(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh empty tensor for an output that is not computed (a custom op's outputs may not alias)."""
    return like.new_empty(0, dtype=dtype)


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
    for an upstream gradient of 1: dw in the accumulation dtype, db in fp32; dlogits, the logits'
    gradient, only when all tokens fit one chunk and the backward is to compute dw from it."""
    options = LossOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    lse, loss = row_values(hidden), row_values(hidden)
    z_loss = row_values(hidden) if lse_square_scale != 0 else torch.zeros_like(lse)
    correct = row_values(hidden) if store_accuracy else _nothing(hidden, torch.float32)
    denominator = mean_denominator(target, class_weight, ignore_index, num_items)
    grad_scale = (1.0 / denominator if reduction == "mean" else torch.ones_like(denominator)).reshape(1)
    # All tokens in one chunk: keep the gradient of the logits and leave dW = dlogits^T @ h to the
    # backward, which folds the upstream gradient into h (a small tensor) and writes dW once in the
    # weight's dtype, summed in fp32 inside the matmul. Several chunks: accumulate dW here.
    defer_dw = compute_dw and 0 < hidden.shape[0] <= chunk_tokens
    dh, dw, db = _accum_buffers(hidden, weight, compute_dh, compute_dw and not defer_dw,
                                compute_db and bias is not None, accum_fp32)  # fmt: skip
    logits_grad = _run_chunks(
        hidden, weight, bias, target, class_weight, options, chunk_tokens, grad_scale,
        lse=lse, lse_given=False, loss=loss, z_loss=z_loss if lse_square_scale != 0 else None,
        correct=correct if store_accuracy else None, dh=dh, dw=dw, db=db, keep_logits_grad=defer_dw,
    )  # fmt: skip
    if reduction == "mean":
        loss, z_loss = loss.sum() / denominator, z_loss.sum() / denominator
    elif reduction == "sum":
        loss, z_loss = loss.sum(), z_loss.sum()
    return (loss, z_loss, lse, correct, denominator,
            dh if dh is not None else _nothing(hidden), dw if dw is not None else _nothing(hidden),
            db if db is not None else _nothing(hidden, torch.float32),
            logits_grad if logits_grad is not None else _nothing(hidden))  # fmt: skip


def _lce_fwd_fake(
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
    rows = row_values(hidden)
    reduced = torch.empty_like(rows) if reduction == "none" else rows.new_empty(())
    return (
        reduced, torch.empty_like(reduced), torch.empty_like(rows),
        torch.empty_like(rows) if store_accuracy else _nothing(hidden, torch.float32), rows.new_empty(()),
        *forward_grad_fakes(hidden, weight, bias, chunk_tokens, accum_fp32, compute_dh, compute_dw, compute_db),
    )  # fmt: skip


def forward_grad_fakes(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake (dh, dw, db, dlogits) of a forward launcher that computes the gradients (see
    :func:`_lce_fwd`): dw in the accumulation dtype unless dlogits is kept for the backward."""
    accum = torch.float32 if accum_fp32 else weight.dtype
    defer_dw = compute_dw and 0 < hidden.shape[0] <= chunk_tokens
    return (
        torch.empty_like(hidden) if compute_dh else _nothing(hidden),
        weight.new_empty(weight.shape, dtype=accum) if compute_dw and not defer_dw else _nothing(hidden),
        hidden.new_empty(weight.shape[0], dtype=torch.float32) if compute_db and bias is not None
        else _nothing(hidden, torch.float32),
        hidden.new_empty((hidden.shape[0], weight.shape[0])) if defer_dw else _nothing(hidden),
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

    ``precomputed``: the forward computed the gradients for an upstream gradient of 1 (reductions
    "mean" and "sum"); scale them by ``grad_loss`` (dW: from the fp32 accumulator in one pass, or
    from the kept ``logits_grad`` as ``logits_grad^T @ (grad_loss * h)``). Otherwise (reduction
    "none") recompute each chunk's logits and scale each row's gradient by its own upstream
    gradient. ``inplace`` (eager mode only): dh, and a weight gradient accumulated in the weight's
    dtype, are scaled in their own buffers instead of new ones.
    """
    if not precomputed:
        options = LossOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
        grad_scale = grad_loss.float().reshape(-1).contiguous()
        dh_saved, dw_saved, db_saved = (
            t if t is not None else _nothing(hidden)
            for t in _accum_buffers(hidden, weight, need_dh, need_dw, need_db and bias is not None, accum_fp32)
        )
        _run_chunks(
            hidden, weight, bias, target, class_weight, options, chunk_tokens, grad_scale,
            lse=lse, lse_given=True, loss=None, z_loss=None, correct=None,
            dh=dh_saved if need_dh else None, dw=dw_saved if need_dw else None,
            db=db_saved if need_db and bias is not None else None,
        )  # fmt: skip
        grad_loss = torch.ones((), dtype=torch.float32, device=hidden.device)
    scale = grad_loss.float().reshape(1)
    if not need_dh:
        dh = _nothing(hidden)
    elif inplace:  # our own buffer: scaled where it is, without an fp32 temporary
        dh = _scale_cast(dh_saved, scale, dh_saved.dtype, out=dh_saved)
    else:
        dh = (dh_saved * scale).to(hidden.dtype)
    if not need_dw:
        dw = _nothing(hidden)
    elif logits_grad.numel():
        dw = torch.mm(logits_grad.t(), (hidden * scale).to(hidden.dtype))
    elif inplace and dw_saved.dtype == weight.dtype:
        dw = _scale_cast(dw_saved, scale, weight.dtype, out=dw_saved)
    else:
        dw = _scale_cast(dw_saved, scale, weight.dtype)
    db = (db_saved * scale).to(bias.dtype) if need_db and bias is not None else _nothing(hidden)
    return dh, dw, db


def _lce_bwd_fake(
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
    return backward_fakes(hidden, weight, bias, need_dh, need_dw, need_db)


def backward_fakes(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, need_dh: bool, need_dw: bool, need_db: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake (dh, dw, db) of a backward launcher, each an empty tensor when not needed."""
    return (
        torch.empty_like(hidden) if need_dh else _nothing(hidden),
        torch.empty_like(weight) if need_dw else _nothing(hidden),
        torch.empty_like(bias) if need_db and bias is not None else _nothing(hidden),
    )


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
    need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
    none = (None,) * (_N_INPUTS - 3)
    if grad_loss is None or not (need_dh or need_dw or need_db):
        return (None, None, None, *none)
    if ctx.precomputed:
        hidden, weight, bias, dh, dw, db, logits_grad = ctx.saved_tensors
        target, class_weight, lse = hidden.new_empty(0, dtype=torch.long), None, _nothing(hidden, torch.float32)
    else:
        hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
        dh = dw = db = logits_grad = hidden.new_empty(0)
    # In place only in eager mode: a custom op (the torch.compile path) may not return its input.
    inplace = run_backward is _lce_bwd
    grads = run_backward(grad_loss, hidden, weight, bias, target, class_weight, lse, dh, dw, db, logits_grad,
                         *ctx.options, need_dh, need_dw, need_db, ctx.precomputed, inplace)  # fmt: skip
    return (grads[0] if need_dh else None, grads[1] if need_dw else None, grads[2] if need_db else None, *none)


_linear_cross_entropy = define_autograd_op(
    __name__, "linear_cross_entropy",
    forward=_lce_fwd, forward_fake=_lce_fwd_fake,
    backward_launcher=_lce_bwd, backward_fake=_lce_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


CHUNK_ALIGN = 128
"""Balanced chunks are a multiple of this many tokens: whole tiles of the chunk matmuls."""


def chunk_tokens_for(memory_budget: int, n_classes: int, itemsize: int, n_tokens: int | None = None) -> int:
    """Tokens per chunk so that a chunk of logits fits ``memory_budget`` bytes (at least 1; a
    multiple of 8 when more than 8, which keeps the matmuls aligned).

    Given ``n_tokens`` (more than one chunk holds), the chunks are balanced: as many chunks as the
    budget needs, of equal size rounded up to a multiple of :data:`CHUNK_ALIGN` where that still
    fits the budget. 8192 tokens of a 128256-word vocabulary in bf16 with 256 MiB: 8 chunks of
    1024 tokens rather than 7 of 1040 and one of 912, whose rows fill no whole matmul tile.
    """
    most = max(1, memory_budget // max(1, n_classes * itemsize))
    most = most - most % 8 if most > 8 else most
    if n_tokens is None or n_tokens <= most:
        return most
    even = cdiv(n_tokens, cdiv(n_tokens, most))
    aligned = cdiv(even, CHUNK_ALIGN) * CHUNK_ALIGN
    return aligned if aligned <= most else most


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


# --- 5. Module ------------------------------------------------------------------------------------


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
