"""fk.flce: cross entropy for LLM training, and fused linear + cross entropy.

- :func:`cross_entropy` / :class:`CrossEntropyLoss`: drop-ins for ``F.cross_entropy`` on 2-D
  logits, with z-loss, logit softcapping, ``num_items_in_batch`` and per-token extras.
- :func:`linear_cross_entropy` / :class:`LinearCrossEntropyLoss`: the loss of
  ``hidden @ weight.T (+ bias)`` without ever materializing the ``[tokens, vocab]`` logits.
- :func:`vocab_parallel_linear_cross_entropy`: the same with the LM head sharded along the
  vocabulary over a process group (tensor parallelism), two small all-reduces per chunk.

Both fused losses run on :mod:`fk.flce.chunks`, the chunk engine, a public module that other
packages (fk-align) build their fused-head losses on.
"""

from fk.flce.chunks import DEFAULT_MEMORY_BUDGET
from fk.flce.cross_entropy import CrossEntropyLoss, CrossEntropyOutput, cross_entropy, cross_entropy_ref
from fk.flce.linear_cross_entropy import (
    LinearCrossEntropyLoss,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    shift_labels,
)
from fk.flce.vocab_parallel import vocab_parallel_linear_cross_entropy, vocab_parallel_linear_cross_entropy_ref

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "CrossEntropyLoss",
    "CrossEntropyOutput",
    "LinearCrossEntropyLoss",
    "cross_entropy",
    "cross_entropy_ref",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "shift_labels",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_cross_entropy_ref",
]
