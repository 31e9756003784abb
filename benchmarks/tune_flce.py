"""Sweep the launch parameters of fk.flce's cross-entropy kernel on a GPU (8192 x 128256 bf16 logits).

Each of the kernel's three uses is swept on its own, since they want different launches:
- forward (loss and lse): reads the logits once;
- backward (lse given): reads once, writes the gradient;
- fused (linear cross entropy's pass: loss, then the gradient over the logits in place): counted
  as one read and one write; its second read of a row costs time unless the row is still in L2.

Prints the bandwidth of every setting against the measured copy ceiling, then one line per use,
``best fused: LaunchParams(programs_per_sm=..., ...)``, to paste into
``fk/flce/cross_entropy.py``'s ``LAUNCH`` table.

Run on a GPU:  python benchmarks/tune_flce.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch

from fk.core import bench
from fk.flce.cross_entropy import LAUNCH, LaunchParams, LossOptions, launch_cross_entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--uses", nargs="+", default=["forward", "backward", "fused"], choices=sorted(LAUNCH))
    parser.add_argument("--per-sm", type=int, nargs="+", help="programs per SM to try (default: by --quick)")
    parser.add_argument("--blocks", type=int, nargs="+", help="columns per load to try (default: by --quick)")
    parser.add_argument("--warps", type=int, nargs="+", help="warps per program to try (default: by --quick)")
    args = parser.parse_args()
    tokens, vocab = 8192, 128256
    logits = torch.randn(tokens, vocab, device="cuda").to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    lse, loss = torch.empty(tokens, device="cuda"), torch.empty(tokens, device="cuda")
    scale = torch.ones(1, device="cuda")
    grad = torch.empty_like(logits)
    work = logits.clone()
    options = LossOptions(-100, 0.0, 0.0, 0.0)
    nbytes = logits.numel() * 2
    copy = bench.copy_bandwidth_tbps()
    print(f"copy ceiling {copy:.2f} TB/s")

    uses: dict[str, tuple[Callable[[], None], int]] = {
        "forward": (lambda: launch_cross_entropy(logits, target, None, None, options, lse=lse, loss=loss), nbytes),
        "backward": (
            lambda: launch_cross_entropy(
                logits, target, None, None, options, lse=lse, grad=grad, grad_scale=scale, lse_given=True
            ),
            2 * nbytes,
        ),
        "fused": (
            lambda: launch_cross_entropy(
                work, target, None, None, options, lse=lse, loss=loss, grad=work, grad_scale=scale
            ),
            2 * nbytes,
        ),
    }
    per_sms = args.per_sm or ((1, 2, 4, 8) if args.quick else (1, 2, 3, 4, 8))
    blocks = args.blocks or ((2048, 4096, 8192) if args.quick else (1024, 2048, 4096, 8192))
    warps = args.warps or ((8, 16, 32) if args.quick else (4, 8, 16, 32))
    best: dict[str, tuple[float, LaunchParams]] = {}
    for use, (run, moved) in uses.items():
        if use not in args.uses:
            continue
        default = LAUNCH[use]
        for setting in itertools.product(per_sms, blocks, warps):
            params = LaunchParams(*setting)
            LAUNCH[use] = params
            ms = bench.time_ms(run)
            print(f"{use:8s} {params}: {bench.tbps(moved, ms) / copy:5.1%} of copy ({ms:.3f} ms)")
            if use not in best or ms < best[use][0]:
                best[use] = (ms, params)
        LAUNCH[use] = default
    for use, (ms, params) in best.items():
        print(f"best {use}: {params}  # {bench.tbps(uses[use][1], ms) / copy:.1%} of copy")


if __name__ == "__main__":
    main()
