"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dimension.

Two casting modes, as the model families that use RMSNorm define them:

- ``"llama"`` (Llama, Mistral, Qwen, ...): the inverse RMS and the normalized row are computed in
  fp32, the normalized row is rounded to the input dtype, then multiplied by the weight.
- ``"gemma"`` (Gemma): everything in fp32, with ``offset=1`` (the weight is stored as ``w`` and
  applied as ``1 + w``); the result is rounded once at the end.

The output has the dtype of ``x``; the weight gradient has the dtype of ``weight``. In both modes
the kernels accumulate in fp32.

This file holds, in order: the reference, the Triton kernels, the launchers registered as custom
ops, the functional API :func:`rms_norm` and the module :class:`RMSNorm`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import RowTiling, as_rows, cdiv, row_reduction_grid, row_tiling
from fk.core.ops import define_autograd_op

CASTING_MODES = ("llama", "gemma")


def _default_offset(casting_mode: str, offset: float | None) -> float:
    if offset is not None:
        return float(offset)
    return 1.0 if casting_mode == "gemma" else 0.0


# --- 1. Reference ---------------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    casting_mode: str = "llama",
    offset: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch RMSNorm over the last dimension (computes in fp32, or fp64 for fp64 input).

    This is the definition the kernels are tested against.
    """
    offset = _default_offset(casting_mode, offset)
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xhat.to(x.dtype)
    scale = weight.to(compute) + offset
    if casting_mode == "llama":
        # Round the normalized row to the input dtype first, as Hugging Face's LlamaRMSNorm does.
        return (xhat.to(x.dtype).to(compute) * scale).to(x.dtype)
    return (xhat * scale).to(x.dtype)


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Notation, per row of H elements: r = 1 / sqrt(mean(x^2) + eps) (saved by the forward, fp32),
# xhat = x * r, s = offset + w, y = xhat * s.
#
# Backward, with g = dy * s:
#   dr/dx_i   = -r^3 x_i / H
#   dx_i      = r g_i + sum_j g_j x_j dr/dx_i = r * (g_i - xhat_i * c),   c = (1/H) sum_j g_j xhat_j
#   dw_j      = sum over rows of dy_j * xhat_j
# In "llama" mode the rounding of xhat to the input dtype is treated as the identity, as autograd
# treats a dtype cast; the kernels use the unrounded fp32 xhat, which is closer to exact.
#
# The weight gradient is a column sum over all rows. The backward runs a persistent grid: program p
# strides over row tiles p, p+P, ... and keeps its share of dw in fp32 registers (or, for rows too
# wide for one tile, in its own row of the fp32 partial buffer), then writes one row of a [P, H]
# partial buffer that a final sum reduces. No atomics, a bounded number of partial rows, and no
# weight-gradient work at all when COMPUTE_DW is False.


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # [M, H] input, row stride x_row_stride, unit column stride
    w_ptr,  # [H] weight (unused when HAS_WEIGHT is False)
    y_ptr,  # [M, H] output, contiguous
    rstd_ptr,  # [M] fp32 output: 1 / sqrt(mean(x^2) + eps), saved for the backward
    n_rows,
    n_cols,
    x_row_stride,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    GEMMA: tl.constexpr,  # all-fp32 product (gemma) instead of rounding xhat first (llama)
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program (1 when LOOPED)
    LOOPED: tl.constexpr,  # the row is wider than BLOCK_COLS: two passes over column tiles
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * n_cols
    cols = tl.arange(0, BLOCK_COLS)
    if not LOOPED:
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        xhat = x * rstd[:, None]
        if HAS_WEIGHT:
            s = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
            if not GEMMA:
                xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
            xhat = xhat * s[None, :]
        tl.store(y_rows + cols[None, :], xhat.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_COLS):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        for start in range(0, n_cols, BLOCK_COLS):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                s = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32) + offset
                if not GEMMA:
                    xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
                xhat = xhat * s[None, :]
            tl.store(y_rows + c[None, :], xhat.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,  # [M, H] upstream gradient, row stride dy_row_stride, unit column stride
    x_ptr,  # [M, H] forward input, row stride x_row_stride, unit column stride
    w_ptr,  # [H] weight (unused when HAS_WEIGHT is False)
    rstd_ptr,  # [M] fp32, from the forward
    dx_ptr,  # [M, H] output, contiguous
    dw_partial_ptr,  # [P, H] fp32 output, one row per program (unused when COMPUTE_DW is False)
    n_rows,
    n_cols,
    dy_row_stride,
    x_row_stride,
    offset,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per tile (1 when LOOPED)
    LOOPED: tl.constexpr,  # the row is wider than BLOCK_COLS: two passes over column tiles
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    partial_row = dw_partial_ptr + pid.to(tl.int64) * n_cols
    if not LOOPED:
        col_mask = cols < n_cols
        s = tl.full([BLOCK_COLS], 1.0, tl.float32)
        if HAS_WEIGHT:
            s = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            xhat = x * rstd[:, None]
            g = dy * s[None, :]
            c = tl.sum(g * xhat, axis=1) / n_cols
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows64 * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
        if COMPUTE_DW:
            tl.store(partial_row + cols, dw_acc, mask=col_mask)
    else:
        for row in range(pid, n_rows, n_programs):
            row64 = tl.cast(row, tl.int64)
            x_row = x_ptr + row64 * x_row_stride
            dy_row = dy_ptr + row64 * dy_row_stride
            dx_row = dx_ptr + row64 * n_cols
            rstd = tl.load(rstd_ptr + row)
            # Pass 1: c = (1/H) sum_j g_j xhat_j. Pass 2 re-reads the row, mostly from L2.
            gx = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c_idx = start + cols
                m = c_idx < n_cols
                # evict_last: keep the row in L2 for pass 2.
                x = tl.load(x_row + c_idx, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                dy = tl.load(dy_row + c_idx, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                s = tl.full([BLOCK_COLS], 1.0, tl.float32)
                if HAS_WEIGHT:
                    s = tl.load(w_ptr + c_idx, mask=m, other=0.0).to(tl.float32) + offset
                gx += dy * s * x
            c = tl.sum(gx, axis=0) * rstd / n_cols
            # Pass 2 walks the tiles backwards: the ones pass 1 read last are likeliest in L2.
            n_col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
            for back in range(0, n_col_tiles):
                c_idx = (n_col_tiles - 1 - back) * BLOCK_COLS + cols
                m = c_idx < n_cols
                # Last use of x and dy: evict_first. dx streams out without displacing them.
                x = tl.load(x_row + c_idx, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
                dy = tl.load(dy_row + c_idx, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
                s = tl.full([BLOCK_COLS], 1.0, tl.float32)
                if HAS_WEIGHT:
                    s = tl.load(w_ptr + c_idx, mask=m, other=0.0).to(tl.float32) + offset
                xhat = x * rstd
                dx = (dy * s - xhat * c) * rstd
                tl.store(dx_row + c_idx, dx.to(dx_ptr.dtype.element_ty), mask=m, eviction_policy="evict_first")
                if COMPUTE_DW:
                    # This program's own partial row (no other program touches it), kept in L2.
                    acc = tl.load(partial_row + c_idx, mask=m, other=0.0, eviction_policy="evict_last")
                    tl.store(partial_row + c_idx, acc + dy * xhat, mask=m, eviction_policy="evict_last")


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

# Launch parameters (benchmarks/tune_rms_norm.py sweeps them on a GPU).
FWD_MAX_BLOCK_COLS = 32768  # widest row the forward holds in one tile
FWD_MIN_TILE = 4096  # narrow rows are grouped into tiles of at least this many elements
FWD_ELEMENTS_PER_WARP = 512
BWD_MAX_BLOCK_COLS = 16384  # the backward holds x, dy, s and dw: four fp32 tiles
BWD_MIN_TILE = 2048
BWD_PROGRAMS_PER_SM = 2  # rows that fit one tile
BWD_LOOPED_PROGRAMS_PER_SM = 1  # wider rows: few programs, so the rows they re-read stay in L2
BWD_ELEMENTS_PER_WARP = 256


@functools.lru_cache(maxsize=256)
def _fwd_tiling(n_cols: int) -> RowTiling:
    return row_tiling(n_cols, max_block_cols=FWD_MAX_BLOCK_COLS, min_tile_elements=FWD_MIN_TILE,
                      elements_per_warp=FWD_ELEMENTS_PER_WARP, name="x")  # fmt: skip


@functools.lru_cache(maxsize=256)
def _bwd_tiling(n_cols: int) -> RowTiling:
    return row_tiling(n_cols, max_block_cols=BWD_MAX_BLOCK_COLS, min_tile_elements=BWD_MIN_TILE,
                      elements_per_warp=BWD_ELEMENTS_PER_WARP, name="x")  # fmt: skip


def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher: returns (y with x's shape and dtype, rstd fp32 with shape x.shape[:-1])."""
    n_cols = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    x_rows = as_rows(x)
    n_rows = x_rows.shape[0]
    if n_rows == 0:
        return y, rstd
    tiling = _fwd_tiling(n_cols)
    grid = (cdiv(n_rows, tiling.rows_per_tile),)
    _rms_norm_fwd_kernel[grid](
        x_rows, weight if weight is not None else x_rows, y, rstd,
        n_rows, n_cols, x_rows.stride(0), eps, offset,
        HAS_WEIGHT=weight is not None, GEMMA=gemma,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    return y, rstd


def _rms_norm_fwd_fake(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def dw_partial_rows(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Rows of the fp32 partial buffer the backward allocates for the weight gradient."""
    return row_reduction_grid(n_rows, _bwd_tiling(n_cols), device, BWD_PROGRAMS_PER_SM, BWD_LOOPED_PROGRAMS_PER_SM)


def _rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward launcher: returns (dx with x's shape and dtype, dw, or an empty tensor when not computed)."""
    n_cols = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    compute_dw = compute_dw and weight is not None
    x_rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows = x_rows.shape[0]
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw and weight is not None else x.new_empty(0)
        return dx, dw
    tiling = _bwd_tiling(n_cols)
    n_programs = dw_partial_rows(n_rows, n_cols, x.device)
    if compute_dw:
        alloc = torch.zeros if tiling.looped else torch.empty
        partial = alloc((n_programs, n_cols), dtype=torch.float32, device=x.device)
    else:
        partial = rstd  # never read or written: COMPUTE_DW is False
    _rms_norm_bwd_kernel[(n_programs,)](
        dy_rows, x_rows, weight if weight is not None else x_rows, rstd, dx, partial,
        n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0), offset,
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw,
        BLOCK_COLS=tiling.block_cols, ROWS=tiling.rows_per_tile, LOOPED=tiling.looped,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    if not compute_dw:
        return dx, x.new_empty(0)
    assert weight is not None
    return dx, partial.sum(0).to(weight.dtype)


def _rms_norm_bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if compute_dw and weight is not None:
        return dx, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return dx, x.new_empty(0)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, _eps, offset, _gemma = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None, _drstd: Any) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if dy is None or not (need_dx or need_dw):
        return None, None, None, None, None
    dx, dw = run_backward(dy, x, weight, rstd, ctx.offset, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None


_rms_norm = define_autograd_op(
    __name__, "rms_norm",
    forward=_rms_norm_fwd, forward_fake=_rms_norm_fwd_fake,
    backward_launcher=_rms_norm_bwd, backward_fake=_rms_norm_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    casting_mode: str = "llama",
    offset: float | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.

    Args:
        x: input of shape ``(..., H)``, fp32/fp16/bf16, any strides.
        weight: ``(H,)`` scale, or None for no affine transform.
        eps: added to the mean square before the square root; > 0.
        casting_mode: ``"llama"`` (round the normalized row to x's dtype before scaling) or
            ``"gemma"`` (all fp32, rounded once).
        offset: added to the weight before scaling; defaults to 1.0 for ``"gemma"`` (its weights
            are stored zero-centred) and 0.0 for ``"llama"``.

    Returns a tensor of x's shape and dtype. The weight gradient is computed only when ``weight``
    requires grad: a frozen weight costs no backward work or memory.
    """
    validate.check_tensor("x", x)
    validate.check_dtype("x", x)
    validate.check_min_ndim("x", x, 1)
    validate.check_choice("casting_mode", casting_mode, CASTING_MODES)
    eps = validate.check_positive_float("eps", eps)
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, (int, float))):
        raise TypeError(f"offset must be a float or None, got {type(offset).__name__}")
    if offset is not None and not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset}")
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight is not None:
        validate.check_tensor("weight", weight)
        validate.check_dtype("weight", weight)
        validate.check_shape("weight", weight, (x.shape[-1],))
        validate.check_same_device("weight", weight, "x", x)
    if not uses_kernel(x):
        return rms_norm_ref(x, weight, eps, casting_mode, offset)
    y, _ = _rms_norm(x, weight, eps, _default_offset(casting_mode, offset), casting_mode == "gemma")
    return y


# --- 5. Module ------------------------------------------------------------------------------------


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in for ``torch.nn.RMSNorm`` (same constructor and state_dict) running fk's kernels.

    Extra keyword arguments ``casting_mode`` and ``offset`` are as in :func:`rms_norm`. As in
    PyTorch, ``eps=None`` means ``torch.finfo(x.dtype).eps``; a multi-dimensional
    ``normalized_shape`` normalizes over all of its trailing dimensions.
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        casting_mode: str = "llama",
        offset: float | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.casting_mode = validate.check_choice("casting_mode", casting_mode, CASTING_MODES)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        if tuple(x.shape[x.ndim - len(shape) :]) != shape:
            raise ValueError(f"x must end with the dimensions {shape}, got shape {tuple(x.shape)}")
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        weight = self.weight
        if len(shape) != 1:
            x_flat = x.reshape(*x.shape[: x.ndim - len(shape)], -1)
            w_flat = weight.reshape(-1) if weight is not None else None
            y = rms_norm(x_flat, w_flat, eps, casting_mode=self.casting_mode, offset=self.offset)
            return y.reshape(x.shape)
        return rms_norm(x, weight, eps, casting_mode=self.casting_mode, offset=self.offset)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, casting_mode={self.casting_mode!r}"
