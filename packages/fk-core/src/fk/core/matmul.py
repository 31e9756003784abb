"""Matmuls with an fp32 result from low-precision inputs, which two kernel packages need.

- :func:`has_fp32_out_matmul`: whether ``torch.mm``/``torch.addmm`` take ``out_dtype=torch.float32``
  for bf16/fp16 inputs on a device (torch 2.8 and later, CUDA only): one kernel writes the fp32
  result, with no upcast copies of the inputs.
- :func:`mm_bf16_fp32`: ``x @ w.T`` for a bf16 ``x`` and an fp32 ``w``, as ``x.float() @ w.T``
  computes it, without the fp32 copy of ``x`` (fk.lora: PEFT keeps LoRA weights in fp32 next to bf16
  activations, and casts the activations up).
- :func:`scaled_mm`: ``alpha * (a @ b)`` in a given dtype, one kernel in eager mode (the scale is the
  matmul's ``alpha``, an fp32 result the matmul's own output).
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
``w`` does not; fp16 inputs would, so they are not taken.) Where the product is rounded to bf16
at once (fk.lora's rank-sized ``x A^T``), ``hi`` and ``mid`` suffice: they hold 16 significant bits
of ``w``, so each element is off by at most 2^-16 of itself, 2^-8 of bf16's own rounding error.
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


def split_bf16(w: torch.Tensor, n_parts: int = 3) -> torch.Tensor:
    """The fp32 ``w`` ``[r, K]`` as bf16 parts stacked ``[n_parts * r, K]`` (hi, mid[, lo]) whose fp32
    sum is ``w`` (three parts, see the module docstring) or ``w`` to 16 significant bits (two: the
    error left is under 2^-16 of each element, for a product that is rounded to bf16 anyway).
    The first ``r`` rows are ``w.to(torch.bfloat16)``. Two kernels for two parts, four for three,
    written straight into the stacked buffer."""
    if n_parts not in (2, 3):
        raise ValueError(f"n_parts must be 2 or 3, got {n_parts}")
    r = w.shape[0]
    parts = torch.empty((n_parts * r, w.shape[1]), dtype=torch.bfloat16, device=w.device)
    hi, mid = parts[:r], parts[r : 2 * r]
    hi.copy_(w)
    if n_parts == 2:
        torch.sub(w, hi, out=mid)  # w - hi is exact in fp32, rounded to bf16 on the way out
        return parts
    rest = w - hi  # exact in fp32
    mid.copy_(rest)
    torch.sub(rest, mid, out=parts[2 * r :])  # rounded to bf16 on the way out
    return parts


def bf16_parts(w: torch.Tensor, n_parts: int = 3) -> torch.Tensor | None:
    """:func:`split_bf16` of ``w`` where :func:`mm_bf16_fp32` uses the parts (a device with
    fp32-output matmuls), else None. A caller that multiplies several inputs by one ``w`` (chunks
    of rows) splits it once and passes the parts to each call."""
    return split_bf16(w, n_parts) if has_fp32_out_matmul(w.device) else None


def mm_bf16_fp32(
    x: torch.Tensor, w: torch.Tensor, parts: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x.float() @ w.T`` in fp32, for ``x`` bf16 ``[M, K]`` and ``w`` fp32 ``[r, K]``, reading ``x``
    once in bf16 (see the module docstring). ``parts``: :func:`bf16_parts` of ``w`` (three parts, or
    two where the result is rounded to bf16), when the caller has it. ``out``: an ``[M, r]`` buffer
    of any float dtype that takes the fp32 result rounded once (one kernel sums the parts into it).
    On a device without fp32-output matmuls it computes ``x.float() @ w.T`` itself."""
    if not has_fp32_out_matmul(x.device):
        product = torch.mm(x.float(), w.t())
        return product if out is None else out.copy_(product)
    r = w.shape[0]
    if parts is None:
        parts = split_bf16(w)
    products = torch.mm(x, parts.t(), out_dtype=torch.float32)  # [M, n r]: x hi^T | x mid^T (| x lo^T)
    if parts.shape[0] == 2 * r and out is not None:  # (a binary op sums in fp32 and rounds once into out;
        return torch.add(products[:, :r], products[:, r:], out=out)  # a sum into out rounds each term first)
    summed = products.view(x.shape[0], parts.shape[0] // r, r).sum(1)
    return summed if out is None else out.copy_(summed)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``alpha * (a @ b)`` in ``dtype``, for ``a`` and ``b`` of one float dtype (a new tensor).

    In eager mode one kernel: the scale is the matmul's ``alpha``, and an fp32 result from bf16/fp16
    inputs is the matmul's own output where the device has fp32-output matmuls (the products are
    then summed in fp32 and never rounded to the inputs' dtype). Elsewhere, and under
    ``torch.compile`` (which fuses the scale and the cast itself), the product in the inputs' dtype,
    scaled and cast.
    """
    shape = (a.shape[0], b.shape[1])
    if torch.compiler.is_compiling():
        return (torch.mm(a, b) * alpha).to(dtype)
    fp32_out = dtype == torch.float32 and a.dtype != dtype and has_fp32_out_matmul(a.device)
    out_dtype = dtype if fp32_out else a.dtype
    if alpha == 1.0:
        product = torch.mm(a, b, out_dtype=out_dtype) if fp32_out else torch.mm(a, b)
    else:  # into a new buffer, uninitialized: beta=0 ignores what it holds, NaNs included
        product = a.new_empty(shape, dtype=out_dtype)
        if fp32_out:
            torch.addmm(product, a, b, beta=0, alpha=alpha, out_dtype=out_dtype, out=product)
        else:
            torch.addmm(product, a, b, beta=0, alpha=alpha, out=product)
    return product if product.dtype == dtype else product.to(dtype)


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
