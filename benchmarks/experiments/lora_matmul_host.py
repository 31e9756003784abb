"""#32, prepared (not run yet): the host time of one launch of fk.lora.lora_matmul's kernel, against
the cuBLAS calls it replaces. At 4096 tokens fk's LoRA QKV and O are host-bound (LoRA O, bf16
adapters: 1.25 ms of wall time for 0.424 of GPU time in bench_lora's record of 2026-11-28T10:26), and
``masked_grad_epilogue``'s host column put a launch of the kernel at 70-120 us, where a bare Triton
launch costs about 16 (``host_probe``). Where does it go? Each case is enqueued while the GPU spins
(``host_probe.host_us``: only the host is timed), at Llama-3.1-8B's O (4096 tokens, r = 16, bf16):

- ``cuBLAS``: ``mm`` of the rank product then ``addmm_`` (the forward's other path), and ``mm`` then
  ``masked_low_rank``'s pass (the dropout input gradient's);
- ``kernel``: ``base_and_lora_out``, ``base_and_lora_grad``, ``base_and_masked_lora_grad`` as fk calls them;
- ``kernel, descriptors built once``: the same launches with the three ``TensorDescriptor``\\ s made
  outside the timing (what a cache of them would save);
- ``TensorDescriptor.from_tensor`` alone, and ``fused_applies`` (the checks fk runs before each call).

``--profile`` then runs each kernel case 400 times under ``cProfile`` (the GPU spinning, as above) and
prints the functions that take the most of its own time: which lines of fk's and Triton's launch path
a cache or a leaner launch would remove.

Run on a GPU:  python benchmarks/experiments/lora_matmul_host.py [--profile]
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fk.core import bench
from fk.core.launch import dot_size, persistent_grid
from fk.lora import lora_matmul
from fk.lora.masked_low_rank import add_masked_low_rank_

R, P = 16, 0.05


def _inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(m + n + k)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return {"x": randn(m, k), "w": randn(n, k, std=k**-0.5), "xa": randn(m, R), "b": randn(n, R, std=0.1),
            "dy": randn(m, n), "gs": randn(m, R), "a": randn(R, k, std=0.1),
            "mask": torch.rand(m, k, device=device, generator=gen) >= P}  # fmt: skip


def forward_with_cached_descriptors(t: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``base_and_lora_out(x, W, None, xa, B, 2)`` with its output and its descriptors made once (the
    launch as ``lora_matmul._launch`` makes it, rank term through descriptors where it would be)."""
    (bm, bn, bk), (m, k), n = lora_matmul.TILE, t["x"].shape, t["w"].shape[0]
    out = torch.empty(m, n, dtype=t["x"].dtype, device=t["x"].device)
    block_rank = dot_size(R)
    by_tma = lora_matmul.rank_by_tma(t["xa"], t["b"])
    u_desc = TensorDescriptor.from_tensor(t["xa"], [bm, block_rank]) if by_tma else None
    v_desc = TensorDescriptor.from_tensor(t["b"], [bn, block_rank]) if by_tma else None
    descs = (TensorDescriptor.from_tensor(t["x"], [bm, bk]), TensorDescriptor.from_tensor(t["w"], [bn, bk]),
             TensorDescriptor.from_tensor(out, [bm, bn // 2 if by_tma else bn]), u_desc, v_desc)  # fmt: skip
    programs = persistent_grid(triton.cdiv(m, bm) * triton.cdiv(n, bn), out.device)

    def launch() -> torch.Tensor:
        lora_matmul._base_and_lora_kernel[(programs,)](
            *descs, t["xa"], t["b"], out, out, 2.0, 0.5, 1.0, m, n, k, R, t["xa"].stride(0), t["b"].stride(0),
            t["b"].stride(1), out.stride(0), W_TRANSPOSED=True, HAS_BIAS=False, MASKED=False, MASK_BASE=False,
            ACCUMULATE=False, RANK_BY_TMA=by_tma, BLOCK_RANK=block_rank, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=lora_matmul.GROUP_M, N_PROGRAMS=programs, num_stages=lora_matmul.NUM_STAGES,
            num_warps=lora_matmul.NUM_WARPS,
        )  # fmt: skip
        return out

    return launch


def cases(t: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    f = 1 / (1 - P)
    return {
        "cuBLAS forward (mm, addmm_)": lambda: torch.mm(t["xa"], t["b"].t()).mul_(2.0).addmm_(t["x"], t["w"].t()),
        "kernel forward (base_and_lora_out)": lambda: lora_matmul.base_and_lora_out(t["x"], t["w"], None, t["xa"], t["b"], 2.0),
        "kernel forward, descriptors built once": forward_with_cached_descriptors(t),
        "cuBLAS input gradient (mm, addmm_)": lambda: torch.mm(t["gs"], t["a"]).addmm_(t["dy"], t["w"]),
        "kernel input gradient (base_and_lora_grad)": lambda: lora_matmul.base_and_lora_grad(t["dy"], t["w"], t["gs"], t["a"]),
        "cuBLAS + pass, dropout (mm, masked_low_rank)": lambda: add_masked_low_rank_(torch.mm(t["dy"], t["w"]), t["gs"], t["a"], t["mask"], f),
        "kernel, dropout (base_and_masked_lora_grad)": lambda: lora_matmul.base_and_masked_lora_grad(t["dy"], t["w"], t["gs"], t["a"], t["mask"], f),
        "TensorDescriptor.from_tensor, three": lambda: [TensorDescriptor.from_tensor(t["x"], [128, 64]) for _ in range(3)],
        "fused_applies": lambda: lora_matmul.fused_applies(t["x"], t["w"], None, t["xa"], t["b"], 2.0),
    }  # fmt: skip


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 tl.dot)
    t = _inputs(70, 64, 96, device, dtype)
    want = lora_matmul.base_and_lora_out_ref(t["x"], t["w"], None, t["xa"], t["b"], 2.0)
    got = forward_with_cached_descriptors(t)()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    for fn in cases(t).values():
        fn()
    print("every case runs; the cached-descriptor launch within rounding of float64")


def timings() -> None:
    from host_probe import host_us

    t = _inputs(4096, 4096, 4096, "cuda", torch.bfloat16)
    print("== host time a call, Llama-3.1-8B O at 4096 tokens (us)", flush=True)
    for name, fn in cases(t).items():
        print(f"  {name:58s} {host_us(fn):8.1f} us", flush=True)


def profiles(t: dict[str, torch.Tensor], calls: int = 400, top: int = 18) -> None:
    import cProfile
    import pstats

    for name, fn in cases(t).items():
        if not name.startswith("kernel"):
            continue
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))  # the launches never wait for the GPU
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"== {name}: {calls} calls under cProfile, by own time", flush=True)
        pstats.Stats(profile).strip_dirs().sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="also cProfile each kernel case")

    def body(args: argparse.Namespace, copy: float) -> None:
        timings()
        if args.profile:
            profiles(_inputs(4096, 4096, 4096, "cuda", torch.bfloat16))

    bench.run_probe(parser, check, body)


if __name__ == "__main__":
    main()
