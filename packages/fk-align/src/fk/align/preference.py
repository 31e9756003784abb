"""Preference losses on the fused LM head: DPO (and its TRL variants), CPO/SimPO, ORPO and KTO.

Inputs as TRL builds them (KTO's are unpaired: one ``desirable`` flag per sequence): the policy's hidden states ``(B, T, H)`` of the concatenated batch,
chosen sequences first, then rejected ones (``B = 2 P`` for ``P`` pairs), the LM head and the
labels ``(B, T)`` with ``ignore_index`` where a token is not scored (the prompt, padding). A
sequence's log-probability is the sum of its scored tokens' log-probabilities (their mean where
the loss asks for it, as TRL's ``average_log_prob``).

How it runs, and what it costs. One pass (:func:`loss_on_head`, 6 N H V FLOPs for the ``N = B T``
tokens, 4 N H V with a frozen head), as :func:`fk.flce.linear_cross_entropy` and GRPO: the chunks
of fk-flce's engine hold whole pairs (pair ``p`` is sequences ``p`` and ``p + P``, gathered into
one chunk; KTO's hold whole sequences), as many as ``memory_budget``'s logits hold. Per chunk: its
logits, its tokens' log-probabilities (pass 1 of :mod:`fk.align.logprobs`' kernel), their sums per
sequence, the loss' gradient w.r.t. those sums (:func:`sequence_grads`: the formula's derivative,
written out, already divided by the batch's normalisation: the number of pairs, the chosen tokens
of the NLL), ``dz`` over the logits (pass 2), then ``dh`` and the chunk's ``dW`` share at once.
The loss itself is the formula on the sums when the loop ends, and the backward only scales the
stored gradients by the upstream one. This holds where each pair's gradient depends on that pair
alone (and on counts known from the labels): every loss here but DPO's ``"aot"`` and
``"aot_unpaired"``, which sort the margins across the batch (:data:`SINGLE_PASS_DPO_TYPES`); KTO's
batch-level KL estimate is a detached constant given up front. Those two types, a pair whose logits
do not fit the budget (long sequences), the reference and CPU tensors without Triton run in two
passes: :func:`fk.align.fused_linear_logprobs` (2 N H V), autograd on the sums, and a backward that
recomputes each chunk's logits (6 N H V): 8 N H V FLOPs.

Memory (the forward's, which is the peak; ``dh`` and the returned gradients come on top): with one
chunk (every pair fits the budget), that chunk's logits' gradient (``N V`` in the head's dtype) is
kept and ``dW`` made from it in the backward; with several, the chunk's logits (``n_c V``) and the
``dW`` sum: by default (``accum_dtype=None``) in the head's own dtype, the returned gradient
itself, where the pass has at most :data:`fk.align.budget.HEAD_DTYPE_SUM_CHUNKS` chunks, else an
fp32 accumulator (``V H * 4`` bytes) as in fk-flce; ``accum_dtype`` chooses either always. The
default budget, :data:`fk.align.budget.ALIGN_MEMORY_BUDGET`, is smaller than fk-flce's.

Each loss has a ``*_pair_losses`` function on sequence log-probabilities (the formula, one value
per pair, usable with log-probabilities from anywhere) and a ``fused_linear_*_loss`` that runs
it on the fused head and returns a :class:`PreferenceOutput` with TRL's metrics. The reference of
each is the same formula on :func:`fk.align.fused_linear_logprobs_ref` (full logits): the tests
compare the two, and compare the formulas with TRL's own trainer code.

Not matched (yet): TRL's DPO ``f_divergence_type`` other than ``"reverse_kl"``, ``ld_alpha``,
``use_weighting`` (WPO), ``loss_weights`` only as given (no per-type defaults); the metrics TRL
computes from extra head outputs (entropy, ``logits/*``, ``mean_token_accuracy``); ORPO's and CPO's
NLL term is over the scored tokens of the chosen labels given here, where TRL's (decoder-only)
scores the prompt too; a sequence with no scored token has log-probability 0 and mean 0 (TRL's
mean is NaN there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fk.align.budget import ALIGN_MEMORY_BUDGET, sums_in_fp32
from fk.align.grpo import GRPOOptions, check_per_token, per_token_loss, per_token_loss_grad
from fk.align.logprobs import (
    TokenStats,
    chunk_token_stats,
    fused_linear_logprobs,
    fused_linear_logprobs_ref,
    launch_token_logprobs,
    token_statistics,
)
from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import cdiv
from fk.core.ops import fake_from
from fk.flce.chunks import (
    DEFAULT_MEMORY_BUDGET,
    chunk_tokens_for,
    define_stored_grads_op,
    gathered_head_grads,
    head_grad_fakes,
)
from fk.flce.cross_entropy import row_values
from fk.flce.linear_cross_entropy import check_inputs, shift_labels

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # fmt: skip
"""TRL 1.16's ``DPOConfig.loss_type`` values, all supported."""

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
"""TRL 1.16's ``CPOConfig.loss_type`` values ("alphapo" there is "simpo" with ``cpo_alpha=0`` here)."""


class PreferenceOutput(NamedTuple):
    """The loss and TRL's metrics. Per-pair metrics are ``(P,)`` fp32 tensors without gradient
    (TRL logs their mean over the gathered batch)."""

    loss: torch.Tensor  # 0-dim fp32, differentiable
    chosen_logps: torch.Tensor  # the sequence log-probabilities the loss used (sum, or mean per token)
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    reward_margins: torch.Tensor  # chosen_rewards - rejected_rewards
    reward_accuracies: torch.Tensor  # 1.0 where chosen_rewards > rejected_rewards
    nll_loss: torch.Tensor | None = None  # CPO and ORPO: the chosen sequences' mean NLL per token
    log_odds_ratio: torch.Tensor | None = None  # ORPO: mean of logsigmoid(log_odds)
    log_odds_chosen: torch.Tensor | None = None  # ORPO: mean of log_odds
    token_stats: TokenStats | None = None  # DPO with return_token_stats: each position's (shifted) statistics


class SequenceLogps(NamedTuple):
    """Per-token log-probabilities ``(B, T)`` and, per sequence ``(B,)``, their sum and the count
    of scored tokens (the labels not ``ignore_index``)."""

    per_token: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor
    entropy: torch.Tensor | None = None  # (B, T) at the temperature, with return_entropy

    def means(self) -> torch.Tensor:
        """The mean log-probability per scored token of each sequence (0 for a sequence with none)."""
        return self.sums / self.counts.clamp(min=1)


# --- 1. Sequence log-probabilities ----------------------------------------------------------------


def sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    shift: bool = False,
    reference: bool = False,
    return_entropy: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> SequenceLogps:
    """Per-token and per-sequence log-probabilities of ``target`` ``(B, T)`` under the head at
    ``temperature``, on :func:`fk.align.fused_linear_logprobs` (``reference``: on the full logits
    instead); ``return_entropy``: each token's entropy too."""
    validate.check_tensor("hidden", hidden)
    validate.check_ndim("hidden", hidden, 3)
    if reference:
        out = fused_linear_logprobs_ref(hidden, weight, target, bias=bias, temperature=temperature,
                                        ignore_index=ignore_index, shift=shift, return_entropy=return_entropy)  # fmt: skip
    else:
        out = fused_linear_logprobs(hidden, weight, target, bias=bias, temperature=temperature, ignore_index=ignore_index,
                                    shift=shift, return_entropy=return_entropy, accum_dtype=accum_dtype,
                                    memory_budget=memory_budget)  # fmt: skip
    per_token, entropy = (out.logps, out.entropy) if return_entropy else (out, None)
    scored = (shift_labels(target, ignore_index) if shift else target) != ignore_index
    return SequenceLogps(per_token, per_token.sum(-1), scored.sum(-1).to(per_token.dtype), entropy)


def _pairs(t: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if t.shape[0] % 2:
        raise ValueError(f"{name} must hold the chosen sequences then the rejected ones (an even batch), "
                         f"got {t.shape[0]} sequences")  # fmt: skip
    chosen, rejected = t.chunk(2, dim=0)
    return chosen, rejected


def _check_beta(beta: object) -> float:
    value = validate.check_positive_float("beta", beta)
    if not math.isfinite(value):
        raise ValueError(f"beta must be finite, got {beta}")
    return value


def _check_label_smoothing(label_smoothing: object, high: float = 1.0) -> float:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing < high:
        raise ValueError(f"label_smoothing must be in [0, {high}), got {label_smoothing}")
    return float(label_smoothing)


def _metrics(
    loss: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    **extras: Any,
) -> PreferenceOutput:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return PreferenceOutput(loss, chosen_logps.detach(), rejected_logps.detach(), chosen_rewards, rejected_rewards,
                            chosen_rewards - rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                            **extras)  # fmt: skip


# --- 2. DPO ---------------------------------------------------------------------------------------


def dpo_pair_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    chosen_counts: torch.Tensor | None = None,
    rejected_counts: torch.Tensor | None = None,
    discopop_tau: float = 0.05,
) -> torch.Tensor:
    """One DPO loss per pair, as TRL 1.16's ``DPOTrainer`` (``f_divergence_type="reverse_kl"``):
    with ``c = chosen - ref_chosen`` and ``r = rejected - ref_rejected`` (sequence sums) and
    ``d = c - r``, e.g. ``"sigmoid"``: ``-logsigmoid(beta d)``. ``"ipo"`` and ``"sigmoid_norm"``
    divide ``c`` and ``r`` by the scored-token counts (``chosen_counts``, ``rejected_counts``,
    clamped to 1). ``"sft"`` is ``-sum(chosen) / sum(chosen_counts)``, spread over the pairs."""
    c, r = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    d = c - r
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * d)
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type in ("ipo", "sigmoid_norm"):
        if chosen_counts is None or rejected_counts is None:
            raise ValueError(f"loss_type={loss_type!r} needs chosen_counts and rejected_counts")
        d_avg = c / chosen_counts.clamp(min=1) - r / rejected_counts.clamp(min=1)
        return (d_avg - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * d_avg)
    if loss_type == "exo_pair":
        return (torch.sigmoid(beta * d) * (F.logsigmoid(beta * d) - math.log1p(-eps))
                + torch.sigmoid(-beta * d) * (F.logsigmoid(-beta * d) - math.log(eps)))  # fmt: skip
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            delta = (torch.sort(chosen_logps - rejected_logps, dim=0)[0]
                     - torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)[0])  # fmt: skip
        else:
            delta = torch.sort(c, dim=0)[0] - torch.sort(r, dim=0)[0]
        return -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * (c - r))
    if loss_type == "discopop":
        logits = beta * d
        mix = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
    if loss_type == "sft":
        if chosen_counts is None:
            raise ValueError("loss_type='sft' needs chosen_counts")
        return (-chosen_logps.sum() / chosen_counts.sum().clamp(min=1)).expand(chosen_logps.shape[0])
    raise ValueError(f"loss_type must be one of {', '.join(repr(t) for t in DPO_LOSS_TYPES)}, got {loss_type!r}")


def fused_linear_dpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    ignore_index: int = -100,
    shift: bool = False,
    reference: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = ALIGN_MEMORY_BUDGET,
    return_token_stats: bool = False,
) -> PreferenceOutput:
    """DPO on the fused head, as TRL 1.16's ``DPOTrainer`` computes it.

    Args:
        hidden: ``(2 P, T, H)`` the policy's last hidden states, chosen sequences first.
        weight, bias, ignore_index, shift, accum_dtype, memory_budget: as in
            :func:`fk.align.fused_linear_logprobs` (``shift=True`` takes TRL's unshifted labels),
            but ``memory_budget`` defaults to :data:`fk.align.budget.ALIGN_MEMORY_BUDGET` and, in
            the single pass, ``accum_dtype=None`` sums ``dW`` in the head's dtype over at most
            :data:`fk.align.budget.HEAD_DTYPE_SUM_CHUNKS` chunks (see the module docstring).
        target: ``(2 P, T)`` labels, ``ignore_index`` where not scored.
        ref_chosen_logps, ref_rejected_logps: ``(P,)`` the reference model's sequence
            log-probabilities (TRL's precomputed ``ref_*_logps``); both None: reference-free (0).
        beta, label_smoothing, discopop_tau: TRL's ``DPOConfig`` fields.
        loss_type: one of :data:`DPO_LOSS_TYPES`, or a list of them, summed with ``loss_weights``
            (default all 1), as TRL combines several.
        reference: run the fp32 full-logit reference instead (the tests' definition).
        return_token_stats: also each position's entropy, mean logit and whether its label is the
            top-1 (:class:`~fk.align.logprobs.TokenStats`, ``(2 P, T)``, without gradient; what
            TRL's ``entropy``, ``logits/*`` and ``mean_token_accuracy`` read): in the single pass
            from its own logits (two more reads of each chunk's), else one more pass over the head
            (:func:`~fk.align.logprobs.token_statistics`, 2 N H V FLOPs).

    Returns a :class:`PreferenceOutput`: ``loss`` is the mean over pairs (weighted sum over loss
    types); rewards are ``beta * (logps - ref_logps)`` of the sequence sums.
    """
    beta = _check_beta(beta)
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    for t in types:
        validate.check_choice("loss_type", t, DPO_LOSS_TYPES)
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(f"loss_weights must have one weight per loss_type ({len(types)}), got {len(weights)}")
    label_smoothing = _check_label_smoothing(label_smoothing, 0.5 if "robust" in types else 1.0)
    if "exo_pair" in types and label_smoothing == 0:
        raise ValueError("label_smoothing must be > 0 for loss_type 'exo_pair' (it takes log(label_smoothing))")
    validate.check_tensor("hidden", hidden)
    n_pairs = hidden.shape[0] // 2
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("ref_chosen_logps and ref_rejected_logps must both be given, or both None (reference-free)")
    check_per_token("ref_chosen_logps", ref_chosen_logps, (n_pairs,), hidden.device)
    check_per_token("ref_rejected_logps", ref_rejected_logps, (n_pairs,), hidden.device)
    ref = None
    if ref_chosen_logps is not None and ref_rejected_logps is not None:
        compute = torch.promote_types(hidden.dtype, torch.float32)
        ref = torch.cat([ref_chosen_logps, ref_rejected_logps]).to(compute)
    spec = LossSpec("dpo", tuple(types), tuple(weights), beta, label_smoothing, discopop_tau)
    out = loss_on_head(spec, hidden, weight, target, bias, ref, None, None, ignore_index, shift, reference, accum_dtype,
                       memory_budget, return_token_stats)  # fmt: skip
    chosen, rejected = _pairs(out.sums, "hidden")
    ref_chosen, ref_rejected = _pairs(torch.zeros_like(out.sums) if ref is None else ref.to(out.sums.dtype), "ref")
    return _metrics(out.loss, chosen, rejected, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected),
                    token_stats=out.token_stats)  # fmt: skip


# --- 3. CPO and SimPO -----------------------------------------------------------------------------


def cpo_pair_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen_rewards, rejected_rewards) per pair, as TRL 1.16's ``CPOTrainer.cpo_loss``:
    no reference model; ``alpha`` != 0 is AlphaPO's reward ``(1 - p^-alpha) / alpha``."""
    if alpha != 0.0:
        chosen_r = (1 - torch.exp(chosen_logps).pow(-alpha)) / alpha
        rejected_r = (1 - torch.exp(rejected_logps).pow(-alpha)) / alpha
    else:
        chosen_r, rejected_r = chosen_logps, rejected_logps
    logits = chosen_r - rejected_r
    if loss_type == "simpo":
        logits = logits - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {', '.join(repr(t) for t in CPO_LOSS_TYPES)}, got {loss_type!r}")
    return losses, beta * chosen_r.detach(), beta * rejected_r.detach()


def _chosen_nll(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The chosen sequences' cross entropy, averaged over their scored tokens (0 with none)."""
    chosen_sums, _ = _pairs(sums, "hidden")
    chosen_counts, _ = _pairs(counts, "hidden")
    return -chosen_sums.sum() / chosen_counts.sum().clamp(min=1)


def fused_linear_cpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    alpha: float = 0.0,
    ignore_index: int = -100,
    shift: bool = False,
    reference: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = ALIGN_MEMORY_BUDGET,
) -> PreferenceOutput:
    """CPO on the fused head, as TRL 1.16's ``CPOTrainer`` (SimPO: ``loss_type="simpo"``,
    ``cpo_alpha=0``; AlphaPO: that and ``alpha`` != 0). Sequence log-probabilities are sums, or
    means per scored token for ``"ipo"`` and ``"simpo"``; ``loss = mean(losses) + cpo_alpha * nll``
    with ``nll`` the chosen sequences' mean cross entropy per scored token. Arguments as in
    :func:`fused_linear_dpo_loss` and TRL's ``CPOConfig``."""
    beta = _check_beta(beta)
    validate.check_choice("loss_type", loss_type, CPO_LOSS_TYPES)
    label_smoothing = _check_label_smoothing(label_smoothing)
    spec = LossSpec("cpo", (loss_type,), (1.0,), beta, label_smoothing, simpo_gamma=simpo_gamma, cpo_alpha=cpo_alpha,
                    alpha=alpha)  # fmt: skip
    out = loss_on_head(spec, hidden, weight, target, bias, None, None, None, ignore_index, shift, reference,
                       accum_dtype, memory_budget)  # fmt: skip
    sums, counts = out.sums.detach(), out.counts
    chosen, rejected = _pairs(sums / counts.clamp(min=1) if spec.uses_means else sums, "hidden")
    _, chosen_rewards, rejected_rewards = cpo_pair_losses(chosen, rejected, beta=beta, loss_type=loss_type,
                                                          label_smoothing=label_smoothing, simpo_gamma=simpo_gamma,
                                                          alpha=alpha)  # fmt: skip
    nll = _chosen_nll(sums, counts) if cpo_alpha != 0 else chosen.new_zeros(())
    return _metrics(out.loss, chosen, rejected, chosen_rewards, rejected_rewards, nll_loss=nll)


# --- 4. ORPO --------------------------------------------------------------------------------------


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (two forms, split at ``-log 2``)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_pair_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``logsigmoid(log_odds)``, ``log_odds``) per pair, as TRL 1.16's
    ``ORPOTrainer.odds_ratio_loss``: ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))`` of the
    mean log-probabilities per token ``c`` and ``r``. The loss subtracts ``beta`` times the first's mean."""
    log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
    return F.logsigmoid(log_odds), log_odds


def fused_linear_orpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    shift: bool = False,
    reference: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = ALIGN_MEMORY_BUDGET,
) -> PreferenceOutput:
    """ORPO on the fused head, as TRL 1.16's ``ORPOTrainer``: ``loss = nll - mean(beta *
    logsigmoid(log_odds))`` on mean log-probabilities per scored token, ``nll`` the chosen
    sequences' mean cross entropy per scored token; rewards ``beta * logps``. Arguments as in
    :func:`fused_linear_dpo_loss`."""
    beta = _check_beta(beta)
    spec = LossSpec("orpo", ("orpo",), (1.0,), beta)
    out = loss_on_head(spec, hidden, weight, target, bias, None, None, None, ignore_index, shift, reference,
                       accum_dtype, memory_budget)  # fmt: skip
    sums, counts = out.sums.detach(), out.counts
    chosen, rejected = _pairs(sums / counts.clamp(min=1), "hidden")
    ratio, log_odds = orpo_pair_losses(chosen, rejected)
    nll = _chosen_nll(sums, counts)
    return _metrics(out.loss, chosen, rejected, beta * chosen, beta * rejected, nll_loss=nll,
                    log_odds_ratio=ratio.mean().detach(),
                    log_odds_chosen=log_odds.mean().detach())  # fmt: skip


# --- 5. KTO ---------------------------------------------------------------------------------------

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
"""TRL 1.16's ``KTOConfig.loss_type`` values, all supported."""


class KTOOutput(NamedTuple):
    """The loss (0-dim fp32, differentiable), each sequence's log-probability (sum over its scored
    tokens) and reward ``(B,)`` without gradient, and TRL's metrics by their TRL names (0-dim
    tensors of this batch: ``kl``, ``rewards/chosen``, ``logps/chosen``, ``rewards/rejected``,
    ``logps/rejected``, ``rewards/margins``; a mean over no desirable (undesirable) sequence is
    NaN, where TRL logs nothing)."""

    loss: torch.Tensor
    logps: torch.Tensor
    rewards: torch.Tensor
    metrics: dict[str, torch.Tensor]
    token_stats: TokenStats | None = None  # with return_token_stats


def kto_sequence_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """One KTO loss per sequence, as TRL 1.16's ``KTOTrainer``: with ``l = logps - ref_logps``,
    desirable ``w_d (1 - sigmoid(beta (l - kl)))``, undesirable ``w_u (1 - sigmoid(beta (kl - l)))``
    (``"apo_zero_unpaired"``: ``w_d (1 - sigmoid(beta l))`` and ``w_u sigmoid(beta l)``)."""
    logratios = logps - ref_logps
    if loss_type == "kto":
        chosen = 1 - torch.sigmoid(beta * (logratios - kl))
        rejected = 1 - torch.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        chosen = 1 - torch.sigmoid(beta * logratios)
        rejected = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"loss_type must be one of {', '.join(repr(t) for t in KTO_LOSS_TYPES)}, got {loss_type!r}")
    return torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)


def fused_linear_kto_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    desirable: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    kl_logps: torch.Tensor | None = None,
    ref_kl_logps: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    ignore_index: int = -100,
    shift: bool = False,
    reference: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = ALIGN_MEMORY_BUDGET,
    return_token_stats: bool = False,
) -> KTOOutput:
    """KTO on the fused head, as TRL 1.16's ``KTOTrainer`` (unpaired: one label per sequence).

    Args:
        hidden, weight, target, bias, ignore_index, shift, reference, accum_dtype, memory_budget,
            return_token_stats: as in :func:`fused_linear_dpo_loss`, for ``B`` sequences in any order.
        desirable: ``(B,)`` bool, TRL's ``label`` (True: desirable).
        ref_logps: ``(B,)`` the reference model's sequence log-probabilities (None: 0).
        kl_logps, ref_kl_logps: the policy's and the reference's sequence log-probabilities of
            TRL's mismatched KL completions (``(B_kl,)``, the policy's without gradient: compute
            them with :func:`fk.align.fused_linear_logprobs` under ``torch.no_grad()``); the KL
            estimate is ``max(mean(kl_logps - ref_kl_logps), 0)``. None: 0 (TRL's
            ``apo_zero_unpaired`` never computes it).
        beta, loss_type, desirable_weight, undesirable_weight: TRL's ``KTOConfig`` fields.

    The loss is the mean over the ``B`` sequences of :func:`kto_sequence_losses`, in one pass
    (6 N H V FLOPs) over chunks of whole sequences (see the module docstring).
    """
    beta = _check_beta(beta)
    validate.check_choice("loss_type", loss_type, KTO_LOSS_TYPES)
    validate.check_tensor("hidden", hidden)
    validate.check_tensor("desirable", desirable)
    validate.check_shape("desirable", desirable, tuple(hidden.shape[:1]))
    if (kl_logps is None) != (ref_kl_logps is None):
        raise ValueError("kl_logps and ref_kl_logps must both be given, or both None (a KL estimate of 0)")
    for name, value in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    compute = torch.promote_types(hidden.dtype, torch.float32)
    check_per_token("ref_logps", ref_logps, (hidden.shape[0],), hidden.device)
    ref = (
        torch.zeros(hidden.shape[0], dtype=compute, device=hidden.device)
        if ref_logps is None
        else ref_logps.to(compute)
    )
    if kl_logps is not None and ref_kl_logps is not None:
        validate.check_tensor("kl_logps", kl_logps)
        check_per_token("ref_kl_logps", ref_kl_logps, (kl_logps.shape[0],), hidden.device)
        kl = (kl_logps.detach() - ref_kl_logps).to(compute).mean().clamp(min=0)
    else:
        kl = torch.zeros((), dtype=compute, device=hidden.device)
    desirable = desirable.to(device=hidden.device, dtype=torch.bool)
    spec = LossSpec("kto", (loss_type,), (1.0,), beta, desirable_weight=float(desirable_weight),
                    undesirable_weight=float(undesirable_weight))  # fmt: skip
    out = loss_on_head(spec, hidden, weight, target, bias, ref, desirable, kl, ignore_index, shift, reference,
                       accum_dtype, memory_budget, return_token_stats)  # fmt: skip
    logps = out.sums.detach()
    rewards = beta * (logps - ref.to(logps.dtype))
    n_chosen = desirable.sum()
    n_rejected = (~desirable).sum()
    metrics = {
        "kl": kl.detach(),
        "rewards/chosen": torch.where(desirable, rewards, 0).sum() / n_chosen,
        "logps/chosen": torch.where(desirable, logps.detach(), 0).sum() / n_chosen,
        "rewards/rejected": torch.where(desirable, 0, rewards).sum() / n_rejected,
        "logps/rejected": torch.where(desirable, 0, logps.detach()).sum() / n_rejected,
    }
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return KTOOutput(out.loss, logps, rewards, metrics, out.token_stats)


# --- 6. The loss on the head, in one pass where each pair's loss is its own -----------------------

SINGLE_PASS_DPO_TYPES = frozenset(DPO_LOSS_TYPES) - {"aot", "aot_unpaired"}
"""The DPO loss types whose gradient at a pair depends only on that pair's values (and on counts
known from the labels up front: ``"sft"``'s denominator). ``"aot"`` and ``"aot_unpaired"`` sort
the margins across the batch: a pair's gradient depends on every other pair, so they run in two
passes."""


class LossSpec(NamedTuple):
    """A sequence-level loss and TRL's settings of it, as the single pass takes them (``family``:
    ``"dpo"``, ``"cpo"``, ``"orpo"``, ``"kto"`` or ``"rloo"``; ``types`` and ``type_weights``:
    DPO's list of loss types and their weights, the one type of the others)."""

    family: str
    types: tuple[str, ...]
    type_weights: tuple[float, ...]
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0
    alpha: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    epsilon_low: float = 0.2  # RLOO's clip range
    epsilon_high: float = 0.2
    temperature: float = 1.0  # the logits are divided by it (RLOO's sampling temperature)

    @property
    def paired(self) -> bool:
        return self.family not in ("kto", "rloo")

    @property
    def uses_means(self) -> bool:
        """Whether the loss reads mean log-probabilities per scored token (else sums)."""
        return self.family == "orpo" or (self.family == "cpo" and self.types[0] in ("ipo", "simpo"))

    @property
    def single_pass(self) -> bool:
        """Whether each pair's (sequence's) gradient depends on its own values alone."""
        return self.family != "dpo" or all(t in SINGLE_PASS_DPO_TYPES for t in self.types)


def rloo_options(spec: LossSpec) -> GRPOOptions:
    """RLOO's per-sequence objective as GRPO's clipped one (:func:`fk.align.grpo.per_token_loss`)
    on one value per sequence: no KL term (RLOO puts it in the reward), no two-sided clip."""
    return GRPOOptions("grpo", 0.0, spec.epsilon_low, spec.epsilon_high, math.inf, "token", False, 1.0, 1.0)


def sequence_loss(
    spec: LossSpec,
    sums: torch.Tensor,
    counts: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor | None,
    kl: torch.Tensor | None,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss (0-dim) from each sequence's log-probability sum ``(B,)`` and scored-token count,
    by the ``*_pair_losses`` formulas: both passes' loss (autograd differentiates it in two).
    ``ref``: RLOO's old log-probabilities, beside its ``advantages``."""
    if spec.family == "rloo":
        assert advantages is not None
        return per_token_loss(sums, ref.to(sums.dtype), None, advantages.to(sums.dtype), None,
                              rloo_options(spec))[0].mean()  # fmt: skip
    if spec.family == "kto":
        assert desirable is not None and kl is not None
        return kto_sequence_losses(sums, ref.to(sums.dtype), desirable, kl.to(sums.dtype), beta=spec.beta,
                                   loss_type=spec.types[0], desirable_weight=spec.desirable_weight,
                                   undesirable_weight=spec.undesirable_weight).mean()  # fmt: skip
    values = sums / counts.clamp(min=1) if spec.uses_means else sums
    chosen, rejected = _pairs(values, "hidden")
    chosen_counts, rejected_counts = _pairs(counts, "hidden")
    if spec.family == "dpo":
        ref_chosen, ref_rejected = _pairs(ref.to(sums.dtype), "ref")
        loss = sums.new_zeros(())
        for t, w in zip(spec.types, spec.type_weights, strict=True):
            pair_losses = dpo_pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta=spec.beta, loss_type=t,
                                          label_smoothing=spec.label_smoothing, chosen_counts=chosen_counts,
                                          rejected_counts=rejected_counts, discopop_tau=spec.discopop_tau)  # fmt: skip
            loss = loss + pair_losses.mean() * w
        return loss
    nll = -_pairs(sums, "hidden")[0].sum() / chosen_counts.sum().clamp(min=1)
    if spec.family == "cpo":
        losses, _, _ = cpo_pair_losses(chosen, rejected, beta=spec.beta, loss_type=spec.types[0],
                                       label_smoothing=spec.label_smoothing, simpo_gamma=spec.simpo_gamma,
                                       alpha=spec.alpha)  # fmt: skip
        return losses.mean() + spec.cpo_alpha * nll if spec.cpo_alpha != 0 else losses.mean()
    ratio, _ = orpo_pair_losses(chosen, rejected)
    return nll - spec.beta * ratio.mean()


# The gradient of sequence_loss w.r.t. each sequence's sum, written out (the single pass needs it
# inside a custom op, where autograd does not run), as autograd differentiates the formulas above.
# With s(x) = sigmoid(x), d/dx -logsigmoid(x) = -s(-x), d/dx s(x) = s(x) s(-x), b = beta, eps the
# label smoothing, and DPO's c = chosen - ref_chosen, r = rejected - ref_rejected, d = c - r, x = b d:
#   sigmoid -b s(-x) | hinge -b [1 - x > 0] | robust b (-(1 - eps) s(-x) - eps s(x)) / (1 - 2 eps)
#   exo_pair b s(x) s(-x) (x - log(1 - eps) + log(eps))
#   discopop, m = s(x / tau): b (-s(-x) (1 - m) - e^-x m + m (1 - m) / tau (logsigmoid(x) + e^-x))
#   (each d/dd: +1 to c, -1 to r); ipo 2 (d' - 1/(2b)) and sigmoid_norm -b s(-b d') of
#   d' = c / n_c - r / n_r (so 1/n_c to c, -1/n_r to r); and per side:
#   nca_pair  c: -b s(-bc) + b s(bc) / 2, r: b s(br) / 2 | bco_pair c: -b s(-bc), r: b s(br)
#   sppo_hard c: 2 (c - 1/(2b)), r: 2 (r + 1/(2b))   | apo_zero c: -b s(bc) s(-bc), r: b s(br) s(-br)
#   apo_down  c: b s(bc) s(-bc) - b s(x) s(-x), r: b s(x) s(-x)
# each over the P pairs (the mean); sft's -sum(chosen) / sum(n_c) gives -1 / sum(n_c) to each chosen.
# CPO on x = b (u(c) - u(r) - [simpo] gamma / b), u(v) = v or AlphaPO's (1 - e^(-alpha v)) / alpha
# (u' = e^(-alpha v)): sigmoid/simpo b (-(1 - eps) s(-x) + eps s(x)), hinge -b [1 - x > 0], ipo
# 2 (x / b - 1/(2b)), times u'(c) to c and -u'(r) to r, over P; its NLL gives -cpo_alpha / sum(n_c)
# to each chosen sum. ORPO on means, o = (c - r) - (log(1 - e^c) - log(1 - e^r)):
# d o / d c = -1 / expm1(c), d o / d r = 1 / expm1(r), and d loss / d o = -b s(-o) / P, plus the NLL's
# -1 / sum(n_c). A mean's gradient reaches its sum divided by the count. KTO on l = sum - ref:
# desirable -w_d b s(y) s(-y) with y = b (l - kl) ("apo_zero_unpaired": y = b l), undesirable
# w_u b s(y) s(-y) with y = b (kl - l) (b l), over the B sequences. RLOO on r = exp(sum - old):
# GRPO's clipped objective's derivative (fk.align.grpo.per_token_loss_grad) over the B sequences.


def _sigmoid_slope(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * torch.sigmoid(-x)


def _dpo_grads(
    spec: LossSpec, chosen: torch.Tensor, rejected: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor,
    ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, n_pairs: int, chosen_total: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, eps = spec.beta, spec.label_smoothing
    c, r = chosen - ref_chosen, rejected - ref_rejected
    d = c - r
    x = b * d
    n_c, n_r = n_c.clamp(min=1), n_r.clamp(min=1)
    gc, gr = torch.zeros_like(c), torch.zeros_like(r)
    for t, w in zip(spec.types, spec.type_weights, strict=True):
        if t == "sft":
            gc = gc - w * n_pairs / chosen_total.clamp(min=1)  # (the division by n_pairs below undoes n_pairs)
            continue
        if t in ("ipo", "sigmoid_norm"):
            d_avg = c / n_c - r / n_r
            g = 2 * (d_avg - 1 / (2 * b)) if t == "ipo" else -b * torch.sigmoid(-b * d_avg)
            gc, gr = gc + w * g / n_c, gr - w * g / n_r
            continue
        side: tuple[torch.Tensor, torch.Tensor] | None = None
        if t == "sigmoid":
            g = -b * torch.sigmoid(-x)
        elif t == "hinge":
            g = -b * (1 - x > 0).to(x.dtype)
        elif t == "robust":
            g = b * (-(1 - eps) * torch.sigmoid(-x) - eps * torch.sigmoid(x)) / (1 - 2 * eps)
        elif t == "exo_pair":
            g = b * _sigmoid_slope(x) * (x - math.log1p(-eps) + math.log(eps))
        elif t == "discopop":
            tau = spec.discopop_tau
            mix = torch.sigmoid(x / tau)
            g = b * (-torch.sigmoid(-x) * (1 - mix) - torch.exp(-x) * mix
                     + mix * (1 - mix) / tau * (F.logsigmoid(x) + torch.exp(-x)))  # fmt: skip
        elif t == "nca_pair":
            side = -b * torch.sigmoid(-b * c) + b * torch.sigmoid(b * c) / 2, b * torch.sigmoid(b * r) / 2
        elif t == "bco_pair":
            side = -b * torch.sigmoid(-b * c), b * torch.sigmoid(b * r)
        elif t == "sppo_hard":
            side = 2 * (c - 0.5 / b), 2 * (r + 0.5 / b)
        elif t == "apo_zero":
            side = -b * _sigmoid_slope(b * c), b * _sigmoid_slope(b * r)
        elif t == "apo_down":
            side = b * _sigmoid_slope(b * c) - b * _sigmoid_slope(x), b * _sigmoid_slope(x)
        else:
            raise ValueError(f"loss_type {t!r} takes two passes")
        g_c, g_r = side if side is not None else (g, -g)
        gc, gr = gc + w * g_c, gr + w * g_r
    return gc / n_pairs, gr / n_pairs


def _cpo_grads(
    spec: LossSpec, chosen: torch.Tensor, rejected: torch.Tensor, n_pairs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    b, eps, loss_type = spec.beta, spec.label_smoothing, spec.types[0]
    if spec.alpha != 0.0:
        u_c, u_r = torch.exp(chosen).pow(-spec.alpha), torch.exp(rejected).pow(-spec.alpha)  # u'(c), u'(r)
        logits = (1 - u_c) / spec.alpha - (1 - u_r) / spec.alpha
    else:
        u_c = u_r = torch.ones_like(chosen)
        logits = chosen - rejected
    if loss_type == "simpo":
        logits = logits - spec.simpo_gamma / b
    x = b * logits
    if loss_type in ("sigmoid", "simpo"):
        g = b * (-(1 - eps) * torch.sigmoid(-x) + eps * torch.sigmoid(x))
    elif loss_type == "hinge":
        g = -b * (1 - x > 0).to(x.dtype)
    else:  # ipo
        g = 2 * (logits - 1 / (2 * b))
    return g * u_c / n_pairs, -g * u_r / n_pairs


def _orpo_grads(
    spec: LossSpec, chosen: torch.Tensor, rejected: torch.Tensor, n_pairs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    g = -spec.beta * torch.sigmoid(-log_odds) / n_pairs
    return g * -1 / torch.expm1(chosen), g / torch.expm1(rejected)


def _kto_grads(
    spec: LossSpec, sums: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, n_seqs: int
) -> torch.Tensor:
    b, logratios = spec.beta, sums - ref
    shift = kl if spec.types[0] == "kto" else torch.zeros_like(kl)
    chosen = -spec.desirable_weight * b * _sigmoid_slope(b * (logratios - shift))
    rejected = spec.undesirable_weight * b * _sigmoid_slope(b * (shift - logratios))
    return torch.where(desirable, chosen, rejected) / n_seqs


def sequence_grads(
    spec: LossSpec,
    sums: torch.Tensor,
    counts: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor | None,
    kl: torch.Tensor | None,
    n_seqs: int,
    chosen_total: torch.Tensor,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """``d loss / d sums`` (the gradient of each scored token's log-probability) of the sequences
    of one chunk (:func:`sequence_loss` of the whole batch of ``n_seqs`` sequences, see the
    derivation above): chosen then rejected sequences of the same pairs when paired.
    ``chosen_total``: the batch's scored chosen tokens (the NLL's and ``"sft"``'s denominator)."""
    if spec.family == "rloo":
        assert advantages is not None
        return per_token_loss_grad(sums, ref, None, advantages, rloo_options(spec)) / n_seqs
    if spec.family == "kto":
        assert desirable is not None and kl is not None
        return _kto_grads(spec, sums, ref, desirable, kl, n_seqs)
    n_pairs = n_seqs // 2
    values = sums / counts.clamp(min=1) if spec.uses_means else sums
    chosen, rejected = _pairs(values, "sums")
    n_c, n_r = _pairs(counts, "counts")
    if spec.family == "dpo":
        ref_chosen, ref_rejected = _pairs(ref, "ref")
        gc, gr = _dpo_grads(spec, chosen, rejected, n_c, n_r, ref_chosen, ref_rejected, n_pairs, chosen_total)
    elif spec.family == "cpo":
        gc, gr = _cpo_grads(spec, chosen, rejected, n_pairs)
    else:
        gc, gr = _orpo_grads(spec, chosen, rejected, n_pairs)
    if spec.uses_means:
        gc, gr = gc / n_c.clamp(min=1), gr / n_r.clamp(min=1)
    nll_weight = 1.0 if spec.family == "orpo" else spec.cpo_alpha if spec.family == "cpo" else 0.0
    if nll_weight != 0.0:
        gc = gc - nll_weight / chosen_total.clamp(min=1)
    return torch.cat([gc, gr])


def sequence_chunks(n_seqs: int, per_chunk: int, paired: bool) -> list[tuple[slice, ...]]:
    """The sequences of each chunk, as ranges of the batch: ``per_chunk`` whole pairs (pair ``p``
    is sequences ``p`` and ``p + n_seqs / 2``: two ranges per chunk, one when it holds every pair)
    or, unpaired, ``per_chunk`` sequences; balanced (as many chunks as ``per_chunk`` needs, of
    equal size but the last)."""
    groups = n_seqs // 2 if paired else n_seqs
    if groups == 0:
        return []
    per_chunk = cdiv(groups, cdiv(groups, max(1, per_chunk)))
    out: list[tuple[slice, ...]] = []
    for start in range(0, groups, per_chunk):
        stop = min(start + per_chunk, groups)
        if not paired:
            out.append((slice(start, stop),))
        elif start == 0 and stop == groups:
            out.append((slice(0, n_seqs),))
        else:
            out.append((slice(start, stop), slice(groups + start, groups + stop)))
    return out


# (loss, sums, dh, dw, db, dlogits, entropy, mean logit, top-1): torch.library needs the arity spelled out.
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                torch.Tensor, torch.Tensor]  # fmt: skip


def _stats_buffers(
    like: torch.Tensor, tokens: int, want_entropy: bool, want_stats: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one pass's flat entropy, mean-logit and top-1 outputs for ``tokens`` tokens: the
    entropy with either flag, the other two with ``want_stats`` (empty where not asked for; each its
    own tensor: a custom op's outputs may not alias)."""
    stat_tokens = tokens if want_stats else 0
    entropy = like.new_zeros(tokens if want_entropy or want_stats else 0, dtype=torch.float32)
    return entropy, like.new_zeros(stat_tokens, dtype=torch.float32), like.new_zeros(stat_tokens, dtype=torch.bool)


def _preference_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor | None,
    kl: torch.Tensor | None,
    advantages: torch.Tensor | None,
    family: str,
    types: str,
    type_weights: list[float],
    beta: float,
    label_smoothing: float,
    discopop_tau: float,
    simpo_gamma: float,
    cpo_alpha: float,
    alpha: float,
    desirable_weight: float,
    undesirable_weight: float,
    epsilon_low: float,
    epsilon_high: float,
    temperature: float,
    ignore_index: int,
    seqs_per_chunk: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
    want_entropy: bool,
    want_stats: bool,
) -> Outputs:
    """Forward launcher on flat tokens (``hidden`` ``(B T, H)``, ``target`` ``(B, T)``, ``ref``
    ``(B,)`` fp32; ``types``: :class:`LossSpec`'s, joined by commas): the loss with its gradients for an upstream gradient of 1, as
    :func:`fk.flce.chunks.head_grads` returns them, and each sequence's log-probability sum.
    Each chunk's logits give its tokens' log-probabilities (pass 1 of :mod:`fk.align.logprobs`'
    kernel), their sums per sequence, :func:`sequence_grads` on those, and ``dz`` over the logits
    (pass 2), then ``dh`` and the chunk's ``dW`` share. With ``want_stats``, also each token's
    :class:`~fk.align.logprobs.TokenStats` values, flat: the entropy from pass 1, the mean logit and
    the top-1 from the chunk's logits before pass 2 overwrites them; with ``want_entropy`` the
    entropy alone (else empty outputs)."""
    spec = LossSpec(family, tuple(types.split(",")), tuple(type_weights), beta, label_smoothing, discopop_tau, simpo_gamma,
                    cpo_alpha, alpha, desirable_weight, undesirable_weight, epsilon_low, epsilon_high,
                    temperature)  # fmt: skip
    n_seqs, seq_len = target.shape
    counts = (target != ignore_index).sum(-1).to(torch.float32)
    chosen_total = counts[: n_seqs // 2].sum() if spec.paired else counts.sum()
    sums = torch.empty(n_seqs, dtype=torch.float32, device=hidden.device)
    flat_target = target.reshape(-1)
    stats = _stats_buffers(hidden, flat_target.shape[0], want_entropy, want_stats)
    chunks = sequence_chunks(n_seqs, seqs_per_chunk // 2 if spec.paired else seqs_per_chunk, spec.paired)

    def chunk_loss(logits: torch.Tensor, parts: tuple[slice, ...], want_grad: bool) -> None:
        seqs = [slice(part.start // seq_len, part.stop // seq_len) for part in parts]
        tgt = flat_target[parts[0]] if len(parts) == 1 else torch.cat([flat_target[part] for part in parts])
        lse, logp = row_values(logits), row_values(logits)
        entropy = row_values(logits) if want_stats or want_entropy else None
        launch_token_logprobs(logits, tgt, ignore_index, temperature, lse=lse, logp=logp, entropy=entropy)
        if entropy is not None:  # (before pass 2 writes dz over the logits)
            values = chunk_token_stats(logits, tgt, ignore_index, entropy) if want_stats else (entropy,)
            offset = 0
            for part in parts:
                size = part.stop - part.start
                for out, value in zip(stats, values, strict=False):
                    out[part] = value[offset : offset + size]
                offset += size
        chunk_sums = logp.view(-1, seq_len).sum(-1)
        offset = 0
        for rows in seqs:
            size = rows.stop - rows.start
            sums[rows] = chunk_sums[offset : offset + size]
            offset += size
        if not want_grad:
            return
        pick = lambda t: t[seqs[0]] if len(seqs) == 1 else torch.cat([t[rows] for rows in seqs])  # noqa: E731
        grad = sequence_grads(spec, chunk_sums, pick(counts), pick(ref), pick(desirable) if desirable is not None
                              else None, kl, n_seqs, chosen_total,
                              pick(advantages) if advantages is not None else None)  # fmt: skip
        grad_logp = grad.to(torch.float32).unsqueeze(-1).expand(-1, seq_len).reshape(-1).contiguous()
        launch_token_logprobs(logits, tgt, ignore_index, temperature, lse=lse, forward=False, grad_logp=grad_logp)

    token_chunks = [tuple(slice(rows.start * seq_len, rows.stop * seq_len) for rows in seqs) for seqs in chunks]
    grads = gathered_head_grads(hidden, weight, bias, token_chunks, chunk_loss, accum_fp32, compute_dh, compute_dw,
                                compute_db)  # fmt: skip
    loss = sequence_loss(spec, sums, counts, ref, desirable, kl, advantages)
    return (loss, sums, *grads, *stats)


def _preference_fwd_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    family: str,
    seqs_per_chunk: int,
    accum_fp32: bool,
    compute_dh: bool,
    compute_dw: bool,
    compute_db: bool,
    want_entropy: bool,
    want_stats: bool,
) -> Outputs:
    n_seqs = target.shape[0]
    paired = LossSpec(family, (), (), 1.0).paired
    one_chunk = len(sequence_chunks(n_seqs, seqs_per_chunk // 2 if paired else seqs_per_chunk, paired)) == 1
    sums = hidden.new_empty(n_seqs, dtype=torch.float32)
    grads = head_grad_fakes(hidden, weight, bias, hidden.shape[0] if one_chunk else 0, accum_fp32, compute_dh,
                            compute_dw, compute_db)  # fmt: skip
    return (sums.new_empty(()), sums, *grads, *_stats_buffers(hidden, hidden.shape[0], want_entropy, want_stats))


_preference_loss = define_stored_grads_op(
    __name__,
    "preference_loss",
    _preference_fwd,
    fake_from(_preference_fwd, _preference_fwd_fake),
    grads_at=2,
    n_inputs=30,
)


def seqs_per_chunk_for(spec: LossSpec, memory_budget: int, vocab: int, itemsize: int, seq_len: int) -> int:
    """Sequences per chunk of the single pass (a multiple of 2 when paired): as many whole pairs
    (sequences) as the budget's logits hold; 0 where not even one fits (two passes then)."""
    tokens = chunk_tokens_for(memory_budget, vocab, itemsize)
    group = 2 * seq_len if spec.paired else seq_len
    return tokens // max(group, 1) * (2 if spec.paired else 1)


class SequenceValues(NamedTuple):
    """What a loss' metrics read: the loss, each sequence's log-probability sum and its count, and
    where asked for, each position's :class:`TokenStats` or its entropy alone ``(B, T)``."""

    loss: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor
    token_stats: TokenStats | None = None
    entropy: torch.Tensor | None = None


def loss_on_head(
    spec: LossSpec,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ref: torch.Tensor | None,
    desirable: torch.Tensor | None,
    kl: torch.Tensor | None,
    ignore_index: int,
    shift: bool,
    reference: bool,
    accum_dtype: torch.dtype | None,
    memory_budget: int,
    token_stats: bool = False,
    advantages: torch.Tensor | None = None,
    entropy: bool = False,
) -> SequenceValues:
    """The loss of ``spec`` on the head: one pass (:data:`_preference_loss`, 6 N H V FLOPs) where
    the loss is per pair (:attr:`LossSpec.single_pass`) and a pair fits ``memory_budget``'s
    logits, else :func:`sequence_logps` and autograd on :func:`sequence_loss` (8 N H V), as on the
    CPU without Triton and for the reference. ``ref``: ``(B,)`` (DPO: the chosen's then the
    rejected's; RLOO: the old log-probabilities, beside ``advantages``) or None (0).
    ``token_stats``: also each position's :class:`TokenStats` (at temperature 1), from the one
    pass's own logits, else by :func:`~fk.align.logprobs.token_statistics` (2 N H V more).
    ``entropy``: each position's entropy at ``spec.temperature`` alone, from the pass itself."""
    if token_stats and spec.temperature != 1.0:
        raise ValueError("token_stats are taken at temperature 1")
    validate.check_tensor("hidden", hidden)
    validate.check_ndim("hidden", hidden, 3)
    n_seqs, seq_len = hidden.shape[:2]
    per_chunk = seqs_per_chunk_for(spec, memory_budget, weight.shape[0], hidden.element_size(), seq_len)
    if spec.paired and n_seqs % 2:
        _pairs(hidden, "hidden")  # raises
    if reference or not spec.single_pass or per_chunk == 0 or not uses_kernel(hidden):
        seq = sequence_logps(hidden, weight, target, bias=bias, temperature=spec.temperature,
                             ignore_index=ignore_index, shift=shift, reference=reference, return_entropy=entropy,
                             accum_dtype=accum_dtype, memory_budget=memory_budget)  # fmt: skip
        refs = torch.zeros_like(seq.sums) if ref is None else ref
        stats = None
        if token_stats:
            scored = shift_labels(target, ignore_index) if shift else target
            stats = token_statistics(hidden, weight, scored, bias=bias, ignore_index=ignore_index,
                                     memory_budget=memory_budget)  # fmt: skip
        loss = sequence_loss(spec, seq.sums, seq.counts, refs, desirable, kl, advantages)
        entropies = seq.entropy.detach() if seq.entropy is not None else None
        return SequenceValues(loss, seq.sums, seq.counts, stats, entropies)
    _options, target, _ = check_inputs(hidden, weight, target, bias, None, ignore_index, "none", 0.0, 0.0, None, shift,
                                       None, accum_dtype, memory_budget)  # fmt: skip
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    if hidden2d.stride(-1) != 1 or hidden2d.stride(0) != hidden2d.shape[1]:
        hidden2d = hidden2d.contiguous()
    refs = torch.zeros(n_seqs, dtype=torch.float32, device=hidden.device) if ref is None else ref.float().contiguous()
    grad_on = torch.is_grad_enabled()
    loss, sums, _dh, _dw, _db, _dlogits, *stats = _preference_loss(
        hidden2d, weight, bias, target, refs, desirable, kl.float() if kl is not None else None,
        advantages.float().contiguous() if advantages is not None else None, spec.family, ",".join(spec.types),
        list(spec.type_weights), spec.beta, spec.label_smoothing, spec.discopop_tau, spec.simpo_gamma, spec.cpo_alpha,
        spec.alpha, spec.desirable_weight, spec.undesirable_weight, spec.epsilon_low, spec.epsilon_high,
        spec.temperature, ignore_index, per_chunk, sums_in_fp32(accum_dtype, weight.dtype, cdiv(n_seqs, per_chunk)),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad, entropy, token_stats,
    )  # fmt: skip
    counts = (target != ignore_index).sum(-1).to(torch.float32)
    placed = TokenStats(*(value.view(target.shape) for value in stats)) if token_stats else None
    entropies = stats[0].view(target.shape) if entropy else None
    return SequenceValues(loss, sums, counts, placed, entropies)
