"""A DoRA projection's forward with dropout in one GEMM: ``x W^T`` and ``d(x) W^T`` from one pass
over ``W``, and the output ``y`` and the kept ``z`` formed in its epilogue.

With dropout PEFT's DoRA recomputes the base product on the dropped input ``d(x)``
(:mod:`fk.lora.dora`'s equations: ``zd = d(x) W^T``, ``lr = s xa B^T``, ``z = zd + lr`` and
``y = x W^T + b + (ms - 1) zd + ms lr``). fk's other path runs two cuBLAS GEMMs, writing ``x W^T``
and ``zd`` as ``[M, N]`` tensors, and one pass (:func:`fk.lora.dora_elementwise.dora_dropout_output`)
reads both back and writes ``y`` and ``z``: six ``[M, N]`` trips through memory. Here a persistent
Triton GEMM with TMA descriptors (the two activations, ``W``, ``xa``, ``B`` and both outputs) keeps
two fp32 accumulators a tile, one for ``x W^T`` and one for ``zd``, fed by the same ``W`` tile at
each K step; after the K loop the rank-sized product goes into the ``zd`` accumulator as one more
MMA (so it becomes ``z``, as in :mod:`fk.lora.lora_matmul`), and ``y`` follows from the identity
``(ms - 1) zd + ms lr = ms z - zd``: ``y = (x W^T - zd) + ms z + b``. Only ``y`` and ``z`` are
written: two trips. On an H200 it took 0.95-0.98x the other path's GPU time at Llama-3.1-8B's q/O,
k/v and gate/up, 1.0x at down (whose long K loop leaves the pass a small share;
``benchmarks/experiments/INDEX.md#dora_dropout_matmul``).

Math, per element: ``zd[i, j] = sum_k d(x)[i, k] W[j, k]``, ``z[i, j] = zd[i, j] + s sum_q xa[i, q]
B[j, q]`` and ``y[i, j] = sum_k x[i, k] W[j, k] - zd[i, j] + ms[j] z[i, j] + b[j]``, exact products
summed in fp32, each output rounded once to ``x``'s dtype (the other path rounds ``x W^T``, ``zd``
and ``lr`` to 16 bits before it sums them). The scale enters as ``z = (zd / s + xa B^T) s``, so
that ``xa`` and ``B`` go to the MMA as they are. There is no backward of its own: this runs inside
fk.lora.dora's forward, whose backward reads ``z``, the masks and ``xa``.

:func:`dora_dropout_out_applies` says where the kernel runs (16-bit operands laid out as TMA needs
them, the rank term TMA-readable as :func:`fk.lora.lora_matmul.rank_by_tma` says; on a GPU,
Hopper only, with enough output tiles to fill it; and Triton's interpreter);
:func:`fk.lora.dora._dora_fwd` takes it there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fk.core.launch import cdiv, dot_size, persistent_grid
from fk.core.tiles import exact_dot_add, grouped_tile_offsets, round_to
from fk.lora.lora_matmul import GROUP_M, rank_by_tma, tma_gemm_runs, tma_ready

TILE = (128, 128, 64)
"""(BLOCK_M, BLOCK_N, BLOCK_K): two ``[128, 128]`` fp32 accumulators hold as many registers as
:mod:`fk.lora.lora_matmul`'s one ``[128, 256]``, and each K step's loads (two activation tiles and
one ``W`` tile) feed as many MMAs a byte; the best of five launches at every Llama-3.1-8B projection, 4096
and 16384 tokens (``benchmarks/experiments/INDEX.md#dora_dropout_matmul``)."""
NUM_STAGES, NUM_WARPS = 3, 8
"""Three stages of the three input tiles in shared memory (144 KB, beside the outputs' staging);
8 warps hold the two accumulators."""


def dora_dropout_out_ref(
    x: torch.Tensor,
    dropped: torch.Tensor,
    weight: torch.Tensor,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    ms: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, z)`` in float64: ``z = d(x) W^T + s xa B^T``, ``y = x W^T + (ms - 1) d(x) W^T + ms s xa B^T
    + b`` (PEFT's DoRA output with dropout, :func:`fk.lora.dora.dora_ref`), before the kernel's
    rounding."""
    w = weight.double()
    zd = dropped.double() @ w.t()
    lr = scaling * (xa.double() @ lora_b.double().t())
    ms64 = ms.double()
    y = x.double() @ w.t() + (ms64 - 1) * zd + ms64 * lr
    return (y if bias is None else y + bias.double()), zd + lr


@triton.jit
def _dora_dropout_out_kernel(x_desc, dropped_desc, w_desc, xa_desc, b_desc, y_desc, z_desc, ms_ptr, bias_ptr,
                             scaling, inv_scaling, n_rows, n_cols, n_inner, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, N_PROGRAMS: tl.constexpr):  # fmt: skip
    # Persistent over output tiles in groups of GROUP_M row blocks; the tile loop flattened into the
    # K loop (the pipeliner issues the next tile's loads during this tile's epilogue, as in
    # fk.lora.lora_matmul's RANK_BY_TMA). TMA reads past the edges as zeros and clips the stores.
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N), N_PROGRAMS,
                         flatten=True):  # fmt: skip
        off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        base = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x W^T
        zd = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # d(x) W^T
        for off_k in range(0, n_inner, BLOCK_K):
            w = w_desc.load([off_n, off_k]).T
            base = exact_dot_add(x_desc.load([off_m, off_k]), w, base)
            zd = exact_dot_add(dropped_desc.load([off_m, off_k]), w, zd)
        cols = off_n + tl.arange(0, BLOCK_N)
        ms = tl.load(ms_ptr + cols, mask=cols < n_cols, other=0.0)
        y = base - zd
        z = exact_dot_add(xa_desc.load([off_m, 0]), b_desc.load([off_n, 0]).T, zd * inv_scaling) * scaling
        y += ms[None, :] * z  # (ms - 1) zd + ms lr = ms z - zd
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        z_desc.store([off_m, off_n], round_to(z, z_desc.dtype))
        y_desc.store([off_m, off_n], round_to(y, y_desc.dtype))


def dora_dropout_out_applies(
    x: torch.Tensor,
    dropped: torch.Tensor,
    weight: torch.Tensor,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    ms: torch.Tensor,
    bias: torch.Tensor | None,
) -> bool:
    """Whether :func:`dora_dropout_out` runs for these operands (else the caller's cuBLAS path):
    ``x`` and ``d(x)`` ``[M, K]`` and ``W`` ``[N, K]`` all fp16 or all bf16 and TMA-ready (contiguous
    rows, row strides and starts 16-byte aligned), ``N`` a multiple of 8, ``xa`` ``[M, r]`` and ``B``
    ``[N, r]`` in that dtype and readable as :func:`fk.lora.lora_matmul.rank_by_tma` says (``r``
    padded to at most its ``TMA_RANK_MAX``), ``ms`` ``[N]`` fp32 and ``b`` ``[N]`` contiguous, ``s``
    not 0; where :func:`fk.lora.lora_matmul.tma_gemm_runs` at :data:`TILE` (Triton's interpreter, or
    a Hopper GPU with enough output tiles)."""
    n_rows, n_cols = x.shape[0], weight.shape[0]
    if not tma_gemm_runs(x, n_cols, TILE):
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2 or n_rows == 0 or n_cols % 8 != 0:
        return False
    if any(t.dtype != x.dtype for t in (dropped, weight, xa, lora_b)) or dropped.shape != x.shape or scaling == 0:
        return False
    if ms.dtype != torch.float32 or tuple(ms.shape) != (n_cols,) or ms.stride(0) != 1:
        return False
    if bias is not None and (tuple(bias.shape) != (n_cols,) or bias.stride(0) != 1):
        return False
    return tma_ready(x) and tma_ready(dropped) and tma_ready(weight) and rank_by_tma(xa, lora_b)


def dora_dropout_out(
    x: torch.Tensor,
    dropped: torch.Tensor,
    weight: torch.Tensor,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    ms: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    tile: tuple[int, int, int] = TILE,
    num_stages: int = NUM_STAGES,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A DoRA projection's ``(y, z)`` with dropout by the kernel (where
    :func:`dora_dropout_out_applies`; the caller checks), two new ``[M, N]`` tensors in ``x``'s dtype:
    ``x`` and its dropped input ``d(x)`` ``[M, K]``, ``W`` ``[N, K]``, ``xa = d(x) A^T`` ``[M, r]``,
    ``B`` ``[N, r]``, ``ms = mag / n`` ``[N]`` fp32, ``b`` ``[N]`` or None. ``tile``, ``num_stages``
    and ``num_warps`` other than the tables' only for probes (``benchmarks/experiments``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_rows, n_inner = x.shape
    n_cols = weight.shape[0]
    block_m, block_n, block_k = tile
    block_rank = dot_size(xa.shape[1])
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    z = torch.empty_like(y)
    programs = persistent_grid(cdiv(n_rows, block_m) * cdiv(n_cols, block_n), x.device)
    _dora_dropout_out_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(dropped, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]), TensorDescriptor.from_tensor(xa, [block_m, block_rank]),
        TensorDescriptor.from_tensor(lora_b, [block_n, block_rank]), TensorDescriptor.from_tensor(y, [block_m, block_n]),
        TensorDescriptor.from_tensor(z, [block_m, block_n]), ms, y if bias is None else bias, float(scaling),
        1.0 / scaling, n_rows, n_cols, n_inner, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=GROUP_M, N_PROGRAMS=programs, num_stages=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return y, z
