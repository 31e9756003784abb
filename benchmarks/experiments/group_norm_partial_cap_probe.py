"""GroupNorm's rows backward with its dw/db partial rows capped (ROWS_PARTIAL_BYTES): which
backward tile (ROWS_PARTIALS_TILE_ELEMENTS) and warp size (ROWS_ELEMENTS_PER_WARP) keep it fast
when the cap leaves few programs (C = 16384 and 32768: 16 and 8 programs per group), against no
cap. Trainable weight and bias, 32 groups of a (16384, C) bf16 input, forward+backward GPU time
(bench.time_ms gpu_only) and peak memory above the inputs.

Run on a GPU:  python benchmarks/experiments/group_norm_partial_cap_probe.py [widths ...]
"""

from __future__ import annotations

import importlib
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from group_norm_rows_tune import case, measure

NO_CAP = 1 << 40


def main() -> None:
    module = importlib.import_module("fk.norms.group_norm")
    names = ("ROWS_PARTIAL_BYTES", "ROWS_PARTIALS_TILE_ELEMENTS", "ROWS_ELEMENTS_PER_WARP")
    defaults = {k: getattr(module, k) for k in names}
    variants = [{"ROWS_PARTIAL_BYTES": NO_CAP}] + [
        {"ROWS_PARTIALS_TILE_ELEMENTS": t, "ROWS_ELEMENTS_PER_WARP": e}
        for t, e in itertools.product((2048, 4096, 8192, 16384), (256, 512, 1024))
    ]
    for width in [int(w) for w in sys.argv[1:]] or [4096, 16384, 32768]:
        fwd_bwd, leaves = case(width, trainable=True)
        for values in [{}, *variants]:
            for key, value in {**defaults, **values}.items():
                setattr(module, key, value)
            try:
                ms, peak = measure(fwd_bwd, leaves)
            except Exception as exc:  # (a variant that does not compile: report and go on)
                print(f"C={width} {values}: {type(exc).__name__}")
                continue
            print(f"C={width:5d} {ms:7.4f} ms {peak:8.1f} MB  {values or 'module defaults'}", flush=True)
        for key, value in defaults.items():
            setattr(module, key, value)


if __name__ == "__main__":
    main()
