"""#32: the rows still short of their floor sit on fk's Triton GEMMs, which run 2-5% behind cuBLAS
(``lora_matmul_tune``) and cannot hide an epilogue's work behind the next tile's MMAs, since
Triton 3.6's warp-specialized loop hangs on Hopper (``hopper_ws_gemm``). Does a newer Triton
change either? Run under the Triton on ``PYTHONPATH`` (the GPU machine has 3.6; a newer one is
carried there unpacked): cuBLAS's product and ``fk.lora.lora_matmul``'s kernel as taken (with the
rank-16 term) at ``lora_matmul_tune``'s twelve products, each output checked before it is timed.
The warp-specialized cases run one at a time in their own processes (``hopper_ws_gemm.py --one``
under a time limit: a loop that deadlocks hangs the GPU until its process is killed).
``--compile-ws`` (no GPU): a plain persistent TMA GEMM, its tile loop warp-specialized or not,
compiled for sm_90 at 4 and 8 warps by the Triton on the path: does the Hopper pass build it?
``--run-ws WARPS`` (a GPU; run it under a time limit): that GEMM, warp-specialized at ``WARPS``,
against cuBLAS and itself without the flag, at q/O and gate/up with 4096 tokens: does it return,
right, and how fast?

Run on a GPU:  python benchmarks/experiments/triton_upgrade_gemm.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from hopper_ws_gemm import SCALING, _fk, _products, _want
from lora_matmul_tune import SHAPES, _operands

from fk.core import bench


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    t = _operands(96, 160, 128, device, dtype)
    for label, (a, w, transposed, u, v) in _products(t).items():
        got = _fk(a, w, transposed, u, v, SCALING).double()
        torch.testing.assert_close(got, _want(a, w, transposed, u, v, SCALING), rtol=2e-2, atol=3e-2, msg=label)
    print(f"fk lora_matmul under triton {triton.__version__}: within rounding of float64")


def timings() -> None:
    print(f"triton {triton.__version__} from {triton.__file__}")
    for label, m, n, k in SHAPES:
        t = _operands(m, n, k, "cuda", torch.bfloat16)
        for what, (a, w, transposed, u, v) in _products(t).items():
            flops = 2 * a.shape[0] * a.shape[1] * (w.shape[0] if transposed else w.shape[1])
            want = _want(a, w, transposed, u, v, SCALING)
            got = _fk(a, w, transposed, u, v, SCALING).double()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=3e-2, msg=f"{label} {what}")
            cublas = bench.time_ms(lambda: torch.mm(a, w.t() if transposed else w), gpu_only=True)  # noqa: B023
            fk = bench.time_ms(lambda: _fk(a, w, transposed, u, v, SCALING), gpu_only=True)  # noqa: B023
            print(f"{label:9s} {m:6d} {what:18s} cuBLAS {cublas * 1e3:7.1f} us {flops / cublas / 1e9:4.0f} TFLOP/s"
                  f"  fk {fk * 1e3:7.1f} us {flops / fk / 1e9:4.0f} TFLOP/s  ({fk / cublas:.3f}x)", flush=True)  # fmt: skip


@triton.jit
def _plain_gemm(a_desc, w_desc, c_ptr, n_rows, n_cols, n_inner, WS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_PROGRAMS: tl.constexpr):  # fmt: skip
    # c = a W^T, persistent over output tiles; the tile loop warp-specialized where WS.
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * col_blocks, N_PROGRAMS, warp_specialize=WS):
        off_m = (tile // col_blocks) * BLOCK_M
        off_n = (tile % col_blocks) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, n_inner, BLOCK_K):
            acc = tl.dot(a_desc.load([off_m, off_k]), w_desc.load([off_n, off_k]).T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + rows[:, None] * n_cols + cols[None, :], acc.to(tl.bfloat16))


def compile_ws() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    print(f"triton {triton.__version__}: a plain persistent TMA GEMM (128 x 256 x 64, 3 stages) for sm_90")
    for warps in (4, 8):
        for ws in (False, True):
            constants = {"WS": ws, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "N_PROGRAMS": 132}
            signature = {"a_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[256, 64]>",
                         "c_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32", "n_inner": "i32"}  # fmt: skip
            signature.update(dict.fromkeys(constants, "constexpr"))
            names = _plain_gemm.arg_names
            source = ASTSource(_plain_gemm, signature, {(names.index(k),): v for k, v in constants.items()})
            try:
                kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": warps, "num_stages": 3})  # fmt: skip
                built = f"compiled: {kernel.metadata.num_warps} warps, {kernel.metadata.shared} bytes shared"
            except RuntimeError as error:
                built = f"{type(error).__name__}: {str(error).splitlines()[-1][:100]}"
            print(f"  {warps} warps, warp_specialize={ws!s:5s}  {built}", flush=True)


def plain_gemm(a: torch.Tensor, w: torch.Tensor, ws: bool, warps: int) -> torch.Tensor:
    """``a @ w.T`` by :func:`_plain_gemm` (128 x 256 x 64, 3 stages), persistent over the SMs."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = a.shape, w.shape[0]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    programs = min(torch.cuda.get_device_properties(a.device).multi_processor_count, (m // 128) * (n // 256))
    _plain_gemm[(programs,)](
        TensorDescriptor.from_tensor(a, [128, 64]), TensorDescriptor.from_tensor(w, [256, 64]), c, m, n, k,
        WS=ws, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, N_PROGRAMS=programs, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return c


def run_ws(warps: int) -> None:
    print(f"triton {triton.__version__}: the plain GEMM at {warps} warps", flush=True)
    for label, m, n, k in SHAPES[:2]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
        want = torch.mm(a, w.t())
        flops = 2 * m * n * k
        for ws in (False, True):
            got = plain_gemm(a, w, ws, warps)
            torch.cuda.synchronize()
            print(f"  {label} {m}: warp_specialize={ws} returned", flush=True)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            t = bench.time_ms(lambda: plain_gemm(a, w, ws, warps), gpu_only=True)  # noqa: B023
            print(
                f"  {label} {m}: warp_specialize={ws} right, {t * 1e3:.1f} us {flops / t / 1e9:.0f} TFLOP/s", flush=True
            )
        t = bench.time_ms(lambda: torch.mm(a, w.t()), gpu_only=True)  # noqa: B023
        print(f"  {label} {m}: cuBLAS {t * 1e3:.1f} us {flops / t / 1e9:.0f} TFLOP/s", flush=True)


def main() -> None:
    argv = __import__("sys").argv
    if "--run-ws" in argv:
        run_ws(int(argv[argv.index("--run-ws") + 1]))
        return
    if "--compile-ws" in argv:
        compile_ws()
        return
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
