"""A projection's LoRA output, and its input gradient, in one GEMM each: ``y = x W^T + b + s xa B^T``
and ``dx = dy W + (s G) A``, the rank-sized product added by the base matmul's own MMAs.

cuBLAS cannot take ``s xa B^T`` (``xa = d(x) A^T`` ``[M, r]``, ``B`` ``[N, r]``) into its GEMM, so
fk's other path writes it as an ``[M, N]`` tensor first and the base GEMM reads it back
(``addmm``, beta = 1): the output passes through memory twice more; the same holds for the input
gradient without dropout, ``s G A`` (``G = dy B``) written first and ``dy W`` added. Here a
persistent Triton GEMM with TMA descriptors (the activation, ``W`` and the output) walks its output
tiles in groups of ``GROUP_M`` row blocks and, after each tile's K loop, adds the rank-sized product
as one more MMA into the same fp32 accumulator (``[BLOCK_M, r] x [r, BLOCK_N]``), then the bias,
and rounds once; where the rank term's operands are TMA-ready and ``r`` at most :data:`TMA_RANK_MAX`,
they are read through descriptors too and the tile loop is flattened into the K loop (the next
tile's loads overlap this tile's epilogue: 0.1-1.4% less time at 11 of Llama-3.1-8B's 12 MLP and
q/O products, ``benchmarks/experiments/INDEX.md#gemm_flat_tma_epilogue``). ``W`` ``[N, K]`` is read
as stored in both: transposed by the MMA in the forward (``y``'s columns are its rows), as it is in
the backward (``dx``'s columns are its columns). At
Llama-3.1-8B's q/k/v/O shapes on an H200 the forward took 5-18% less GPU time than ``mm`` +
``addmm`` (``benchmarks/experiments/INDEX.md#gemm_lora_epilogues``); where it loses,
and the sizes it is taken at, are in ``INDEX.md#lora_matmul_shapes``.

Math, per element: ``y[i, j] = sum_k x[i, k] W[j, k] + b[j] + s sum_q xa[i, q] B[j, q]`` and
``dx[i, k] = sum_j dy[i, j] W[j, k] + sum_q sG[i, q] A[q, k]``, exact products summed in fp32,
rounded once to the activation's dtype. The scale enters as ``acc = (acc / s + xa B^T) s`` so that
``xa`` and ``B`` go to the MMA as they are (two fp32 roundings of the sum, against the other path's
rounding of ``s xa B^T`` to 16 bits before it is added). There is no backward of its own: this
runs inside fk.lora's forward and backward.

With dropout (mask ``m``, ``f = 1 / (1 - p)``) the input gradient's rank-sized term is masked
element by element, ``dx = dy W + f m (s G A)``, which no MMA can take; there the same kernel
(:func:`base_and_masked_lora_grad`) forms ``s G A`` in its epilogue, on two ``[BLOCK_M, BLOCK_N / 2]``
halves of the tile in turn (a whole second tile beside the accumulator spills), masks it and adds
it, so no pass of its own reads and writes ``dx``; DoRA's term ``f m (dy_ms1 W + s G A)``, whose
mask covers the base product too, is added to a ``dx`` the kernel reads through TMA (no ``[M, K]``
addend written). Per element: ``dx[i, k] = sum_j dy[i, j] W[j, k] + f m[i, k] sum_q sG[i, q] A[q, k]``,
or ``dx[i, k] + f m[i, k] (sum_j dy_ms1[i, j] W[j, k] + sum_q sG[i, q] A[q, k])``, summed in fp32
and rounded once. (At Llama-3.1-8B's attention on an H200: 0.89-0.96x the ``mm`` and masked pass
it replaces, ``benchmarks/experiments/INDEX.md#masked_grad_epilogue``.)

:func:`fused_applies`, :func:`fused_grad_applies` and :func:`masked_grad_applies` say where the
kernel runs (16-bit operands laid out as TMA needs them, ``r`` at most :data:`MAX_RANK`; on a GPU,
Hopper only, where it was measured, with enough output tiles to fill it; and Triton's
interpreter); fk.lora.projection's :func:`~fk.lora.projection.lora_and_base_out` and fk.lora.lora's
and fk.lora.dora's input gradients take it there.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import KernelPath, kernel_path
from fk.core.launch import cdiv, dot_size, multiprocessor_count, persistent_grid
from fk.core.tiles import exact_dot, exact_dot_add, grouped_tile_offsets, round_to

MAX_RANK = 128
"""The largest ``r`` the kernel takes: the rank-sized tiles (``[BLOCK_M, r]`` and ``[r, BLOCK_N]``)
come beside the accumulator (compiled for sm_90 at 128 x 256 tiles on 8 warps: no spills at r = 16
to 128, 213 KB of shared memory at each, under the 227 KB an H100 or H200 gives a program)."""

TILE = (128, 256, 64)
"""(BLOCK_M, BLOCK_N, BLOCK_K): the fastest of ``gemm_lora_epilogues``' tiles at three of Llama-3.1-8B's
four q/k/v/O shapes, within 2% at the fourth (k/v at 4096 tokens)."""
NUM_STAGES, NUM_WARPS = 3, 8
"""Three stages of ``x`` and ``W`` tiles in shared memory (the fastest there); 8 warps hold the
128 x 256 fp32 accumulator (4 spill it)."""
GROUP_M = 8
"""Row blocks walked together, so that consecutive programs share ``W``'s tiles in L2."""
MIN_TILES_PER_SM = 0.75
"""On a GPU, the kernel is taken only where its output has at least this many tiles an SM: it does
not split K, so with fewer tiles SMs idle where cuBLAS splits (``lora_matmul_shapes``: Llama-3.2-1B's
k/v at 4096 tokens, 64 tiles on 132 SMs, took 2.6x the cuBLAS path's time; Llama-3.1-8B's k/v at
4096, 128 tiles, 0.85x)."""
GRAD_MIN_ROWS = GRAD_MIN_INNER = 4096
"""On a GPU, the input gradient's kernel (``W`` read as stored, in ``[BLOCK_K, BLOCK_N]`` tiles) is
taken only for at least this many rows (tokens) and this inner dimension (``W``'s rows): below
them it lost to the cuBLAS path at shapes with tiles enough for the SMs, by a cause not yet found
(``lora_matmul_shapes --grad``: Llama-3.2-1B's q/O at 4096 tokens 2.0x, k/v 2.7x; Llama-3.1-8B's
k/v at 1024 tokens 2.0x); at and above them it took 0.91-0.99x, except Llama-3.1-8B's down at
16384 tokens (1.05x)."""
TMA_RANK_MAX = 32
"""The largest padded rank (:func:`fk.core.launch.dot_size` of ``r``) whose operands the kernel reads
through TMA descriptors (with the tile loop flattened: ``RANK_BY_TMA``): their tiles take shared
memory beside the pipeline's stages (about 192 KB at r = 16 at :data:`TILE`); larger ranks, and
operands TMA cannot describe, are read by pointer, the loop not flattened."""
MASKED_MIN_INNER = 1024
"""The inner dimension from which the input gradient with dropout (:func:`base_and_masked_lora_grad`)
is taken on a GPU: its one masked term in the epilogue took 0.90-0.91x fk's ``mm`` and masked pass
at Llama-3.1-8B's k/v at 4096 tokens (inner 1024; ``INDEX.md#gemm_masked_halves``,
``INDEX.md#masked_grad_epilogue``)."""


def base_and_lora_out_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``x W^T + b + s xa B^T`` in float64: what the kernel computes, before its one rounding."""
    y = x.double() @ weight.double().t() + scaling * (xa.double() @ lora_b.double().t())
    return y if bias is None else y + bias.double()


def base_and_lora_grad_ref(
    dy: torch.Tensor, weight: torch.Tensor, scaled_g: torch.Tensor, lora_a: torch.Tensor
) -> torch.Tensor:
    """``dy W + (s G) A`` in float64: what the kernel computes for the input gradient."""
    return dy.double() @ weight.double() + scaled_g.double() @ lora_a.double()


def base_and_masked_lora_grad_ref(
    dy: torch.Tensor,
    weight: torch.Tensor,
    scaled_g: torch.Tensor,
    lora_a: torch.Tensor,
    mask: torch.Tensor,
    factor: float,
    *,
    mask_base: bool = False,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dy W + f m ((s G) A)``, or ``f m (dy W + (s G) A)`` with ``mask_base``, plus ``addend``, in
    float64: what the kernel computes for an input gradient with dropout."""
    base = dy.double() @ weight.double()
    low = scaled_g.double() @ lora_a.double()
    kept = factor * mask.double()
    out = kept * (base + low) if mask_base else base + kept * low
    return out if addend is None else out + addend.double()


@triton.jit
def _masked_half(part, u, v_ptr, v_col_stride, v_rank_stride, rank, mask_ptr, mask_row_stride, factor, out_desc,
                 off_m, off_n, rows, n_rows, n_cols, MASK_BASE: tl.constexpr, ACCUMULATE: tl.constexpr,
                 BLOCK_RANK: tl.constexpr, HALF_N: tl.constexpr):  # fmt: skip
    # One [BLOCK_M, HALF_N] half of the input gradient's tile (columns off_n on), its masked term
    # added and stored: part + f m (u v) (LoRA), or f m (part + u v) (MASK_BASE, DoRA), plus the
    # output's own value (ACCUMULATE).
    ks = tl.arange(0, BLOCK_RANK)
    cols = off_n + tl.arange(0, HALF_N)
    v = tl.load(v_ptr + cols[None, :] * v_col_stride + ks[:, None] * v_rank_stride,
                mask=(cols[None, :] < n_cols) & (ks[:, None] < rank), other=0.0)  # fmt: skip
    keep = tl.load(mask_ptr + rows[:, None] * mask_row_stride + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0) != 0  # fmt: skip
    if MASK_BASE:
        part = tl.where(keep, factor * exact_dot_add(u, v, part), 0.0)
    else:
        part += tl.where(keep, factor * exact_dot(u, v), 0.0)
    if ACCUMULATE:
        part += out_desc.load([off_m, off_n]).to(tl.float32)
    out_desc.store([off_m, off_n], round_to(part, out_desc.dtype))  # TMA clips the edges


@triton.jit
def _base_and_lora_kernel(a_desc, w_desc, out_desc, u_desc, v_desc, u_ptr, v_ptr, bias_ptr, mask_ptr, scaling,
                          inv_scaling, factor, n_rows, n_cols, n_inner, rank, u_row_stride, v_col_stride,
                          v_rank_stride, mask_row_stride, W_TRANSPOSED: tl.constexpr, HAS_BIAS: tl.constexpr,
                          MASKED: tl.constexpr, MASK_BASE: tl.constexpr, ACCUMULATE: tl.constexpr,
                          RANK_BY_TMA: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          N_PROGRAMS: tl.constexpr):  # fmt: skip
    # out = a op(W) + b + s u v: op(W) = W^T (W_TRANSPOSED, the forward) or W; v[q, j] at
    # v_ptr + j v_col_stride + q v_rank_stride (B^T in the forward, A in the backward).
    # RANK_BY_TMA (no mask): u [M, r] and v (B [N, r] or A [r, K]) read through their descriptors,
    # the tile loop flattened into the K loop (the pipeliner then issues the next tile's loads
    # during this tile's epilogue) and the output stored in two [BLOCK_M, BLOCK_N / 2] halves (a
    # whole tile's staging buffer beside the pipeline's stages leaves no shared memory).
    # MASKED (the backward with dropout): out = a W + f m (u v), or f m (a W + u v) with MASK_BASE,
    # plus out's own value with ACCUMULATE; m [M, N] bool; the epilogue in two halves of the tile
    # (out_desc's blocks are [BLOCK_M, BLOCK_N / 2]): a whole [BLOCK_M, BLOCK_N] term tile beside the
    # accumulator spills at 128 x 256.
    ks = tl.arange(0, BLOCK_RANK)
    half_n: tl.constexpr = BLOCK_N // 2
    # Flattened with the rank term's operands loaded by pointer, the epilogue's loads took the
    # kernel from 186 to 279 us (O, 4096 tokens); through descriptors, 189.2 -> 186.7 us.
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N), N_PROGRAMS,
                         flatten=RANK_BY_TMA):  # fmt: skip
        off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, n_inner, BLOCK_K):  # TMA reads past the edges as zeros
            if W_TRANSPOSED:  # noqa: SIM108 (the descriptor of the branch not taken has the other block shape)
                w = w_desc.load([off_n, off_k]).T
            else:
                w = w_desc.load([off_k, off_n])
            acc = exact_dot_add(a_desc.load([off_m, off_k]), w, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        if RANK_BY_TMA:
            u = u_desc.load([off_m, 0])  # columns past r read as zeros
        else:
            u = tl.load(u_ptr + rows[:, None].to(tl.int64) * u_row_stride + ks[None, :],
                        mask=(rows[:, None] < n_rows) & (ks[None, :] < rank), other=0.0)  # fmt: skip
        if MASKED:
            first, second = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, half_n)), (0, 2, 1)))
            wide_rows = rows.to(tl.int64)
            _masked_half(first, u, v_ptr, v_col_stride, v_rank_stride, rank, mask_ptr, mask_row_stride, factor,
                         out_desc, off_m, off_n, wide_rows, n_rows, n_cols, MASK_BASE, ACCUMULATE, BLOCK_RANK,
                         half_n)  # fmt: skip
            _masked_half(second, u, v_ptr, v_col_stride, v_rank_stride, rank, mask_ptr, mask_row_stride, factor,
                         out_desc, off_m, off_n + half_n, wide_rows, n_rows, n_cols, MASK_BASE, ACCUMULATE,
                         BLOCK_RANK, half_n)  # fmt: skip
        else:
            cols = off_n + tl.arange(0, BLOCK_N)
            if RANK_BY_TMA:
                if W_TRANSPOSED:  # noqa: SIM108
                    v = v_desc.load([off_n, 0]).T
                else:
                    v = v_desc.load([0, off_n])
            else:
                v = tl.load(v_ptr + cols[None, :] * v_col_stride + ks[:, None] * v_rank_stride,
                            mask=(cols[None, :] < n_cols) & (ks[:, None] < rank), other=0.0)  # fmt: skip
            acc = exact_dot_add(u, v, acc * inv_scaling) * scaling
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
            if RANK_BY_TMA:
                first, second = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, half_n)), (0, 2, 1)))
                out_desc.store([off_m, off_n], round_to(first, out_desc.dtype))  # TMA clips the edges
                out_desc.store([off_m, off_n + half_n], round_to(second, out_desc.dtype))
            else:
                out_desc.store([off_m, off_n], round_to(acc, out_desc.dtype))


def _has_tensor_descriptors() -> bool:
    """Whether this Triton has host-side TMA descriptors that kernels ``load`` and ``store`` through
    (``triton.tools.tensor_descriptor``, Triton 3.4 and later; fk-lora takes Triton 3.2 too)."""
    match = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return match is not None and (int(match.group(1)), int(match.group(2))) >= (3, 4)


HAS_TENSOR_DESCRIPTORS = _has_tensor_descriptors()


def tma_ready(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can describe: rows of contiguous elements, 16-byte aligned start and rows."""
    alignment = 16 // t.element_size()
    return t.stride(1) == 1 and t.stride(0) % alignment == 0 and t.data_ptr() % 16 == 0


def tma_gemm_runs(a: torch.Tensor, n_cols: int, tile: tuple[int, int, int]) -> bool:
    """Whether one of fk-lora's persistent TMA GEMMs (this module's, :mod:`fk.lora.dora_dropout_matmul`'s)
    runs for the activation ``a`` ``[M, inner]`` and ``n_cols`` output columns at ``tile``: in Triton's
    interpreter (any size), or on a CUDA device of compute capability 9 (Hopper, where they were
    measured) with at least :data:`MIN_TILES_PER_SM` output tiles an SM; with Triton 3.4 or later
    (:data:`HAS_TENSOR_DESCRIPTORS`); not while ``torch.compile`` traces. The operands' own
    conditions are each kernel's."""
    path = kernel_path(a)
    if path is KernelPath.REFERENCE or not HAS_TENSOR_DESCRIPTORS or torch.compiler.is_compiling():
        return False
    if path is KernelPath.TRITON:
        if torch.cuda.get_device_capability(a.device)[0] != 9:
            return False
        tiles = cdiv(a.shape[0], tile[0]) * cdiv(n_cols, tile[1])
        if tiles < MIN_TILES_PER_SM * multiprocessor_count(a.device):
            return False
    return True


def _applies(a: torch.Tensor, weight: torch.Tensor, n_cols: int, u: torch.Tensor, small: tuple[torch.Tensor, ...],
             scaling: float) -> bool:  # fmt: skip
    """The checks of :func:`fused_applies` and :func:`fused_grad_applies`: ``a`` the activation
    ``[M, inner]``, ``n_cols`` the output's columns, ``u`` ``[M, r]``, ``small`` the rank-sized
    operands and the bias."""
    if not tma_gemm_runs(a, n_cols, TILE):
        return False
    if a.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != a.dtype or a.dim() != 2:
        return False
    if a.shape[0] == 0 or n_cols % 8 != 0 or not 0 < u.shape[1] <= MAX_RANK or scaling == 0:
        return False
    if any(t.dtype != a.dtype for t in small) or u.stride(-1) != 1:
        return False
    return tma_ready(a) and tma_ready(weight)


def fused_applies(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> bool:
    """Whether :func:`base_and_lora_out` runs for these operands (else the caller's cuBLAS path):
    ``x`` ``[M, K]`` and ``W`` ``[N, K]`` both fp16 or both bf16, each TMA-ready (contiguous rows,
    row strides and starts 16-byte aligned), ``N`` a multiple of 8 (``y``'s rows), ``xa`` (with
    contiguous rows), ``B`` (any strides) and ``b`` (contiguous) in that dtype, ``r`` at most
    :data:`MAX_RANK`, ``s`` not 0; on a CUDA device of compute capability 9 (Hopper, where the
    kernel was measured; the tile table is Hopper's) with at least :data:`MIN_TILES_PER_SM` output
    tiles an SM, or in Triton's interpreter (any size); with Triton 3.4 or later
    (:data:`HAS_TENSOR_DESCRIPTORS`); not while ``torch.compile`` traces."""
    if bias is not None and bias.stride(0) != 1:
        return False
    small = (xa, lora_b) if bias is None else (xa, lora_b, bias)
    return _applies(x, weight, weight.shape[0], xa, small, scaling)


def fused_grad_applies(dy: torch.Tensor, weight: torch.Tensor, scaled_g: torch.Tensor, lora_a: torch.Tensor) -> bool:
    """Whether :func:`base_and_lora_grad` runs: :func:`fused_applies`' conditions with ``dy``
    ``[M, N]`` as the activation and ``dx`` ``[M, K]`` as the output (``K`` a multiple of 8), and on
    a GPU ``M`` and ``N`` at least :data:`GRAD_MIN_ROWS` and :data:`GRAD_MIN_INNER`."""
    if kernel_path(dy) is KernelPath.TRITON and (dy.shape[0] < GRAD_MIN_ROWS or weight.shape[0] < GRAD_MIN_INNER):
        return False
    return _applies(dy, weight, weight.shape[1], scaled_g, (scaled_g, lora_a), 1.0)


class _Masked(NamedTuple):
    """The input gradient's dropout term, where :func:`_launch` adds one: ``f m (u v)`` (or
    ``f m (a W + u v)``)."""

    mask: torch.Tensor
    """``m`` ``[M, K]``, bool, unit column stride."""
    factor: float
    """``f = 1 / (1 - p)``."""
    mask_base: bool
    """Whether ``m`` and ``f`` apply to the base product ``a W`` too (DoRA's)."""


def masked_grad_applies(
    dy: torch.Tensor,
    weight: torch.Tensor,
    scaled_g: torch.Tensor,
    lora_a: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`base_and_masked_lora_grad` runs: :func:`fused_grad_applies`' conditions, but
    on a GPU an inner dimension of :data:`MASKED_MIN_INNER` or more (not :data:`GRAD_MIN_INNER`);
    ``mask`` bool ``[M, K]`` with unit column stride; ``out``, where given, ``[M, K]`` in ``dy``'s
    dtype and TMA-ready."""
    if kernel_path(dy) is KernelPath.TRITON and (dy.shape[0] < GRAD_MIN_ROWS or weight.shape[0] < MASKED_MIN_INNER):
        return False
    if not _applies(dy, weight, weight.shape[1], scaled_g, (scaled_g, lora_a), 1.0):
        return False
    want = (dy.shape[0], weight.shape[1])
    if mask.dtype != torch.bool or tuple(mask.shape) != want or mask.stride(1) != 1:
        return False
    return out is None or (tuple(out.shape) == want and out.dtype == dy.dtype and tma_ready(out))


def rank_by_tma(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel reads the rank term's operands ``u`` ``[M, r]`` and ``v`` (``B`` ``[N, r]``
    in the forward, ``A`` ``[r, K]`` in the backward, as stored) through TMA descriptors, its tile
    loop flattened (``RANK_BY_TMA``; where there is no mask): both TMA-ready and ``r`` padded to at
    most :data:`TMA_RANK_MAX`."""
    return dot_size(u.shape[1]) <= TMA_RANK_MAX and tma_ready(u) and tma_ready(v)


def _launch(a: torch.Tensor, weight: torch.Tensor, w_transposed: bool, bias: torch.Tensor | None, u: torch.Tensor,
            v: torch.Tensor, v_col_stride: int, v_rank_stride: int, scaling: float,
            masked: _Masked | None = None, out: torch.Tensor | None = None, *, tile: tuple[int, int, int] = TILE,
            num_stages: int = NUM_STAGES, num_warps: int = NUM_WARPS, group_m: int = GROUP_M) -> torch.Tensor:  # fmt: skip
    """The kernel's launch (``out`` given: added to, with ``masked`` only); ``tile``, ``num_stages``,
    ``num_warps`` and ``group_m`` other than the tables' only for probes (``benchmarks/experiments``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_rows, n_inner = a.shape
    n_cols = weight.shape[0] if w_transposed else weight.shape[1]
    accumulate = out is not None
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=a.dtype, device=a.device)
    block_m, block_n, block_k = tile
    rank = u.shape[1]
    block_rank = dot_size(rank)
    by_tma = masked is None and rank_by_tma(u, v)
    w_block = [block_n, block_k] if w_transposed else [block_k, block_n]
    out_block = [block_m, block_n if masked is None and not by_tma else block_n // 2]
    programs = persistent_grid(cdiv(n_rows, block_m) * cdiv(n_cols, block_n), a.device)
    mask = out if masked is None else masked.mask
    u_desc = v_desc = None
    if by_tma:
        u_desc = TensorDescriptor.from_tensor(u, [block_m, block_rank])
        v_desc = TensorDescriptor.from_tensor(v, [block_n, block_rank] if w_transposed else [block_rank, block_n])
    _base_and_lora_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]), TensorDescriptor.from_tensor(weight, w_block),
        TensorDescriptor.from_tensor(out, out_block), u_desc, v_desc, u, v, out if bias is None else bias, mask,
        float(scaling), 1.0 / scaling, 1.0 if masked is None else float(masked.factor), n_rows, n_cols, n_inner,
        rank, u.stride(0), v_col_stride, v_rank_stride, mask.stride(0), W_TRANSPOSED=w_transposed,
        HAS_BIAS=bias is not None, MASKED=masked is not None, MASK_BASE=masked is not None and masked.mask_base,
        ACCUMULATE=accumulate, RANK_BY_TMA=by_tma, BLOCK_RANK=block_rank, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=group_m, N_PROGRAMS=programs, num_stages=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out


def base_and_lora_out(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``y = x W^T + b + s xa B^T``, a new ``[M, N]`` tensor in ``x``'s dtype, by the kernel (where
    :func:`fused_applies`; the caller checks). ``x`` ``[M, K]``, ``W`` ``[N, K]``, ``b`` ``[N]``,
    ``xa`` ``[M, r]`` and ``B`` ``[N, r]``."""
    return _launch(x, weight, True, bias, xa, lora_b, lora_b.stride(0), lora_b.stride(1), scaling)


def base_and_lora_grad(
    dy: torch.Tensor, weight: torch.Tensor, scaled_g: torch.Tensor, lora_a: torch.Tensor
) -> torch.Tensor:
    """``dx = dy W + (s G) A``, a new ``[M, K]`` tensor in ``dy``'s dtype, by the kernel (where
    :func:`fused_grad_applies`; the caller checks). ``dy`` ``[M, N]``, ``W`` ``[N, K]``, ``s G``
    ``[M, r]`` (already scaled), ``A`` ``[r, K]``."""
    return _launch(dy, weight, False, None, scaled_g, lora_a, lora_a.stride(1), lora_a.stride(0), 1.0)


def base_and_masked_lora_grad(
    dy: torch.Tensor,
    weight: torch.Tensor,
    scaled_g: torch.Tensor,
    lora_a: torch.Tensor,
    mask: torch.Tensor,
    factor: float,
    *,
    mask_base: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """An input gradient with dropout by the kernel (where :func:`masked_grad_applies`; the caller
    checks): ``dy W + f m ((s G) A)`` (LoRA's), or ``f m (dy W + (s G) A)`` with ``mask_base``
    (DoRA's part through the dropped input), as a new ``[M, K]`` tensor in ``dy``'s dtype, or added
    to ``out`` (returned). ``dy`` ``[M, N]``, ``W`` ``[N, K]``, ``s G`` ``[M, r]`` (already scaled),
    ``A`` ``[r, K]``, ``m`` ``[M, K]`` bool, ``f = 1 / (1 - p)``."""
    masked = _Masked(mask, factor, mask_base)
    return _launch(dy, weight, False, None, scaled_g, lora_a, lora_a.stride(1), lora_a.stride(0), 1.0, masked, out)
