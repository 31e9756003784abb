"""fk-align's memory defaults on the fused head: how much of the logits one chunk holds, and how a
pass over several chunks sums the head's weight gradient.

fk-flce's chunk engine keeps, with one chunk, that chunk's logits' gradient for the backward, and
with several, an fp32 weight-gradient accumulator of ``V H * 4`` bytes beside the returned gradient.
At an 8B model's head (H = 4096, V = 128256) and 8192 tokens either is 2 GiB, which put fk-align's
losses above Liger Kernel's chunked losses in peak memory: those sum each chunk's share in the
head's own dtype, into the returned gradient. fk-align's preference and distillation losses
default to chunks of :data:`ALIGN_MEMORY_BUDGET` and, with ``accum_dtype=None``, sum in the head's
dtype when the pass has at most :data:`HEAD_DTYPE_SUM_CHUNKS` chunks (:func:`sums_in_fp32`).
"""

from __future__ import annotations

import torch

ALIGN_MEMORY_BUDGET = 1 << 30
"""Bytes of logits per chunk (1 GiB: 4096 tokens of a 128256-word vocabulary in bf16, or 2048 of
the student's and the teacher's together): the forward's peak beside the returned gradients."""

HEAD_DTYPE_SUM_CHUNKS = 8
"""The most chunks whose weight-gradient shares ``accum_dtype=None`` sums in the head's dtype: each
element rounded at most 8 times, as Liger's distillation loss rounds it at 8192 tokens (chunks of
1024) and its preference losses once a pair; over more chunks the sum is fp32, rounded once."""


def sums_in_fp32(accum_dtype: torch.dtype | None, head_dtype: torch.dtype, n_chunks: int | None) -> bool:
    """Whether a pass of ``n_chunks`` chunks (None: not known, as under ``torch.compile``) sums the
    head's weight gradient in an fp32 accumulator: ``accum_dtype`` decides when given (fp32 unless
    it is the head's dtype); None sums in the head's dtype up to :data:`HEAD_DTYPE_SUM_CHUNKS`."""
    if accum_dtype is not None:
        return accum_dtype != head_dtype
    return n_chunks is None or n_chunks > HEAD_DTYPE_SUM_CHUNKS
