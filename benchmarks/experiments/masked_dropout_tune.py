"""fk-lora's two dropout passes at Llama-3.1-8B's q/k/v input (16384 x 4096 tokens x features, r = 16,
bf16, p = 0.05), by tile and warps: ``add_masked_low_ranks_`` (dx += sum_t f_t m_t G_t A_t; q, k and v
in one launch, and one term with DoRA's addend) and ``masked_a_grads`` (dA of q, k and v from one
pass over x and their masks). GPU time, median of triton.testing.do_bench's calls (L2 flushed before
each), and the share of the copy speed measured in the same run (a bf16 copy of x) that the pass's
bytes would take.

Run on a GPU:  python benchmarks/experiments/masked_dropout_tune.py   (output: masked_dropout_tune_h200.txt)
"""

from __future__ import annotations

import itertools

import torch
import triton

from fk.lora import masked_a_grad, masked_low_rank
from fk.lora.masked_a_grad import LaunchParams, MaskedA
from fk.lora.masked_low_rank import MaskedLowRank

M, K, R, P = 16384, 4096, 16, 0.05


def ms(fn: object) -> float:
    return float(triton.testing.do_bench(fn, rep=100, return_mode="median"))  # type: ignore[arg-type]


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    dev, c = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=c)
    dx = torch.randn(M, K, device=dev, dtype=c)
    addend = torch.randn(M, K, device=dev, dtype=c)
    masks = [torch.rand(M, K, device=dev) >= P for _ in range(3)]
    gs = [torch.randn(M, R, device=dev, dtype=c) for _ in range(3)]
    a = [torch.randn(R, K, device=dev, dtype=c) for _ in range(3)]
    f = 1 / (1 - P)
    out = torch.empty_like(x)
    copy_ms = ms(lambda: out.copy_(x))
    copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6
    print(f"copy of x (bf16 {M}x{K}): {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s")

    def row(label: str, t: float, nbytes: float) -> None:
        print(
            f"  {label:44s} {t:7.3f} ms  bytes at copy speed {nbytes / copy_gbs / 1e6:.3f} ms ({nbytes / copy_gbs / 1e6 / t:5.1%})"
        )

    terms3 = [MaskedLowRank(g, aa, m, f) for g, aa, m in zip(gs, a, masks, strict=True)]
    print("add_masked_low_ranks_: (BLOCK_ROWS, BLOCK_COLS, NUM_WARPS)")
    for br, bc, nw in itertools.product((32, 64, 128), (64, 128, 256), (4, 8)):
        if br * bc > 32768 or br * bc < 4096:
            continue
        masked_low_rank.BLOCK_ROWS, masked_low_rank.BLOCK_COLS, masked_low_rank.NUM_WARPS = br, bc, nw
        t3 = ms(lambda: masked_low_rank.add_masked_low_ranks_(dx, terms3))
        row(f"q/k/v, 3 terms ({br}, {bc}, {nw})", t3, x.numel() * (2 + 2 + 3))
        t1 = ms(lambda: masked_low_rank.add_masked_low_ranks_(dx, terms3[:1], addend))
        row(f"1 term + addend ({br}, {bc}, {nw})", t1, x.numel() * (2 + 2 + 2 + 1))
    terms_a = [MaskedA(g, m, f, torch.float32) for g, m in zip(gs, masks, strict=True)]
    print("masked_a_grads (r = 16): (block_rows, block_cols, num_warps, programs_per_sm)")
    for br, bc, nw, pps in itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 4)):
        if br * bc > 32768:
            continue
        masked_a_grad.LAUNCH[16] = LaunchParams(br, bc, nw, pps)
        t3 = ms(lambda: masked_a_grad.masked_a_grads(x, terms_a))
        row(f"q/k/v ({br}, {bc}, {nw}, {pps})", t3, x.numel() * (2 + 3))
        t1 = ms(lambda: masked_a_grad.masked_a_grads(x, terms_a[:1]))
        row(f"one ({br}, {bc}, {nw}, {pps})", t1, x.numel() * (2 + 1))


if __name__ == "__main__":
    main()
