"""RMSNorm's and FusedAddRMSNorm's backward without a weight gradient: programs per SM and tiles.

The frozen backward keeps no partial rows, so its persistent grid may take many programs per SM.
For each op and width this times forward+backward with the weight frozen (16384 rows, bf16, GPU
time alone, ``bench.time_ms(gpu_only=True)``) with the module's settings and with each of
BWD_FROZEN_PROGRAMS_PER_SM (BWD_FROZEN_WIDE_PROGRAMS_PER_SM from BWD_FROZEN_WIDE_COLS on) in
{2, 4, 8, 16, 32} x BWD_FROZEN_MIN_TILE in {2048, 4096, 8192}, and prints the module's time and
the five fastest.

Run on a GPU:  python benchmarks/experiments/rms_norm_frozen_programs.py
Output of a run on an H200: rms_norm_frozen_programs_h200.txt beside this file.
"""

from __future__ import annotations

import importlib
import itertools

import torch

import fk.norms
from fk.core import bench

ROWS = 16384
WIDTHS = (2048, 4096, 8192, 16384)


def main() -> None:
    module = importlib.import_module("fk.norms.rms_norm")
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  rows {ROWS}  bf16  fwd+bwd GPU ms, frozen weight"
    )
    for op, width in itertools.product(("rms_norm", "fused_add_rms_norm"), WIDTHS):
        per_sm = (
            "BWD_FROZEN_WIDE_PROGRAMS_PER_SM" if width >= module.BWD_FROZEN_WIDE_COLS else "BWD_FROZEN_PROGRAMS_PER_SM"
        )
        names = (per_sm, "BWD_FROZEN_MIN_TILE")
        own = {name: getattr(module, name) for name in names}
        x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        residual = torch.randn_like(x)
        dy = torch.randn_like(x)
        w = (1 + 0.1 * torch.randn(width, device="cuda")).to(torch.bfloat16)

        def forward_backward(op: str = op) -> None:
            if op == "rms_norm":
                torch.autograd.backward(fk.norms.rms_norm(x, w, 1e-6), dy)  # noqa: B023
            else:
                torch.autograd.backward(fk.norms.fused_add_rms_norm(x, residual, w, 1e-6), [dy, dy])  # noqa: B023

        results = []
        for values in [{}, *(dict(zip(names, v, strict=True)) for v in itertools.product([2, 4, 8, 16, 32],
                                                                                          [2048, 4096, 8192]))]:  # fmt: skip
            for name, value in {**own, **values}.items():
                setattr(module, name, value)
            module._bwd_tiling.cache_clear()
            ms = bench.time_ms(forward_backward, warmup=5, rep=40, grad_to_none=[x], gpu_only=True)
            results.append((ms, str(values) if values else f"module's {own}"))
        for name, value in own.items():
            setattr(module, name, value)
        module._bwd_tiling.cache_clear()
        print(f"{op} H={width}")
        for ms, label in [results[0], *sorted(results[1:])[:5]]:
            print(f"  {ms:.4f}  {label}")


if __name__ == "__main__":
    main()
