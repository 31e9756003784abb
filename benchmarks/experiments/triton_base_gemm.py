"""#32: what keeps QLoRA's O at 4096 tokens at 88% of its floor, beside the base GEMMs at the
matmul ceiling, is the LoRA work that cuBLAS cannot take into its GEMMs (``rank_products``): the
forward writes ``s (x A^T) B^T`` as an ``[M, N]`` tensor that the base GEMM reads back (``addmm``,
beta = 1), and the backward's masked pass reads and writes the ``[M, K]`` input gradient the base
GEMM wrote. A GEMM of fk's own could add the rank-16 product in its epilogue, where it costs one
``[BM, r] x [r, BN]`` MMA a tile and no bytes. That pays only if Triton's GEMM is as fast as
cuBLAS's on the base products themselves. Is it?

- ``cublas``: ``torch.mm`` (forward ``x W^T``, backward ``dy W``), and ``torch.addmm`` with the
  LoRA output as the addend (``beta = 1``, as fk's forward runs it) beside it;
- ``triton``: a persistent Triton GEMM with TMA descriptors (operands and output), tiles walked in
  groups of ``GROUP_M`` row blocks; Hopper has no automatic warp specialization in Triton 3.6
  (Blackwell only), so this is its pipelined wgmma loop;
- ``triton + lora``: the same GEMM with ``s u B^T`` (``u = x A^T``, ``[M, r]``) added in the
  epilogue, the forward's fusion;

at Llama-3.1-8B's O (4096 x 4096) and q (4096 x 4096), k/v (1024 x 4096) weights, 4096 and 16384
tokens, bf16 operands, fp32 sums; GPU time (median of ``triton.testing.do_bench``, L2 flushed) and
TFLOP/s over a few tile shapes and pipeline depths.

Run on a GPU:  python benchmarks/experiments/triton_base_gemm.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fk.core import bench
from fk.core.launch import multiprocessor_count

R = 16
SHAPES = (  # (label, tokens, out features, in features)
    ("O / q forward", 4096, 4096, 4096),
    ("O / q forward", 16384, 4096, 4096),
    ("k / v forward", 4096, 1024, 4096),
    ("k / v forward", 16384, 1024, 4096),
)


@triton.jit
def _gemm_kernel(a_desc, b_desc, c_desc, u_ptr, lora_b_ptr, scale, n_rows, n_cols, n_inner, B_TRANSPOSED: tl.constexpr,
                 LORA: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, N_PROGRAMS: tl.constexpr):  # fmt: skip
    # C = A B (B given as [N, K] when B_TRANSPOSED: x W^T), plus scale u L^T (u [M, r], L [N, r]).
    tiles_m, tiles_n = tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N)
    k_steps = tl.cdiv(n_inner, BLOCK_K)
    in_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, N_PROGRAMS, flatten=True):
        group = tile // in_group
        first_m = group * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % in_group) % group_m
        tile_n = (tile % in_group) // group_m
        off_m, off_n = tile_m * BLOCK_M, tile_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(k_steps):
            off_k = step * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_TRANSPOSED:
                acc = tl.dot(a, b_desc.load([off_n, off_k]).T, acc)
            else:
                acc = tl.dot(a, b_desc.load([off_k, off_n]), acc)
        if LORA:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, RANK)
            u = tl.load(u_ptr + rows[:, None] * RANK + ks[None, :], mask=rows[:, None] < n_rows, other=0.0)
            lora_b = tl.load(lora_b_ptr + cols[None, :] * RANK + ks[:, None], mask=cols[None, :] < n_cols, other=0.0)
            # Into the accumulator, as the base product's last K step: a second [BM, BN] tile spills.
            acc = tl.dot((u * scale).to(u.dtype), lora_b, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def triton_mm(a: torch.Tensor, b: torch.Tensor, b_transposed: bool, config: tuple[int, int, int, int, int, int],
              lora: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:  # fmt: skip
    """``a @ b.T`` (``b_transposed``) or ``a @ b``, plus ``scale * u @ lora_b.T`` where ``lora`` is
    ``(u, lora_b, scale)``; ``config`` is (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M)."""
    bm, bn, bk, stages, warps, group_m = config
    m, k = a.shape
    n = b.shape[0] if b_transposed else b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk] if b_transposed else [bk, bn])
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn])
    u, lora_b, scale = lora if lora is not None else (c, c, 0.0)
    programs = min(multiprocessor_count(a.device), triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _gemm_kernel[(programs,)](a_desc, b_desc, c_desc, u, lora_b, scale, m, n, k, B_TRANSPOSED=b_transposed,
                              LORA=lora is not None, RANK=R, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                              N_PROGRAMS=programs, num_stages=stages, num_warps=warps)  # fmt: skip
    return c


def _inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(m + n + k)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return {"x": randn(m, k), "w": randn(n, k, std=k**-0.5), "dy": randn(m, n), "u": randn(m, R),
            "lora_b": randn(n, R, std=0.1)}  # fmt: skip


def check(device: str) -> None:
    # fp16 here: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    for m, n, k in ((40, 48, 80), (130, 64, 96)):
        t = _inputs(m, n, k, device, dtype)
        x, w, dy, u, lb = (t[name].double() for name in ("x", "w", "dy", "u", "lora_b"))
        config = (32, 32, 32, 2, 4, 2)
        cases = {
            "x W^T": (triton_mm(t["x"], t["w"], True, config), x @ w.t()),
            "dy W": (triton_mm(t["dy"], t["w"], False, config), dy @ w),
            "x W^T + s u B^T": (
                triton_mm(t["x"], t["w"], True, config, (t["u"], t["lora_b"], 0.5)),
                x @ w.t() + 0.5 * u @ lb.t(),
            ),
        }
        for label, (got, want) in cases.items():
            torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2, msg=label)
    print("triton_mm: within rounding of float64 (x W^T, dy W, x W^T + s u B^T)")


CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M): the tiles of Triton's Hopper tutorials;
    # a 128 x 256 fp32 accumulator needs 8 warps (4 spill it)
    (bm, bn, 64, stages, warps, 8)
    for (bm, bn, warps), stages in itertools.product(
        ((128, 128, 4), (128, 128, 8), (128, 256, 8), (256, 128, 8)), (3, 4)
    )
]


def ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, rep=40, return_mode="median"))


def timings() -> None:
    for label, m, n, k in SHAPES:
        t = _inputs(m, n, k, "cuda", torch.bfloat16)
        x, w, dy, u, lb = (t[name] for name in ("x", "w", "dy", "u", "lora_b"))
        lora_out = torch.mm(u, lb.t())
        flops = 2 * m * n * k
        print(f"== {label}: {m} tokens, W {n} x {k}, {flops / 1e9:.0f} GFLOP a product", flush=True)

        def row(what: str, t: float) -> None:
            print(f"  {what:58s} {t * 1e3:7.1f} us  {flops / t / 1e9:6.0f} TFLOP/s", flush=True)  # noqa: B023

        row("cuBLAS x W^T (mm)", ms(lambda: torch.mm(x, w.t())))  # noqa: B023
        row("cuBLAS x W^T + lora_out (addmm, beta 1)", ms(lambda: torch.addmm(lora_out, x, w.t())))  # noqa: B023
        row("cuBLAS lora_out = s u B^T alone (not a product of W)", ms(lambda: torch.mm(u, lb.t())))  # noqa: B023
        row("cuBLAS dy W (mm, [M, K] out)", ms(lambda: torch.mm(dy, w)))  # noqa: B023
        best: dict[str, tuple[float, tuple[int, ...]]] = {}
        for config in CONFIGS:
            variants = {
                "triton x W^T": lambda: triton_mm(x, w, True, config),  # noqa: B023
                "triton x W^T + s u B^T": lambda: triton_mm(x, w, True, config, (u, lb, 2.0)),  # noqa: B023
                "triton dy W": lambda: triton_mm(dy, w, False, config),  # noqa: B023
            }
            for what, fn in variants.items():
                try:
                    t_ms = ms(fn)
                except (triton.runtime.errors.OutOfResources, RuntimeError) as error:
                    print(f"  {what} {config}: {type(error).__name__}")
                    continue
                row(f"{what} {config}", t_ms)
                if what not in best or t_ms < best[what][0]:
                    best[what] = (t_ms, config)
        for what, (t_ms, config) in best.items():
            row(f"best {what} {config}", t_ms)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
