"""Preference losses on the fused LM head: DPO (and its TRL variants), CPO/SimPO, ORPO and KTO.

Inputs as TRL builds them (KTO's are unpaired: one ``desirable`` flag per sequence): the policy's hidden states ``(B, T, H)`` of the concatenated batch,
chosen sequences first, then rejected ones (``B = 2 P`` for ``P`` pairs), the LM head and the
labels ``(B, T)`` with ``ignore_index`` where a token is not scored (the prompt, padding). A
sequence's log-probability is the sum of its scored tokens' log-probabilities (their mean where
the loss asks for it, as TRL's ``average_log_prob``).

How it runs, and what it costs: :func:`fk.align.fused_linear_logprobs` gives every token's
log-probability without the logits (2 N H V FLOPs for the ``N = B T`` tokens); the sums per
sequence and the loss are plain PyTorch on ``(B,)`` values; the backward recomputes each chunk's
logits with each token's upstream gradient, the loss' gradient of its sequence (6 N H V FLOPs).
8 N H V FLOPs in all (6 N H V with a frozen head). A single pass (6 N H V) would need every
pair's two sequences in one chunk; this keeps the chunking free of the batch layout.

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
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fk.align.logprobs import fused_linear_logprobs, fused_linear_logprobs_ref
from fk.core import validate
from fk.flce.chunks import DEFAULT_MEMORY_BUDGET
from fk.flce.linear_cross_entropy import shift_labels

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


class SequenceLogps(NamedTuple):
    """Per-token log-probabilities ``(B, T)`` and, per sequence ``(B,)``, their sum and the count
    of scored tokens (the labels not ``ignore_index``)."""

    per_token: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor

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
    ignore_index: int = -100,
    shift: bool = False,
    reference: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> SequenceLogps:
    """Per-token and per-sequence log-probabilities of ``target`` ``(B, T)`` under the head, on
    :func:`fk.align.fused_linear_logprobs` (``reference``: on the full logits instead)."""
    validate.check_tensor("hidden", hidden)
    validate.check_ndim("hidden", hidden, 3)
    if reference:
        per_token = fused_linear_logprobs_ref(hidden, weight, target, bias=bias, ignore_index=ignore_index, shift=shift)
    else:
        per_token = fused_linear_logprobs(hidden, weight, target, bias=bias, ignore_index=ignore_index, shift=shift,
                                          accum_dtype=accum_dtype, memory_budget=memory_budget)  # fmt: skip
    scored = (shift_labels(target, ignore_index) if shift else target) != ignore_index
    return SequenceLogps(per_token, per_token.sum(-1), scored.sum(-1).to(per_token.dtype))


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
    **extras: torch.Tensor | None,
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


def _check_ref(name: str, ref: torch.Tensor | None, n_pairs: int, device: torch.device) -> None:
    if ref is None:
        return
    validate.check_tensor(name, ref)
    validate.check_shape(name, ref, (n_pairs,))
    if ref.device != device:
        raise ValueError(f"{name} must be on the device of hidden ({device}), got {ref.device}")


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
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> PreferenceOutput:
    """DPO on the fused head, as TRL 1.16's ``DPOTrainer`` computes it.

    Args:
        hidden: ``(2 P, T, H)`` the policy's last hidden states, chosen sequences first.
        weight, bias, ignore_index, shift, accum_dtype, memory_budget: as in
            :func:`fk.align.fused_linear_logprobs` (``shift=True`` takes TRL's unshifted labels).
        target: ``(2 P, T)`` labels, ``ignore_index`` where not scored.
        ref_chosen_logps, ref_rejected_logps: ``(P,)`` the reference model's sequence
            log-probabilities (TRL's precomputed ``ref_*_logps``); both None: reference-free (0).
        beta, label_smoothing, discopop_tau: TRL's ``DPOConfig`` fields.
        loss_type: one of :data:`DPO_LOSS_TYPES`, or a list of them, summed with ``loss_weights``
            (default all 1), as TRL combines several.
        reference: run the fp32 full-logit reference instead (the tests' definition).

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
    seq = sequence_logps(hidden, weight, target, bias=bias, ignore_index=ignore_index, shift=shift,
                         reference=reference, accum_dtype=accum_dtype, memory_budget=memory_budget)  # fmt: skip
    chosen, rejected = _pairs(seq.sums, "hidden")
    chosen_counts, rejected_counts = _pairs(seq.counts, "hidden")
    n_pairs = chosen.shape[0]
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("ref_chosen_logps and ref_rejected_logps must both be given, or both None (reference-free)")
    _check_ref("ref_chosen_logps", ref_chosen_logps, n_pairs, hidden.device)
    _check_ref("ref_rejected_logps", ref_rejected_logps, n_pairs, hidden.device)
    zero = torch.zeros_like(chosen)
    ref_chosen = zero if ref_chosen_logps is None else ref_chosen_logps.to(chosen.dtype)
    ref_rejected = zero if ref_rejected_logps is None else ref_rejected_logps.to(chosen.dtype)
    loss = chosen.new_zeros(())
    for t, w in zip(types, weights, strict=True):
        pair_losses = dpo_pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type=t,
                                      label_smoothing=label_smoothing, chosen_counts=chosen_counts,
                                      rejected_counts=rejected_counts, discopop_tau=discopop_tau)  # fmt: skip
        loss = loss + pair_losses.mean() * w
    return _metrics(loss, chosen, rejected, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected))


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


def _chosen_nll(seq: SequenceLogps) -> torch.Tensor:
    """The chosen sequences' cross entropy, averaged over their scored tokens (0 with none)."""
    chosen_sums, _ = _pairs(seq.sums, "hidden")
    chosen_counts, _ = _pairs(seq.counts, "hidden")
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
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> PreferenceOutput:
    """CPO on the fused head, as TRL 1.16's ``CPOTrainer`` (SimPO: ``loss_type="simpo"``,
    ``cpo_alpha=0``; AlphaPO: that and ``alpha`` != 0). Sequence log-probabilities are sums, or
    means per scored token for ``"ipo"`` and ``"simpo"``; ``loss = mean(losses) + cpo_alpha * nll``
    with ``nll`` the chosen sequences' mean cross entropy per scored token. Arguments as in
    :func:`fused_linear_dpo_loss` and TRL's ``CPOConfig``."""
    beta = _check_beta(beta)
    validate.check_choice("loss_type", loss_type, CPO_LOSS_TYPES)
    label_smoothing = _check_label_smoothing(label_smoothing)
    seq = sequence_logps(hidden, weight, target, bias=bias, ignore_index=ignore_index, shift=shift,
                         reference=reference, accum_dtype=accum_dtype, memory_budget=memory_budget)  # fmt: skip
    chosen, rejected = _pairs(seq.means() if loss_type in ("ipo", "simpo") else seq.sums, "hidden")
    losses, chosen_rewards, rejected_rewards = cpo_pair_losses(chosen, rejected, beta=beta, loss_type=loss_type,
                                                               label_smoothing=label_smoothing,
                                                               simpo_gamma=simpo_gamma, alpha=alpha)  # fmt: skip
    nll = _chosen_nll(seq) if cpo_alpha != 0 else chosen.new_zeros(())
    loss = losses.mean() + cpo_alpha * nll
    return _metrics(loss, chosen, rejected, chosen_rewards, rejected_rewards, nll_loss=nll.detach())


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
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> PreferenceOutput:
    """ORPO on the fused head, as TRL 1.16's ``ORPOTrainer``: ``loss = nll - mean(beta *
    logsigmoid(log_odds))`` on mean log-probabilities per scored token, ``nll`` the chosen
    sequences' mean cross entropy per scored token; rewards ``beta * logps``. Arguments as in
    :func:`fused_linear_dpo_loss`."""
    beta = _check_beta(beta)
    seq = sequence_logps(hidden, weight, target, bias=bias, ignore_index=ignore_index, shift=shift,
                         reference=reference, accum_dtype=accum_dtype, memory_budget=memory_budget)  # fmt: skip
    chosen, rejected = _pairs(seq.means(), "hidden")
    ratio, log_odds = orpo_pair_losses(chosen, rejected)
    nll = _chosen_nll(seq)
    loss = nll - beta * ratio.mean()
    return _metrics(loss, chosen, rejected, beta * chosen, beta * rejected, nll_loss=nll.detach(),
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
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> KTOOutput:
    """KTO on the fused head, as TRL 1.16's ``KTOTrainer`` (unpaired: one label per sequence).

    Args:
        hidden, weight, target, bias, ignore_index, shift, reference, accum_dtype, memory_budget:
            as in :func:`fused_linear_dpo_loss`, for ``B`` sequences in any order.
        desirable: ``(B,)`` bool, TRL's ``label`` (True: desirable).
        ref_logps: ``(B,)`` the reference model's sequence log-probabilities (None: 0).
        kl_logps, ref_kl_logps: the policy's and the reference's sequence log-probabilities of
            TRL's mismatched KL completions (``(B_kl,)``, the policy's without gradient: compute
            them with :func:`fk.align.fused_linear_logprobs` under ``torch.no_grad()``); the KL
            estimate is ``max(mean(kl_logps - ref_kl_logps), 0)``. None: 0 (TRL's
            ``apo_zero_unpaired`` never computes it).
        beta, loss_type, desirable_weight, undesirable_weight: TRL's ``KTOConfig`` fields.

    The loss is the mean over the ``B`` sequences of :func:`kto_sequence_losses` (8 N H V FLOPs).
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
    seq = sequence_logps(hidden, weight, target, bias=bias, ignore_index=ignore_index, shift=shift,
                         reference=reference, accum_dtype=accum_dtype, memory_budget=memory_budget)  # fmt: skip
    logps = seq.sums
    _check_ref("ref_logps", ref_logps, logps.shape[0], hidden.device)
    ref = torch.zeros_like(logps) if ref_logps is None else ref_logps.to(logps.dtype)
    if kl_logps is not None and ref_kl_logps is not None:
        validate.check_tensor("kl_logps", kl_logps)
        _check_ref("ref_kl_logps", ref_kl_logps, kl_logps.shape[0], hidden.device)
        kl = (kl_logps.detach() - ref_kl_logps).to(logps.dtype).mean().clamp(min=0)
    else:
        kl = logps.new_zeros(())
    desirable = desirable.to(device=logps.device, dtype=torch.bool)
    losses = kto_sequence_losses(logps, ref, desirable, kl, beta=beta, loss_type=loss_type,
                                 desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)  # fmt: skip
    rewards = (beta * (logps - ref)).detach()
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
    return KTOOutput(losses.mean(), logps.detach(), rewards, metrics)
