"""Sweep the launch parameters of fk.flce's cross-entropy kernel on a GPU (8192 x 128256 bf16 logits).

Prints the bandwidth of the three uses of the kernel: the forward (loss and lse: reads the logits
once), the backward (lse given: reads once, writes the gradient) and the fused pass of linear
cross entropy (loss, then the gradient over the logits in place: counted as one read and one
write; a second read that misses L2 costs time but is not counted).

Run on a GPU:  python benchmarks/tune_flce.py
"""

from __future__ import annotations

import itertools
import sys

import torch

from fk.core import bench
from fk.flce.cross_entropy import LossOptions, launch_cross_entropy

# The module, not fk.flce's re-exported function of the same name.
ce = sys.modules["fk.flce.cross_entropy"]


def main() -> None:
    tokens, vocab = 8192, 128256
    logits = torch.randn(tokens, vocab, device="cuda").to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    lse, loss = torch.empty(tokens, device="cuda"), torch.empty(tokens, device="cuda")
    scale = torch.ones(1, device="cuda")
    grad = torch.empty_like(logits)
    options = LossOptions(-100, 0.0, 0.0, 0.0)
    nbytes = logits.numel() * 2
    copy = bench.copy_bandwidth_tbps()
    print(f"copy ceiling {copy:.2f} TB/s")
    results = []
    for per_sm, block, warps in itertools.product((2, 4, 8), (1024, 2048, 4096), (8, 16)):
        ce.PROGRAMS_PER_SM, ce.MAX_BLOCK, ce.NUM_WARPS = per_sm, block, warps
        fwd = bench.time_ms(lambda: launch_cross_entropy(logits, target, None, None, options, lse=lse, loss=loss))
        bwd = bench.time_ms(lambda: launch_cross_entropy(logits, target, None, None, options, lse=lse, grad=grad,
                                                         grad_scale=scale, lse_given=True))  # fmt: skip
        work = logits.clone()

        def fused_pass(work: torch.Tensor = work) -> None:
            launch_cross_entropy(work, target, None, None, options, lse=lse, loss=loss, grad=work, grad_scale=scale)

        fused = bench.time_ms(fused_pass)
        results.append((fwd + bwd + fused, per_sm, block, warps))
        print(
            f"per_sm {per_sm} block {block:5d} warps {warps:2d}: fwd {bench.tbps(nbytes, fwd) / copy:5.1%}  "
            f"bwd {bench.tbps(2 * nbytes, bwd) / copy:5.1%}  fused {bench.tbps(2 * nbytes, fused) / copy:5.1%}"
        )

    # The best for the three uses together (cross entropy forward + backward, and the fused pass).
    _, per_sm, block, warps = min(results)
    print(f"best: PROGRAMS_PER_SM = {per_sm}, MAX_BLOCK = {block}, NUM_WARPS = {warps}")


if __name__ == "__main__":
    main()
