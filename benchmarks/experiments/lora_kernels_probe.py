"""CUDA kernels and host time per forward+backward of bench_lora.py's blocks at 4096 tokens, PEFT
eager against fk.lora (Llama-3.1-8B shapes, r=16, fp32 and bf16 adapters, dropout 0 and 0.05).

Kernels: the CUDA activity events (kernels, memsets) of one profiled forward+backward. Host: the
best of 7 repeats of 10 forward+backward calls enqueued while the GPU runs a sleep kernel, so only
the host is timed. The host times move by tens of percent between machines of the same kind (PEFT's
O projection took 0.65 to 1.1 ms on three H200 hosts); compare them within one run only.

Run on a GPU:  python benchmarks/experiments/lora_kernels_probe.py [o,qkv,mlp] [--names]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def host_us(fn: Callable[[], object], n: int = 10, reps: int = 7) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # (about 0.1 s: longer than the host takes to enqueue n calls)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
        torch.cuda.synchronize()
    return best * 1e6


def cuda_events(fn: Callable[[], object]) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    import bench_lora

    import fk.lora

    blocks = sys.argv[1].split(",") if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ["o", "qkv", "mlp"]
    for block in blocks:
        for p in (0.0, 0.05):
            for adapter in ("fp32", "bf16"):
                model = bench_lora._lora_model("mlp" if block == "mlp" else "qkv", p, 16, 32,
                                               bench_lora.ADAPTER_DTYPES[adapter])  # fmt: skip
                call = bench_lora._call(model, block)
                x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                dys = [torch.ones_like(o) for o in call(x)]

                def step(call: Callable[[torch.Tensor], list[torch.Tensor]] = call, x: torch.Tensor = x,
                         dys: list[torch.Tensor] = dys) -> None:  # fmt: skip
                    torch.autograd.backward(call(x), dys)

                def forward(call: Callable[[torch.Tensor], list[torch.Tensor]] = call, x: torch.Tensor = x) -> None:
                    call(x)

                res = {}
                for name in ("peft", "fk"):
                    if name == "fk":
                        fk.lora.patch(model)
                    res[name] = (host_us(step), len(cuda_events(step)), host_us(forward))
                (ph, pk, pf), (fh, fk_, ff) = res["peft"], res["fk"]
                print(f"{block:4s} p={p:<4} {adapter}: host fwd+bwd peft {ph:5.0f} us ({pk} kernels), "
                      f"fk {fh:5.0f} us ({fk_} kernels); fwd host peft {pf:4.0f} fk {ff:4.0f}")  # fmt: skip
                if "--names" in sys.argv and p == 0.0 and adapter == "fp32":
                    print("   fk:", "; ".join(n[:60] for n in cuda_events(step)))


if __name__ == "__main__":
    main()
