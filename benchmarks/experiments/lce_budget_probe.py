"""fk.flce.linear_cross_entropy at bench_e2e.py's loss shape (8192 tokens, hidden 2048, vocabulary
128256, bf16, trainable weight), forward+backward: the default budget (one chunk) against 1024, 512
and 256 MiB chunks with the head's gradient summed in bf16 or fp32. Per setting: the median and min
of 10 timed calls (CUDA events), peak memory above what was allocated before, and the GPU time of
one call by kernel (torch.profiler). Its output on an H200 is in lce_budget_h200.txt beside it.

Run on a GPU:  python benchmarks/experiments/lce_budget_probe.py
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from fk.flce import linear_cross_entropy

N, H, V = 8192, 2048, 128256


def main() -> None:
    torch.manual_seed(0)
    hidden = (torch.randn(N, H, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda")
    settings: dict[str, dict[str, Any]] = {"default": {}}
    for mib in (1024, 512, 256):
        for accum in (torch.bfloat16, torch.float32):
            settings[f"{mib} MiB {str(accum).removeprefix('torch.')}"] = {
                "memory_budget": mib << 20,
                "accum_dtype": accum,
            }

    def call(options: dict[str, Any]) -> None:
        linear_cross_entropy(hidden, weight, labels, **options).backward()
        hidden.grad = weight.grad = None

    for name, options in settings.items():
        for _ in range(3):
            call(options)
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(options)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call(options)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call(options)
            torch.cuda.synchronize()
        by_kernel, count = collections.Counter[str](), collections.Counter[str]()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                by_kernel[event.name[:60]] += event.device_time
                count[event.name[:60]] += 1
        print(f"{name:18s} median {statistics.median(times):.2f} ms  min {min(times):.2f}  "
              f"peak above {peak:.0f} MiB  kernels {sum(by_kernel.values()) / 1e3:.2f} ms")  # fmt: skip
        for kernel, us in by_kernel.most_common(8):
            print(f"      {us / 1e3:7.3f} ms x{count[kernel]:3d} {kernel}")


if __name__ == "__main__":
    main()
