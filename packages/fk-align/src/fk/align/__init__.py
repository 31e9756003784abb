"""fk.align: preference and RL losses on the fused LM head, without the ``[tokens, vocab]`` logits.

- :func:`fused_linear_logprobs` (and ``_ref``): per-token log-probabilities (and entropies) of
  ``hidden @ weight.T + bias`` at a temperature, the building block of every loss here.
"""

from fk.align.logprobs import LogProbsOutput, fused_linear_logprobs, fused_linear_logprobs_ref

__all__ = ["LogProbsOutput", "fused_linear_logprobs", "fused_linear_logprobs_ref"]
