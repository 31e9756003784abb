"""Sweep fk.lora.quant_matmul on a GPU: a 4-bit weight dequantized tile by tile inside the GEMM against
dequantizing it whole and calling cuBLAS, and where the two cross (a development tool; results set
``TILE_DEQUANT_MAX_ROWS`` and the ``LAUNCH`` table).

At the Llama-3.1-8B weights (NF4, blocksize 64, nested absmax in blocks of 256, bf16; q and o share a
shape, so do k and v, and gate and up) and ``M`` rows of bf16 activations, it times both products a
LoRA base layer needs, ``x W^T`` (forward) and ``dy W`` (input gradient):
- whole: ``dequantize(q)`` then ``torch.mm`` (what fk-lora runs above the threshold);
- tile: ``linear_4bit`` / ``matmul_4bit`` with each candidate launch (``LAUNCH``'s first).
Each case first checks the tile result against the whole one (max error relative to the largest
value). Prints one table row per case (ms, TFLOP/s, tile / whole), then for each weight and product
the largest ``M`` where the best tile launch wins, the best launch per product, and the threshold
that the smallest of those crossovers suggests.

Run on a GPU (about 3 minutes on an H100):  python benchmarks/tune_qlora_matmul.py
Try on a CPU:  TRITON_INTERPRET=1 python benchmarks/tune_qlora_matmul.py --tiny  (tiny shapes, the code paths only)
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable

import torch
import triton

from fk.core import bench
from fk.lora.quant import QuantizedWeight, dequantize, quantize_ref
from fk.lora.quant_matmul import LAUNCH, TILE_DEQUANT_MAX_ROWS, LaunchParams, linear_4bit, matmul_4bit

WEIGHTS = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
"""Llama-3.1-8B's base weights, ``[N, K]`` (out_features, in_features)."""
ROWS = [256, 512, 1024, 2048, 4096, 8192, 16384]
"""Tokens ``M``: the training range (2048..16384) and below it, where the crossover is expected."""
CANDIDATES = [
    LaunchParams(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    LaunchParams(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=2),
    LaunchParams(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
    LaunchParams(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
]
"""Launches tried for both products (``LAUNCH``'s go first); block_k 64 keeps the aligned path. (Compiled
for sm_90 without a GPU, on the aligned path each fits a Hopper SM's shared memory; one that does not
is skipped.)"""
TINY_WEIGHTS = {"small": (48, 128), "narrow": (24, 192)}
TINY_ROWS = [16, 40]
TINY_CANDIDATES = [LaunchParams(16, 16, 64, 2, 4, 2), LaunchParams(32, 32, 32, 2, 4, 2)]


def _products(q: QuantizedWeight, x: torch.Tensor, dy: torch.Tensor) -> dict[str, dict[str, Callable[..., object]]]:
    """Per product: the whole path (no launch) and the tile path (given a launch)."""
    return {
        "x W^T": {
            "whole": lambda: torch.mm(x, dequantize(q).t()),
            "tile": lambda p: linear_4bit(x, q, params=p),
        },
        "dy W": {
            "whole": lambda: torch.mm(dy, dequantize(q)),
            "tile": lambda p: matmul_4bit(dy, q, params=p),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", help=f"tokens M (default {ROWS})")
    parser.add_argument("--weights", nargs="+", choices=sorted(WEIGHTS), help="which weights (default all)")
    parser.add_argument("--rep", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU in Triton's interpreter")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    weights = TINY_WEIGHTS if args.tiny else {name: WEIGHTS[name] for name in args.weights or WEIGHTS}
    rows_list = args.rows or (TINY_ROWS if args.tiny else ROWS)
    candidates = TINY_CANDIDATES if args.tiny else list(dict.fromkeys([*LAUNCH.values(), *CANDIDATES]))

    def time_ms(fn: Callable[[], object]) -> float:
        if args.tiny:
            return bench.cpu_time_ms(fn, warmup=1, rep=1)
        return bench.time_ms(fn, rep=args.rep, warmup=5)

    if not args.tiny:
        ceilings = bench.measure_ceilings()
        print(f"copy ceiling {ceilings.copy_tbps:.2f} TB/s, bf16 matmul ceiling {ceilings.matmul_tflops:.0f} TFLOP/s")
    table = []
    wins: dict[tuple[str, str], list[tuple[int, bool]]] = collections.defaultdict(list)
    best_launch: dict[str, collections.Counter[LaunchParams]] = collections.defaultdict(collections.Counter)
    for name, (n, k) in weights.items():
        w = torch.randn(n, k, device=device).to(torch.bfloat16)
        q = quantize_ref(w, "nf4", 64, nested=True)  # (QuantizedWeight.dtype bf16, as bench_lora's bases)
        del w
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            for product, paths in _products(q, x, dy).items():
                want = paths["whole"]()
                assert isinstance(want, torch.Tensor)
                scale = float(want.abs().max())
                errors = {}
                for p in candidates:
                    try:
                        errors[p] = float((paths["tile"](p) - want).abs().max()) / scale  # type: ignore[operator]
                    except triton.runtime.errors.OutOfResources as e:  # a launch that does not fit: skipped
                        print(f"skipped {product} {tuple(p)} at M = {m}: {e}")
                error = max(errors.values())
                whole = time_ms(paths["whole"])
                tile = {p: time_ms(lambda p=p, run=paths["tile"]: run(p)) for p in errors}  # type: ignore[misc]
                launch, tile_ms = min(tile.items(), key=lambda item: item[1])
                best_launch[product][launch] += 1
                wins[(name, product)].append((m, tile_ms < whole))
                flops = 2 * m * n * k
                table.append(
                    {"weight": name, "N x K": f"{n} x {k}", "M": m, "product": product,
                     "whole ms": whole, "tile ms": tile_ms, "default tile ms": tile.get(candidates[0], float("nan")),
                     "tile / whole": tile_ms / whole, "whole TFLOP/s": bench.tflops(flops, whole),
                     "tile TFLOP/s": bench.tflops(flops, tile_ms), "max rel err": error,
                     "best launch": "/".join(str(v) for v in launch)}
                )  # fmt: skip
            del x, dy
    print(bench.markdown_table(table, list(table[0])))
    print("\nlaunch fields: block_m/block_n/block_k/group_m/num_warps/num_stages")
    print("\ncrossover (the largest M up to which the best tile launch beats whole at every M swept;")
    print(f"current TILE_DEQUANT_MAX_ROWS = {TILE_DEQUANT_MAX_ROWS}):")
    crossovers = []
    for (name, product), outcomes in wins.items():
        below = [m for m, tile_wins in sorted(outcomes) if tile_wins]
        crossover = 0
        for m, tile_wins in sorted(outcomes):
            if not tile_wins:
                break
            crossover = m
        crossovers.append(crossover)
        print(f"  {name:8s} {product:6s}: {crossover if crossover else 'tile never wins'} (tile wins at M = {below})")
    for product, counter in best_launch.items():
        launch, count = counter.most_common(1)[0]
        print(f"best {product} launch ({count} of {sum(counter.values())} cases): {launch}")
    print(f"suggested TILE_DEQUANT_MAX_ROWS = {min(crossovers)}  (the smallest crossover; 0: never tile)")


if __name__ == "__main__":
    main()
