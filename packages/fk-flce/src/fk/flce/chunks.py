"""The chunk engine: an LM head's loss and gradients without its ``[tokens, vocab]`` logits.

The fused-head losses run on it: :mod:`fk.flce.linear_cross_entropy` and
:mod:`fk.flce.vocab_parallel` here, and fk-align's preference, RL and distillation losses build on
it (this module is public for them). The tokens of ``hidden`` ``(N, H)`` are cut into chunks whose
logits fit a memory budget (:func:`chunk_tokens_for`), and for each chunk ``c``:

1. ``z_c = h_c @ W^T (+ b)`` (:func:`chunk_logits`: one matmul in the dtype of ``hidden``, into one
   buffer that every chunk reuses);
2. the caller's :data:`ChunkLoss` fills its per-row values (loss, log-sum-exp, ...) from ``z_c``
   and, when gradients are wanted, writes ``dz_c = d loss / d z_c`` over ``z_c`` in place, already
   scaled (by the mean's denominator, or by each row's upstream gradient);
3. :func:`chunk_grads`: ``dh_c = dz_c @ W`` into the chunk's rows of the hidden gradient,
   ``dW += dz_c^T @ h_c`` into an fp32 buffer (``accum_fp32``) through
   ``torch.addmm(..., out_dtype=torch.float32)`` (one kernel, no temporaries), ``db += sum(dz_c)``.

So a forward that computes the gradients (:func:`head_grads`) has them ready when it ends, and
the backward only multiplies them by the upstream gradient, a scalar for a reduced loss
(:func:`scale_grads`, which rounds the fp32 accumulator to the weight's dtype in the same pass).
That costs 6 N H V FLOPs in all (4 N H V with a frozen weight, whose gradient is never computed).
When all tokens fit one chunk, the logits' gradient is kept instead of ``dW`` and the backward
computes ``dW = dz^T @ (g h)`` once, in the weight's dtype. A loss whose upstream gradient differs
per token (reduction "none") computes no gradient in its forward; its backward recomputes each
chunk's logits (:func:`head_grads` with ``recompute``, 8 N H V FLOPs in all).

A chunk may also be several token ranges taken together (:func:`run_gathered_chunks`,
:func:`gathered_head_grads`): fk-align's preference losses put a pair's chosen and rejected
sequences, ``P`` sequences apart, into one chunk, so that each pair's loss and gradient are
known inside it (one pass).

The launchers of such a loss are registered as custom ops by :func:`fk.core.ops.define_autograd_op`:
:func:`head_grad_fakes` and :func:`backward_fakes` are the fakes of what this engine returns, and
:func:`empty_output` stands for an output that is not computed.

The order of the file: chunk sizes, the scale-and-cast kernel, the chunk loop, the gradients of a
forward and of a backward, their fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from fk.core.launch import cdiv
from fk.core.matmul import accumulate_mm, column_sum
from fk.core.ops import define_autograd_op, fake_from

# --- 1. Chunk sizes -------------------------------------------------------------------------------

DEFAULT_MEMORY_BUDGET = 4 << 30
"""Bytes for the logits of one chunk (4 GiB: 16384 tokens of a 128256-word vocabulary in bf16).
When all tokens fit one chunk, its logits' gradient is kept for the backward; with several
chunks, the fp32 weight-gradient accumulator (``V * H * 4`` bytes) comes on top. The returned
gradients come on top in both cases."""

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


def scale_cast(
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


# --- 3. The chunk loop ----------------------------------------------------------------------------

ChunkLoss = Callable[[torch.Tensor, slice, bool], None]
"""``chunk_loss(logits, rows, want_grad)``: the loss of one chunk, from its logits ``(n_c, V)``
(the tokens ``rows`` of ``hidden``). It fills the caller's per-row buffers at ``rows`` and, when
``want_grad``, writes the (scaled) gradient of the loss over ``logits`` in place: fk-flce's is the
cross-entropy kernel of :mod:`fk.flce.cross_entropy`."""


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T (+ bias)`` written into ``out``: the logits ``(n_c, V)`` of a chunk ``h`` ``(n_c, H)``."""
    return torch.addmm(bias, h, weight.t(), out=out) if bias is not None else torch.mm(h, weight.t(), out=out)


def row_scale(grad_scale: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The upstream gradient of a chunk's ``rows``: those rows of a per-token ``grad_scale``, or its
    one value (the scale of a reduced loss) as it is."""
    return grad_scale[rows] if grad_scale is not None and grad_scale.numel() > 1 else grad_scale


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


def run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_tokens: int,
    chunk_loss: ChunkLoss,
    *,
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    keep_logits_grad: bool = False,
) -> torch.Tensor | None:
    """The chunk loop on 2-D ``hidden`` ``(N, H)`` and ``weight`` ``(V, H)``: per chunk of
    ``chunk_tokens`` tokens, :func:`chunk_logits`, ``chunk_loss`` and :func:`chunk_grads` into the
    given buffers (``dh`` ``(N, H)``; ``dw`` ``(V, H)`` and ``db`` ``(V,)`` accumulated). The
    gradient is wanted of ``chunk_loss`` when a buffer is given or ``keep_logits_grad`` (one chunk
    only), which returns the logits' gradient ``(N, V)``."""
    n_tokens = hidden.shape[0]
    chunks = [(slice(start, min(start + chunk_tokens, n_tokens)),) for start in range(0, n_tokens, chunk_tokens)]
    return run_gathered_chunks(hidden, weight, bias, chunks, lambda logits, parts, want: chunk_loss(logits, parts[0], want),
                               dh=dh, dw=dw, db=db, keep_logits_grad=keep_logits_grad)  # fmt: skip


GatheredChunkLoss = Callable[[torch.Tensor, tuple[slice, ...], bool], None]
"""``chunk_loss(logits, parts, want_grad)``: as :data:`ChunkLoss` for a chunk made of the token
ranges ``parts`` of ``hidden``, its logits' rows in that order."""


def run_gathered_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunks: Sequence[tuple[slice, ...]],
    chunk_loss: GatheredChunkLoss,
    *,
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    keep_logits_grad: bool = False,
) -> torch.Tensor | None:
    """:func:`run_chunks` over given ``chunks``, each a tuple of token ranges of ``hidden`` that
    one chunk holds together (a preference pair's chosen and rejected sequences, which are ``P``
    sequences apart). A chunk of several ranges gathers its hidden states into one buffer (``n_c
    H`` elements, a copy that is small beside the chunk's logits), so that its logits and its ``dW``
    share are one matmul each; ``dh`` is written straight into each range's rows."""
    want_grad = dh is not None or dw is not None or db is not None or keep_logits_grad
    most = max((sum(part.stop - part.start for part in parts) for parts in chunks), default=0)
    logits = None
    # One logits buffer for every chunk: a new one per chunk would hold two chunks at a time.
    buffer = hidden.new_empty((most, weight.shape[0]))
    gathered = hidden.new_empty((most, hidden.shape[1])) if any(len(parts) > 1 for parts in chunks) else None
    for index, parts in enumerate(chunks):
        n_c = sum(part.stop - part.start for part in parts)
        if len(parts) == 1:
            h = hidden[parts[0]]
        else:
            assert gathered is not None
            h = torch.cat([hidden[part] for part in parts], out=gathered[:n_c])
        logits = chunk_logits(h, weight, bias, out=buffer[:n_c])
        chunk_loss(logits, parts, want_grad)
        if dh is not None:
            offset = 0
            for part in parts:
                size = part.stop - part.start
                torch.mm(logits[offset : offset + size], weight, out=dh[part])
                offset += size
        chunk_grads(logits, h, weight, None, dw, db, first=index == 0)
    return logits if keep_logits_grad else None


# --- 4. Gradients of a forward and of a backward --------------------------------------------------


def gradient_buffers(
    hidden: torch.Tensor, weight: torch.Tensor, compute_dh: bool, compute_dw: bool, compute_db: bool, accum_fp32: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The (dh, dw, db) buffers that :func:`run_chunks` fills, None where not computed: dh like
    ``hidden``, dw in fp32 (``accum_fp32``) or the weight's dtype, db ``(V,)`` in fp32."""
    dh = torch.empty_like(hidden) if compute_dh else None
    accum = torch.float32 if accum_fp32 else weight.dtype
    # Zeros only when no chunk will write it (no tokens); otherwise the first chunk overwrites it.
    alloc = torch.zeros if hidden.shape[0] == 0 else torch.empty
    dw = alloc(weight.shape, dtype=accum, device=weight.device) if compute_dw else None
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if compute_db else None
    return dh, dw, db


def empty_output(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh empty tensor for an output that is not computed (a custom op's outputs may not alias)."""
    return like.new_empty(0, dtype=dtype)


def keeps_logits_grad(hidden: torch.Tensor, chunk_tokens: int, compute_dw: bool) -> bool:
    """Whether a forward keeps its logits' gradient and leaves ``dW = dlogits^T @ h`` to the
    backward: when all tokens fit one chunk. The backward then folds the upstream gradient into h
    (a small tensor) and writes dW once in the weight's dtype, summed in fp32 inside the matmul.
    With several chunks, dW accumulates in the forward."""
    return compute_dw and 0 < hidden.shape[0] <= chunk_tokens


def head_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_tokens: int,
    chunk_loss: ChunkLoss,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
    *,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's gradients (dh, dw, db, dlogits) by the chunk loop, each empty when not computed:
    dh like ``hidden``, dw in the accumulation dtype, db in fp32, and dlogits ``(N, V)`` only when
    :func:`keeps_logits_grad` (dw is then empty). In a forward, ``chunk_loss`` scales the gradient
    as for an upstream gradient of 1 (a reduced loss), and a backward applies the upstream gradient
    with :func:`scale_grads`; :func:`head_grad_fakes` is the fake. ``recompute``: the backward of a
    loss whose upstream gradient differs per token (reduction "none"), ``chunk_loss`` scaling each
    row by its own; dW then accumulates over the chunks even in one (no dlogits kept)."""
    n_tokens = hidden.shape[0]
    chunks = [(slice(start, min(start + chunk_tokens, n_tokens)),) for start in range(0, n_tokens, chunk_tokens)]
    return gathered_head_grads(hidden, weight, bias, chunks, lambda logits, parts, want: chunk_loss(logits, parts[0], want),
                               accum_fp32, compute_dh, compute_dw, compute_db, recompute=recompute)  # fmt: skip


def gathered_head_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunks: Sequence[tuple[slice, ...]],
    chunk_loss: GatheredChunkLoss,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
    *,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`head_grads` over given ``chunks`` (:func:`run_gathered_chunks`): the logits'
    gradient is kept when there is one chunk (``dW`` is then left to the backward)."""
    keep = not recompute and compute_dw and len(chunks) == 1 and hidden.shape[0] > 0
    dh, dw, db = gradient_buffers(hidden, weight, compute_dh, compute_dw and not keep, compute_db and bias is not None,
                                  accum_fp32)  # fmt: skip
    logits_grad = run_gathered_chunks(hidden, weight, bias, chunks, chunk_loss, dh=dh, dw=dw, db=db,
                                      keep_logits_grad=keep)  # fmt: skip
    return (dh if dh is not None else empty_output(hidden), dw if dw is not None else empty_output(hidden),
            db if db is not None else empty_output(hidden, torch.float32),
            logits_grad if logits_grad is not None else empty_output(hidden))  # fmt: skip


def scale_grads(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dh_saved: torch.Tensor,
    dw_saved: torch.Tensor,
    db_saved: torch.Tensor,
    logits_grad: torch.Tensor,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    inplace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a reduced loss: (dh, dw, db), the gradients a forward computed (those of
    :func:`head_grads`) times the upstream gradient ``grad_loss`` (one value), each in its
    input's dtype and empty when not needed. dW comes from the fp32 accumulator in one pass, or from
    the kept ``logits_grad`` as ``logits_grad^T @ (grad_loss * h)``. ``inplace`` (eager mode only:
    a custom op may not return its input): dh, and a weight gradient accumulated in the weight's
    dtype, are scaled in their own buffers instead of new ones."""
    scale = grad_loss.float().reshape(1)
    if not need_dh:
        dh = empty_output(hidden)
    elif inplace:  # our own buffer: scaled where it is, without an fp32 temporary
        dh = scale_cast(dh_saved, scale, dh_saved.dtype, out=dh_saved)
    else:
        dh = (dh_saved * scale).to(hidden.dtype)
    if not need_dw:
        dw = empty_output(hidden)
    elif logits_grad.numel():
        dw = torch.mm(logits_grad.t(), (hidden * scale).to(hidden.dtype))
    elif inplace and dw_saved.dtype == weight.dtype:
        dw = scale_cast(dw_saved, scale, weight.dtype, out=dw_saved)
    else:
        dw = scale_cast(dw_saved, scale, weight.dtype)
    db = (db_saved * scale).to(bias.dtype) if need_db and bias is not None else empty_output(hidden)
    return dh, dw, db


# --- 5. Fakes, for the launchers registered as custom ops ----------------------------------------


def head_grad_fakes(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake (dh, dw, db, dlogits) of :func:`head_grads` in a forward launcher."""
    accum = torch.float32 if accum_fp32 else weight.dtype
    keep = keeps_logits_grad(hidden, chunk_tokens, compute_dw)
    return (
        torch.empty_like(hidden) if compute_dh else empty_output(hidden),
        weight.new_empty(weight.shape, dtype=accum) if compute_dw and not keep else empty_output(hidden),
        hidden.new_empty(weight.shape[0], dtype=torch.float32) if compute_db and bias is not None
        else empty_output(hidden, torch.float32),
        hidden.new_empty((hidden.shape[0], weight.shape[0])) if keep else empty_output(hidden),
    )  # fmt: skip


def input_grads(
    grads: tuple[torch.Tensor, ...] | None, needs: tuple[bool, ...], n_inputs: int
) -> tuple[torch.Tensor | None, ...]:
    """What a head op's autograd backward returns for its ``n_inputs`` inputs: (dh, dw, db) from
    ``grads`` where ``needs`` (the op's ``needs_input_grad`` for hidden, weight, bias) asks for
    them, else None (all None when ``grads`` is None: no upstream gradient), and None for the
    op's other inputs (targets, options), which take no gradient."""
    if grads is None:
        return (None,) * n_inputs
    head = tuple(g if need else None for g, need in zip(grads[:3], needs, strict=True))
    return (*head, *(None,) * (n_inputs - 3))


def backward_fakes(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, need_dh: bool, need_dw: bool, need_db: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake (dh, dw, db) of a backward launcher (:func:`scale_grads`), each empty when not needed."""
    return (
        torch.empty_like(hidden) if need_dh else empty_output(hidden),
        torch.empty_like(weight) if need_dw else empty_output(hidden),
        torch.empty_like(bias) if need_db and bias is not None else empty_output(hidden),
    )


def define_stored_grads_op(
    module_name: str,
    name: str,
    forward: Callable[..., Any],
    forward_fake: Callable[..., Any],
    grads_at: int,
    n_inputs: int,
) -> Callable[..., Any]:
    """A differentiable head op (:func:`fk.core.ops.define_autograd_op`) of a reduced loss whose
    forward computed its own gradients: it returns the loss first, then outputs without gradient,
    among them, from index ``grads_at``, :func:`head_grads`' dh, dW, db and the logits' gradient
    for an upstream gradient of 1. The backward scales those by the loss' upstream gradient
    (:func:`scale_grads`). The forward takes ``n_inputs`` inputs, hidden, weight and bias first.
    (fk-align's token-level GRPO and its one-pass preference losses are such ops.)"""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        hidden, weight, bias = inputs[:3]
        ctx.save_for_backward(hidden, weight, bias, *output[grads_at : grads_at + 4])
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    def backward(run_backward: Any, ctx: Any, grad_loss: torch.Tensor | None, *_rest: Any) -> tuple[Any, ...]:
        needs = need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if grad_loss is None or not (need_dh or need_dw or need_db):
            return input_grads(None, needs, n_inputs)
        hidden, weight, bias, dh, dw, db, logits_grad = ctx.saved_tensors
        # In place only in eager mode: a custom op (the torch.compile path) may not return its input.
        inplace = run_backward is scale_grads
        grads = run_backward(
            grad_loss, hidden, weight, bias, dh, dw, db, logits_grad, need_dh, need_dw, need_db, inplace
        )
        return input_grads(grads, needs, n_inputs)

    return define_autograd_op(
        module_name, name, forward=forward, forward_fake=forward_fake,
        backward_launcher=scale_grads, backward_fake=fake_from(scale_grads, backward_fakes),
        setup_context=setup_context, backward=backward,
    )  # fmt: skip
