"""fk.align: preference, RL and distillation losses on the fused LM head, without the ``[tokens, vocab]`` logits.

- :func:`fused_linear_logprobs` (and ``_ref``): per-token log-probabilities (and entropies) of
  ``hidden @ weight.T + bias`` at a temperature, the building block of every loss here;
  :func:`token_statistics` the per-token entropy, mean logit and top-1 that TRL's metrics read
  (:class:`TokenStats`; DPO and KTO give them from their own pass with ``return_token_stats``).
- :func:`fused_linear_dpo_loss`, :func:`fused_linear_cpo_loss` (SimPO, AlphaPO),
  :func:`fused_linear_orpo_loss`: paired preference losses as TRL computes them, with TRL's
  metrics (:class:`PreferenceOutput`); :func:`fused_linear_kto_loss` (:class:`KTOOutput`) for
  unpaired ones. Their formulas on sequence log-probabilities: :func:`dpo_pair_losses`,
  :func:`cpo_pair_losses`, :func:`orpo_pair_losses`, :func:`kto_sequence_losses`;
  :func:`sequence_logps` gives those log-probabilities.
- :func:`fused_linear_grpo_loss`: GRPO and TRL's variants (:data:`GRPO_LOSS_TYPES`), token or
  sequence importance sampling, KL to a reference, entropy bonus, TRL's metrics
  (:class:`GRPOOutput`); in one pass with gradients at the token level.
- :func:`fused_linear_rloo_loss`: RLOO's clipped objective on each completion's log-probability,
  TRL's metrics (:class:`RLOOOutput`); in one pass with gradients over chunks of whole completions.
- :func:`fused_linear_distill` (and ``_ref``), :class:`LinearDistillLoss`: a student head
  distilled from a frozen teacher head (generalized JSD, forward/reverse KL, TVD) as TRL computes
  them, neither head's logits built; :func:`fused_linear_distill_from_logits` from precomputed
  teacher logits (TRL's GKD trainer); :func:`distill_loss_ref` on full logits.
"""

from fk.align.distill import (
    LinearDistillLoss,
    distill_loss_ref,
    fused_linear_distill,
    fused_linear_distill_from_logits,
    fused_linear_distill_ref,
)
from fk.align.grpo import LOSS_TYPES as GRPO_LOSS_TYPES
from fk.align.grpo import GRPOOutput, fused_linear_grpo_loss
from fk.align.logprobs import (
    LogProbsOutput,
    TokenStats,
    fused_linear_logprobs,
    fused_linear_logprobs_ref,
    token_statistics,
)
from fk.align.preference import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    KTOOutput,
    PreferenceOutput,
    SequenceLogps,
    cpo_pair_losses,
    dpo_pair_losses,
    fused_linear_cpo_loss,
    fused_linear_dpo_loss,
    fused_linear_kto_loss,
    fused_linear_orpo_loss,
    kto_sequence_losses,
    orpo_pair_losses,
    sequence_logps,
)
from fk.align.rloo import RLOOOutput, fused_linear_rloo_loss

__all__ = [
    "CPO_LOSS_TYPES",
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "KTO_LOSS_TYPES",
    "GRPOOutput",
    "KTOOutput",
    "LinearDistillLoss",
    "LogProbsOutput",
    "PreferenceOutput",
    "RLOOOutput",
    "SequenceLogps",
    "TokenStats",
    "cpo_pair_losses",
    "distill_loss_ref",
    "dpo_pair_losses",
    "fused_linear_cpo_loss",
    "fused_linear_distill",
    "fused_linear_distill_from_logits",
    "fused_linear_distill_ref",
    "fused_linear_dpo_loss",
    "fused_linear_grpo_loss",
    "fused_linear_kto_loss",
    "fused_linear_logprobs",
    "fused_linear_logprobs_ref",
    "fused_linear_orpo_loss",
    "fused_linear_rloo_loss",
    "kto_sequence_losses",
    "orpo_pair_losses",
    "sequence_logps",
    "token_statistics",
]
