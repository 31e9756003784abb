"""#32: ``fk.lora.lora_matmul``'s kernel runs 1-5% behind cuBLAS's base product at Llama-3.1-8B's
layer products, most where the inner dimension is short (4096: 64 K steps a tile) and the tiles
many (``lora_matmul_tune``: q/O forward at 4096 tokens 189.4 against 180.4 us, gate/up forward
634.8 against 605.6), which points at the epilogue of each tile not overlapping the next tile's
loads. Triton's persistent tutorials overlap them by flattening the tile loop into the K loop
(``tl.range(..., flatten=True)``); ``gemm_lora_epilogues`` found that flattening took the kernel from
186 to 279 us with the rank term's operands loaded by pointer in the epilogue. Is it different with
``u`` and ``v`` loaded through TMA descriptors, as the GEMM's own operands are, and with the output
stored in two halves (the tutorials' ``EPILOGUE_SUBTILE``)?

Cases (each output checked against torch's before it is timed; GPU time with the GPU idle before
each call, as ``bench_lora`` times its rows), at the module's launch (128 x 256 x 64, 3 stages,
8 warps, ``GROUP_M`` 8), persistent over the SMs:
- ``cublas``: ``torch.mm`` of the base product alone (the floor's product);
- ``fk``: ``fk.lora.lora_matmul._launch`` as taken (u and v by pointer, the tile loop not flattened);
- ``tma``: u and v through descriptors, the tile loop flattened or not, the output whole or in halves.

Run on a GPU:  python benchmarks/experiments/gemm_flat_tma_epilogue.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from lora_matmul_tune import SCALING, SHAPES, _operands, _products
from triton.tools.tensor_descriptor import TensorDescriptor

from fk.core import bench
from fk.core.launch import multiprocessor_count
from fk.core.tiles import grouped_tile_offsets

TILE, STAGES, WARPS, GROUP_M = (128, 256, 64), 3, 8, 8


@triton.jit
def _tma_kernel(a_desc, w_desc, u_desc, v_desc, out_desc, scaling, inv_scaling, n_rows, n_cols, n_inner,
                W_TRANSPOSED: tl.constexpr, FLATTEN: tl.constexpr, HALVES: tl.constexpr, N_PROGRAMS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # out = a op(W) + s u v: op(W) = W^T and v = B^T from B [N, r] (W_TRANSPOSED), else W and A [r, N].
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N), N_PROGRAMS,
                         flatten=FLATTEN):  # fmt: skip
        off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, n_inner, BLOCK_K):
            if W_TRANSPOSED:  # noqa: SIM108
                w = w_desc.load([off_n, off_k]).T
            else:
                w = w_desc.load([off_k, off_n])
            acc = tl.dot(a_desc.load([off_m, off_k]), w, acc)
        if W_TRANSPOSED:  # noqa: SIM108
            v = v_desc.load([off_n, 0]).T
        else:
            v = v_desc.load([0, off_n])
        acc = tl.dot(u_desc.load([off_m, 0]), v, acc * inv_scaling) * scaling
        if HALVES:
            first, second = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            out_desc.store([off_m, off_n], first.to(out_desc.dtype))
            out_desc.store([off_m, off_n + BLOCK_N // 2], second.to(out_desc.dtype))
        else:
            out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def tma_mm(a: torch.Tensor, w: torch.Tensor, w_transposed: bool, u: torch.Tensor, v: torch.Tensor, scaling: float,
           flatten: bool, halves: bool, tile: tuple[int, int, int] = TILE, stages: int = STAGES,
           warps: int = WARPS) -> torch.Tensor:  # fmt: skip
    """``a @ W.T + s u @ v.T`` (``w_transposed``; ``v`` = B ``[N, r]``) or ``a @ W + s u @ v`` (``v`` = A ``[r, N]``)."""
    bm, bn, bk = tile
    m = a.shape[0]
    n = w.shape[0] if w_transposed else w.shape[1]
    r = u.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    programs = min(multiprocessor_count(a.device), triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk] if w_transposed else [bk, bn]),
        TensorDescriptor.from_tensor(u, [bm, r]),
        TensorDescriptor.from_tensor(v, [bn, r] if w_transposed else [r, bn]),
        TensorDescriptor.from_tensor(out, [bm, bn // 2 if halves else bn]),
        float(scaling), 1.0 / scaling, m, n, a.shape[1], W_TRANSPOSED=w_transposed, FLATTEN=flatten, HALVES=halves,
        N_PROGRAMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out


def _tma_call(t: dict[str, torch.Tensor], fwd: bool, flatten: bool, halves: bool, **launch):  # type: ignore[no-untyped-def]
    if fwd:
        return lambda: tma_mm(t["x"], t["w"], True, t["xa"], t["lora_b"], SCALING, flatten, halves, **launch)
    return lambda: tma_mm(t["dy"], t["w"], False, t["g"], t["lora_a"], 1.0, flatten, halves, **launch)


VARIANTS = list(itertools.product((False, True), (False, True)))  # (flatten, halves)


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    t = _operands(96, 160, 128, device, dtype)
    launch = {"tile": (32, 32, 32), "stages": 2, "warps": 4} if device == "cpu" else {}
    for (label, (_, want, _)), fwd in zip(_products(t).items(), (True, False), strict=True):
        for flatten, halves in VARIANTS:
            got = _tma_call(t, fwd, flatten, halves, **launch)()
            torch.testing.assert_close(got.float(), want().float(), rtol=2e-2, atol=2e-2, msg=f"{label} {flatten}")
    print("tma_mm: within rounding of torch's (x W^T + s xa B^T, dy W + G A; flattened or not, whole or halves)")


def timings() -> None:
    fk_launch = {"tile": TILE, "num_stages": STAGES, "num_warps": WARPS, "group_m": GROUP_M}
    for label, m, n, k in SHAPES:
        t = _operands(m, n, k, "cuda", torch.bfloat16)
        print(f"== {label}: {m} tokens, W {n} x {k}", flush=True)
        for (what, (kernel, want, cublas)), fwd in zip(_products(t).items(), (True, False), strict=True):
            flops = 2 * m * n * k
            reference = want().float()

            def row(case: str, fn, check: bool = True) -> None:  # type: ignore[no-untyped-def]
                if check:
                    torch.testing.assert_close(fn().float(), reference, rtol=2e-2, atol=5e-2, msg=case)  # noqa: B023
                t_ms = bench.time_ms(fn, gpu_only=True)
                print(f"  {what:18s} {case:36s} {t_ms * 1e3:8.1f} us {flops / t_ms / 1e9:6.0f} TFLOP/s", flush=True)  # noqa: B023

            row("cuBLAS mm (base product alone)", cublas, check=False)
            row("fk lora_matmul", lambda: kernel(fk_launch))  # noqa: B023
            for flatten, halves in VARIANTS:
                row(f"tma flatten={flatten} halves={halves}", _tma_call(t, fwd, flatten, halves))


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
