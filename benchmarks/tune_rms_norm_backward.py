"""Sweep the launch parameters of fk RMSNorm's backward alone, timed without host cost (a development
tool; its results picked the BWD_* defaults of fk.norms.rms_norm).

bench_rms_norm.py times forward+backward calls, which at narrow rows measures the host (Python,
the autograd engine, Triton's launch path) more than the kernel. Here 20 calls of the backward
launcher (kernel plus the partial-sum reduction) are captured in a CUDA graph and replayed, so
only GPU time counts. For each shape it prints every variant's time relative to the best, and the
variants sorted by their worst ratio over all shapes.

Run:  python benchmarks/tune_rms_norm_backward.py
"""

from __future__ import annotations

import importlib
import itertools

import torch

module = importlib.import_module("fk.norms.rms_norm")

SPACE = {"BWD_PROGRAMS_PER_SM": [2, 4, 8], "BWD_ELEMENTS_PER_WARP": [128, 256, 512], "BWD_MIN_TILE": [2048, 4096]}
SHAPES = [(8192, 2048), (16384, 1024), (16384, 2048), (16384, 4096), (16384, 8192), (16384, 16384), (2048, 4096)]
CALLS = 20


def graph_time_us(fn: object, calls: int = CALLS, replays: int = 5) -> float:
    for _ in range(3):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()  # type: ignore[operator]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def configure(values: dict[str, int]) -> None:
    for key, value in values.items():
        setattr(module, key, value)
    # The narrow-row settings follow the swept ones, so that every width sees the variant.
    module.BWD_NARROW_MIN_TILE = values["BWD_MIN_TILE"]
    module.BWD_NARROW_PROGRAMS_PER_SM = values["BWD_PROGRAMS_PER_SM"]
    module._bwd_tiling.cache_clear()


def main() -> None:
    saved = {k: getattr(module, k) for k in (*SPACE, "BWD_NARROW_MIN_TILE", "BWD_NARROW_PROGRAMS_PER_SM")}
    variants = [dict(zip(SPACE, values, strict=True)) for values in itertools.product(*SPACE.values())]
    times: dict[tuple[int, ...], dict[tuple[int, int], float]] = {}
    for rows, width in SHAPES:
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(width, device="cuda", dtype=torch.bfloat16)
        dy, dx = torch.randn_like(x), torch.empty_like(x)
        _, rstd = module.launch_forward(x, w, 1e-6, 0.0, False)
        for variant in variants:
            configure(variant)
            us = graph_time_us(lambda: module.launch_backward(dy, x, w, rstd, 0.0, True, dx))  # noqa: B023
            times.setdefault(tuple(variant.values()), {})[rows, width] = us
        for key, value in saved.items():
            setattr(module, key, value)
        module._bwd_tiling.cache_clear()
        us = graph_time_us(lambda: module.launch_backward(dy, x, w, rstd, 0.0, True, dx))  # noqa: B023
        print(f"{rows} x {width}: the module's settings {us:.1f} us ({6 * rows * width / us / 1e6:.2f} TB/s)")
    best = {shape: min(t[shape] for t in times.values()) for shape in map(tuple, SHAPES)}
    print(f"{tuple(SPACE)}: time / best at " + ", ".join(f"{r}x{w}" for r, w in SHAPES))
    for key, t in sorted(times.items(), key=lambda kv: max(kv[1][s] / best[s] for s in best)):
        print(key, " ".join(f"{t[s] / best[s]:.3f}" for s in best))


if __name__ == "__main__":
    main()
