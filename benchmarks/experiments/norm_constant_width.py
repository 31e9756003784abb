"""#34: does RMSNorm's forward gain from the width as a compile-time constant, as LayerNorm's did
(INDEX.md#layer_norm_forward_stats: Triton unrolls the passes over column tiles when their trip count
is known)? RMSNorm's forward at 32768 columns takes two passes over 16384-column tiles and trails
torch.compile (0.536 against 0.502 ms in norms.json); at 16384 it holds one tile.

Variants, bf16 x and weight, 16384 rows, llama casting, forward GPU time (L2 flushed, median):

- ``fk``: ``fk.norms.rms_norm.launch_forward`` as committed;
- ``constant B/W``: fk's own kernel, ``_rms_norm_fwd_kernel``, called from a kernel whose width is a
  ``tl.constexpr`` (the rest as fk passes it), over column tiles of B columns on W warps;
- ``torch.compile``: ``rms_norm_ref`` compiled afresh for each width (bench_norms' peer).

Run on a GPU:  python benchmarks/experiments/norm_constant_width.py
Check in Triton's interpreter (tiny rows, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import functools
import importlib

import torch
import triton
import triton.language as tl

from fk.core import bench

rms_norm = importlib.import_module("fk.norms.rms_norm")

ROWS = 16384
EPS = 1e-6
# (block columns, warps) per width: one tile and column tiles.
LAUNCHES = {16384: [(16384, 8), (16384, 16), (8192, 16), (8192, 32), (4096, 16), (4096, 32)],
            32768: [(16384, 16), (16384, 32), (8192, 16), (8192, 32), (4096, 16), (4096, 32)]}  # fmt: skip


@triton.jit
def _constant_width_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, eps, N_COLS: tl.constexpr,
                           BLOCK_COLS: tl.constexpr, LOOPED: tl.constexpr):  # fmt: skip
    # fk's kernel with the width (and the contiguous rows' strides) a constant; no residual.
    rms_norm._rms_norm_fwd_kernel(x_ptr, x_ptr, x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, N_COLS, N_COLS, N_COLS,
                                  N_COLS, eps, 0.0, False, True, False, BLOCK_COLS, 1, LOOPED)  # fmt: skip


def constant_width(x: torch.Tensor, w: torch.Tensor, block: int, warps: int) -> torch.Tensor:
    m, n = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    _constant_width_kernel[(m,)](x, w, y, rstd, m, EPS, N_COLS=n, BLOCK_COLS=block, LOOPED=n > block,
                                 num_warps=warps)  # fmt: skip
    return y


def fk_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm.launch_forward(x, w, EPS, 0.0, False)[0]


def _inputs(m: int, n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(torch.bfloat16)
    return x, w


def check(device: str) -> None:
    for n, block in ((100, 32), (100, 128), (257, 64)):
        x, w = _inputs(3, n, device)
        want = rms_norm.rms_norm_ref(x, w, EPS)
        for got in (fk_forward(x, w), constant_width(x, w, block, 1)):
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            assert err < 1e-2, (n, block, err)
    print("fk and constant_width (one tile and column tiles): within 1e-2 of rms_norm_ref over its largest value")


def timings(args: argparse.Namespace, copy: float) -> None:
    print(f"{ROWS} rows, bf16 x and weight; forward GPU time (ms, share of copy)")
    for n, launches in LAUNCHES.items():
        x, w = _inputs(ROWS, n, "cuda")
        compiled = bench.fresh_compile(lambda x, w: rms_norm.rms_norm_ref(x, w, EPS))
        compiled(x, w)
        calls = {"fk": functools.partial(fk_forward, x, w), "torch.compile": functools.partial(compiled, x, w)}
        for block, warps in launches:
            calls[f"constant {block}/{warps}"] = functools.partial(constant_width, x, w, block, warps)
        print(f"-- H = {n} (fk's tiling: {rms_norm._fwd_tiling(n, False)})")
        for name, fn in calls.items():
            ms = bench.time_ms(fn, rep=20, gpu_only=True)
            print(f"  {name:22} {ms:.4f}  {bench.tbps(4 * ROWS * n, ms) / copy:6.1%}")


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, timings)


if __name__ == "__main__":
    main()
