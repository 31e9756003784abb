"""#32: ``fk.lora.lora_matmul``'s launch (128 x 256 x 64 tiles, 3 stages, 8 warps, ``GROUP_M`` 8) was
chosen at Llama-3.1-8B's q/k/v/O products at 4096 tokens (``gemm_lora_epilogues``); the MLP's
products (inner or output 14336) and 16384 tokens were never swept, and there the base GEMMs run
behind cuBLAS (``lora_shortfalls``: the QLoRA MLP's at 16384 tokens, O's 1.446 ms against
cuBLAS's 1.40 in ``lora_gemm_floor``). Which tile, depth, warps and row grouping is fastest at
each product, with the rank-16 term in the epilogue as the layers run it?

Each launch's output is checked against ``torch.mm`` (+ the rank term) before it is timed; GPU
time with the GPU idle before each call, as ``bench_lora`` times its rows; cuBLAS's ``mm`` of the
base product alone beside them (the floor's product).

Run on a GPU:  python benchmarks/experiments/lora_matmul_tune.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse

import torch
import triton

from fk.core import bench
from fk.lora import lora_matmul

R = 16
SCALING = 2.0
SHAPES = (  # (label, tokens, W rows (out features), W columns (in features))
    ("q / O", 4096, 4096, 4096),
    ("gate / up", 4096, 14336, 4096),
    ("down", 4096, 4096, 14336),
    ("q / O", 16384, 4096, 4096),
    ("gate / up", 16384, 14336, 4096),
    ("down", 16384, 4096, 14336),
)
LAUNCHES = (  # ((BLOCK_M, BLOCK_N, BLOCK_K), stages, warps, GROUP_M); the first is the module's
    ((128, 256, 64), 3, 8, 8),
    ((128, 256, 64), 3, 8, 4),
    ((128, 256, 64), 3, 8, 16),
    ((128, 256, 64), 3, 8, 32),
    ((128, 256, 64), 4, 8, 8),
    ((256, 128, 64), 3, 8, 8),
    ((256, 128, 64), 4, 8, 8),
    ((128, 128, 64), 4, 4, 8),
    ((128, 128, 64), 5, 8, 8),
    ((128, 256, 32), 5, 8, 8),
)


def _operands(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(m + n + k)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return {"x": randn(m, k), "w": randn(n, k, std=k**-0.5), "dy": randn(m, n), "xa": randn(m, R),
            "g": randn(m, R), "lora_b": randn(n, R, std=0.1), "lora_a": randn(R, k, std=0.1)}  # fmt: skip


def _products(t: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """label: (the kernel's call at a launch, torch's result, cuBLAS's base product alone)."""
    x, w, dy, xa, g, lb, la = (t[n] for n in ("x", "w", "dy", "xa", "g", "lora_b", "lora_a"))
    return {
        "x W^T + s xa B^T": (
            lambda launch: lora_matmul._launch(x, w, True, None, xa, lb, lb.stride(0), lb.stride(1), SCALING, **launch),
            lambda: torch.addmm(torch.mm(xa, lb.t()), x, w.t(), alpha=1.0, beta=SCALING),
            lambda: torch.mm(x, w.t()),
        ),
        "dy W + G A": (
            lambda launch: lora_matmul._launch(dy, w, False, None, g, la, la.stride(1), la.stride(0), 1.0, **launch),
            lambda: torch.addmm(torch.mm(g, la), dy, w),
            lambda: torch.mm(dy, w),
        ),
    }


def _kwargs(launch) -> dict:  # type: ignore[no-untyped-def, type-arg]
    tile, stages, warps, group_m = launch
    return {"tile": tile, "num_stages": stages, "num_warps": warps, "group_m": group_m}


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    t = _operands(96, 160, 128, device, dtype)
    for label, (kernel, want, _) in _products(t).items():
        for launch in (((32, 32, 32), 2, 4, 2), ((32, 64, 32), 2, 4, 1)):
            torch.testing.assert_close(kernel(_kwargs(launch)).float(), want().float(), rtol=2e-2, atol=2e-2,
                                       msg=f"{label} {launch}")  # fmt: skip
    print("lora_matmul._launch at other launches: within rounding of torch's (x W^T + s xa B^T, dy W + G A)")


def timings() -> None:
    for label, m, n, k in SHAPES:
        t = _operands(m, n, k, "cuda", torch.bfloat16)
        print(f"== {label}: {m} tokens, W {n} x {k}", flush=True)
        for what, (kernel, want, cublas) in _products(t).items():
            flops = 2 * m * n * k
            reference = want()

            def row(case: str, t_ms: float) -> None:
                print(f"  {what:18s} {case:40s} {t_ms * 1e3:8.1f} us {flops / t_ms / 1e9:6.0f} TFLOP/s", flush=True)  # noqa: B023

            row("cuBLAS mm (base product alone)", bench.time_ms(cublas, gpu_only=True))
            best = None
            for launch in LAUNCHES:
                try:
                    got = kernel(_kwargs(launch))
                except triton.runtime.errors.OutOfResources as error:
                    print(f"  {what:18s} {launch!s:40s} {type(error).__name__}", flush=True)
                    continue
                torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=5e-2, msg=str(launch))
                t_ms = bench.time_ms(lambda: kernel(_kwargs(launch)), gpu_only=True)  # noqa: B023
                row(str(launch), t_ms)
                if best is None or t_ms < best[0]:
                    best = (t_ms, launch)
            if best is not None:
                row(f"best {best[1]}", best[0])


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
