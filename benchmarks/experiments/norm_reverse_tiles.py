"""A/B of the frozen backward's tile order (``BACKWARD_FROZEN.narrow_reverse_tiles`` of fk.norms.rms_norm
and fk.norms.layer_norm): last tile first, so that the backward's first programs read the rows
the forward touched last, which the L2 may still hold, against first tile first.

Forward+backward with frozen parameters, timed as ``benchmarks/bench_norms.py`` times it (GPU time
alone, L2 flushed before each call, its own inputs and upstream gradients), 16384 rows, bf16;
torch.compile of the eager op beside it, the peer fk trailed at H=1024 (0.952-0.972x). The two
orders alternate over ROUNDS rounds; each keeps its best round.

Run on a GPU:  python benchmarks/experiments/norm_reverse_tiles.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from fk.core import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTHS = [1024, 2048, 4096]  # 32-128 MiB a tensor: the L2 (50 MiB) holds a share worth having
OPS = ["rms_norm", "fused_add_rms_norm", "layer_norm"]
ROUNDS = 3


def set_reverse(reverse: bool) -> None:
    for name in ("fk.norms.rms_norm", "fk.norms.layer_norm"):
        module = importlib.import_module(name)
        module.BACKWARD_FROZEN = module.BACKWARD_FROZEN._replace(narrow_reverse_tiles=reverse)


def main() -> None:
    import bench_norms  # benchmarks/bench_norms.py

    copy_tbps = bench.measure_ceilings().copy_tbps
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {copy_tbps:.2f} TB/s  16384 rows, bf16")
    print("op | H | fk forwards us | fk reversed us | reversed/forwards | torch.compile us | compile/reversed")
    for op in (o for o in bench_norms.OPS if o.name in OPS):
        for width in WIDTHS:
            record = bench.BenchRecord("norm_reverse_tiles")
            compiled = bench.fresh_compile(op.eager)
            bench_norms.measure(record, copy_tbps, op, "torch.compile", compiled, 16384, width, False, 20)
            for _ in range(ROUNDS):
                for reverse in (False, True):
                    set_reverse(reverse)
                    bench_norms.measure(record, copy_tbps, op, f"fk {reverse}", op.fk, 16384, width, False, 20)
            best = {}
            for row in record.rows:
                if row["mode"] == "fwd+bwd" and "gpu_ms" in row:
                    best[row["provider"]] = min(best.get(row["provider"], float("inf")), row["gpu_ms"] * 1e3)
            fwd, rev, comp = best["fk False"], best["fk True"], best["torch.compile"]
            print(f"{op.name} | {width} | {fwd:.1f} | {rev:.1f} | {rev / fwd:.3f} | {comp:.1f} | {comp / rev:.3f}")
    set_reverse(True)


if __name__ == "__main__":
    main()
