"""Sweep the launch parameters of fk's RMSNorm, LayerNorm or PolyNorm backward alone, timed
without host cost (a development tool; its results picked the BACKWARD and BACKWARD_FROZEN tables of
fk.norms.rms_norm, layer_norm and poly_norm, and RMSNorm's STRIPS tables (LayerNorm's STRIPS holds
RMSNorm's values, not swept yet), whose fields ``TABLE.field`` it sets).

bench_norms.py times forward+backward calls, which at narrow rows measure the
host (Python, the autograd engine, Triton's launch path) more than the kernel. Here 20 calls of
the backward launcher (kernel plus the partial-sum reductions) are captured in a CUDA graph and
replayed, so only GPU time counts. Three modes: ``trainable`` (weight gradient), ``frozen`` (none)
and, for RMSNorm, ``residual`` (FusedAddRMSNorm's backward: trainable, plus the residual's
gradient added to dx).

For each mode it prints the module's own settings' time per shape (and, with ``--baseline FILE``,
the time of another version of the module's file, e.g. the committed one, loaded beside it), then
every variant of SPACE relative to the best, sorted by its worst ratio over the shapes.

Run:  python benchmarks/tune_norm_backward.py [--op rms_norm|layer_norm|poly_norm]
      [--modes trainable frozen] [--top N] [--space looped|strips|contiguous|order] [--widths H ...] [--baseline path/to/old/<op>.py]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
from collections.abc import Callable
from types import ModuleType

import torch
from tune_norms import set_settings, setting  # benchmarks/tune_norms.py

from fk.core import bench

# Trainable: 4 and 8 programs an SM lost to 1 and 2 at 1024-4096 columns (INDEX.md#norm_narrow_trainable);
# 3 programs, 2048-element tiles and 256 elements a warp were added after that run, swept one width at
# a time (--widths 1024, then 2048, ...) for the table of rows up to 4096 columns.
SPACE = {
    "trainable": {"BACKWARD.programs_per_sm": [1, 2, 3, 4], "BACKWARD.min_tile": [2048, 4096, 8192, 16384],
                  "BACKWARD.elements_per_warp": [256, 512, 1024, 2048]},
    "frozen": {"BACKWARD_FROZEN.programs_per_sm": [2, 4, 8], "BACKWARD_FROZEN.min_tile": [2048, 4096, 8192]},
}  # fmt: skip
SPACE["residual"] = SPACE["trainable"]
# --space looped: the backward with a weight gradient for rows taken several at a time in column
# tiles (BACKWARD.widest_*), applied from the narrowest of --widths on (e.g. --widths 16384 32768 65536).
LOOPED_SPACE = {
    "rms_norm": {"BACKWARD.widest_rows": [1, 2, 4], "BACKWARD.widest_block_cols": [4096, 8192, 16384],
                 "BACKWARD.elements_per_warp": [512, 1024], "BACKWARD.widest_max_warps": [16, 32]},
    "layer_norm": {"BACKWARD.widest_rows": [1, 2, 4], "BACKWARD.widest_block_cols": [4096, 8192, 16384],
                   "BACKWARD.wide_elements_per_warp": [512], "BACKWARD.widest_max_warps": [16]},
    # PolyNorm's rows wider than 16384, one at a time: its programs per SM and column tiles.
    "poly_norm": {"BACKWARD.looped_programs_per_sm": [1, 2, 4], "BACKWARD.looped_block_cols": [2048, 4096, 8192]},
}  # fmt: skip
# --space strips: the two-pass backward with a weight gradient (fk.norms.norm_strips) of RMSNorm
# (trainable; residual: FusedAddRMSNorm's) or LayerNorm (trainable: with db), applied at every one of
# --widths; pass --baseline with a one-kernel version of the op's file (rms_norm.py from before the
# strips were added, layer_norm.py from before it took them) to time the two side by side.
# The fields of the op's STRIPS (trainable) or STRIPS_RESIDUAL (residual).
STRIPS_SPACE = {"block_rows": [2, 4, 8], "block_cols": [512, 1024, 2048], "num_warps": [4, 8],
                "programs_per_sm": [2, 4, 8], "dot_block_cols": [2048, 4096]}  # fmt: skip
# --space contiguous: RMSNorm's one-tile rows wider than the prefetch takes, each program a block of
# consecutive row tiles (as Liger's backward) or every n-th tile, with the weight held or reloaded.
CONTIGUOUS_SPACE = {"BACKWARD.contiguous_min_cols": [1024, 1 << 30], "BACKWARD.weight_per_tile_cols": [16384, 1 << 30],
                    "BACKWARD.elements_per_warp": [512, 1024, 2048], "BACKWARD.programs_per_sm": [1, 2]}  # fmt: skip
# --space order: the one-tile backward's order of work: FusedAddRMSNorm's dres loaded beside x and dy
# or after computing dx, and the tile's dw added before dx is computed (as Liger's) or after, also in
# prefetched one-row tiles or not.
ORDER_SPACE = {
    "residual": {"BACKWARD.early_dres_min_cols": [1, 1 << 30], "BACKWARD.dw_first_min_cols_residual": [1, 1 << 30],
                 "BACKWARD.dw_first_prefetched_min_rows": [1, 2]},
    "trainable": {"BACKWARD.dw_first_min_cols": [1, 1 << 30], "BACKWARD.dw_first_prefetched_min_rows": [1, 2]},
}  # fmt: skip
# PolyNorm's weight and bias gradients are four scalars per program (16-byte partial rows), so the
# question there is how few programs keep memory busy.
POLY_NORM_SPACE = {
    "trainable": {"BACKWARD.programs_per_sm": [1, 2, 4, 8], "BACKWARD.min_tile": [2048, 4096, 8192],
                  "BACKWARD.elements_per_warp": [256, 512, 1024]},
    "frozen": {"BACKWARD_FROZEN.min_tile": [2048, 4096, 8192], "BACKWARD_FROZEN.elements_per_warp": [512, 1024]},
}  # fmt: skip
WIDTHS = [512, 1024, 2048, 4096, 8192, 16384]
ROWS = 16384


def backward_call(module: ModuleType, op: str, mode: str, width: int) -> Callable[[], object]:
    """The backward launcher of ``module`` on fresh [ROWS, width] bf16 tensors."""
    x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    trainable = mode != "frozen"
    if op == "rms_norm":
        dx = torch.empty_like(x)
        dres = torch.randn_like(x) if mode == "residual" else None
        _, rstd = module.launch_forward(x, w, 1e-6, 0.0, False)
        return lambda: module.launch_backward(dy, x, w, rstd, 0.0, trainable, dx, dres)
    if op == "poly_norm":
        w3, b1 = (
            torch.randn(3, device="cuda", dtype=torch.bfloat16),
            torch.randn(1, device="cuda", dtype=torch.bfloat16),
        )
        _, rstd = module._poly_norm_fwd(x, w3, b1, 1e-6)
        return lambda: module._poly_norm_bwd(dy, x, w3, b1, rstd, True, trainable, trainable)
    b = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    _, mean, rstd = module._layer_norm_fwd(x, w, b, 1e-5)
    return lambda: module._layer_norm_bwd(dy, x, w, b, mean, rstd, True, trainable, trainable)


def load_file(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(
    module: ModuleType, baseline: ModuleType | None, op: str, mode: str, top: int, space_name: str, widths: list[int]
) -> None:
    if space_name == "strips":
        table = "STRIPS_RESIDUAL" if mode == "residual" else "STRIPS"
        thresholds = ["BACKWARD.strips_min_cols"] + (["BACKWARD.strips_min_cols_residual"] if op == "rms_norm" else [])
        space = {**{key: [min(widths)] for key in thresholds},
                 **{f"{table}.{field}": values for field, values in STRIPS_SPACE.items()}}  # fmt: skip
    elif space_name == "contiguous":
        space = dict(CONTIGUOUS_SPACE)
    elif space_name == "order":
        space = dict(ORDER_SPACE[mode])
    elif space_name == "looped":
        space = dict(LOOPED_SPACE[op])
        if op != "poly_norm":
            space = {"BACKWARD.widest_min_cols": [min(widths)], **space}
    else:
        space = POLY_NORM_SPACE[mode] if op == "poly_norm" else SPACE[mode]
    saved = {k: setting(module, k) for k in space}
    # The default space sweeps BACKWARD's own fields, which rows in the module's BACKWARD_NARROW
    # table do not read: the table is emptied for the variants, and back for the module's settings.
    narrow_table = getattr(module, "BACKWARD_NARROW", ()) if space_name == "default" and mode != "frozen" else ()
    variants = [dict(zip(space, values, strict=True)) for values in itertools.product(*space.values())]
    times: dict[tuple[int, ...], dict[int, float]] = {}
    print(f"--- {op} {mode}: {ROWS} rows, bf16, backward GPU time (us)")
    for width in widths:
        call = backward_call(module, op, mode, width)
        if narrow_table:
            module.BACKWARD_NARROW = ()
        for variant in variants:
            set_settings(module, variant)
            times.setdefault(tuple(variant.values()), {})[width] = bench.graph_time_us(call)
        if narrow_table:
            module.BACKWARD_NARROW = narrow_table
        set_settings(module, saved)
        us = bench.graph_time_us(call)
        line = f"H={width}: the module's settings {us:.1f} us"
        if baseline is not None:
            old = bench.graph_time_us(backward_call(baseline, op, mode, width))
            line += f", baseline {old:.1f} us (x{old / us:.3f})"
        print(line)
    best = {w: min(t[w] for t in times.values()) for w in widths}
    print("best (us) at H = " + ", ".join(f"{w}: {best[w]:.1f}" for w in widths))
    print(f"{tuple(space)}: time / best at H = " + ", ".join(map(str, widths)))
    for key, t in sorted(times.items(), key=lambda kv: max(kv[1][w] / best[w] for w in widths))[:top]:
        print(key, " ".join(f"{t[w] / best[w]:.3f}" for w in widths))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", choices=["rms_norm", "layer_norm", "poly_norm"], default="rms_norm")
    parser.add_argument("--modes", nargs="+", choices=list(SPACE), default=["trainable", "frozen"])
    parser.add_argument("--baseline", help="another version of the op's module file, timed beside it")
    parser.add_argument("--top", type=int, default=10, help="variants to print per mode, best first")
    parser.add_argument("--space", choices=["default", "looped", "strips", "contiguous", "order"], default="default",
                        help="see LOOPED_SPACE, STRIPS_SPACE, CONTIGUOUS_SPACE and ORDER_SPACE")  # fmt: skip
    parser.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    args = parser.parse_args()
    module = importlib.import_module(f"fk.norms.{args.op}")
    baseline = load_file(args.baseline, f"baseline_{args.op}") if args.baseline else None
    for mode in args.modes:
        if mode == "residual" and args.op != "rms_norm":
            raise SystemExit("--modes residual is RMSNorm's (FusedAddRMSNorm's backward)")
        if args.space == "looped" and (args.op not in LOOPED_SPACE or mode == "frozen"):
            raise SystemExit(
                "--space looped is for RMSNorm, LayerNorm and PolyNorm, with --modes trainable (and residual)"
            )
        if args.space == "strips" and (args.op not in ("rms_norm", "layer_norm") or mode == "frozen"):
            raise SystemExit(
                "--space strips is for RMSNorm and LayerNorm, with --modes trainable (and RMSNorm's residual)"
            )
        if args.space in ("contiguous", "order") and (args.op != "rms_norm" or mode == "frozen"):
            raise SystemExit(f"--space {args.space} is for RMSNorm, with --modes trainable (and residual)")
        sweep(module, baseline, args.op, mode, args.top, args.space, args.widths)


if __name__ == "__main__":
    main()
