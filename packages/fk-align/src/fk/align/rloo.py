"""RLOO on the fused LM head, without the ``[tokens, vocab]`` logits.

The loss is TRL 1.16's ``RLOOTrainer._compute_loss``: per completion ``i``, with ``s_i`` the sum
of its masked tokens' log-probabilities (at ``temperature``), ``old_i`` the same under the policy
that sampled it (TRL's ``old_logps``), ``A_i`` its advantage (TRL's leave-one-out baseline, the KL
penalty already in the reward) and ``r_i = exp(s_i - old_i)``::

    l_i = -min(r_i A_i, clip(r_i, 1 - epsilon_low, 1 + epsilon_high) A_i),   loss = mean_i l_i

TRL's ``entropy`` metric is the mean entropy over the masked tokens, and its clip ratios are the
fractions of completions with ``r_i < 1 - epsilon_low`` and ``A_i < 0`` (low) or
``r_i > 1 + epsilon_high`` and ``A_i > 0`` (high).

What it costs: a token's gradient depends on its whole completion (through ``r_i``), so the loss
runs in :mod:`fk.align.preference`'s single pass over chunks of whole completions, as KTO's: per
chunk, its logits, the log-probabilities and entropies (pass 1), the sums, ``d loss / d s_i``
(:func:`fk.align.grpo.per_token_loss_grad` on one value per completion: GRPO's clipped objective
and its derivative, ties and clips as autograd takes them), then ``dz`` over the logits (pass 2):
6 N H V FLOPs with gradients (4 N H V with a frozen head). Where a completion's logits do not fit
``memory_budget``, on the CPU without Triton and for the reference: log-probabilities by
:func:`fk.align.fused_linear_logprobs` and autograd (8 N H V).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fk.align.budget import ALIGN_MEMORY_BUDGET
from fk.align.grpo import check_number, check_per_token
from fk.align.logprobs import check_temperature
from fk.align.preference import LossSpec, loss_on_head
from fk.core import validate

IGNORE = -100  # the label of a completion token outside the mask


class RLOOOutput(NamedTuple):
    """The loss (0-dim fp32, differentiable); per completion ``(B,)`` without gradient: its
    log-probability ``s_i``, its ratio ``r_i`` and whether it was clipped low or high (what TRL
    gathers across processes for its clip metrics); each token's entropy ``(B, T)`` (0 outside
    the mask; None unless asked for); TRL's metrics by their TRL names, of this process' batch."""

    loss: torch.Tensor
    logps: torch.Tensor
    ratios: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    entropies: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


def fused_linear_rloo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    temperature: float = 1.0,
    return_entropy: bool = True,
    reference: bool = False,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = ALIGN_MEMORY_BUDGET,
) -> RLOOOutput:
    """The RLOO loss on the fused head, as TRL 1.16's ``RLOOTrainer`` (see the module docstring).

    Args:
        hidden: ``(B, T, H)`` the policy's hidden states at the positions that predict the
            completion tokens (TRL: the last ``T + 1`` positions but the last).
        weight, bias, accum_dtype, memory_budget: as in :func:`fk.align.fused_linear_kto_loss`.
        completion_ids: ``(B, T)`` the sampled tokens; ``completion_mask``: ``(B, T)`` 1 where a
            token counts (TRL's ``completion_mask``), any dtype.
        advantages: ``(B,)``, TRL's ``advantages``.
        old_logps: ``(B,)`` the sampling policy's sequence log-probabilities (TRL's ``old_logps``).
        epsilon_low, epsilon_high (default ``epsilon_low``), temperature: TRL's ``epsilon``,
            ``epsilon_high`` and ``temperature``.
        return_entropy: compute each token's entropy (TRL always logs its mean).
        reference: run the fp32 full-logit reference instead (the tests' definition).

    Returns an :class:`RLOOOutput`.
    """
    validate.check_tensor("hidden", hidden)
    validate.check_ndim("hidden", hidden, 3)
    shape = tuple(hidden.shape[:2])
    for name, t in (("completion_ids", completion_ids), ("completion_mask", completion_mask)):
        check_per_token(name, t, shape, hidden.device)
    for name, t in (("advantages", advantages), ("old_logps", old_logps)):
        check_per_token(name, t, shape[:1], hidden.device)
    epsilon_low = check_number("epsilon_low", epsilon_low)
    epsilon_high = epsilon_low if epsilon_high is None else check_number("epsilon_high", epsilon_high)
    spec = LossSpec("rloo", ("rloo",), (1.0,), 1.0, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                    temperature=check_temperature(temperature))  # fmt: skip
    compute = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for the reference in fp64)
    target = torch.where(completion_mask.bool(), completion_ids, IGNORE)
    adv, old = advantages.to(compute), old_logps.to(compute)
    out = loss_on_head(spec, hidden, weight, target, bias, old, None, None, IGNORE, False, reference, accum_dtype,
                       memory_budget, advantages=adv, entropy=return_entropy)  # fmt: skip
    logps = out.sums.detach()
    ratios = torch.exp(logps - old.to(logps.dtype))
    low = (ratios < 1 - epsilon_low) & (adv < 0)
    high = (ratios > 1 + epsilon_high) & (adv > 0)
    metrics = {
        "clip_ratio/low_mean": low.float().mean(),
        "clip_ratio/low_min": low.float().min(),
        "clip_ratio/high_mean": high.float().mean(),
        "clip_ratio/high_max": high.float().max(),
        "clip_ratio/region_mean": (low | high).float().mean(),
    }
    if out.entropy is not None:
        mask = completion_mask.to(out.entropy.dtype)
        metrics["entropy"] = (out.entropy * mask).sum() / mask.sum().clamp(min=1.0)
    return RLOOOutput(out.loss, logps, ratios, low, high, out.entropy, metrics)
