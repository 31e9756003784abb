"""#32, prepared (not run yet): the five rows of #32 still short are dropout rows, whose masked input
gradient terms ``f m_t (G_t A_t)`` are a pass of their own over ``dx`` (``fk.lora.masked_low_rank``)
after cuBLAS's ``dy W``. ``gemm_lora_epilogues`` put one such term into the GEMM's epilogue
(``masked``) and lost: the term's ``[BM, BN]`` tile beside the accumulator spilled at 128 x 256, and
128 x 128 tiles were slower (220.1 against 208.9 us at q/O, 4096 tokens). Here the epilogue works on
the accumulator in two ``[BM, BN / 2]`` halves (each half's term, mask and store in turn), so that
at most half a tile more is live; and it takes q/k/v's three terms (their masks on the same ``dx``),
as ``masked_low_rank`` does, beside the first projection's ``dy W``:

- ``fk now``: ``mm(dy, W)`` then ``masked_low_rank.add_masked_low_ranks_`` (one pass, 1 or 3 terms);
- ``whole``: fk.lora.lora_matmul's loop, the terms added to the whole tile;
- ``halves``: the same, the epilogue in two halves;

``W`` read as stored (the backward's layout), at q/O (W 4096 x 4096) and k/v (1024 x 4096), 4096 and
16384 tokens, r = 16, p = 0.05, bf16, over tiles, stages and warps; GPU time (median of
``triton.testing.do_bench``, L2 flushed). ``--ptx`` compiles each variant for sm_90 on the CPU
(registers, spills, shared memory).

Run on a GPU:  python benchmarks/experiments/gemm_masked_halves.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fk.core import bench
from fk.core.launch import multiprocessor_count
from fk.core.tiles import exact_dot, exact_dot_add, grouped_tile_offsets, round_to
from fk.lora import masked_low_rank
from fk.lora.masked_low_rank import MaskedLowRank

R, P = 16, 0.05
SHAPES = (("q/O", 4096, 4096, 4096), ("q/O", 16384, 4096, 4096), ("k/v", 4096, 1024, 4096), ("k/v", 16384, 1024, 4096))
SETTINGS = [  # ((BLOCK_M, BLOCK_N, BLOCK_K), stages, warps, halves)
    ((128, 256, 64), 3, 8, True), ((128, 256, 64), 3, 8, False), ((128, 256, 64), 4, 8, True),
    ((128, 128, 64), 3, 8, True), ((128, 128, 64), 4, 8, False), ((128, 128, 64), 4, 4, True),
    ((256, 128, 64), 3, 8, True),
]  # fmt: skip


@triton.jit
def _masked_terms(acc, gs_ptrs, a_ptrs, mask_ptrs, factors, rows, cols, n_rows, n_cols,
                  N_TERMS: tl.constexpr, RANK: tl.constexpr):  # fmt: skip
    # acc + sum_t f_t m_t (G_t A_t) over the columns cols (G_t [M, r], A_t [r, K], m_t [M, K], contiguous)
    ks = tl.arange(0, RANK)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    for t in tl.static_range(N_TERMS):
        g = tl.load(gs_ptrs[t] + rows[:, None] * RANK + ks[None, :], mask=rows[:, None] < n_rows, other=0.0)
        a = tl.load(a_ptrs[t] + ks[:, None] * n_cols + cols[None, :], mask=cols[None, :] < n_cols, other=0.0)
        keep = tl.load(mask_ptrs[t] + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0) != 0
        acc += tl.where(keep, factors[t] * exact_dot(g, a), 0.0)
    return acc


@triton.jit
def _masked_grad_kernel(dy_desc, w_desc, dx_desc, gs_ptrs, a_ptrs, mask_ptrs, factors, n_rows, n_cols, n_inner,
                        N_TERMS: tl.constexpr, RANK: tl.constexpr, HALVES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        N_PROGRAMS: tl.constexpr):  # fmt: skip
    # dx = dy W + sum_t f_t m_t (G_t A_t); W [N, K] read as stored, in [BLOCK_K, BLOCK_N] tiles.
    for tile in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N), N_PROGRAMS):
        off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, n_inner, BLOCK_K):
            acc = exact_dot_add(dy_desc.load([off_m, off_k]), w_desc.load([off_k, off_n]), acc)
        rows = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        if HALVES:
            half: tl.constexpr = BLOCK_N // 2
            first, second = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, half)), (0, 2, 1)))
            cols = off_n + tl.arange(0, half)
            first = _masked_terms(first, gs_ptrs, a_ptrs, mask_ptrs, factors, rows, cols, n_rows, n_cols, N_TERMS,
                                  RANK)  # fmt: skip
            dx_desc.store([off_m, off_n], round_to(first, dx_desc.dtype))
            second = _masked_terms(second, gs_ptrs, a_ptrs, mask_ptrs, factors, rows, cols + half, n_rows, n_cols,
                                   N_TERMS, RANK)  # fmt: skip
            dx_desc.store([off_m, off_n + half], round_to(second, dx_desc.dtype))
        else:
            cols = off_n + tl.arange(0, BLOCK_N)
            acc = _masked_terms(acc, gs_ptrs, a_ptrs, mask_ptrs, factors, rows, cols, n_rows, n_cols, N_TERMS, RANK)
            dx_desc.store([off_m, off_n], round_to(acc, dx_desc.dtype))


def masked_grad(dy: torch.Tensor, w: torch.Tensor, terms: Sequence[MaskedLowRank],
                setting: tuple[tuple[int, int, int], int, int, bool]) -> torch.Tensor:  # fmt: skip
    """``dy W + sum_t f_t m_t (G_t A_t)`` (1 or 3 terms; G, A and the masks contiguous)."""
    (bm, bn, bk), stages, warps, halves = setting
    m, k = dy.shape[0], w.shape[1]
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    programs = min(multiprocessor_count(dy.device), triton.cdiv(m, bm) * triton.cdiv(k, bn))
    _masked_grad_kernel[(programs,)](
        TensorDescriptor.from_tensor(dy, [bm, bk]), TensorDescriptor.from_tensor(w, [bk, bn]),
        TensorDescriptor.from_tensor(dx, [bm, bn // 2 if halves else bn]), tuple(t.g for t in terms),
        tuple(t.a for t in terms), tuple(t.mask for t in terms), tuple(float(t.factor) for t in terms), m, k,
        dy.shape[1], N_TERMS=len(terms), RANK=R, HALVES=halves, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        N_PROGRAMS=programs, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return dx


def fk_now(dy: torch.Tensor, w: torch.Tensor, terms: Sequence[MaskedLowRank]) -> torch.Tensor:
    return masked_low_rank.add_masked_low_ranks_(torch.mm(dy, w), terms)


def _inputs(m: int, n: int, k: int, n_terms: int, device: str,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[MaskedLowRank]]:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(m + n + k + n_terms)
    dy = torch.randn(m, n, device=device, generator=gen).to(dtype)
    w = (n**-0.5 * torch.randn(n, k, device=device, generator=gen)).to(dtype)
    terms = [
        MaskedLowRank(
            torch.randn(m, R, device=device, generator=gen).to(dtype),
            (0.1 * torch.randn(R, k, device=device, generator=gen)).to(dtype),
            torch.rand(m, k, device=device, generator=gen) >= P,
            1 / (1 - P),
        )
        for _ in range(n_terms)
    ]
    return dy, w, terms


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 tl.dot)
    for n_terms, halves in itertools.product((1, 3), (False, True)):
        dy, w, terms = _inputs(70, 96, 112, n_terms, device, dtype)
        want = masked_low_rank.add_masked_low_ranks_ref(dy.double() @ w.double(), terms)
        got = masked_grad(dy, w, terms, ((32, 64, 32), 2, 4, halves))
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    print("masked_grad (1 and 3 terms, whole and halves): within rounding of float64")


def ptx() -> None:
    from fk.core.testing import compile_kernel

    for ((bm, bn, bk), _, warps, halves), n_terms in itertools.product(SETTINGS, (1, 3)):
        out_n = bn // 2 if halves else bn
        signature = {
            "dy_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{bk}, {bn}]>",
            "dx_desc": f"tensordesc<bf16[{bm}, {out_n}]>", "gs_ptrs": ("*bf16",) * n_terms,
            "a_ptrs": ("*bf16",) * n_terms, "mask_ptrs": ("*i1",) * n_terms, "factors": ("fp32",) * n_terms,
            "n_rows": "i32", "n_cols": "i32", "n_inner": "i32", "N_TERMS": "", "RANK": "", "HALVES": "",
            "BLOCK_M": "", "BLOCK_N": "", "BLOCK_K": "", "GROUP_M": "", "N_PROGRAMS": "",
        }  # fmt: skip
        constexprs = {"N_TERMS": n_terms, "RANK": R, "HALVES": halves, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                      "GROUP_M": 8, "N_PROGRAMS": 132}  # fmt: skip
        compiled = compile_kernel("gemm_masked_halves", "_masked_grad_kernel", signature, constexprs, num_warps=warps)
        print(f"  {bm} x {bn} x {bk}, {warps} warps, {'halves' if halves else 'whole '}, {n_terms} terms: "
              f"{compiled.registers} registers, {compiled.spill_bytes} bytes spilled, "
              f"{compiled.shared_bytes // 1024} KB shared", flush=True)  # fmt: skip


def timings() -> None:
    for (label, m, n, k), n_terms in itertools.product(SHAPES, (1, 3)):
        dy, w, terms = _inputs(m, n, k, n_terms, "cuda", torch.bfloat16)
        flops = 2 * m * n * k / 1e9
        print(f"== {label}: dy [{m}, {n}], W [{n}, {k}], {n_terms} masked terms", flush=True)
        now = triton.testing.do_bench(lambda: fk_now(dy, w, terms), rep=40, return_mode="median")  # noqa: B023
        print(f"  {'fk now (mm, masked pass)':60s} {now * 1e3:8.1f} us  {flops / now:5.0f} TFLOP/s", flush=True)
        for setting in SETTINGS:
            try:
                t = triton.testing.do_bench(lambda: masked_grad(dy, w, terms, setting), rep=40, return_mode="median")  # noqa: B023
            except (triton.runtime.errors.OutOfResources, RuntimeError) as error:
                print(f"  {setting}: {type(error).__name__}")
                continue
            what = f"{'halves' if setting[3] else 'whole'} {setting[:3]}"
            print(f"  {what:60s} {t * 1e3:8.1f} us  {flops / t:5.0f} TFLOP/s  ({t / now:.3f}x fk now)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", action="store_true", help="compile each variant for sm_90 on the CPU, no GPU")
    args, _ = parser.parse_known_args()
    if args.ptx:
        ptx()
        return
    bench.run_probe(parser, check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
