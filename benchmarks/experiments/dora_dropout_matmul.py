"""#32: DoRA with dropout recomputes the base product on the dropped input, so each projection's
forward ran two cuBLAS GEMMs (``x W^T`` and ``zd = d(x) W^T``, both written) and one pass reading
both back to write ``y`` and ``z`` (``_dora_dropout_output``: 0.205 ms of DoRA q/k/v's 5.82 at 16384
tokens, 0.277 of the MLP's 9.52 at 4096, ``lora_shortfalls``). ``fk.lora.dora_dropout_matmul`` does
both products in one persistent TMA GEMM (two accumulators fed by one ``W`` tile) and writes ``y``
and ``z`` from its epilogue. Is it faster than the path it replaces, at which launch?

Each launch's ``(y, z)`` is checked against the other path's before it is timed; GPU time with the
GPU idle before each call, as ``bench_lora`` times its rows; cuBLAS's two base products alone
beside them.

Run on a GPU:  python benchmarks/experiments/dora_dropout_matmul.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse

import torch
import triton

from fk.core import bench
from fk.lora.dora_dropout_matmul import dora_dropout_out
from fk.lora.dora_elementwise import LowRank, dora_dropout_output

R = 16
SCALING = 2.0
SHAPES = (  # (label, tokens, W rows (out features), W columns (in features))
    ("q / O", 4096, 4096, 4096),
    ("k / v", 4096, 1024, 4096),
    ("gate / up", 4096, 14336, 4096),
    ("down", 4096, 4096, 14336),
    ("q / O", 16384, 4096, 4096),
    ("k / v", 16384, 1024, 4096),
    ("gate / up", 16384, 14336, 4096),
    ("down", 16384, 4096, 14336),
)
LAUNCHES = (  # ((BLOCK_M, BLOCK_N, BLOCK_K), stages, warps); the first is the module's
    ((128, 128, 64), 3, 8),
    ((128, 128, 64), 4, 8),
    ((128, 128, 32), 5, 8),
    ((64, 256, 64), 3, 8),
    ((128, 64, 64), 4, 4),
)


def _operands(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(m + n + k)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    x = randn(m, k)
    keep = torch.rand(m, k, device=device, generator=gen) >= 0.05
    ms = 1 + 0.1 * torch.randn(n, device=device, generator=gen)
    return {"x": x, "dropped": (x.float() * keep / 0.95).to(dtype), "w": randn(n, k, std=k**-0.5),
            "xa": randn(m, R), "lora_b": randn(n, R, std=0.1), "ms": ms}  # fmt: skip


def _paths(t: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """(the kernel at a launch, fk's other path, cuBLAS's two base products alone)."""
    x, dropped, w, xa, lb, ms = (t[n] for n in ("x", "dropped", "w", "xa", "lora_b", "ms"))

    def other() -> tuple[torch.Tensor, torch.Tensor]:
        return dora_dropout_output(torch.mm(x, w.t()), torch.mm(dropped, w.t()), LowRank(xa, lb, SCALING), ms, None)

    return (
        lambda launch: dora_dropout_out(x, dropped, w, xa, lb, SCALING, ms, None, **launch),
        other,
        lambda: (torch.mm(x, w.t()), torch.mm(dropped, w.t())),
    )


def _kwargs(launch) -> dict:  # type: ignore[no-untyped-def, type-arg]
    tile, stages, warps = launch
    return {"tile": tile, "num_stages": stages, "num_warps": warps}


def _check(got, want, tol: float, what: str) -> None:  # type: ignore[no-untyped-def]
    for name, g, w in zip("yz", got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol, msg=f"{name} {what}")


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    kernel, other, _ = _paths(_operands(96, 160, 128, device, dtype))
    for launch in (((32, 32, 32), 2, 4), ((32, 64, 32), 2, 4)):
        _check(kernel(_kwargs(launch)), other(), 2e-2, str(launch))
    print("dora_dropout_out at other launches: within rounding of fk's other path (y, z)")


def timings() -> None:
    for label, m, n, k in SHAPES:
        kernel, other, cublas = _paths(_operands(m, n, k, "cuda", torch.bfloat16))
        flops = 2 * 2 * m * n * k
        print(f"== {label}: {m} tokens, W {n} x {k}", flush=True)

        def row(case: str, t_ms: float, base_ms: float | None = None) -> None:
            against = f"  ({t_ms / base_ms:.3f}x the other path)" if base_ms else ""
            print(f"  {case:36s} {t_ms * 1e3:8.1f} us {flops / t_ms / 1e9:6.0f} TFLOP/s{against}", flush=True)  # noqa: B023

        row("cuBLAS: the two base products alone", bench.time_ms(cublas, gpu_only=True))
        other_ms = bench.time_ms(other, gpu_only=True)
        row("fk's other path (2 mm + pass)", other_ms)
        reference = other()
        best = None
        for launch in LAUNCHES:
            try:
                got = kernel(_kwargs(launch))
            except triton.runtime.errors.OutOfResources as error:
                print(f"  {launch!s:36s} {type(error).__name__}", flush=True)
                continue
            _check(got, reference, 5e-2, str(launch))
            t_ms = bench.time_ms(lambda: kernel(_kwargs(launch)), gpu_only=True)  # noqa: B023
            row(str(launch), t_ms, other_ms)
            if best is None or t_ms < best[0]:
                best = (t_ms, launch)
        if best is not None:
            row(f"best {best[1]}", best[0], other_ms)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
