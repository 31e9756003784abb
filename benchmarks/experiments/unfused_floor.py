"""#32: which of the rows still short of their target could an implementation that runs the LoRA
passes apart from the GEMMs (as fk does) reach at all?

bench_lora's floor counts the base GEMMs at the matmul ceiling (or cuBLAS's time, the faster), the
4-bit dequantizations at the copy bandwidth and, with dropout, each mask written and read once. An
implementation whose rank-16 products and gated activation are passes of their own also moves, at
the least, these bytes (bf16, Llama-3.1-8B: H = 4096, I = 14336, q/k/v 4096 + 1024 + 1024 out):

- the MLP's activation: forward reads gate and up and writes h, backward reads dh, gate and up and
  writes d gate and d up: 8 M I elements;
- the rank-16 products, each reading its [M, *] operand once: the MLP's x A^T (x), h A_d^T (h), dy's
  G and dB (dy), d gate's and d up's G and dB (both), dA_d (h), gate's and up's dA (x): 3 H + 4 I
  elements a row; QKV's x A^T (x), the three G and dB (dq, dk, dv), the three dA (x): 2 H + 6144;
  O's x A^T, G and dB (dy), dA (x): 3 H;

and its base GEMMs take what fk's `lora_matmul` kernel takes above cuBLAS's (`triton_upgrade_gemm`:
measured at the q/O, gate/up and down products; k and v, not measured, count 0). The unfused floor
is the floor plus those bytes at the copy bandwidth plus that GEMM excess: a lower bound (Philox's
draws, DoRA's extra passes, a mask read more than once and the dequantizations above copy speed are
left out). A row whose target is below it cannot be met without fusing those passes into the GEMMs;
a row whose target is above it might be, by passes nearer the copy bandwidth.

Run (no GPU; reads the committed records and `triton_upgrade_gemm_h200.txt`):
    python benchmarks/experiments/unfused_floor.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
RECORDS = ("lora_qlora", "lora_dora", "lora_dora_qlora")
HIDDEN, INTERMEDIATE, QKV_OUT = 4096, 14336, 4096 + 1024 + 1024
TARGET_SPEEDUP, FLOOR_SLACK = 1.5, 1.1
"""The issue's targets: 1.5x PEFT's GPU time, or within 10% of the floor where that is slower."""
LABELS = {"q / O": "o", "gate / up": "mlp", "down": "mlp"}


def pass_elements(block: str, tokens: int) -> int:
    """Elements the activation and rank-16 passes read and write, apart from the GEMMs."""
    if block == "mlp":
        return tokens * (8 * INTERMEDIATE + 3 * HIDDEN + 4 * INTERMEDIATE)
    if block == "qkv":
        return tokens * (2 * HIDDEN + QKV_OUT)
    return tokens * 3 * HIDDEN


def gemm_excess_ms() -> dict[tuple[str, int], float]:
    """fk's base GEMMs above cuBLAS's, ms, per (block, tokens), from ``triton_upgrade_gemm_h200.txt``
    (gate/up counted twice: two products; QKV counts q's alone)."""
    line = re.compile(r"^(q / O|gate / up|down)\s+(\d+) .* cuBLAS\s+([\d.]+) us .* fk\s+([\d.]+) us")
    excess: dict[tuple[str, int], float] = {}
    for text in (HERE / "triton_upgrade_gemm_h200.txt").read_text().splitlines():
        found = line.match(text)
        if found is None:
            continue
        label, tokens, cublas, fk = found[1], int(found[2]), float(found[3]), float(found[4])
        extra = (fk - cublas) / 1e3 * (2 if label == "gate / up" else 1)
        blocks = ("o", "qkv") if label == "q / O" else (LABELS[label],)
        for block in blocks:
            excess[(block, tokens)] = excess.get((block, tokens), 0.0) + extra
    return excess


def main() -> None:
    excess = gemm_excess_ms()
    print("record            block tokens dropout   fk ms  target  floor  unfused  verdict")
    for name in RECORDS:
        record = json.loads((RESULTS / f"{name}.json").read_text())
        copy = record["ceilings"]["copy_tbps"] * 1e12
        rows = [r for r in record["rows"] if r["adapter"] == "bf16"]
        for row in rows:
            if row["provider"] != "fk":
                continue
            same = ("block", "tokens", "dropout")
            peft = next(p for p in rows if p["provider"] == "peft" and all(p[k] == row[k] for k in same))
            target = max(peft["gpu_ms"] / TARGET_SPEEDUP, row["floor_ms"] * FLOOR_SLACK)
            if row["gpu_ms"] <= target:
                continue
            block, tokens = row["block"], row["tokens"]
            passes_ms = 2 * pass_elements(block, tokens) / copy * 1e3
            unfused = row["floor_ms"] + excess[(block, tokens)] + passes_ms
            verdict = "needs fusion" if unfused > target else "reachable unfused"
            print(f"{name:17s} {block:5s} {tokens:6d} {row['dropout']:7.2f} {row['gpu_ms']:7.3f} {target:7.3f}"
                  f" {row['floor_ms']:6.3f} {unfused:8.3f}  {verdict} (fk at {unfused / row['gpu_ms']:.1%} of it)")  # fmt: skip


if __name__ == "__main__":
    main()
