"""Host time of fk's fused LoRA O projection (bench_lora.py's Llama-3.1-8B shapes, r=16, fp32
adapters, 4096 tokens), without and with dropout 0.05: forward+backward enqueued 20 times while the
GPU runs a long sleep kernel (so only the host is timed), then one forward+backward under the CPU
profiler, its ops by self CPU time. (One profiled call: its first-event costs inflate the largest
rows; read the order, not the sum.)

Run on a GPU:  python benchmarks/experiments/lora_host_probe.py
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import bench_lora

    import fk.lora

    for dropout in (0.0, 0.05):
        model = bench_lora._lora_model("qkv", dropout, 16, 32, torch.float32)
        call = bench_lora._call(model, "o")
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fk.lora.patch(model)

        def step(call: object = call, x: torch.Tensor = x) -> None:
            outs = call(x)  # type: ignore[operator]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        start = time.perf_counter()
        for _ in range(20):
            step()
        host = (time.perf_counter() - start) / 20
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        torch.cuda.synchronize()
        print(f"o, dropout {dropout}: host {host * 1e3:.3f} ms per forward+backward (GPU asleep)")
        total, count = collections.Counter[str](), collections.Counter[str]()
        for event in prof.events():
            total[event.name] += event.self_cpu_time_total
            count[event.name] += 1
        for name, us in total.most_common(25):
            print(f"   {us:8.1f} us self  x{count[name]:3d}  {name[:90]}")


if __name__ == "__main__":
    main()
