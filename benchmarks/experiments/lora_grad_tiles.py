"""#32, prepared (not run yet): fk.lora.lora_matmul's input-gradient kernel (``dx = dy W + (s G) A``,
``W`` ``[N, K]`` read as stored in ``[BLOCK_K, BLOCK_N]`` tiles) lost 2.0-2.7x to the cuBLAS path at
shapes with tiles enough for the SMs (``lora_matmul_shapes --grad``: Llama-3.2-1B's q/O and k/v at
4096 tokens, Llama-3.1-8B's k/v at 1024), where the forward's kernel (``W`` transposed by the MMA,
``[BLOCK_N, BLOCK_K]`` tiles) did not; ``GRAD_MIN_ROWS`` and ``GRAD_MIN_INNER`` keep it from them.
A 256-wide ``W`` tile row is 512 bytes, four times the 128-byte swizzle a TMA box can take: is the
layout of ``W``'s tiles the cause? At those shapes and two it wins, against the cuBLAS path:

- ``as stored``: the module's kernel in the backward's layout, over tiles (128 x 256, 128 x 128,
  256 x 128, 64-wide K steps and 128-wide ones), stages and warps;
- ``transposed copy``: the same ``dx`` by the forward's layout, from a contiguous copy of ``W^T``
  (``[K, N]``, made once outside the timing, as a training step could keep it beside ``W``): if this
  one is fast, the backward's ``W`` tiles are what is slow;

bf16, r = 16; GPU time (median of ``triton.testing.do_bench``, L2 flushed).

Run on a GPU:  python benchmarks/experiments/lora_grad_tiles.py
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
SHAPES = (  # (label, tokens, W's N (the inner dimension), W's K (dx's columns))
    ("1B q/O", 4096, 2048, 2048), ("1B k/v", 4096, 512, 2048), ("8B k/v", 1024, 1024, 4096),
    ("8B down", 16384, 4096, 14336), ("8B q/O (wins)", 4096, 4096, 4096), ("1B k/v (wins)", 16384, 512, 2048),
)  # fmt: skip
SETTINGS = list(
    dict.fromkeys(  # ((BLOCK_M, BLOCK_N, BLOCK_K), stages, warps); a 128 x 256 accumulator needs 8 warps
        (tile, stages, 8 if tile[0] * tile[1] > 128 * 128 else warps)
        for tile, stages, warps in itertools.product(
            ((128, 256, 64), (128, 128, 64), (256, 128, 64), (128, 128, 128)), (3, 4), (4, 8)
        )
    )
)


def grad_as_stored(dy: torch.Tensor, w: torch.Tensor, gs: torch.Tensor, a: torch.Tensor,
                   setting: tuple[tuple[int, int, int], int, int]) -> torch.Tensor:  # fmt: skip
    tile, stages, warps = setting
    return lora_matmul._launch(dy, w, False, None, gs, a, a.stride(1), a.stride(0), 1.0, tile=tile,
                               num_stages=stages, num_warps=warps)  # fmt: skip


def grad_by_transposed_copy(dy: torch.Tensor, w_t: torch.Tensor, gs: torch.Tensor, a: torch.Tensor,
                            setting: tuple[tuple[int, int, int], int, int]) -> torch.Tensor:  # fmt: skip
    """``dy W + gs A`` as the forward's kernel computes ``x W'^T + s xa B'^T``, with ``W' = W^T``
    (``w_t``, contiguous ``[K, N]``) and ``B' = A^T``."""
    tile, stages, warps = setting
    return lora_matmul._launch(dy, w_t, True, None, gs, a, a.stride(1), a.stride(0), 1.0, tile=tile,
                               num_stages=stages, num_warps=warps)  # fmt: skip


def _inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(m + n + k)
    dy = torch.randn(m, n, device=device, generator=gen).to(dtype)
    w = (n**-0.5 * torch.randn(n, k, device=device, generator=gen)).to(dtype)
    gs = torch.randn(m, R, device=device, generator=gen).to(dtype)
    a = (0.1 * torch.randn(R, k, device=device, generator=gen)).to(dtype)
    return dy, w, w.t().contiguous(), gs, a


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 tl.dot)
    dy, w, w_t, gs, a = _inputs(70, 96, 48, device, dtype)
    want = lora_matmul.base_and_lora_grad_ref(dy, w, gs, a)
    setting = ((32, 32, 32), 2, 4)
    for got in (grad_as_stored(dy, w, gs, a, setting), grad_by_transposed_copy(dy, w_t, gs, a, setting)):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    print("grad_as_stored and grad_by_transposed_copy: within rounding of float64")


def timings() -> None:
    for label, m, n, k in SHAPES:
        dy, w, w_t, gs, a = _inputs(m, n, k, "cuda", torch.bfloat16)
        flops = 2 * m * n * k / 1e9

        def row(what: str, t: float) -> None:
            print(f"  {what:56s} {t * 1e3:8.1f} us  {flops / t:5.0f} TFLOP/s", flush=True)  # noqa: B023

        print(f"== {label}: dy [{m}, {n}], W [{n}, {k}]", flush=True)
        cublas = triton.testing.do_bench(lambda: torch.mm(gs, a).addmm_(dy, w), rep=40, return_mode="median")  # noqa: B023
        row("cuBLAS path (mm, addmm_)", cublas)
        for setting in SETTINGS:
            for what, fn in (("as stored", grad_as_stored), ("transposed copy", grad_by_transposed_copy)):
                operand = w if fn is grad_as_stored else w_t
                try:
                    t = triton.testing.do_bench(lambda: fn(dy, operand, gs, a, setting), rep=40, return_mode="median")  # noqa: B023
                except (triton.runtime.errors.OutOfResources, RuntimeError) as error:
                    print(f"  {what} {setting}: {type(error).__name__}")
                    continue
                row(f"{what} {setting} ({t / cublas:.3f}x cuBLAS)", t)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
