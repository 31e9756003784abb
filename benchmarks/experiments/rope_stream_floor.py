"""The bytes floor of bench_rope's cases, beside fk and its peers, in one run (#34: RoPE at S = 1024
runs at 77-82% of the copy bandwidth in rope.json, the other lengths at 89-96%).

bench_rope.py counts the bytes any implementation must move: the forward reads q and k and writes
both outputs, plus cos and sin once (the backward the same again). At S = 1024 that is 85 MB a
forward, about 20 us at the copy bandwidth, which ``fk.core.bench`` measures on a much larger copy.
This times, GPU time alone as bench_rope.py times it (L2 flushed before each call, median):

- fk (``fk.rope.apply_rotary_pos_emb``), Liger and torch.compile, forward and forward+backward, in
  both layouts;
- the **floor**: kernels that only stream the counted bytes: one launch reading q and k and writing
  two outputs of their size (q and k as one flat buffer each way, cos and sin left out: 0.2% of
  the bytes), the fastest of a sweep of Triton tilings (``norm_stream_floor.py``'s kernel) and
  ATen's copy; forward+backward is two such launches.

"fk/floor" says how far fk is from the floor, "floor copy%" how much of the large copy's bandwidth
the floor itself reaches at that size.

Run on a GPU:  python benchmarks/experiments/rope_stream_floor.py   (output: rope_stream_floor_h200.txt)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/experiments/
import bench_rope
from norm_stream_floor import _best_streams

from fk.core import bench

SEQS = (1024, 4096, 16384)
REP = 50


def _gpu_ms(fn: Any, grads: list[torch.Tensor] | None = None) -> float:
    return bench.time_ms(fn, warmup=5, rep=REP, grad_to_none=grads, gpu_only=True)


def _floor_ms(seq: int) -> tuple[float, float, str]:
    """(forward, forward+backward) ms of the fastest bytes-only streams at ``seq``, and their label."""
    n = bench_rope.BATCH * seq * (bench_rope.N_Q + bench_rope.N_KV) * bench_rope.HEAD_DIM
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    (call, label), _ = _best_streams([src], [dst])
    forward = _gpu_ms(call)

    def both() -> None:
        call()
        call()

    return forward, _gpu_ms(both), label


def _provider_ms(fn: bench_rope.Fn, seq: int, layout: str) -> tuple[float, float]:
    case = bench_rope.inputs(seq, layout)
    forward, forward_backward = bench_rope.calls(fn, case)
    return _gpu_ms(forward, [case.q, case.k]), _gpu_ms(forward_backward, [case.q, case.k])


def main() -> None:
    ceilings = bench.measure_ceilings()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {ceilings.copy_tbps:.2f} TB/s  GPU-only ms, median of {REP}")  # fmt: skip
    print("layout | S | mode | fk | liger | torch.compile | floor | fk/floor | floor copy% | floor kernel")
    factories = {name: f for name, f in bench_rope.providers().items() if name in ("fk", "liger", "torch.compile")}
    for seq in SEQS:
        floor_fwd, floor_both, label = _floor_ms(seq)
        nbytes = bench_rope.forward_bytes(seq)
        for layout in bench_rope.LAYOUTS:
            times = {name: _provider_ms(factory(), seq, layout) for name, factory in factories.items()}
            for i, (mode, floor, counted) in enumerate(
                (("fwd", floor_fwd, nbytes), ("fwd+bwd", floor_both, 2 * nbytes))
            ):
                peers = " | ".join(
                    f"{times[name][i]:.4f}" if name in times else "-" for name in ("liger", "torch.compile")
                )
                copy = 100 * bench.fraction(bench.tbps(counted, floor), ceilings.copy_tbps)
                print(f"{layout} | {seq} | {mode} | {times['fk'][i]:.4f} | {peers} | {floor:.4f} | "
                      f"{times['fk'][i] / floor:.3f} | {copy:.1f} | {label}", flush=True)  # fmt: skip


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    main()
