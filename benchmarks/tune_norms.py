"""Sweep the launch parameters of fk's RMSNorm, LayerNorm or PolyNorm on a GPU (a development
tool; its results pick the module defaults).

Each variant sets fields of the launch tables of ``fk.norms.<op>`` (``TABLE.field``: FORWARD, or
FORWARD_RESIDUAL for FusedAddRMSNorm; BACKWARD, or BACKWARD_FROZEN with --frozen) and times fk alone
on bf16 rows with trainable (or, with --frozen, frozen) parameters: the forward and forward+backward. Times are
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

FWD_SPACE = {"FORWARD.min_tile": [2048, 4096, 8192], "FORWARD.elements_per_warp": [256, 512, 1024],
             "FORWARD.max_warps": [4, 8, 16]}  # fmt: skip
BWD_SPACE = {"BACKWARD.min_tile": [2048, 4096], "BACKWARD.programs_per_sm": [2, 4, 8],
             "BACKWARD.elements_per_warp": [256, 512]}  # fmt: skip
WIDE_FWD_SPACE = {"FORWARD.max_block_cols": [8192, 16384, 32768], "FORWARD.elements_per_warp": [256, 512, 1024],
                  "FORWARD.max_warps": [8, 16]}  # fmt: skip
WIDE_BWD_SPACE = {"BACKWARD.max_block_cols": [4096, 8192, 16384], "BACKWARD.looped_block_cols": [4096, 8192],
                  "BACKWARD.looped_programs_per_sm": [1, 2, 4],
                  "BACKWARD.elements_per_warp": [256, 512]}  # fmt: skip
# Rows at most narrow_cols wide, in a backward table that gives them programs of their own, sweep these.
NARROW_BWD_SPACE = {"BACKWARD.narrow_min_tile": [1024, 2048, 4096], "BACKWARD.narrow_programs_per_sm": [4, 8, 16, 32]}
WIDE = 16384  # widths from here on sweep the widest tile instead of the narrow-row grouping


def setting(module: ModuleType, key: str) -> int | None:
    """The value of ``TABLE.field`` in ``module``, or None where its table has no such field."""
    table, _, field = key.partition(".")
    return getattr(getattr(module, table, None), field, None)


def set_settings(module: ModuleType, values: dict[str, int]) -> None:
    """Set fields of ``module``'s launch tables (``{"TABLE.field": value}``) and clear its tiling caches."""
    for key, value in values.items():
        table, _, field = key.partition(".")
        if setting(module, key) is None:
            raise AttributeError(f"{module.__name__} has no setting {key}")
        setattr(module, table, getattr(module, table)._replace(**{field: value}))
    module._fwd_tiling.cache_clear()
    module._bwd_tiling.cache_clear()


def tables(space: dict[str, list[int]], forward: str, backward: str) -> dict[str, list[int]]:
    """``space`` with its FORWARD and BACKWARD keys naming the tables ``forward`` and ``backward``."""
    names = {"FORWARD": forward, "BACKWARD": backward}
    renamed = {}
    for key, values in space.items():
        table, _, field = key.partition(".")
        renamed[f"{names[table]}.{field}"] = values
    return renamed


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
    # The module whose tables the variants set (FusedAddRMSNorm runs RMSNorm's kernels, with its own
    # forward table); the module, not the function of the same name that fk.norms exports.
    module = importlib.import_module(f"fk.norms.{'rms_norm' if args.op == 'fused_add_rms_norm' else args.op}")
    forward = "FORWARD_RESIDUAL" if args.op == "fused_add_rms_norm" else "FORWARD"
    backward = "BACKWARD_FROZEN" if args.frozen else "BACKWARD"
    spaces = [tables(space, forward, backward)
              for space in (FWD_SPACE, BWD_SPACE, NARROW_BWD_SPACE, WIDE_FWD_SPACE, WIDE_BWD_SPACE)]  # fmt: skip
    fwd_space, bwd_space, narrow_bwd_space, wide_fwd_space, wide_bwd_space = spaces
    defaults = {k: v for space in spaces for k in space if (v := setting(module, k)) is not None}
    narrow_cols = getattr(getattr(module, backward), "narrow_cols", 0)
    for width in args.widths:
        x = torch.randn(args.rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        fn = call(args.op, x, trainable=not args.frozen)
        for direction in args.directions:
            timed = fn if direction == "fwd" else functools.partial(forward_backward, fn, dy)
            if direction == "fwd":
                space, nbytes = (wide_fwd_space if width >= WIDE else fwd_space), 4
            elif width <= narrow_cols and f"{backward}.narrow_programs_per_sm" in defaults:
                space, nbytes = narrow_bwd_space, 10
            else:
                space, nbytes = (wide_bwd_space if width >= WIDE else bwd_space), 10
            space = {k: v for k, v in space.items() if k in defaults and not args.defaults_only}
            results = []
            for values in [{}, *(dict(zip(space, v, strict=True)) for v in itertools.product(*space.values()))]:
                set_settings(module, {**defaults, **values})
                try:
                    ms = bench.time_ms(timed, rep=args.rep, warmup=5, grad_to_none=[x], gpu_only=True)
                except Exception as exc:  # a variant that does not compile (too many registers, ...)
                    print(f"H={width} {direction} {values}: failed: {type(exc).__name__}: {exc}"[:300])
                    continue
                results.append({"TB/s": round(bench.tbps(nbytes * args.rows * width, ms), 3),
                                "GPU ms": round(ms, 4), "variant": str(values or "module defaults")})  # fmt: skip
            set_settings(module, defaults)
            top = [results[0], *sorted(results[1:], key=lambda r: -r["TB/s"])[:5]] if results else []
            print(f"\n{args.op} H={width} {direction}")
            print(bench.markdown_table(top, ["TB/s", "GPU ms", "variant"]), flush=True)


if __name__ == "__main__":
    main()
