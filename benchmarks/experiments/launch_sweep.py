"""The sweep the GEMM-epilogue probes share (``gate_up_act_gemm``, ``glu_grad_epilogue``): the
cuBLAS products and fk's path they would replace timed first, then each launch of the probe's
kernel run once, checked against fk's path and timed, a launch out of shared memory named and
skipped, the best printed last. GPU time with the GPU idle before each call, as ``bench_lora``
times its rows. Not a probe of its own (no INDEX row)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import triton

from fk.core import bench

Launch = tuple[tuple[int, int, int], int, int]
"""((BLOCK_M, BLOCK_N, BLOCK_K), stages, warps)."""


def sweep(
    flops: int,
    cublas: tuple[str, Callable[[], Any]],
    fk_path: tuple[str, Callable[[], Any]],
    launches: Sequence[Launch],
    kernel: Callable[..., Any],
    check: Callable[[Any, Any, str], None],
) -> None:
    """Print one line a case: ``cublas`` and ``fk_path`` as (label, call), then ``kernel(tile=,
    num_stages=, num_warps=)`` at each of ``launches`` (its output checked by ``check(got, fk's,
    what)`` before it is timed) against fk's path; ``flops`` for the TFLOP/s column."""

    def row(case: str, t_ms: float, base_ms: float | None = None) -> None:
        against = f"  ({t_ms / base_ms:.3f}x fk's path)" if base_ms else ""
        print(f"  {case:36s} {t_ms * 1e3:8.1f} us {flops / t_ms / 1e9:6.0f} TFLOP/s{against}", flush=True)

    row(cublas[0], bench.time_ms(cublas[1], gpu_only=True))
    fk_ms = bench.time_ms(fk_path[1], gpu_only=True)
    row(fk_path[0], fk_ms)
    reference = fk_path[1]()
    best: tuple[float, Launch] | None = None
    for launch in launches:
        tile, stages, warps = launch
        kwargs = {"tile": tile, "num_stages": stages, "num_warps": warps}
        try:
            got = kernel(**kwargs)
        except triton.runtime.errors.OutOfResources as error:
            print(f"  {launch!s:36s} {type(error).__name__}", flush=True)
            continue
        check(got, reference, str(launch))
        t_ms = bench.time_ms(lambda: kernel(**kwargs), gpu_only=True)  # noqa: B023
        row(str(launch), t_ms, fk_ms)
        if best is None or t_ms < best[0]:
            best = (t_ms, launch)
    if best is not None:
        row(f"best {best[1]}", best[0], fk_ms)
