"""Sweep the launch parameters of fk's RMSNorm or LayerNorm backward alone, timed without host cost
(a development tool; its results picked the BWD_* defaults of fk.norms.rms_norm).

bench_rms_norm.py and bench_norms.py time forward+backward calls, which at narrow rows measure the
host (Python, the autograd engine, Triton's launch path) more than the kernel. Here 20 calls of
the backward launcher (kernel plus the partial-sum reductions; trainable weight) are captured in a
CUDA graph and replayed, so only GPU time counts. It prints the module's own settings' time per
shape, then every variant's time relative to the best, sorted by the worst ratio over all shapes.

Run:  python benchmarks/tune_norm_backward.py [--op rms_norm|layer_norm]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
from collections.abc import Callable
from types import ModuleType

import torch

SPACE = {"BWD_PROGRAMS_PER_SM": [2, 4, 8], "BWD_ELEMENTS_PER_WARP": [128, 256, 512], "BWD_MIN_TILE": [2048, 4096]}
SHAPES = [(8192, 2048), (16384, 1024), (16384, 2048), (16384, 4096), (16384, 8192), (16384, 16384), (2048, 4096)]
CALLS = 20


def graph_time_us(fn: Callable[[], object], calls: int = CALLS, replays: int = 5) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


NARROW = ("BWD_NARROW_MIN_TILE", "BWD_NARROW_PROGRAMS_PER_SM")
"""RMSNorm's settings for narrow rows: set to the swept values too, so that every width sees the variant."""


def configure(module: ModuleType, values: dict[str, int]) -> None:
    for key, value in values.items():
        setattr(module, key, value)
    if hasattr(module, NARROW[0]):
        setattr(module, NARROW[0], values["BWD_MIN_TILE"])
        setattr(module, NARROW[1], values["BWD_PROGRAMS_PER_SM"])
    module._bwd_tiling.cache_clear()


def backward_call(module: ModuleType, op: str, rows: int, width: int) -> Callable[[], object]:
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    if op == "rms_norm":
        dx = torch.empty_like(x)
        _, rstd = module.launch_forward(x, w, 1e-6, 0.0, False)
        return lambda: module.launch_backward(dy, x, w, rstd, 0.0, True, dx)
    b = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    _, mean, rstd = module._layer_norm_fwd(x, w, b, 1e-5)
    return lambda: module._layer_norm_bwd(dy, x, w, b, mean, rstd, True, True, True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", choices=["rms_norm", "layer_norm"], default="rms_norm")
    args = parser.parse_args()
    module = importlib.import_module(f"fk.norms.{args.op}")
    saved = {k: getattr(module, k) for k in (*SPACE, *NARROW) if hasattr(module, k)}
    variants = [dict(zip(SPACE, values, strict=True)) for values in itertools.product(*SPACE.values())]
    times: dict[tuple[int, ...], dict[tuple[int, int], float]] = {}
    for rows, width in SHAPES:
        call = backward_call(module, args.op, rows, width)
        for variant in variants:
            configure(module, variant)
            times.setdefault(tuple(variant.values()), {})[rows, width] = graph_time_us(call)
        for key, value in saved.items():
            setattr(module, key, value)
        module._bwd_tiling.cache_clear()
        us = graph_time_us(call)
        print(f"{rows} x {width}: the module's settings {us:.1f} us ({6 * rows * width / us / 1e6:.2f} TB/s)")
    best = {shape: min(t[shape] for t in times.values()) for shape in map(tuple, SHAPES)}
    print(f"{tuple(SPACE)}: time / best at " + ", ".join(f"{r}x{w}" for r, w in SHAPES))
    for key, t in sorted(times.items(), key=lambda kv: max(kv[1][s] / best[s] for s in best)):
        print(key, " ".join(f"{t[s] / best[s]:.3f}" for s in best))


if __name__ == "__main__":
    main()
