"""RMSNorm's backward with a weight gradient, rows of one 16384-column tile: the weight held in
registers for all of a program's rows, or loaded for every tile (``BWD_WEIGHT_PER_TILE_COLS``).
Trainable forward+backward GPU time (bench.time_ms gpu_only, 40 reps), 16384 rows, bf16, RMSNorm
and FusedAddRMSNorm at H = 8192 and 16384, each setting timed twice or more in turn; then the
registers and spills of every compiled backward kernel variant.

Run on a GPU:  python benchmarks/experiments/norm_weight_per_tile_probe.py
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import torch

import fk.norms
from fk.core import bench

NEVER = 1 << 30


def main() -> None:
    module: Any = importlib.import_module("fk.norms.rms_norm")  # (fk.norms.rms_norm is the function)
    default = module.BWD_WEIGHT_PER_TILE_COLS
    for op in ("rms_norm", "fused_add_rms_norm"):
        for width in (8192, 16384):
            x = torch.randn(16384, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            residual, dy = torch.randn_like(x), torch.randn_like(x)

            def forward_backward(op: str = op, x: torch.Tensor = x, w: torch.Tensor = w,
                                 residual: torch.Tensor = residual, dy: torch.Tensor = dy) -> None:  # fmt: skip
                outs = (fk.norms.rms_norm(x, w),) if op == "rms_norm" else fk.norms.fused_add_rms_norm(x, residual, w)
                torch.autograd.backward(outs, [dy] * len(outs))

            for threshold in (NEVER, 16384, 8192, NEVER, 16384):
                module.BWD_WEIGHT_PER_TILE_COLS = threshold
                ms = bench.time_ms(forward_backward, rep=40, warmup=5, grad_to_none=[x, w], gpu_only=True)
                label = "never" if threshold == NEVER else threshold
                print(f"{op} H={width} weight per tile from {label}: {ms * 1e3:.1f} us")
    module.BWD_WEIGHT_PER_TILE_COLS = default
    for key, kernel in module._rms_norm_bwd_kernel.device_caches[torch.cuda.current_device()][0].items():
        constexprs = re.findall(
            r"\('constexpr', ([^)]+)\)", str(key)
        )  # (the cache key's layout varies by Triton version)
        names = ["HAS_DRES", "HAS_WEIGHT", "COMPUTE_DW", "BLOCK_COLS", "ROWS", "LOOPED", "WEIGHT_PER_TILE"]
        print(f"warps={kernel.metadata.num_warps} regs={kernel.n_regs} spills={kernel.n_spills}",
              dict(zip(names, constexprs, strict=False)))  # fmt: skip


if __name__ == "__main__":
    main()
