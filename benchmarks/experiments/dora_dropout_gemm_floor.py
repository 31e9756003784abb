"""#32: bench_lora's floor for DoRA with dropout counts the base products twice (PEFT's DoRA
multiplies the dropped input by the base weight too, and its input gradient follows), at twice
cuBLAS's time for one set of the layer's products (``2 * gemm_ms``), each set timed with the GPU
idle before it. A row runs both sets in one call, back to back, and a large product run back to
back is slower (``matmul_ceiling_modes``). Does cuBLAS take twice its one-set time for the two
sets run as a row runs them, one call after an idle GPU, or longer?

Per block (Llama-3.1-8B MLP, QKV, O) and token count: cuBLAS's GPU time for one set of the layer's
products (``bench_lora.base_products``: forward ``x @ W.T`` and input gradient ``dy @ W`` of each
projection, separate or fused by shared input, the faster), and for two sets in one call, the second
with operands of its own (the dropped input, its gradient) and the same weights; timed as
bench_lora's rows (``bench.time_ms(gpu_only=True)``: L2 flushed, the GPU idle before each call).

Run on a GPU:  python benchmarks/experiments/dora_dropout_gemm_floor.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sets_ms(block: str, tokens: int, sets: int, fused: bool) -> float:
    """cuBLAS's GPU time for ``sets`` sets of ``block``'s base products in one call."""
    import bench_lora

    from fk.core import bench

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    products = bench_lora.base_products(block, tokens, fused=fused)
    weights = []
    for _, k, n, layout in products:  # (x @ W.T: W stored [n, k]; dy @ W: W stored [k, n] here)
        stored = (n, k) if layout == "nt" else (k, n)
        w = torch.randn(*stored, device="cuda", generator=gen).bfloat16()
        weights.append(w.t() if layout == "nt" else w)
    pairs = [(torch.randn(m, k, device="cuda", generator=gen).bfloat16(), w)
             for _ in range(sets) for (m, k, _, _), w in zip(products, weights, strict=True)]  # fmt: skip

    def run(pairs: list[tuple[torch.Tensor, torch.Tensor]] = pairs) -> None:
        for a, b in pairs:
            torch.matmul(a, b)

    ms = bench.time_ms(run, warmup=5, rep=20, gpu_only=True)
    del pairs, weights
    torch.cuda.empty_cache()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("round block tokens  one set ms  two sets ms  two / (2 x one)")
    for r in range(args.rounds):
        for block in ("mlp", "qkv", "o"):
            for tokens in args.tokens:
                one = min(sets_ms(block, tokens, 1, fused) for fused in (False, True))
                two = min(sets_ms(block, tokens, 2, fused) for fused in (False, True))
                print(f"{r:5d} {block:5s} {tokens:6d} {one:11.3f} {two:12.3f} {two / (2 * one):16.3f}", flush=True)


if __name__ == "__main__":
    main()
