"""Matmuls with an fp32 result from low-precision inputs, which two kernel packages need.

- :func:`has_fp32_out_matmul`: whether ``torch.mm``/``torch.addmm`` take ``out_dtype=torch.float32``
  for bf16/fp16 inputs on a device (torch 2.8 and later, CUDA only): one kernel writes the fp32
  result, with no upcast copies of the inputs.
- :func:`mm_bf16_fp32`: ``x @ w.T`` for a bf16 ``x`` and an fp32 ``w``, as ``x.float() @ w.T``
  computes it, without the fp32 copy of ``x`` (fk.lora: PEFT keeps LoRA weights in fp32 next to bf16
  activations, and casts the activations up).
- :func:`accumulate_mm`: ``acc (=|+=) a @ b`` with the sum kept in ``acc``'s dtype (fp32 sums of
  bf16 products over chunks of rows: fk.flce's weight gradient, fk.lora's chunked MLP).
- :func:`column_sum`: the fp32 sum over the rows of a matrix (a bias gradient) without the staging
  buffer torch's column reduction allocates.

The split behind :func:`mm_bf16_fp32`: ``w = hi + mid + lo`` exactly (to fp32's precision), each part
in bf16, where ``hi = bf16(w)``, ``mid = bf16(w - hi)``, ``lo = bf16(w - hi - mid)``: three bf16
parts carry 3 x 8 significant bits, fp32 has 24. A bf16 x bf16 product is exact in fp32, so one
bf16 matmul of ``x`` against the stacked parts, accumulated in fp32, gives ``x @ hi.T``,
``x @ mid.T`` and ``x @ lo.T``, whose sum is ``x.float() @ w.T`` up to the order of fp32 additions.
``x`` is read once, in bf16. (bf16 has fp32's exponent range, so no part under- or overflows where
``w`` does not; fp16 inputs would, so they are not taken.)
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _torch_has_out_dtype_matmul() -> bool:
    try:
        torch.ops.aten.addmm.dtype_out  # noqa: B018 (looked up only to see that it exists)
    except (AttributeError, RuntimeError):
        return False
    return True


def has_fp32_out_matmul(device: torch.device) -> bool:
    """Whether ``torch.mm``/``torch.addmm(..., out_dtype=torch.float32)`` run bf16/fp16 matmuls with
    an fp32 result on ``device`` (torch >= 2.8, on CUDA only)."""
    return device.type == "cuda" and _torch_has_out_dtype_matmul()


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """The fp32 ``w`` ``[r, K]`` as three bf16 parts stacked ``[3r, K]`` (hi, mid, lo) whose fp32 sum
    is ``w`` (see the module docstring). Four kernels, written straight into the stacked buffer."""
    r = w.shape[0]
    parts = torch.empty((3 * r, w.shape[1]), dtype=torch.bfloat16, device=w.device)
    hi, mid, lo = parts[:r], parts[r : 2 * r], parts[2 * r :]
    hi.copy_(w)
    rest = w - hi  # exact in fp32
    mid.copy_(rest)
    torch.sub(rest, mid, out=lo)  # rounded to bf16 on the way out
    return parts


def bf16_parts(w: torch.Tensor) -> torch.Tensor | None:
    """:func:`split_bf16` of ``w`` where :func:`mm_bf16_fp32` uses the parts (a device with
    fp32-output matmuls), else None. A caller that multiplies several inputs by one ``w`` (chunks
    of rows) splits it once and passes the parts to each call."""
    return split_bf16(w) if has_fp32_out_matmul(w.device) else None


def mm_bf16_fp32(x: torch.Tensor, w: torch.Tensor, parts: torch.Tensor | None = None) -> torch.Tensor:
    """``x.float() @ w.T`` in fp32, for ``x`` bf16 ``[M, K]`` and ``w`` fp32 ``[r, K]``, reading ``x``
    once in bf16 (see the module docstring). ``parts``: :func:`bf16_parts` of ``w``, when the caller
    has it. On a device without fp32-output matmuls it computes ``x.float() @ w.T`` itself."""
    if not has_fp32_out_matmul(x.device):
        return torch.mm(x.float(), w.t())
    r = w.shape[0]
    if parts is None:
        parts = split_bf16(w)
    out = torch.mm(x, parts.t(), out_dtype=torch.float32)  # [M, 3r]: x hi^T | x mid^T | x lo^T
    return out.view(x.shape[0], 3, r).sum(1)


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (=|+=) a @ b`` (``=`` when ``first``) with the sum kept in ``acc.dtype``: on a GPU with
    fp32-output matmuls one kernel and no temporaries for bf16/fp16 ``a`` and ``b`` and an fp32
    ``acc``; elsewhere (the CPU: the interpreter and reference runs) through upcast copies of ``a``
    and ``b``."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif has_fp32_out_matmul(acc.device):
        if first:
            torch.mm(a, b, out_dtype=acc.dtype, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif first:
        torch.mm(a.to(acc.dtype), b.to(acc.dtype), out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def column_sum(t: torch.Tensor) -> torch.Tensor:
    """``t.sum(0, dtype=torch.float32)`` for a 2-D ``t``: the fp32 sum of its rows, ``[t.shape[1]]``.

    On a GPU with fp32-output matmuls, a bf16/fp16 ``t`` is summed as ``ones[1, rows] @ t`` with an
    fp32 result: one read of ``t``, fp32 sums, and no temporary. torch's column reduction keeps an
    fp32 staging buffer instead: on an H200, 256 MiB for a 16384 x 32768 bf16 ``t`` (0.27 ms; the
    matmul 0.25 ms and 0.1 MiB).
    """
    row_major = t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])  # (not a stride-0 expand: mm would copy it)
    if t.dtype in (torch.bfloat16, torch.float16) and has_fp32_out_matmul(t.device) and t.shape[0] > 0 and row_major:
        ones = torch.ones((1, t.shape[0]), dtype=t.dtype, device=t.device)
        return torch.mm(ones, t, out_dtype=torch.float32).view(t.shape[1])
    return t.sum(0, dtype=torch.float32)
