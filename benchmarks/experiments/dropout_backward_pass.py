"""#32: the LoRA dropout's backward for projections that share ``x`` (q/k/v: three masks), after the
``dy W`` GEMMs: fk ran two passes, ``masked_a_grad`` (``dA_t = f_t (s G_t)^T (x * m_t)``: x and
the masks read) and ``masked_low_rank`` (``dx += sum_t f_t m_t (s G_t A_t)``: dx read and written,
the masks read again). ``masked_a_grads(x, terms, dx, lora_as)`` does both in one pass (each program
owns a column strip, as the dA kernel's do, and adds the dx terms of each row tile it reads): the
masks read once. Here the two passes (``two passes``) against the one (``one pass``, at the table's
launch and at others), at Llama-3.1-8B's q/k/v (x [tokens, 4096], r = 16) with three masks and
gate/up's two, 4096 and 16384 tokens, bf16; GPU time (``fk.core.bench.time_ms(gpu_only=True)``) and
the fraction of a copy's speed for the one pass's bytes (x, each mask once, dx read and written).

Runs at e1a7658 (``git checkout e1a7658``): the one pass was reverted after this probe's run.
Run on a GPU:  python benchmarks/experiments/dropout_backward_pass.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools

import torch

from fk.core import bench
from fk.lora import masked_a_grad
from fk.lora.masked_a_grad import LaunchParams, MaskedA, masked_a_grads
from fk.lora.masked_low_rank import MaskedLowRank, add_masked_low_ranks_

R, P, K = 16, 0.05, 4096
LAUNCHES = [  # (block_rows, block_cols, num_warps, programs_per_sm); the table's first
    masked_a_grad.LAUNCH_WITH_DX[16], LaunchParams(16, 128, 2, 8), LaunchParams(32, 128, 4, 4),
    LaunchParams(16, 256, 4, 4), LaunchParams(16, 64, 4, 8), LaunchParams(16, 64, 2, 8), LaunchParams(32, 128, 8, 4),
]  # fmt: skip


def _inputs(m: int, k: int, n_terms: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(m + n_terms)
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    dx = torch.randn(m, k, device=device, generator=gen).to(dtype)
    terms = [MaskedA(torch.randn(m, R, device=device, generator=gen).to(dtype),
                     torch.rand(m, k, device=device, generator=gen) >= P, 1 / (1 - P), dtype) for _ in range(n_terms)]  # fmt: skip
    lora_as = [(0.1 * torch.randn(R, k, device=device, generator=gen)).to(dtype) for _ in range(n_terms)]
    return x, dx, terms, lora_as


def two_passes(x: torch.Tensor, dx: torch.Tensor, terms: list[MaskedA], lora_as: list[torch.Tensor]) -> object:
    grads = masked_a_grads(x, terms)
    add_masked_low_ranks_(dx, [MaskedLowRank(t.gs, a, t.mask, t.factor) for t, a in zip(terms, lora_as, strict=True)])
    return grads


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    x, dx, terms, lora_as = _inputs(70, 200, 3, device, dtype)
    want_dx = dx.clone()
    want = two_passes(x, want_dx, terms, lora_as)
    got = masked_a_grads(x, terms, dx, lora_as)
    torch.testing.assert_close(dx.float(), want_dx.float(), rtol=2e-2, atol=2e-2)
    for g, w in zip(got, want, strict=True):  # type: ignore[call-overload]
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    print("one pass: within bf16 rounding of the two passes")


def timings(copy_tbps: float) -> None:
    table = masked_a_grad.LAUNCH_WITH_DX[16]
    for m, n_terms in itertools.product((4096, 16384), (3, 2)):
        x, dx, terms, lora_as = _inputs(m, K, n_terms, "cuda", torch.bfloat16)
        moved = m * K * (2 + n_terms + 4)  # bytes: x, each mask, dx read and written
        print(f"== x [{m}, {K}], {n_terms} masks, r = {R}", flush=True)
        two = bench.time_ms(lambda: two_passes(x, dx, terms, lora_as), gpu_only=True)  # noqa: B023
        print(f"  {'two passes (dA, then dx)':52s} {two * 1e3:7.1f} us", flush=True)
        for params in LAUNCHES:
            masked_a_grad.LAUNCH_WITH_DX[16] = params
            t = bench.time_ms(lambda: masked_a_grads(x, terms, dx, lora_as), gpu_only=True)  # noqa: B023
            print(f"  one pass {tuple(params)!s:43s} {t * 1e3:7.1f} us  {moved / t / 1e9 / copy_tbps:5.1%} of copy  "
                  f"({t / two:.3f}x)", flush=True)  # fmt: skip
        masked_a_grad.LAUNCH_WITH_DX[16] = table


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings(copy))


if __name__ == "__main__":
    main()
