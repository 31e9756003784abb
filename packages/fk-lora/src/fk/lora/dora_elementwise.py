"""DoRA's elementwise passes over ``[M, N]``: each group in one read and one write, fp32 in registers.

A DoRA projection (:mod:`fk.lora.dora`, whose notation this file keeps: ``ms = mag / n`` ``[N]``
fp32, ``zd = d(x2) W^T``, ``lr = s xa B^T``, ``z`` what ``ms`` multiplies, ``c`` the compute dtype)
scales its matmuls' ``[M, N]`` outputs column by column. With torch ops each scale or sum is a
pass of its own, and the fp32 ones (the forward's sum, the magnitude's column sum) go through fp32
copies of ``[M, N]``. The kernels here do each group in one pass:

- :func:`dora_scaled_output` (forward without dropout, and the MLP backward's recomputation):
  ``y = ms z + b`` in fp32, rounded once; reads ``z``, writes ``y``. (``torch.mul`` of a
  ``[M, N]`` tensor in ``c`` by an fp32 ``[N]`` into ``c`` takes TensorIterator's slow path for
  mixed dtypes, at about a quarter of the copy bandwidth.)
- :func:`dora_dropout_output` (forward, with dropout): ``y = x2 W^T + (ms - 1) zd + ms lr + b``
  summed in fp32 and rounded once, and ``z = zd + lr``; reads two ``[M, N]`` tensors in ``c`` and
  writes two over them. ``lr`` is formed tile by tile in registers from its rank-sized factors
  (``tl.dot`` in fp32, rounded to ``c`` as the matmul that wrote it rounded it), never written.
- :func:`dora_grad_terms` (backward): ``dmag = colsum(dy * z) / n`` and ``db = colsum(dy)`` (fp32
  partial column sums per program, then :func:`fk.core.reduce.sum_rows_pair`), with
  ``dy_ms = ms * dy`` and ``dy_ms1 = (ms - 1) * dy`` (each one fp32 product rounded to ``c``,
  as ``torch.mul`` rounds it); reads ``dy`` and ``z``, writes the two scaled gradients.

None has a backward of its own: they run inside fk.lora's DoRA autograd functions. Off Triton's
path (a CPU tensor without the interpreter) and under ``torch.compile`` they are the torch
expressions they replace (:func:`dora_scaled_output_torch`, :func:`dora_dropout_output_torch`,
:func:`dora_grad_terms_torch`).

This file holds, in order: the float64 references and the torch expressions, the kernels, their
launch table, the launchers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.backend import uses_kernel
from fk.core.launch import as_rows, cdiv, column_strip_grid, writable_rows
from fk.core.matmul import column_sum, scaled_mm
from fk.core.reduce import sum_rows, sum_rows_pair
from fk.core.tiles import exact_dot, grid_tile, round_to

# --- 1. References and the torch expressions ------------------------------------------------------


class LowRank(NamedTuple):
    """``lr = s xa B^T`` ``[M, N]`` as its factors."""

    xa: torch.Tensor
    """``[M, r]`` in ``c``."""
    B: torch.Tensor
    """``[N, r]`` in ``c``."""
    scaling: float
    """``s``."""

    def product(self) -> torch.Tensor:
        """``lr`` in ``c``: one matmul, scaled and rounded once (:func:`fk.core.matmul.scaled_mm`)."""
        return scaled_mm(self.xa, self.B.t(), self.scaling, self.xa.dtype)


def dora_scaled_output_ref(z: torch.Tensor, ms: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``ms z + b`` in float64: what :func:`dora_scaled_output` rounds."""
    y = z.double() * ms.double()
    return y if bias is None else y + bias.double()


def dora_scaled_output_torch(z: torch.Tensor, ms: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`dora_scaled_output` in torch ops: one mixed-dtype pass, computed in fp32 (``ms``'s
    dtype) and rounded once to ``z``'s."""
    y = torch.empty_like(z)
    return torch.mul(z, ms, out=y) if bias is None else torch.addcmul(bias, z, ms, out=y)


def dora_dropout_output_ref(
    base: torch.Tensor, zd: torch.Tensor, low_rank: LowRank, ms: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base + (ms - 1) zd + ms lr + b, zd + lr)`` in float64: what :func:`dora_dropout_output` rounds."""
    lr = low_rank.scaling * (low_rank.xa.double() @ low_rank.B.double().t())
    base, zd, ms = base.double(), zd.double(), ms.double()
    y = base + (ms - 1) * zd + ms * lr
    return (y if bias is None else y + bias.double()), zd + lr


def dora_dropout_output_torch(
    base: torch.Tensor, zd: torch.Tensor, low_rank: LowRank, ms: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dora_dropout_output` in torch ops: ``lr`` written by a matmul, the sum in an fp32
    ``[M, N]`` buffer, a pass a term."""
    lr = low_rank.product()
    y32 = base.float().addcmul_(zd, ms - 1).addcmul_(lr, ms)
    if bias is not None:
        y32.add_(bias)
    return y32.to(base.dtype), zd.add_(lr)


GradDtypes = tuple[torch.dtype | None, torch.dtype | None]
"""The dtypes of a projection's magnitude and bias gradients, None for one not wanted."""


class DoRAGradTerms(NamedTuple):
    """What :func:`dora_grad_terms` forms from ``dy``; None where not asked for."""

    magnitude: torch.Tensor | None
    """``dmag = colsum(dy * z) / n`` ``[N]``, in the magnitude's dtype."""
    bias: torch.Tensor | None
    """``db = colsum(dy)`` ``[N]``, in the bias's dtype."""
    dy_ms: torch.Tensor | None
    """``ms * dy`` ``[M, N]`` in ``c``."""
    dy_ms1: torch.Tensor | None
    """``(ms - 1) * dy`` ``[M, N]`` in ``c``."""


def dora_grad_terms_ref(
    dy: torch.Tensor, z: torch.Tensor, ms: torch.Tensor, norm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(colsum(dy * z) / n, colsum(dy), ms * dy, (ms - 1) * dy)`` in float64."""
    dy, z, ms = dy.double(), z.double(), ms.double()
    return (dy * z).sum(0) / norm.double(), dy.sum(0), ms * dy, (ms - 1) * dy


def dora_grad_terms_torch(
    dy: torch.Tensor,
    z: torch.Tensor,
    ms: torch.Tensor,
    norm: torch.Tensor,
    dtypes: GradDtypes,
    want: tuple[bool, bool],
) -> DoRAGradTerms:
    """:func:`dora_grad_terms` in torch ops: four passes over ``dy``, the first through fp32 copies."""
    magnitude_dtype, bias_dtype = dtypes
    dmag = (column_sum(dy.float() * z) / norm).to(magnitude_dtype) if magnitude_dtype is not None else None
    db = column_sum(dy).to(bias_dtype) if bias_dtype is not None else None
    dy_ms = torch.mul(dy, ms, out=torch.empty_like(dy)) if want[0] else None  # fp32 product, rounded once to c
    dy_ms1 = torch.mul(dy, ms - 1, out=torch.empty_like(dy)) if want[1] else None
    return DoRAGradTerms(dmag, db, dy_ms, dy_ms1)


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Forward without dropout, per element (i, j), in fp32 from c, one rounding to c:
#   y[i, j] = ms_j z[i, j] + b_j
# Forward with dropout, per element (i, j), all in fp32 from c, one rounding to c per output:
#   lr[i, j] = c(s sum_k xa[i, k] B[j, k])                              (c(): rounded to c)
#   y[i, j] = base[i, j] + (ms_j - 1) zd[i, j] + ms_j lr[i, j] + b_j    (added in that order)
#   z[i, j] = zd[i, j] + lr[i, j]
# Backward, with dy [M, N]; n is detached and ms = mag / n, so d/dmag_j = (1 / n_j) d/dms_j:
#   dmag_j = (sum_i dy[i, j] z[i, j]) / n_j ;  db_j = sum_i dy[i, j]
#   dy_ms[i, j] = ms_j dy[i, j] ;  dy_ms1[i, j] = (ms_j - 1) dy[i, j]
# A backward program owns a strip of columns and every P-th tile of rows; it adds its tiles' dy z
# and dy in fp32 registers and writes one partial row of each (dmag's divided by n), which
# sum_rows_pair then adds over the P programs and rounds to the parameters' dtypes.


@triton.jit
def _dora_scaled_output_kernel(
    z_ptr,  # [M, N] in c
    ms_ptr,  # [N] fp32
    bias_ptr,  # [N] b (read only when HAS_BIAS)
    y_ptr,  # [M, N] out, c, contiguous
    n_rows,
    n_cols,
    z_row_stride,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    z = tl.load(z_ptr + rows[:, None] * z_row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = z * tl.load(ms_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], round_to(y, y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dora_dropout_output_kernel(
    base_ptr,  # [M, N] x2 W^T in c; y is written over it (y_ptr)
    zd_ptr,  # [M, N] d(x2) W^T in c; z is written over it (z_ptr)
    xa_ptr,  # [M, r] in c
    b_ptr,  # [N, r] B in c
    ms_ptr,  # [N] fp32
    bias_ptr,  # [N] b (read only when HAS_BIAS)
    y_ptr,  # [M, N] out, c
    z_ptr,  # [M, N] out, c
    n_rows,
    n_cols,
    rank,
    base_row_stride,
    zd_row_stride,
    xa_row_stride,
    b_row_stride,
    y_row_stride,
    z_row_stride,
    scaling,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    product = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_RANK):  # the rank, padded to BLOCK_RANK with zeros
        ks = k0 + tl.arange(0, BLOCK_RANK)
        k_ok = ks < rank
        xa = tl.load(xa_ptr + rows[:, None] * xa_row_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        bt = tl.load(b_ptr + cols[None, :].to(tl.int64) * b_row_stride + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        # Exact products summed in fp32, as fk.lora.masked_low_rank (16-bit operands on the tensor cores).
        product += exact_dot(xa, bt)
    lr = round_to(product * scaling, y_ptr.dtype.element_ty).to(tl.float32)  # as the matmul rounded it
    ms = tl.load(ms_ptr + cols, mask=col_ok, other=0.0)[None, :]
    base = tl.load(base_ptr + rows[:, None] * base_row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    zd = tl.load(zd_ptr + rows[:, None] * zd_row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = base + zd * (ms - 1.0)
    y += lr * ms
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], round_to(y, y_ptr.dtype.element_ty), mask=ok)
    tl.store(z_ptr + rows[:, None] * z_row_stride + cols[None, :], round_to(zd + lr, z_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dora_grad_terms_kernel(
    dy_ptr,  # [M, N] in c (row stride dy_row_stride, 0 for an expanded gradient)
    z_ptr,  # [M, N] in c (read only when COMPUTE_DMAG)
    ms_ptr,  # [N] fp32
    norm_ptr,  # [N] fp32 n (read only when COMPUTE_DMAG)
    dy_ms_ptr,  # [M, N] out, c, contiguous (written only when WRITE_DY_MS)
    dy_ms1_ptr,  # [M, N] out, c, contiguous (written only when WRITE_DY_MS1)
    partials_ptr,  # [groups, P, N] fp32: dmag's partial rows (if COMPUTE_DMAG), then db's (if COMPUTE_DB)
    n_rows,
    n_cols,
    dy_row_stride,
    z_row_stride,
    COMPUTE_DMAG: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    WRITE_DY_MS: tl.constexpr,
    WRITE_DY_MS1: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    program, n_programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    ms = tl.load(ms_ptr + cols, mask=col_ok, other=0.0)[None, :]
    dy_z = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    dy_sum = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for tile in range(program, tl.cdiv(n_rows, BLOCK_ROWS), n_programs):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        ok = (rows < n_rows)[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if COMPUTE_DMAG:
            z = tl.load(z_ptr + rows[:, None] * z_row_stride + cols[None, :], mask=ok, other=0.0)
            dy_z += dy * z.to(tl.float32)
        if COMPUTE_DB:
            dy_sum += dy
        out = rows[:, None] * n_cols + cols[None, :]
        if WRITE_DY_MS:
            tl.store(dy_ms_ptr + out, round_to(dy * ms, dy_ms_ptr.dtype.element_ty), mask=ok)
        if WRITE_DY_MS1:
            tl.store(dy_ms1_ptr + out, round_to(dy * (ms - 1.0), dy_ms1_ptr.dtype.element_ty), mask=ok)
    row = partials_ptr + program * n_cols + cols
    if COMPUTE_DMAG:
        norm = tl.load(norm_ptr + cols, mask=col_ok, other=1.0)
        tl.store(row, tl.sum(dy_z, axis=0) / norm, mask=col_ok)
        row += n_programs * n_cols
    if COMPUTE_DB:
        tl.store(row, tl.sum(dy_sum, axis=0), mask=col_ok)


# --- 3. Launch table ------------------------------------------------------------------------------


class LaunchParams(NamedTuple):
    block_rows: int  # rows of a tile
    block_cols: int  # columns of a tile (a backward program's strip)
    block_rank: int  # forward: the rank step of lr's tl.dot (its smallest)
    num_warps: int
    programs_per_sm: int  # backward: programs (row groups x column strips) per multiprocessor


# All are streaming passes: a tile of 4096 elements, 32 a thread over 4 warps, keeps enough loads
# in flight. The backward's row groups are sized so the grid is a few waves of programs, each
# writing one fp32 partial row per sum (a few MiB in all, read back from L2 by sum_rows_pair).
# xa and B are rank-sized and come from L2 for every forward tile. Tuned on an H200 at
# Llama-3.1-8B shapes (benchmarks/tune_dora.py, INDEX.md#dora_launch):
# - scale: the first guess was best or within 1% everywhere;
# - forward: tiles twice as tall over 8 warps, best at five of six shapes (the lr tl.dot's tile of
#   64 rows keeps the tensor cores busier);
# - backward: the same tiles, 8 programs a multiprocessor: within 1% of the best at q/o and
#   gate/up (the shapes that take most of the time), 10-15% slower than the best at k/v.
LAUNCH = {
    "scale": LaunchParams(block_rows=32, block_cols=128, block_rank=0, num_warps=4, programs_per_sm=0),
    "forward": LaunchParams(block_rows=64, block_cols=128, block_rank=16, num_warps=8, programs_per_sm=0),
    "backward": LaunchParams(block_rows=64, block_cols=128, block_rank=0, num_warps=8, programs_per_sm=8),
}


# --- 4. Launchers ---------------------------------------------------------------------------------


def on_kernel_path(t: torch.Tensor) -> bool:
    """Whether DoRA's kernels (here and in :mod:`fk.lora.dora_glu`) take ``t``: a Triton path, not
    under ``torch.compile`` (which gets the torch expressions), and not empty."""
    return uses_kernel(t) and not torch.compiler.is_compiling() and t.numel() > 0


def dora_scaled_output(z: torch.Tensor, ms: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A DoRA projection's output without dropout, ``y = ms z + b`` (in fp32, rounded once to
    ``z``'s dtype ``c``), a new tensor: one pass over ``z`` ``[..., N]`` (any row stride), ``ms``
    ``[N]`` fp32, ``bias`` ``[N]`` or None."""
    if not on_kernel_path(z):
        return dora_scaled_output_torch(z, ms, bias)
    z_rows = as_rows(z)
    n_rows, n_cols = z_rows.shape
    y = torch.empty((n_rows, n_cols), dtype=z.dtype, device=z.device)
    params = LAUNCH["scale"]
    grid = (cdiv(n_rows, params.block_rows), cdiv(n_cols, params.block_cols))
    _dora_scaled_output_kernel[grid](
        z_rows, ms, bias if bias is not None else ms, y, n_rows, n_cols, z_rows.stride(0),
        HAS_BIAS=bias is not None, BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols,
        num_warps=params.num_warps,
    )  # fmt: skip
    return y.view(z.shape)


def dora_dropout_output(
    base: torch.Tensor, zd: torch.Tensor, low_rank: LowRank, ms: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A DoRA projection's output with dropout and what its backward keeps: ``(y, z)`` with
    ``y = base + (ms - 1) zd + ms lr + b`` (summed in fp32, rounded once) and ``z = zd + lr``,
    ``lr`` the product of ``low_rank`` rounded to ``c``.

    ``base`` and ``zd`` ``[M, N]`` and ``low_rank``'s factors in one dtype ``c``; ``ms`` ``[N]``
    fp32; ``bias`` ``[N]`` or None. ``base`` and ``zd`` are consumed: ``z`` is ``zd`` updated in
    place, and on Triton's path ``y`` is written over ``base`` (one kernel, ``lr`` formed in it);
    elsewhere ``lr`` is a matmul's output and ``y`` a new tensor.
    """
    base_rows, zd_rows = writable_rows(base), writable_rows(zd)
    if base_rows is None or zd_rows is None or not on_kernel_path(base):
        return dora_dropout_output_torch(base, zd, low_rank, ms, bias)
    xa, B = as_rows(low_rank.xa), as_rows(low_rank.B)
    n_rows, n_cols = base_rows.shape
    params = LAUNCH["forward"]
    grid = (cdiv(n_rows, params.block_rows), cdiv(n_cols, params.block_cols))
    _dora_dropout_output_kernel[grid](
        base_rows, zd_rows, xa, B, ms, bias if bias is not None else ms, base_rows, zd_rows,
        n_rows, n_cols, xa.shape[1],
        base_rows.stride(0), zd_rows.stride(0), xa.stride(0), B.stride(0), base_rows.stride(0), zd_rows.stride(0),
        low_rank.scaling,
        HAS_BIAS=bias is not None, BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols,
        BLOCK_RANK=params.block_rank, num_warps=params.num_warps,
    )  # fmt: skip
    return base, zd


def dora_grad_terms(
    dy: torch.Tensor,
    z: torch.Tensor,
    ms: torch.Tensor,
    norm: torch.Tensor,
    dtypes: GradDtypes,
    want: tuple[bool, bool],
) -> DoRAGradTerms:
    """The terms of a DoRA projection's backward that are formed from ``dy`` alone (and ``z``), in
    one pass over ``dy`` on Triton's path: see :class:`DoRAGradTerms`.

    ``dy`` and ``z`` ``[M, N]`` in ``c`` (``dy`` of any row stride); ``ms`` and ``norm`` ``[N]`` fp32.
    ``dtypes``: the magnitude's and the bias's dtype, None for a gradient not wanted (then neither
    computed nor allocated for); ``want``: whether ``dy_ms`` and ``dy_ms1`` are.
    """
    magnitude_dtype, bias_dtype = dtypes
    compute_dmag, compute_db = magnitude_dtype is not None, bias_dtype is not None
    if not on_kernel_path(dy) or not (compute_dmag or compute_db or any(want)):
        return dora_grad_terms_torch(dy, z, ms, norm, dtypes, want)
    dy_rows = as_rows(dy)
    z_rows = as_rows(z) if compute_dmag else dy_rows
    n_rows, n_cols = dy_rows.shape
    params = LAUNCH["backward"]
    programs, strips = column_strip_grid(
        n_rows, n_cols, params.block_rows, params.block_cols, dy.device, params.programs_per_sm
    )
    groups = int(compute_dmag) + int(compute_db)
    partials = torch.empty((groups, programs, n_cols), dtype=torch.float32, device=dy.device) if groups else ms
    dy_ms = torch.empty((n_rows, n_cols), dtype=dy.dtype, device=dy.device) if want[0] else None
    dy_ms1 = torch.empty((n_rows, n_cols), dtype=dy.dtype, device=dy.device) if want[1] else None
    _dora_grad_terms_kernel[(programs, strips)](
        dy_rows, z_rows, ms, norm, dy_ms if dy_ms is not None else dy_rows, dy_ms1 if dy_ms1 is not None else dy_rows,
        partials, n_rows, n_cols, dy_rows.stride(0), z_rows.stride(0),
        COMPUTE_DMAG=compute_dmag, COMPUTE_DB=compute_db, WRITE_DY_MS=want[0], WRITE_DY_MS1=want[1],
        BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, num_warps=params.num_warps,
    )  # fmt: skip
    dmag = db = None
    if compute_dmag and compute_db:
        assert magnitude_dtype is not None and bias_dtype is not None
        dmag, db = sum_rows_pair(partials, magnitude_dtype, bias_dtype)
    elif compute_dmag:
        assert magnitude_dtype is not None
        dmag = sum_rows(partials[0], magnitude_dtype)
    elif compute_db:
        assert bias_dtype is not None
        db = sum_rows(partials[0], bias_dtype)
    shape = dy.shape
    return DoRAGradTerms(
        dmag, db, None if dy_ms is None else dy_ms.view(shape), None if dy_ms1 is None else dy_ms1.view(shape)
    )
