"""The parts of one LoRA projection's forward and backward that plain LoRA's launchers
(:mod:`fk.lora.lora`) and DoRA's (:mod:`fk.lora.dora`) are both built from.

Notation (:mod:`fk.lora.lora`'s): ``x2`` the input ``[M, K]``, ``c`` the compute dtype, ``W`` ``[N, K]``,
``b``, ``A`` ``[r, K]``, ``B`` ``[N, r]``, ``b_B``, ``s`` the scaling, ``d`` the LoRA dropout (mask
``m``, probability ``p``), ``xa = d(x2) A^T`` the rank-sized LoRA input product, ``G = dy B``.

- :class:`Settings`: one projection's scalars; :func:`to_flat` / :func:`from_flat`: a list of
  per-projection ``NamedTuple``\\ s as the flat argument list an autograd function takes.
- The forward's parts: :func:`lora_input_products` (``xa`` of projections that share ``x2``, stacked
  where they can be: one read of ``x2``; with dropout, on a GPU, their masks drawn in that read), :func:`lora_and_base_out` (``y = s xa B^T + s b_B + x2 W^T
  + b``: one GEMM of :mod:`fk.lora.lora_matmul` where it applies, else the rank-sized product first), :func:`base_out` (``x2 W^T + b``) and :func:`add_lora_out`
  (``y += s xa B^T + s b_B``).
- The backward's parts: :func:`scaled_lora_grad` (``s G``), :func:`lora_b_grads` (``s G`` and ``dB``
  from one read of ``dy`` where both are needed: :mod:`fk.lora.dy_products`), :func:`kept_input` (``x2 * m``),
  :func:`lora_a_grads` (``dA = f (s G)^T (x2 * m)`` of projections that share ``x2``; with dropout
  and a 16-bit ``x2``, :mod:`fk.lora.masked_a_grad`'s one pass over ``x2`` and the masks).
- :func:`autocast_off`, :func:`backward_without_autocast`: the launchers run with autocast disabled
  (their operands are cast already), forward and backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from fk.core.matmul import bf16_parts, mm_bf16_fp32, scaled_mm
from fk.lora.dropped_lora_inputs import DroppedInput, dropped_inputs_apply, dropped_lora_inputs
from fk.lora.dy_products import dy_products
from fk.lora.lora_matmul import base_and_lora_out, fused_applies
from fk.lora.masked_a_grad import MaskedA, masked_a_grads
from fk.lora.masked_low_rank import masked
from fk.lora.torch_dropout import Draw, reserve


class Settings(NamedTuple):
    """One projection's settings, as the autograd functions take them (beside its tensors)."""

    scaling: float
    """``s``."""
    dropout_p: float
    """``p``, 0 without dropout."""
    dropout_dtype: torch.dtype
    """The dtype ``d`` is drawn in: ``lora_A``'s own, before any autocast cast (PEFT casts ``x`` to
    it, ``_cast_input_dtype``)."""


def _bf16_split_applies(x_dtype: torch.dtype, lora_A: torch.Tensor, p: float, dropout_dtype: torch.dtype) -> bool:
    """Whether :func:`lora_input_product` takes ``mm_bf16_fp32`` (bf16 input, fp32 ``A``, no dropout)."""
    return p == 0 and x_dtype == torch.bfloat16 and lora_A.dtype == dropout_dtype == torch.float32


def lora_a_operands(
    x_dtype: torch.dtype, lora_A: torch.Tensor, p: float, dropout_dtype: torch.dtype, c: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the two-part bf16 split of ``A`` where :func:`lora_input_product` uses it, else None; ``A``
    in the compute dtype ``c``, kept for the backward). The split's first part is ``A`` in bf16, so
    with bf16 activations ``A`` in ``c`` costs nothing more."""
    split = _bf16_split_applies(x_dtype, lora_A, p, dropout_dtype)
    A_parts = bf16_parts(lora_A, n_parts=2) if split else None
    if A_parts is not None and c == torch.bfloat16:
        return A_parts, A_parts[: lora_A.shape[0]]
    return A_parts, lora_A.to(c)


def lora_input_product(
    x2: torch.Tensor,
    xc: torch.Tensor,
    lora_A: torch.Tensor,
    p: float,
    dropout_dtype: torch.dtype,
    A_parts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``xa = d(x2 in dropout_dtype) A^T`` ``[M, r]``, computed in ``A``'s dtype and rounded to
    ``xc``'s (the compute dtype ``c``, in which every later use of ``xa`` runs), the dropout mask and
    the dropped input ``d(x2)`` in ``dropout_dtype`` (both None without dropout). ``A`` may be
    several projections' ``A``\\ s stacked (no dropout): ``x2`` is read once.

    ``xc`` is ``x2`` in the weight's dtype (``x2`` itself outside autocast); ``dropout_dtype`` the
    dtype the dropout is drawn in (``lora_A``'s own, before any autocast cast); ``A_parts`` the
    two-part bf16 split of ``A`` (:func:`lora_a_operands`); ``out`` an ``[M, r]`` buffer in ``c``
    for ``xa``.
    """
    c = xc.dtype
    if _bf16_split_applies(x2.dtype, lora_A, p, dropout_dtype):
        if out is None:
            out = torch.empty((x2.shape[0], lora_A.shape[0]), dtype=c, device=x2.device)
        # x2.float() @ A^T rounded to c; on a GPU one bf16 matmul and no fp32 copy of x2.
        return mm_bf16_fp32(x2, lora_A, A_parts, out=out), None, None
    mask = dropped = None
    xl = x2 if x2.dtype == dropout_dtype else x2.to(dropout_dtype)
    if p == 0 and xl is x2 and lora_A.dtype == c:
        xl = xc  # (autocast, no dropout: the base matmul's cast of x serves the LoRA branch too)
    if p > 0:
        xl, mask = torch.native_dropout(xl, p, True)
        dropped = xl
    if xl.dtype != lora_A.dtype:
        xl = xl.to(lora_A.dtype)
    xa = torch.mm(xl, lora_A.t())
    if out is not None:
        return out.copy_(xa), mask, dropped
    return (xa if xa.dtype == c else xa.to(c)), mask, dropped


_PerProjection = TypeVar("_PerProjection", bound=tuple[Any, ...])
"""A per-projection ``NamedTuple`` (plain LoRA's or DoRA's tensors, flags or kept terms)."""


def to_flat(per_projection: Iterable[tuple[Any, ...]]) -> list[Any]:
    """The fields of each projection's ``NamedTuple`` (its tensors, gradients, or what its forward
    keeps) one after the other: the flat list an autograd function takes, returns or saves."""
    return [field for fields in per_projection for field in fields]


def from_flat(kind: type[_PerProjection], flat: Sequence[Any]) -> list[_PerProjection]:
    """:func:`to_flat` undone: ``flat`` cut into one ``kind`` (a ``NamedTuple``) per projection (a
    ``kind`` of flags cuts the projections' part of ``ctx.needs_input_grad``)."""
    size = len(kind._fields)  # type: ignore[attr-defined]
    return [kind(*flat[start : start + size]) for start in range(0, len(flat), size)]


class LoRAInputs(NamedTuple):
    """What :func:`lora_input_products` returns, one entry a projection."""

    xas: list[torch.Tensor]
    """``xa = d(x2) A^T`` ``[M, r]`` in ``c``."""
    masks: list[torch.Tensor | None]
    """The dropout masks (None without dropout)."""
    A_cs: list[torch.Tensor]
    """``A`` in ``c``."""
    dropped: list[torch.Tensor | None]
    """The dropped inputs ``d(x2)`` where asked for (``keep_dropped``) and drawn in ``c`` (a dropout
    drawn in fp32 next to a 16-bit ``c`` is not kept: its product is formed from ``x2 * m``), else None."""


def lora_input_products(
    x2: torch.Tensor,
    xc: torch.Tensor,
    lora_As: list[torch.Tensor],
    settings: Sequence[Settings],
    keep_dropped: bool = False,
) -> LoRAInputs:
    """(xa's, masks, A's in ``c``, dropped inputs) of projections that share ``x2`` (with
    ``settings`` each). Those without dropout whose ``A``\\ s share a dtype take one matmul against
    their stacked ``A``\\ s, so ``x2`` is read once for all of them; each ``xa`` is then a column
    block of its result (and each ``A`` in ``c`` a row block of the stack's). Dropout masks are
    torch's, drawn projection by projection, in order, as PEFT draws them: on a GPU (no
    ``keep_dropped``, where :func:`_one_pass_draws` finds the kernel applies) all of them inside one pass over ``x2`` that
    forms their ``xa``\\ s too (:mod:`fk.lora.dropped_lora_inputs`, no dropped input written), else
    by ``torch.native_dropout``; each dropped input ``d(x2)`` is kept only with ``keep_dropped``
    (DoRA's ``zd`` is its product)."""
    n = len(settings)
    xas: list[Any] = [None] * n
    masks: list[torch.Tensor | None] = [None] * n
    A_cs: list[Any] = [None] * n
    dropped: list[torch.Tensor | None] = [None] * n
    for group in stackable(settings, [a.dtype for a in lora_As]):
        stacked = torch.cat([lora_As[i] for i in group]) if len(group) > 1 else lora_As[group[0]]
        dropout_dtype = settings[group[0]].dropout_dtype
        A_parts, A_c = lora_a_operands(x2.dtype, stacked, 0.0, dropout_dtype, xc.dtype)
        xa, _, _ = lora_input_product(x2, xc, stacked, 0.0, dropout_dtype, A_parts)
        ranks = [lora_As[i].shape[0] for i in group]
        for i, xa_i, A_c_i in zip(group, cut_blocks(xa, ranks, 1), cut_blocks(A_c, ranks, 0), strict=True):
            xas[i], A_cs[i] = xa_i, A_c_i
    with_dropout = [i for i, setting in enumerate(settings) if setting.dropout_p > 0]
    in_c = [lora_As[i].to(xc.dtype) for i in with_dropout]  # (each A itself where it is in c already)
    draws = None if keep_dropped else _one_pass_draws(x2, xc, [lora_As[i] for i in with_dropout], in_c,
                                                      [settings[i] for i in with_dropout])  # fmt: skip
    if draws is not None:  # every mask drawn, and every product formed, in one pass over x2
        terms = [DroppedInput(a_c, draw, 1.0 / (1.0 - settings[i].dropout_p))
                 for i, a_c, draw in zip(with_dropout, in_c, draws, strict=True)]  # fmt: skip
        drawn_in = settings[with_dropout[0]].dropout_dtype
        for i, a_c, xa, mask in zip(with_dropout, in_c, *dropped_lora_inputs(x2, terms, drawn_in), strict=True):
            xas[i], masks[i], A_cs[i] = xa, mask, a_c
        return LoRAInputs(xas, masks, A_cs, dropped)
    x2_in: dict[torch.dtype, torch.Tensor] = {}  # x2 in each dropout dtype, cast once for all projections
    for i, a_c in zip(with_dropout, in_c, strict=True):
        _, p, dropout_dtype = settings[i]
        if dropout_dtype not in x2_in:
            x2_in[dropout_dtype] = x2 if x2.dtype == dropout_dtype else x2.to(dropout_dtype)
        xas[i], masks[i], d_x2 = lora_input_product(x2_in[dropout_dtype], xc, lora_As[i], p, dropout_dtype)
        dropped[i] = d_x2 if keep_dropped and d_x2 is not None and d_x2.dtype == xc.dtype else None
        del d_x2  # (not held past this projection unless kept)
        A_cs[i] = a_c
    return LoRAInputs(xas, masks, A_cs, dropped)


def _one_pass_draws(x2: torch.Tensor, xc: torch.Tensor, lora_As: list[torch.Tensor], A_cs: list[torch.Tensor],
                    settings: list[Settings]) -> list[Draw] | None:  # fmt: skip
    """The draws of these projections' dropout (each with ``p > 0``) where
    :func:`fk.lora.dropped_lora_inputs.dropped_lora_inputs` takes them all (the device's generator
    then moved past them, as their ``torch.native_dropout`` calls would move it), else None (nothing
    drawn): each dropout drawn in one dtype, ``x2``'s or fp32 (PEFT casting a 16-bit ``x2`` to it);
    every ``A`` in the compute dtype ``c`` (``xc``'s, 16-bit), as the fused functions pass them
    under autocast (cast to ``c``), or else autocast to ``c`` on (it casts the dropped input and
    ``A`` to ``c`` for their product): then :func:`lora_input_product`'s product is the kernel's,
    the dropped input rounded to ``c`` times ``A`` in ``c``, ``x2`` in ``c`` or fp32. (An fp32 ``A``
    outside autocast has an fp32 product, which the kernel does not form.) And
    :func:`fk.lora.torch_dropout.reserve` able to replicate torch's masks. ``A_cs``: the ``A``\\ s
    in ``c``, which the kernel would take."""
    if not lora_As:
        return None
    drawn_in = settings[0].dropout_dtype
    if any(s.dropout_dtype != drawn_in for s in settings) or drawn_in not in (x2.dtype, torch.float32):
        return None
    c = xc.dtype
    if not all(a.dtype == c for a in lora_As) and not _autocast_to(x2.device, c):
        return None
    if not dropped_inputs_apply(x2, A_cs, drawn_in):
        return None
    return reserve(x2, [s.dropout_p for s in settings], None if drawn_in == x2.dtype else drawn_in)


def _autocast_to(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether autocast is on for ``device`` with ``dtype``."""
    return torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == dtype


def cut_blocks(t: torch.Tensor, sizes: list[int], dim: int) -> list[torch.Tensor]:
    """``t`` cut along ``dim`` into consecutive blocks of ``sizes`` (views; ``t`` itself when one
    block covers it): the projections' shares of a result computed for their stacked weights."""
    if len(sizes) == 1 and sizes[0] == t.shape[dim]:
        return [t]
    blocks, start = [], 0
    for size in sizes:
        blocks.append(t.narrow(dim, start, size))
        start += size
    return blocks


def stackable(settings: Sequence[Settings], lora_dtypes: list[torch.dtype | None]) -> list[list[int]]:
    """Indices of the projections without dropout, grouped by (LoRA weights' dtype, dropout dtype):
    the ones whose rank-sized terms can be stacked (a None in ``lora_dtypes`` leaves one out)."""
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (_, p, dropout_dtype) in enumerate(settings):
        ld = lora_dtypes[i]
        if ld is not None and p == 0:
            groups.setdefault((ld, dropout_dtype), []).append(i)
    return list(groups.values())


def base_out(
    xc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``xc W^T + b`` in ``xc``'s dtype (into ``out`` when given)."""
    if bias is None:
        return torch.mm(xc, weight.t(), out=out)
    return torch.addmm(bias, xc, weight.t(), out=out)


def add_lora_out(
    y: torch.Tensor, xa: torch.Tensor, B_c: torch.Tensor, lora_bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """``y += s xa B^T + s b_B`` in ``y``'s dtype (``xa`` and ``B`` in it already), in place; returns
    ``y``: the rank-``r`` product added to a base product already in ``y``, where that product is not
    a matmul of fk's (an int8 layer's own) or is written a chunk of rows at a time. Elsewhere
    :func:`lora_and_base_out`, one pass over ``y`` fewer."""
    y.addmm_(xa, B_c.t(), alpha=scaling)
    if lora_bias is not None:
        y.add_(lora_bias.to(y.dtype), alpha=scaling)
    return y


def lora_and_base_out(
    xc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    xa: torch.Tensor,
    B_c: torch.Tensor,
    lora_bias: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """``y = s xa B^T + s b_B + b + xc W^T`` in ``xc``'s dtype (``xa``, ``B`` and ``b`` in it
    already), a new tensor. Where :func:`fk.lora.lora_matmul.fused_applies` (16-bit operands on a
    Hopper GPU or in Triton's interpreter) and there is no ``b_B``: one Triton GEMM that adds the
    rank-``r`` product in its epilogue. Elsewhere cuBLAS: the rank-``r`` product (with ``b``) written
    first, then the base matmul adding into it, which reads ``y`` in its epilogue. (The other order,
    the base product first, passes over ``y`` once more: q/k/v's forward at 16384 tokens took 5%
    longer that way on an H200, ``benchmarks/experiments/INDEX.md#lora_qkv_orders``.)"""
    if lora_bias is None and fused_applies(xc, weight, bias, xa, B_c, scaling):
        return base_and_lora_out(xc, weight, bias, xa, B_c, scaling)
    y = scaled_mm(xa, B_c.t(), scaling, xc.dtype) if bias is None else torch.addmm(bias, xa, B_c.t(), alpha=scaling)
    if lora_bias is not None:
        y.add_(lora_bias.to(y.dtype), alpha=scaling)
    return y.addmm_(xc, weight.t())


def scaled_lora_grad(dy: torch.Tensor, B_c: torch.Tensor, scaling: float) -> torch.Tensor:
    """``s G = s dy B`` ``[M, r]``: the rank-sized term both ``dA`` and ``dx`` are formed from."""
    return scaled_mm(dy, B_c, scaling, dy.dtype)


def lora_b_grads(
    dy: torch.Tensor,
    B_c: torch.Tensor,
    xa: torch.Tensor,
    scaling: float,
    lora_dtype: torch.dtype,
    need_gs: bool,
    need_dB: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(``s G = s dy B`` in ``dy``'s dtype, ``dB = s dy^T xa`` in ``lora_dtype``), each None where not
    needed: where both are, :func:`fk.lora.dy_products.dy_products` (one read of ``dy`` for both,
    where its kernel applies); else the one needed, by a scaled matmul."""
    if need_gs and need_dB:
        return dy_products(dy, B_c, xa, scaling, lora_dtype)
    gs = scaled_lora_grad(dy, B_c, scaling) if need_gs else None
    return gs, scaled_mm(dy.t(), xa, scaling, lora_dtype) if need_dB else None


def kept_input(x2: torch.Tensor, mask: torch.Tensor | None, dropout_dtype: torch.dtype, c: torch.dtype) -> torch.Tensor:
    """``x2 * m`` in ``c``: the LoRA input as the forward dropped it, without dropout's ``1 / (1 - p)``
    (``dA = (s G)^T d(x2)`` takes that factor as the matmul's scale instead). Under autocast the
    forward's LoRA input was ``x2`` cast to ``dropout_dtype``; here it goes on to ``c``. The mask's
    zeros and ones change no value, so ``x2 * m`` is exact and one pass over ``x2``, in ``c`` (not in
    ``dropout_dtype``, which may be fp32 next to bf16 activations)."""
    xc = x2 if x2.dtype == c else (x2 if x2.dtype == dropout_dtype else x2.to(dropout_dtype)).to(c)
    return xc if mask is None else masked(xc, mask, 1.0)


def lora_a_grads(
    x2: torch.Tensor,
    c: torch.dtype,
    gss: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor | None],
    settings: Sequence[Settings],
    lora_dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """``dA = f (s G)^T (x2 * m)`` (``f = 1 / (1 - p)``; ``x2`` itself and ``f = 1`` without a mask)
    in its LoRA dtype, for projections that share ``x2`` (``s G`` in ``c``).

    The ones with a mask, when ``x2`` is in ``c`` (no autocast cast between them), take
    :func:`fk.lora.masked_a_grad.masked_a_grads`: ``x2`` and each mask read once, no ``x2 * m``
    written (its kernel for 16-bit ``c``). The others: :func:`kept_input` and one scaled matmul each.
    """
    grads: list[Any] = [None] * len(gss)
    fused = [i for i, mask in enumerate(masks) if mask is not None and x2.dtype == c]
    terms = [MaskedA(gss[i], masks[i], 1.0 / (1.0 - settings[i].dropout_p), lora_dtypes[i]) for i in fused]  # type: ignore[arg-type]
    for i, grad in zip(fused, masked_a_grads(x2, terms), strict=True):
        grads[i] = grad
    for i, (gs, mask, setting, lora_dtype) in enumerate(zip(gss, masks, settings, lora_dtypes, strict=True)):
        if grads[i] is None:
            f = 1.0 if mask is None else 1.0 / (1.0 - setting.dropout_p)
            grads[i] = scaled_mm(gs.t(), kept_input(x2, mask, setting.dropout_dtype, c), f, lora_dtype)
    return grads


def autocast_off(device_type: str) -> Any:
    """A context that disables autocast for ``device_type`` where it is enabled (else a no-op)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def backward_without_autocast(backward: Callable[..., Any]) -> Callable[..., Any]:
    """An autograd function's ``backward`` run with autocast disabled for its gradients' device (a
    backward called under autocast would otherwise recast the operands the forward cast already)."""

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        device = next((g.device.type for g in grads if g is not None), None)
        with autocast_off(device) if device is not None else contextlib.nullcontext():
            return backward(ctx, *grads)

    return run
