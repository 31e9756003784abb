"""#32: is Triton 3.6's warp-specialized GEMM (``tl.range(..., warp_specialize=True)``) as fast as
cuBLAS on an H200 at Llama-3.1-8B's layer products, with fk's rank-sized LoRA term in its epilogue?

fk's ``fk.lora.lora_matmul`` kernel is a persistent, pipelined wgmma loop (one warp group issues
the loads and the MMAs): at 16384 tokens it ran 3-10% behind cuBLAS (``triton_base_gemm``,
``qlora_profile_mlp``), and much of what the QLoRA and DoRA rows lack against their floor is that.
Triton 3.6 also has a Hopper pass that splits such a loop into a producer warp group (the TMA
loads) and two consumer warp groups (the MMAs, each half of the tile's rows), as cuBLAS's kernels
do; its docstring says Blackwell only, but compiled for sm_90 with ``num_warps=4`` the loop comes
out as 12 warps with ``setmaxnreg`` (no change at 8 warps). The rank term goes in through TMA
descriptors (``u`` ``[M, r]``, ``v``): loaded by pointer in the epilogue, the pass fails to compile.

Cases, each product checked against cuBLAS before it is timed (GPU time, the GPU idle before each
call, as ``bench_lora`` times its rows):
- ``cublas``: ``torch.mm`` (``x @ W.T``, ``dy @ W``), the floor's own product;
- ``fk``: ``fk.lora.lora_matmul``'s kernel as taken (128 x 256 x 64, 3 stages, 8 warps), with the term;
- ``ws``: the warp-specialized loop, one program a tile (grouped), with the term, over tiles and stages;
- ``ws persistent``: the same with the tile loop persistent (the pass on the tile loop).

Run on a GPU:  python benchmarks/experiments/hopper_ws_gemm.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from lora_matmul_tune import SHAPES, _operands  # the same products and operands
from triton.tools.tensor_descriptor import TensorDescriptor

from fk.core import bench
from fk.core.launch import multiprocessor_count
from fk.core.tiles import grouped_tile_offsets
from fk.lora import lora_matmul

WS_CONFIGS = (  # (BLOCK_M, BLOCK_N, BLOCK_K, stages); 4 warps a consumer group, as the pass needs
    (128, 256, 64, 3),
    (128, 256, 64, 4),
    (128, 128, 64, 4),
    (128, 128, 64, 5),
    (256, 128, 64, 3),
)
GROUP_M = 8


@triton.jit
def _ws_kernel(a_desc, w_desc, u_desc, v_desc, c_ptr, scaling, inv_scaling, n_rows, n_cols, n_inner,
               W_TRANSPOSED: tl.constexpr, PERSISTENT: tl.constexpr, N_PROGRAMS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # c = a op(W) + s u v: op(W) = W^T, v = B^T from B [N, r] (W_TRANSPOSED, the forward), or
    # op(W) = W, v = A [r, N] (the input gradient).
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N), N_PROGRAMS,
                             warp_specialize=True):  # fmt: skip
            _ws_tile(tile, a_desc, w_desc, u_desc, v_desc, c_ptr, scaling, inv_scaling, n_rows, n_cols, n_inner,
                     W_TRANSPOSED, False, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)  # fmt: skip
    else:
        _ws_tile(tl.program_id(0), a_desc, w_desc, u_desc, v_desc, c_ptr, scaling, inv_scaling, n_rows, n_cols,
                 n_inner, W_TRANSPOSED, True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)  # fmt: skip


@triton.jit
def _ws_tile(tile, a_desc, w_desc, u_desc, v_desc, c_ptr, scaling, inv_scaling, n_rows, n_cols, n_inner,
             W_TRANSPOSED: tl.constexpr, WS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for off_k in tl.range(0, n_inner, BLOCK_K, warp_specialize=WS):
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
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))  # fmt: skip


def ws_mm(a: torch.Tensor, w: torch.Tensor, w_transposed: bool, u: torch.Tensor, v: torch.Tensor, scaling: float,
          config: tuple[int, int, int, int], persistent: bool = False) -> torch.Tensor:  # fmt: skip
    """``a @ W.T + s u @ v.T`` (``w_transposed``; ``v`` = B ``[N, r]``) or ``a @ W + s u @ v``
    (``v`` = A ``[r, N]``); ``config`` (BLOCK_M, BLOCK_N, BLOCK_K, stages)."""
    bm, bn, bk, stages = config
    m, k = a.shape
    n = w.shape[0] if w_transposed else w.shape[1]
    r = u.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(multiprocessor_count(a.device), tiles) if persistent else tiles
    _ws_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk] if w_transposed else [bk, bn]),
        TensorDescriptor.from_tensor(u, [bm, r]),
        TensorDescriptor.from_tensor(v, [bn, r] if w_transposed else [r, bn]),
        c, float(scaling), 1.0 / scaling, m, n, k, W_TRANSPOSED=w_transposed, PERSISTENT=persistent,
        N_PROGRAMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, num_stages=stages, num_warps=4,
    )  # fmt: skip
    return c


def _products(t: dict[str, torch.Tensor]) -> dict[str, tuple]:  # type: ignore[type-arg]
    """(a, W, transposed, u, v, v as fk's kernel takes it (column and rank strides)) per product."""
    return {
        "x W^T + s xa B^T": (t["x"], t["w"], True, t["xa"], t["lora_b"]),
        "dy W + s G A": (t["dy"], t["w"], False, t["g"], t["lora_a"]),
    }


def _want(a, w, transposed, u, v, s):  # type: ignore[no-untyped-def]
    a, w, u, v = (z.double() for z in (a, w, u, v))
    return a @ (w.t() if transposed else w) + s * (u @ (v.t() if transposed else v))


def _fk(a, w, transposed, u, v, s):  # type: ignore[no-untyped-def]
    col, rank = (v.stride(0), v.stride(1)) if transposed else (v.stride(1), v.stride(0))
    return lora_matmul._launch(a, w, transposed, None, u, v, col, rank, s)


SCALING = 2.0


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    shapes = ((64, 96, 128), (128, 256, 192)) if device == "cpu" else ((4096, 4096, 4096),)
    configs = ((32, 32, 32, 2),) if device == "cpu" else WS_CONFIGS
    for m, n, k in shapes:
        t = _operands(m, n, k, device, dtype)
        for label, (a, w, transposed, u, v) in _products(t).items():
            want = _want(a, w, transposed, u, v, SCALING)
            for config in configs:
                for persistent in (False, True):
                    got = ws_mm(a, w, transposed, u, v, SCALING, config, persistent)
                    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=3e-2, msg=f"{label} {config}")
    print("ws_mm: within rounding of float64 (x W^T + s xa B^T, dy W + s G A; one program a tile and persistent)")


def ms(fn) -> float:  # type: ignore[no-untyped-def]
    return bench.time_ms(fn, gpu_only=True)


def timings() -> None:
    for label, m, n, k in SHAPES:
        t = _operands(m, n, k, "cuda", torch.bfloat16)
        print(f"== {label}: {m} tokens, W {n} x {k}", flush=True)
        for what, (a, w, transposed, u, v) in _products(t).items():
            flops = 2 * a.shape[0] * a.shape[1] * (w.shape[0] if transposed else w.shape[1])
            want = _want(a, w, transposed, u, v, SCALING)

            def row(case: str, fn, check: bool = True) -> None:  # type: ignore[no-untyped-def]
                if check:
                    torch.testing.assert_close(fn().double(), want, rtol=2e-2, atol=3e-2, msg=case)  # noqa: B023
                t_ms = ms(fn)
                print(f"  {what:18s} {case:32s} {t_ms * 1e3:8.1f} us {flops / t_ms / 1e9:6.0f} TFLOP/s", flush=True)  # noqa: B023

            row("cublas mm (no term)", lambda: torch.mm(a, w.t() if transposed else w), check=False)  # noqa: B023
            row("fk lora_matmul", lambda: _fk(a, w, transposed, u, v, SCALING))  # noqa: B023
            for config in WS_CONFIGS:
                for persistent in (False, True):
                    name = f"ws{' persistent' if persistent else ''} {config}"
                    try:
                        row(name, lambda: ws_mm(a, w, transposed, u, v, SCALING, config, persistent))  # noqa: B023
                    except (triton.runtime.errors.OutOfResources, RuntimeError) as error:
                        print(f"  {what:18s} {name:32s} {type(error).__name__}: {str(error)[:80]}", flush=True)


def one(spec: str) -> None:
    """One case alone (``--one BM,BN,BK,STAGES,PERSISTENT,TRANSPOSED``) at q/O 4096 tokens: checked,
    then timed; run in its own process under a time limit (a loop whose warp groups deadlock hangs
    the GPU until the process is killed)."""
    bm, bn, bk, stages, persistent, transposed = (int(v) for v in spec.split(","))
    t = _operands(4096, 4096, 4096, "cuda", torch.bfloat16)
    a, w, transposed_, u, v = _products(t)["x W^T + s xa B^T" if transposed else "dy W + s G A"]
    fn = lambda: ws_mm(a, w, transposed_, u, v, SCALING, (bm, bn, bk, stages), bool(persistent))  # noqa: E731
    got = fn()
    torch.cuda.synchronize()
    print(spec, "ran", flush=True)
    torch.testing.assert_close(got.double(), _want(a, w, transposed_, u, v, SCALING), rtol=2e-2, atol=3e-2)
    print(spec, "right", f"{ms(fn) * 1e3:.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", help="BM,BN,BK,STAGES,PERSISTENT,TRANSPOSED: that case alone (see one())")
    if "--one" in __import__("sys").argv:
        one(parser.parse_known_args()[0].one)
        return
    bench.run_probe(parser, check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
