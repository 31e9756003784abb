"""#32: ``masked_lora_inputs.py`` (this folder), the dropout's input products ``xa_t = f_t (x * m_t) A_t^T`` of
projections that share ``x`` in one pass over ``x`` and the masks: its launch (rows a program, columns
a step, warps, stages, programs an SM, which sets the split of K) against what it replaces, one
``torch.mm`` a projection on the dropped input ``native_dropout`` wrote, at Llama-3.1-8B's q/k/v
(x [tokens, 4096], r = 16, three masks) and gate/up (two), 4096 and 16384 tokens, bf16; GPU time
(``fk.core.bench.time_ms(gpu_only=True)``) and the fraction of a copy's speed for the kernel's
bytes (x once, each mask once).

Run on a GPU:  python benchmarks/experiments/masked_lora_inputs_tune.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools

import masked_lora_inputs as module
import torch
from masked_lora_inputs import LaunchParams, MaskedInput

from fk.core import bench

R, P, K = 16, 0.05, 4096
SETTINGS = [
    LaunchParams(rows, cols, warps, stages, per_sm)
    for rows, cols, warps, stages, per_sm in itertools.product((32, 64), (64, 128), (4, 8), (3, 4), (1, 2, 4))
    if not (rows == 32 and warps == 8)
]


def _inputs(m: int, k: int, n_terms: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[MaskedInput]]:
    gen = torch.Generator(device=device).manual_seed(m + n_terms)
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    terms = [
        MaskedInput((0.1 * torch.randn(R, k, device=device, generator=gen)).to(dtype),
                    torch.rand(m, k, device=device, generator=gen) >= P, 1 / (1 - P))
        for _ in range(n_terms)
    ]  # fmt: skip
    return x, terms


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    x, terms = _inputs(70, 200, 3, device, dtype)
    want = module.masked_lora_inputs_ref(x, terms)
    for params in (LaunchParams(32, 64, 4, 2, 1), LaunchParams(32, 64, 4, 2, 64)):
        for got, w in zip(module._launch(x, terms, params), want, strict=True):
            torch.testing.assert_close(got.double(), w, rtol=2e-2, atol=2e-2)
    print("masked_lora_inputs (whole rows and split K): within bf16 rounding of float64")


def timings(copy_tbps: float) -> None:
    for m, n_terms in itertools.product((4096, 16384), (3, 2)):
        x, terms = _inputs(m, K, n_terms, "cuda", torch.bfloat16)
        dropped = [module.masked(x, t.mask, t.factor) for t in terms]
        moved = m * K * (2 + n_terms)  # bytes: x once, each mask once (the outputs are rank-sized)
        print(f"== x [{m}, {K}], {n_terms} masks, r = {R}", flush=True)
        pairs = list(zip(dropped, terms, strict=True))
        now = bench.time_ms(lambda: [torch.mm(d, t.lora_a.t()) for d, t in pairs], gpu_only=True)  # noqa: B023
        print(f"  {'torch.mm on each dropped input (fk before)':58s} {now * 1e3:7.1f} us", flush=True)
        results = []
        for params in SETTINGS:
            t = bench.time_ms(lambda: module._launch(x, terms, params), gpu_only=True)  # noqa: B023
            results.append((t, params))
        for t, params in sorted(results, key=lambda r: r[0])[:8]:
            print(f"  {tuple(params)!s:58s} {t * 1e3:7.1f} us  {moved / t / 1e9 / copy_tbps:5.1%} of copy  "
                  f"({t / now:.3f}x)", flush=True)  # fmt: skip
        table = next(r for r in results if r[1] == module.LAUNCH[16])
        print(f"  the table's {tuple(module.LAUNCH[16])}: {table[0] * 1e3:.1f} us", flush=True)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings(copy))


if __name__ == "__main__":
    main()
