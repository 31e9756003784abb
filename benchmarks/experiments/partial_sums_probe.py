"""The norms' last backward step, the sum of fp32 partial rows into the weight gradient: torch's
``partials.sum(0).to(bf16)`` (two kernels) against fk.core.reduce.sum_rows (one) at the partial
buffer shapes RMSNorm's backward uses for 16384 rows, at its defaults and with a few other settings
(the rows x columns of a program's tile). GPU time per call
(bench.time_ms gpu_only, no L2 flush: the buffer was just written by the backward kernel).

Run on a GPU:  python benchmarks/experiments/partial_sums_probe.py
"""

from __future__ import annotations

import torch

import fk.core.reduce as reduce
from fk.core import bench
from fk.norms.rms_norm import dw_partial_rows

# (rows, columns) of a program's tile; the columns through SUM_ROWS_WIDE_COLS (0: always 32, 1 << 30: always 16).
SETTINGS = [(64, 16), (64, 32), (32, 16), (32, 32), (128, 16), (128, 32)]


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for width in (1024, 2048, 4096, 8192, 16384, 32768):
        rows = dw_partial_rows(16384, width, torch.device("cuda"))
        partials = torch.randn(rows, width, device="cuda")
        want = partials.sum(0).to(torch.bfloat16)
        line = [f"H={width:5d} partials [{rows:4d}, {width:5d}]"]
        ms = bench.time_ms(lambda p=partials: p.sum(0).to(torch.bfloat16), flush_l2=False, gpu_only=True, rep=200)
        line.append(f"torch {ms * 1e3:6.1f} us")
        ms = bench.time_ms(lambda p=partials: reduce.sum_rows(p, torch.bfloat16), flush_l2=False, gpu_only=True,
                           rep=200)  # fmt: skip
        line.append(f"fk default {ms * 1e3:6.1f}")
        defaults = reduce.SUM_ROWS_BLOCK_ROWS, reduce.SUM_ROWS_WIDE_COLS
        for block_rows, cols in SETTINGS:
            reduce.SUM_ROWS_BLOCK_ROWS, reduce.SUM_ROWS_WIDE_COLS = block_rows, (0 if cols == 32 else 1 << 30)
            got = reduce.sum_rows(partials, torch.bfloat16)
            torch.testing.assert_close(got, want)
            ms = bench.time_ms(lambda p=partials: reduce.sum_rows(p, torch.bfloat16), flush_l2=False, gpu_only=True,
                               rep=200)  # fmt: skip
            line.append(f"{block_rows}x{cols} {ms * 1e3:6.1f}")
        reduce.SUM_ROWS_BLOCK_ROWS, reduce.SUM_ROWS_WIDE_COLS = defaults
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
