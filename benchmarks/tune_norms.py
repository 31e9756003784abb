"""Sweep the launch parameters of fk's RMSNorm, LayerNorm or PolyNorm on a GPU (a development
tool; its results pick the module defaults).

Each variant sets module constants of ``fk.norms.<op>`` and times fk alone on bf16 rows with a
trainable (or, with --frozen, frozen) parameters: the forward (FWD_* constants) and forward+backward (BWD_* constants). Times are
GPU work only (``bench.time_ms(gpu_only=True)``), so narrow rows measure the kernels, not the
host. TB/s counts the bytes of bench_norms.py: 4*M*H forward, 10*M*H forward+backward. For each
width it prints the module's own settings and the five best variants.

Run:  python benchmarks/tune_norms.py --op poly_norm [--frozen] [--widths ...] [--directions fwd fwd+bwd]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
from collections.abc import Callable
from types import ModuleType

import torch

import fk.norms
from fk.core import bench

FWD_SPACE = {"FWD_MIN_TILE": [2048, 4096, 8192], "FWD_ELEMENTS_PER_WARP": [256, 512, 1024],
             "FWD_MAX_WARPS": [4, 8, 16]}  # fmt: skip
BWD_SPACE = {"BWD_MIN_TILE": [2048, 4096], "BWD_PROGRAMS_PER_SM": [2, 4, 8], "BWD_ELEMENTS_PER_WARP": [256, 512]}
WIDE_FWD_SPACE = {"FWD_MAX_BLOCK_COLS": [8192, 16384, 32768], "FWD_ELEMENTS_PER_WARP": [256, 512, 1024],
                  "FWD_MAX_WARPS": [8, 16]}  # fmt: skip
WIDE_BWD_SPACE = {"BWD_MAX_BLOCK_COLS": [4096, 8192, 16384], "BWD_LOOPED_BLOCK_COLS": [4096, 8192],
                  "BWD_LOOPED_PROGRAMS_PER_SM": [1, 2, 4],
                  "BWD_ELEMENTS_PER_WARP": [256, 512]}  # fmt: skip
# Rows at most the module's BWD_NARROW_COLS wide take settings of their own in the backward.
NARROW_BWD_SPACE = {"BWD_NARROW_MIN_TILE": [1024, 2048, 4096], "BWD_NARROW_PROGRAMS_PER_SM": [4, 8, 16, 32]}
WIDE = 16384  # widths from here on sweep the widest tile instead of the narrow-row grouping
# With --frozen, a module that has settings of its own for the backward without dw (LayerNorm's wide
# rows) sweeps those instead of the trainable ones.
FROZEN_NAMES = {"BWD_MAX_BLOCK_COLS": "BWD_FROZEN_LOOPED_BLOCK_COLS",
                "BWD_LOOPED_PROGRAMS_PER_SM": "BWD_FROZEN_LOOPED_PROGRAMS_PER_SM",
                "BWD_PROGRAMS_PER_SM": "BWD_FROZEN_PROGRAMS_PER_SM",
                "BWD_NARROW_PROGRAMS_PER_SM": "BWD_FROZEN_NARROW_PROGRAMS_PER_SM"}  # fmt: skip


def call(op: str, x: torch.Tensor, trainable: bool) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One forward of ``op`` on ``x`` with new parameters (``trainable``: they require grad),
    returning the outputs the backward starts from."""
    width = x.shape[-1]
    kwargs = {"device": x.device, "dtype": x.dtype, "requires_grad": trainable}
    if op == "rms_norm":
        w = torch.ones(width, **kwargs)
        return lambda: (fk.norms.rms_norm(x, w),)
    if op == "fused_add_rms_norm":
        w, residual = torch.ones(width, **kwargs), torch.randn_like(x)
        return lambda: fk.norms.fused_add_rms_norm(x, residual, w)
    if op == "layer_norm":
        w, b = torch.ones(width, **kwargs), torch.zeros(width, **kwargs)
        return lambda: (fk.norms.layer_norm(x, w, b),)
    w, b = torch.full((3,), 1 / 3, **kwargs), torch.ones(1, **kwargs)
    return lambda: (fk.norms.poly_norm(x, w, b),)


def forward_backward(fn: Callable[[], tuple[torch.Tensor, ...]], dy: torch.Tensor) -> None:
    outputs = fn()
    torch.autograd.backward(outputs, [dy] * len(outputs))


def configure(module: ModuleType, values: dict[str, int]) -> None:
    for key, value in values.items():
        setattr(module, key, value)
    module._fwd_tiling.cache_clear()
    module._bwd_tiling.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--op", choices=["rms_norm", "fused_add_rms_norm", "layer_norm", "poly_norm"], default="rms_norm"
    )
    parser.add_argument("--frozen", action="store_true", help="parameters that need no gradient")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--directions", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--defaults-only", action="store_true", help="time the module's own settings only")
    args = parser.parse_args()
    # The module whose constants the variants set (FusedAddRMSNorm runs RMSNorm's kernels); the
    # module, not the function of the same name that fk.norms exports.
    module = importlib.import_module(f"fk.norms.{'rms_norm' if args.op == 'fused_add_rms_norm' else args.op}")
    names = {*FWD_SPACE, *BWD_SPACE, *NARROW_BWD_SPACE, *WIDE_FWD_SPACE, *WIDE_BWD_SPACE, *FROZEN_NAMES.values()}
    defaults = {k: getattr(module, k) for k in names if hasattr(module, k)}
    for width in args.widths:
        x = torch.randn(args.rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        fn = call(args.op, x, trainable=not args.frozen)
        for direction in args.directions:
            timed = fn if direction == "fwd" else functools.partial(forward_backward, fn, dy)
            if direction == "fwd":
                space, nbytes = (WIDE_FWD_SPACE if width >= WIDE else FWD_SPACE), 4
            elif width <= getattr(module, "BWD_NARROW_COLS", 0):
                space, nbytes = NARROW_BWD_SPACE, 10
            else:
                space, nbytes = (WIDE_BWD_SPACE if width >= WIDE else BWD_SPACE), 10
            if args.frozen:
                space = {FROZEN_NAMES[k] if FROZEN_NAMES.get(k) in defaults else k: v for k, v in space.items()}
            space = {k: v for k, v in space.items() if k in defaults and not args.defaults_only}
            results = []
            for values in [{}, *(dict(zip(space, v, strict=True)) for v in itertools.product(*space.values()))]:
                configure(module, {**defaults, **values})
                try:
                    ms = bench.time_ms(timed, rep=args.rep, warmup=5, grad_to_none=[x], gpu_only=True)
                except Exception as exc:  # a variant that does not compile (too many registers, ...)
                    print(f"H={width} {direction} {values}: failed: {type(exc).__name__}: {exc}"[:300])
                    continue
                results.append({"TB/s": round(bench.tbps(nbytes * args.rows * width, ms), 3),
                                "GPU ms": round(ms, 4), "variant": str(values or "module defaults")})  # fmt: skip
            configure(module, defaults)
            top = [results[0], *sorted(results[1:], key=lambda r: -r["TB/s"])[:5]] if results else []
            print(f"\n{args.op} H={width} {direction}")
            print(bench.markdown_table(top, ["TB/s", "GPU ms", "variant"]), flush=True)


if __name__ == "__main__":
    main()
