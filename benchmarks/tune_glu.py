"""Sweep fk GLU's launch parameters on a GPU (a development tool; results pick the defaults).

Each variant sets the module constants of ``fk.glu.glu`` (elements per program, warps) and times
fk alone on bf16 ``tokens x intermediate`` inputs: the forward (3 tensors moved) and the backward
launcher (5 tensors moved), for SwiGLU and tanh-GeGLU; the table shows TB/s and the fraction of the
copy bandwidth measured in the same run. Run:  python benchmarks/tune_glu.py [--tokens ...]
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch

from fk.core import bench

module = importlib.import_module("fk.glu.glu")

TILES = [1024, 2048, 4096, 8192]
WARPS = [2, 4, 8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--rep", type=int, default=30)
    args = parser.parse_args()
    copy = bench.copy_bandwidth_tbps()
    print(f"copy ceiling {copy:.2f} TB/s")
    rows = []
    for tokens, act in itertools.product(args.tokens, ("silu", "gelu_tanh")):
        shape = (tokens, args.intermediate)
        a, b, dy = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        code = module._CODES[act]
        elements = a.numel()
        for tile, warps in itertools.product(TILES, WARPS):
            if tile // (warps * 32) < 8:  # fewer than 8 elements (one 16-byte vector) per thread
                continue
            for key, value in {"FWD_TILE": tile, "BWD_TILE": tile, "FWD_WARPS": warps, "BWD_WARPS": warps}.items():
                setattr(module, key, value)
            module._tiling.cache_clear()
            fwd = bench.time_ms(lambda: module._glu_fwd(a, b, code, False), rep=args.rep, warmup=5)  # noqa: B023
            bwd = bench.time_ms(lambda: module._glu_bwd(dy, a, b, code, False, True, True), rep=args.rep, warmup=5)  # noqa: B023
            rows.append(
                {"tokens": tokens, "act": act, "tile": tile, "warps": warps,
                 "fwd TB/s": bench.tbps(6 * elements, fwd), "fwd copy%": 100 * bench.tbps(6 * elements, fwd) / copy,
                 "bwd TB/s": bench.tbps(10 * elements, bwd), "bwd copy%": 100 * bench.tbps(10 * elements, bwd) / copy}
            )  # fmt: skip
    print(bench.markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
