"""Vocabulary-parallel fused linear + cross entropy: the LM head sharded along the vocabulary.

Tensor parallelism splits the head ``W`` (V, H) by rows over the ranks of a process group: rank r
holds ``W_r``, the rows ``[o_r, o_r + V_r)`` of the vocabulary, and every rank holds the same hidden
states ``h`` (N, H) and labels. No rank ever holds the full weight or the full logits. Each rank
streams its own logits ``z^r = h W_r^T (+ b_r)`` in token chunks, on the chunk engine of
:mod:`fk.flce.chunks` as :mod:`fk.flce.linear_cross_entropy` does, and per chunk:

1. the cross-entropy kernel (its ``SHARDED`` mode) gives each row's shard-local log-sum-exp
   ``lse_r``, the label's logit ``z_y`` when the label lies in the shard (0 otherwise: a label
   held by another rank is not an error here) and, for label smoothing, ``sum_v z_v``;
2. two small all-reduces combine them: the maximum ``M`` of the ``lse_r``, then the sum of
   ``[exp(lse_r - M), z_y, sum_v z_v]``, so ``lse = M + log sum_r exp(lse_r - M)``;
3. the kernel writes ``d loss / d z^r`` over the chunk's logits from the global ``lse`` (the
   gradient of every class depends on its own logit and ``lse`` only), and the chunk's partial
   ``dh = dz^r W_r`` and ``dW_r += dz^r^T h`` follow by matmul.

The loss of a token is then, as in :mod:`fk.flce.cross_entropy` (no class weights)::

    loss_n = (1 - eps) * (lse - z_y) + eps * (lse - sum_v z_v / V) + s * lse^2

``dW_r`` (and ``db_r``) stay local; ``dh`` is the sum over the ranks of their partial ``dh``: one
all-reduce of (N, H) at the end. Every rank computes the same loss.

Every rank must call with the same hidden states, labels, options and ``memory_budget``, and
with the same ``requires_grad`` on ``hidden`` (the ranks' collectives must pair up: the chunk size
comes from the budget and the largest shard, ``ceil(V / world)`` rows).

This file holds, in order: the reference (plain PyTorch, differentiable through two small
autograd functions for the collectives), the launchers registered as custom ops (they reuse the
cross-entropy kernel; no kernel of their own), and the functional API
:func:`vocab_parallel_linear_cross_entropy`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import cdiv
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
from fk.flce.cross_entropy import CrossEntropyOutput, LossOptions, launch_cross_entropy, mean_denominator, row_values
from fk.flce.linear_cross_entropy import check_inputs

# Shard-local label codes the kernel sees (a label in the shard is its row in [0, V_r)).
IGNORED = -1  # the caller's ignore_index (given to the kernel as its ignore_index)
ELSEWHERE = -2  # a label another rank's shard holds
OUTSIDE = -3  # a label outside [0, V): NaN loss and gradients, as in linear_cross_entropy


# --- 1. Reference ---------------------------------------------------------------------------------


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over ``group``. Backward: the gradient as it is, since every rank computes
    the same loss from the sum (the loss counts once, not once per rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SharedInput(torch.autograd.Function):
    """Identity on an input every rank holds the same; backward: the sum over ``group`` of the
    ranks' partial gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def vocab_parallel_linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: Any = None,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> CrossEntropyOutput:
    """Plain PyTorch on each rank's shard (fp32, or fp64 for fp64 inputs, and the losses returned in
    that dtype, as the kernel path's are), combined with
    differentiable collectives: the definition the kernel path is tested against, and the path of
    CPU tensors without Triton's interpreter. Arguments as :func:`vocab_parallel_linear_cross_entropy`
    (plain tensors only)."""
    group, start, vocab_size = shard_layout(weight, group, vocab_start_index, vocab_size)
    if shift:
        target = F.pad(target[..., 1:], (0, 1), value=ignore_index)
    compute = torch.promote_types(hidden.dtype, torch.float32)
    rows = target.shape
    target = target.reshape(-1)
    h = _SharedInput.apply(hidden, group).reshape(-1, hidden.shape[-1])
    z = F.linear(h, weight, bias).to(compute)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    m = z.detach().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    lse = m + torch.log(_SumOverRanks.apply(torch.exp(z - m[:, None]).sum(-1), group))
    local = target - start
    mine = (local >= 0) & (local < weight.shape[0])
    z_y = _SumOverRanks.apply(z.gather(1, torch.where(mine, local, 0).long()[:, None])[:, 0] * mine, group)
    valid = target != ignore_index
    z_y = torch.where(valid & ((target < 0) | (target >= vocab_size)), float("nan"), z_y)
    loss = (1 - label_smoothing) * (lse - z_y)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - _SumOverRanks.apply(z.sum(-1), group) / vocab_size)
    z_loss = lse_square_scale * lse.square() * valid
    loss = torch.where(valid, loss + z_loss, 0.0)
    if reduction == "none":
        return CrossEntropyOutput(loss.reshape(rows), lse.float().reshape(rows), z_loss.reshape(rows))
    if reduction == "sum":
        denominator = torch.ones((), dtype=compute, device=z.device)
    elif num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, dtype=compute, device=z.device)
    else:
        denominator = valid.sum().to(compute)
    denominator = torch.where(denominator != 0, denominator, 1)
    return CrossEntropyOutput(loss.sum() / denominator, lse.float().reshape(rows), z_loss.sum() / denominator)


# --- 2. Launchers, registered as custom ops -------------------------------------------------------

# (loss, z_loss, lse, dh, dw, db, dlogits): torch.library needs the arity spelled out.
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _group(name: str) -> Any:
    """The process group registered under ``name`` (custom ops take strings, not groups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]  # (a NewType of str)


def _combine_shards(lse: torch.Tensor, z_y: torch.Tensor, sum_z: torch.Tensor | None, target: torch.Tensor,
                    group: Any) -> None:  # fmt: skip
    """Turn the shard-local ``lse``, ``z_y`` and ``sum_z`` of a chunk into the whole vocabulary's,
    in place, with two all-reduces; a label outside the vocabulary gets a NaN lse."""
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    parts = torch.stack([torch.exp(lse - m), z_y] + ([sum_z] if sum_z is not None else []))
    dist.all_reduce(parts, group=group)
    torch.add(m, parts[0].log(), out=lse)
    lse.masked_fill_(target == OUTSIDE, float("nan"))
    z_y.copy_(parts[1])
    if sum_z is not None:
        sum_z.copy_(parts[2])


def _shard_chunks(
    target: torch.Tensor,
    options: LossOptions,
    vocab_size: int,
    group: Any,
    grad_scale: torch.Tensor,
    *,
    lse: torch.Tensor,
    lse_given: bool,
    z_y: torch.Tensor | None = None,
    sum_z: torch.Tensor | None = None,
) -> ChunkLoss:
    """The cross-entropy kernel, in its sharded mode, as each chunk's loss: in the forward (the
    chunk's lse, z_y and sum_z combined across the ranks, then the gradient when asked for) and in
    the recomputing backward of reduction "none" (``lse_given``, ``grad_scale`` per row). The
    partial ``dh`` that the chunks give is summed over the ranks by the caller."""
    total = torch.full((1,), float(vocab_size), dtype=torch.float32, device=lse.device)

    def chunk_loss(logits: torch.Tensor, rows: slice, want_grad: bool) -> None:
        t = target[rows]
        if not lse_given:
            assert z_y is not None
            launch_cross_entropy(logits, t, None, total, options, lse=lse[rows], loss=z_y[rows],
                                 z_loss=sum_z[rows] if sum_z is not None else None, sharded=True)  # fmt: skip
            _combine_shards(lse[rows], z_y[rows], sum_z[rows] if sum_z is not None else None, t, group)
        if want_grad:
            launch_cross_entropy(logits, t, None, total, options, lse=lse[rows], lse_given=True,
                                 grad=logits, grad_scale=row_scale(grad_scale, rows), sharded=True)  # fmt: skip

    return chunk_loss


def _token_losses(
    lse: torch.Tensor, z_y: torch.Tensor, sum_z: torch.Tensor | None, target: torch.Tensor, options: LossOptions,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-token loss and z-loss (fp32) from the combined lse, z_y and sum_z (see the module docstring)."""
    eps, scale = options.label_smoothing, options.lse_square_scale
    loss = (1.0 - eps) * (lse - z_y)
    if sum_z is not None:
        loss += eps * (lse - sum_z / vocab_size)
    ignored = target == IGNORED
    z_loss = torch.where(ignored, 0.0, scale * lse.square()) if scale != 0 else torch.zeros_like(lse)
    return torch.where(ignored, 0.0, loss + z_loss), z_loss


def _vp_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    denominator: torch.Tensor,
    group_name: str,
    vocab_size: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    """Forward launcher on 2-D ``hidden`` and shard-local labels ``target`` (the codes above):
    (loss, z_loss, lse, dh, dw, db, dlogits), the gradients as :func:`fk.flce.chunks.head_grads`
    returns them (for an upstream gradient of 1; dh already summed over the ranks)."""
    options = LossOptions(IGNORED, label_smoothing, lse_square_scale, softcap)
    lse, z_y = row_values(hidden), row_values(hidden)
    sum_z = row_values(hidden) if label_smoothing > 0 else None
    grad_scale = (1.0 / denominator if reduction == "mean" else torch.ones_like(denominator)).reshape(1)
    group = _group(group_name)
    chunk_loss = _shard_chunks(target, options, vocab_size, group, grad_scale, lse=lse, lse_given=False, z_y=z_y,
                               sum_z=sum_z)  # fmt: skip
    grads = head_grads(hidden, weight, bias, chunk_tokens, chunk_loss, accum_fp32, compute_dh, compute_dw, compute_db)
    if compute_dh:
        dist.all_reduce(grads[0], group=group)
    loss, z_loss = _token_losses(lse, z_y, sum_z, target, options, vocab_size)
    if reduction == "mean":
        loss, z_loss = loss.sum() / denominator, z_loss.sum() / denominator
    elif reduction == "sum":
        loss, z_loss = loss.sum(), z_loss.sum()
    return (loss, z_loss, lse, *grads)


def _vp_fwd_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    reduction: str,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    rows = row_values(hidden)
    reduced = torch.empty_like(rows) if reduction == "none" else rows.new_empty(())
    return (reduced, torch.empty_like(reduced), torch.empty_like(rows),
            *head_grad_fakes(hidden, weight, bias, chunk_tokens, accum_fp32, compute_dh, compute_dw, compute_db))  # fmt: skip


def _vp_bwd(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    dh_saved: torch.Tensor,
    dw_saved: torch.Tensor,
    db_saved: torch.Tensor,
    logits_grad: torch.Tensor,
    group_name: str,
    vocab_size: int,
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
    """Backward launcher: (dh, dw, db). ``precomputed`` (reductions "mean" and "sum"): the forward's
    gradients scaled by ``grad_loss`` (:func:`fk.flce.chunks.scale_grads`). Otherwise
    (reduction "none") each chunk's logits are recomputed and its rows scaled by their own
    upstream gradient, from the saved (global) lse: no collective but the final one over dh."""
    if not precomputed:
        options = LossOptions(IGNORED, label_smoothing, lse_square_scale, softcap)
        group = _group(group_name)
        chunk_loss = _shard_chunks(target, options, vocab_size, group, grad_loss.float().reshape(-1).contiguous(),
                                   lse=lse, lse_given=True)  # fmt: skip
        dh_saved, dw_saved, db_saved, _ = head_grads(hidden, weight, bias, chunk_tokens, chunk_loss, accum_fp32,
                                                     need_dh, need_dw, need_db, recompute=True)  # fmt: skip
        if need_dh:
            dist.all_reduce(dh_saved, group=group)
        grad_loss = torch.ones((), dtype=torch.float32, device=hidden.device)
        inplace = True  # our own buffers
    return scale_grads(grad_loss, hidden, weight, bias, dh_saved, dw_saved, db_saved, logits_grad,
                       need_dh, need_dw, need_db, inplace)  # fmt: skip


_N_INPUTS = 16


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    (hidden, weight, bias, target, _denominator, group_name, vocab_size, label_smoothing, lse_square_scale, softcap,
     _reduction, chunk_tokens, accum_fp32, compute_dh, compute_dw, compute_db) = inputs  # fmt: skip
    _loss, _z_loss, lse, dh, dw, db, logits_grad = output
    ctx.precomputed = compute_dh or compute_dw or compute_db
    if ctx.precomputed:
        ctx.save_for_backward(hidden, weight, bias, dh, dw, db, logits_grad)
    else:  # reduction "none": the backward recomputes the logits
        ctx.save_for_backward(hidden, weight, bias, target, lse)
    ctx.options = (group_name, vocab_size, label_smoothing, lse_square_scale, softcap, chunk_tokens, accum_fp32)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, grad_loss: torch.Tensor | None, *_rest: Any) -> tuple[Any, ...]:
    needs = need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_loss is None or not (need_dh or need_dw or need_db):
        return input_grads(None, needs, _N_INPUTS)
    if ctx.precomputed:
        hidden, weight, bias, dh, dw, db, logits_grad = ctx.saved_tensors
        target, lse = hidden.new_empty(0, dtype=torch.long), empty_output(hidden, torch.float32)
    else:
        hidden, weight, bias, target, lse = ctx.saved_tensors
        dh = dw = db = logits_grad = hidden.new_empty(0)
    inplace = run_backward is _vp_bwd  # eager mode only: a custom op may not return its input
    grads = run_backward(grad_loss, hidden, weight, bias, target, lse, dh, dw, db, logits_grad, *ctx.options,
                         need_dh, need_dw, need_db, ctx.precomputed, inplace)  # fmt: skip
    return input_grads(grads, needs, _N_INPUTS)


_vocab_parallel_linear_cross_entropy = define_autograd_op(
    __name__, "vocab_parallel_linear_cross_entropy",
    forward=_vp_fwd, forward_fake=fake_from(_vp_fwd, _vp_fwd_fake),
    backward_launcher=_vp_bwd, backward_fake=fake_from(_vp_bwd, backward_fakes),
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 3. Functional API ----------------------------------------------------------------------------


def shard_layout(weight: torch.Tensor, group: Any, vocab_start_index: int | None,
                 vocab_size: int | None) -> tuple[Any, int, int]:  # fmt: skip
    """(group, vocab_start_index, vocab_size) of a rank's shard ``weight`` (V_r rows): equal shards
    in rank order when neither index nor size is given, else both as given (checked)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_linear_cross_entropy needs torch.distributed initialized")
    group = dist.group.WORLD if group is None else group
    rows = weight.shape[0]
    if vocab_start_index is None and vocab_size is None:
        return group, dist.get_rank(group) * rows, dist.get_world_size(group) * rows
    if vocab_start_index is None or vocab_size is None:
        raise ValueError("vocab_start_index and vocab_size go together: give both (uneven shards) or neither")
    for name, value in (("vocab_start_index", vocab_start_index), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if vocab_start_index + rows > vocab_size:
        raise ValueError(f"the shard's rows [{vocab_start_index}, {vocab_start_index + rows}) must lie in the "
                         f"vocabulary [0, {vocab_size})")  # fmt: skip
    return group, vocab_start_index, vocab_size


def _from_dtensors(
    hidden: Any, weight: Any, bias: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any, int, int] | None:
    """(hidden, weight, bias, group, vocab_start_index, vocab_size) as local tensors when
    ``weight`` is a DTensor sharded by rows on a 1-D mesh (``Shard(0)``, as ``ColwiseParallel``
    shards an LM head), else None. ``hidden`` may be a replicated DTensor, ``bias`` a DTensor
    sharded as the weight."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch without distributed
        return None
    if not isinstance(weight, DTensor):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"a DTensor weight must be sharded by rows on a 1-D mesh (Shard(0)), got {weight.placements}")
    if isinstance(hidden, DTensor):
        if any(not isinstance(p, Replicate) for p in hidden.placements):
            raise ValueError(f"a DTensor hidden must be replicated, got {hidden.placements}")
        hidden = hidden.to_local()
    if isinstance(bias, DTensor):
        if tuple(bias.placements) != (Shard(0),):
            raise ValueError(f"a DTensor bias must be sharded as the weight (Shard(0)), got {bias.placements}")
        bias = bias.to_local()
    vocab_size = weight.shape[0]
    per_rank = cdiv(vocab_size, mesh.size())  # DTensor shards as torch.chunk does
    start = min(mesh.get_local_rank() * per_rank, vocab_size)
    return hidden, weight.to_local(), bias, mesh.get_group(), start, vocab_size


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: Any = None,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
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
    """:func:`fk.flce.linear_cross_entropy` with the LM head sharded along the vocabulary over ``group``.

    Args:
        hidden: ``(..., H)``, the same on every rank of ``group`` (or a replicated DTensor).
        weight: ``(V_r, H)``: this rank's rows of the head (or a DTensor sharded ``Shard(0)`` on a
            1-D mesh, whose group, offset and vocabulary size are then used).
        target: labels in the *whole* vocabulary ``[0, V)`` (or ``ignore_index``), the same on
            every rank; a label held by another rank's shard is not an error. A label outside
            the whole vocabulary ``[0, V)`` raises a ``ValueError`` on the CPU that names its
            position in ``target`` as given; on a GPU it gives that token a NaN loss and NaN
            gradients unless ``FK_CHECK_LABELS=1``, as :func:`fk.flce.cross_entropy` describes.
        bias: optional ``(V_r,)``, this rank's part of the head's bias.
        group: the process group the vocabulary is sharded over (default: the whole world).
        vocab_start_index, vocab_size: the shard's first row in the vocabulary and the vocabulary's
            size. Neither: equal shards in rank order (``rank * V_r``, ``world * V_r``).
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, shift,
        num_items_in_batch, return_lse, return_z_loss, accum_dtype, memory_budget: as in
            :func:`fk.flce.linear_cross_entropy` (``memory_budget`` bounds one chunk of this
            rank's logits: ``ceil(V / world)`` columns).
        class_weight, return_accuracy: not supported here (``NotImplementedError``).

    Returns what :func:`fk.flce.linear_cross_entropy` returns, the same on every rank. The
    gradient of ``weight`` (and ``bias``) is this rank's shard; that of ``hidden`` is the full one
    (summed over the ranks by one all-reduce, during the forward). Costs per rank: ``1 / world``
    of the single-GPU FLOPs, two all-reduces of a few floats per token per chunk, one of dh.
    """
    if class_weight is not None:
        raise NotImplementedError("vocab_parallel_linear_cross_entropy does not support class_weight")
    if return_accuracy:
        raise NotImplementedError("vocab_parallel_linear_cross_entropy does not support return_accuracy")
    local = _from_dtensors(hidden, weight, bias)
    if local is not None:
        if group is not None or vocab_start_index is not None or vocab_size is not None:
            raise ValueError("with a DTensor weight, group, vocab_start_index and vocab_size come from it: give none")
        hidden, weight, bias, group, vocab_start_index, vocab_size = local
    validate.check_tensor("weight", weight)
    validate.check_ndim("weight", weight, 2)
    group, start, vocab_size = shard_layout(weight, group, vocab_start_index, vocab_size)
    options, target, num_items = check_inputs(
        hidden, weight, target, bias, None, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        shift, num_items_in_batch, accum_dtype, memory_budget, vocab_size,
    )  # fmt: skip
    if not uses_kernel(hidden):
        out = vocab_parallel_linear_cross_entropy_ref(
            hidden, weight, target, bias, group=group, vocab_start_index=start, vocab_size=vocab_size,
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, softcap=softcap, num_items_in_batch=num_items,
        )  # fmt: skip
    else:
        rows_shape = target.shape
        flat = target.reshape(-1)
        labels = torch.where((flat >= start) & (flat < start + weight.shape[0]), flat - start, ELSEWHERE)
        labels = torch.where((flat < 0) | (flat >= vocab_size), OUTSIDE, labels)
        labels = torch.where(flat == ignore_index, IGNORED, labels)
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        if hidden2d.stride(-1) != 1 or hidden2d.stride(0) != hidden2d.shape[1]:
            hidden2d = hidden2d.contiguous()
        in_forward = torch.is_grad_enabled() and reduction != "none"
        chunk = chunk_tokens_for(memory_budget, cdiv(vocab_size, dist.get_world_size(group)), hidden.element_size())
        loss, z_loss, lse, *_ = _vocab_parallel_linear_cross_entropy(
            hidden2d, weight, bias, labels, mean_denominator(flat, None, ignore_index, num_items), group.group_name,
            vocab_size, options.label_smoothing, options.lse_square_scale, options.softcap, reduction, chunk,
            accum_dtype != weight.dtype, in_forward and hidden.requires_grad, in_forward and weight.requires_grad,
            in_forward and bias is not None and bias.requires_grad,
        )  # fmt: skip
        if reduction == "none":
            loss, z_loss = loss.reshape(rows_shape), z_loss.reshape(rows_shape)
        out = CrossEntropyOutput(loss, lse.reshape(rows_shape), z_loss)
    if not (return_lse or return_z_loss):
        return out.loss
    return CrossEntropyOutput(out.loss, out.lse if return_lse else None, out.z_loss if return_z_loss else None)
