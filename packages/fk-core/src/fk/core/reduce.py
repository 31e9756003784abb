"""The last step of a weight gradient: summing the fp32 partial rows a backward kernel wrote.

Row-wise backward kernels (the norms) accumulate their weight and bias gradients per program, into
one fp32 row each of a ``[programs, H]`` buffer, and the gradient is the sum of those rows in the
parameter's dtype. ``partials.sum(0).to(dtype)`` takes two kernels (a reduction, then a cast); at the
widths LLMs use the buffer is a few MiB still in L2, so those two launches, not the bytes, are what
it costs. :func:`sum_rows` is one kernel: each program sums a strip of columns over all rows in
fp32 and stores the result in the output dtype; :func:`sum_rows_pair` does the same for a weight's
and a bias's partial rows in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, next_power_of_2

SUM_ROWS_BLOCK_ROWS = 64
"""Rows of the ``[BLOCK_ROWS, BLOCK_COLS]`` tile a program adds per step."""
SUM_ROWS_WIDE_COLS = 32768
"""From this width on a program sums 32 columns, below it 16 (64 bytes of fp32 a row): narrow
gradients then still get 64 programs or more. Chosen on an H200 at the partial buffers of
RMSNorm's backward for 16384 rows (``benchmarks/experiments/INDEX.md#partial_sums_probe``, its
last run): 1056 x 1024 partials 10.9 us with torch, 6.0 us here; 132 x 32768, 9.4 us and 6.6 us."""

INTERPRETER_PROGRAMS = 4
"""Column strips per group off the GPU (as ``fk.core.launch.multiprocessor_count`` there): in Triton's
interpreter a 65536-wide gradient in 16-column strips was 4096 programs, seconds per backward."""


@triton.jit
def _sum_rows_kernel(
    partials_ptr,  # [groups, n_rows, n_cols] fp32, contiguous (groups: 1, or 2 for sum_rows_pair)
    out0_ptr,  # [n_cols]: group 0's sum, in its gradient's dtype
    out1_ptr,  # [n_cols]: group 1's sum (not written when there is one group)
    n_rows,
    n_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    group = tl.program_id(1)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows[:, None] < n_rows) & col_mask[None, :]
        offsets = (group.to(tl.int64) * n_rows + rows[:, None]) * n_cols + cols[None, :]
        acc += tl.load(partials_ptr + offsets, mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if group == 0:
        tl.store(out0_ptr + cols, total.to(out0_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(out1_ptr + cols, total.to(out1_ptr.dtype.element_ty), mask=col_mask)


def _check_partials(partials: torch.Tensor, shape: str, ndim: int) -> None:
    if partials.dtype != torch.float32 or partials.ndim != ndim or not partials.is_contiguous():
        raise ValueError(
            f"partials must be a contiguous float32 tensor of shape {shape}, "
            f"got {partials.dtype} of shape {tuple(partials.shape)} and strides {partials.stride()}"
        )


def _launch(partials: torch.Tensor, outs: list[torch.Tensor]) -> None:
    n_rows, n_cols = partials.shape[-2:]
    if partials.device.type == "cuda":
        block_cols = 32 if n_cols >= SUM_ROWS_WIDE_COLS else 16
    else:  # Triton's interpreter runs programs one after another, each tile a numpy array: a few wide strips
        block_cols = next_power_of_2(cdiv(n_cols, INTERPRETER_PROGRAMS))
    _sum_rows_kernel[(cdiv(n_cols, block_cols), len(outs))](
        partials, outs[0], outs[-1], n_rows, n_cols,
        BLOCK_ROWS=SUM_ROWS_BLOCK_ROWS, BLOCK_COLS=block_cols, num_warps=4,
    )  # fmt: skip


def sum_rows(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``partials.sum(0).to(dtype)`` for a contiguous fp32 ``partials`` of shape ``[rows, H]``, in
    one kernel: the rows are added in fp32 and the result rounded once to ``dtype``. Off the kernel
    path (a CPU tensor without Triton's interpreter) it is that expression itself."""
    _check_partials(partials, "[rows, H]", 2)
    if not uses_kernel(partials) or partials.numel() == 0:
        return partials.sum(0).to(dtype)
    out = torch.empty(partials.shape[1], dtype=dtype, device=partials.device)
    _launch(partials, [out])
    return out


def sum_rows_pair(
    partials: torch.Tensor, dtype0: torch.dtype, dtype1: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials[0].sum(0).to(dtype0), partials[1].sum(0).to(dtype1))`` for a contiguous fp32
    ``partials`` of shape ``[2, rows, H]`` (a weight's and a bias's partial rows), in one kernel
    that writes two separate tensors."""
    _check_partials(partials, "[2, rows, H]", 3)
    if partials.shape[0] != 2:
        raise ValueError(f"partials must have 2 groups of rows, got shape {tuple(partials.shape)}")
    if not uses_kernel(partials) or partials.numel() == 0:
        return partials[0].sum(0).to(dtype0), partials[1].sum(0).to(dtype1)
    outs = [torch.empty(partials.shape[2], dtype=d, device=partials.device) for d in (dtype0, dtype1)]
    _launch(partials, outs)
    return outs[0], outs[1]


def sum_weight_and_bias_rows(
    partials: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``weight`` and ``bias`` (each None when not given: not computed) in their
    dtypes, from ``partials``: contiguous fp32 ``[n, rows, H]`` holding the partial rows of the
    ``n`` gradients given, the weight's first. One kernel either way."""
    if weight is not None and bias is not None:
        return sum_rows_pair(partials, weight.dtype, bias.dtype)
    if weight is not None:
        return sum_rows(partials[0], weight.dtype), None
    if bias is not None:
        return None, sum_rows(partials[0], bias.dtype)
    return None, None
