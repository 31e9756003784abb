"""A quantized base weight where the launchers take a base weight: :class:`QuantizedBase`, and the
helpers that dequantize it where a matmul needs it (:func:`dense`; small ones that share an input
together, :func:`dequantized_together`) and keep only its packed data between forward and backward
(:func:`weights_to_save`, :func:`saved_weights`).

Plain LoRA's launchers (:mod:`fk.lora.lora`) and DoRA's (:mod:`fk.lora.dora`) both take one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fk.lora.quant import Int8Base, QuantizedWeight, dequantize, dequantize_together

# The projections of one input whose 4-bit weights hold at most this many elements together are
# dequantized by one launch, all before the first matmul; more, one at a time, so their transient
# stays one weight. 1 << 25: q, k and v of Llama-3.1-8B (25.2M) together, 21.1 us against 30.0 for
# three launches; gate and up (117M, long launches already) apart (INDEX.md#qlora_dequant_pairs).
# In bench_lora --qlora's QKV at 4096 tokens: 19.5 us a launch, 16 MB more peak (INDEX.md#qlora_dequant_fused).
TOGETHER_MAX_ELEMENTS = 1 << 25


class QuantizedBase:
    """A 4-bit base weight (:class:`fk.lora.quant.QuantizedWeight`) in the weight slot of a
    projection's parameters, with the compute dtype ``c`` it is dequantized to; or an int8 one with its
    layer's ``product`` (:class:`fk.lora.quant.Int8Base`), which gives the forward's base output,
    while ``W`` is dequantized for the backward's ``dx`` only.

    It is not a tensor, so autograd passes it through ``apply`` untouched (no gradient: the base
    is frozen) and the autograd functions keep it on ``ctx`` rather than saving a tensor
    (:func:`weights_to_save`): only the packed data stays alive between forward and backward. The
    forward dequantizes ``W`` for the base matmul (DoRA: and its norm) into a temporary it drops
    before the next projection's; the backward dequantizes it again for ``dx = dy W`` (the MLP's
    down projection: ``dh = dy Wd``), and drops it before the next projection's. So at most one
    projection's ``W`` is dequantized at a time. (Dequantizing in the wrapper, before ``apply``,
    would have autograd save the full-precision ``W``: what QLoRA exists to avoid.) The exception,
    where :data:`TOGETHER_MAX_ELEMENTS` allows it: small weights of projections
    that share an input (q, k and v) dequantized together, by one launch, before the first of their
    matmuls (:func:`dequantized_together`). ``shape`` and
    ``dtype`` stand in for the tensor's where the launchers read them.

    Each matmul with ``W`` is cuBLAS's, on the whole ``[N, K]`` matrix dequantized into a temporary
    (:meth:`dense`), as bitsandbytes 0.50's ``MatMul4Bit`` does in its backward
    (``dequantize_4bit(...).to(dtype)`` then a matmul). A GEMM dequantizing ``W`` tile by tile inside
    its loop (no temporary) was slower than this at every size measured, and was removed
    (``benchmarks/experiments/INDEX.md#tune_qlora_matmul``).
    """

    __slots__ = ("dtype", "product", "q", "shape")

    def __init__(self, q: QuantizedWeight | Int8Base, dtype: torch.dtype) -> None:
        self.product = q.product if isinstance(q, Int8Base) else None
        self.q = q.weight if isinstance(q, Int8Base) else q
        self.dtype, self.shape = dtype, torch.Size(self.q.shape)

    def layer_output(self, xc: torch.Tensor) -> torch.Tensor:
        """An int8 base's own product of ``xc`` ``[M, K]`` (its layer's output, bias included), checked:
        ``[M, N]`` in ``xc``'s dtype, else a ``ValueError``."""
        assert self.product is not None, "a 4-bit base has no product of its own"
        y = self.product(xc)
        want = (xc.shape[0], self.shape[0])
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != want or y.dtype != xc.dtype:
            got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"the int8 base's product must return {want} in {xc.dtype}, got {got}")
        return y

    def dense(self, own_dtype: bool = False) -> torch.Tensor:
        """``W`` in ``c``. 4-bit: dequantized to bitsandbytes' own dtype (``QuantState.dtype``),
        then cast, as bitsandbytes' 4-bit matmul does (``dequantize_4bit(...).to(A.dtype)``); with
        ``own_dtype``, not cast (PEFT's ``dequantize_module_weight``, which DoRA's norm starts from).
        int8: dequantized to ``c`` directly (one rounding), as bitsandbytes' int8 backward forms it."""
        if self.product is not None:
            return dequantize(self.q, dtype=self.dtype)
        w = dequantize(self.q)
        return w if own_dtype or w.dtype == self.dtype else w.to(self.dtype)


def dense(weight: Any) -> torch.Tensor:
    """The base weight as a tensor in ``c`` (a :class:`QuantizedBase` dequantized whole). Callers pass
    the result straight on to the matmuls that need it, so a dequantized weight lives no longer than
    those (and one projection's at a time)."""
    return weight.dense() if isinstance(weight, QuantizedBase) else weight


def dequantized_together(weights: Sequence[Any]) -> list[Any]:
    """``weights`` (the base weights of projections that share an input), with the 4-bit
    :class:`QuantizedBase` ones replaced by their dense ``W`` (as :meth:`QuantizedBase.dense` gives
    it) when there are two or more holding at most :data:`TOGETHER_MAX_ELEMENTS` elements together:
    one launch (:func:`fk.lora.quant.dequantize_together`). Otherwise ``weights`` unchanged, each to
    be dequantized by :func:`dense` at its matmul. Callers drop each dense ``W`` after its matmul."""
    four_bit = [i for i, w in enumerate(weights) if isinstance(w, QuantizedBase) and w.product is None]
    if len(four_bit) < 2 or sum(weights[i].shape.numel() for i in four_bit) > TOGETHER_MAX_ELEMENTS:
        return list(weights)
    out = list(weights)
    dense_ws = dequantize_together([weights[i].q for i in four_bit])
    for i, w in zip(four_bit, dense_ws, strict=True):
        out[i] = w if w.dtype == weights[i].dtype else w.to(weights[i].dtype)
    return out


def weights_to_save(weights: Sequence[Any]) -> tuple[list[torch.Tensor | None], list[QuantizedBase | None]]:
    """(the base weights an autograd function saves, None for a quantized one; the quantized ones,
    which it keeps on ``ctx`` instead: their packed data only, never a dequantized ``W``)."""
    quantized = [w if isinstance(w, QuantizedBase) else None for w in weights]
    return [None if q is not None else w for q, w in zip(quantized, weights, strict=True)], quantized


def saved_weights(saved: Sequence[torch.Tensor | None], quantized: Sequence[QuantizedBase | None]) -> list[Any]:
    """:func:`weights_to_save` undone in the backward: each base weight, or its :class:`QuantizedBase`."""
    return [w if q is None else q for w, q in zip(saved, quantized, strict=True)]
