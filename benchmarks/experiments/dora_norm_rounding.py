"""#32: under autocast on an fp32 model, PEFT's DoRA forms the row norm ``||W + s B A||`` from the fp32
weight, fk's fused DoRA from the weight cast to bf16 (autocast's dtype, in which its GEMMs take it).
How far apart are the two norms, against bf16's half unit (2**-9) that rounds every output anyway?

Rows of Llama-3.1-8B's widths (K = 4096: q/k/v/O, gate/up's inputs; K = 14336: down's), weights
drawn as ``N(0, 0.02)`` (transformers' initializer range), ``A`` and ``B`` as ``N(0, 0.01)``, r = 16,
s = 2; the largest relative difference over 1024 rows. CPU only.

Run:  python benchmarks/experiments/dora_norm_rounding.py
"""

from __future__ import annotations

import torch


def norm_rounding(rows: int, k: int, seed: int = 0) -> float:
    """The largest relative difference between ``||W + s B A||`` from fp32 and from bf16-cast operands."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, k, generator=gen) * 0.02
    lora_b, lora_a = torch.randn(rows, 16, generator=gen) * 0.01, torch.randn(16, k, generator=gen) * 0.01
    exact = torch.linalg.norm(weight + 2.0 * (lora_b @ lora_a), dim=1)
    cast = [t.bfloat16().float() for t in (weight, lora_b, lora_a)]
    rounded = torch.linalg.norm(cast[0] + 2.0 * (cast[1] @ cast[2]), dim=1)
    return float(((rounded - exact) / exact).abs().max())


def main() -> None:
    print(f"bf16 half unit: {2.0**-9:.3e}")
    for k in (4096, 14336):
        print(f"K = {k}: largest relative difference of the row norm {norm_rounding(1024, k):.3e}")


if __name__ == "__main__":
    main()
