"""Sweep fk RMSNorm's launch parameters on a GPU (a development tool; results pick the defaults).

Each variant sets the module constants of ``fk.norms.rms_norm`` and times fk alone, forward and
forward+backward (trainable weight), on bf16 rows; the table shows TB/s with the byte counts of
bench_rms_norm.py. Run:  python benchmarks/tune_rms_norm.py [--widths ...]
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch

from fk.core import bench

# The module, not the function of the same name that fk.norms exports.
module = importlib.import_module("fk.norms.rms_norm")

FWD_SPACE = {
    "FWD_MAX_BLOCK_COLS": [8192, 16384, 32768],
    "FWD_MIN_TILE": [2048, 4096, 8192],
    "FWD_ELEMENTS_PER_WARP": [256, 512, 1024],
}
BWD_SPACE = {"BWD_MAX_BLOCK_COLS": [4096, 8192, 16384], "BWD_MIN_TILE": [2048, 4096],
             "BWD_PROGRAMS_PER_SM": [2, 4, 8], "BWD_LOOPED_PROGRAMS_PER_SM": [1, 2], "BWD_ELEMENTS_PER_WARP": [256, 512]}  # fmt: skip


def variants(space: dict[str, list[int]]) -> list[dict[str, int]]:
    return [dict(zip(space, values, strict=True)) for values in itertools.product(*space.values())]


def configure(module: object, values: dict[str, int]) -> None:
    for key, value in values.items():
        setattr(module, key, value)
    module._fwd_tiling.cache_clear()  # type: ignore[attr-defined]
    module._bwd_tiling.cache_clear()  # type: ignore[attr-defined]


def time_variant(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, direction: str, rep: int) -> float:
    def forward() -> None:
        module.rms_norm(x, w)

    def forward_backward() -> None:
        module.rms_norm(x, w).backward(dy)

    call = forward if direction == "fwd" else forward_backward
    return bench.time_ms(call, rep=rep, warmup=5, grad_to_none=[x, w])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--rep", type=int, default=30)
    args = parser.parse_args()
    defaults = {k: getattr(module, k) for k in {**FWD_SPACE, **BWD_SPACE}}
    rows = []
    for width in args.widths:
        x = torch.randn(args.rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        for direction, space, nbytes in (("fwd", FWD_SPACE, 4), ("fwd+bwd", BWD_SPACE, 10)):
            best = None
            for variant in variants(space):
                configure(module, {**defaults, **variant})
                try:
                    ms = time_variant(x, w, dy, direction, args.rep)
                except Exception as exc:  # a variant that does not compile (too many registers, ...)
                    print(f"H={width} {direction} {variant}: failed: {type(exc).__name__}")
                    continue
                speed = bench.tbps(nbytes * args.rows * width, ms)
                if best is None or speed > best[0]:
                    best = (speed, ms, variant)
                rows.append({"H": width, "dir": direction, "TB/s": speed, "ms": ms, **variant})
            if best:
                print(f"H={width} {direction}: best {best[0]:.2f} TB/s ({best[1]:.3f} ms) with {best[2]}", flush=True)
    configure(module, defaults)
    for width in args.widths:
        for direction in ("fwd", "fwd+bwd"):
            sub = sorted((r for r in rows if r["H"] == width and r["dir"] == direction), key=lambda r: -r["TB/s"])
            print(bench.markdown_table(sub[:5], list(sub[0].keys())) if sub else "")


if __name__ == "__main__":
    main()
