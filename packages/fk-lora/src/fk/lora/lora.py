"""LoRA projections with the frozen base matmul and the low-rank branch fused: ``y = x W^T + b + s (d(x) A^T) B^T + s b_B``.

Notation, for one projection: ``x`` ``[M, K]`` (the leading dimensions flattened), base weight
``W`` ``[N, K]`` and bias ``b`` ``[N]`` (frozen or trainable), LoRA ``A`` ``[r, K]``, ``B``
``[N, r]``, ``lora_bias`` ``b_B`` ``[N]`` (PEFT's ``lora_bias=True`` gives ``lora_B`` a bias),
``scaling`` ``s`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) and ``d`` the LoRA dropout
(``p``), applied to the LoRA branch only, as PEFT applies ``nn.Dropout`` before ``lora_A``.

The forward computes the base projection, then adds ``s (d(x) A^T) B^T`` into the same buffer
with one ``addmm``: the only extra intermediate is the rank-sized ``xa = d(x) A^T`` ``[M, r]``.
Dropout masks are torch's: those ``torch.native_dropout`` draws on ``x`` cast to ``A``'s dtype, in
the order PEFT calls the modules (q, k, v; gate, up, down): the same random stream as ``nn.Dropout``
in PEFT, so a run seeded like a PEFT run draws the same masks. On a GPU, where the input is 16-bit
in ``A``'s dtype, they are drawn inside the kernel that forms ``xa`` (:mod:`fk.lora.torch_dropout`,
:mod:`fk.lora.dropped_lora_inputs`: the same Philox numbers torch's kernel takes, bit for bit, and
no dropped input written); elsewhere by ``torch.native_dropout`` itself. The mask is saved as bool
(one byte per element), not the dropped input.

Dtypes: the output has ``x``'s dtype (as PEFT's, which casts its result back to the base
layer's). ``A`` and ``B`` may be kept in another dtype (fp32 LoRA weights with bf16 activations):
``d(x) A^T`` is computed in ``A``'s dtype, as PEFT computes it; the rest runs in ``x``'s dtype
(the rank-sized ``xa`` and ``B`` are cast, never the activations) and the LoRA gradients are
returned in the LoRA weights' dtype.

Autocast: under ``torch.autocast`` enabled for ``x``'s device, the functions compute what PEFT's
``lora.Linear`` computes under the same autocast. ``W``, ``b``, ``A``, ``B`` and ``b_B`` are cast to
autocast's dtype (autograd carries their gradients back through the casts, as through autocast's
own), the base matmul runs on ``x`` cast to that dtype, the dropout is drawn on ``x`` cast to the
LoRA weights' own dtype (PEFT's ``_cast_input_dtype``) and its result is cast to autocast's dtype
for ``A``. Every matmul then runs in autocast's dtype, the output has that dtype, and ``dx`` is
returned in ``x``'s. The fused functions themselves run with autocast disabled. DoRA too: PEFT
forms its row norm from the base weight as it is (a 4-bit one dequantized) and from ``B A``, in
the dtype of its (cast) input, the LoRA weights', which is where fk's norm is rounded; fk forms it
from the weight cast to autocast's dtype, so where the weight is wider (an fp32 model) the norms
differ by that rounding: at most 1.8e-4 relative on rows of 4096 random weights (7.5e-5 on rows
of 14336), against bf16's 2.0e-3 half unit that rounds every output
(``benchmarks/experiments/INDEX.md#dora_norm_rounding``). DoRA's launchers take ``x``
cast to autocast's dtype, so its dropout is drawn on that cast again to the LoRA weights' dtype:
the same mask as on ``x`` itself, the dropped values rounded once more than PEFT's where ``x`` is
wider (autocast rounds them for ``A`` anyway).

DoRA (PEFT ``use_dora=True``): a projection given a magnitude vector ``mag`` computes PEFT's
``DoraLinearLayer`` output, ``mag / ||W + s B A||`` (the row norm detached) scaling the base and
LoRA products; its launchers are :mod:`fk.lora.dora`'s, which the functional API here calls.

This file holds, in order: the references, the launchers (forward and backward of a group of
projections that share their input, and of a gated MLP, as ``torch.autograd.Function``\\ s, built
from :mod:`fk.lora.projection`'s parts; the matmuls are PyTorch's, the MLP's activation is fk.glu's
Triton kernel, the dropout's masked input gradient the kernel of :mod:`fk.lora.masked_low_rank`),
and the functional API (:func:`lora_linear`, :func:`lora_o`, :func:`lora_qkv`, :func:`lora_mlp`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.matmul import accumulate_mm, column_sum, scaled_mm
from fk.glu import (
    gated_act,
    gated_act_backward_with_value,
    gated_act_forward,
    gated_act_ref,
    resolve_activation,
)
from fk.lora.dora import DoRAMLP, DoRAParams, DoRAProjections, dora_ref
from fk.lora.lora_matmul import (
    base_and_lora_grad,
    base_and_masked_lora_grad,
    fused_grad_applies,
    masked_grad_applies,
)
from fk.lora.masked_low_rank import MaskedLowRank, add_masked_low_rank_, add_masked_low_ranks_
from fk.lora.projection import (
    Settings,
    add_lora_out,
    autocast_off,
    backward_without_autocast,
    base_out,
    cut_blocks,
    from_flat,
    kept_input,
    lora_a_grads,
    lora_a_operands,
    lora_and_base_out,
    lora_b_grads,
    lora_input_product,
    lora_input_products,
    stackable,
    to_flat,
)
from fk.lora.quant import Int8Base, QuantizedWeight, dequantize
from fk.lora.quantized_base import QuantizedBase, dense, dequantized_together, saved_weights, weights_to_save

MLP_ACTIVATIONS: dict[str, str] = {"swiglu": "silu", "geglu": "gelu_tanh"}
"""Short names accepted by :func:`lora_mlp` (Hugging Face ``hidden_act`` names are accepted too)."""


class LoRAWeights(NamedTuple):
    """The parameters of one LoRA projection (a PEFT ``lora.Linear`` with one active adapter)."""

    weight: torch.Tensor | QuantizedWeight | Int8Base
    """Base weight ``[N, K]`` (``base_layer.weight``), frozen or trainable; or a frozen 4-bit
    (NF4/FP4) :class:`fk.lora.quant.QuantizedWeight` (QLoRA, plain LoRA or DoRA: every function
    takes one), dequantized to the compute dtype (autocast's, else ``x``'s) in the forward and again
    in the backward for ``dx``, never kept (DoRA's norm: from the weight in bitsandbytes' own dtype,
    as PEFT's); or a bitsandbytes LLM.int8() layer,
    :class:`fk.lora.quant.Int8Base` (plain LoRA, outside autocast), whose own product gives the base
    output and whose int8 weight, dequantized to ``x``'s dtype, gives ``dx``'s base term."""
    bias: torch.Tensor | None
    """Base bias ``[N]`` or None. With an :class:`fk.lora.quant.Int8Base`, the layer's bias (its
    product adds it; the fused functions use it for its gradient only), in ``x``'s dtype."""
    lora_A: torch.Tensor
    """``[r, K]`` (``lora_A[adapter].weight``)."""
    lora_B: torch.Tensor
    """``[N, r]`` (``lora_B[adapter].weight``), same dtype as ``lora_A``."""
    scaling: float
    """``alpha / r`` (or ``alpha / sqrt(r)``): PEFT's ``module.scaling[adapter]``."""
    dropout_p: float = 0.0
    """LoRA dropout probability; 0 when the dropout module is in eval mode."""
    lora_bias: torch.Tensor | None = None
    """``[N]``: ``lora_B``'s bias (PEFT ``lora_bias=True``), scaled by ``scaling`` like ``lora_B``."""
    magnitude: torch.Tensor | None = None
    """``[N]``: DoRA's magnitude vector ``mag`` (PEFT ``use_dora=True``,
    ``lora_magnitude_vector[adapter].weight``); None for plain LoRA. Not with ``lora_bias``."""


# --- 1. Reference ---------------------------------------------------------------------------------


def lora_linear_ref(
    x: torch.Tensor,
    base_weight: torch.Tensor | QuantizedWeight | Int8Base,
    base_bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    dropout_p: float = 0.0,
    lora_bias: torch.Tensor | None = None,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """PEFT's ``lora.Linear.forward`` for one adapter, in plain PyTorch (the definition tests use).

    ``result = base(x); result = result + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling``, cast
    back to the base result's dtype. Dropout (``dropout_p > 0``) draws from the global generator
    exactly as :func:`lora_linear` does.

    With ``magnitude`` (DoRA, PEFT's ``DoraLinearLayer``): with ``xl`` the LoRA branch's input (``x``
    in the LoRA dtype, dropped), ``n = ||W + s B A||`` over each output row, in ``xl``'s dtype and
    detached, and ``ms = magnitude / n``, the result is ``result + (ms - 1) base + ms lora``, where
    ``base`` is ``result - b`` without dropout and ``xl W^T`` with it (PEFT recomputes the base
    product on the dropped input).
    """
    if isinstance(base_weight, Int8Base):  # (LLM.int8(): the layer's own product, bias included)
        result = base_weight.product(x)
        base_weight = dequantize(base_weight.weight, dtype=x.dtype)  # (for DoRA's norm only)
    elif isinstance(base_weight, QuantizedWeight):  # (QLoRA: bitsandbytes' dequantize, then matmul in x's dtype)
        base_weight = dequantize(base_weight)  # (in bitsandbytes' own dtype: DoRA's norm starts from it, as PEFT's)
        result = F.linear(x, base_weight.to(x.dtype), base_bias)
    else:
        result = F.linear(x, base_weight, base_bias)
    xl = x.to(lora_A.dtype)
    if dropout_p > 0:
        xl = F.dropout(xl, dropout_p, training=True)
    lora = F.linear(F.linear(xl, lora_A), lora_B, lora_bias) * scaling
    if magnitude is None:
        return (result + lora).to(result.dtype)
    return dora_ref(result, xl, lora, base_weight, base_bias, lora_A, lora_B, scaling, dropout_p, magnitude)


def lora_mlp_ref(
    x: torch.Tensor, gate: LoRAWeights, up: LoRAWeights, down: LoRAWeights, activation: str = "swiglu"
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with each projection a :func:`lora_linear_ref`."""
    act = _resolve_mlp_activation(activation)
    g = lora_linear_ref(x, *gate)
    u = lora_linear_ref(x, *up)
    return lora_linear_ref(gated_act_ref(g, u, act), *down)


# --- 2. Launchers ---------------------------------------------------------------------------------
#
# Forward of one projection (x2 = x as [M, K], c = the activation dtype, l = the LoRA dtype):
#   y  = addmm(b, x2, W^T)                       [M, N], in c     (launched first: the long matmul)
#   xa = d(x2.to(l)) A^T                         [M, r], in l, rounded to c   (d: dropout, mask m, 1/(1-p))
#        (bf16 x2, fp32 A, no dropout, on a GPU: fk.core.matmul.mm_bf16_fp32 computes the same
#        product reading x2 once in bf16, with no fp32 copy of it, against a two-part split of A)
#   y += s xa B^T ; y += s b_B                   one buffer
# Kept for the backward: xa, and A and B cast to c, A_c and B_c (cast once here, not again in the
# backward).
#
# Backward, with upstream gradient dy [M, N] and G = dy B [M, r] (rank-sized):
#   dB      = s dy^T xa                          [N, r]
#   db_B    = s sum_rows(dy)                     [N]
#   dA      = s G^T d(x2)                        [r, K]   d(x2) = x2 * m / (1 - p), formed as
#             (s G)^T (x2 * m) scaled by 1/(1-p): x2 * m exact in c, formed in registers by
#             fk.lora.masked_a_grad (never written; one pass over x2 for all the projections
#             that share it, each mask read once)
#   dW      = dy^T x2                            [N, K]   only when W requires grad
#   db      = sum_rows(dy)                       [N]      only when b requires grad
#   dx      = dy W + s (G A) * m / (1 - p)       [M, K]
# Each rank-sized matmul is one kernel (fk.core.matmul.scaled_mm): its scale is the matmul's alpha,
# and dA and dB (fp32 next to bf16 activations) are the matmul's own fp32 output.
# Under autocast, W, b, A, B and b_B arrive cast to autocast's dtype, which is then c: x2 is cast
# to c for the base matmul (and recast in the backward for dW), the LoRA branch casts x2 to lora_A's
# own dtype for the dropout and the result to c, and dx is formed in c and cast to x's dtype.
# For projections that share x (q, k, v; gate, up), the rank-sized work of the ones without
# dropout is stacked, so that x2 is read once for all of them, not once per projection: the
# forward's xa's come from one matmul against [A_q; A_k; A_v] (each xa a column block of it), the
# backward's dA's from one [s G_q | s G_k | s G_v]^T x2. dx is one buffer: the first dy W and the
# stacked s G A terms come from one GEMM of fk.lora.lora_matmul where it applies (else the s G A
# terms are written first and the dy W matmul adds into them), the other dy W terms are accumulated
# into it with addmm_; with dropout, the projections' masked s G A terms go into dx by
# the kernel of fk.lora.masked_low_rank, which forms each G A tile by tile in registers (one more
# pass over dx for all of them; a projection alone, such as O, takes its masked term into its dy W
# GEMM's epilogue instead, fk.lora.lora_matmul's base_and_masked_lora_grad). Projections with
# dropout that share x and the dropout dtype draw their masks on one cast of x2 (in PEFT's order).
#
# Gated MLP: g = proj_gate(x), u = proj_up(x), h = act(g) * u (fk.glu's kernel), y = proj_down(h).
# Saved: x, g, u, the rank-sized xa's and the masks; h is not saved but recomputed from g and u in
# the backward, inside the gradient pass (one more write instead of an [M, I] buffer kept from
# forward to backward). Backward: dh = dy Wd + s (G_d Ad) needs no h, so it comes first; then
# (dg, du, h) = fk.glu.gated_act_backward_with_value(dh, g, u) in one pass, in eager mode with dg
# and du written over g's and u's buffers and h over dh's; then the down projection's parameter
# gradients from h (dWd = dy^T h, dAd = (s G_d)^T h), then dx from dg and du.
# Without dropout on the down projection, h and dh are formed MLP_CHUNK_BYTES of rows at a time
# (forward and eager backward), so g and u are the only [M, I] buffers: the down projection's
# parameter gradients are then sums over the chunks, in fp32.
#
# 4-bit (QLoRA) bases, in the projections and the MLP alike, plain LoRA and DoRA (fk.lora.dora): W is
# dequantized whole to c where a matmul needs it and dropped once that matmul (for the MLP's row
# chunks: all of them) has run, so at most one projection's W exists at a time. Forward: for its base
# matmul (DoRA: and its norm and, with dropout, its product on the dropped input). Backward: for
# dx = dy W (and the MLP's dh = dy Wd), never for a parameter gradient (the base is frozen). Only the
# packed data is kept between forward and backward (why whole: fk.lora.quantized_base).
#
# 8-bit (LLM.int8(), bitsandbytes' Linear8bitLt with has_fp16_weights=False) bases, given as an Int8Base
# (the int8 weight and the layer as its product). What bitsandbytes 0.50.2 computes, which PEFT's
# lora.bnb.Linear8bitLt (and lora.Linear around such a base) runs as `base_layer(x)`:
#   forward: Linear8bitLt.forward sets state.is_training = training, casts the bias in place to x's
#     dtype, and calls bnb.matmul. On CUDA (and on CPU in eval mode) that is MatMul8bitLt: x cast to
#     fp16 and quantized row-wise to int8 (int8_vectorwise_quant); with threshold > 0, the columns of
#     x holding any |x| > threshold are zeroed in the int8 copy and multiplied in x's own dtype
#     against the weight's dequantized columns (int8_mixed_scaled_mm); int8 GEMM, dequantized with
#     the bias added, returned in x's dtype. On CPU in training mode it is MatMul8bitFp: W dequantized
#     to x's dtype, then F.linear. Either way the output has x's dtype.
#   backward, for x: grad_A = dy.to(x's dtype) @ (CB.to(x's dtype) * (SCB / 127)) in both functions:
#     the dense product with the dequantized weight, no int8 in it (and no gradient for the frozen
#     int8 weight); the bias gets sum_rows(dy).
# So fk calls the layer itself for the base output (bitsandbytes' activation quantization and
# outlier split stay exact, whatever the device or mode; it runs once, with autograd off, and fk
# never imports bitsandbytes), adds the LoRA branch into that output as above, and in the backward
# forms dx = dy W + s G A in one buffer with W dequantized by fk.lora.quant to x's dtype, like the
# 4-bit W: for dx only, one projection's at a time, never kept. (fk dequantizes in
# int8_vectorwise_dequant's order, (CB * SCB) / 127 in fp32 then rounded once; bitsandbytes'
# backward forms CB * (SCB / 127): in fp32 the two differ by an ulp at most, so after the rounding
# to x's dtype a weight element differs, rarely, by one rounding of that dtype.) The MLP's down
# projection on an int8 base is computed on all rows at once (its outlier columns are found over
# all rows, as PEFT's call finds them), never in row chunks. Autocast on int8 bases is refused
# (fk.lora.patch leaves it to PEFT); DoRA on them is fk.lora.dora's.


class _Params(NamedTuple):
    """One projection's tensors, as the autograd functions take them: cast to autocast's dtype
    under autocast; flat, five a projection, at the functions' boundary (:func:`to_flat`)."""

    weight: Any
    """``W`` ``[N, K]``, in the compute dtype ``c``: a tensor, or a :class:`QuantizedBase`
    (4-bit QLoRA base)."""
    bias: torch.Tensor | None
    """``b`` ``[N]``."""
    lora_A: torch.Tensor
    """``A`` ``[r, K]``, in the LoRA dtype."""
    lora_B: torch.Tensor
    """``B`` ``[N, r]``."""
    lora_bias: torch.Tensor | None
    """``b_B`` ``[N]``."""


class _Needs(NamedTuple):
    """Which of one projection's :class:`_Params` need a gradient (its share of ``needs_input_grad``)."""

    weight: bool
    bias: bool
    lora_A: bool
    lora_B: bool
    lora_bias: bool


class _Grads(NamedTuple):
    """The gradients of one projection's :class:`_Params` (``dW``, ``db``, ``dA``, ``dB``,
    ``db_B``), None where not needed; the LoRA ones in the LoRA dtype."""

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    lora_bias: torch.Tensor | None = None


class _LowRank(NamedTuple):
    """What one projection's forward keeps of its LoRA branch for the backward, all but the mask in
    the compute dtype ``c`` (cast once in the forward, so the backward casts nothing)."""

    xa: torch.Tensor
    """``d(x) A^T`` ``[M, r]``."""
    mask: torch.Tensor | None
    """The dropout mask (bool, ``[M, K]``), or None."""
    A_c: torch.Tensor
    """``A`` ``[r, K]``."""
    B_c: torch.Tensor
    """``B`` ``[N, r]``."""


def _projection_out(xc: torch.Tensor, proj: _Params, low: _LowRank, scaling: float) -> torch.Tensor:
    """``y = xc W^T + b + s xa B^T + s b_B`` of one projection: :func:`lora_and_base_out` (a 4-bit
    ``W`` dequantized for it and dropped after), or, for an int8 base, its layer's own product (bias
    included), checked for its shape and dtype, with the rank-sized product added after it."""
    weight = proj.weight
    if isinstance(weight, QuantizedBase) and weight.product is not None:
        return add_lora_out(weight.layer_output(xc), low.xa, low.B_c, proj.lora_bias, scaling)
    return lora_and_base_out(xc, dense(weight), proj.bias, low.xa, low.B_c, proj.lora_bias, scaling)


def _outputs_and_lows(
    x2: torch.Tensor, xc: torch.Tensor, params: Sequence[_Params], settings: Sequence[Settings]
) -> tuple[list[torch.Tensor], list[_LowRank]]:
    """(the outputs, what each projection's backward keeps) of projections that share ``x2``: their
    LoRA input products first (:func:`lora_input_products`: one read of ``x2`` where they stack; with
    dropout, the ``[M, K]`` buffers it forms are freed before any output exists), then each output
    (:func:`_projection_out`; a 4-bit ``W`` dequantized for its own matmul and dropped before the
    next one's, or, for small ones such as q, k and v's where ``TOGETHER_MAX_ELEMENTS`` allows it,
    all by one launch before the first matmul: :func:`dequantized_together`)."""
    xas, masks, A_cs, _ = lora_input_products(x2, xc, [proj.lora_A for proj in params], settings)
    lows = [
        _LowRank(xa, mask, A_c, proj.lora_B.to(xc.dtype))
        for xa, mask, A_c, proj in zip(xas, masks, A_cs, params, strict=True)
    ]
    weights = dequantized_together([proj.weight for proj in params])
    ys = []
    for i, (proj, low, s) in enumerate(zip(params, lows, settings, strict=True)):
        ys.append(_projection_out(xc, proj._replace(weight=weights[i]), low, s.scaling))
        weights[i] = None  # (a dequantized W dropped after its matmul)
    return ys, lows


def _proj_fwd(x2: torch.Tensor, xc: torch.Tensor, params: _Params, settings: Settings) -> tuple[torch.Tensor, _LowRank]:
    """One projection of ``x2`` ``[M, K]``: (y ``[M, N]``, what its backward keeps)."""
    (y,), (low,) = _outputs_and_lows(x2, xc, [params], [settings])
    return y, low


def _proj_bwd_params(
    dy: torch.Tensor,
    x2: torch.Tensor | None,
    xc: torch.Tensor | None,
    weight: torch.Tensor,
    low: _LowRank,
    lora_dtype: torch.dtype,
    settings: Settings,
    needs: _Needs,
    gs: torch.Tensor | None,
    dB: torch.Tensor | None,
) -> _Grads:
    """The parameter gradients of :func:`_proj_fwd`, None where not in ``needs``; the LoRA ones in
    ``lora_dtype``. ``x2`` is needed only for dA, ``xc`` (``x2`` in ``dy``'s dtype) only for dW,
    ``gs`` (:func:`scaled_lora_grad`) only for dA; ``gs`` and ``dB`` come formed, as
    :func:`~fk.lora.projection.lora_b_grads` forms them for ``needs``."""
    assert dB is not None or not needs.lora_B
    dW: torch.Tensor | None = None
    db: torch.Tensor | None = None
    dA: torch.Tensor | None = None
    db_B: torch.Tensor | None = None
    if needs.weight:
        assert xc is not None
        dW = scaled_mm(dy.t(), xc, 1.0, weight.dtype)
    if needs.bias or needs.lora_bias:
        col_sum = column_sum(dy)
        if needs.bias:
            db = col_sum.to(weight.dtype)
        if needs.lora_bias:
            db_B = (col_sum * settings.scaling).to(lora_dtype)
    if needs.lora_A:
        assert gs is not None and x2 is not None
        (dA,) = lora_a_grads(x2, dy.dtype, [gs], [low.mask], [settings], [lora_dtype])
    return _Grads(dW, db, dA, dB, db_B)


def _proj_bwd_input(
    dy: torch.Tensor, weight: Any, A_c: torch.Tensor, gs: torch.Tensor, mask: torch.Tensor | None, p: float
) -> torch.Tensor:
    """``dx = dy W + (s G A) * m / (1 - p)``, a new buffer; a :class:`QuantizedBase` ``W`` is
    dequantized for the ``dy W`` matmul only. One GEMM of :mod:`fk.lora.lora_matmul` where it
    applies (with dropout, the masked term in its epilogue); else, without dropout, the rank-sized
    term written first and the ``dy W`` matmul adding into it (one pass over dx fewer, as
    :func:`lora_and_base_out`), with dropout the ``dy W`` matmul and the masked term's own pass."""
    w = dense(weight)
    if mask is None:
        if fused_grad_applies(dy, w, gs, A_c):
            return base_and_lora_grad(dy, w, gs, A_c)
        return torch.mm(gs, A_c).addmm_(dy, w)
    if masked_grad_applies(dy, w, gs, A_c, mask):
        return base_and_masked_lora_grad(dy, w, gs, A_c, mask, 1.0 / (1.0 - p))
    return add_masked_low_rank_(torch.mm(dy, w), gs, A_c, mask, 1.0 / (1.0 - p))


def _shared_input_bwd(
    dys: list[torch.Tensor | None],
    x2: torch.Tensor,
    xc: torch.Tensor | None,
    weights: list[Any],
    lows: list[_LowRank],
    lora_dtypes: list[torch.dtype],
    settings: Sequence[Settings],
    needs: Sequence[_Needs],
    need_dx: bool,
) -> tuple[torch.Tensor | None, list[_Grads]]:
    """Backward of the projections of one input ``x2`` (q, k, v; gate, up; or one alone): returns
    (dx, the parameter gradients of each projection).

    ``dys[i]`` ``[M, N_i]`` (None: projection i got no gradient), ``weights[i]`` its base weight
    (or a :class:`QuantizedBase`, dequantized for its ``dy W`` term only, then dropped),
    ``lows[i]`` what its forward kept, ``lora_dtypes[i]`` its LoRA weights' dtype; ``xc`` is ``x2``
    in the gradients' dtype (needed for dW only).
    dx is one buffer: the first projection's ``dy W`` and the rank-sized ``s G A`` terms of the
    projections without dropout, stacked as in the forward, by one GEMM of :mod:`fk.lora.lora_matmul`
    where it applies (else the ``s G A`` terms written by one matmul first; their ``dA``\\ s, too,
    come from one matmul that reads ``x2`` once), then the other ``dy W`` terms added by their
    matmuls' epilogues (one pass over dx fewer than the other order, as :func:`lora_and_base_out`),
    then the masked terms of the projections with dropout in one more pass (a projection alone: its
    masked term in its GEMM's epilogue, :func:`~fk.lora.lora_matmul.base_and_masked_lora_grad`, where
    that applies).
    """
    n = len(settings)
    live = [i for i in range(n) if dys[i] is not None]
    if not live:
        return None, [_Grads()] * n
    c = dys[live[0]].dtype  # type: ignore[union-attr]
    gss: list[Any] = [None] * n
    grads = [_Grads()] * n
    groups = stackable(settings, [lora_dtypes[i] if i in live else None for i in range(n)])
    stacked_dA = {i for group in groups for i in group}
    for i in live:
        dy = dys[i]
        assert dy is not None
        gss[i], dB = lora_b_grads(dy, lows[i].B_c, lows[i].xa, settings[i].scaling, lora_dtypes[i],
                                  need_dx or needs[i].lora_A, needs[i].lora_B)  # fmt: skip
        own_needs = needs[i]._replace(lora_A=needs[i].lora_A and i not in stacked_dA and lows[i].mask is None)
        grads[i] = _proj_bwd_params(dy, x2, xc, weights[i], lows[i], lora_dtypes[i], settings[i], own_needs, gss[i],
                                    dB)  # fmt: skip
    with_dropout = [i for i in live if needs[i].lora_A and lows[i].mask is not None]
    if with_dropout:  # dA of projections with dropout: one read of x2 and of each mask, for all of them
        dAs = lora_a_grads(x2, c, [gss[i] for i in with_dropout], [lows[i].mask for i in with_dropout],
                           [settings[i] for i in with_dropout], [lora_dtypes[i] for i in with_dropout])  # fmt: skip
        for i, dA_i in zip(with_dropout, dAs, strict=True):
            grads[i] = grads[i]._replace(lora_A=dA_i)
    stacked_gs: dict[tuple[int, ...], torch.Tensor] = {}  # [s G_i | s G_j | ...], concatenated once

    def gs_of(indices: list[int]) -> torch.Tensor:
        key = tuple(indices)
        if key not in stacked_gs:
            stacked_gs[key] = torch.cat([gss[i] for i in indices], dim=1) if len(indices) > 1 else gss[indices[0]]
        return stacked_gs[key]

    for group in groups:
        group = [i for i in group if needs[i].lora_A]
        if group:  # dA of projections without dropout: one read of d(x2) = x2, for all of them
            kept = kept_input(x2, None, settings[group[0]].dropout_dtype, c)
            dA = scaled_mm(gs_of(group).t(), kept, 1.0, lora_dtypes[group[0]])
            for i, dA_i in zip(group, cut_blocks(dA, [lows[i].A_c.shape[0] for i in group], 0), strict=True):
                grads[i] = grads[i]._replace(lora_A=dA_i)
    if not need_dx:
        return None, grads
    dx: torch.Tensor | None = None
    plain = [i for i in live if lows[i].mask is None]
    # s G A of the projections without dropout, stacked: one rank-sized product
    A_plain = (torch.cat([lows[i].A_c for i in plain]) if len(plain) > 1 else lows[plain[0]].A_c) if plain else None
    live_weights = dequantized_together([weights[i] for i in live])
    # A projection alone with dropout: its dy W and masked term as _proj_bwd_input forms them (one GEMM
    # where it applies). With more projections, each GEMM adding its own term to dx took longer than
    # the one pass for all of them (benchmarks/experiments/INDEX.md#masked_grad_epilogue).
    alone_with_dropout = len(live) == 1 and lows[live[0]].mask is not None
    for j, i in enumerate(live):  # the base terms; a 4-bit W dequantized for its term only (or q, k, v's together)
        dy = dys[i]
        assert dy is not None
        weight = dense(live_weights[j])
        live_weights[j] = None
        if alone_with_dropout:
            dx = _proj_bwd_input(dy, weight, lows[i].A_c, gss[i], lows[i].mask, settings[i].dropout_p)
        elif dx is not None:
            dx.addmm_(dy, weight)
        elif A_plain is None:
            dx = torch.mm(dy, weight)
        elif fused_grad_applies(dy, weight, gs_of(plain), A_plain):  # the first base term and s G A in one GEMM
            dx = base_and_lora_grad(dy, weight, gs_of(plain), A_plain)
        else:  # s G A written first, the dy W matmul adding into it
            dx = torch.mm(gs_of(plain), A_plain).addmm_(dy, weight)
        del weight
    assert dx is not None
    masked_terms = [
        MaskedLowRank(gss[i], lows[i].A_c, mask, 1.0 / (1.0 - settings[i].dropout_p))
        for i in live
        if (mask := lows[i].mask) is not None and not alone_with_dropout
    ]
    if masked_terms:  # s G A of the projections with dropout, each under its mask: one more pass over dx
        add_masked_low_ranks_(dx, masked_terms)
    return dx, grads


def _cast_if_needed(x2: torch.Tensor, dtype: torch.dtype, needed: bool) -> torch.Tensor | None:
    """``x2`` in ``dtype`` (``x2`` itself when it has it; None when not ``needed``)."""
    if x2.dtype == dtype:
        return x2
    return x2.to(dtype) if needed else None


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype when autocast is enabled for ``x``'s device, else None."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _LoRAProjections(torch.autograd.Function):
    """``len(settings)`` LoRA projections of one input ``x``: returns one output per projection.

    ``settings`` holds one :class:`Settings` per projection, ``flat`` their :class:`_Params`
    (:func:`to_flat`). The weights share one dtype, the compute dtype; ``x`` may have another
    (autocast): it is cast.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, settings: tuple[Settings, ...], *flat: Any) -> Any:
        params = from_flat(_Params, flat)
        x2 = x.reshape(-1, x.shape[-1])
        c = params[0].weight.dtype
        xc = x2 if x2.dtype == c else x2.to(c)
        # (a 4-bit base is dequantized for its base matmul only, one at a time: see QuantizedBase)
        ys, lows = _outputs_and_lows(x2, xc, params, settings)
        outs = [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]
        kept_weights, quantized = weights_to_save([proj.weight for proj in params])
        ctx.save_for_backward(x, *kept_weights, *to_flat(lows))
        ctx.quantized = quantized
        ctx.settings = settings
        ctx.lora_dtypes = [proj.lora_A.dtype for proj in params]
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, *dys: Any) -> Any:
        n = len(ctx.settings)
        x, *saved = ctx.saved_tensors
        # (a 4-bit base is dequantized again by _shared_input_bwd, one at a time, for its dx = dy W term)
        weights = saved_weights(saved[:n], ctx.quantized)
        lows = from_flat(_LowRank, saved[n:])
        need_dx = ctx.needs_input_grad[0]
        x2 = x.reshape(-1, x.shape[-1])
        c = lows[0].xa.dtype
        needs = from_flat(_Needs, ctx.needs_input_grad[2:])
        xc = _cast_if_needed(x2, c, any(need.weight for need in needs))
        dys2 = [None if dy is None else dy.reshape(-1, dy.shape[-1]) for dy in dys]
        dx, grads = _shared_input_bwd(dys2, x2, xc, weights, lows, ctx.lora_dtypes, ctx.settings, needs, need_dx)
        if dx is not None:
            dx = dx.view(x.shape).to(x.dtype)
        return (dx, None, *to_flat(grads))


MLP_CHUNK_BYTES = 128 << 20
"""Bound on the ``[rows, I]`` intermediate (``act(gate) * up`` and its gradient) the MLP forms at a
time when it has no down-projection dropout: the forward and the backward then walk the rows in
chunks, so the only ``[M, I]`` buffers are the saved gate and up (the backward writes their
gradients over them). With dropout on the down projection, the mask is drawn over the whole ``h``
in one call, as PEFT draws it, so ``h`` is formed whole.

The down projection's matmuls run once per chunk, so fewer, larger chunks fill the GPU's waves
better. On an H200 (benchmarks/experiments/INDEX.md#lora_mlp_chunks;
Llama-3.1-8B MLP, 16384 tokens, fp32 adapters, forward+backward GPU time) 128 MiB (4681 rows of
I = 14336) took 17.77 ms against 17.98 ms with 64 MiB, at the same peak memory (1162 MB); the
whole ``h`` at once, 17.75 ms at 1477 MB."""


def _mlp_chunk_rows(gate: torch.Tensor, p_down: float) -> int:
    """Rows of ``h`` formed at a time (all of them with down-projection dropout)."""
    if p_down > 0:
        return gate.shape[0]
    return max(1, MLP_CHUNK_BYTES // max(1, gate.shape[1] * gate.element_size()))


def _down_forward_in_chunks(
    gate: torch.Tensor, up: torch.Tensor, act: str, rows: int, down: _Params, settings: Settings
) -> tuple[torch.Tensor, _LowRank]:
    """The down projection of ``h = act(gate) * up`` (no dropout), ``rows`` rows at a time:
    returns (y, what the backward keeps) as :func:`_proj_fwd` would for the whole ``h``.

    Each chunk writes its rows of the base product into ``y`` and its rows of ``xa`` into one
    ``[M, r]`` buffer (against ``A`` split once, on the ``mm_bf16_fp32`` path); the rank-sized
    ``s xa B^T`` is then added to all rows at once. Per chunk: the activation and two matmuls.
    """
    c = gate.dtype
    y = torch.empty((gate.shape[0], down.weight.shape[0]), dtype=c, device=gate.device)
    xa = torch.empty((gate.shape[0], down.lora_A.shape[0]), dtype=c, device=gate.device)
    A_parts, A_c = lora_a_operands(c, down.lora_A, 0.0, settings.dropout_dtype, c)  # (split once for all chunks)
    weight = dense(down.weight)  # (a 4-bit W dequantized once for all chunks, dropped after them)
    for start in range(0, gate.shape[0], rows):
        part = slice(start, start + rows)
        h = gated_act_forward(gate[part], up[part], act)
        base_out(h, weight, down.bias, out=y[part])
        lora_input_product(h, h, down.lora_A, 0.0, settings.dropout_dtype, A_parts, out=xa[part])
        del h
    del weight
    B_c = down.lora_B.to(c)
    return add_lora_out(y, xa, B_c, down.lora_bias, settings.scaling), _LowRank(xa, None, A_c, B_c)


def _down_backward(
    dy2: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    act: str,
    wd: Any,
    low: _LowRank,
    lora_dtype: torch.dtype,
    settings: Settings,
    need_gu: bool,
    needs: _Needs,
) -> tuple[_Grads, torch.Tensor | None, torch.Tensor | None, bool]:
    """The down projection's backward and the activation's, for the rows of ``dy2``, ``gate`` and
    ``up``: returns (the down projection's parameter gradients, dg, du, written).

    ``need_gu``: whether dg and du are needed; ``needs``: the down projection's flags. The input
    gradient ``dh`` needs no ``h``, so it comes first; fk.glu's gradient pass then forms (dg, du)
    and recomputes ``h = act(gate) * up`` over ``dh``'s buffer, in eager mode with
    the gradients over ``gate``'s and ``up``'s (``written``), and the parameter gradients read that
    ``h``. Without dg and du, ``h`` is recomputed alone.
    """
    gs, dB = lora_b_grads(dy2, low.B_c, low.xa, settings.scaling, lora_dtype, need_gu or needs.lora_A, needs.lora_B)
    dg = du = None
    written = False
    if need_gu:
        assert gs is not None
        dh = _proj_bwd_input(dy2, wd, low.A_c, gs, low.mask, settings.dropout_p)
        dg, du, h, written = gated_act_backward_with_value(dh, gate, up, act, inplace=True)
        del dh  # (its buffer holds h now)
    else:
        h = gated_act_forward(gate, up, act)
    grads = _proj_bwd_params(dy2, h, h, wd, low, lora_dtype, settings, needs, gs, dB)
    return grads, dg, du, written


def _down_backward_in_chunks(
    dy2: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    act: str,
    rows: int,
    wd: Any,
    low: _LowRank,
    lora_dtype: torch.dtype,
    settings: Settings,
    need_gu: bool,
    needs: _Needs,
) -> _Grads:
    """:func:`_down_backward` (no dropout) ``rows`` rows at a time, with (when ``need_gu``)
    (dg, du) of each chunk written over its gate and up rows. Returns the down projection's
    parameter gradients.

    What needs no ``h`` is formed for all rows at once: ``s G`` (:func:`scaled_lora_grad`), and
    db, dB and db_B. Per chunk: ``dh`` (a matmul and an ``addmm_``), fk.glu's gradient pass
    (which leaves ``h`` in ``dh``'s buffer), and one matmul each for dA and dW, accumulated over
    the chunks in fp32 (``fk.core.matmul.accumulate_mm``). A :class:`QuantizedBase` ``Wd`` is
    dequantized once for all chunks (where ``dh`` is needed) and dropped on return.
    """
    gs, dB = lora_b_grads(dy2, low.B_c, low.xa, settings.scaling, lora_dtype, need_gu or needs.lora_A, needs.lora_B)
    wd_dense = dense(wd) if need_gu else wd
    grads = _proj_bwd_params(
        dy2, None, None, wd, low, lora_dtype, settings, needs._replace(weight=False, lora_A=False), gs, dB
    )
    n_inter = gate.shape[1]
    acc_dA = torch.empty((low.A_c.shape[0], n_inter), dtype=torch.float32, device=gate.device) if needs.lora_A else None
    acc_dW = torch.empty((wd.shape[0], n_inter), dtype=torch.float32, device=gate.device) if needs.weight else None
    for start in range(0, gate.shape[0], rows):
        part = slice(start, start + rows)
        if need_gu:
            assert gs is not None
            dh = _proj_bwd_input(dy2[part], wd_dense, low.A_c, gs[part], None, 0.0)  # dy Wd + s G Ad
            dg, du, h, written = gated_act_backward_with_value(dh, gate[part], up[part], act, inplace=True)
            del dh  # (its buffer holds h now)
            if not written:
                gate[part] = dg
                up[part] = du
            del dg, du
        else:
            h = gated_act_forward(gate[part], up[part], act)
        if acc_dA is not None:
            assert gs is not None
            accumulate_mm(acc_dA, gs[part].t(), h, first=start == 0)  # dA += (s G)^T h
        if acc_dW is not None:
            accumulate_mm(acc_dW, dy2[part].t(), h, first=start == 0)  # dW += dy^T h
        del h
    if acc_dW is not None:
        grads = grads._replace(weight=acc_dW.to(wd.dtype))
    if acc_dA is not None:
        grads = grads._replace(lora_A=acc_dA.to(lora_dtype))
    return grads


class _LoRAMLP(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))`` with three LoRA projections; ``act`` is fk.glu's kernel.

    ``act`` is the fk.glu activation; ``settings`` the :class:`Settings` of gate, up and down;
    ``flat`` their :class:`_Params` (:func:`to_flat`).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, act: str, settings: tuple[Settings, ...], *flat: Any) -> Any:
        params_g, params_u, params_d = from_flat(_Params, flat)
        settings_d = settings[2]
        x2 = x.reshape(-1, x.shape[-1])
        c = params_g.weight.dtype
        xc = x2 if x2.dtype == c else x2.to(c)
        (gate, up), (low_g, low_u) = _outputs_and_lows(x2, xc, [params_g, params_u], settings[:2])
        del xc
        rows = _mlp_chunk_rows(gate, settings_d.dropout_p)
        int8_down = isinstance(params_d.weight, QuantizedBase) and params_d.weight.product is not None
        if rows >= gate.shape[0] or int8_down:  # (an int8 base's outlier columns are found over all rows)
            h = gated_act_forward(gate, up, act)
            y, low_d = _proj_fwd(h, h, params_d, settings_d)
            del h  # recomputed in the backward
        else:  # h a chunk of rows at a time: never [M, I] at once
            y, low_d = _down_forward_in_chunks(gate, up, act, rows, params_d, settings_d)
        weights, ctx.quantized = weights_to_save([params_g.weight, params_u.weight, params_d.weight])
        ctx.save_for_backward(x, gate, up, *weights, *to_flat([low_g, low_u, low_d]))
        ctx.act, ctx.settings = act, settings
        ctx.lora_dtypes = (params_g.lora_A.dtype, params_u.lora_A.dtype, params_d.lora_A.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @backward_without_autocast
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        act, settings_d = ctx.act, ctx.settings[2]
        x, gate, up, *saved = ctx.saved_tensors
        # (4-bit bases: dequantized again where dx = dy W needs them, one at a time, and dropped)
        wg, wu, wd = saved_weights(saved[:3], ctx.quantized)
        low_g, low_u, low_d = from_flat(_LowRank, saved[3:])
        ld_g, ld_u, ld_d = ctx.lora_dtypes
        need_dx = ctx.needs_input_grad[0]
        needs_g, needs_u, needs_d = from_flat(_Needs, ctx.needs_input_grad[3:])
        need_gu = need_dx or any(needs_g) or any(needs_u)
        dy2 = dy.reshape(-1, dy.shape[-1])
        rows = _mlp_chunk_rows(gate, settings_d.dropout_p)
        chunked = rows < gate.shape[0] and uses_kernel(gate) and not torch.compiler.is_compiling()
        if chunked:  # eager: (dg, du) of each chunk of rows written over its gate and up rows
            grads_d = _down_backward_in_chunks(dy2, gate, up, act, rows, wd, low_d, ld_d, settings_d, need_gu, needs_d)
            dg, du, written = (gate, up, True) if need_gu else (None, None, False)
        else:
            grads_d, dg, du, written = _down_backward(dy2, gate, up, act, wd, low_d, ld_d, settings_d, need_gu, needs_d)
        grads_g = grads_u = _Grads()
        dx = None
        if dg is not None and du is not None:
            if written:  # the gradients overwrote gate and up: a second backward must fail loudly
                torch.autograd.graph.increment_version(gate)
                torch.autograd.graph.increment_version(up)
            x2 = x.reshape(-1, x.shape[-1])
            xc = _cast_if_needed(x2, wg.dtype, needs_g.weight or needs_u.weight)
            dx, (grads_g, grads_u) = _shared_input_bwd(
                [dg, du], x2, xc, [wg, wu], [low_g, low_u], [ld_g, ld_u],
                ctx.settings[:2], [needs_g, needs_u], need_dx,
            )  # fmt: skip
        if dx is not None:
            dx = dx.view(x.shape).to(x.dtype)
        return (dx, None, None, *to_flat([grads_g, grads_u, grads_d]))


# --- 3. Functional API ----------------------------------------------------------------------------


def _resolve_mlp_activation(activation: str) -> str:
    if isinstance(activation, str) and activation in MLP_ACTIVATIONS:
        return MLP_ACTIVATIONS[activation]
    return resolve_activation(activation)


def _check_scalar(name: str, value: object, *, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and not value < high:
        raise ValueError(f"{name} must be < {high}, got {value}")
    return value


def _check_optional_vector(name: str, t: object, n: int, like_name: str, like: torch.Tensor) -> None:
    if t is None:
        return
    validate.check_tensor(name, t)
    assert isinstance(t, torch.Tensor)
    validate.check_same_dtype(name, t, like_name, like)
    validate.check_same_device(name, t, like_name, like)
    validate.check_shape(name, t, (n,))


def _check_parts(
    prefix: str, x: torch.Tensor, parts: object, cast: torch.dtype | None = None
) -> tuple[Settings, _Params, torch.Tensor | None]:
    """Validate one projection's parameters against ``x``; returns (its settings, its tensors, its
    DoRA magnitude or None). ``cast``: autocast's dtype, which the base weight need not have; the
    tensors are returned cast to it (None: outside autocast, the base weight must have ``x``'s
    dtype)."""
    if not isinstance(parts, tuple) or len(parts) not in (5, 6, 7, 8):
        raise TypeError(f"{prefix or 'parts'} must be a LoRAWeights (or a tuple of its 5 to 8 fields), got {type(parts).__name__}")  # fmt: skip
    weight, bias, lora_A, lora_B, scaling, *rest = parts
    dropout_p = rest[0] if rest else 0.0
    lora_bias = rest[1] if len(rest) > 1 else None
    magnitude = rest[2] if len(rest) > 2 else None
    names = [f"{prefix}{n}" for n in ("weight", "bias", "lora_A", "lora_B", "scaling", "dropout_p", "lora_bias", "magnitude")]  # fmt: skip
    if isinstance(weight, (QuantizedWeight, Int8Base)):
        weight = _quantized_base(names[0], x, weight, cast)
    tensors = ((names[2], lora_A), (names[3], lora_B))
    for name, t in tensors if isinstance(weight, QuantizedBase) else ((names[0], weight), *tensors):
        validate.check_tensor(name, t)
        validate.check_dtype(name, t)
        validate.check_same_device(name, t, "x", x)
        validate.check_ndim(name, t, 2)
    if cast is None and isinstance(weight, torch.Tensor):
        validate.check_same_dtype(names[0], weight, "x", x)
    validate.check_same_dtype(names[3], lora_B, names[2], lora_A)
    n_out, k = weight.shape
    r = lora_A.shape[0]
    if isinstance(weight, torch.Tensor):
        validate.check_shape(names[0], weight, (n_out, x.shape[-1]))
    validate.check_shape(names[2], lora_A, (r, k))
    validate.check_shape(names[3], lora_B, (n_out, r))
    _check_optional_vector(names[1], bias, n_out, names[0], weight if isinstance(weight, torch.Tensor) else x)
    _check_optional_vector(names[6], lora_bias, n_out, names[3], lora_B)
    scaling = _check_scalar(names[4], scaling)
    dropout_p = _check_scalar(names[5], dropout_p, low=0.0, high=1.0)
    if magnitude is not None:
        validate.check_tensor(names[7], magnitude)
        assert isinstance(magnitude, torch.Tensor)
        validate.check_dtype(names[7], magnitude)
        validate.check_same_device(names[7], magnitude, "x", x)
        validate.check_shape(names[7], magnitude, (n_out,))
        _check_dora_combination(prefix, lora_bias is not None)
    params = _Params(weight, bias, lora_A, lora_B, lora_bias)
    return Settings(scaling, dropout_p, lora_A.dtype), _cast_params(params, cast), magnitude


def _quantized_base(
    name: str, x: torch.Tensor, q: QuantizedWeight | Int8Base, cast: torch.dtype | None
) -> QuantizedBase:
    """A 4-bit base weight, or an int8 base layer, checked against ``x``, for the compute dtype ``c``:
    autocast's, else ``x``'s (int8: ``x``'s, outside autocast only)."""
    int8 = isinstance(q, Int8Base)
    weight = q.weight if isinstance(q, Int8Base) else q
    if not int8 and weight.quant_type not in ("nf4", "fp4"):
        raise ValueError(
            f"{name} is a {weight.quant_type} QuantizedWeight; fk.lora fuses 4-bit (nf4, fp4) weights, "
            "and int8 bases as an Int8Base (the weight with its layer's product)"
        )
    if int8 and cast is not None:
        raise ValueError(f"{name} is an Int8Base: int8 bases are fused outside torch.autocast only")
    validate.check_same_device(f"{name}.data", weight.data, "x", x)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{name} takes {weight.shape[1]} input features, got x of shape {tuple(x.shape)}")
    return QuantizedBase(q, cast if cast is not None else x.dtype)


def _check_dora_combination(prefix: str, has_lora_bias: bool) -> None:
    """DoRA (a magnitude) is fused without ``lora_bias`` (PEFT refuses the two together)."""
    if has_lora_bias:
        raise ValueError(f"{prefix}magnitude (DoRA) cannot be combined with {prefix}lora_bias (PEFT refuses them together too)")  # fmt: skip


def _cast_params(params: _Params, cast: torch.dtype | None) -> _Params:
    """``params`` cast to autocast's dtype ``cast`` (None: as they are), as autocast casts each
    ``F.linear``'s operands (autograd sees the casts)."""
    if cast is None:
        return params
    quantized = isinstance(params.weight, QuantizedBase)  # (dequantized to autocast's dtype)
    return _Params._make(t if t is None or t.dtype == cast or (quantized and i == 0) else t.to(cast) for i, t in enumerate(params))  # fmt: skip


def _module_parts(
    prefix: str, x: torch.Tensor, parts: LoRAWeights, cast: torch.dtype | None = None
) -> tuple[Settings, _Params, torch.Tensor | None]:
    """:func:`_check_parts` for parameters that ``fk.lora.patch``'s forwards read from a PEFT
    ``lora.Linear`` (``fk.lora.patching._call_parts``, which checked their kinds and float dtypes
    and PEFT's scaling and dropout): only the input's width against the weight is checked here,
    the one mistake a caller of a patched module can make. (The full checks took 7 us a projection
    against 0.7 us, each call, on the 2-core CPU machine this project tests on:
    ``benchmarks/experiments/INDEX.md#lora_checks_probe``.)"""
    if x.shape[-1] != parts[0].shape[1]:
        raise ValueError(f"{prefix}weight takes {parts[0].shape[1]} input features, got x of shape {tuple(x.shape)}")
    return _module_params(parts, cast, cast if cast is not None else x.dtype)


def _module_params(
    parts: LoRAWeights, cast: torch.dtype | None, compute: torch.dtype
) -> tuple[Settings, _Params, torch.Tensor | None]:
    """The settings, tensors and DoRA magnitude of :func:`_module_parts`, without the width check;
    a 4-bit base (a ``Linear4bit``'s, read by the patcher) is dequantized to ``compute``."""
    weight, bias, lora_A, lora_B, scaling, dropout_p, lora_bias, magnitude = parts
    base = QuantizedBase(weight, compute) if isinstance(weight, (QuantizedWeight, Int8Base)) else weight
    params = _Params(base, bias, lora_A, lora_B, lora_bias)
    return Settings(scaling, dropout_p, lora_A.dtype), _cast_params(params, cast), magnitude


def _apply(fn: Any, x: torch.Tensor, *args: Any) -> Any:
    """``fn.apply(x, *args)`` with autocast disabled (the operands are already cast)."""
    with autocast_off(x.device.type):
        return fn.apply(x, *args)


def _check_x(x: object) -> torch.Tensor:
    validate.check_tensor("x", x)
    assert isinstance(x, torch.Tensor)
    validate.check_dtype("x", x)
    validate.check_min_ndim("x", x, 1)
    return x


def lora_linear(
    x: torch.Tensor,
    base_weight: torch.Tensor | QuantizedWeight | Int8Base,
    base_bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    dropout_p: float = 0.0,
    lora_bias: torch.Tensor | None = None,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """A LoRA linear layer, as PEFT's ``lora.Linear`` with one adapter, with the base matmul and the
    low-rank branch sharing one output buffer (see the module docstring).

    Args:
        x: ``(..., K)``, fp32/fp16/bf16.
        base_weight: ``[N, K]``, dtype of ``x`` (any float dtype under autocast); no gradient,
            buffer or FLOP is spent on it when it does not require grad (the usual frozen base).
            Or a 4-bit (NF4/FP4) :class:`fk.lora.quant.QuantizedWeight` (QLoRA; see :class:`LoRAWeights`),
            or a bitsandbytes LLM.int8() layer as an :class:`fk.lora.quant.Int8Base` (outside autocast).
        base_bias: ``[N]`` or None, dtype of ``base_weight``; frozen or trainable. With an
            ``Int8Base``: the layer's own bias, in ``x``'s dtype (its product adds it).
        lora_A: ``[r, K]``; ``lora_B``: ``[N, r]``, both of one float dtype (may differ from ``x``'s).
        scaling: ``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA).
        dropout_p: LoRA dropout in ``[0, 1)``, applied to the LoRA branch's input only; the mask is
            drawn from the global generator as PEFT's ``nn.Dropout`` draws it. Pass 0 in eval mode.
        lora_bias: ``[N]`` or None, dtype of ``lora_B``: ``lora_B``'s bias (PEFT ``lora_bias=True``).
        magnitude: ``[N]`` or None: DoRA's magnitude vector (PEFT ``use_dora=True``), any float
            dtype; the output is then PEFT's DoRA output (see :func:`lora_linear_ref` and the DoRA
            equations above the DoRA launchers). Not with ``lora_bias``.

    Returns ``(..., N)`` in ``x``'s dtype, or in autocast's dtype under autocast (then
    ``base_weight`` may have any float dtype; see the module docstring).
    """
    x = _check_x(x)
    cast = _autocast_dtype(x)
    checked = _check_parts("", x, (base_weight, base_bias, lora_A, lora_B, scaling, dropout_p, lora_bias, magnitude), cast)  # fmt: skip
    (y,) = _projections(x, [checked])
    return y


def _projections(x: torch.Tensor, checked: Sequence[tuple[Settings, _Params, torch.Tensor | None]]) -> Any:
    """The outputs of the projections of ``x`` that :func:`_check_parts` (or :func:`_module_parts`)
    returned: plain LoRA's function, or DoRA's where every projection has a magnitude."""
    settings = tuple(part[0] for part in checked)
    magnitudes = [part[2] for part in checked]
    if all(m is None for m in magnitudes):
        return _apply(_LoRAProjections, x, settings, *to_flat([part[1] for part in checked]))
    present = [m for m in magnitudes if m is not None]
    if len(present) < len(magnitudes):
        raise ValueError("either every projection of one input has a magnitude (DoRA) or none has")
    params = [
        DoRAParams(part[1].weight, part[1].bias, part[1].lora_A, part[1].lora_B, magnitude)
        for part, magnitude in zip(checked, present, strict=True)
    ]
    return _apply(DoRAProjections, _in_compute_dtype(x, params[0].weight), settings, *to_flat(params))


def _in_compute_dtype(x: torch.Tensor, weight: torch.Tensor | QuantizedBase) -> torch.Tensor:
    """``x`` in the base weight's dtype, which DoRA's launchers take it in (cast under autocast only:
    outside it the checks made the two agree); autograd carries ``dx`` back through the cast."""
    return x if x.dtype == weight.dtype else x.to(weight.dtype)


lora_o = lora_linear
"""The attention output projection: :func:`lora_linear` (its input is not shared with another projection)."""


def lora_projections(x: torch.Tensor, *parts: LoRAWeights) -> tuple[torch.Tensor, ...]:
    """Several LoRA projections of one input ``x`` (one per :class:`LoRAWeights`), with one ``dx``
    accumulation in the backward. Dropout masks are drawn in the order of ``parts``."""
    return module_projections(x, parts, from_module=False)


def module_projections(x: torch.Tensor, parts: Sequence[LoRAWeights], *, from_module: bool) -> tuple[torch.Tensor, ...]:
    """:func:`lora_projections`; ``from_module``: ``parts`` were read from PEFT modules by
    ``fk.lora.patch``'s forwards, which checked them (:func:`_module_parts`)."""
    x = _check_x(x)
    if not parts:
        raise ValueError("lora_projections needs at least one LoRAWeights")
    cast = _autocast_dtype(x)
    check = _module_parts if from_module else _check_parts
    checked = [check("" if from_module else f"parts[{i}].", x, part, cast) for i, part in enumerate(parts)]
    return tuple(_projections(x, checked))


def lora_qkv(
    x: torch.Tensor, q_parts: LoRAWeights, k_parts: LoRAWeights, v_parts: LoRAWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_proj(x), k_proj(x), v_proj(x))`` for three LoRA projections of one input.

    One forward call, one ``dx`` in the backward (``dq Wq + dk Wk + dv Wv`` plus the LoRA terms,
    accumulated into one buffer). Dropout masks are drawn in the order q, k, v, as PEFT's
    attention forward calls the three modules.
    """
    x = _check_x(x)
    cast = _autocast_dtype(x)
    parts = (("q_parts", q_parts), ("k_parts", k_parts), ("v_parts", v_parts))
    q, k, v = _projections(x, [_check_parts(f"{name}.", x, part, cast) for name, part in parts])
    return q, k, v


def lora_mlp(
    x: torch.Tensor,
    gate_parts: LoRAWeights,
    up_parts: LoRAWeights,
    down_parts: LoRAWeights,
    activation: str = "swiglu",
) -> torch.Tensor:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with three LoRA projections (LlamaMLP / GemmaMLP).

    ``activation`` is ``"swiglu"`` (SiLU) or ``"geglu"`` (tanh GELU), or a Hugging Face
    ``hidden_act`` name (``"silu"``, ``"gelu_pytorch_tanh"``, ``"gelu"``, ...). The gated activation
    runs in fk.glu's Triton kernel; its output is not kept for the backward but recomputed from
    the gate and up projections. Dropout masks are drawn in the order gate, up, down.

    DoRA: a ``magnitude`` on gate and up (both or neither), and/or on down; the MLP is then
    composed of DoRA's launchers and :func:`fk.glu.gated_act` (see :func:`module_mlp`).

    QLoRA: any of the three base weights may be a 4-bit :class:`fk.lora.quant.QuantizedWeight`
    (plain LoRA or DoRA), dequantized where a matmul needs it, one projection's at a time, never saved, or
    an int8 :class:`fk.lora.quant.Int8Base` (plain LoRA, outside autocast; an int8 down projection
    takes all rows at once).
    """
    return module_mlp(x, gate_parts, up_parts, down_parts, activation, from_module=False)


def module_mlp(
    x: torch.Tensor,
    gate_parts: LoRAWeights,
    up_parts: LoRAWeights,
    down_parts: LoRAWeights,
    activation: str,
    *,
    from_module: bool,
) -> torch.Tensor:
    """:func:`lora_mlp`; ``from_module`` as in :func:`module_projections`.

    With DoRA on all three projections, :class:`DoRAMLP` (``act(gate) * up`` recomputed in the
    backward). With DoRA on some only (gate and up both or neither), the MLP is composed of the
    projections' launchers (gate and up as projections of one input: one ``dx``), fk.glu's
    :func:`fk.glu.gated_act` and the down projection: ``act(gate) * up`` is then kept."""
    x = _check_x(x)
    act = _resolve_mlp_activation(activation)
    cast = _autocast_dtype(x)
    check = _module_parts if from_module else _check_parts
    settings_g, params_g, magnitude_g = check("gate_parts.", x, gate_parts, cast)
    settings_u, params_u, magnitude_u = check("up_parts.", x, up_parts, cast)
    n_inter = params_g.weight.shape[0]
    if params_u.weight.shape[0] != n_inter:
        raise ValueError(f"up_parts.weight must have {n_inter} rows (gate_parts.weight's), got shape {tuple(params_u.weight.shape)}")  # fmt: skip
    if from_module:  # the intermediate's width is all there is to check: no tensor stands in for it
        if down_parts[0].shape[1] != n_inter:
            raise ValueError(f"down_parts.weight takes {down_parts[0].shape[1]} input features, gate_parts.weight gives {n_inter}")  # fmt: skip
        settings_d, params_d, magnitude_d = _module_params(down_parts, cast, params_g.weight.dtype)
    else:
        h_like = x.new_empty((1, n_inter), dtype=params_g.weight.dtype) if x.ndim else x
        settings_d, params_d, magnitude_d = _check_parts("down_parts.", h_like, down_parts, cast)
    magnitudes = [magnitude_g, magnitude_u, magnitude_d]
    if all(m is not None for m in magnitudes):
        dora = [DoRAParams(p.weight, p.bias, p.lora_A, p.lora_B, m) for p, m in zip((params_g, params_u, params_d), magnitudes, strict=True)]  # type: ignore[arg-type]  # fmt: skip
        return _apply(DoRAMLP, _in_compute_dtype(x, params_g.weight), act, (settings_g, settings_u, settings_d), *to_flat(dora))  # fmt: skip
    if any(m is not None for m in magnitudes):  # DoRA on some of them: composed, h kept
        gate_up = [(settings_g, params_g, magnitude_g), (settings_u, params_u, magnitude_u)]
        gate, up = _projections(x, gate_up)
        h = gated_act(gate, up, act, inplace_grad=True)
        (y,) = _projections(h, [(settings_d, params_d, magnitude_d)])
        return y
    params = to_flat([params_g, params_u, params_d])
    return _apply(_LoRAMLP, x, act, (settings_g, settings_u, settings_d), *params)
