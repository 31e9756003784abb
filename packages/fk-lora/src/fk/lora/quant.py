"""Dequantizing QLoRA base weights: bitsandbytes' 4-bit (NF4, FP4) and 8-bit (LLM.int8()) formats.

A QLoRA base layer keeps its frozen weight ``W`` ``[N, K]`` quantized. The fused LoRA path needs
``W`` in the compute dtype for one matmul at a time, and drops it after. This module describes such a weight without bitsandbytes' objects
(:class:`QuantizedWeight`, read from them by :func:`from_bnb`), defines its value in plain PyTorch
(:func:`dequantize_ref`), and computes it with a Triton kernel (:func:`dequantize`,
:func:`dequantize_rows`). :func:`quantize_ref` writes the formats, for tests.

The formats, as bitsandbytes stores them (``bitsandbytes.functional.quantize_4bit``, ``QuantState``,
``Int8Params``):

- 4-bit: the weight is flattened row-major (``i = n * K + k``) and cut into blocks of
  ``blocksize`` consecutive elements (a block may span rows; the last one may be short). Element
  ``i`` stores a 4-bit index ``c_i`` into a code book of 16 values in ``[-1, 1]`` (:data:`CODES`),
  two per byte: byte ``i // 2`` holds ``c_i`` in its high nibble when ``i`` is even, in its low
  nibble when ``i`` is odd (an odd count pads the last low nibble). With ``absmax[b]`` the fp32
  scale of block ``b``: ``W_i = code[c_i] * absmax[i // blocksize]``, one fp32 multiply.
- Nested (double) quantization of the absmax (``compress_statistics=True``): ``absmax`` is uint8,
  itself blockwise-quantized with its own 256-value code, fp32 scales and blocksize (bitsandbytes'
  ``state2``), after subtracting the mean ``offset``:
  ``absmax[b] = code2[absmax_q[b]] * absmax2[b // blocksize2] + offset``, rounded to fp32 after
  the product and after the sum (two operations, never one fused multiply-add).
- 8-bit (``Linear8bitLt``'s ``Int8Params``): int8 ``CB`` ``[N, K]`` and the fp32 absmax of each
  row ``SCB`` ``[N]``: ``W[n, k] = (CB[n, k] * SCB[n]) * fp32(1 / 127)``, the order and rounding of
  ``bitsandbytes.functional.int8_vectorwise_dequant``.

Every value is formed in fp32 and rounded once to the output dtype, so the kernel and the
reference agree bit for bit (fp32 output) and after the cast (bf16, fp16).

This file holds, in order: the code books, the weight's description, the references, the
kernels, the launchers and the reading of bitsandbytes' objects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, writable_rows

# ---------------------------------------------------------------------------------------------
# Code books
# ---------------------------------------------------------------------------------------------

NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""NormalFloat4 (QLoRA): quantiles of N(0, 1) scaled to [-1, 1], by index (bitsandbytes'
``get_4bit_type("nf4")``, the constants of its CUDA kernel)."""

FP4_VALUES: tuple[float, ...] = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)
"""bitsandbytes' FP4 (1 sign bit, 2 exponent bits, 1 mantissa bit, exponent bias 2) by the index's
three low bits; bit 3 is the sign. Divided by 12 (the largest) in fp32, as ``get_4bit_type("fp4")``
does, these are the fp32 constants of its CUDA kernel (0, 5.208333333e-03, 0.66666667, 1,
0.33333333, 0.5, 0.16666667, 0.25)."""

QUANT_TYPES = ("nf4", "fp4", "int8")
"""The formats :class:`QuantizedWeight` describes."""

INT8_SCALE = 7.874015718698502e-3
"""``fp32(1 / 127)``, by which bitsandbytes multiplies ``CB * SCB`` (it does not divide by 127)."""
_INT8_SCALE: tl.constexpr = tl.constexpr(INT8_SCALE)


def _code_table(quant_type: str) -> torch.Tensor:
    if quant_type == "nf4":
        return torch.tensor(NF4_CODE, dtype=torch.float32)
    magnitudes = torch.tensor(FP4_VALUES, dtype=torch.float32)
    # -0.0 for index 8 would be the sign bit applied to zero (as the CUDA kernel computes it);
    # bitsandbytes' table has +0.0 there, and so does this one.
    return torch.cat([magnitudes, -magnitudes]).add_(0.0).div_(12.0)


@functools.cache
def code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """The 16-value fp32 code book of ``quant_type`` (``"nf4"`` or ``"fp4"``) on ``device``, cached."""
    validate.check_choice("quant_type", quant_type, ("nf4", "fp4"))
    return _code_table(quant_type).to(device)


# ---------------------------------------------------------------------------------------------
# The weight's description
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class NestedAbsmax:
    """How a 4-bit weight's uint8 ``absmax`` turns into fp32 scales (bitsandbytes' ``state2`` and
    ``offset``): ``absmax[b] = code[absmax_q[b]] * absmax[b // blocksize] + offset``.

    absmax: fp32 ``[ceil(n_blocks / blocksize)]``, the scales of the absmax's own blocks.
    code: fp32 ``[256]``, the 8-bit code book (bitsandbytes' dynamic map).
    blocksize: absmax values per block (bitsandbytes: 256).
    offset: fp32 ``[1]``, the mean subtracted before quantizing (a tensor: reading it as a number
        would wait for the GPU).
    """

    absmax: torch.Tensor
    code: torch.Tensor
    blocksize: int
    offset: torch.Tensor


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A quantized ``[N, K]`` weight as bitsandbytes stores it (see the module's docstring).

    quant_type: ``"nf4"``, ``"fp4"`` or ``"int8"``.
    data: 4-bit: uint8 ``[ceil(N * K / 2)]``, two code indices a byte, high nibble first;
        int8: int8 ``[N, K]`` (``CB``).
    shape: ``(N, K)``, out_features by in_features.
    absmax: 4-bit: ``[ceil(N * K / blocksize)]``, fp32 per block, or uint8 when ``nested``;
        int8: fp32 ``[N]``, the absmax of each row (``SCB``).
    blocksize: 4-bit: elements per block of the flattened weight; int8: 0 (rows are the blocks).
    nested: the absmax's own quantization, or None.
    dtype: the dtype bitsandbytes dequantizes to (``QuantState.dtype``; float16 for int8, which
        ``Int8Params`` quantizes from): the default output dtype.
    """

    quant_type: str
    data: torch.Tensor
    shape: tuple[int, int]
    absmax: torch.Tensor
    blocksize: int = 0
    nested: NestedAbsmax | None = None
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        _check_weight(self)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def n_blocks(self) -> int:
        """Blocks of the flattened weight (4-bit), or rows (int8)."""
        n, k = self.shape
        return n if self.quant_type == "int8" else cdiv(n * k, self.blocksize)


@dataclass(frozen=True, eq=False)
class Int8Base:
    """A bitsandbytes LLM.int8() base layer (``Linear8bitLt`` with ``has_fp16_weights=False``) as the
    fused LoRA functions take it: its int8 weight, and its own product.

    LLM.int8()'s base product quantizes the activations too (row-wise absmax to int8, the columns of
    ``x`` with an ``|x|`` above the layer's ``threshold`` kept apart and multiplied in ``x``'s dtype
    against the dequantized weight columns), and bitsandbytes computes it differently per device and
    mode (0.50: ``MatMul8bitLt`` on CUDA; on CPU in training mode ``MatMul8bitFp``, a dequantization
    then ``F.linear``). The fused functions therefore call ``product`` for the base output, so it is
    bitsandbytes' own, bit for bit, and form everything else themselves: the LoRA branch and, in the
    backward, ``dx = dy W`` from ``weight`` dequantized by :func:`dequantize` to ``x``'s dtype
    (bitsandbytes' backward multiplies ``dy`` by the dequantized weight the same way; see
    :mod:`fk.lora.lora`).

    weight: the int8 :class:`QuantizedWeight` (``CB``, ``SCB``).
    product: ``x2`` ``[M, K]`` -> ``x2 W^T + b`` ``[M, N]`` in ``x2``'s dtype, bias included: the
        ``Linear8bitLt`` itself (:func:`int8_base`). It is called with autograd off, once per forward.
    """

    weight: QuantizedWeight
    product: Callable[[torch.Tensor], torch.Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.weight, QuantizedWeight) or self.weight.quant_type != "int8":
            raise TypeError(f"weight must be an int8 QuantizedWeight, got {self.weight!r}")
        if not callable(self.product):
            raise TypeError(f"product must be callable (the Linear8bitLt layer), got {type(self.product).__name__}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape


def _check_numel(name: str, tensor: torch.Tensor, numel: int, why: str) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements ({why}), got shape {tuple(tensor.shape)}")


def _check_weight(q: QuantizedWeight) -> None:
    validate.check_choice("quant_type", q.quant_type, QUANT_TYPES)
    if not isinstance(q.shape, tuple) or len(q.shape) != 2:
        raise ValueError(f"shape must be a tuple (out_features, in_features), got {q.shape!r}")
    n, k = (validate.check_int(f"shape[{i}]", s, 1) for i, s in enumerate(q.shape))
    validate.check_tensor("data", q.data)
    validate.check_tensor("absmax", q.absmax)
    validate.check_same_device("absmax", q.absmax, "data", q.data)
    if not isinstance(q.dtype, torch.dtype) or q.dtype not in validate.FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, float16, bfloat16, got {q.dtype!r}")
    if q.quant_type == "int8":
        validate.check_dtype("data", q.data, (torch.int8,))
        validate.check_shape("data", q.data, (n, k))
        validate.check_dtype("absmax", q.absmax, (torch.float32,))
        _check_numel("absmax", q.absmax, n, "one scale per row")
        if q.nested is not None:
            raise ValueError("nested must be None for int8 weights (their absmax is not quantized)")
        return
    validate.check_int("blocksize", q.blocksize, 2)
    if q.blocksize & (q.blocksize - 1):
        raise ValueError(f"blocksize must be a power of two (as bitsandbytes' are), got {q.blocksize}")
    validate.check_dtype("data", q.data, (torch.uint8,))
    _check_numel("data", q.data, cdiv(n * k, 2), "two 4-bit codes a byte")
    n_blocks = cdiv(n * k, q.blocksize)
    nested = q.nested
    if nested is None:
        validate.check_dtype("absmax", q.absmax, (torch.float32,))
        _check_numel("absmax", q.absmax, n_blocks, f"one scale per block of {q.blocksize}")
        return
    if not isinstance(nested, NestedAbsmax):
        raise TypeError(f"nested must be a NestedAbsmax or None, got {type(nested).__name__}")
    validate.check_dtype("absmax", q.absmax, (torch.uint8,))
    _check_numel("absmax", q.absmax, n_blocks, f"one code index per block of {q.blocksize}")
    validate.check_int("nested.blocksize", nested.blocksize, 1)
    for name in ("absmax", "code", "offset"):
        value = validate.check_tensor(f"nested.{name}", getattr(nested, name))
        validate.check_dtype(f"nested.{name}", value, (torch.float32,))
        validate.check_same_device(f"nested.{name}", value, "data", q.data)
    _check_numel("nested.absmax", nested.absmax, cdiv(n_blocks, nested.blocksize), "one scale per nested block")
    _check_numel("nested.code", nested.code, 256, "an 8-bit code book")
    _check_numel("nested.offset", nested.offset, 1, "one number")


# ---------------------------------------------------------------------------------------------
# 1. References
# ---------------------------------------------------------------------------------------------


def block_scales_ref(q: QuantizedWeight) -> torch.Tensor:
    """The fp32 scale of each block (4-bit) or row (int8): ``absmax``, or its nested dequantization."""
    nested = q.nested
    if nested is None:
        return q.absmax.reshape(-1)
    index = torch.arange(q.absmax.numel(), device=q.device) // nested.blocksize
    product = nested.code.reshape(-1)[q.absmax.reshape(-1).long()] * nested.absmax.reshape(-1)[index]
    return product + nested.offset.reshape(1)  # (two eager ops: two roundings)


def dequantize_ref(
    q: QuantizedWeight, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rows ``start:stop`` of the weight, ``[stop - start, K]`` in ``dtype`` (default ``q.dtype``),
    from the formats' definitions in plain PyTorch: each value formed in fp32, rounded once."""
    n, k = q.shape
    stop = n if stop is None else stop
    dtype = q.dtype if dtype is None else dtype
    scales = block_scales_ref(q)
    if q.quant_type == "int8":
        rows = q.data[start:stop].float() * scales[start:stop, None]
        return (rows * INT8_SCALE).to(dtype)
    i = torch.arange(start * k, stop * k, device=q.device)
    byte = q.data.reshape(-1)[i // 2]
    index = torch.where(i % 2 == 0, byte >> 4, byte & 0xF).long()
    # (torch.compile traces the table's construction: it warns about a cached function.)
    code = (
        _code_table(q.quant_type).to(q.device) if torch.compiler.is_compiling() else code_table(q.quant_type, q.device)
    )
    values = code[index] * scales[i // q.blocksize]
    return values.reshape(stop - start, k).to(dtype)


def quantize_ref(
    weight: torch.Tensor, quant_type: str, blocksize: int = 64, *, nested: bool = False, nested_blocksize: int = 256
) -> QuantizedWeight:
    """``weight`` ``[N, K]`` quantized from the format's definition (for tests; round to nearest).

    4-bit: per block, ``absmax`` = the largest ``|w|``; each ``w / absmax`` takes the index of the
    nearest code value. ``nested``: the absmax minus its mean, quantized in blocks of
    ``nested_blocksize`` against a linear 256-value code (bitsandbytes uses its dynamic map; the
    dequantizer reads whichever code the weight carries). int8: ``round(w * 127 / absmax_row)``.
    """
    validate.check_tensor("weight", weight)
    validate.check_ndim("weight", weight, 2)
    validate.check_choice("quant_type", quant_type, QUANT_TYPES)
    n, k = weight.shape
    w = weight.detach().float()
    if quant_type == "int8":
        scb = w.abs().amax(dim=1)
        cb = torch.round(w * (127.0 / scb[:, None])).to(torch.int8)
        return QuantizedWeight("int8", cb, (n, k), scb, dtype=weight.dtype)
    validate.check_int("blocksize", blocksize, 1)
    flat = w.reshape(-1)
    absmax = _blockwise_absmax(flat, blocksize)
    scaled = flat / absmax.clamp(min=1e-38).repeat_interleave(blocksize)[: flat.numel()]
    code = code_table(quant_type, w.device)
    index = (scaled[:, None] - code[None, :]).abs().argmin(dim=1).to(torch.uint8)
    if index.numel() % 2:
        index = torch.cat([index, index.new_zeros(1)])
    data = (index[0::2] << 4) | index[1::2]
    if not nested:
        return QuantizedWeight(quant_type, data, (n, k), absmax, blocksize, dtype=weight.dtype)
    offset = absmax.mean().reshape(1)
    centered = absmax - offset
    absmax2 = _blockwise_absmax(centered, nested_blocksize)
    code2 = torch.linspace(-1.0, 1.0, 256, device=w.device)
    scaled2 = centered / absmax2.clamp(min=1e-38).repeat_interleave(nested_blocksize)[: centered.numel()]
    absmax_q = (scaled2[:, None] - code2[None, :]).abs().argmin(dim=1).to(torch.uint8)
    state2 = NestedAbsmax(absmax2, code2, nested_blocksize, offset)
    return QuantizedWeight(quant_type, data, (n, k), absmax_q, blocksize, state2, weight.dtype)


def _blockwise_absmax(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % blocksize))
    return padded.reshape(-1, blocksize).abs().amax(dim=1)


# ---------------------------------------------------------------------------------------------
# 2. Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dequantize_4bit_tile(
    out_ptr,  # [n_out] contiguous: W's flattened elements first:first + n_out (PAIRS: as int32 words)
    data_ptr,  # [ceil(N * K / 2)] uint8: the code index of element i in byte i // 2, high nibble if i is even
    code_ptr,  # [16] fp32: the code book (NF4 or FP4)
    absmax_ptr,  # [n_blocks]: fp32 scale per block, or (NESTED) uint8 index into code2
    code2_ptr,  # [256] fp32 (NESTED): the absmax's code book
    absmax2_ptr,  # [ceil(n_blocks / BLOCKSIZE2)] fp32 (NESTED): the absmax's block scales
    offset_ptr,  # [1] fp32 (NESTED): added to the dequantized absmax
    first,
    n_out,
    n_bytes,  # data_ptr's length: the loads' bound
    tile,  # which tile of RUNS * RUN elements (from first's run on) this program writes
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    RUNS: tl.constexpr,
    RUN: tl.constexpr,
    PAIRS: tl.constexpr,  # write each byte's two values as one 32-bit word (first and n_out even)
    BF16: tl.constexpr,  # (PAIRS) the 16-bit output is bfloat16 (else float16)
):
    # A program writes RUNS runs of RUN consecutive elements of the flattened W. Runs are aligned to
    # RUN, a power of two that divides BLOCKSIZE: each starts on a byte and lies in one block, so a
    # run has one scale and its bytes are loaded once (RUN // 2 of them, contiguous). Byte j of a run
    # holds elements 2j (high nibble) and 2j + 1 (low). Without PAIRS the two halves are interleaved
    # back for one contiguous store (tl.interleave: a shuffle between lanes); with PAIRS each byte's
    # two 16-bit values are stored as one little-endian word (the even element in the low half), as
    # contiguous as the bytes were and with no shuffle (INDEX.md#qlora_dequant_pairs).
    # Offsets inside the tile are int32; the tile's start is a scalar (int64 for large weights).
    # Every mask compares the offsets with bounds whose divisibility Triton can see (no "+ 1"
    # rounding up), so loads and stores stay vectorized (a byte bound (first + n_out + 1) // 2 made
    # both scalar: INDEX.md#qlora_dequant_fused). The loads take the tile's bytes up to the end of
    # data_ptr; bytes outside first:first + n_out are decoded and not stored.
    tile_byte = (first // RUN + tile * RUNS) * (RUN // 2)  # the tile's first byte
    tile_start = tile_byte * 2  # flat index of the tile's first element
    runs = tl.arange(0, RUNS)
    bytes_in_tile = runs[:, None] * (RUN // 2) + tl.arange(0, RUN // 2)[None, :]
    byte = tl.load(data_ptr + tile_byte + bytes_in_tile, mask=bytes_in_tile < n_bytes - tile_byte, other=0).to(tl.int32)
    block = (tile_start + runs.to(tl.int64) * RUN) // BLOCKSIZE  # [RUNS]: each run's block
    block_ok = block * BLOCKSIZE < first + n_out
    if NESTED:
        absmax_q = tl.load(absmax_ptr + block, mask=block_ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + absmax_q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=block_ok, other=0.0)
        scale = scale + tl.load(offset_ptr)  # rounded apart from the product: launched without fp fusion
    else:
        scale = tl.load(absmax_ptr + block, mask=block_ok, other=0.0)
    even = tl.load(code_ptr + (byte >> 4)) * scale[:, None]  # 16 values: from L1
    odd = tl.load(code_ptr + (byte & 0xF)) * scale[:, None]
    if PAIRS:  # (tile_start and first are even: words start on elements 2j, as bytes do)
        if BF16:
            even_half = even.to(tl.bfloat16, fp_downcast_rounding="rtne")
            odd_half = odd.to(tl.bfloat16, fp_downcast_rounding="rtne")
        else:
            even_half = even.to(tl.float16, fp_downcast_rounding="rtne")
            odd_half = odd.to(tl.float16, fp_downcast_rounding="rtne")
        low = even_half.to(tl.uint16, bitcast=True).to(tl.uint32)
        high = odd_half.to(tl.uint16, bitcast=True).to(tl.uint32)
        word = (low | (high << 16)).to(tl.int32, bitcast=True)
        word_lo = first // 2 - tile_byte  # the words of elements first:first + n_out, from the tile's first
        word_hi = tl.minimum((first + n_out) // 2 - tile_byte, RUNS * RUN // 2)
        tl.store(
            out_ptr + tile_byte - first // 2 + bytes_in_tile,
            word,
            mask=(bytes_in_tile >= word_lo) & (bytes_in_tile < word_hi),
        )
    else:
        out = tl.interleave(even, odd)  # [RUNS, RUN]: element 2j from byte j's high nibble, 2j + 1 from its low
        in_tile = runs[:, None] * RUN + tl.arange(0, RUN)[None, :]
        lo = first - tile_start
        hi = tl.minimum(first + n_out - tile_start, RUNS * RUN)
        tl.store(
            out_ptr + (tile_start - first) + in_tile,
            out.to(out_ptr.dtype.element_ty),
            mask=(in_tile >= lo) & (in_tile < hi),
        )


@triton.jit
def _dequantize_4bit_kernel(
    out_ptr, data_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first, n_out, n_bytes,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, RUNS: tl.constexpr,
    RUN: tl.constexpr, PAIRS: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    # Elements first:first + n_out of one weight (see _dequantize_4bit_tile), a tile a program.
    _dequantize_4bit_tile(out_ptr, data_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first, n_out,
                          n_bytes, tl.program_id(0), BLOCKSIZE, BLOCKSIZE2, NESTED, RUNS, RUN, PAIRS, BF16)  # fmt: skip


@triton.jit
def _dequantize_4bit_three_kernel(
    out0, data0, absmax0, code2_0, absmax2_0, offset0, n_out0, n_bytes0, tiles0,
    out1, data1, absmax1, code2_1, absmax2_1, offset1, n_out1, n_bytes1, tiles1,
    out2, data2, absmax2, code2_2, absmax2_2, offset2, n_out2, n_bytes2,
    code_ptr,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, RUNS: tl.constexpr,
    RUN: tl.constexpr, PAIRS: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    # Three whole weights of one format in one launch (q, k and v: their small weights' launches
    # are mostly ramp and tail, INDEX.md#qlora_dequant_pairs): programs 0:tiles0 write the first,
    # the next tiles1 the second, the rest the third.
    tile = tl.program_id(0)
    if tile < tiles0:
        _dequantize_4bit_tile(out0, data0, code_ptr, absmax0, code2_0, absmax2_0, offset0, 0, n_out0, n_bytes0, tile,
                              BLOCKSIZE, BLOCKSIZE2, NESTED, RUNS, RUN, PAIRS, BF16)  # fmt: skip
    elif tile < tiles0 + tiles1:
        _dequantize_4bit_tile(out1, data1, code_ptr, absmax1, code2_1, absmax2_1, offset1, 0, n_out1, n_bytes1, tile - tiles0,
                              BLOCKSIZE, BLOCKSIZE2, NESTED, RUNS, RUN, PAIRS, BF16)  # fmt: skip
    else:
        _dequantize_4bit_tile(out2, data2, code_ptr, absmax2, code2_2, absmax2_2, offset2, 0, n_out2, n_bytes2,
                              tile - tiles0 - tiles1, BLOCKSIZE, BLOCKSIZE2, NESTED, RUNS, RUN, PAIRS, BF16)  # fmt: skip


@triton.jit
def _dequantize_int8_kernel(
    out_ptr,  # [n_rows, K] rows start:start + n_rows of W, unit column stride
    data_ptr,  # [N, K] int8 (CB), unit column stride
    scb_ptr,  # [N] fp32: the absmax of each row (SCB)
    start,
    n_rows,
    n_cols,
    data_row_stride,
    out_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    source = (start + rows).to(tl.int64)
    cb = tl.load(data_ptr + source[:, None] * data_row_stride + cols[None, :], mask=ok, other=0).to(tl.float32)
    scb = tl.load(scb_ptr + source, mask=row_ok, other=0.0)
    out = (cb * scb[:, None]) * _INT8_SCALE  # bitsandbytes' order: two fp32 products
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3. Launchers
# ---------------------------------------------------------------------------------------------


class LaunchParams(NamedTuple):
    block_rows: int  # rows of W per program
    block_cols: int  # columns per program, a power of two
    num_warps: int


class Launch4bit(NamedTuple):
    elements: int  # elements of W per program, a power of two
    max_run: int  # the longest run of one block a tile row holds, a power of two (see the kernel)
    num_warps: int


# int8: a tile of 16 x 256 outputs per program; a row's scale loaded once, the codes' loads contiguous.
LAUNCH_INT8 = LaunchParams(block_rows=16, block_cols=256, num_warps=4)
# 4-bit: 2048 elements (1 KiB of codes) over 4 warps, runs up to 256 elements (a 128-byte load a
# row): within 1% of the fastest of 16 launches at every Llama-3.1-8B weight, blocksizes 64 and 256
# (benchmarks/experiments/INDEX.md#qlora_dequant_probe).
LAUNCH_4BIT = Launch4bit(elements=2048, max_run=256, num_warps=4)
# 4-bit into a 16-bit output as 32-bit words (PAIRS), or None: not taken. The probe's best of 6
# launches at every Llama-3.1-8B weight but k/v (within 7% there): gate/up 41.6 us against 50.1
# without PAIRS (INDEX.md#qlora_dequant_pairs); in bench_lora --qlora, with q, k and v together,
# QKV at 4096 tokens 0.745 against 0.766 ms (INDEX.md#qlora_dequant_fused).
LAUNCH_4BIT_PAIRS: Launch4bit | None = Launch4bit(elements=8192, max_run=256, num_warps=4)
HALF_DTYPES = (torch.bfloat16, torch.float16)
"""The output dtypes the 4-bit kernel can write as pairs (two values a 32-bit word)."""


def _runs(blocksize: int, params: Launch4bit) -> tuple[int, int]:
    """(runs a program, elements a run) of the 4-bit kernel for ``blocksize`` (a power of two)."""
    run = max(2, min(blocksize, params.max_run, params.elements))
    return params.elements // run, run


def _launch_4bit(pairs: bool) -> Launch4bit:
    """The 4-bit kernel's launch: LAUNCH_4BIT_PAIRS for a pairs store (taken only where it is set)."""
    return LAUNCH_4BIT_PAIRS if pairs and LAUNCH_4BIT_PAIRS is not None else LAUNCH_4BIT


def _as_words(out: torch.Tensor, first: int, n_out: int) -> torch.Tensor | None:
    """``out`` (a contiguous run of a 16-bit dtype) viewed as int32 words, where the 4-bit kernel can
    write it as pairs: an even first element and count, word-aligned; else None."""
    if LAUNCH_4BIT_PAIRS is None or out.dtype not in HALF_DTYPES or first % 2 or n_out % 2 or out.data_ptr() % 4:
        return None
    return out.reshape(-1).view(torch.int32)


def _check_rows(q: QuantizedWeight, start: object, stop: object) -> tuple[int, int]:
    n = q.shape[0]
    start = validate.check_int("start", start, 0)
    stop = validate.check_int("stop", stop, start)
    if stop > n:
        raise ValueError(f"stop must be <= out_features ({n}), got {stop}")
    return start, stop


def _output(q: QuantizedWeight, n_rows: int, out: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
    shape = (n_rows, q.shape[1])
    if out is None:
        dtype = q.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or dtype not in validate.FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of float32, float16, bfloat16, got {dtype!r}")
        return torch.empty(shape, dtype=dtype, device=q.device)
    validate.check_tensor("out", out)
    validate.check_dtype("out", out, validate.FLOAT_DTYPES)
    validate.check_shape("out", out, shape)
    validate.check_same_device("out", out, "the weight's data", q.data)
    if dtype is not None and dtype != out.dtype:
        raise TypeError(f"dtype ({dtype}) must match out's dtype ({out.dtype}), or be None")
    return out


def dequantize_rows(
    q: QuantizedWeight,
    start: int,
    stop: int,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows ``start:stop`` of the weight ``W`` ``[N, K]``, ``[stop - start, K]``: into ``out`` when
    given (any row stride, unit column stride: a slice of a reused buffer), else a new tensor of
    ``dtype`` (default ``q.dtype``).

    One Triton kernel on Triton's path (a GPU, or the interpreter); :func:`dequantize_ref` elsewhere
    and under ``torch.compile``. Both give the same values, bit for bit. The 4-bit kernel writes the
    rows as one contiguous run: into an ``out`` whose rows are apart, it writes a temporary and
    copies it.
    """
    if not isinstance(q, QuantizedWeight):
        raise TypeError(f"q must be a QuantizedWeight, got {type(q).__name__}")
    start, stop = _check_rows(q, start, stop)
    result = _output(q, stop - start, out, dtype)
    n_rows, n_cols = stop - start, q.shape[1]
    if n_rows == 0:
        return result
    rows = writable_rows(result)
    if rows is None or not uses_kernel(q.data) or torch.compiler.is_compiling():
        return result.copy_(dequantize_ref(q, start, stop, result.dtype))
    if q.quant_type == "int8":
        params = LAUNCH_INT8
        data = q.data if q.data.stride(1) == 1 else q.data.contiguous()
        _dequantize_int8_kernel[(cdiv(n_rows, params.block_rows), cdiv(n_cols, params.block_cols))](
            rows, data, q.absmax, start, n_rows, n_cols, data.stride(0), rows.stride(0),
            BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, num_warps=params.num_warps,
        )  # fmt: skip
        return result
    if n_rows > 1 and rows.stride(0) != n_cols:  # (the kernel writes the flattened rows: a contiguous run)
        return result.copy_(dequantize_rows(q, start, stop, dtype=result.dtype))
    first, n_out = start * n_cols, n_rows * n_cols
    words = _as_words(rows, first, n_out)
    launch = _launch_4bit(words is not None)
    runs, run = _runs(q.blocksize, launch)
    _dequantize_4bit_kernel[(cdiv(first % run + n_out, runs * run),)](
        words if words is not None else rows, q.data.reshape(-1), code_table(q.quant_type, q.device),
        *_scale_args(q), first, n_out, q.data.numel(), **_format_args(q, words is not None, result.dtype, runs, run),
        num_warps=launch.num_warps,
        enable_fp_fusion=False,  # the nested absmax's product and sum round apart, as bitsandbytes rounds them
    )  # fmt: skip
    return result


def _scale_args(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit kernel's absmax, code2, absmax2 and offset arguments (the absmax thrice unread
    without nesting)."""
    nested = q.nested
    absmax2, code2, offset = (nested.absmax, nested.code, nested.offset) if nested else (q.absmax,) * 3
    return q.absmax.reshape(-1), code2.reshape(-1), absmax2.reshape(-1), offset.reshape(-1)


def _format_args(q: QuantizedWeight, pairs: bool, dtype: torch.dtype, runs: int, run: int) -> dict[str, Any]:
    """The 4-bit kernel's constexpr arguments for ``q``'s format."""
    nested = q.nested
    return {"BLOCKSIZE": q.blocksize, "BLOCKSIZE2": nested.blocksize if nested else 1, "NESTED": nested is not None,
            "RUNS": runs, "RUN": run, "PAIRS": pairs, "BF16": dtype == torch.bfloat16}  # fmt: skip


def _same_format(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    """Whether one 4-bit launch can dequantize both (the kernel's constexprs and code book agree)."""
    a_nested = a.nested.blocksize if a.nested else None
    b_nested = b.nested.blocksize if b.nested else None
    return (a.quant_type, a.blocksize, a_nested, a.dtype, a.device) == (
        b.quant_type,
        b.blocksize,
        b_nested,
        b.dtype,
        b.device,
    )


def dequantize_together(qs: Sequence[QuantizedWeight], *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each weight of ``qs`` whole, as :func:`dequantize` gives it (a new tensor each, of ``dtype``,
    default each weight's own), but up to three 4-bit weights of one format in one launch: q, k and
    v's, whose separate launches are mostly ramp and tail (three at Llama-3.1-8B's shapes: 30.0 us,
    one: 21.1; ``benchmarks/experiments/INDEX.md#qlora_dequant_pairs``)."""
    qs = list(qs)
    for i, q in enumerate(qs):
        if not isinstance(q, QuantizedWeight):
            raise TypeError(f"qs[{i}] must be a QuantizedWeight, got {type(q).__name__}")
    outs = [_output(q, q.shape[0], None, dtype) for q in qs]
    four_bit = [i for i, q in enumerate(qs) if q.quant_type != "int8"]
    groups: list[list[int]] = []
    for i in four_bit:
        group = next((g for g in groups if len(g) < 3 and _same_format(qs[g[0]], qs[i])
                      and outs[g[0]].dtype == outs[i].dtype), None)  # fmt: skip
        if group is None:
            groups.append([i])
        else:
            group.append(i)
    together = {i for g in groups if len(g) > 1 for i in g}
    for i, q in enumerate(qs):
        if i not in together:
            dequantize(q, out=outs[i])
    for group in (g for g in groups if len(g) > 1):
        _launch_together([qs[i] for i in group], [outs[i] for i in group])
    return outs


def _launch_together(qs: list[QuantizedWeight], outs: list[torch.Tensor]) -> None:
    """Two or three whole 4-bit weights of one format into ``outs`` (new contiguous tensors) by one
    launch of the three-weight kernel (a missing third: no programs)."""
    if not uses_kernel(qs[0].data) or torch.compiler.is_compiling():
        for q, out in zip(qs, outs, strict=True):
            out.copy_(dequantize_ref(q, dtype=out.dtype))
        return
    n_outs = [q.shape[0] * q.shape[1] for q in qs]
    words = [_as_words(out, 0, n) for out, n in zip(outs, n_outs, strict=True)]
    pairs = all(w is not None for w in words)
    params = _launch_4bit(pairs)
    runs, run = _runs(qs[0].blocksize, params)
    tiles = [cdiv(n, runs * run) for n in n_outs]
    sources = [
        (w if pairs else out, q.data.reshape(-1), *_scale_args(q), n, q.data.numel())
        for q, out, w, n in zip(qs, outs, words, n_outs, strict=True)
    ]
    if len(sources) == 2:  # (the second again as the third, with no programs)
        sources.append(sources[1])
        tiles.append(0)
    _dequantize_4bit_three_kernel[(sum(tiles),)](
        *sources[0], tiles[0], *sources[1], tiles[1], *sources[2], code_table(qs[0].quant_type, qs[0].device),
        **_format_args(qs[0], pairs, outs[0].dtype, runs, run), num_warps=params.num_warps,
        enable_fp_fusion=False,  # as dequantize_rows
    )  # fmt: skip


def dequantize(
    q: QuantizedWeight, *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The whole weight ``W`` ``[N, K]``: :func:`dequantize_rows` over every row."""
    if not isinstance(q, QuantizedWeight):
        raise TypeError(f"q must be a QuantizedWeight, got {type(q).__name__}")
    return dequantize_rows(q, 0, q.shape[0], out=out, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# 4. Reading bitsandbytes' objects (duck-typed: bitsandbytes is not imported)
# ---------------------------------------------------------------------------------------------


def from_bnb(layer_or_weight: Any) -> QuantizedWeight:
    """The :class:`QuantizedWeight` of a bitsandbytes layer (``Linear4bit``, ``Linear8bitLt``) or of
    its weight (``Params4bit``, ``Int8Params``), sharing its tensors (no copy).

    Read by attributes (``quant_state`` with ``absmax``, ``shape``, ``blocksize``, ``quant_type``,
    ``dtype``, ``offset``, ``state2``; ``SCB``, on the weight or, once a ``Linear8bitLt`` has run,
    on the layer's ``state``), so bitsandbytes need not be imported here. A weight
    not quantized yet (bitsandbytes quantizes when it moves to a device), with ``has_fp16_weights``,
    or repacked for bitsandbytes' CPU matmul (``packing_format_for_cpu``) raises ``ValueError``.
    """
    weight = layer_or_weight
    if not isinstance(weight, torch.Tensor):
        weight = getattr(weight, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"layer_or_weight must be a bitsandbytes layer or weight, got {type(layer_or_weight).__name__}"
            )
    state = getattr(weight, "quant_state", None)
    if state is not None:
        return _from_quant_state(weight, state)
    if getattr(weight, "SCB", None) is not None or hasattr(weight, "has_fp16_weights"):
        # (Linear8bitLt's first forward moves SCB from its weight to its ``state``.)
        state_scb = None if weight is layer_or_weight else getattr(getattr(layer_or_weight, "state", None), "SCB", None)
        return _from_int8_params(weight, state_scb)
    if hasattr(weight, "quant_type") and hasattr(weight, "blocksize"):  # a Params4bit not quantized yet
        raise ValueError("layer_or_weight is not quantized yet: bitsandbytes quantizes it when it moves to a device")
    raise TypeError(
        f"layer_or_weight must be a bitsandbytes 4-bit or 8-bit weight (with quant_state or SCB), "
        f"got {type(weight).__name__}"
    )


def _from_quant_state(weight: torch.Tensor, state: Any) -> QuantizedWeight:
    if getattr(state, "packing_format_for_cpu", False):
        raise ValueError(
            "layer_or_weight is repacked for bitsandbytes' CPU matmul (quant_state.packing_format_for_cpu); "
            "this layout is not bitsandbytes' 4-bit format"
        )
    shape = tuple(int(s) for s in state.shape)
    if len(shape) != 2:
        raise ValueError(f"layer_or_weight's quant_state.shape must be 2-D, got {shape}")
    data = weight.data
    if data.dtype != torch.uint8:  # quant_storage (bf16, ... for FSDP): the same bytes
        data = data.view(torch.uint8)
    nested = None
    state2 = getattr(state, "state2", None)
    if state2 is not None:
        offset = torch.as_tensor(state.offset, dtype=torch.float32, device=data.device).reshape(1)
        nested = NestedAbsmax(state2.absmax.reshape(-1), state2.code.reshape(-1), int(state2.blocksize), offset)
    return QuantizedWeight(
        quant_type=str(state.quant_type),
        data=data.reshape(-1),
        shape=(shape[0], shape[1]),
        absmax=state.absmax.reshape(-1),
        blocksize=int(state.blocksize),
        nested=nested,
        dtype=state.dtype,
    )


def _from_int8_params(weight: torch.Tensor, state_scb: torch.Tensor | None) -> QuantizedWeight:
    if getattr(weight, "has_fp16_weights", False):
        raise ValueError("layer_or_weight has has_fp16_weights=True: its weight is not kept in int8")
    scb = getattr(weight, "SCB", None)
    scb = state_scb if scb is None else scb
    if weight.dtype != torch.int8 or scb is None:
        raise ValueError("layer_or_weight is not quantized yet: bitsandbytes quantizes it when it moves to a device")
    n, k = weight.shape
    return QuantizedWeight("int8", weight.data, (int(n), int(k)), scb.reshape(-1), dtype=torch.float16)


def int8_base(layer: Any) -> Int8Base:
    """The :class:`Int8Base` of a bitsandbytes ``Linear8bitLt`` (``has_fp16_weights=False``, quantized):
    its weight read by :func:`from_bnb` (no copy) and the layer itself as the product."""
    return Int8Base(from_bnb(layer), layer)
