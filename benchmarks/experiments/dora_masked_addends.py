"""#32, prepared (not run yet): DoRA's q/k/v with dropout at 16384 tokens is the row of
``lora_dora_qlora.json`` furthest from its target after the dropout passes of
``masked_dropout_kernels`` (1.48x PEFT, 1.5x asked; plain DoRA 1.45x, 88.7% of the floor). Its input
gradient takes three launches of ``fk.lora.masked_low_rank``, one a projection, each
``dx += f m_t (dy_ms1_t W_t + s G_t A_t)`` with the first product (``addend``) written by a GEMM:
each launch reads and writes ``dx``. One launch for the three, each term with its addend, would
read and write ``dx`` once: 13 bytes an element against 21, 537 MB less at 16384 x 4096, at the
price of the three addends alive together (two more ``[M, K]`` buffers, 268 MB, at the backward's
peak). What would it save?

- ``three_launches``: the module's kernel once per projection, one term and its addend each
  (DoRA's backward as committed);
- ``one_launch``: this file's kernel, three terms, each with its addend, dx read and written once;

at 16384 and 4096 rows of 4096 (Llama-3.1-8B's q/k/v input), r = 16, bf16, p = 0.05, over tiles and
warps; GPU time (median of ``triton.testing.do_bench``, L2 flushed) and the share of the copy speed
its bytes would take.

Run on a GPU:  python benchmarks/experiments/dora_masked_addends.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv
from fk.core.tiles import grid_tile, round_to
from fk.lora import masked_low_rank
from fk.lora.masked_low_rank import MaskedLowRank

K, R, P = 4096, 16, 0.05


@triton.jit
def _masked_term(mask_ptr, mask_row_stride, addend_ptr, addend_row_stride, g_ptr, a_ptr, rank, g_row_stride,
                 a_row_stride, factor, rows, cols, row_ok, col_ok, ok, BLOCK_ROWS: tl.constexpr,
                 BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    """``f m (addend + G A)`` over one tile, fp32."""
    keep = tl.load(mask_ptr + rows[:, None] * mask_row_stride + cols[None, :], mask=ok, other=0)
    addend = tl.load(addend_ptr + rows[:, None] * addend_row_stride + cols[None, :], mask=ok, other=0.0)
    product = masked_low_rank._low_rank_tile(g_ptr, a_ptr, rank, g_row_stride, a_row_stride, rows, cols, row_ok,
                                             col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK, 1)  # fmt: skip
    return tl.where(keep != 0, (product + addend.to(tl.float32)) * factor, 0.0)


@triton.jit
def _one_launch_kernel(dx_ptr, g_ptrs, a_ptrs, mask_ptrs, addend_ptrs, ranks, g_row_strides, a_row_strides,
                       mask_row_strides, addend_row_strides, factors, n_rows, n_cols, dx_row_stride,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    # Three terms, each with its addend (DoRA's q, k and v), r <= BLOCK_RANK.
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    dx_at = dx_ptr + rows[:, None] * dx_row_stride + cols[None, :]
    total = tl.load(dx_at, mask=ok, other=0.0).to(tl.float32)
    for t in tl.static_range(3):
        total += _masked_term(mask_ptrs[t], mask_row_strides[t], addend_ptrs[t], addend_row_strides[t], g_ptrs[t],
                              a_ptrs[t], ranks[t], g_row_strides[t], a_row_strides[t], factors[t], rows, cols, row_ok,
                              col_ok, ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
    tl.store(dx_at, round_to(total, dx_ptr.dtype.element_ty), mask=ok)


def one_launch(dx: torch.Tensor, terms: Sequence[MaskedLowRank], addends: Sequence[torch.Tensor], br: int, bc: int,
               nw: int) -> torch.Tensor:  # fmt: skip
    n_rows, n_cols = dx.shape
    gs, as_, masks = (tuple(getattr(t, name) for t in terms) for name in ("g", "a", "mask"))
    _one_launch_kernel[(cdiv(n_rows, br), cdiv(n_cols, bc))](
        dx, gs, as_, masks, tuple(addends), tuple(g.shape[1] for g in gs), tuple(g.stride(0) for g in gs),
        tuple(a.stride(0) for a in as_), tuple(m.stride(0) for m in masks), tuple(t.stride(0) for t in addends),
        tuple(float(t.factor) for t in terms), n_rows, n_cols, dx.stride(0), BLOCK_ROWS=br, BLOCK_COLS=bc,
        BLOCK_RANK=16, num_warps=nw,
    )  # fmt: skip
    return dx


def three_launches(dx: torch.Tensor, terms: Sequence[MaskedLowRank], addends: Sequence[torch.Tensor]) -> torch.Tensor:
    for term, addend in zip(terms, addends, strict=True):
        masked_low_rank.add_masked_low_rank_(dx, term.g, term.a, term.mask, term.factor, addend=addend)
    return dx


def _inputs(m: int, k: int, device: str) -> tuple[torch.Tensor, list[MaskedLowRank], list[torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(m + k)
    c, f = torch.bfloat16, 1 / (1 - P)
    dx = torch.randn(m, k, device=device, generator=gen).to(c)
    terms, addends = [], []
    for _ in range(3):
        mask = torch.rand(m, k, device=device, generator=gen) >= P
        g = torch.randn(m, R, device=device, generator=gen).to(c)
        a = torch.randn(R, k, device=device, generator=gen).to(c)
        terms.append(MaskedLowRank(g, a, mask, f))
        addends.append(torch.randn(m, k, device=device, generator=gen).to(c))
    return dx, terms, addends


def check(device: str) -> None:
    for m, k in ((40, 200), (17, 300)):
        dx, terms, addends = _inputs(m, k, device)
        want = masked_low_rank.add_masked_low_ranks_ref(dx, terms[:1], addends[0])
        for term, addend in zip(terms[1:], addends[1:], strict=True):
            want += masked_low_rank.add_masked_low_rank_ref(torch.zeros_like(dx), *term, addend)
        got = one_launch(dx.clone(), terms, addends, 16, 64, 1)
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(three_launches(dx.clone(), terms, addends).double(), want, rtol=1e-2, atol=6e-2)
    print("one_launch: within bf16 rounding of float64 (three_launches: within three roundings)")


def ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, rep=50, return_mode="median"))


def timings() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for m in (16384, 4096):
        dx, terms, addends = _inputs(m, K, "cuda")
        out = torch.empty_like(dx)
        copy_ms = ms(lambda: out.copy_(dx))  # noqa: B023
        copy_gbs = 2 * dx.numel() * 2 / copy_ms / 1e6
        print(f"== {m} x {K}: copy {copy_ms:.4f} ms, {copy_gbs:.0f} GB/s")

        def row(label: str, t: float, nbytes: float) -> None:
            share = nbytes / copy_gbs / 1e6 / t  # noqa: B023
            print(f"  {label:40s} {t:7.4f} ms  ({share:5.1%} of copy)", flush=True)

        row("three_launches (module)", ms(lambda: three_launches(dx, terms, addends)), dx.numel() * 21)  # noqa: B023
        for br, bc, nw in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8)):
            if not 1024 <= br * bc <= 8192 or br * bc // (32 * nw) < 8:
                continue
            try:
                t = ms(lambda: one_launch(dx, terms, addends, br, bc, nw))  # noqa: B023
            except triton.runtime.errors.OutOfResources:
                continue
            row(f"one_launch ({br}, {bc}, {nw})", t, dx.numel() * 13)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
