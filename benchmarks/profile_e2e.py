"""Where one training step of bench_e2e.py's model spends its GPU time, per kernel (a diagnostic,
not a benchmark: the profiler's own overhead shows in the wall time it prints).

Builds the Llama-3.2-1B-shaped model for one provider (stock, liger, fk, fk-lowmem) as
bench_e2e.py does, trains 8 steps, then profiles 2 more with torch.profiler and prints the GPU
time per step by rough category (matmul kernels, optimizer, the rest) and the 45 costliest kernels
with their launch counts per step.

Run on a GPU:  python benchmarks/profile_e2e.py fk [--batch 4] [--lora]

benchmarks/results/profiles/ holds the output of an earlier form of this script (the same
measurement; categories split differently) for liger and fk on an H200, taken before fk.glu's
gated MLP formed h in its gradient pass (fk's "_glu_fwd_kernel x32" there is 16 forward passes
and 16 recomputations).
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
    args = parser.parse_args()
    bench_e2e._patch_before_build(args.provider)
    model = training.build_model(training.SHAPES["llama-3.2-1b"], dtype=torch.bfloat16, device="cuda", seed=0,
                                 lora=args.lora, max_positions=args.seq)  # fmt: skip
    bench_e2e._patch_after_build(args.provider, model)
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    run = training.train(model, corpus, steps=8, warmup=3, batch=args.batch, seq=args.seq, lr=1e-4, optimizer=opt)
    print(f"{args.provider}: {run.tokens_per_s:.0f} tokens/s, step ms {[round(s * 1e3, 1) for s in run.step_seconds]}")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        training.train(model, corpus, steps=2, batch=args.batch, seq=args.seq, lr=1e-4, optimizer=opt, first_step=100)
        wall = (time.perf_counter() - start) / 2
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
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


if __name__ == "__main__":
    main()
