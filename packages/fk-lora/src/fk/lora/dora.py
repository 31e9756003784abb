"""DoRA (PEFT ``use_dora=True``): LoRA projections with a magnitude vector, ``mag / ||W + s B A||``
(the row norm detached) scaling the base and LoRA products, as PEFT's ``DoraLinearLayer`` computes.

:func:`fk.lora.lora_linear`, :func:`fk.lora.lora_qkv`, :func:`fk.lora.lora_projections` and
:func:`fk.lora.lora_mlp` take DoRA's magnitude (``LoRAWeights.magnitude``) and call the launchers
here: :class:`DoRAProjections` (projections of one input, one ``dx``) and :class:`DoRAMLP` (a gated
MLP with DoRA on all three projections). They are built from the parts plain LoRA's launchers are
built from (:mod:`fk.lora.projection`), and take a 4-bit (QLoRA) or int8 base as plain LoRA's do
(:mod:`fk.lora.quantized_base`: dequantized where needed, never saved).

This file holds, in order: the reference (:func:`dora_ref`, the DoRA half of
:func:`fk.lora.lora_linear_ref`), then the launchers, their equations first (the row norm is
:func:`fk.lora.dora_norm.dora_weight_norm`'s).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fk.core.matmul import scaled_mm
from fk.glu import gated_act_backward, gated_act_forward
from fk.lora.dora_dropout_matmul import dora_dropout_out, dora_dropout_out_applies
from fk.lora.dora_elementwise import (
    DoRAGradTerms,
    GradDtypes,
    LowRank,
    dora_dropout_output,
    dora_grad_terms,
    dora_scaled_output,
)
from fk.lora.dora_glu import ScaledProjection, dora_gated_act, dora_gated_act_grad_terms
from fk.lora.dora_norm import dora_weight_norm
from fk.lora.lora_matmul import (
    base_and_lora_grad,
    base_and_masked_lora_grad,
    fused_grad_applies,
    masked_grad_applies,
)
from fk.lora.masked_low_rank import add_masked_low_rank_
from fk.lora.projection import (
    Settings,
    add_lora_out,
    backward_without_autocast,
    base_out,
    from_flat,
    kept_input,
    lora_a_grads,
    lora_and_base_out,
    lora_b_grads,
    lora_input_products,
    to_flat,
)
from fk.lora.quantized_base import QuantizedBase, dense, saved_weights, weights_to_save

# --- 1. Reference ---------------------------------------------------------------------------------


def dora_ref(
    result: torch.Tensor,
    xl: torch.Tensor,
    lora: torch.Tensor,
    base_weight: torch.Tensor,
    base_bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    dropout_p: float,
    magnitude: torch.Tensor,
) -> torch.Tensor:
    """PEFT's DoRA output from the pieces of a plain LoRA forward: ``result`` the base layer's output,
    ``xl`` the LoRA branch's (dropped) input, ``lora`` its output ``s B A xl``. With
    ``n = ||W + s B A||`` over each output row (in ``xl``'s dtype, detached) and ``ms = mag / n``:
    ``result + (ms - 1) base + ms lora``, where ``base`` is ``result - b`` without dropout and
    ``xl W^T`` with it (PEFT recomputes the base product on the dropped input)."""
    weight = base_weight.to(xl.dtype)
    norm = torch.linalg.norm(weight + scaling * (lora_B @ lora_A).to(xl.dtype), dim=1).detach()
    ms = magnitude / norm
    if dropout_p > 0:  # PEFT recomputes the base product on the dropped input
        base = F.linear(xl, weight)
    elif base_bias is not None:
        base = result - base_bias
    else:
        base = result
    return (result + (ms - 1) * base + ms * lora).to(result.dtype)


# --- 2. Launchers ---------------------------------------------------------------------------------
#
# One projection with DoRA's magnitude vector mag [N] (fk.lora.lora's notation: m the dropout mask, f = 1 / (1 - p),
# d(x2) = f x2 * m the LoRA branch's input, xa = d(x2) A^T):
#   n    = ||W + s B A|| over each row of W     [N], fp32, then rounded to the dropout dtype (PEFT
#                                               computes it in the LoRA branch's input dtype) and
#                                               detached (DoRA's paper, section 4.3: no gradient)
#   ms   = mag / n                              [N], fp32 (PEFT's mag_norm_scale)
#   lr   = s xa B^T                             [M, N], the low-rank product
# Without dropout (PEFT scales the base layer's result less its bias):
#   z    = x2 W^T + lr                          one buffer, plain LoRA's y without b
#   y    = ms * z + b                           (ms scales each column)
# With dropout (PEFT recomputes the base product on the dropped input):
#   zd   = d(x2) W^T                            d(x2) the dropout's own output where it is in c
#                                               (PEFT's operand; no pass to form it again), else
#                                               f (x2 * m) W^T with f the matmul's scale, x2 * m exact
#   z    = zd + lr
#   y    = x2 W^T + b + (ms - 1) * zd + ms * lr   summed in fp32, rounded once
# Kept for the backward: z, ms, n, and what plain LoRA keeps (xa, m, A and B in c).
# With dropout, x2 W^T and zd come from one GEMM whose epilogue writes y and z
# (fk.lora.dora_dropout_matmul) where it applies; else from two matmuls and one pass over both
# (fk.lora.dora_elementwise), which forms lr in registers from xa and B, and writes y over x2 W^T's
# buffer and z over zd's.
#
# The norm reads W once (fk.lora.dora_norm: each tile of W + s B A formed in fp32 registers, 2 N K r
# FLOPs in all, as for B A itself; no [N, K] buffer). The cheaper-looking
# expansion n^2 = ||W||^2 + 2 s <W A^T, B>_row + s^2 <B (A A^T), B>_row costs the same 2 N K r for
# W A^T and cancels where s B A pulls a row of W towards zero: its relative error is
# eps ||W||^2 / n^2 against eps for the direct sum, so the direct form is the one taken.
#
# Backward. n is detached, so mag enters through ms = mag / n only; with dy [M, N]:
#   dmag   = colsum(dy * z) / n                 (both forms: dy/dms_j = sum_i dy_ij z_ij)
#   db     = colsum(dy)                         (b is added once, unscaled)
#   dy_ms  = ms * dy                            the gradient reaching lr
# (dmag, db, dy_ms and, with dropout, dy_ms1 below: one pass over dy, fk.lora.dora_elementwise)
#   dB     = s dy_ms^T xa ;  s G = s dy_ms B ;  dA = f (s G)^T (x2 * m)   (x2 * m never written:
#                                                                         fk.lora.masked_a_grad)
# Without dropout x2 W^T is scaled by ms as well:
#   dW     = dy_ms^T x2 ;  dx = dy_ms W + s G A
# With dropout x2 W^T is not, and zd is scaled by (ms - 1); with dy_ms1 = (ms - 1) * dy:
#   dW     = dy^T x2 + f dy_ms1^T (x2 * m)
#   dx     = dy W + f (dy_ms1 W + s G A) * m    (the masked sum in dy_ms1 W's GEMM: lora_matmul, mask_base;
#                                                 else one pass: masked_low_rank, addend)
# Under autocast DoRA is not fused (fk.lora.patch leaves it to PEFT; the functions refuse it).
#
# A 4-bit (QLoRA) W (fk.lora.quantized_base.QuantizedBase; frozen, so no dW) is dequantized whole in
# the forward, first to bitsandbytes' own dtype (QuantState.dtype), as PEFT's dequantize_module_weight
# gives it to DoRA's norm: n is formed from that W as above (fp32, rounded to the dropout dtype); then
# cast to c for x2 W^T and, with dropout, zd, and dropped before the next projection's. The backward
# dequantizes it again to c where dx needs it (dy_ms W; with dropout dy W and dy_ms1 W from one
# dequantized W), and drops it. Only the packed data is kept between forward and backward.
#
# An int8 (LLM.int8()) base, as PEFT's DoRA on bitsandbytes' Linear8bitLt computes it: the base
# output is the layer's own product (bias included, fk.lora.lora's int8 notes), so x2 W^T above is
# that output less b: without dropout z = (layer(x2) - b) + lr; with dropout y = layer(x2) + (ms - 1)
# zd + ms lr. W (the int8 weight dequantized to c, as PEFT's DoRA takes it) gives the norm, zd and
# the backward's dx; the backward is the one above (bitsandbytes' own backward of the base product
# is dy W with that W).


class DoRAParams(NamedTuple):
    """One DoRA projection's tensors, as :class:`DoRAProjections` takes them (flat, five a projection)."""

    weight: Any
    """``W`` ``[N, K]``: a tensor, or a frozen 4-bit or int8 :class:`fk.lora.quantized_base.QuantizedBase`."""
    bias: torch.Tensor | None
    """``b`` ``[N]``."""
    lora_A: torch.Tensor
    """``A`` ``[r, K]``."""
    lora_B: torch.Tensor
    """``B`` ``[N, r]``."""
    magnitude: torch.Tensor
    """``mag`` ``[N]``."""


class _DoRANeeds(NamedTuple):
    """Which of one projection's :class:`DoRAParams` need a gradient."""

    weight: bool
    bias: bool
    lora_A: bool
    lora_B: bool
    magnitude: bool


class _DoRAGrads(NamedTuple):
    """The gradients of one projection's :class:`DoRAParams`, None where not needed."""

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None


class _DoRALowRank(NamedTuple):
    """What one DoRA projection's forward keeps: plain LoRA's :class:`_LowRank` and DoRA's terms."""

    xa: torch.Tensor
    mask: torch.Tensor | None
    A_c: torch.Tensor
    B_c: torch.Tensor
    z: torch.Tensor
    """``[M, N]`` in ``c``: what ``ms`` multiplies (``dmag`` is formed from it)."""
    ms: torch.Tensor
    """``mag / n`` ``[N]``, fp32."""
    norm: torch.Tensor
    """``n`` ``[N]``, fp32 (holding the dropout dtype's rounding)."""


def _dora_fwd(
    x2: torch.Tensor,
    xa: torch.Tensor,
    mask: torch.Tensor | None,
    A_c: torch.Tensor,
    params: DoRAParams,
    settings: Settings,
    dropped: torch.Tensor | None = None,
    want_output: bool = True,
) -> tuple[torch.Tensor | None, _DoRALowRank]:
    """One DoRA projection of ``x2`` ``[M, K]`` (in ``c``) given its LoRA input product ``xa``,
    mask and dropped input ``d(x2)`` (None: formed again from ``x2`` and the mask): (y ``[M, N]`` in
    ``c``, what its backward keeps). Without dropout and ``want_output`` False, y is not formed
    (None): the caller forms it from ``z`` (:mod:`fk.lora.dora_glu`)."""
    c = x2.dtype
    scaling, p, dropout_dtype = settings
    weight = params.weight
    int8 = weight if isinstance(weight, QuantizedBase) and weight.product is not None else None
    if isinstance(weight, QuantizedBase):  # 4-bit: W in bitsandbytes' dtype for the norm (PEFT's), then in c;
        weight = weight.dense(own_dtype=True)  # int8: in c (PEFT's DoRA casts it to the input's dtype)
    norm = dora_weight_norm(weight, params.lora_A, params.lora_B, scaling, dropout_dtype)
    if weight.dtype != c:  # (a 4-bit W only: a dense one has c; the uncast W is dropped here)
        weight = weight.to(c)
    ms = params.magnitude.detach().float() / norm
    B_c = params.lora_B.to(c)
    if mask is None:
        if int8 is None:
            z = lora_and_base_out(x2, weight, None, xa, B_c, None, scaling)
        else:  # the layer's own product less its bias (PEFT's base_result), lr added into it
            base = int8.layer_output(x2)
            z = add_lora_out(base if params.bias is None else base.sub_(params.bias), xa, B_c, None, scaling)
        del weight  # (a dequantized W is dropped before the next projection's)
        y = dora_scaled_output(z, ms, params.bias) if want_output else None
        return y, _DoRALowRank(xa, mask, A_c, B_c, z, ms, norm)
    f = 1.0 / (1.0 - p)
    if (
        int8 is None
        and dropped is not None
        and dora_dropout_out_applies(x2, dropped, weight, xa, B_c, scaling, ms, params.bias)
    ):
        y, z = dora_dropout_out(x2, dropped, weight, xa, B_c, scaling, ms, params.bias)  # one GEMM for both
        return y, _DoRALowRank(xa, mask, A_c, B_c, z, ms, norm)
    if dropped is not None and dropped.dtype == c:  # the dropout's own output, PEFT's operand
        zd = base_out(dropped, weight, None)
    else:
        zd = scaled_mm(kept_input(x2, mask, dropout_dtype, c), weight.t(), f, c)
    del dropped
    if int8 is None:
        base, bias = base_out(x2, weight, None), params.bias
    else:  # the layer's own product, its bias in it already
        base, bias = int8.layer_output(x2), None
    del weight
    y, z = dora_dropout_output(base, zd, LowRank(xa, B_c, scaling), ms, bias)
    return y, _DoRALowRank(xa, mask, A_c, B_c, z, ms, norm)


def _grad_dtypes(weight: Any, dtypes: tuple[torch.dtype, torch.dtype], needs: _DoRANeeds) -> GradDtypes:
    """The dtypes of the magnitude's and the bias's gradients, None where not needed."""
    return (dtypes[1] if needs.magnitude else None, weight.dtype if needs.bias else None)


def _wants(low: _DoRALowRank, needs: _DoRANeeds, need_dx: bool) -> tuple[bool, bool]:
    """Whether the backward needs ``dy_ms`` and ``dy_ms1`` (see the equations above)."""
    need_dy_ms = need_dx or needs.lora_A or needs.lora_B or (low.mask is None and needs.weight)
    need_dy_ms1 = low.mask is not None and (needs.weight or need_dx)
    return need_dy_ms, need_dy_ms1


def _dora_bwd(
    dy: torch.Tensor | None,
    x2: torch.Tensor,
    weight: Any,
    low: _DoRALowRank,
    dtypes: tuple[torch.dtype, torch.dtype],
    settings: Settings,
    needs: _DoRANeeds,
    dx: torch.Tensor | None,
    need_dx: bool,
    terms: DoRAGradTerms | None = None,
    a_grad_terms: list[tuple[int, torch.Tensor]] | None = None,
    index: int = 0,
) -> tuple[_DoRAGrads, torch.Tensor | None]:
    """The backward of :func:`_dora_fwd` (see the equations above): (the parameter gradients, dx
    with this projection's terms added, a new buffer when ``dx`` is None). ``dtypes``: the LoRA
    weights' and the magnitude's. ``weight`` is ``W`` or its :class:`QuantizedBase`, dequantized
    here for ``dx`` only and dropped on return. ``terms``: the terms formed from ``dy``, where the
    caller formed them (:mod:`fk.lora.dora_glu`; then ``dy`` is None), else None.
    ``a_grad_terms``: where given, ``dA`` is left to the caller, who forms those of projections
    sharing ``x2`` in one :func:`lora_a_grads` call (one pass over ``x2`` and the masks): ``(index,
    s G)`` is appended to it instead."""
    lora_dtype = dtypes[0]
    scaling, p, dropout_dtype = settings
    f = 1.0 if low.mask is None else 1.0 / (1.0 - p)
    if terms is None:  # dmag, db, dy_ms and (dropout) dy_ms1 in one pass over dy, each only where needed
        assert dy is not None
        terms = dora_grad_terms(
            dy, low.z, low.ms, low.norm, _grad_dtypes(weight, dtypes, needs), _wants(low, needs, need_dx)
        )
    c = low.z.dtype
    grads = _DoRAGrads(bias=terms.bias, magnitude=terms.magnitude)
    dy_ms, dy_ms1 = terms.dy_ms, terms.dy_ms1
    if dy_ms is None and dy_ms1 is None:  # only mag or b needs a gradient
        return grads, dx
    gs = dB = None
    if dy_ms is not None:
        gs, dB = lora_b_grads(dy_ms, low.B_c, low.xa, scaling, lora_dtype, need_dx or needs.lora_A, needs.lora_B)
    if needs.lora_B:
        assert dB is not None
        grads = grads._replace(lora_B=dB)
    if needs.lora_A:
        assert gs is not None
        if a_grad_terms is not None:
            a_grad_terms.append((index, gs))
        else:
            (dA,) = lora_a_grads(x2, c, [gs], [low.mask], [settings], [lora_dtype])
            grads = grads._replace(lora_A=dA)
    if low.mask is None:
        assert dy_ms is not None
        if needs.weight:
            grads = grads._replace(weight=scaled_mm(dy_ms.t(), x2, 1.0, weight.dtype))
        if need_dx:
            assert gs is not None
            w = dense(weight)
            if dx is None and fused_grad_applies(dy_ms, w, gs, low.A_c):  # one GEMM (fk.lora.lora_matmul)
                dx = base_and_lora_grad(dy_ms, w, gs, low.A_c)
            else:
                # (the rank-sized term first: a dx this call creates is then written by it, and the
                # dy_ms W matmul adds into it; as fk.lora.projection.lora_and_base_out)
                dx = torch.mm(gs, low.A_c) if dx is None else dx.addmm_(gs, low.A_c)
                dx.addmm_(dy_ms, w)
        return grads, dx
    assert dy is not None  # (a caller forms the terms only without dropout)
    if needs.weight:
        assert dy_ms1 is not None
        kept = kept_input(x2, low.mask, dropout_dtype, c)
        dW = scaled_mm(dy.t(), x2, 1.0, torch.float32).add_(scaled_mm(dy_ms1.t(), kept, f, torch.float32))
        grads = grads._replace(weight=dW.to(weight.dtype))
    if need_dx:
        assert gs is not None and low.mask is not None and dy_ms1 is not None
        w = dense(weight)  # (one dequantized W for both of its products)
        dx = torch.mm(dy, w) if dx is None else dx.addmm_(dy, w)
        if masked_grad_applies(dy_ms1, w, gs, low.A_c, low.mask, dx):  # the masked sum in dy_ms1 W's epilogue
            base_and_masked_lora_grad(dy_ms1, w, gs, low.A_c, low.mask, f, mask_base=True, out=dx)
        else:
            add_masked_low_rank_(dx, gs, low.A_c, low.mask, f, addend=torch.mm(dy_ms1, w))
    return grads, dx


class DoRAProjections(torch.autograd.Function):
    """``len(settings)`` DoRA projections of one input ``x`` (one output each): ``settings`` one
    :class:`Settings` per projection, ``flat`` their :class:`DoRAParams` (:func:`to_flat`). ``x``
    and the base weights share one dtype, ``c`` (a 4-bit base: its :class:`QuantizedBase`, kept on
    ``ctx``, packed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, settings: tuple[Settings, ...], *flat: Any) -> Any:
        params = from_flat(DoRAParams, flat)
        x2 = x.reshape(-1, x.shape[-1])
        xas, masks, A_cs, dropped = lora_input_products(x2, x2, [p.lora_A for p in params], settings, keep_dropped=True)
        outs, lows = [], []
        for i, (xa, mask, A_c, proj, setting) in enumerate(zip(xas, masks, A_cs, params, settings, strict=True)):
            y, low = _dora_fwd(x2, xa, mask, A_c, proj, setting, dropped[i])
            dropped[i] = None  # (each dropped input freed once its zd is formed)
            assert y is not None
            lows.append(low)
            outs.append(y.view(*x.shape[:-1], y.shape[-1]))
        kept_weights, ctx.quantized = weights_to_save([proj.weight for proj in params])
        ctx.save_for_backward(x, *kept_weights, *to_flat(lows))
        ctx.settings = settings
        ctx.dtypes = [(proj.lora_A.dtype, proj.magnitude.dtype) for proj in params]
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, *dys: Any) -> Any:
        n = len(ctx.settings)
        x, *saved = ctx.saved_tensors
        weights, lows = saved_weights(saved[:n], ctx.quantized), from_flat(_DoRALowRank, saved[n:])
        x2 = x.reshape(-1, x.shape[-1])
        needs = from_flat(_DoRANeeds, ctx.needs_input_grad[2:])
        need_dx = ctx.needs_input_grad[0]
        dx: torch.Tensor | None = None
        grads = [_DoRAGrads()] * n
        a_grad_terms: list[tuple[int, torch.Tensor]] = []  # the projections' dA, formed together below
        for i, dy in enumerate(dys):
            if dy is not None:
                dy2 = dy.reshape(-1, dy.shape[-1])
                grads[i], dx = _dora_bwd(dy2, x2, weights[i], lows[i], ctx.dtypes[i], ctx.settings[i], needs[i], dx, need_dx,
                                         a_grad_terms=a_grad_terms, index=i)  # fmt: skip
        if a_grad_terms:
            idx = [i for i, _ in a_grad_terms]
            dAs = lora_a_grads(x2, lows[idx[0]].z.dtype, [gs for _, gs in a_grad_terms], [lows[i].mask for i in idx],
                               [ctx.settings[i] for i in idx], [ctx.dtypes[i][0] for i in idx])  # fmt: skip
            for i, dA in zip(idx, dAs, strict=True):
                grads[i] = grads[i]._replace(lora_A=dA)
        if dx is not None:
            dx = dx.view(x.shape)
        return (dx, None, *to_flat(grads))


def _gate_up(
    lows: tuple[_DoRALowRank, _DoRALowRank],
    kept: tuple[torch.Tensor | None, torch.Tensor | None],
    biases: tuple[torch.Tensor | None, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate's and up's outputs in the backward: kept (dropout), or recomputed from ``z`` as
    :func:`_dora_fwd` computed them (the same op on the same tensors: the same values)."""
    return tuple(  # type: ignore[return-value]
        k if k is not None else dora_scaled_output(low.z, low.ms, b)
        for low, k, b in zip(lows, kept, biases, strict=True)
    )


class DoRAMLP(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))`` with DoRA on all three projections; ``act`` is fk.glu's kernel.

    ``settings``: the :class:`Settings` of gate, up and down; ``flat``: their :class:`DoRAParams`.
    Gate and up are projections of one input (their LoRA inputs stacked without dropout, one
    ``dx``). What is kept of ``[M, I]`` size: DoRA's ``z`` of gate and of up, and, for one with
    dropout, its output too (which ``ms * z + b`` gives back only without dropout). Without dropout
    on gate and up, their outputs are never written: ``h`` and, in the backward, their DoRA terms
    are formed from the two ``z`` in one pass each (:mod:`fk.lora.dora_glu`). ``h`` is recomputed in
    the backward. A 4-bit base is kept packed (:class:`QuantizedBase`) and dequantized as in
    :class:`DoRAProjections`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, act: str, settings: tuple[Settings, ...], *flat: Any) -> Any:
        params_g, params_u, params_d = from_flat(DoRAParams, flat)
        x2 = x.reshape(-1, x.shape[-1])
        xas, masks, A_cs, dropped = lora_input_products(
            x2, x2, [params_g.lora_A, params_u.lora_A], settings[:2], keep_dropped=True
        )
        fused = masks[0] is None and masks[1] is None  # h from gate's and up's z, neither written
        gate, low_g = _dora_fwd(x2, xas[0], masks[0], A_cs[0], params_g, settings[0], dropped.pop(0), not fused)
        up, low_u = _dora_fwd(x2, xas[1], masks[1], A_cs[1], params_u, settings[1], dropped.pop(0), not fused)
        if fused:
            h = dora_gated_act(_scaled(low_g, params_g.bias), _scaled(low_u, params_u.bias), act)
        else:
            assert gate is not None and up is not None
            h = gated_act_forward(gate, up, act)
        (xa_d,), (mask_d,), (A_c_d,), (dropped_d,) = lora_input_products(
            h, h, [params_d.lora_A], settings[2:], keep_dropped=True
        )
        y, low_d = _dora_fwd(h, xa_d, mask_d, A_c_d, params_d, settings[2], dropped_d)
        del dropped_d
        assert y is not None
        del h  # recomputed in the backward
        kept_g = gate if low_g.mask is not None else None
        kept_u = up if low_u.mask is not None else None
        weights, ctx.quantized = weights_to_save([params_g.weight, params_u.weight, params_d.weight])
        ctx.save_for_backward(
            x, *weights, params_g.bias, params_u.bias, kept_g, kept_u, *to_flat([low_g, low_u, low_d])
        )
        ctx.act, ctx.settings = act, settings
        ctx.dtypes = [(proj.lora_A.dtype, proj.magnitude.dtype) for proj in (params_g, params_u, params_d)]
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, wg, wu, wd, bias_g, bias_u, kept_g, kept_u, *lows = ctx.saved_tensors
        wg, wu, wd = saved_weights((wg, wu, wd), ctx.quantized)  # (4-bit: dequantized in _dora_bwd for dx)
        low_g, low_u, low_d = from_flat(_DoRALowRank, lows)
        settings_g, settings_u, settings_d = ctx.settings
        dtypes_g, dtypes_u, dtypes_d = ctx.dtypes
        need_dx = ctx.needs_input_grad[0]
        needs_g, needs_u, needs_d = from_flat(_DoRANeeds, ctx.needs_input_grad[3:])
        need_gu = need_dx or any(needs_g) or any(needs_u)
        fused = kept_g is None and kept_u is None  # as in the forward: no dropout on gate and up
        scaled_g, scaled_u = _scaled(low_g, bias_g), _scaled(low_u, bias_u)
        gate = up = None
        if fused:
            h = dora_gated_act(scaled_g, scaled_u, ctx.act)
        else:
            gate, up = _gate_up((low_g, low_u), (kept_g, kept_u), (bias_g, bias_u))
            h = gated_act_forward(gate, up, ctx.act)
        dy2 = dy.reshape(-1, dy.shape[-1])
        grads_d, dh = _dora_bwd(dy2, h, wd, low_d, dtypes_d, settings_d, needs_d, None, need_gu)
        del h
        grads_g = grads_u = _DoRAGrads()
        dx = None
        if dh is not None:
            x2 = x.reshape(-1, x.shape[-1])
            if fused and _wants(low_g, needs_g, need_dx)[0] and _wants(low_u, needs_u, need_dx)[0]:
                dtypes = (_grad_dtypes(wg, dtypes_g, needs_g), _grad_dtypes(wu, dtypes_u, needs_u))
                terms_g, terms_u = dora_gated_act_grad_terms(dh, scaled_g, scaled_u, ctx.act, dtypes)
                del dh
                grads_g, dx = _dora_bwd(None, x2, wg, low_g, dtypes_g, settings_g, needs_g, None, need_dx, terms_g)
                grads_u, dx = _dora_bwd(None, x2, wu, low_u, dtypes_u, settings_u, needs_u, dx, need_dx, terms_u)
            else:
                if gate is None or up is None:  # (fused, but dy_ms not needed: only mag or b train)
                    gate, up = _gate_up((low_g, low_u), (kept_g, kept_u), (bias_g, bias_u))
                # (dg, du) over the recomputed gate and up's buffers; a saved one is not written over
                dg, du, _ = gated_act_backward(dh, gate, up, ctx.act, inplace=fused)
                del dh, gate, up
                grads_g, dx = _dora_bwd(dg, x2, wg, low_g, dtypes_g, settings_g, needs_g, None, need_dx)
                grads_u, dx = _dora_bwd(du, x2, wu, low_u, dtypes_u, settings_u, needs_u, dx, need_dx)
        if dx is not None:
            dx = dx.view(x.shape)
        return (dx, None, None, *to_flat([grads_g, grads_u, grads_d]))


def _scaled(low: _DoRALowRank, bias: torch.Tensor | None) -> ScaledProjection:
    """Gate's or up's scaling, as :mod:`fk.lora.dora_glu` takes it."""
    return ScaledProjection(low.z, low.ms, low.norm, bias)
