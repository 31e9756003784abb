"""GRPO and its TRL variants on the fused LM head, without the ``[tokens, vocab]`` logits.

The loss is TRL 1.16's ``GRPOTrainer._compute_loss`` on the per-token log-probabilities
``logp`` of the completion tokens (at ``temperature``). Per token, with ``A`` the advantage and
``r = exp(logp - old_logp)`` (``old_logp = logp.detach()`` on-policy: ``r = 1``, gradient ``A``)::

    grpo, bnpo, dr_grpo, dapo, luspo:  l = -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)
    cispo:                              l = -sg(min(r, eps_high)) A logp
    sapo:                               l = -sigmoid(tau (r - 1)) 4 / tau A   (tau by the sign of A)
    + beta * (exp(ref - logp) - (ref - logp) - 1)                        (the k3 KL estimator)

and the loss is ``sum_t w_t l_t`` with weights from the completion mask ``m`` alone:
``m / (len_i B)`` (grpo), ``m / sum m`` (bnpo), ``m / (B max_completion_length)`` (dr_grpo),
``m / num_items_in_batch`` (dapo, cispo), ``m / B`` (luspo); grpo/bnpo/dr_grpo/luspo divide by
``gradient_accumulation_steps`` as TRL does. ``entropy_coef`` subtracts that times the mean entropy.
With ``importance_sampling_level="sequence"`` (GSPO), ``r`` is one value per sequence: the exp of
the masked mean of ``logp - old_logp``.

What it costs: at the token level, ``d loss / d logp_t`` depends only on the token itself (the
weights are known from the mask up front), so each chunk computes its logits, its log-probs and
entropies (pass 1 of :mod:`fk.align.logprobs`' kernel), the per-token loss and its gradient on
those ``n_c`` values (the derivative autograd takes of TRL's formula, ties and clips included),
and writes ``dz`` over the logits (pass 2): one pass with gradients, 6 N H V FLOPs (4 N H V with
a frozen head), as :func:`fk.flce.linear_cross_entropy`. At the sequence level a token's gradient
depends on its whole sequence: the loss then runs on :func:`fk.align.fused_linear_logprobs` and
autograd (8 N H V FLOPs).

Not supported (yet): ``loss_type="vespo"``, ``top_entropy_quantile < 1``,
``off_policy_mask_threshold``, vLLM's importance-sampling correction, the MoE aux loss.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fk.align.logprobs import (
    LogProbsOutput,
    check_temperature,
    fused_linear_logprobs,
    fused_linear_logprobs_ref,
    launch_token_logprobs,
)
from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.ops import fake_from
from fk.flce.chunks import (
    DEFAULT_MEMORY_BUDGET,
    chunk_tokens_for,
    define_stored_grads_op,
    empty_output,
    head_grad_fakes,
    head_grads,
)
from fk.flce.cross_entropy import check_num_items, row_values
from fk.flce.linear_cross_entropy import check_inputs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
"""TRL 1.16's ``GRPOConfig.loss_type`` values supported here (all but ``"vespo"``)."""

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IGNORE = -100  # the label of a completion token outside the mask


class GRPOOptions(NamedTuple):
    """The per-token loss' settings (TRL's ``GRPOConfig`` names; ``delta = inf``: no two-sided clip)."""

    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    delta: float
    importance_sampling_level: str
    use_bias_correction_kl: bool
    sapo_temperature_pos: float
    sapo_temperature_neg: float


class GRPOOutput(NamedTuple):
    """The loss (0-dim fp32, differentiable), the per-token log-probabilities and entropies
    ``(B, T)`` (fp32, without gradient; 0 outside the mask; entropies None unless computed), and
    TRL's logged metrics by their TRL names (0-dim tensors, this process' batch only)."""

    loss: torch.Tensor
    per_token_logps: torch.Tensor
    entropies: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


# --- 1. The loss on per-token log-probabilities (TRL's formula) -----------------------------------


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    options: GRPOOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-token loss, ``coef_1`` (the ratio after the two-sided clip, for the clip metrics), k3
    KL or None) of ``logps`` ``(..., T)``, as TRL; ``advantages`` broadcasts against ``logps``.
    At the sequence level ``coef_1`` (and the policy term) has one value per sequence, the masked
    mean over ``mask`` (only read there)."""
    o = options
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if o.importance_sampling_level == "sequence":
        assert mask is not None
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    coef_1 = torch.exp(log_weights)
    kl = None
    if o.beta != 0.0:
        assert ref_logps is not None
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if o.use_bias_correction_kl:
            kl = kl * coef_1
    if o.loss_type == "cispo":
        loss = -torch.clamp(coef_1, max=o.epsilon_high).detach() * advantages * logps
    elif o.loss_type == "sapo":
        tau = torch.where(advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages
    else:
        coef_2 = torch.clamp(coef_1, 1 - o.epsilon_low, 1 + o.epsilon_high)
        if math.isfinite(o.delta):
            coef_1 = torch.clamp(coef_1, max=o.delta)
        loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if kl is not None:
        loss = loss + o.beta * kl
    return loss, coef_1, kl


# Gradient at the token level, d l / d logp, as autograd differentiates the formula above (the
# single pass needs it inside a custom op, where autograd does not run). With r = exp(logp - old)
# (r = 1 on-policy, where old is logp itself, detached), d r / d logp = r:
#   KL:      d kl / d logp = 1 - exp(ref - logp); with the bias correction, d (kl r) = dkl r + kl r
#   cispo:   -c A with c = min(r, eps_high), detached
#   sapo:    -4 A s (1 - s) r with s = sigmoid(tau (r - 1))
#   clipped: l = -min(a, b), a = min(r, delta) A, b = clip(r, 1 - eps_low, 1 + eps_high) A:
#            -(u_a A r [r <= delta] + u_b A r [1 - eps_low <= r <= 1 + eps_high]), where
#            torch.min's backward gives u = 1 to the smaller of a and b, 0 to the other, 1/2 each on a tie
#            (and torch.clamp's passes the gradient where the value is within its bounds, ends included).


def per_token_loss_grad(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    options: GRPOOptions,
) -> torch.Tensor:
    """``d per_token_loss / d logps`` at the token level, elementwise (see the comment above)."""
    o = options
    a_ = advantages
    r = torch.exp(logps - old_logps) if old_logps is not None else torch.ones_like(logps)
    if o.loss_type == "cispo":
        grad = -torch.clamp(r, max=o.epsilon_high) * a_
    elif o.loss_type == "sapo":
        tau = torch.where(a_ > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        s = torch.sigmoid(tau * (r - 1))
        grad = -4 * a_ * s * (1 - s) * r
    else:
        lo, hi = 1 - o.epsilon_low, 1 + o.epsilon_high
        a = torch.clamp(r, max=o.delta) * a_ if math.isfinite(o.delta) else r * a_
        b = torch.clamp(r, lo, hi) * a_
        u_a = torch.where(a == b, 0.5, (a < b).float())
        u_b = torch.where(a == b, 0.5, (b < a).float())
        da = r * (r <= o.delta) if math.isfinite(o.delta) else r
        db = r * ((r >= lo) & (r <= hi))
        grad = -(u_a * a_ * da + u_b * a_ * db)
    if o.beta != 0.0:
        assert ref_logps is not None
        ratio = torch.exp(ref_logps - logps)
        dkl = 1 - ratio
        if o.use_bias_correction_kl:
            dkl = dkl * r + (ratio - (ref_logps - logps) - 1) * r
        grad = grad + o.beta * dkl
    return grad


def token_weights(
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: torch.Tensor | float | None,
    gradient_accumulation_steps: int,
) -> torch.Tensor:
    """``w`` ``(B, T)`` fp32 with ``loss = sum(w * per_token_loss)``: TRL's aggregation per
    ``loss_type`` (see the module docstring), which depends on the mask alone."""
    m = mask if mask.is_floating_point() else mask.float()
    n_seqs = m.shape[0]
    if loss_type in ("grpo", "sapo"):
        w = m / m.sum(-1, keepdim=True).clamp(min=1.0) / n_seqs
    elif loss_type == "bnpo":
        w = m / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        assert max_completion_length is not None
        w = m / (n_seqs * max_completion_length)
    elif loss_type == "luspo":
        w = m / n_seqs
    else:  # dapo, cispo: the caller's global count, already per accumulation window (no division below)
        items = m.sum() if num_items_in_batch is None else check_num_items(num_items_in_batch, "mean", m.device)
        assert items is not None
        return m / items.to(m.dtype).clamp(min=1.0)
    return w / gradient_accumulation_steps


def entropy_weights(mask: torch.Tensor, entropy_coef: float, gradient_accumulation_steps: int) -> torch.Tensor:
    """The entropy bonus' ``d loss / d H_t``: ``-entropy_coef * m_t / sum(m) / accumulation``."""
    m = mask if mask.is_floating_point() else mask.float()
    return -entropy_coef * m / m.sum().clamp(min=1.0) / gradient_accumulation_steps


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's ``global_masked_mean`` on one process (one value per sequence: their plain mean)."""
    if x.shape[-1] == 1:
        return x.sum() / max(x.shape[0], 1)
    m = mask.float()
    return (x * m).sum() / m.sum().clamp(min=1.0)


def _seq_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """TRL's ``nanmin``/``nanmax`` of ``masked_seq_mean``: NaN (a sequence without tokens) skipped."""
    per_seq = x.squeeze(-1) if x.shape[-1] == 1 else (x * mask).sum(-1) / mask.float().sum(-1)
    fill = -math.inf if largest else math.inf
    cleaned = torch.where(torch.isnan(per_seq), fill, per_seq)
    best = cleaned.max() if largest else cleaned.min()
    return torch.where(torch.isnan(per_seq).all(), math.nan, best)


def grpo_metrics(
    coef_1: torch.Tensor,
    kl: torch.Tensor | None,
    entropies: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: GRPOOptions,
) -> dict[str, torch.Tensor]:
    """TRL's logged metrics (one process), by their names, without gradient."""
    o = options
    out: dict[str, torch.Tensor] = {}
    m = mask.float()
    if kl is not None:
        out["kl"] = _masked_mean(kl.detach(), m)
    if entropies is not None:
        out["entropy"] = _masked_mean(entropies.detach(), m)
    coef_1 = coef_1.detach()
    if o.loss_type in CLIPPED_LOSS_TYPES:
        low = ((coef_1 < 1 - o.epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + o.epsilon_high) & (advantages > 0)).float()
        out["clip_ratio/low_mean"] = _masked_mean(low, m)
        out["clip_ratio/high_mean"] = _masked_mean(high, m)
        out["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), m)
        out["clip_ratio/low_min"] = _seq_extreme(low, m, largest=False)
        out["clip_ratio/high_max"] = _seq_extreme(high, m, largest=True)
    elif o.loss_type == "cispo":
        out["cispo_clip_ratio"] = _masked_mean(((coef_1 > o.epsilon_high) & (advantages > 0)).float(), m)
    return out


def grpo_loss_from_logps(
    logps: torch.Tensor,
    entropies: torch.Tensor | None,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: GRPOOptions,
    weights: torch.Tensor,
    entropy_coef: float,
    gradient_accumulation_steps: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) from per-token log-probabilities ``(B, T)`` by autograd: the reference's
    path, and the fused path's at the sequence level."""
    loss_t, coef_1, kl = per_token_loss(logps, old_logps, ref_logps, advantages, mask, options)
    loss = (loss_t * weights).sum()
    metrics = grpo_metrics(coef_1, kl, entropies, advantages.expand_as(coef_1), mask, options)
    if entropy_coef != 0.0:
        assert entropies is not None
        metrics["policy_loss"] = loss.detach() * (gradient_accumulation_steps if options.loss_type not in
                                                  ("dapo", "cispo") else 1)  # fmt: skip
        loss = loss + (entropies * entropy_weights(mask, entropy_coef, gradient_accumulation_steps)).sum()
    return loss, metrics


# --- 2. The single pass at the token level, registered as custom ops -----------------------------

# (loss, logp, entropy, coef_1, kl, dh, dw, db, dlogits): torch.library needs the arity spelled out.
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


def _grpo_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    weights: torch.Tensor,
    entropy_grad: torch.Tensor | None,
    loss_type: str,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    delta: float,
    use_bias_correction_kl: bool,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
    temperature: float,
    want_entropy: bool,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    """Forward launcher on flat tokens (``hidden`` ``(N, H)``, every other tensor ``(N,)``): the
    token-level loss ``sum(weights * l)`` (minus the entropy bonus, through ``entropy_grad``: its
    gradient per token) with its gradients for an upstream gradient of 1, as
    :func:`fk.flce.chunks.head_grads` returns them, plus per token logp, entropy, coef_1 and KL."""
    options = GRPOOptions(loss_type, beta, epsilon_low, epsilon_high, delta, "token", use_bias_correction_kl,
                          sapo_temperature_pos, sapo_temperature_neg)  # fmt: skip
    logp, lse, coef_1, loss_rows = row_values(hidden), row_values(hidden), row_values(hidden), row_values(hidden)
    entropy = row_values(hidden) if want_entropy else empty_output(hidden, torch.float32)
    kl = row_values(hidden) if beta != 0.0 else empty_output(hidden, torch.float32)

    def chunk_loss(logits: torch.Tensor, rows: slice, want_grad: bool) -> None:
        launch_token_logprobs(logits, target[rows], IGNORE, temperature, lse=lse[rows], logp=logp[rows],
                              entropy=entropy[rows] if want_entropy else None)  # fmt: skip
        lp, old = logp[rows], old_logps[rows] if old_logps is not None else None
        ref = ref_logps[rows] if ref_logps is not None else None
        loss_t, coef_1[rows], kl_c = per_token_loss(lp, old, ref, advantages[rows], None, options)
        loss_rows[rows] = loss_t * weights[rows]
        if kl_c is not None:
            kl[rows] = kl_c
        if want_grad:
            grad_logp = per_token_loss_grad(lp, old, ref, advantages[rows], options) * weights[rows]
            launch_token_logprobs(logits, target[rows], IGNORE, temperature, lse=lse[rows],
                                  entropy=entropy[rows] if entropy_grad is not None else None, forward=False,
                                  grad_logp=grad_logp.float().contiguous(),
                                  grad_entropy=entropy_grad[rows] if entropy_grad is not None else None)  # fmt: skip

    grads = head_grads(hidden, weight, bias, chunk_tokens, chunk_loss, accum_fp32, compute_dh, compute_dw, compute_db)
    loss = loss_rows.sum()
    if entropy_grad is not None:
        loss = loss + (entropy * entropy_grad).sum()
    return (loss, logp, entropy, coef_1, kl, *grads)


def _grpo_fwd_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    beta: float,
    want_entropy: bool,
    chunk_tokens: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
) -> Outputs:
    rows = row_values(hidden)
    none = empty_output(hidden, torch.float32)
    return (
        rows.new_empty(()), rows, torch.empty_like(rows) if want_entropy else none, torch.empty_like(rows),
        torch.empty_like(rows) if beta != 0.0 else empty_output(hidden, torch.float32),
        *head_grad_fakes(hidden, weight, bias, chunk_tokens, accum_fp32, compute_dh, compute_dw, compute_db),
    )  # fmt: skip


_grpo_token_loss = define_stored_grads_op(
    __name__, "grpo_token_loss", _grpo_fwd, fake_from(_grpo_fwd, _grpo_fwd_fake), grads_at=5, n_inputs=24
)


# --- 3. Functional API ----------------------------------------------------------------------------


def _placed(values: torch.Tensor, kept: torch.Tensor, shape: tuple[int, ...], fill: float) -> torch.Tensor:
    """Per-token ``values`` of the ``kept`` flat positions, placed in a flat tensor of ``shape``'s
    size filled with ``fill`` elsewhere."""
    return values.new_full((math.prod(shape),), fill).index_copy_(0, kept, values)


def check_number(name: str, value: object, *, low: float = 0.0) -> float:
    """``value``: a finite number >= ``low``, as a float (else a ``ValueError`` naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return float(value)


def check_per_token(name: str, t: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> None:
    """``t``: None, or a tensor of ``shape`` on ``device`` (the one of ``hidden``)."""
    if t is None:
        return
    validate.check_tensor(name, t)
    validate.check_shape(name, t, shape)
    if t.device != device:
        raise ValueError(f"{name} must be on the device of hidden ({device}), got {t.device}")


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    gradient_accumulation_steps: int = 1,
    temperature: float = 1.0,
    entropy_coef: float = 0.0,
    use_bias_correction_kl: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    return_entropy: bool = True,
    reference: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    skip_ignored: bool = True,
) -> GRPOOutput:
    """The GRPO loss on the fused head, as TRL 1.16's ``GRPOTrainer`` (see the module docstring).

    Args:
        hidden: ``(B, T, H)`` the policy's hidden states at the positions that predict the
            completion tokens (TRL: the last ``T + 1`` positions but the last).
        weight, bias, accum_dtype, memory_budget: as in :func:`fk.align.fused_linear_logprobs`.
        completion_ids: ``(B, T)`` the sampled tokens; ``completion_mask``: ``(B, T)`` 1 where a
            token counts (TRL's ``completion_mask``, times its ``tool_mask``), any dtype.
        advantages: ``(B,)`` or ``(B, T)``.
        old_per_token_logps: ``(B, T)`` the sampling policy's log-probs; None: on-policy (ratio 1,
            TRL's ``per_token_logps.detach()``).
        ref_per_token_logps: ``(B, T)``, needed when ``beta`` != 0 (the KL term's weight).
        epsilon_low, epsilon_high (default ``epsilon_low``), delta, importance_sampling_level,
            loss_type, max_completion_length (dr_grpo), temperature, entropy_coef,
            use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg: TRL's fields.
        num_items_in_batch: the dapo/cispo denominator: what TRL computes as
            ``num_items_in_batch / num_processes * gradient_accumulation_steps / steps_per_generation``
            (a number or a one-element tensor); default this batch's masked token count.
        gradient_accumulation_steps: TRL's ``current_gradient_accumulation_steps`` (the loss types
            other than dapo/cispo, and the entropy bonus, are divided by it).
        return_entropy: compute each token's entropy (TRL always logs its mean).
        reference: run the fp32 full-logit reference instead (the tests' definition).
        skip_ignored: at the token level, compute the logits of the tokens in the mask only (a
            token outside it adds nothing to the loss or its gradient): one host synchronization
            (the count of masked tokens) to leave the others' rows out; False keeps the call free
            of synchronization and computes every row. Not under ``torch.compile``.

    Returns a :class:`GRPOOutput`.
    """
    validate.check_tensor("hidden", hidden)
    validate.check_ndim("hidden", hidden, 3)
    validate.check_choice("loss_type", loss_type, LOSS_TYPES)
    validate.check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    if not isinstance(skip_ignored, bool):
        raise TypeError(f"skip_ignored must be a bool, got {type(skip_ignored).__name__}")
    shape = tuple(hidden.shape[:2])
    validate.check_tensor("completion_mask", completion_mask)
    check_per_token("completion_mask", completion_mask, shape, hidden.device)
    validate.check_tensor("completion_ids", completion_ids)
    check_per_token("completion_ids", completion_ids, shape, hidden.device)
    validate.check_tensor("advantages", advantages)
    if tuple(advantages.shape) not in (shape[:1], shape):
        raise ValueError(f"advantages must have shape {shape[:1]} or {shape}, got {tuple(advantages.shape)}")
    check_per_token("old_per_token_logps", old_per_token_logps, shape, hidden.device)
    check_per_token("ref_per_token_logps", ref_per_token_logps, shape, hidden.device)
    beta = check_number("beta", beta)
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("ref_per_token_logps must be given when beta != 0 (the KL term needs it)")
    epsilon_low = check_number("epsilon_low", epsilon_low)
    epsilon_high = epsilon_low if epsilon_high is None else check_number("epsilon_high", epsilon_high)
    delta_value = math.inf if delta is None else check_number("delta", delta)
    if loss_type == "dr_grpo" and (
        isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int)
        or max_completion_length <= 0
    ):  # fmt: skip
        raise ValueError(f"max_completion_length must be a positive int for loss_type 'dr_grpo', "
                         f"got {max_completion_length!r}")  # fmt: skip
    if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) or \
            gradient_accumulation_steps <= 0:  # fmt: skip
        raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gradient_accumulation_steps!r}")
    entropy_coef = check_number("entropy_coef", entropy_coef, low=-math.inf)
    temperature = check_temperature(temperature)
    options = GRPOOptions(loss_type, beta, epsilon_low, epsilon_high, delta_value, importance_sampling_level,
                          bool(use_bias_correction_kl), check_number("sapo_temperature_pos", sapo_temperature_pos),
                          check_number("sapo_temperature_neg", sapo_temperature_neg))  # fmt: skip
    compute = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for the reference in fp64)
    mask = completion_mask.to(compute)
    target = torch.where(completion_mask.bool(), completion_ids, IGNORE)
    if not reference:  # (the reference also takes fp64, for the tests)
        check_inputs(hidden, weight, target, bias, None, IGNORE, "none", 0.0, 0.0, None, False, None, accum_dtype,
                     memory_budget)  # fmt: skip
    want_entropy = return_entropy or entropy_coef != 0.0
    adv = advantages.to(compute) if advantages.ndim == 2 else advantages.to(compute).unsqueeze(1)
    weights = token_weights(mask, loss_type, max_completion_length, num_items_in_batch, gradient_accumulation_steps)
    old = old_per_token_logps.to(compute) if old_per_token_logps is not None else None
    ref = ref_per_token_logps.to(compute) if ref_per_token_logps is not None else None

    single_pass = importance_sampling_level == "token" and not reference and uses_kernel(hidden)
    if not single_pass:
        if reference:
            out = fused_linear_logprobs_ref(hidden, weight, target, bias=bias, temperature=temperature,
                                            ignore_index=IGNORE, return_entropy=True)  # fmt: skip
        else:
            out = fused_linear_logprobs(hidden, weight, target, bias=bias, temperature=temperature,
                                        ignore_index=IGNORE, return_entropy=want_entropy, accum_dtype=accum_dtype,
                                        memory_budget=memory_budget)  # fmt: skip
        logps, entropies = (out.logps, out.entropy) if isinstance(out, LogProbsOutput) else (out, None)
        entropies = entropies if want_entropy else None
        loss, metrics = grpo_loss_from_logps(logps, entropies, old, ref, adv, mask, options, weights, entropy_coef,
                                             gradient_accumulation_steps)  # fmt: skip
        return GRPOOutput(loss, logps.detach(), entropies.detach() if entropies is not None else None, metrics)

    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    if hidden2d.stride(-1) != 1 or hidden2d.stride(0) != hidden2d.shape[1]:
        hidden2d = hidden2d.contiguous()
    entropy_grad = (entropy_weights(mask, entropy_coef, gradient_accumulation_steps).reshape(-1)
                    if entropy_coef != 0.0 else None)  # fmt: skip
    flat = lambda t: t.reshape(-1).contiguous() if t is not None else None  # noqa: E731
    flat_target = target.reshape(-1)
    per_token = [flat_target, flat(adv.expand(shape)), flat(old), flat(ref), flat(weights), entropy_grad]
    kept = None
    if skip_ignored and not torch.compiler.is_compiling():
        kept = flat_target.ne(IGNORE).nonzero().squeeze(1)  # (the host synchronization)
        if kept.numel() < flat_target.numel():  # only the masked tokens' rows; autograd scatters dh back
            hidden2d = hidden2d.index_select(0, kept)
            per_token = [t.index_select(0, kept) if t is not None else None for t in per_token]
        else:
            kept = None
    n_tokens = None if torch.compiler.is_compiling() else hidden2d.shape[0]
    chunk_tokens = chunk_tokens_for(memory_budget, weight.shape[0], hidden.element_size(), n_tokens)
    grad_on = torch.is_grad_enabled()
    loss, logp, entropy, coef_1, kl, *_ = _grpo_token_loss(
        hidden2d, weight, bias, *per_token, loss_type, beta, epsilon_low, epsilon_high, delta_value,
        bool(use_bias_correction_kl), options.sapo_temperature_pos, options.sapo_temperature_neg, temperature,
        want_entropy, chunk_tokens, accum_dtype != weight.dtype, grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad, grad_on and bias is not None and bias.requires_grad,
    )  # fmt: skip
    if kept is not None:  # each token's values back in place: 0 outside the mask (coef_1: 1)
        logp, coef_1 = _placed(logp, kept, shape, 0.0), _placed(coef_1, kept, shape, 1.0)
        entropy = _placed(entropy, kept, shape, 0.0) if want_entropy else entropy
        kl = _placed(kl, kept, shape, 0.0) if beta != 0.0 else kl
    logps = logp.reshape(shape)
    entropies = entropy.reshape(shape) if want_entropy else None
    metrics = grpo_metrics(coef_1.reshape(shape), kl.reshape(shape) if beta != 0.0 else None, entropies,
                           adv.expand(shape), mask, options)  # fmt: skip
    if entropy_coef != 0.0:
        assert entropies is not None
        bonus = (entropies * entropy_weights(mask, entropy_coef, gradient_accumulation_steps)).sum()
        metrics["policy_loss"] = (loss.detach() - bonus) * (gradient_accumulation_steps if loss_type not in
                                                            ("dapo", "cispo") else 1)  # fmt: skip
    return GRPOOutput(loss, logps, entropies, metrics)
