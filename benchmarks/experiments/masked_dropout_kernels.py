"""#32: fk-lora's two dropout passes at q/k/v (three masks, r = 16, bf16) run at 45% (dx) and 63% (dA)
of the copy speed for their bytes (INDEX.md#masked_dropout_tune), one term at 80%. Compiled for sm_90,
the three-term dx kernel takes 167 registers a thread (3 programs of 4 warps an SM) and 29 barriers a
tile; the dA kernel 255 registers and 8 bytes of spills. Do other launches, or these variants, reach
more of the copy speed?

- dx, ``loads_first``: dx and every mask loaded before the products (the kernel of the module loads
  each mask after its term's product);
- dA, ``transposed``: each accumulator ``[strip, r]`` (``dA^T = (x * m)^T (s G)``), the strip on the
  product's first axis, where Hopper's warpgroup MMA takes 64 rows or more.

Each against the module's kernel, at 16384 rows of 4096 (Llama-3.1-8B's q/k/v input), over
tiles, warps and (dA) programs an SM; GPU time, median of ``triton.testing.do_bench`` (L2 flushed),
and the share of the copy speed (a bf16 copy of x, same run) its bytes would take.

Run on a GPU:  python benchmarks/experiments/masked_dropout_kernels.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
Registers and barriers, compiled for sm_90 on the CPU:  python ... --ptx
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl

from fk.core import bench, testing
from fk.core.launch import cdiv, column_strip_grid
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, grid_tile, round_to
from fk.lora import masked_a_grad, masked_low_rank
from fk.lora.masked_a_grad import LaunchParams, MaskedA
from fk.lora.masked_low_rank import MaskedLowRank

K, R, P = 4096, 16, 0.05
RANK = 16  # BLOCK_RANK: the variants take r <= 16 (one rank step)


# --- dx: loads first -------------------------------------------------------------------------------


@triton.jit
def _dx_loads_first_kernel(dx_ptr, g_ptrs, a_ptrs, mask_ptrs, ranks, g_row_strides, a_row_strides, mask_row_strides,
                           factors, n_rows, n_cols, dx_row_stride, N_TERMS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                           BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    dx_at = dx_ptr + rows[:, None] * dx_row_stride + cols[None, :]
    dx = tl.load(dx_at, mask=ok, other=0.0)
    keep0 = tl.load(mask_ptrs[0] + rows[:, None] * mask_row_strides[0] + cols[None, :], mask=ok, other=0)
    keep1 = keep0
    keep2 = keep0
    if N_TERMS > 1:
        keep1 = tl.load(mask_ptrs[1] + rows[:, None] * mask_row_strides[1] + cols[None, :], mask=ok, other=0)
    if N_TERMS > 2:
        keep2 = tl.load(mask_ptrs[2] + rows[:, None] * mask_row_strides[2] + cols[None, :], mask=ok, other=0)
    total = dx.to(tl.float32)
    p0 = masked_low_rank._low_rank_tile(g_ptrs[0], a_ptrs[0], ranks[0], g_row_strides[0], a_row_strides[0], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK, 1)  # fmt: skip
    total += tl.where(keep0 != 0, p0 * factors[0], 0.0)
    if N_TERMS > 1:
        p1 = masked_low_rank._low_rank_tile(g_ptrs[1], a_ptrs[1], ranks[1], g_row_strides[1], a_row_strides[1], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK, 1)  # fmt: skip
        total += tl.where(keep1 != 0, p1 * factors[1], 0.0)
    if N_TERMS > 2:
        p2 = masked_low_rank._low_rank_tile(g_ptrs[2], a_ptrs[2], ranks[2], g_row_strides[2], a_row_strides[2], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK, 1)  # fmt: skip
        total += tl.where(keep2 != 0, p2 * factors[2], 0.0)
    tl.store(dx_at, round_to(total, dx_ptr.dtype.element_ty), mask=ok)


def dx_loads_first(dx: torch.Tensor, terms: Sequence[MaskedLowRank], br: int, bc: int, nw: int) -> torch.Tensor:
    n_rows, n_cols = dx.shape
    gs, as_, masks = (tuple(getattr(t, name) for t in terms) for name in ("g", "a", "mask"))
    _dx_loads_first_kernel[(cdiv(n_rows, br), cdiv(n_cols, bc))](
        dx, gs, as_, masks, tuple(g.shape[1] for g in gs), tuple(g.stride(0) for g in gs),
        tuple(a.stride(0) for a in as_), tuple(m.stride(0) for m in masks), tuple(float(t.factor) for t in terms),
        n_rows, n_cols, dx.stride(0), N_TERMS=len(terms), BLOCK_ROWS=br, BLOCK_COLS=bc, BLOCK_RANK=RANK,
        num_warps=nw,
    )  # fmt: skip
    return dx


def dx_module(dx: torch.Tensor, terms: Sequence[MaskedLowRank], br: int, bc: int, nw: int) -> torch.Tensor:
    masked_low_rank.BLOCK_ROWS, masked_low_rank.BLOCK_COLS, masked_low_rank.NUM_WARPS = br, bc, nw
    return masked_low_rank.add_masked_low_ranks_(dx, terms)


# --- dA: transposed accumulators -------------------------------------------------------------------


@triton.jit
def _add_masked_product_t(acc, x, gs_ptr, gs_row_stride, rank, mask_ptr, mask_row_stride, rows, row_ok, cols, ok,
                          BLOCK_RANK: tl.constexpr):  # fmt: skip
    ks = tl.arange(0, BLOCK_RANK)
    gs = tl.load(gs_ptr + rows[:, None] * gs_row_stride + ks[None, :], mask=row_ok[:, None] & (ks < rank)[None, :], other=0.0)  # fmt: skip
    keep = tl.load(mask_ptr + rows[:, None] * mask_row_stride + cols[None, :], mask=ok, other=0)
    return acc + exact_dot(tl.trans(tl.where(keep != 0, x, tl.zeros_like(x))), gs)


@triton.jit
def _store_partial_t(acc, factor, partials_ptr, group, rank_start, rank, n_ranks, n_cols, cols, col_ok,
                     BLOCK_RANK: tl.constexpr):  # fmt: skip
    ks = tl.arange(0, BLOCK_RANK)
    out = partials_ptr + (group.to(tl.int64) * n_ranks + rank_start + ks[None, :]) * n_cols + cols[:, None]
    tl.store(out, acc * factor, mask=(ks < rank)[None, :] & col_ok[:, None])


@triton.jit
def _a_grads_transposed_kernel(x_ptr, gs_ptrs, gs_row_strides, mask_ptrs, mask_row_strides, ranks, rank_starts, factors,
                               partials_ptr, n_rows, n_cols, n_ranks, x_row_stride, N_TERMS: tl.constexpr,
                               BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    group, groups = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    acc0 = tl.zeros((BLOCK_COLS, BLOCK_RANK), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_COLS, BLOCK_RANK), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_COLS, BLOCK_RANK), dtype=tl.float32)
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=ok, other=0.0)
        acc0 = _add_masked_product_t(acc0, x, gs_ptrs[0], gs_row_strides[0], ranks[0], mask_ptrs[0], mask_row_strides[0], rows, row_ok, cols, ok, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 1:
            acc1 = _add_masked_product_t(acc1, x, gs_ptrs[1], gs_row_strides[1], ranks[1], mask_ptrs[1], mask_row_strides[1], rows, row_ok, cols, ok, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 2:
            acc2 = _add_masked_product_t(acc2, x, gs_ptrs[2], gs_row_strides[2], ranks[2], mask_ptrs[2], mask_row_strides[2], rows, row_ok, cols, ok, BLOCK_RANK)  # fmt: skip
    _store_partial_t(acc0, factors[0], partials_ptr, group, rank_starts[0], ranks[0], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 1:
        _store_partial_t(acc1, factors[1], partials_ptr, group, rank_starts[1], ranks[1], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 2:
        _store_partial_t(acc2, factors[2], partials_ptr, group, rank_starts[2], ranks[2], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip


def a_grads_transposed(x: torch.Tensor, terms: Sequence[MaskedA], params: LaunchParams) -> list[torch.Tensor]:
    ranks = [t.gs.shape[1] for t in terms]
    n_ranks, (n_rows, n_cols) = sum(ranks), x.shape
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    groups, strips = column_strip_grid(n_rows, n_cols, params.block_rows, params.block_cols, x.device,
                                       params.programs_per_sm)  # fmt: skip
    partials = torch.empty((groups, n_ranks, n_cols), dtype=torch.float32, device=x.device)
    _a_grads_transposed_kernel[(groups, strips)](
        x, tuple(t.gs for t in terms), tuple(t.gs.stride(0) for t in terms), tuple(t.mask for t in terms),
        tuple(t.mask.stride(0) for t in terms), tuple(ranks), tuple(starts), tuple(float(t.factor) for t in terms),
        partials, n_rows, n_cols, n_ranks, x.stride(0), N_TERMS=len(terms), BLOCK_ROWS=params.block_rows,
        BLOCK_COLS=params.block_cols, BLOCK_RANK=RANK, num_warps=params.num_warps,
    )  # fmt: skip
    stacked = sum_rows(partials.view(groups, n_ranks * n_cols), terms[0].dtype).view(n_ranks, n_cols)
    return [stacked.narrow(0, s, r) for s, r in zip(starts, ranks, strict=True)]


def a_grads_module(x: torch.Tensor, terms: Sequence[MaskedA], params: LaunchParams) -> list[torch.Tensor]:
    masked_a_grad.LAUNCH[16] = params
    return masked_a_grad.masked_a_grads(x, terms)


# --- inputs, check, timing -------------------------------------------------------------------------


def _inputs(m: int, k: int, device: str, n_terms: int = 3) -> tuple[torch.Tensor, torch.Tensor, list, list]:  # type: ignore[type-arg]
    gen = torch.Generator(device=device).manual_seed(m + k)
    c, f = torch.bfloat16, 1 / (1 - P)
    x = torch.randn(m, k, device=device, generator=gen).to(c)
    dx = torch.randn(m, k, device=device, generator=gen).to(c)
    masks = [torch.rand(m, k, device=device, generator=gen) >= P for _ in range(n_terms)]
    gs = [torch.randn(m, R, device=device, generator=gen).to(c) for _ in range(n_terms)]
    a = [torch.randn(R, k, device=device, generator=gen).to(c) for _ in range(n_terms)]
    dx_terms = [MaskedLowRank(g, aa, mm, f) for g, aa, mm in zip(gs, a, masks, strict=True)]
    a_terms = [MaskedA(g, mm, f, c) for g, mm in zip(gs, masks, strict=True)]
    return x, dx, dx_terms, a_terms


def check(device: str) -> None:
    for m, k in ((40, 200), (17, 64)):
        for n in (1, 3):
            x, dx, dx_terms, a_terms = _inputs(m, k, device, n)
            want = masked_low_rank.add_masked_low_ranks_(dx.clone(), dx_terms)
            tile = (masked_low_rank.BLOCK_ROWS, masked_low_rank.BLOCK_COLS, masked_low_rank.NUM_WARPS)
            got = dx_loads_first(dx.clone(), dx_terms, *tile)  # (the interpreter's sums depend on the tile)
            assert torch.equal(got, want), (m, k, n)
            want_a = masked_a_grad.masked_a_grads(x, a_terms)
            got_a = a_grads_transposed(x, a_terms, LaunchParams(16, 64, 1, 2))
            for g, w in zip(got_a, want_a, strict=True):
                torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)
    print("dx_loads_first: the same bits as the module's kernel; a_grads_transposed: within bf16 rounding")


def ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, rep=50, return_mode="median"))


def timings() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    dx_launches = [(br, bc, nw) for br, bc, nw in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4))
                   if 1024 <= br * bc <= 8192 and br * bc // (32 * nw) >= 8]  # fmt: skip
    a_launches = [LaunchParams(br, bc, nw, pps) for br, bc, nw, pps in
                  itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8), (4, 8))
                  if br * bc <= 16384 and bc * nw <= 1024]  # fmt: skip
    for m in (16384,):
        x, dx, dx_terms, a_terms = _inputs(m, K, "cuda")
        out = torch.empty_like(x)
        copy_ms = ms(lambda: out.copy_(x))  # noqa: B023
        copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6
        print(f"== {m} x {K}: copy of x {copy_ms:.4f} ms, {copy_gbs:.0f} GB/s")

        def row(label: str, t: float, nbytes: float) -> None:
            share = nbytes / copy_gbs / 1e6 / t  # noqa: B023
            print(f"  {label:52s} {t:7.4f} ms  ({share:5.1%} of copy)", flush=True)

        for n in (3, 1):
            print(f"-- dx, {n} term(s): (rows, cols, warps)")
            for br, bc, nw in dx_launches:
                for name, fn in (("module", dx_module), ("loads_first", dx_loads_first)):
                    try:
                        t = ms(lambda: fn(dx, dx_terms[:n], br, bc, nw))  # noqa: B023
                    except triton.runtime.errors.OutOfResources:
                        continue
                    row(f"{name} ({br}, {bc}, {nw})", t, x.numel() * (4 + n))
            print(f"-- dA, {n} term(s): (rows, cols, warps, programs an SM)")
            for params in a_launches:
                for name, fn in (("module", a_grads_module), ("transposed", a_grads_transposed)):
                    if name == "transposed" and params.block_cols > 128:  # (spills thousands of bytes: --ptx)
                        continue
                    try:
                        t = ms(lambda: fn(x, a_terms[:n], params))  # noqa: B023
                    except triton.runtime.errors.OutOfResources:
                        continue
                    row(f"{name} {tuple(params)}", t, x.numel() * (2 + n))


# --- compiled for sm_90 on the CPU -----------------------------------------------------------------


def _ptx_counts(kernel: str, signature: dict, constexprs: dict, num_warps: int) -> str:  # type: ignore[type-arg]
    module = "masked_dropout_kernels" if not kernel.startswith("fk.") else kernel.rsplit(".", 1)[0]
    compiled = testing.compile_kernel(module, kernel.rsplit(".", 1)[-1], signature, constexprs, num_warps=num_warps)
    ops = {
        op: n
        for op, n in compiled.sync_and_mma.items()
        if op in ("bar.sync", "mma.sync", "wgmma.mma_async", "ld.shared", "st.shared")
    }
    return f"{compiled.registers} registers, {compiled.spill_bytes} bytes spilled, {dict(sorted(ops.items()))}"


def ptx() -> None:
    # compile_kernel imports the kernels in a fresh interpreter: this folder on its path.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *sys.path])
    three = lambda t: (t,) * 3  # noqa: E731
    dx_sig = {"dx_ptr": "*bf16", "g_ptrs": three("*bf16"), "a_ptrs": three("*bf16"), "mask_ptrs": three("*i1"),
              "ranks": three("i32"), "g_row_strides": three("i32"), "a_row_strides": three("i32"),
              "mask_row_strides": three("i32"), "factors": three("fp32")}  # fmt: skip
    module_sig = {**dx_sig, "addend_ptr": "*i1", "n_rows": "i32", "n_cols": "i32", "dx_row_stride": "i32",
                  "addend_row_stride": "i32", "N_TERMS": "", "HAS_ADDEND": "", "BLOCK_ROWS": "", "BLOCK_COLS": "",
                  "BLOCK_RANK": "", "RANK_STEPS": ""}  # fmt: skip
    first_sig = {**dx_sig, "n_rows": "i32", "n_cols": "i32", "dx_row_stride": "i32", "N_TERMS": "", "BLOCK_ROWS": "",
                 "BLOCK_COLS": "", "BLOCK_RANK": ""}  # fmt: skip
    for br, bc, nw in ((32, 128, 2), (32, 128, 4), (16, 128, 2), (32, 64, 2), (16, 64, 1)):
        tile = {"N_TERMS": 3, "BLOCK_ROWS": br, "BLOCK_COLS": bc, "BLOCK_RANK": RANK}
        print(
            f"dx 3 terms ({br}, {bc}, {nw}) module:     ",
            _ptx_counts(
                "fk.lora.masked_low_rank._add_masked_low_rank_kernel",
                module_sig,
                {**tile, "HAS_ADDEND": False, "RANK_STEPS": 1},
                nw,
            ),
        )
        print(f"dx 3 terms ({br}, {bc}, {nw}) loads_first:", _ptx_counts("_dx_loads_first_kernel", first_sig, tile, nw))
    a_sig = {"x_ptr": "*bf16", "gs_ptrs": three("*bf16"), "gs_row_strides": three("i32"), "mask_ptrs": three("*i1"),
             "mask_row_strides": three("i32"), "ranks": three("i32"), "rank_starts": three("i32"),
             "factors": three("fp32"), "partials_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "n_ranks": "i32",
             "x_row_stride": "i32", "N_TERMS": "", "BLOCK_ROWS": "", "BLOCK_COLS": "", "BLOCK_RANK": ""}  # fmt: skip
    for br, bc, nw in ((16, 128, 2), (32, 256, 4), (32, 128, 4), (64, 128, 4), (32, 64, 2)):
        tile = {"N_TERMS": 3, "BLOCK_ROWS": br, "BLOCK_COLS": bc, "BLOCK_RANK": RANK}
        print(
            f"dA 3 terms ({br}, {bc}, {nw}) module:    ",
            _ptx_counts("fk.lora.masked_a_grad._masked_a_grads_kernel", a_sig, tile, nw),
        )
        print(f"dA 3 terms ({br}, {bc}, {nw}) transposed:", _ptx_counts("_a_grads_transposed_kernel", a_sig, tile, nw))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", action="store_true", help="registers and barriers, compiled for sm_90 (no GPU)")
    if "--ptx" in sys.argv[1:]:
        ptx()
    else:
        bench.run_probe(parser, check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
