"""Matmuls with a 4-bit (NF4, FP4) base weight dequantized one tile at a time inside the GEMM.

A QLoRA base layer needs two products of its frozen weight ``W`` ``[N, K]`` (a
:class:`fk.lora.quant.QuantizedWeight`): the forward's ``y = x W^T + b`` and the backward's input
gradient ``dx = dy W``. Dequantizing ``W`` whole (:func:`fk.lora.quant.dequantize`) and calling
cuBLAS moves, per product, the packed codes (``NK / 2`` bytes) in and the dequantized weight
(``2 NK`` bytes in bf16) out, then the GEMM reads that weight back (``2 NK``): about ``4.5 NK``
bytes beside the GEMM's ``2 MNK`` FLOPs, and one more launch. Here each program of the GEMM
instead dequantizes the ``[BLOCK_N, BLOCK_K]`` tiles of ``W`` it multiplies, in registers, from the
codes (``NK / 2`` bytes, read once per row of programs, mostly from L2): no ``[N, K]`` temporary.

Notation: ``x`` ``[M, K]``, ``dy`` ``[M, N]``, ``c`` their dtype (the compute dtype: float16 or
bfloat16), ``b`` ``[N]``. Each weight value is formed as :mod:`fk.lora.quant` forms it (the code
book value times its block's fp32 scale, the nested scale's product and sum rounded apart), rounded
to the weight's own dtype (``QuantizedWeight.dtype``, bitsandbytes' ``QuantState.dtype``) and then
to ``c``: the operand the whole-matrix path (``dequantize(q).to(c)``) hands cuBLAS, bit for bit.
Products accumulate in fp32 and are rounded once to ``c``.

When to take which path (:func:`tile_dequant_applies`, :data:`TILE_DEQUANT_MAX_ROWS`): see the
threshold's docstring.

This file holds, in order: the references, the kernels, the launch table and the rule, the launchers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import INTERPRETER_ON, uses_kernel
from fk.core.launch import cdiv
from fk.core.tiles import round_to
from fk.lora.quant import QuantizedWeight, code_table, dequantize, dequantize_ref

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The compute dtypes the tile path takes (fp32 operands would run ``tl.dot`` in TF32, not as cuBLAS
runs an fp32 matmul: fp32 compute stays on the whole-matrix path)."""

# ---------------------------------------------------------------------------------------------
# 1. References
# ---------------------------------------------------------------------------------------------


def _weight_in(q: QuantizedWeight, compute: torch.dtype) -> torch.Tensor:
    """``W`` as the GEMM takes it: formed in fp32, rounded to ``q.dtype``, then to ``compute``."""
    return dequantize_ref(q).to(compute)


def linear_4bit_ref(
    x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None, compute: torch.dtype | None = None
) -> torch.Tensor:
    """``x W^T + b`` in ``x``'s dtype, computed in fp32 or wider, with ``W`` rounded to ``compute``
    (default ``x``'s dtype) first, as the kernels round it."""
    w = _weight_in(q, compute or x.dtype)
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) @ w.to(acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def matmul_4bit_ref(dy: torch.Tensor, q: QuantizedWeight, compute: torch.dtype | None = None) -> torch.Tensor:
    """``dy W`` in ``dy``'s dtype, computed in fp32 or wider, ``W`` rounded to ``compute`` first."""
    w = _weight_in(q, compute or dy.dtype)
    acc = torch.promote_types(dy.dtype, torch.float32)
    return (dy.to(acc) @ w.to(acc)).to(dy.dtype)


# ---------------------------------------------------------------------------------------------
# 2. Kernels
# ---------------------------------------------------------------------------------------------
# Both kernels walk the output in [BLOCK_M, BLOCK_*] tiles, GROUP_M tiles of rows per column sweep
# (consecutive programs share the weight tiles they dequantize while those sit in L2), and run
# their reduction over K (forward) or N (input gradient) in steps, each a tl.dot of an activation
# tile and a weight tile dequantized by _weight_tile.
#
#   forward:         y[m, n]  = sum_k x[m, k] W[n, k]  (+ b[n])  (+ y[m, n] when ACCUMULATE)
#   input gradient:  dx[m, k] = sum_n dy[m, n] W[n, k]           (+ dx[m, k] when ACCUMULATE)
#
# The forward's weight tile is dequantized as [BLOCK_N, BLOCK_K] (the codes' layout: consecutive k
# in consecutive nibbles) and transposed in registers for the dot; the input gradient's is used as
# it comes. ACCUMULATE adds the product to what the output holds (torch.addmm_'s beta = 1: the fp32
# sum rounded once), how the projections of one input sum their dx terms.


@triton.jit
def _tile_ids(GROUP_M: tl.constexpr, n_tiles_m, n_tiles_n):
    """(row tile, column tile) of this program: GROUP_M row tiles per sweep of the columns."""
    pid = tl.program_id(0)
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


# Two workarounds for Triton's interpreter (INTERPRETER), where the tests run, so that it computes
# what a GPU computes: its tl.dot multiplies bfloat16's raw bits as integers (the operands go in as
# fp32 instead, which holds their values exactly), and it casts fp32 to bfloat16 toward zero
# (fk.core.tiles.round_to rounds to nearest even there).


@triton.jit
def _dot(a, b, acc, INTERPRETER: tl.constexpr):
    """acc + a b, products summed in fp32."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _weight_tile(
    data_ptr,  # [ceil(N * K / 2)] uint8: the code index of element i = n * K + k in byte i // 2, high nibble if i is even
    code_ptr,  # [16] fp32: the code book (NF4 or FP4)
    absmax_ptr,  # [n_blocks]: fp32 scale per block of BLOCKSIZE elements, or (NESTED) uint8 index into code2
    code2_ptr,  # [256] fp32 (NESTED): the absmax's code book
    absmax2_ptr,  # [ceil(n_blocks / BLOCKSIZE2)] fp32 (NESTED): the absmax's block scales
    offset_ptr,  # [1] fp32 (NESTED): added to the dequantized absmax
    n,  # [BN] rows of W
    k0,  # the first of the tile's BK columns of W
    N,
    K,
    BK: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    ALIGNED: tl.constexpr,  # K % BLOCKSIZE == 0 and BLOCKSIZE % BK == 0: each row of the tile in one block
    W_ROUND: tl.constexpr,  # the weight's own dtype, rounded to before c: 0 fp32, 1 fp16, 2 bf16
    c: tl.constexpr,  # the compute dtype
    INTERPRETER: tl.constexpr,
):
    """W[n, k0:k0 + BK] in c, [BN, BK], zero outside [N, K]: quant.py's _dequantize_4bit_kernel's
    values. ALIGNED: one scale per row of the tile (every k of the tile in [0, K), K even); else the
    element-wise indexing of the dequantization kernel. Either way each element reads its own byte
    (two neighbours read the same one, from L1) and takes its nibble: splitting BK / 2 loaded bytes
    into their nibbles with tl.interleave gave wrong values in the input gradient's tl.dot on an
    H200 (Triton 3.6; right in the interpreter and in the forward)."""
    k = k0 + tl.arange(0, BK)
    i = n.to(tl.int64)[:, None] * K + k[None, :]
    if ALIGNED:
        ok = (n < N)[:, None]
        block = ((n.to(tl.int64) * K + k0) // BLOCKSIZE)[:, None]  # [BN, 1]
    else:
        ok = (n < N)[:, None] & (k < K)[None, :]
        block = i // BLOCKSIZE
    byte = tl.load(data_ptr + (i >> 1), mask=ok, other=0).to(tl.int32)
    value = tl.load(code_ptr + tl.where((i & 1) == 0, byte >> 4, byte & 0xF))  # 16 values: from L1
    if NESTED:
        absmax_q = tl.load(absmax_ptr + block, mask=ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + absmax_q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=ok, other=0.0)
        scale = scale + tl.load(offset_ptr)  # rounded apart from the product: launched without fp fusion
    else:
        scale = tl.load(absmax_ptr + block, mask=ok, other=0.0)
    w = tl.where(ok, value * scale, 0.0)
    if W_ROUND == 1:
        w = w.to(tl.float16).to(tl.float32)
    elif W_ROUND == 2:
        w = round_to(w, tl.bfloat16).to(tl.float32)
    return round_to(w, c)


@triton.jit
def _linear_4bit_kernel(
    y_ptr,  # [M, N] output in c (strides y_stride_m, y_stride_n); read first when ACCUMULATE
    x_ptr,  # [M, K] in c (strides x_stride_m, x_stride_k)
    bias_ptr,  # [N] (HAS_BIAS), any float dtype, unit stride
    data_ptr,  # the 4-bit weight: see _weight_tile
    code_ptr,
    absmax_ptr,
    code2_ptr,
    absmax2_ptr,
    offset_ptr,
    M,
    N,
    K,
    x_stride_m,
    x_stride_k,
    y_stride_m,
    y_stride_n,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    ALIGNED: tl.constexpr,
    W_ROUND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile_m, tile_n = _tile_ids(GROUP_M, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N))
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride_m + k[None, :] * x_stride_k,
                     mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)  # fmt: skip
        w = _weight_tile(data_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, n, k0, N, K,
                         BLOCK_K, BLOCKSIZE, BLOCKSIZE2, NESTED, ALIGNED, W_ROUND, c, INTERPRETER)  # fmt: skip
        acc = _dot(xs, tl.trans(w), acc, INTERPRETER)
    ok = (m < M)[:, None] & (n < N)[None, :]
    y_at = y_ptr + m.to(tl.int64)[:, None] * y_stride_m + n[None, :] * y_stride_n
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    if ACCUMULATE:
        acc += tl.load(y_at, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_at, round_to(acc, y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _matmul_4bit_kernel(
    dx_ptr,  # [M, K] output in c (strides dx_stride_m, dx_stride_k); read first when ACCUMULATE
    dy_ptr,  # [M, N] in c (strides dy_stride_m, dy_stride_n)
    data_ptr,  # the 4-bit weight: see _weight_tile
    code_ptr,
    absmax_ptr,
    code2_ptr,
    absmax2_ptr,
    offset_ptr,
    M,
    N,
    K,
    dy_stride_m,
    dy_stride_n,
    dx_stride_m,
    dx_stride_k,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    ALIGNED: tl.constexpr,
    W_ROUND: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile_m, tile_k = _tile_ids(GROUP_M, tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K))
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    c = dy_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        g = tl.load(dy_ptr + m.to(tl.int64)[:, None] * dy_stride_m + n[None, :] * dy_stride_n,
                    mask=(m < M)[:, None] & (n < N)[None, :], other=0.0)  # fmt: skip
        w = _weight_tile(data_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, n, tile_k * BLOCK_K,
                         N, K, BLOCK_K, BLOCKSIZE, BLOCKSIZE2, NESTED, ALIGNED, W_ROUND, c, INTERPRETER)  # fmt: skip
        acc = _dot(g, w, acc, INTERPRETER)
    ok = (m < M)[:, None] & (k < K)[None, :]
    dx_at = dx_ptr + m.to(tl.int64)[:, None] * dx_stride_m + k[None, :] * dx_stride_k
    if ACCUMULATE:
        acc += tl.load(dx_at, mask=ok, other=0.0).to(tl.float32)
    tl.store(dx_at, round_to(acc, dx_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# 3. Launch table and the rule that picks the path
# ---------------------------------------------------------------------------------------------


class LaunchParams(NamedTuple):
    block_m: int  # rows of x (dy) per program: each weight tile is dequantized once per block_m rows
    block_n: int  # forward: output columns per program; input gradient: reduction step over N
    block_k: int  # forward: reduction step over K; input gradient: output columns per program
    group_m: int  # row tiles per sweep of the columns, so neighbouring programs share weight tiles in L2
    num_warps: int  # 8 warps (two warp groups) feed Hopper's wgmma on a 128-wide tile
    num_stages: int  # software-pipelined loads in flight: 3 fits a 128 x 128 x 64 bf16 step in shared memory


# Hopper's usual bf16 GEMM tile (128 x 128, 64 deep), not yet swept on a GPU
# (benchmarks/tune_qlora_matmul.py sweeps it; results go to benchmarks/experiments/INDEX.md).
# block_k stays at most QLoRA's blocksize (64), which keeps the kernels' aligned path (a scale per row).
LAUNCH = {
    "forward": LaunchParams(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    "input_grad": LaunchParams(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
}

UNALIGNED_MAX_STAGES = 2
"""The most pipeline stages when a tile's rows span quantization blocks (not ``ALIGNED``): the
element-wise scale indices are pipelined with the codes, and at 3 stages the 128 x 128 x 64 input
gradient needs 240 KiB of shared memory, more than a Hopper SM's 227 KiB (2 stages: 144 KiB)."""

TILE_DEQUANT_MAX_ROWS = 0
"""The most rows (tokens, ``M``) for which a product with a 4-bit weight dequantizes it tile by tile
inside the GEMM; above, ``W`` is dequantized whole and cuBLAS runs the product.

Why one row count decides, whatever the weight's shape: the whole-matrix path adds about ``4.5 NK``
bytes (codes read, ``W`` written and read back in bf16) and a launch to a cuBLAS GEMM of ``2 MNK``
FLOPs; the tile path adds no bytes but runs a Triton GEMM that reaches a smaller share of the
matmul ceiling and spends CUDA-core work on each weight tile once per ``block_m`` rows. Both added
costs scale with ``NK``, the first alone, the second times ``M``, so they cross at a row count
``M* ~ 4.5 / (bandwidth * (2 (1/e - 1) / F + d / block_m))`` (``F`` the matmul ceiling, ``e`` the
Triton GEMM's share of it, ``d`` the time to dequantize one element). On an H200 (~4 TB/s,
~700 TFLOP/s), ``e`` = 0.8 and ``d`` ~ 10 fp32 operations at ~60 TFLOP/s give ``M*`` ~ 600. That is
an estimate, and the kernels have not run on a GPU yet: until benchmarks/tune_qlora_matmul.py has
measured the crossover there, this is 0 (the tile path off; the tests force it on)."""


def tile_dequant_applies(rows: int, compute: torch.dtype) -> bool:
    """Whether products over ``rows`` rows in ``compute`` with a 4-bit weight take the tile path
    (:func:`linear_4bit`, :func:`matmul_4bit`) rather than ``dequantize`` and cuBLAS: for half
    precision compute up to :data:`TILE_DEQUANT_MAX_ROWS` rows."""
    return compute in HALF_DTYPES and rows <= TILE_DEQUANT_MAX_ROWS


# ---------------------------------------------------------------------------------------------
# 4. Launchers
# ---------------------------------------------------------------------------------------------

_W_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _check_operands(name: str, a: torch.Tensor, q: object, width: int | None, width_name: str) -> QuantizedWeight:
    if not isinstance(q, QuantizedWeight):
        raise TypeError(f"q must be a QuantizedWeight, got {type(q).__name__}")
    if q.quant_type not in ("nf4", "fp4"):
        raise ValueError(f"q must be a 4-bit (nf4, fp4) weight, got {q.quant_type}")
    validate.check_tensor(name, a)
    validate.check_ndim(name, a, 2)
    validate.check_dtype(name, a, HALF_DTYPES)
    validate.check_same_device(name, a, "q's data", q.data)
    if a.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns ({width_name}), got shape {tuple(a.shape)}")
    return q


def _output(out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor, accumulate: bool) -> torch.Tensor:
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out (the tensor to add the product to)")
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    validate.check_tensor("out", out)
    validate.check_shape("out", out, shape)
    validate.check_same_dtype("out", out, "the input", like)
    validate.check_same_device("out", out, "the input", like)
    return out


def _weight_args(q: QuantizedWeight, block_k: int) -> tuple[list[torch.Tensor], dict[str, int | bool]]:
    """The weight's tensor arguments and constants, for either kernel with ``block_k`` columns a tile."""
    nested = q.nested
    absmax2, code2, offset = (nested.absmax, nested.code, nested.offset) if nested else (q.absmax,) * 3
    tensors = [q.data.reshape(-1), code_table(q.quant_type, q.device), q.absmax.reshape(-1),
               code2.reshape(-1), absmax2.reshape(-1), offset.reshape(-1)]  # fmt: skip
    constants: dict[str, int | bool] = {
        "BLOCKSIZE": q.blocksize, "BLOCKSIZE2": nested.blocksize if nested else 1,
        "NESTED": nested is not None, "ALIGNED": q.shape[1] % q.blocksize == 0 and q.blocksize % block_k == 0,
        "W_ROUND": _W_ROUND[q.dtype], "INTERPRETER": INTERPRETER_ON,
    }  # fmt: skip
    return tensors, constants


def _stages(p: LaunchParams, constants: dict[str, int | bool]) -> int:
    return p.num_stages if constants["ALIGNED"] else min(p.num_stages, UNALIGNED_MAX_STAGES)


def _reference_path(a: torch.Tensor) -> bool:
    return not uses_kernel(a) or torch.compiler.is_compiling()


def linear_4bit(
    x: torch.Tensor,
    q: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    params: LaunchParams | None = None,
) -> torch.Tensor:
    """``x W^T + b`` ``[M, N]`` in ``x``'s dtype (float16 or bfloat16), ``W`` the 4-bit ``q``
    dequantized tile by tile inside the GEMM (values as ``dequantize(q).to(x.dtype)``'s).

    ``x`` ``[M, K]`` any strides; ``bias`` ``[N]`` or None; ``out`` ``[M, N]`` in ``x``'s dtype, any
    strides (a new tensor when None); ``accumulate``: add the product to what ``out`` holds.
    ``params`` overrides ``LAUNCH["forward"]`` (tuning, tests). On the reference path (a CPU without
    Triton's interpreter, or under ``torch.compile``) ``W`` is dequantized whole and ``torch.addmm`` runs.
    """
    n, k = q.shape if isinstance(q, QuantizedWeight) else (0, 0)
    q = _check_operands("x", x, q, k, "the weight's in_features")
    if bias is not None:
        validate.check_tensor("bias", bias)
        validate.check_shape("bias", bias, (n,))
        validate.check_same_device("bias", bias, "x", x)
    y = _output(out, (x.shape[0], n), x, accumulate)
    if x.shape[0] == 0:
        return y
    if _reference_path(x):
        w = dequantize(q).to(x.dtype).t()
        if accumulate:
            y.addmm_(x, w)
            return y if bias is None else y.add_(bias.to(y.dtype))
        return torch.mm(x, w, out=y) if bias is None else torch.addmm(bias.to(x.dtype), x, w, out=y)
    p = params or LAUNCH["forward"]
    tensors, constants = _weight_args(q, p.block_k)
    grid = (cdiv(x.shape[0], p.block_m) * cdiv(n, p.block_n),)
    _linear_4bit_kernel[grid](
        y, x, bias if bias is not None else y, *tensors, x.shape[0], n, k,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), **constants,
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
        num_warps=p.num_warps, num_stages=_stages(p, constants),
        enable_fp_fusion=False,  # the nested absmax's product and sum round apart, as bitsandbytes rounds them
    )  # fmt: skip
    return y


def matmul_4bit(
    dy: torch.Tensor,
    q: QuantizedWeight,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    params: LaunchParams | None = None,
) -> torch.Tensor:
    """``dy W`` ``[M, K]`` in ``dy``'s dtype (float16 or bfloat16), ``W`` the 4-bit ``q``
    dequantized tile by tile inside the GEMM: a base layer's input gradient.

    ``dy`` ``[M, N]`` any strides; ``out`` ``[M, K]`` in ``dy``'s dtype, any strides (a new tensor
    when None); ``accumulate``: add the product to what ``out`` holds (the projections of one input
    summing their terms). ``params`` overrides ``LAUNCH["input_grad"]``. On the reference path ``W``
    is dequantized whole and ``torch.mm`` runs.
    """
    n, k = q.shape if isinstance(q, QuantizedWeight) else (0, 0)
    q = _check_operands("dy", dy, q, n, "the weight's out_features")
    dx = _output(out, (dy.shape[0], k), dy, accumulate)
    if dy.shape[0] == 0:
        return dx
    if _reference_path(dy):
        w = dequantize(q).to(dy.dtype)
        return dx.addmm_(dy, w) if accumulate else torch.mm(dy, w, out=dx)
    p = params or LAUNCH["input_grad"]
    tensors, constants = _weight_args(q, p.block_k)
    grid = (cdiv(dy.shape[0], p.block_m) * cdiv(k, p.block_k),)
    _matmul_4bit_kernel[grid](
        dx, dy, *tensors, dy.shape[0], n, k,
        dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1), **constants,
        ACCUMULATE=accumulate,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
        num_warps=p.num_warps, num_stages=_stages(p, constants),
        enable_fp_fusion=False,  # as in linear_4bit
    )  # fmt: skip
    return dx
