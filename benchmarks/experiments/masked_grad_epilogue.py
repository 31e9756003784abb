"""#32: fk.lora.lora_matmul's input gradient with dropout, the masked rank term in the GEMM's
epilogue (``base_and_masked_lora_grad``), against the passes it replaces, at the call sites that take
it, Llama-3.1-8B's attention (q/O W 4096 x 4096, k/v 1024 x 4096), 4096 and 16384 tokens, r = 16,
p = 0.05, bf16:

- LoRA O (one projection): ``mm`` then ``masked_low_rank``'s pass (``pass``) against one GEMM
  (``epilogue``);
- LoRA q/k/v (three masks on one dx): ``mm``, two ``addmm_`` and one pass for the three terms
  (``pass``); the first GEMM with q's term and the pass for k's and v's (``epilogue first``); each
  GEMM with its own term, k's and v's added to dx (``epilogue all``, as fk.lora takes it);
- DoRA, one projection's term ``f m (dy_ms1 W + s G A)`` added to a dx holding ``dy W``: ``mm`` of
  the addend and the pass (``pass``) against the GEMM masking its own product (``epilogue``).

GPU time (``fk.core.bench.time_ms(gpu_only=True)``, bench_lora's measure) and the host's time to
enqueue one call (``host us``: the mean over 200 calls queued back to back).

Run on a GPU:  python benchmarks/experiments/masked_grad_epilogue.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fk.core import bench
from fk.lora import lora_matmul
from fk.lora.masked_low_rank import MaskedLowRank, add_masked_low_rank_, add_masked_low_ranks_

R, P = 16, 0.05
F = 1 / (1 - P)


def _inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return {"dy": randn(m, n), "dy_ms1": randn(m, n, std=0.1), "w": randn(n, k, std=n**-0.5), "gs": randn(m, R),
            "a": randn(R, k, std=0.1), "mask": torch.rand(m, k, device=device, generator=gen) >= P}  # fmt: skip


def one_pass(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return add_masked_low_rank_(torch.mm(t["dy"], t["w"]), t["gs"], t["a"], t["mask"], F)


def one_epilogue(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return lora_matmul.base_and_masked_lora_grad(t["dy"], t["w"], t["gs"], t["a"], t["mask"], F)


def qkv_pass(ts: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    dx = torch.mm(ts[0]["dy"], ts[0]["w"])
    for t in ts[1:]:
        dx.addmm_(t["dy"], t["w"])
    return add_masked_low_ranks_(dx, [MaskedLowRank(t["gs"], t["a"], t["mask"], F) for t in ts])


def qkv_epilogue_first(ts: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    dx = one_epilogue(ts[0])
    for t in ts[1:]:
        dx.addmm_(t["dy"], t["w"])
    return add_masked_low_ranks_(dx, [MaskedLowRank(t["gs"], t["a"], t["mask"], F) for t in ts[1:]])


def qkv_epilogue_all(ts: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    dx = one_epilogue(ts[0])
    for t in ts[1:]:
        lora_matmul.base_and_masked_lora_grad(t["dy"], t["w"], t["gs"], t["a"], t["mask"], F, out=dx)
    return dx


def dora_pass(t: dict[str, torch.Tensor], dx: torch.Tensor) -> torch.Tensor:
    addend = torch.mm(t["dy_ms1"], t["w"])
    return add_masked_low_rank_(dx, t["gs"], t["a"], t["mask"], F, addend=addend)


def dora_epilogue(t: dict[str, torch.Tensor], dx: torch.Tensor) -> torch.Tensor:
    return lora_matmul.base_and_masked_lora_grad(t["dy_ms1"], t["w"], t["gs"], t["a"], t["mask"], F,
                                                 mask_base=True, out=dx)  # fmt: skip


def _qkv(m: int, device: str, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    return [_inputs(m, n, 4096 if device == "cuda" else 96, device, dtype, seed=i) for i, n in enumerate(
        (4096, 1024, 1024) if device == "cuda" else (64, 32, 32))]  # fmt: skip


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 tl.dot)
    t = _inputs(70, 64, 96, device, dtype, seed=0)
    torch.testing.assert_close(one_epilogue(t).float(), one_pass(t).float(), rtol=2e-2, atol=2e-2)
    ts = _qkv(70, device, dtype)
    want = qkv_pass(ts).float()
    for fn in (qkv_epilogue_first, qkv_epilogue_all):
        torch.testing.assert_close(fn(ts).float(), want, rtol=2e-2, atol=3e-2)
    dx = torch.randn(70, 96, device=device).to(dtype)
    torch.testing.assert_close(dora_epilogue(t, dx.clone()).float(), dora_pass(t, dx.clone()).float(), rtol=2e-2,
                               atol=2e-2)  # fmt: skip
    print("epilogue variants: within bf16 rounding of the passes")


def _host_us(fn: Callable[[], object], calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def timings() -> None:
    def row(what: str, fn: Callable[[], object], against: float | None = None) -> float:
        gpu = bench.time_ms(fn, gpu_only=True) * 1e3
        ratio = f"  ({gpu / against:.3f}x pass)" if against else ""
        print(f"  {what:40s} GPU {gpu:8.1f} us   host {_host_us(fn):6.1f} us{ratio}", flush=True)
        return gpu

    for m in (4096, 16384):
        ts = _qkv(m, "cuda", torch.bfloat16)
        for label, t in (("O (q)", ts[0]), ("k/v alone", ts[1])):
            print(f"== LoRA {label}, {m} tokens: dy [{m}, {t['w'].shape[0]}], W {list(t['w'].shape)}", flush=True)
            base = row("pass", lambda t=t: one_pass(t))
            row("epilogue", lambda t=t: one_epilogue(t), base)
        print(f"== LoRA q/k/v, {m} tokens, three masks on one dx", flush=True)
        base = row("pass", lambda ts=ts: qkv_pass(ts))
        row("epilogue first", lambda ts=ts: qkv_epilogue_first(ts), base)
        row("epilogue all", lambda ts=ts: qkv_epilogue_all(ts), base)
        dx = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        for label, t in (("q/O", ts[0]), ("k/v", ts[1])):
            print(f"== DoRA {label}, {m} tokens: the masked term added to dx", flush=True)
            base = row("pass", lambda t=t, dx=dx: dora_pass(t, dx))
            row("epilogue", lambda t=t, dx=dx: dora_epilogue(t, dx), base)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
