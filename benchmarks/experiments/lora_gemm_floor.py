"""How much of bench_lora.py's floor can cuBLAS itself reach? Its floor counts a case's base matmuls
(forward and input gradient, ``4 * tokens * sum(in * out)`` FLOPs; twice for DoRA with dropout) at
the matmul ceiling, which ``fk.core.bench`` measures on an 8192 x 8192 x 8192 bf16 product. The
products of a Llama-3.1-8B layer at 4096 and 16384 tokens have other shapes; this times exactly
them, by torch.matmul (cuBLAS), GPU time alone, as the LoRA path must run them: for each block
(MLP, QKV, O) and token count, the forward ``x @ W.T`` and the input gradient ``dy @ W`` of every
projection, one product per projection ("separate") or the projections that share an input in one
product ("fused": gate and up; q, k and v), the faster of the two (``bench_lora.base_gemm_times``,
which since 2026-11-28 runs them in the layer's layouts, ``x @ W.T`` and ``dy @ W`` of a weight
``W[n, k]``, and bench_lora's floor takes; the 2026-11-27 output, with the ceilings timed back to
back, took every product as ``[m, k] @ [k, n]``). It prints each case's GEMM time,
its share of the ceiling's time for the same FLOPs ("GEMMs / floor"), and the share of the nominal
floor that a case made of these GEMMs plus the floor's bytes at the copy ceiling can reach
("reachable floor%", per record row kind: dense, QLoRA, DoRA, DoRA with dropout).

Run on a GPU:  python benchmarks/experiments/lora_gemm_floor.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import bench_lora

from fk.core import bench

TOKENS = (4096, 16384)
BLOCKS = ("mlp", "qkv", "o")
KINDS = {  # the records' kinds of rows: (4-bit base, DoRA, dropout)
    "dense": (False, False, 0.0), "dense+dropout": (False, False, 0.05), "qlora": (True, False, 0.0),
    "qlora+dropout": (True, False, 0.05), "dora": (False, True, 0.0), "dora+dropout": (False, True, 0.05),
    "dora nf4": (True, True, 0.0), "dora nf4+dropout": (True, True, 0.05),
}  # fmt: skip


def main() -> None:
    ceilings = bench.measure_ceilings(gpu_only=True)  # as bench_lora's
    print(f"# {bench.environment()}")
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    rows = []
    for block in BLOCKS:
        for tokens in TOKENS:
            flops = bench_lora._flops(block, tokens)
            ideal = bench.floor_ms(ceilings, flops=flops)
            times = bench_lora.base_gemm_times(block, tokens, rep=50)
            gemm = min(times.values())
            row: dict[str, object] = {"block": block, "tokens": tokens, "GFLOP": flops / 1e9,
                                      "ceiling ms": ideal, "separate ms": times["separate"], "fused ms": times["fused"],
                                      "GEMMs / floor": gemm / ideal}  # fmt: skip
            # bench_lora's floor of each kind of row (bf16 adapters), over the same floor with these
            # GEMMs' time in place of their FLOPs at the ceiling (DoRA with dropout has them twice).
            for kind, (qlora, dora, dropout) in KINDS.items():
                nominal = bench_lora._against_ceilings(ceilings, block, tokens, bench_lora.LLAMA, qlora, 1.0, dora,
                                                       dropout)["floor_ms"]  # fmt: skip
                products = 2 if dora and dropout > 0 else 1
                row[f"reachable floor% {kind}"] = 100 * nominal / (nominal + products * (gemm - ideal))
            rows.append(row)
    print(bench.markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
