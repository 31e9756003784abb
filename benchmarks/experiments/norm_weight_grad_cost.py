"""#34: what does the weight gradient cost the norms' backward?

The trainable norm backwards run at 66-81% of their bytes floor at 1024-2048 columns and at 16384-32768
(LayerNorm) where the frozen ones, which move the same counted bytes (read x and dy, write dx),
come close to a bytes-only kernel (``INDEX.md#norm_stream_floor_all``). The difference between the
two is the weight (and bias) gradient: a sum over all rows, which fk keeps deterministic by fp32
partial rows (one per program, summed by a second launch) and, from 16384 columns, by two passes.

For RMSNorm, LayerNorm and PolyNorm at 16384 rows, bf16, per width, the backward launcher alone
(CUDA graph replays, ``fk.core.bench.graph_time_us``, as ``../tune_norm_backward.py`` times it),
with the module's own settings:

- ``trainable``: dx and the parameters' gradients;
- ``frozen``: dx only (the same kernels' frozen path);
- ``bytes``: ``torch.add(x, dy, out=dx)``, one launch that reads two ``[M, H]`` tensors and writes one,
  as both backwards must at least;

each with its share of the copy bandwidth for those 6 M H bytes (the partial rows and parameters are
O(H) per program and left out, as bench_norms' floor leaves them out).

Run on a GPU:  python benchmarks/experiments/norm_weight_grad_cost.py   (output: norm_weight_grad_cost_h200.txt)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from fk.core import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tune_norm_backward import ROWS, backward_call  # benchmarks/tune_norm_backward.py

OPS = ["rms_norm", "layer_norm", "poly_norm"]
WIDTHS = [1024, 2048, 4096, 8192, 16384, 32768]


def main() -> None:
    print(bench.environment())
    copy = bench.copy_bandwidth_tbps()
    print(f"copy {copy:.2f} TB/s; {ROWS} rows, bf16, backward GPU time (us) and share of copy for 6 M H bytes")
    for op in OPS:
        module = importlib.import_module(f"fk.norms.{op}")
        print(f"-- {op}")
        print("     H  trainable       frozen          bytes           trainable/frozen  frozen/bytes")
        for width in WIDTHS:
            nbytes = 6 * ROWS * width
            trainable = bench.graph_time_us(backward_call(module, op, "trainable", width))
            frozen = bench.graph_time_us(backward_call(module, op, "frozen", width))
            x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16)
            dy, dx = torch.randn_like(x), torch.empty_like(x)
            only_bytes = bench.graph_time_us(lambda x=x, dy=dy, dx=dx: torch.add(x, dy, out=dx))

            def cell(us: float, nbytes: int = nbytes) -> str:
                return f"{us:7.1f} ({nbytes / (us * 1e-6) / (copy * 1e12):5.1%})"

            print(f"{width:6}  {cell(trainable)}  {cell(frozen)}  {cell(only_bytes)}  "
                  f"{trainable / frozen:16.3f}  {frozen / only_bytes:12.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
