"""Per-token log-probabilities (and entropies) of an LM head, without its ``[tokens, vocab]`` logits.

For tokens with hidden states ``h`` ``(N, H)``, the head ``W`` ``(V, H)`` (and bias ``b``), a
temperature ``T`` and labels ``y``, with ``z = (h @ W^T + b) / T`` and ``p = softmax(z)``::

    logp_t = z_{t, y_t} - lse_t                 lse_t = log sum_v exp(z_{t, v})
    H_t    = lse_t - sum_v p_{t, v} z_{t, v}    (the entropy -sum_v p log p)

Both are fp32 and 0 at an ignored token (label ``ignore_index``): what TRL's fused LM head
(``add_fused_lm_head``) returns as ``log_probs`` and ``entropy``, and what every loss of fk.align
is built from.

The tokens run through fk-flce's chunk engine (:mod:`fk.flce.chunks`): each chunk's logits are
made by one matmul, the kernel of this file reads them, and they are dropped. The upstream
gradient differs per token, so the forward computes no gradient (2 N H V FLOPs) and the backward
recomputes each chunk's logits, writes ``d/dz`` over them with each token's upstream gradients and
multiplies back through the head (6 N H V FLOPs): 8 N H V FLOPs in all (6 N H V with a frozen head).

Why a kernel of its own rather than fk-flce's cross-entropy kernel: that kernel has neither the
entropy (it needs ``sum_v p_v z_v`` in the same pass) nor the temperature, and its gradient takes
one upstream factor per row, where this one takes two (of ``logp`` and of ``H``). It streams the
rows the same way, so it uses that kernel's tuned launch table (:data:`fk.flce.cross_entropy.LAUNCH`).

The order of the file: the reference, the kernel, the launchers registered as custom ops, the
functional API :func:`fused_linear_logprobs`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import multiprocessor_count, next_power_of_2
from fk.core.ops import define_autograd_op, fake_from
from fk.flce.chunks import (
    DEFAULT_MEMORY_BUDGET,
    ChunkLoss,
    backward_fakes,
    chunk_tokens_for,
    empty_output,
    head_grads,
    input_grads,
    run_chunks,
    scale_grads,
)
from fk.flce.cross_entropy import LAUNCH, row_values
from fk.flce.linear_cross_entropy import check_inputs, shift_labels


class LogProbsOutput(NamedTuple):
    """What :func:`fused_linear_logprobs` returns with ``return_entropy``: per-token fp32 values
    shaped like the labels, 0 at ignored tokens."""

    logps: torch.Tensor
    entropy: torch.Tensor


# --- 1. Reference ---------------------------------------------------------------------------------


def fused_linear_logprobs_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    shift: bool = False,
    return_entropy: bool = False,
) -> Any:
    """Plain PyTorch on the full logits (made in the dtype of ``hidden``, then upcast to fp32, or
    fp64 for fp64 inputs): the definition the kernel is tested against, and the path of CPU
    tensors without Triton's interpreter."""
    if shift:
        target = shift_labels(target, ignore_index)
    logits = F.linear(hidden, weight, bias)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).long()
    logps = torch.where(valid, logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
    if not return_entropy:
        return logps
    entropy = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    return LogProbsOutput(logps, entropy)


class TokenStats(NamedTuple):
    """Per-token statistics of the head's distribution that TRL's metrics read (DPO's and KTO's
    ``entropy``, ``logits/*`` and ``mean_token_accuracy``), shaped like the labels, at each position
    scored against its label (after the shift, where there is one); 0 (False) where not scored."""

    entropy: torch.Tensor  # fp32: -sum_v p log p
    mean_logit: torch.Tensor  # fp32: the mean of the position's logits over the vocabulary
    top1: torch.Tensor  # bool: the label is the logits' argmax


@torch.no_grad()
def token_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> TokenStats:
    """:class:`TokenStats` of the scored tokens (``target`` not ``ignore_index``; no shift here),
    from their logits ``hidden @ weight.T + bias`` made in the dtype of ``hidden`` and upcast to
    fp32, in chunks of ``memory_budget`` bytes of fp32 logits; without gradient. The reference of
    what the one-pass preference losses compute beside their loss (``return_token_stats``), and
    their path where that pass does not run."""
    scored = target != ignore_index
    rows, labels = hidden[scored], target[scored]
    entropy = torch.zeros(rows.shape[0], dtype=torch.float32, device=hidden.device)
    mean = torch.zeros_like(entropy)
    top1 = torch.zeros(rows.shape[0], dtype=torch.bool, device=hidden.device)
    chunk = max(1, memory_budget // (4 * weight.shape[0]))
    for start in range(0, rows.shape[0], chunk):
        end = min(start + chunk, rows.shape[0])
        logits = F.linear(rows[start:end], weight, bias).float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy[start:end] = -(logp.exp() * logp).sum(-1)
        mean[start:end] = logits.mean(-1)
        top1[start:end] = logits.argmax(-1) == labels[start:end]
    placed = torch.zeros(target.shape, dtype=torch.float32, device=hidden.device)
    return TokenStats(placed.masked_scatter(scored, entropy), torch.zeros_like(placed).masked_scatter(scored, mean),
                      torch.zeros(target.shape, dtype=torch.bool, device=hidden.device).masked_scatter(scored, top1))  # fmt: skip


def chunk_token_stats(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, entropy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`TokenStats`' values of one chunk's rows from its ``logits`` (before anything
    overwrites them) and ``entropy``, which pass 1 of the kernel wrote (:func:`launch_token_logprobs`
    with ``entropy``): the mean logit (an fp32 sum, no fp32 copy of the chunk) and whether the
    label is the argmax, 0 (False) at ignored rows."""
    scored = target != ignore_index
    mean = torch.where(scored, logits.sum(-1, dtype=torch.float32) / logits.shape[1], 0.0)
    return entropy, mean, (logits.argmax(-1) == target) & scored


# --- 2. Kernel ------------------------------------------------------------------------------------
#
# Backward, per token t (not ignored) with upstream gradients g = d L / d logp_t and e = d L / d H_t,
# and x the raw logits (z = x / T):
#   d logp_t / d z_v = [v == y_t] - p_v
#   d H_t / d z_v    = -p_v (log p_v + H_t) = -p_v (z_v - lse_t + H_t)
#   d L / d x_v      = (g ([v == y_t] - p_v) - e p_v (z_v - lse_t + H_t)) / T
# An ignored token has gradient 0. Pass 1 (FORWARD) streams each row once with an online softmax
# that also sums exp(z - m) * z, for sum_v p_v z_v; pass 2 (COMPUTE_GRAD) reads lse and H saved by
# pass 1 (in this launch or an earlier one) and writes d L / d x over the logits.


@triton.jit
def _token_logprob_kernel(
    logits_ptr,  # [N, V] raw logits x, row stride row_stride, unit column stride; d L / d x written over them
    target_ptr,  # [N] int32/int64 labels
    logp_ptr,  # [N] fp32 log p(y): written by pass 1
    entropy_ptr,  # [N] fp32 entropy: written by pass 1 when ENTROPY, read by pass 2 when GRAD_ENTROPY
    lse_ptr,  # [N] fp32 log-sum-exp of z: written by pass 1, read by pass 2
    grad_logp_ptr,  # [N] fp32 upstream gradient of logp (pass 2)
    grad_entropy_ptr,  # [N] fp32 upstream gradient of the entropy (pass 2, when GRAD_ENTROPY)
    n_rows,
    n_cols,
    row_stride,
    ignore_index,
    inv_temperature,
    FORWARD: tl.constexpr,
    ENTROPY: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    GRAD_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    for row in range(pid, n_rows, n_programs):
        x_row = logits_ptr + tl.cast(row, tl.int64) * row_stride
        label = tl.load(target_ptr + row).to(tl.int64)
        ignored = label == ignore_index
        label_ok = (label >= 0) & (label < n_cols) & (label != ignore_index)
        bad_label = (label != ignore_index) & ((label < 0) | (label >= n_cols))
        label32 = tl.where(label_ok, label, -1).to(tl.int32)
        if FORWARD:
            # Per-lane running max m, sum s of exp(z - m) and sum u of exp(z - m) * (z - m), combined
            # once after the loop. Sums relative to the maximum keep the entropy free of the
            # cancellation lse - E[z] would have. One exp per element: exp(-|z - m|) rescales the old
            # sums when z is the new maximum (u also shifts by s * (m - z)), and weighs z otherwise.
            m = tl.full([BLOCK], -1e30, tl.float32)
            s = tl.zeros([BLOCK], tl.float32)
            u = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                z = tl.where(mask, x * inv_temperature, -float("inf"))
                e = tl.exp(-tl.abs(z - m))
                new_max = z > m
                if ENTROPY:
                    # (a column past the end stands at m: no inf - inf, and it adds e * 0)
                    z_in = tl.where(mask, z, m)
                    u = tl.where(new_max, (u + s * (m - z_in)) * e, u + e * (z_in - m))
                s = tl.where(new_max, s * e + 1.0, s + e)
                m = tl.maximum(m, z)
            m_row = tl.max(m, axis=0)
            w = tl.exp(m - m_row)
            total = tl.sum(s * w, axis=0)
            log_total = tl.log(total)
            lse = m_row + log_total
            z_y = tl.load(x_row + label, mask=label_ok, other=0.0).to(tl.float32) * inv_temperature
            logp = tl.where(ignored, 0.0, z_y - lse)
            tl.store(logp_ptr + row, tl.where(bad_label, float("nan"), logp))
            tl.store(lse_ptr + row, lse)
            if ENTROPY:
                # H = lse - E[z] = log(total) - E[z - m_row]
                entropy = log_total - tl.sum(w * (u + s * (m - m_row)), axis=0) / total
                tl.store(entropy_ptr + row, tl.where(ignored, 0.0, entropy))
        if COMPUTE_GRAD:
            lse_g = tl.load(lse_ptr + row)
            g = tl.where(ignored, 0.0, tl.load(grad_logp_ptr + row))
            g = tl.where(bad_label, float("nan"), g)
            if GRAD_ENTROPY:
                e_g = tl.where(ignored, 0.0, tl.load(grad_entropy_ptr + row))
                entropy_g = tl.load(entropy_ptr + row)
            n_blocks = tl.cdiv(n_cols, BLOCK)
            for back in range(0, n_blocks):  # backwards: the blocks pass 1 read last are likeliest in L2
                c = (n_blocks - 1 - back) * BLOCK + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                log_p = x * inv_temperature - lse_g
                p = tl.exp(log_p)
                dz = g * (tl.where(c == label32, 1.0, 0.0) - p)
                if GRAD_ENTROPY:
                    dz -= e_g * p * (log_p + entropy_g)
                tl.store(x_row + c, (dz * inv_temperature).to(logits_ptr.dtype.element_ty), mask=mask)


def launch_token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float,
    *,
    lse: torch.Tensor,
    logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    forward: bool = True,
    grad_logp: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> None:
    """Run the kernel on 2-D ``logits`` (unit column stride). ``forward``: fill ``lse``, ``logp``
    (given then) and ``entropy`` (when given). ``grad_logp`` (fp32, one per row): write the gradient over
    ``logits`` from the ``lse`` (and ``entropy``) already there, with ``grad_entropy`` too when given."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    compute_grad = grad_logp is not None
    params = LAUNCH["fused" if forward and compute_grad else "forward" if forward else "backward"]
    grid = (min(n_rows, multiprocessor_count(logits.device) * params.programs_per_sm),)
    _token_logprob_kernel[grid](
        logits, target, logp if logp is not None else lse, entropy if entropy is not None else lse, lse,
        grad_logp if grad_logp is not None else lse, grad_entropy if grad_entropy is not None else lse,
        n_rows, n_cols, logits.stride(0), ignore_index, 1.0 / temperature,
        FORWARD=forward, ENTROPY=entropy is not None and forward, COMPUTE_GRAD=compute_grad,
        GRAD_ENTROPY=grad_entropy is not None and compute_grad,
        BLOCK=min(params.max_block, next_power_of_2(n_cols)), num_warps=params.num_warps if n_cols >= 4096 else 4,
    )  # fmt: skip


# --- 3. Launchers, registered as custom ops -------------------------------------------------------


def _logprobs_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float,
    want_entropy: bool,
    chunk_tokens: int,
    accum_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward launcher on 2-D ``hidden`` ``(N, H)``: (logp, entropy, lse), fp32 per token; the
    entropy is empty unless ``want_entropy``. No gradient is computed (see the module docstring);
    ``accum_fp32`` is for the backward."""
    logp, lse = row_values(hidden), row_values(hidden)
    entropy = row_values(hidden) if want_entropy else empty_output(hidden, torch.float32)

    def chunk_loss(logits: torch.Tensor, rows: slice, want_grad: bool) -> None:
        launch_token_logprobs(logits, target[rows], ignore_index, temperature, logp=logp[rows], lse=lse[rows],
                              entropy=entropy[rows] if want_entropy else None)  # fmt: skip

    run_chunks(hidden, weight, bias, chunk_tokens, chunk_loss, dh=None, dw=None, db=None)
    return logp, entropy, lse


def _logprobs_fwd_fake(hidden: torch.Tensor, want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = row_values(hidden)
    return rows, torch.empty_like(rows) if want_entropy else empty_output(hidden, torch.float32), torch.empty_like(rows)


def recompute_chunks(
    target: torch.Tensor,
    ignore_index: int,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
) -> ChunkLoss:
    """The chunk loss of a backward: each chunk's logits recomputed, their gradient written over
    them from the saved ``lse`` (and ``entropy``) and the per-token upstream gradients."""

    def chunk_loss(logits: torch.Tensor, rows: slice, want_grad: bool) -> None:
        launch_token_logprobs(logits, target[rows], ignore_index, temperature, lse=lse[rows],
                              entropy=entropy[rows] if entropy is not None else None, forward=False,
                              grad_logp=grad_logp[rows],
                              grad_entropy=grad_entropy[rows] if grad_entropy is not None else None)  # fmt: skip

    return chunk_loss


def _logprobs_bwd(
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    ignore_index: int,
    temperature: float,
    chunk_tokens: int,
    accum_fp32: bool,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    inplace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher: (dh, dw, db), each empty when not needed, by recomputing every chunk's
    logits (:func:`fk.flce.chunks.head_grads` with ``recompute``). ``grad_entropy`` is None when
    the entropy got no gradient (or was not computed)."""
    grad_logp = grad_logp.float().reshape(-1).contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.float().reshape(-1).contiguous()
    chunk_loss = recompute_chunks(target, ignore_index, temperature, lse,
                                  entropy if grad_entropy is not None else None, grad_logp, grad_entropy)  # fmt: skip
    dh, dw, db, _ = head_grads(hidden, weight, bias, chunk_tokens, chunk_loss, accum_fp32, need_dh, need_dw, need_db,
                               recompute=True)  # fmt: skip
    one = torch.ones((), dtype=torch.float32, device=hidden.device)
    return scale_grads(one, hidden, weight, bias, dh, dw, db, empty_output(hidden), need_dh, need_dw, need_db, inplace)


_N_INPUTS = 9


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, bias, target, ignore_index, temperature, want_entropy, chunk_tokens, accum_fp32 = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, target, lse, entropy)
    ctx.options = (ignore_index, temperature, chunk_tokens, accum_fp32)
    ctx.want_entropy = want_entropy
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(
    run_backward: Any, ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_rest: Any
) -> tuple[Any, ...]:
    needs = need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
    if not ctx.want_entropy:
        grad_entropy = None
    if (grad_logp is None and grad_entropy is None) or not (need_dh or need_dw or need_db):
        return input_grads(None, needs, _N_INPUTS)
    hidden, weight, bias, target, lse, entropy = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    # In place only in eager mode: a custom op (the torch.compile path) may not return its input.
    inplace = run_backward is _logprobs_bwd
    grads = run_backward(grad_logp, grad_entropy, hidden, weight, bias, target, lse, entropy, *ctx.options,
                         need_dh, need_dw, need_db, inplace)  # fmt: skip
    return input_grads(grads, needs, _N_INPUTS)


_fused_linear_logprobs = define_autograd_op(
    __name__, "fused_linear_logprobs",
    forward=_logprobs_fwd, forward_fake=fake_from(_logprobs_fwd, _logprobs_fwd_fake),
    backward_launcher=_logprobs_bwd, backward_fake=fake_from(_logprobs_bwd, backward_fakes),
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def check_temperature(temperature: object) -> float:
    """``temperature``: a finite number > 0."""
    value = validate.check_positive_float("temperature", temperature)
    if not math.isfinite(value):
        raise ValueError(f"temperature must be finite, got {temperature}")
    return value


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    shift: bool = False,
    return_entropy: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Any:
    """Per-token ``log p(target)`` under ``softmax((hidden @ weight.T + bias) / temperature)``,
    without the full logits (8 N H V FLOPs with the backward; see the module docstring).

    Args:
        hidden: ``(..., H)`` fp32/fp16/bf16 (any strides; made contiguous inside if it is not).
        weight: ``(V, H)`` the LM head, same dtype as ``hidden``; a head that does not require grad
            gets no gradient work.
        target: ``hidden.shape[:-1]`` int64/int32 labels, or ``ignore_index``. A label outside
            ``[0, V)`` raises a ``ValueError`` on the CPU; on a GPU it gives NaN (as
            :func:`fk.flce.linear_cross_entropy` describes).
        bias: optional ``(V,)``.
        temperature: the logits are divided by it (TRL's ``temperature``), > 0.
        ignore_index: label of tokens that are not scored: their log-prob and entropy are 0 and
            they get no gradient.
        shift: causal-LM shift: position t is scored against ``target[..., t + 1]``, the last
            position of each sequence is ignored (as TRL's fused head does with ``labels``).
        return_entropy: also return each token's entropy (differentiable).
        accum_dtype, memory_budget: as in :func:`fk.flce.linear_cross_entropy`.

    Returns the fp32 log-probs shaped like ``target``, or a :class:`LogProbsOutput` with
    ``return_entropy``.
    """
    _options, target, _ = check_inputs(hidden, weight, target, bias, None, ignore_index, "none", 0.0, 0.0, None,
                                       shift, None, accum_dtype, memory_budget)  # fmt: skip
    temperature = check_temperature(temperature)
    if not uses_kernel(hidden):
        return fused_linear_logprobs_ref(hidden, weight, target, bias=bias, temperature=temperature,
                                         ignore_index=ignore_index, return_entropy=return_entropy)  # fmt: skip
    rows_shape = target.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    if hidden2d.stride(-1) != 1 or hidden2d.stride(0) != hidden2d.shape[1]:
        hidden2d = hidden2d.contiguous()
    # (Balanced chunks in eager mode only: under torch.compile the token count may be symbolic.)
    n_tokens = None if torch.compiler.is_compiling() else hidden2d.shape[0]
    chunk_tokens = chunk_tokens_for(memory_budget, weight.shape[0], hidden.element_size(), n_tokens)
    logp, entropy, _lse = _fused_linear_logprobs(hidden2d, weight, bias, target.reshape(-1), ignore_index, temperature,
                                                 return_entropy, chunk_tokens, accum_dtype != weight.dtype)  # fmt: skip
    if not return_entropy:
        return logp.reshape(rows_shape)
    return LogProbsOutput(logp.reshape(rows_shape), entropy.reshape(rows_shape))
