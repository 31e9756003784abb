"""#32: ``fk.lora.dy_products``, a LoRA projection's ``s G = s dy B`` and ``dB = s dy^T xa`` from one
read of ``dy``, against the two scaled matmuls it replaces (cuBLAS, each reading ``dy`` whole).

For Llama-3.1-8B's output gradients (``dy`` ``[tokens, N]``: N = 4096 for q and O, 1024 for k and v,
14336 for gate and up; 1024, 4096 and 16384 tokens; r = 16, bf16, ``dB`` in bf16), each launch
setting (rows a program, columns a step, warps, programs an SM) and the two matmuls, by GPU time
(``fk.core.bench.time_ms(gpu_only=True)``: L2 flushed and the GPU idle before each call, as
bench_lora times its rows), with the fraction of a copy's speed for the kernel's least bytes
(``dy`` read once).

Run on a GPU:  python benchmarks/experiments/dy_products_tune.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools

import torch

from fk.core import bench
from fk.core.matmul import scaled_mm
from fk.lora import dy_products as module
from fk.lora.dy_products import LaunchParams

R, SCALING = 16, 2.0
SHAPES = [(1024, 4096), (4096, 1024), (4096, 4096), (4096, 14336), (16384, 1024), (16384, 4096), (16384, 14336)]
SETTINGS = [
    LaunchParams(rows, cols, warps, per_sm)
    for rows, cols, warps, per_sm in itertools.product((128, 256, 512), (64, 128), (4, 8), (1, 2, 4))
    if rows * cols <= 256 * 128 and not (rows == 512 and warps == 4)  # (three stages of 512 x 128: 384 KB)
]


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    dy, b, xa = (
        torch.randn(*shape, device=device, generator=gen).to(dtype) for shape in ((300, 200), (200, R), (300, R))
    )
    want_gs, want_db = module.dy_products_ref(dy, b, xa, SCALING)
    for params in (LaunchParams(128, 64, 4, 1), LaunchParams(128, 64, 4, 64)):
        gs, db = module.dy_products(dy, b, xa, SCALING, torch.float32, params)
        torch.testing.assert_close(gs.double(), want_gs, rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(db.double(), want_db, rtol=2e-2, atol=5e-2)
    print("dy_products (one and several column ranges): within 16-bit rounding of float64")


def _right(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Both products within bf16 rounding of float64 (relative to their largest element)."""
    return all(
        float((g.double() - w).abs().max()) <= 2e-2 * float(w.abs().max()) + 1e-3
        for g, w in zip(got, want, strict=True)
    )


def gpu_operands(m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy ``[m, n]``, B ``[n, R]``, xa ``[m, R]``) in bf16 on the GPU, seeded by the shape."""
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    b = (0.1 * torch.randn(n, R, device="cuda", generator=gen)).bfloat16()
    xa = torch.randn(m, R, device="cuda", generator=gen).bfloat16()
    return dy, b, xa


def timings(copy_tbps: float) -> None:
    for m, n in SHAPES:
        dy, b, xa = gpu_operands(m, n)

        def two_matmuls() -> tuple[torch.Tensor, torch.Tensor]:
            return scaled_mm(dy, b, SCALING, dy.dtype), scaled_mm(dy.t(), xa, SCALING, dy.dtype)  # noqa: B023

        want = module.dy_products_ref(dy, b, xa, SCALING)
        now = bench.time_ms(two_matmuls, warmup=3, rep=30, gpu_only=True)
        print(f"== dy [{m}, {n}], r = {R}: two scaled matmuls (fk before) {now * 1e3:7.1f} us", flush=True)
        results = []
        for params in SETTINGS:

            def kernel(p: LaunchParams = params) -> tuple[torch.Tensor, torch.Tensor]:
                return module.dy_products(dy, b, xa, SCALING, dy.dtype, p)  # noqa: B023

            if not _right(kernel(), want):  # every setting's result checked before it is timed
                print(f"  {tuple(params)!s:28s} WRONG", flush=True)
                continue
            t = bench.time_ms(kernel, warmup=3, rep=30, gpu_only=True)
            results.append((t, params))
        for t, params in sorted(results, key=lambda r: r[0])[:4]:
            print(f"  {tuple(params)!s:28s} {t * 1e3:7.1f} us  {2 * m * n / t / 1e9 / copy_tbps:5.1%} of copy  "
                  f"({t / now:.3f}x)", flush=True)  # fmt: skip
        table = next(r for r in results if r[1] == module.LAUNCH)
        print(f"  the table's {tuple(module.LAUNCH)}: {table[0] * 1e3:.1f} us ({table[0] / now:.3f}x)", flush=True)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings(copy))


if __name__ == "__main__":
    main()
