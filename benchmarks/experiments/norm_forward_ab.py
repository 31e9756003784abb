"""A/B of RMSNorm's forward settings (which FusedAddRMSNorm shares): the module's own against the
settings before 2026-11-24 (FWD_MIN_TILE 4096, at most 16 warps), interleaved in one process.

GPU time (``bench.time_ms(gpu_only=True)``), 16384 rows, bf16, forward and forward+backward, weight
trainable and frozen, as ``benchmarks/tune_norms.py`` times them. Each case alternates the two
settings over three rounds and keeps each one's best round.

Run on a GPU:  python benchmarks/experiments/norm_forward_ab.py
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

import torch

from fk.core import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BEFORE = {"FWD_MIN_TILE": 4096, "FWD_MAX_WARPS": 16}
WIDTHS = [1024, 2048, 4096, 8192, 16384, 32768]


def main() -> None:
    import tune_norms

    module = importlib.import_module("fk.norms.rms_norm")
    after = {key: getattr(module, key) for key in BEFORE}
    print(f"{torch.cuda.get_device_name()}; before {BEFORE}, after {after}")
    print(
        f"{'op':20s} {'weight':9s} {'H':>6s} {'direction':9s} {'before us':>10s} {'after us':>9s} {'after/before':>12s}"
    )
    for op in ("rms_norm", "fused_add_rms_norm"):
        for frozen in (False, True):
            for width in WIDTHS:
                x = torch.randn(16384, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                dy = torch.randn_like(x)
                fn = tune_norms.call(op, x, trainable=not frozen)
                for direction in ("fwd", "fwd+bwd"):
                    timed = fn if direction == "fwd" else functools.partial(tune_norms.forward_backward, fn, dy)
                    best = {"before": float("inf"), "after": float("inf")}
                    for _ in range(3):
                        for name, values in (("before", BEFORE), ("after", after)):
                            tune_norms.configure(module, values)
                            ms = bench.time_ms(timed, rep=20, warmup=5, grad_to_none=[x], gpu_only=True)
                            best[name] = min(best[name], ms)
                    tune_norms.configure(module, after)
                    print(f"{op:20s} {'frozen' if frozen else 'trainable':9s} {width:6d} {direction:9s} "
                          f"{best['before'] * 1e3:10.1f} {best['after'] * 1e3:9.1f} {best['after'] / best['before']:12.3f}",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
