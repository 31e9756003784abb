"""Where one training step of bench_e2e.py's model spends its GPU time, per kernel (a diagnostic,
not a benchmark: the profiler's own overhead shows in the wall time it prints).

Builds the Llama-3.2-1B-shaped model for one provider (stock, liger, fk, fk-lowmem) as
bench_e2e.py does, trains 8 steps, then profiles 2 more with torch.profiler and prints the GPU
time per step by rough category (matmul kernels, optimizer, the rest) and the 45 costliest kernels
with their launch counts per step. Then where the GPU sits idle: the gaps between one kernel's end
and the next one's start (``--gap-us``: the smallest gap listed), summed per step and listed
longest first with the kernels on either side, since a gap is host time the step pays for.

Run on a GPU:  python benchmarks/profile_e2e.py fk [--batch 4] [--lora]

benchmarks/experiments/profiles/ holds its output for fk on an H200 before and after fk.hf's qkv
switch and then with the add_norm switch (``e2e_full_fk_h200_before_qkv.txt``,
``e2e_full_fk_h200_qkv.txt``, ``e2e_full_fk_h200_add_norm.txt``; host times differ
between those two machines, so compare their GPU times, not their gaps), and that of an earlier
form of it (the same measurement; categories split differently) for liger and fk, taken before
fk.glu's gated MLP formed h in its gradient pass (fk's "_glu_fwd_kernel x32" there is 16 forward
passes and 16 recomputations).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e

from fk.hf import training

MATMUL_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "sm90", "splitk")


def category(kernel: str) -> str:
    name = kernel.lower()
    if any(marker in name for marker in MATMUL_MARKERS):
        return "matmul (names with gemm, nvjet, cutlass, xmma, sm90, splitk: cuDNN attention too)"
    if "adam" in name or "multi_tensor" in name:
        return "optimizer"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("provider", choices=bench_e2e.PROVIDERS)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--gap-us", type=float, default=20.0, help="smallest idle gap to list (microseconds)")
    args = parser.parse_args()
    bench_e2e.patch_before_build(args.provider, "llama")
    model = training.build_model(training.SHAPES["llama-3.2-1b"], dtype=torch.bfloat16, device="cuda", seed=0,
                                 lora=args.lora, max_positions=args.seq)  # fmt: skip
    bench_e2e.patch_after_build(args.provider, model)
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    run = training.train(model, corpus, steps=8, warmup=3, batch=args.batch, seq=args.seq, lr=1e-4, optimizer=opt)
    print(f"{args.provider}: {run.tokens_per_s:.0f} tokens/s, step ms {[round(s * 1e3, 1) for s in run.step_seconds]}")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        training.train(model, corpus, steps=2, batch=args.batch, seq=args.seq, lr=1e-4, optimizer=opt, first_step=100)
        wall = (time.perf_counter() - start) / 2
    # The optimizer's annotation range is reported as a device event too; it is no kernel.
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Optimizer.")]  # fmt: skip
    per_step = collections.Counter[str]()
    launches = collections.Counter[str]()
    for e in kernels:
        per_step[e.name[:110]] += e.device_time / 1e3 / 2
        launches[e.name[:110]] += 1
    by_category = collections.Counter[str]()
    for name, ms in per_step.items():
        by_category[category(name)] += ms
    print(f"wall per profiled step {wall * 1e3:.1f} ms; GPU time per step {sum(per_step.values()):.1f} ms")
    print("by category (ms per step):", {k: round(v, 2) for k, v in by_category.most_common()})
    for name, ms in per_step.most_common(45):
        print(f"{ms:8.3f} ms  x{launches[name] // 2:4d}  {name}")
    print_gaps(kernels, args.gap_us)


def print_gaps(kernels: list, min_gap_us: float) -> None:
    """The device's idle time between consecutive kernels (of any stream), per profiled step."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in kernels)
    gaps = []
    busy_until, before = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start - busy_until >= min_gap_us:
            gaps.append((start - busy_until, before, name))
        if end > busy_until:
            busy_until, before = end, name
    # The two profiled steps are separated by the host's synchronization and the next batch: drop
    # the longest gap, which is that boundary, not time inside a step.
    gaps.sort(reverse=True)
    inner = gaps[1:]
    print(
        f"idle gaps >= {min_gap_us:.0f} us inside the steps: {len(inner) / 2:.0f} per step, "
        f"{sum(g for g, _, _ in inner) / 2e3:.2f} ms per step"
    )
    for gap, before, after in inner[:25]:
        print(f"{gap / 1e3:8.3f} ms idle  after {before}  before {after}")


if __name__ == "__main__":
    main()
