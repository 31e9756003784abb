"""DoRA's elementwise passes at bench_lora.py's shapes (Llama-3.1-8B, 16384 and 4096 tokens, bf16),
the torch expressions they replaced against fk.lora's kernels (``fk.lora.dora_elementwise``, and the
masked ``dx`` term of ``fk.lora.masked_low_rank``), each with its bytes as counted in the commits
that fused them and the share of copy bandwidth (measured in the same run) it reaches.

Rows: ``fwd`` the dropout forward's ``y`` and ``z`` (torch: the ``lr`` matmul and five passes; fk: one
pass forming ``lr`` in registers), ``bwd`` ``dmag``, ``dy_ms`` and ``dy_ms1`` (torch: four passes
through fp32 copies; fk: one pass and the partial sums), ``dx`` the masked term of ``dx`` (torch:
``masked``, an add and ``add_masked_low_rank_``; fk: one pass with the addend).

Run on a GPU:  python benchmarks/experiments/dora_elementwise_probe.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fk.core import bench
from fk.lora.dora_elementwise import (
    LowRank,
    dora_dropout_output,
    dora_dropout_output_torch,
    dora_grad_terms,
    dora_grad_terms_torch,
)
from fk.lora.masked_low_rank import add_masked_low_rank_, masked

SHAPES = {"gate/up": (14336, 4096), "down": (4096, 14336), "o/q": (4096, 4096), "k/v": (1024, 4096)}  # (N, K)
RANK, P = 16, 0.05
# Bytes an element (bf16), per the fusing commits: (torch, fk); fwd and bwd per [M, N], dx per [M, K].
BYTES = {"fwd": (40, 8), "bwd": (28, 8), "dx": (16, 7)}


def _row(name: str, elements: int, torch_fn: Callable[[], object], fk_fn: Callable[[], object], copy: float) -> str:
    cells = [f"{name:4}"]
    for which, fn, nbytes in zip(("torch", "fk"), (torch_fn, fk_fn), BYTES[name], strict=True):
        ms = bench.time_stats_ms(fn, gpu_only=True).median
        tbps = bench.tbps(nbytes * elements, ms)
        cells.append(f"{which} {ms:7.3f} ms ({nbytes:2} B/el, {tbps:5.2f} TB/s, {tbps / copy:4.0%} of copy)")
    return "  ".join(cells)


def _probe(tokens: int, n: int, k: int, copy: float) -> None:
    dev, c, f = "cuda", torch.bfloat16, 1 / (1 - P)
    base, zd, dy, z = (torch.randn(tokens, n, device=dev, dtype=c) for _ in range(4))
    xa, B = torch.randn(tokens, RANK, device=dev, dtype=c), torch.randn(n, RANK, device=dev, dtype=c) * 0.1
    low_rank = LowRank(xa, B, 2.0)
    ms, norm = torch.rand(n, device=dev) + 0.5, torch.rand(n, device=dev) + 1.0
    fwd_torch = lambda: dora_dropout_output_torch(base, zd, low_rank, ms, None)  # noqa: E731
    print(_row("fwd", tokens * n, fwd_torch, lambda: dora_dropout_output(base, zd, low_rank, ms, None), copy))
    dtypes, want = (torch.bfloat16, None), (True, True)
    bwd_torch = lambda: dora_grad_terms_torch(dy, z, ms, norm, dtypes, want)  # noqa: E731
    print(_row("bwd", tokens * n, bwd_torch, lambda: dora_grad_terms(dy, z, ms, norm, dtypes, want), copy))
    dx, addend = (torch.randn(tokens, k, device=dev, dtype=c) for _ in range(2))
    mask = torch.rand(tokens, k, device=dev) >= P
    g, a = torch.randn(tokens, RANK, device=dev, dtype=c), torch.randn(RANK, k, device=dev, dtype=c)

    def dx_torch() -> None:
        dx.add_(masked(addend, mask, f))
        add_masked_low_rank_(dx, g, a, mask, f)

    print(_row("dx", tokens * k, dx_torch, lambda: add_masked_low_rank_(dx, g, a, mask, f, addend), copy))


def main() -> None:
    copy = bench.copy_bandwidth_tbps()
    print(bench.environment())
    print(f"copy {copy:.2f} TB/s")
    for tokens in (16384, 4096):
        for label, (n, k) in SHAPES.items():
            print(f"-- {tokens} tokens, {label}: N={n} K={k}")
            _probe(tokens, n, k, copy)


if __name__ == "__main__":
    main()
