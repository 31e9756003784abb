"""DoRA's gate and up scalings fused with the gated activation of a DoRA MLP
(:class:`fk.lora.dora.DoRAMLP`) whose gate and up have no dropout.

In :mod:`fk.lora.dora`'s notation, gate and up are ``ms_g * z_g + b_g`` and ``ms_u * z_u + b_u``
(``z`` kept from the forward, ``[M, I]`` in ``c``; ``ms = mag / n`` fp32) and ``h = act(gate) * up``.
Composed from :func:`fk.lora.dora_elementwise.dora_scaled_output`, fk.glu's kernels and
:func:`fk.lora.dora_elementwise.dora_grad_terms`, the forward writes gate and up and reads them
back (7 passes over ``[M, I]``), and the backward recomputes them and ``h``, writes ``dg`` and
``du`` and reads them back for DoRA's terms (18 passes). The kernels here form gate and up in
registers from ``z`` and never write them:

- :func:`dora_gated_act`: ``h``; reads ``z_g`` and ``z_u``, writes ``h`` (3 passes). The forward's,
  and the backward's recomputation of ``h`` for the down projection.
- :func:`dora_gated_act_grad_terms`: from ``dh``, each of gate's and up's DoRA terms as
  :func:`fk.lora.dora_elementwise.dora_grad_terms` forms them from its ``dy`` (``dmag``, ``db``,
  ``ms * dy``); reads ``dh``, ``z_g`` and ``z_u``, writes the two scaled gradients (5 passes).

Gate and up are rounded to ``c`` in registers before the activation, as the composed path stores
them, so ``h`` is the same. ``dg`` and ``du`` stay in fp32 (the composed path rounds them to ``c``
before scaling and summing them): one rounding fewer.

Neither has a backward of its own. Off Triton's path (a CPU tensor without the interpreter) and
under ``torch.compile`` they are the composition above (:func:`dora_gated_act_torch`,
:func:`dora_gated_act_grad_terms_torch`).

This file holds, in order: the float64 references and the torch expressions, the kernels, their
launch table, the launchers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core.launch import as_rows, cdiv, column_strip_grid
from fk.core.reduce import sum_rows_pair
from fk.core.tiles import grid_tile, round_to
from fk.glu import (
    activation_and_derivative,
    activation_code,
    gated_act_backward,
    gated_act_backward_ref,
    gated_act_forward,
    gated_act_ref,
)
from fk.lora.dora_elementwise import (
    DoRAGradTerms,
    GradDtypes,
    dora_grad_terms_torch,
    dora_scaled_output,
    dora_scaled_output_ref,
    on_kernel_path,
)

# --- 1. References and the torch expressions ------------------------------------------------------


class ScaledProjection(NamedTuple):
    """Gate's or up's DoRA scaling: its output is ``ms * z + bias``."""

    z: torch.Tensor
    """``[M, I]`` in ``c``."""
    ms: torch.Tensor
    """``mag / n`` ``[I]`` fp32."""
    norm: torch.Tensor
    """``n`` ``[I]`` fp32 (``dmag``'s divisor)."""
    bias: torch.Tensor | None
    """``[I]`` or None."""


def _rounded_output_ref(p: ScaledProjection) -> torch.Tensor:
    """The projection's output, rounded to ``c`` (as the kernels round it), in float64."""
    return dora_scaled_output_ref(p.z, p.ms, p.bias).to(p.z.dtype).double()


def dora_gated_act_ref(gate: ScaledProjection, up: ScaledProjection, activation: str) -> torch.Tensor:
    """``h`` in float64 from gate's and up's outputs rounded to ``c``."""
    return gated_act_ref(_rounded_output_ref(gate), _rounded_output_ref(up), activation)


def dora_gated_act_grad_terms_ref(
    dh: torch.Tensor, gate: ScaledProjection, up: ScaledProjection, activation: str
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Gate's and up's ``(dmag, db, ms * dy)`` in float64."""
    dg, du = gated_act_backward_ref(dh.double(), _rounded_output_ref(gate), _rounded_output_ref(up), activation)
    return tuple(  # type: ignore[return-value]
        ((d * p.z.double()).sum(0) / p.norm.double(), d.sum(0), p.ms.double() * d) for d, p in ((dg, gate), (du, up))
    )


def dora_gated_act_torch(gate: ScaledProjection, up: ScaledProjection, activation: str) -> torch.Tensor:
    """:func:`dora_gated_act` composed: gate and up written, then fk.glu's activation."""
    return gated_act_forward(
        dora_scaled_output(gate.z, gate.ms, gate.bias), dora_scaled_output(up.z, up.ms, up.bias), activation
    )


def dora_gated_act_grad_terms_torch(
    dh: torch.Tensor,
    gate: ScaledProjection,
    up: ScaledProjection,
    activation: str,
    dtypes: tuple[GradDtypes, GradDtypes],
) -> tuple[DoRAGradTerms, DoRAGradTerms]:
    """:func:`dora_gated_act_grad_terms` composed: gate and up recomputed, ``dg`` and ``du`` written
    (in ``c``), then each one's terms."""
    gate_out = dora_scaled_output(gate.z, gate.ms, gate.bias)
    up_out = dora_scaled_output(up.z, up.ms, up.bias)
    dg, du, _ = gated_act_backward(dh, gate_out, up_out, activation, inplace=True)
    return (
        dora_grad_terms_torch(dg, gate.z, gate.ms, gate.norm, dtypes[0], (True, False)),
        dora_grad_terms_torch(du, up.z, up.ms, up.norm, dtypes[1], (True, False)),
    )


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Per element (i, j), in fp32 from c:
#   g = c(ms_g[j] z_g[i, j] + b_g[j]) ;  u = c(ms_u[j] z_u[i, j] + b_u[j])   (c(): rounded to c)
#   h[i, j] = act(g) u                                                    (rounded to c)
# Backward, with dh [M, I] (fk.glu's derivation: dg = dh u act'(g), du = dh act(g)):
#   dg_ms[i, j] = c(ms_g[j] dg) ;  du_ms[i, j] = c(ms_u[j] du)
#   dmag_g[j] = (sum_i dg z_g[i, j]) / n_g[j] ;  db_g[j] = sum_i dg   (and up's alike)
# A backward program owns a strip of columns and every P-th tile of rows, and adds its tiles in
# fp32 registers (a column sum per tile costs a reduction across warps each time: the first version
# did that and ran at 29% of the copy bandwidth, dora_profile); it writes one partial row per sum,
# which sum_rows_pair adds over the P programs and rounds to the parameters' dtypes
# (fk.lora.dora_elementwise's scheme).


@triton.jit
def _scaled(z_ptr, ms_ptr, bias_ptr, offsets, cols, ok, col_ok, HAS_BIAS: tl.constexpr):
    """(the projection's output rounded to z's dtype then in fp32, z in fp32, ms) of one tile."""
    z = tl.load(z_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    ms = tl.load(ms_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out = z * ms
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return round_to(out, z_ptr.dtype.element_ty).to(tl.float32), z, ms


@triton.jit
def _dora_gated_act_kernel(
    zg_ptr,  # [M, I] z of gate, in c (row stride z_row_stride, as up's)
    zu_ptr,  # [M, I] z of up
    msg_ptr,  # [I] fp32
    msu_ptr,  # [I] fp32
    bg_ptr,  # [I] gate's bias (read only when HAS_BIAS_G)
    bu_ptr,  # [I] up's bias (read only when HAS_BIAS_U)
    h_ptr,  # [M, I] out, c, contiguous
    n_rows,
    n_cols,
    z_row_stride,
    ACTIVATION: tl.constexpr,
    HAS_BIAS_G: tl.constexpr,
    HAS_BIAS_U: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * z_row_stride + cols[None, :]
    g, _, _ = _scaled(zg_ptr, msg_ptr, bg_ptr, offsets, cols, ok, col_ok, HAS_BIAS_G)
    u, _, _ = _scaled(zu_ptr, msu_ptr, bu_ptr, offsets, cols, ok, col_ok, HAS_BIAS_U)
    act, _ = activation_and_derivative(g, ACTIVATION)
    tl.store(h_ptr + rows[:, None] * n_cols + cols[None, :], round_to(act * u, h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dora_gated_act_grad_terms_kernel(
    dh_ptr,  # [M, I] in c (row stride dh_row_stride)
    zg_ptr,  # [M, I] z of gate, in c (row stride z_row_stride, as up's)
    zu_ptr,  # [M, I] z of up
    msg_ptr,  # [I] fp32
    msu_ptr,  # [I] fp32
    bg_ptr,  # [I] gate's bias (read only when HAS_BIAS_G)
    bu_ptr,  # [I] up's bias (read only when HAS_BIAS_U)
    ng_ptr,  # [I] fp32 n of gate (read only when COMPUTE_DMAG)
    nu_ptr,  # [I] fp32 n of up
    dg_ms_ptr,  # [M, I] out, c, contiguous
    du_ms_ptr,  # [M, I] out, c, contiguous
    partials_ptr,  # [groups, P, I] fp32: dmag_g's and dmag_u's partial rows (if COMPUTE_DMAG), then db_g's, db_u's (if COMPUTE_DB)
    n_rows,
    n_cols,
    dh_row_stride,
    z_row_stride,
    ACTIVATION: tl.constexpr,
    HAS_BIAS_G: tl.constexpr,
    HAS_BIAS_U: tl.constexpr,
    COMPUTE_DMAG: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    program, n_programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    dmag_g = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    dmag_u = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    db_g = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    db_u = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for tile in range(program, tl.cdiv(n_rows, BLOCK_ROWS), n_programs):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        ok = (rows < n_rows)[:, None] & col_ok[None, :]
        offsets = rows[:, None] * z_row_stride + cols[None, :]
        g, zg, msg = _scaled(zg_ptr, msg_ptr, bg_ptr, offsets, cols, ok, col_ok, HAS_BIAS_G)
        u, zu, msu = _scaled(zu_ptr, msu_ptr, bu_ptr, offsets, cols, ok, col_ok, HAS_BIAS_U)
        dh = tl.load(dh_ptr + rows[:, None] * dh_row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        act, grad = activation_and_derivative(g, ACTIVATION)
        dg = dh * u * grad
        du = dh * act
        out = rows[:, None] * n_cols + cols[None, :]
        tl.store(dg_ms_ptr + out, round_to(dg * msg, dg_ms_ptr.dtype.element_ty), mask=ok)
        tl.store(du_ms_ptr + out, round_to(du * msu, du_ms_ptr.dtype.element_ty), mask=ok)
        if COMPUTE_DMAG:
            dmag_g += dg * zg
            dmag_u += du * zu
        if COMPUTE_DB:
            db_g += dg
            db_u += du
    row = partials_ptr + program * n_cols + cols
    if COMPUTE_DMAG:
        tl.store(row, tl.sum(dmag_g, axis=0) / tl.load(ng_ptr + cols, mask=col_ok, other=1.0), mask=col_ok)
        row += n_programs * n_cols
        tl.store(row, tl.sum(dmag_u, axis=0) / tl.load(nu_ptr + cols, mask=col_ok, other=1.0), mask=col_ok)
        row += n_programs * n_cols
    if COMPUTE_DB:
        tl.store(row, tl.sum(db_g, axis=0), mask=col_ok)
        row += n_programs * n_cols
        tl.store(row, tl.sum(db_u, axis=0), mask=col_ok)


# --- 3. Launch table ------------------------------------------------------------------------------


class LaunchParams(NamedTuple):
    block_rows: int  # rows of a tile
    block_cols: int  # columns of a tile (a backward program's strip)
    num_warps: int
    programs_per_sm: int  # backward: programs (row groups x column strips) per multiprocessor


# Streaming passes, as fk.lora.dora_elementwise's (tiles of 4096 elements over 4 warps); the
# backward holds a tile's dh, two z, gate's and up's outputs and up to four fp32 sums in
# registers, so its tiles are half as tall. Its row groups are sized as dora_grad_terms' (a few
# waves of programs). Tuned on an H200 at Llama-3.1-8B's gate/up (benchmarks/tune_dora.py,
# INDEX.md#dora_launch): the forward's first guess was the best; the backward's best is 64-row
# tiles over 8 warps, 8 programs a multiprocessor (within 1% of the best at 4096 and 16384 tokens,
# 11% less time than 16 rows over 4 warps at 16384).
LAUNCH = {
    "forward": LaunchParams(block_rows=32, block_cols=128, num_warps=4, programs_per_sm=0),
    "backward": LaunchParams(block_rows=64, block_cols=128, num_warps=8, programs_per_sm=8),
}


# --- 4. Launchers ---------------------------------------------------------------------------------


def _same_layout(gate: ScaledProjection, up: ScaledProjection) -> bool:
    return gate.z.shape == up.z.shape and gate.z.dtype == up.z.dtype and gate.z.stride() == up.z.stride()


def dora_gated_act(gate: ScaledProjection, up: ScaledProjection, activation: str) -> torch.Tensor:
    """``h = act(ms_g z_g + b_g) * (ms_u z_u + b_u)`` ``[M, I]`` in ``c``, gate and up rounded to
    ``c`` first: one pass over the two ``z`` on Triton's path. ``activation``: any name fk.glu takes."""
    if not on_kernel_path(gate.z) or not _same_layout(gate, up):
        return dora_gated_act_torch(gate, up, activation)
    zg, zu = as_rows(gate.z), as_rows(up.z)
    if zg.stride() != zu.stride():
        return dora_gated_act_torch(gate, up, activation)
    n_rows, n_cols = zg.shape
    h = torch.empty((n_rows, n_cols), dtype=zg.dtype, device=zg.device)
    params = LAUNCH["forward"]
    grid = (cdiv(n_rows, params.block_rows), cdiv(n_cols, params.block_cols))
    _dora_gated_act_kernel[grid](
        zg, zu, gate.ms, up.ms, gate.bias if gate.bias is not None else gate.ms,
        up.bias if up.bias is not None else up.ms, h, n_rows, n_cols, zg.stride(0),
        ACTIVATION=activation_code(activation), HAS_BIAS_G=gate.bias is not None, HAS_BIAS_U=up.bias is not None,
        BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, num_warps=params.num_warps,
    )  # fmt: skip
    return h.view(gate.z.shape)


def dora_gated_act_grad_terms(
    dh: torch.Tensor,
    gate: ScaledProjection,
    up: ScaledProjection,
    activation: str,
    dtypes: tuple[GradDtypes, GradDtypes],
) -> tuple[DoRAGradTerms, DoRAGradTerms]:
    """Gate's and up's DoRA terms from the gradient ``dh`` of ``h`` (:func:`dora_gated_act`): for
    each, ``dmag = colsum(d * z) / n``, ``db = colsum(d)`` and ``ms * d`` (in ``c``) with ``d`` its
    gradient (``dy_ms1`` is None: there is no dropout). One pass over ``dh`` and the two ``z`` on
    Triton's path, ``d`` in fp32 registers.

    ``dtypes``: gate's and up's (magnitude dtype, bias dtype), None for a gradient not wanted.
    """
    if not on_kernel_path(dh) or not _same_layout(gate, up):
        return dora_gated_act_grad_terms_torch(dh, gate, up, activation, dtypes)
    zg, zu, dh_rows = as_rows(gate.z), as_rows(up.z), as_rows(dh)
    if zg.stride() != zu.stride():
        return dora_gated_act_grad_terms_torch(dh, gate, up, activation, dtypes)
    (mag_g, bias_g), (mag_u, bias_u) = dtypes
    compute_dmag = mag_g is not None or mag_u is not None
    compute_db = bias_g is not None or bias_u is not None
    n_rows, n_cols = zg.shape
    params = LAUNCH["backward"]
    programs, strips = column_strip_grid(
        n_rows, n_cols, params.block_rows, params.block_cols, dh.device, params.programs_per_sm
    )
    groups = 2 * (int(compute_dmag) + int(compute_db))
    partials = torch.empty((groups, programs, n_cols), dtype=torch.float32, device=dh.device) if groups else gate.ms
    dg_ms = torch.empty((n_rows, n_cols), dtype=dh.dtype, device=dh.device)
    du_ms = torch.empty_like(dg_ms)
    _dora_gated_act_grad_terms_kernel[(programs, strips)](
        dh_rows, zg, zu, gate.ms, up.ms, gate.bias if gate.bias is not None else gate.ms,
        up.bias if up.bias is not None else up.ms, gate.norm, up.norm, dg_ms, du_ms, partials,
        n_rows, n_cols, dh_rows.stride(0), zg.stride(0),
        ACTIVATION=activation_code(activation), HAS_BIAS_G=gate.bias is not None, HAS_BIAS_U=up.bias is not None,
        COMPUTE_DMAG=compute_dmag, COMPUTE_DB=compute_db,
        BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, num_warps=params.num_warps,
    )  # fmt: skip
    dmag: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if compute_dmag:
        dmag = sum_rows_pair(partials[0:2], mag_g or torch.float32, mag_u or torch.float32)
    db: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if compute_db:
        db = sum_rows_pair(partials[groups - 2 :], bias_g or torch.float32, bias_u or torch.float32)
    shape = dh.shape
    return (
        DoRAGradTerms(dmag[0] if mag_g else None, db[0] if bias_g else None, dg_ms.view(shape), None),
        DoRAGradTerms(dmag[1] if mag_u else None, db[1] if bias_u else None, du_ms.view(shape), None),
    )
