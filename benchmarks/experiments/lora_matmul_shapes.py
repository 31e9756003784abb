"""#32, after ``gemm_lora_epilogues``: fk.lora.lora_matmul's one-GEMM LoRA output (the tile of that
probe's best at Llama-3.1-8B's attention) against the cuBLAS path it replaces in
``fk.lora.projection.lora_and_base_out`` (``mm`` of the rank product, then ``addmm`` with beta = 1),
and (``--grad``) its input gradient ``dy W + (s G) A`` against fk.lora's cuBLAS path (``mm`` of the
rank product, then ``addmm_`` of ``dy W``), at Llama-3.1-8B's attention and at shapes that probe did
not time: Llama-3.1-8B's MLP (gate/up 14336 x 4096, down 4096 x 14336) and
Llama-3.2-1B's projections (q/O 2048 x 2048, k/v 512 x 2048, gate/up 8192 x 2048, down 2048 x 8192),
at 1024, 4096 and 16384 tokens, r = 16, bf16; GPU time (median of ``triton.testing.do_bench``, L2
flushed), and whether ``fused_applies`` (``fused_grad_applies``) takes the kernel there. Does it
lose anywhere it is taken?

Run on a GPU:  python benchmarks/experiments/lora_matmul_shapes.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from fk.core import bench
from fk.lora import lora_matmul

R = 16
WEIGHTS = (  # (label, N, K)
    ("8B q/O", 4096, 4096), ("8B k/v", 1024, 4096), ("8B gate/up", 14336, 4096), ("8B down", 4096, 14336),
    ("1B q/O", 2048, 2048), ("1B k/v", 512, 2048), ("1B gate/up", 8192, 2048), ("1B down", 2048, 8192),
)  # fmt: skip


def _inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(m + n + k)
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    w = (k**-0.5 * torch.randn(n, k, device=device, generator=gen)).to(dtype)
    xa = torch.randn(m, R, device=device, generator=gen).to(dtype)
    b = (0.1 * torch.randn(n, R, device=device, generator=gen)).to(dtype)
    return x, w, xa, b


def cublas_path(x: torch.Tensor, w: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """``lora_and_base_out`` where the kernel does not apply: the rank product, then ``addmm``."""
    return torch.mm(xa, b.t()).mul_(s).addmm_(x, w.t())


def cublas_grad_path(dy: torch.Tensor, w: torch.Tensor, gs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """fk.lora's input gradient where the kernel does not apply: ``s G A`` first, ``dy W`` added."""
    return torch.mm(gs, a).addmm_(dy, w)


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    x, w, xa, b = _inputs(70, 48, 96, device, dtype)
    want = lora_matmul.base_and_lora_out_ref(x, w, None, xa, b, 2.0)
    for got in (lora_matmul.base_and_lora_out(x, w, None, xa, b, 2.0), cublas_path(x, w, xa, b, 2.0)):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    dy, a = torch.randn_like(x[:, :48]), 0.1 * torch.randn(R, 96, device=device).to(dtype)
    want = lora_matmul.base_and_lora_grad_ref(dy, w, xa, a)
    for got in (lora_matmul.base_and_lora_grad(dy, w, xa, a), cublas_grad_path(dy, w, xa, a)):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    print("base_and_lora_out, base_and_lora_grad and the cuBLAS paths: within rounding of float64")


def timings(grad: bool) -> None:
    for (label, n, k), m in itertools.product(WEIGHTS, (1024, 4096, 16384)):
        x, w, xa, b = _inputs(m, n, k, "cuda", torch.bfloat16)
        if grad:  # dx [M, K] = dy [M, N] W + gs [M, r] A [r, K]
            dy, a = torch.randn(m, n, device="cuda").to(x.dtype), (0.1 * torch.randn(R, k, device="cuda")).to(x.dtype)
            fused_fn = lambda: lora_matmul.base_and_lora_grad(dy, w, xa, a)  # noqa: B023, E731
            cublas_fn = lambda: cublas_grad_path(dy, w, xa, a)  # noqa: B023, E731
            applies = lora_matmul.fused_grad_applies(dy, w, xa, a)
        else:
            fused_fn = lambda: lora_matmul.base_and_lora_out(x, w, None, xa, b, 2.0)  # noqa: B023, E731
            cublas_fn = lambda: cublas_path(x, w, xa, b, 2.0)  # noqa: B023, E731
            applies = lora_matmul.fused_applies(x, w, None, xa, b, 2.0)
        fused = triton.testing.do_bench(fused_fn, rep=40, return_mode="median")
        cublas = triton.testing.do_bench(cublas_fn, rep=40, return_mode="median")
        tflops = 2 * m * n * k / 1e9
        taken = "taken" if applies else "not taken"
        print(f"  {label:11s} {m:6d} tokens  fused {fused * 1e3:8.1f} us ({tflops / fused:4.0f} TFLOP/s)  "
              f"cuBLAS path {cublas * 1e3:8.1f} us ({tflops / cublas:4.0f})  fused/cuBLAS {fused / cublas:5.3f}  ({taken})",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grad", action="store_true", help="the input gradient's GEMM, not the forward's")
    bench.run_probe(parser, check, lambda args, copy: timings(args.grad))


if __name__ == "__main__":
    main()
