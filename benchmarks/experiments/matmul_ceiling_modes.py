"""#32: the bf16 matmul ceiling that fk's floors divide by (``fk.core.bench.matmul_tflops``: an 8192-cube
matmul of random bf16 matrices, timed back to back by ``time_ms``) moved between 671 and 742 TFLOP/s
across the day's bench_lora runs with the same GPU times, and in the 2026-11-28T12:43 LoRA record it
came out below what the blocks' own GEMMs reach (floor fractions of 98-101%). Is the ceiling a matter
of shape, or of how it is timed? The rows are timed with ``time_ms(gpu_only=True)``, the GPU idle
(spinning) before each call; the ceiling back to back.

Each shape's cuBLAS bf16 matmul (``torch.matmul`` into a preallocated output), TFLOP/s from the
median of ``time_ms`` back to back and of ``time_ms(gpu_only=True)``, three times in turn; the shapes:
the ceiling's 8192 cube, a 4096 cube (O at 4096 tokens), Llama-3.1-8B's q/k/v stacked at 16384 tokens
(16384 x 4096 x 6144) and its MLP's gate at 16384 (16384 x 4096 x 14336).

Run on a GPU:  python benchmarks/experiments/matmul_ceiling_modes.py
"""

from __future__ import annotations

import argparse

import torch

from fk.core import bench

SHAPES = {  # (M, K, N): [M, K] x [K, N]
    "8192 cube (the ceiling's)": (8192, 8192, 8192),
    "4096 cube (O, 4096 tokens)": (4096, 4096, 4096),
    "q/k/v stacked, 16384 tokens": (16384, 4096, 6144),
    "gate, 16384 tokens": (16384, 4096, 14336),
}


def check(device: str) -> None:
    print(f"nothing to check on {device}: cuBLAS matmuls only")


def _rates(m: int, k: int, n: int) -> tuple[float, float]:
    """TFLOP/s of one shape's matmul: back to back, and with the GPU idle before each call."""
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    b = torch.randn(k, n, device="cuda", generator=gen).bfloat16()
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * k * n
    back_to_back = bench.tflops(flops, bench.time_ms(lambda: torch.matmul(a, b, out=c)))
    idle_first = bench.tflops(flops, bench.time_ms(lambda: torch.matmul(a, b, out=c), gpu_only=True))
    return back_to_back, idle_first


def timings() -> None:
    for round_ in range(3):
        print(f"== round {round_ + 1}: TFLOP/s (back to back | GPU idle before each call)", flush=True)
        for name, shape in SHAPES.items():
            back_to_back, idle_first = _rates(*shape)
            print(f"  {name:32s} {back_to_back:6.0f} | {idle_first:6.0f}", flush=True)
            torch.cuda.empty_cache()
        print(f"  bench.matmul_tflops(): {bench.matmul_tflops():.0f}", flush=True)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
