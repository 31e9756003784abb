"""#32: QLoRA O at 4096 tokens lacks 11% of its target with no kernel left that runs near its bytes:
beside its two base GEMMs it runs small memory-bound kernels that do not depend on each other, each
at 39-63% of the copy bandwidth alone (``qlora_profile_4096``, ``lora_rank_products``): the 4-bit
dequantization of ``W`` and, in the forward, ``xa = x A^T``; in the backward, ``s G, dB`` from ``dy``
(``fk.lora.dy_products``) and ``dA = (s G)^T x``. Does a second CUDA stream, running the
dequantization beside the rank products, shorten the pair's GPU time, and by how much? (A
persistent GEMM fills every SM, so only these kernels can overlap.)

Cases, at Llama-3.1-8B's O (``W`` 4096 x 4096 NF4, nested, blocksize 64; r = 16; bf16), 4096 and
16384 tokens: forward ``dequantize(W)`` and ``x A^T``; backward ``dequantize(W)`` and
``dy_products`` then ``dA``. Each one after the other on one stream, then with the dequantization
on a side stream (joined before the end event), GPU time with the GPU idle before each call, as
``bench_lora`` times its rows. The overlapped results are checked against the serial ones.

Run on a GPU:  python benchmarks/experiments/stream_overlap.py
Check (no GPU: the serial cases only, in the interpreter):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from fk.core import bench
from fk.core.matmul import scaled_mm
from fk.lora import dequantize, quantize_ref
from fk.lora.dy_products import dy_products

R = 16
SCALING = 2.0
TOKENS = (4096, 16384)
HIDDEN = 4096


def _operands(m: int, k: int, device: str, dtype: torch.dtype) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(m + k)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    weight = quantize_ref(torch.randn(k, k, device=device, generator=gen) * k**-0.5, "nf4", 64, nested=True)
    return {"q": weight, "x": randn(m, k), "dy": randn(m, k), "a": randn(R, k, std=0.1), "b": randn(k, R, std=0.1),
            "xa": randn(m, R)}  # fmt: skip


def _forward(t: dict[str, Any], side: torch.cuda.Stream | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, x A^T): the dequantization on ``side`` where given."""
    return _beside(lambda: dequantize(t["q"], dtype=t["x"].dtype), lambda: (t["x"] @ t["a"].t(),), side)


def _backward(t: dict[str, Any], side: torch.cuda.Stream | None) -> tuple[torch.Tensor, ...]:
    """(W, s G, dB, dA): the dequantization on ``side`` where given."""

    def rank_products() -> tuple[torch.Tensor, ...]:
        gs, db = dy_products(t["dy"], t["b"], t["xa"], SCALING, t["dy"].dtype)
        return gs, db, scaled_mm(gs.t(), t["x"], 1.0, t["x"].dtype)

    return _beside(lambda: dequantize(t["q"], dtype=t["x"].dtype), rank_products, side)


def _beside(first: Callable[[], torch.Tensor], rest: Callable[[], tuple[torch.Tensor, ...]],
            side: torch.cuda.Stream | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``first()`` and ``rest()``: one after the other, or ``first`` on ``side`` beside ``rest`` on
    the current stream, joined after both (its output recorded on the current stream, as a caller
    that frees it there must)."""
    if side is None:
        return first(), *rest()
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        w = first()
    out = rest()
    main.wait_stream(side)
    w.record_stream(main)
    return w, *out


def check(device: str) -> None:
    # fp16 in the interpreter (Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong); no second
    # stream without a GPU: the serial cases and their shapes.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    t = _operands(96, 128, device, dtype)
    side = torch.cuda.Stream() if device == "cuda" else None
    for case in (_forward, _backward):
        serial = case(t, None)
        got = case(t, side) if side is not None else serial
        for s_, g in zip(serial, got, strict=True):
            torch.testing.assert_close(g.float(), s_.float(), rtol=1e-2, atol=1e-2)
    print("stream_overlap: the cases run, overlapped equal to serial where there is a GPU")


def timings() -> None:
    side = torch.cuda.Stream()
    for m in TOKENS:
        t = _operands(m, HIDDEN, "cuda", torch.bfloat16)
        print(f"== O at {m} tokens, W {HIDDEN} x {HIDDEN} NF4, r = {R}", flush=True)
        for name, case in (
            ("forward: dequantize || x A^T", _forward),
            ("backward: dequantize || G, dB, dA", _backward),
        ):
            serial = case(t, None)
            for s_, g in zip(serial, case(t, side), strict=True):
                torch.testing.assert_close(g.float(), s_.float(), rtol=1e-2, atol=1e-2)
            alone = bench.time_ms(lambda: dequantize(t["q"], dtype=torch.bfloat16), gpu_only=True)  # noqa: B023
            one = bench.time_ms(lambda: case(t, None), gpu_only=True)  # noqa: B023
            two = bench.time_ms(lambda: case(t, side), gpu_only=True)  # noqa: B023
            print(f"  {name:36s} one stream {one * 1e3:7.1f} us, two {two * 1e3:7.1f} us ({two / one:.3f}x); "
                  f"the dequantization alone {alone * 1e3:6.1f} us", flush=True)  # fmt: skip


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
