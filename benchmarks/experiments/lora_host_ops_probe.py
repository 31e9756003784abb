"""Host time of each op fk.lora's O projection issues (Llama-3.1-8B shapes, 4096 tokens, r=16, fp32
A and B), then of PEFT's and fk's whole O and QKV calls, each timed over repeated calls while the
GPU sleeps (so only the host is timed), and a cProfile of 30 forward+backward calls.

The QKV rows of the output are not host times: 30 of its forward+backward calls queue more
kernels than CUDA's launch queue holds, so the host waits for the sleeping GPU (see the output).

Run on a GPU:  python benchmarks/experiments/lora_host_ops_probe.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

M = K = N = 4096
RANK = 16


class _View(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, d: torch.Tensor) -> torch.Tensor:
        return d


def host_us(fn: Callable[[], Any], n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - start) / n
    torch.cuda.synchronize()
    return elapsed * 1e6


def main() -> None:
    import bench_lora

    import fk.lora
    from fk.core.matmul import mm_bf16_fp32, scaled_mm, split_bf16
    from fk.glu import swiglu

    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=bf16)
    w = torch.randn(N, K, device=dev, dtype=bf16)
    a, b = torch.randn(RANK, K, device=dev), torch.randn(N, RANK, device=dev)
    b16 = b.to(bf16)
    dy = torch.randn(M, N, device=dev, dtype=bf16)
    xa = torch.randn(M, RANK, device=dev, dtype=bf16)
    y = torch.empty(M, N, device=dev, dtype=bf16)
    parts = split_bf16(a, 2)
    out = torch.empty(M, RANK, device=dev, dtype=bf16)
    tiny = torch.randn(8, 64, device=dev, dtype=bf16)
    leaf = torch.randn(8, device=dev, requires_grad=True)
    ops: dict[str, Callable[[], Any]] = {
        "torch.empty [M,r]": lambda: torch.empty(M, RANK, device=dev, dtype=bf16),
        "x.reshape": lambda: x.reshape(-1, K),
        "A.to(bf16)": lambda: a.to(bf16),
        "torch.mm x W^T": lambda: torch.mm(x, w.t()),
        "torch.mm x W^T out=": lambda: torch.mm(x, w.t(), out=y),
        "y.addmm_(xa, B^T, alpha)": lambda: y.addmm_(xa, b16.t(), alpha=2.0),
        "split_bf16(A, 2)": lambda: split_bf16(a, 2),
        "mm_bf16_fp32(x, A, parts, out)": lambda: mm_bf16_fp32(x, a, parts, out=out),
        "scaled_mm(dy, B, s, bf16)": lambda: scaled_mm(dy, b16, 2.0, bf16),
        "scaled_mm(dy^T, xa, s, fp32)": lambda: scaled_mm(dy.t(), xa, 2.0, torch.float32),
        "torch.mm(dy^T, xa, out_dtype=fp32)": lambda: torch.mm(dy.t(), xa, out_dtype=torch.float32),
        "torch.mm dy^T xa (bf16)": lambda: torch.mm(dy.t(), xa),
        "triton swiglu tiny": lambda: swiglu(tiny, tiny),
        "Function apply (view)": lambda: _View.apply(leaf),
        "torch.is_autocast_enabled": lambda: torch.is_autocast_enabled("cuda"),
    }
    for name, fn in ops.items():
        print(f"{host_us(fn):8.1f} us  {name}")

    for block in ("o", "qkv"):
        model = bench_lora._lora_model("qkv", 0.0, RANK, 32, torch.float32)
        call = bench_lora._call(model, block)
        xx = torch.randn(M, K, device=dev, dtype=bf16, requires_grad=True)
        with torch.no_grad():
            dys = [torch.randn_like(o) for o in call(xx)]

        def step(call: Any = call, xx: torch.Tensor = xx, dys: list[torch.Tensor] = dys) -> None:
            torch.autograd.backward(call(xx), dys)

        for provider in ("peft", "fk"):
            if provider == "fk":
                fk.lora.patch(model)
            forward_us = host_us(lambda call=call, xx=xx: call(xx), 30)
            step_us = host_us(step, 30)
            print(f"{block} {provider}: host fwd {forward_us:.0f} us, fwd+bwd {step_us:.0f} us")
            torch.cuda.synchronize()
            torch.cuda._sleep(int(3e9))
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(30):
                step()
            profiler.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:4000])
        fk.lora.unpatch(model)


if __name__ == "__main__":
    main()
