"""#32: the LoRA MLP's backward, after ``dh`` (the down projection's input gradient), runs fk.glu's
gradient pass (reads ``dh``, gate and up; writes ``dg``, ``du`` and ``h``), then reads ``h`` again
for the down projection's ``dA_d = (s G_d)^T h`` and ``dg`` and ``du`` again for gate's and up's
``fk.lora.dy_products`` (``s G = s dg B_g``, ``dB_g = s dg^T xa_g``, and up's). At Llama-3.1-8B's
MLP (I = 14336), 16384 tokens, those reads are 1.4 GB and ``h``'s write 0.47 GB. One kernel that
forms ``dg``, ``du`` and ``h`` in registers and feeds them to the five rank-16 products' MMAs
(``G`` summed along its rows, ``dB_g``, ``dB_u`` and ``dA_d`` through fp32 partials a row block, as
``dy_products`` does) would read ``dh``, gate and up once and write only ``dg`` and ``du``: faster?

Two layouts of that kernel: ``rows`` (a program owns a row block and a range of columns: ``G`` in
registers, ``dB_g``, ``dB_u``, ``dA_d`` through partials a row block) and ``cols`` (a program owns a
strip of columns and a range of rows: the three column sums in registers, ``G_g``, ``G_u`` through
partials a strip). Compiled for sm_90 both hold 226-255 registers; without spills only at 64-row
blocks (``rows``) and 32 x 64 steps (``cols``), where their partials are largest.

SiLU, bf16, r = 16, by GPU time (``fk.core.bench.time_ms(gpu_only=True)``, as bench_lora times its
rows): fk's passes as the MLP runs them (``gated_act_backward_with_value``, ``scaled_mm`` for
``dA_d``, ``dy_products`` twice) against the one kernel at each launch, every result checked
against float64 before it is timed, with the copy bandwidth's time for the one kernel's least
bytes (``dh``, gate and up read, ``dg`` and ``du`` written).

Run on a GPU:  python benchmarks/experiments/glu_rank_backward.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv, reduction_splits
from fk.core.matmul import scaled_mm
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, round_to
from fk.glu import gated_act_backward_with_value
from fk.glu.glu import activation_and_derivative
from fk.lora.dy_products import dy_products

R = 16
SCALING = 2.0
SHAPES = [(4096, 14336), (16384, 14336)]


class Launch(NamedTuple):
    block_rows: int
    block_cols: int
    num_warps: int
    programs_per_sm: int
    stages: int  # the column loop's software pipeline (1: none)


# Compiled for sm_90 at r = 16 (on the CPU): 64-row blocks do not spill (64 x 32: 175-234 registers;
# 64 x 64: 255, and 124 bytes of spills with 2 stages); 128 rows spill 220-1436 bytes, 256 rows
# 3912-7192. Larger row blocks mean fewer fp32 partials ([M / rows, I, R], three of them).
LAUNCHES = [Launch(*v) for v in itertools.product((64, 128, 256), (32, 64), (8,), (1, 2), (1,))]
# The column-owning kernel: block_rows the rows a step, block_cols the strip.
COLUMN_LAUNCHES = [
    Launch(*v) for v in itertools.product((16, 32, 64), (64, 128, 256), (8,), (1, 2), (1,)) if v[0] * v[1] <= 64 * 128
]


@triton.jit
def _store_partial(ptr, t, row_block, cols, col_ok, n_cols, R: tl.constexpr):
    """``t`` ``[BLOCK_COLS, R]`` into row block ``row_block``'s ``[n_cols, R]`` fp32 partial."""
    ranks = tl.arange(0, R)
    tl.store(ptr + (row_block.to(tl.int64) * n_cols + cols[:, None]) * R + ranks[None, :], t, mask=col_ok[:, None])


@triton.jit
def _fused_kernel(dh_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr, b_g_ptr, b_u_ptr, xa_g_ptr, xa_u_ptr, gs_d_ptr,
                  gs_g_ptr, gs_u_ptr, db_g_ptr, db_u_ptr, da_d_ptr, scaling, n_rows, n_cols, cols_per_split,
                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, R: tl.constexpr,
                  STAGES: tl.constexpr):  # fmt: skip
    # Per element (SiLU, s = sigmoid(g)): h = g s u, du = dh g s, dg = dh u s (1 + g (1 - s)), dg and
    # du rounded to 16 bits and stored (over gate and up where dg_ptr, du_ptr are theirs: each
    # element is read before it is written, as fk.glu's in-place gradient). Then, from the rounded values: G_g += dg B_g and G_u += du B_u
    # over this program's columns (fp32 partials a column range, [splits, M, R]); this row block's
    # share of dB_g = s dg^T xa_g, dB_u = s du^T xa_u and dA_d^T = h^T (s G_d) ([row blocks, I, R]).
    row_block, split = tl.program_id(0), tl.program_id(1)
    first_row = row_block.to(tl.int64) * BLOCK_ROWS
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    ranks = tl.arange(0, R)
    row_ok = rows < n_rows
    small = rows[:, None] * R + ranks[None, :]
    xa_g = tl.load(xa_g_ptr + small, mask=row_ok[:, None], other=0.0)
    xa_u = tl.load(xa_u_ptr + small, mask=row_ok[:, None], other=0.0)
    gs_d = tl.load(gs_d_ptr + small, mask=row_ok[:, None], other=0.0)
    acc_g = tl.zeros((BLOCK_ROWS, R), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_ROWS, R), dtype=tl.float32)
    # [M, I] tiles from this row block's first element by int32 offsets within it
    base = first_row * n_cols
    local_rows = tl.arange(0, BLOCK_ROWS)
    first = split * cols_per_split
    for start in tl.range(first, tl.minimum(first + cols_per_split, n_cols), BLOCK_COLS, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = cols < n_cols
        ok = row_ok[:, None] & col_ok[None, :]
        at = local_rows[:, None] * n_cols + cols[None, :]
        g = tl.load(gate_ptr + base + at, mask=ok, other=0.0).to(tl.float32)
        act, grad = activation_and_derivative(g, 0)  # fk.glu's SiLU and its derivative
        dh = tl.load(dh_ptr + base + at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + base + at, mask=ok, other=0.0).to(tl.float32)
        # each 16-bit result to its products as soon as it is formed (fewer fp32 tiles live at once)
        dg = round_to(dh * u * grad, dh_ptr.dtype.element_ty)
        tl.store(dg_ptr + base + at, dg, mask=ok)
        b_at = cols[:, None] * R + ranks[None, :]
        acc_g += exact_dot(dg, tl.load(b_g_ptr + b_at, mask=col_ok[:, None], other=0.0))
        _store_partial(db_g_ptr, exact_dot(tl.trans(dg), xa_g) * scaling, row_block, cols, col_ok, n_cols, R)
        du = round_to(dh * act, dh_ptr.dtype.element_ty)
        tl.store(du_ptr + base + at, du, mask=ok)
        acc_u += exact_dot(du, tl.load(b_u_ptr + b_at, mask=col_ok[:, None], other=0.0))
        _store_partial(db_u_ptr, exact_dot(tl.trans(du), xa_u) * scaling, row_block, cols, col_ok, n_cols, R)
        h = round_to(act * u, dh_ptr.dtype.element_ty)
        _store_partial(da_d_ptr, exact_dot(tl.trans(h), gs_d), row_block, cols, col_ok, n_cols, R)
    out = (split.to(tl.int64) * n_rows + rows[:, None]) * R + ranks[None, :]
    tl.store(gs_g_ptr + out, acc_g * scaling, mask=row_ok[:, None])
    tl.store(gs_u_ptr + out, acc_u * scaling, mask=row_ok[:, None])


@triton.jit
def _fused_cols_kernel(dh_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr, b_g_ptr, b_u_ptr, xa_g_ptr, xa_u_ptr, gs_d_ptr,
                       gs_g_ptr, gs_u_ptr, db_g_ptr, db_u_ptr, da_d_ptr, scaling, n_rows, n_cols, rows_per_range,
                       BLOCK_STEP: tl.constexpr, BLOCK_COLS: tl.constexpr, R: tl.constexpr,
                       STAGES: tl.constexpr):  # fmt: skip
    # The same products with the roles turned: a program owns a strip of BLOCK_COLS columns and a
    # range of rows, walked BLOCK_STEP rows a step; dB_g, dB_u and dA_d^T (sums over rows) stay in
    # fp32 registers and are written once as the range's partial ([ranges, I, R]: a few); G_g and
    # G_u (sums over columns) are written a step as the strip's partial ([strips, M, R]).
    strip, row_range = tl.program_id(0), tl.program_id(1)
    cols = strip * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    ranks = tl.arange(0, R)
    b_at = cols[:, None] * R + ranks[None, :]
    b_g = tl.load(b_g_ptr + b_at, mask=col_ok[:, None], other=0.0)
    b_u = tl.load(b_u_ptr + b_at, mask=col_ok[:, None], other=0.0)
    acc_db_g = tl.zeros((BLOCK_COLS, R), dtype=tl.float32)
    acc_db_u = tl.zeros((BLOCK_COLS, R), dtype=tl.float32)
    acc_da_d = tl.zeros((BLOCK_COLS, R), dtype=tl.float32)
    first = row_range * rows_per_range
    for start in tl.range(first, tl.minimum(first + rows_per_range, n_rows), BLOCK_STEP, num_stages=STAGES):
        rows = (start + tl.arange(0, BLOCK_STEP)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        at = rows[:, None] * n_cols + cols[None, :]
        g = tl.load(gate_ptr + at, mask=ok, other=0.0).to(tl.float32)
        act, grad = activation_and_derivative(g, 0)
        dh = tl.load(dh_ptr + at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + at, mask=ok, other=0.0).to(tl.float32)
        small = rows[:, None] * R + ranks[None, :]
        g_out = (strip.to(tl.int64) * n_rows + rows[:, None]) * R + ranks[None, :]
        dg = round_to(dh * u * grad, dh_ptr.dtype.element_ty)
        tl.store(dg_ptr + at, dg, mask=ok)
        tl.store(gs_g_ptr + g_out, exact_dot(dg, b_g) * scaling, mask=row_ok[:, None])
        acc_db_g += exact_dot(tl.trans(dg), tl.load(xa_g_ptr + small, mask=row_ok[:, None], other=0.0))
        du = round_to(dh * act, dh_ptr.dtype.element_ty)
        tl.store(du_ptr + at, du, mask=ok)
        tl.store(gs_u_ptr + g_out, exact_dot(du, b_u) * scaling, mask=row_ok[:, None])
        acc_db_u += exact_dot(tl.trans(du), tl.load(xa_u_ptr + small, mask=row_ok[:, None], other=0.0))
        h = round_to(act * u, dh_ptr.dtype.element_ty)
        acc_da_d += exact_dot(tl.trans(h), tl.load(gs_d_ptr + small, mask=row_ok[:, None], other=0.0))
    _store_partial(db_g_ptr, acc_db_g * scaling, row_range, cols, col_ok, n_cols, R)
    _store_partial(db_u_ptr, acc_db_u * scaling, row_range, cols, col_ok, n_cols, R)
    _store_partial(da_d_ptr, acc_da_d, row_range, cols, col_ok, n_cols, R)


class Operands(NamedTuple):
    dh: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    b_g: torch.Tensor
    b_u: torch.Tensor
    xa_g: torch.Tensor
    xa_u: torch.Tensor
    gs_d: torch.Tensor


def _operands(m: int, n: int, device: str, dtype: torch.dtype) -> Operands:
    gen = torch.Generator(device=device).manual_seed(m + n)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return Operands(randn(m, n), randn(m, n), randn(m, n), randn(n, R, std=0.1), randn(n, R, std=0.1), randn(m, R),
                    randn(m, R), randn(m, R))  # fmt: skip


def _buffers(t: Operands, g_blocks: int, db_blocks: int, inplace: bool) -> tuple[torch.Tensor, ...]:
    """(dg, du, then fp32 partials: G_g, G_u ``[g_blocks, M, R]``, dB_g, dB_u, dA_d^T ``[db_blocks, I, R]``)."""
    m, n = t.dh.shape
    f32 = {"dtype": torch.float32, "device": t.dh.device}
    dg, du = (t.gate, t.up) if inplace else (torch.empty_like(t.dh), torch.empty_like(t.dh))
    gs = [torch.empty((g_blocks, m, R), **f32) for _ in range(2)]
    return dg, du, *gs, *(torch.empty((db_blocks, n, R), **f32) for _ in range(3))


def _sums(buffers: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(dg, du, s G_g, s G_u, dB_g, dB_u, dA_d): the partials of :func:`_buffers` summed and rounded."""
    dg, du, *partials = buffers
    summed = [sum_rows(p.view(p.shape[0], -1), dg.dtype).view(p.shape[1:]) for p in partials]
    return dg, du, *summed[:4], summed[4].t()


def fused(t: Operands, launch: Launch, inplace: bool = False) -> tuple[torch.Tensor, ...]:
    """(dg, du, s G_g, s G_u, dB_g, dB_u, dA_d) by the row-owning kernel and the partials' sums
    (with ``inplace``, dg and du over gate's and up's buffers, as the MLP's backward writes them)."""
    m, n = t.dh.shape
    row_blocks = cdiv(m, launch.block_rows)
    steps, splits = reduction_splits(row_blocks, cdiv(n, launch.block_cols), t.dh.device, launch.programs_per_sm)
    buffers = _buffers(t, splits, row_blocks, inplace)
    _fused_kernel[(row_blocks, splits)](
        t.dh, t.gate, t.up, *buffers[:2], t.b_g, t.b_u, t.xa_g, t.xa_u, t.gs_d, *buffers[2:], SCALING, m, n,
        steps * launch.block_cols, BLOCK_ROWS=launch.block_rows, BLOCK_COLS=launch.block_cols, R=R,
        STAGES=launch.stages, num_warps=launch.num_warps,
    )  # fmt: skip
    return _sums(buffers)


def fused_cols(t: Operands, launch: Launch, inplace: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`fused` by the column-owning kernel (``launch.block_rows`` the rows a step)."""
    m, n = t.dh.shape
    strips = cdiv(n, launch.block_cols)
    steps, ranges = reduction_splits(strips, cdiv(m, launch.block_rows), t.dh.device, launch.programs_per_sm)
    buffers = _buffers(t, strips, ranges, inplace)
    _fused_cols_kernel[(strips, ranges)](
        t.dh, t.gate, t.up, *buffers[:2], t.b_g, t.b_u, t.xa_g, t.xa_u, t.gs_d, *buffers[2:], SCALING, m, n,
        steps * launch.block_rows, BLOCK_STEP=launch.block_rows, BLOCK_COLS=launch.block_cols, R=R,
        STAGES=launch.stages, num_warps=launch.num_warps,
    )  # fmt: skip
    return _sums(buffers)


def fk_passes(t: Operands) -> tuple[torch.Tensor, ...]:
    """The same by fk's passes as the MLP's backward runs them (the whole rows at once)."""
    dg, du, h, _ = gated_act_backward_with_value(t.dh, t.gate, t.up, "silu")
    da_d = scaled_mm(t.gs_d.t(), h, 1.0, t.dh.dtype)
    gs_g, db_g = dy_products(dg, t.b_g, t.xa_g, SCALING, t.dh.dtype)
    gs_u, db_u = dy_products(du, t.b_u, t.xa_u, SCALING, t.dh.dtype)
    return dg, du, gs_g, gs_u, db_g, db_u, da_d


def reference(t: Operands) -> tuple[torch.Tensor, ...]:
    """float64, from dg, du and h rounded to the operands' dtype as both paths round them."""
    dh, g, u = (z.double() for z in (t.dh, t.gate, t.up))
    sig = torch.sigmoid(g)
    dg = (dh * u * sig * (1 + g * (1 - sig))).to(t.dh.dtype).double()
    du = (dh * g * sig).to(t.dh.dtype).double()
    h = (g * sig * u).to(t.dh.dtype).double()
    b_g, b_u, xa_g, xa_u, gs_d = (z.double() for z in (t.b_g, t.b_u, t.xa_g, t.xa_u, t.gs_d))
    return (dg, du, SCALING * dg @ b_g, SCALING * du @ b_u, SCALING * dg.t() @ xa_g, SCALING * du.t() @ xa_u,
            gs_d.t() @ h)  # fmt: skip


def _right(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    """Every output within 16-bit rounding of float64 (relative to its largest element)."""
    return all(
        float((a.double() - b).abs().max()) <= 2e-2 * float(b.abs().max()) + 1e-3
        for a, b in zip(got, want, strict=True)
    )


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    t = _operands(150, 200, device, dtype)
    want = reference(t)
    for launch in (Launch(64, 64, 4, 1, 1), Launch(64, 32, 4, 64, 2)):
        assert _right(fused(t, launch), want), launch
        assert _right(fused_cols(t, launch), want), launch
    assert _right(fk_passes(t), want)
    assert _right(fused(t._replace(gate=t.gate.clone(), up=t.up.clone()), Launch(64, 64, 4, 2, 1), inplace=True), want)
    print("fused and fk's passes: within 16-bit rounding of float64 (one and several column ranges)")


def timings(copy_tbps: float) -> None:
    for m, n in SHAPES:
        t = _operands(m, n, "cuda", torch.bfloat16)
        want = reference(t)
        assert _right(fk_passes(t), want)
        least_bytes = 5 * m * n * 2  # dh, gate, up read; dg, du written
        now = bench.time_ms(lambda: fk_passes(t), warmup=3, rep=20, gpu_only=True)  # noqa: B023
        print(f"== [{m}, {n}], r = {R}: fk's passes {now * 1e3:8.1f} us; the one kernel's least bytes at copy "
              f"{least_bytes / copy_tbps / 1e6:8.1f} us", flush=True)  # fmt: skip
        for name, kernel, launches in (("rows", fused, LAUNCHES), ("cols", fused_cols, COLUMN_LAUNCHES)):
            results = []
            for launch in launches:
                try:
                    right = _right(kernel(t, launch), want)
                except triton.runtime.errors.OutOfResources:
                    print(f"  {name} {tuple(launch)!s:20s} out of resources", flush=True)
                    continue
                if not right:  # every launch's result checked before it is timed
                    print(f"  {name} {tuple(launch)!s:20s} WRONG", flush=True)
                    continue
                t_ms = bench.time_ms(lambda k=kernel, lc=launch: k(t, lc), warmup=3, rep=20, gpu_only=True)  # noqa: B023
                results.append((t_ms, launch))
            for t_ms, launch in sorted(results, key=lambda r: r[0])[:5]:
                print(
                    f"  {name} {tuple(launch)!s:20s} {t_ms * 1e3:8.1f} us  ({t_ms / now:.3f}x fk's passes)", flush=True
                )
            if results:  # the best launch writing dg and du over gate and up (copies, overwritten call after call)
                best = min(results, key=lambda r: r[0])[1]
                copies = t._replace(gate=t.gate.clone(), up=t.up.clone())
                in_place = bench.time_ms(lambda k=kernel, c=copies, lc=best: k(c, lc, inplace=True), warmup=3,
                                         rep=20, gpu_only=True)  # fmt: skip
                print(f"  {name} {tuple(best)!s:20s} in place {in_place * 1e3:8.1f} us", flush=True)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings(copy))


if __name__ == "__main__":
    main()
