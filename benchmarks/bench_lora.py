"""LoRA MLP, QKV and O forward+backward side by side: fk.lora against PEFT eager, on the same modules.

Llama-3.1-8B layer shapes (hidden 4096, intermediate 14336, 32 query / 8 key-value heads of 128),
r=16, alpha=32, bf16 base weights (frozen), inputs that require grad, at 4096 and 16384 tokens,
LoRA dropout 0 and 0.05, LoRA weights in bf16 and in fp32 (fp32 is what ``peft.get_peft_model``
gives a bf16 model by default: ``autocast_adapter_dtype=True``). PEFT's LoRA layers are injected into plain modules
that compute as Hugging Face's LlamaMLP / LlamaAttention projections
(``peft.inject_adapter_in_model``); the ``fk`` rows run the same modules after ``fk.lora.patch``.
Forward+backward time, FLOP rate against the bf16 matmul ceiling measured in the same run, and
peak memory. FLOPs counted: the base matmuls only, forward and the input gradient
(``4 * tokens * sum(in * out)``); the LoRA branch is under 1% of that at r=16.

``--dora`` runs the same with DoRA adapters (PEFT ``use_dora=True``; record ``lora_dora.json``).

Run on a GPU:  python benchmarks/bench_lora.py --out benchmarks/results/lora.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fk.core import bench

NAME = "lora"
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
BLOCKS = ("mlp", "qkv", "o")
ADAPTER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _MLP(nn.Module):
    """Hugging Face's LlamaMLP."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Attention(nn.Module):
    """The four projections of Hugging Face's LlamaAttention (the attention itself is not timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)


def _lora_model(
    block: str, dropout: float, rank: int, alpha: int, adapter_dtype: torch.dtype, dora: bool = False
) -> nn.Module:
    import peft

    torch.manual_seed(0)
    base = _MLP() if block == "mlp" else _Attention()
    targets = ["gate_proj", "up_proj", "down_proj"] if block == "mlp" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                             init_lora_weights=False, use_dora=dora)  # fmt: skip
    model = peft.inject_adapter_in_model(config, base)
    model = model.to(device="cuda", dtype=torch.bfloat16).train()
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)  # (DoRA's lora_magnitude_vector too)
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return model


def _call(model: nn.Module, block: str) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    if block == "mlp":
        return lambda x: [model(x)]
    attn: Any = model
    if block == "qkv":
        return lambda x: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    return lambda x: [attn.o_proj(x)]


def _flops(block: str, tokens: int) -> float:
    shapes = {"mlp": [(HIDDEN, INTER)] * 3, "qkv": [(HIDDEN, HEADS * HEAD_DIM)] + [(HIDDEN, KV_HEADS * HEAD_DIM)] * 2,
              "o": [(HEADS * HEAD_DIM, HIDDEN)]}[block]  # fmt: skip
    return 4.0 * tokens * sum(k * n for k, n in shapes)


def measure(record: bench.BenchRecord, matmul_tflops: float, block: str, tokens: int, dropout: float,
            rank: int, alpha: int, rep: int, adapter: str, dora: bool = False) -> None:  # fmt: skip
    import fk.lora

    model = _lora_model(block, dropout, rank, alpha, ADAPTER_DTYPES[adapter], dora)
    fn = _call(model, block)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    with torch.no_grad():
        dys = [torch.randn_like(o) for o in fn(x)]
    leaves = [x, *(p for p in model.parameters() if p.requires_grad)]

    def forward_backward() -> None:
        torch.autograd.backward(fn(x), dys)

    # Sanity (dropout 0): the patched modules compute what PEFT's do, bf16 rounding apart.
    if dropout == 0:
        with torch.no_grad():
            want = fn(x)
            fk.lora.patch(model)
            got = fn(x)
            fk.lora.unpatch(model)
        for g, w in zip(got, want, strict=True):
            err = (g.float() - w.float()).abs().max().item() / max(w.float().abs().max().item(), 1e-6)
            if err > 0.05:
                raise AssertionError(f"fk disagrees with PEFT ({block}, {tokens} tokens): relative error {err}")

    for provider in ("peft", "fk"):
        if provider == "fk":
            fk.lora.patch(model)
        ms = bench.time_ms(forward_backward, warmup=5, rep=rep, grad_to_none=leaves)
        gpu_ms = bench.time_ms(
            forward_backward, warmup=5, rep=rep, grad_to_none=leaves, gpu_only=True, head_start_ms=25.0
        )  # a LoRA block's host path takes milliseconds
        for t in leaves:
            t.grad = None
        peak = bench.peak_memory_bytes(forward_backward)
        for t in leaves:
            t.grad = None
        achieved = bench.tflops(_flops(block, tokens), ms)
        record.add(
            provider=provider, block=block, tokens=tokens, dropout=dropout, adapter=adapter, mode="fwd+bwd", ms=ms,
            tflops=achieved, matmul_fraction=bench.fraction(achieved, matmul_tflops), peak_mb=peak / 2**20,
            gpu_ms=gpu_ms, **({"dora": True} if dora else {}),
        )  # fmt: skip
    fk.lora.unpatch(model)


def run(tokens: list[int], dropouts: list[float], adapters: list[str], out: Path, rep: int, rank: int,
        alpha: int, dora: bool = False) -> bench.BenchRecord:  # fmt: skip
    record = bench.BenchRecord(
        NAME,
        notes=(f"Llama-3.1-8B layer shapes, {'DoRA, ' if dora else ''}r={rank}, alpha={alpha}, bf16 base (frozen), LoRA weights "
               f"in {' and '.join(adapters)}; "
               "FLOPs: base matmuls of forward and input gradient"),
    )  # fmt: skip
    ceilings = bench.measure_ceilings()
    record.ceilings = ceilings.as_dict()
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    cases = [(b, t, d, a) for a in adapters for b in BLOCKS for t in tokens for d in dropouts]
    for block, t, d, a in bench.progress(cases, desc=NAME):
        measure(record, ceilings.matmul_tflops, block, t, d, rank, alpha, rep, a, dora)
        torch.cuda.empty_cache()
    out.parent.mkdir(parents=True, exist_ok=True)
    record.to_json(out)
    return record


def speedups(record: bench.BenchRecord) -> list[dict[str, object]]:
    """fk against PEFT eager per (adapter dtype, block, tokens, dropout): speed (PEFT ms / fk ms) and
    memory ratio. Records from before the adapter axis had bf16 adapters."""
    table = []

    def key(r: dict[str, Any]) -> tuple[bool, str, str, int, float]:
        return (r.get("dora", False), r.get("adapter", "bf16"), r["block"], r["tokens"], r["dropout"])

    keys = sorted({key(r) for r in record.rows}, key=lambda k: (k[0], k[1], BLOCKS.index(k[2]), k[3], k[4]))
    for dora, adapter, block, tokens, dropout in keys:
        rows = {r["provider"]: r for r in record.rows if key(r) == (dora, adapter, block, tokens, dropout)}
        fk, peft = rows["fk"], rows["peft"]
        table.append({
            **({"dora": True} if dora else {}), "adapter": adapter, "block": block, "tokens": tokens, "dropout": dropout, "fk ms": fk["ms"],
            "peft ms": peft["ms"],
            "x peft": peft["ms"] / fk["ms"], "fk matmul%": 100 * fk["matmul_fraction"],
            "fk MB": fk["peak_mb"], "peft MB": peft["peak_mb"], "memory / peft": fk["peak_mb"] / peft["peak_mb"],
            **({"fk GPU ms": fk["gpu_ms"], "GPU x peft": peft["gpu_ms"] / fk["gpu_ms"]} if "gpu_ms" in fk else {}),
        })  # fmt: skip
    return table


COLUMNS = [
    "dora",
    "adapter",
    "block",
    "tokens",
    "dropout",
    "fk ms",
    "peft ms",
    "x peft",
    "fk matmul%",
    "fk GPU ms",
    "GPU x peft",
    "fk MB",
    "peft MB",
    "memory / peft",
]


def summary(record: bench.BenchRecord) -> str:
    """The markdown table for docs/benchmarks.md ("x peft": PEFT's time over fk's; "GPU x peft": the
    same of the GPU work alone, ``bench.time_ms(gpu_only=True)``)."""
    return bench.markdown_table(speedups(record), COLUMNS, skip_absent=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON record to write (a directory gets lora.json, or lora_dora.json, inside; "
                             "default benchmarks/results/)")  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.05])
    parser.add_argument("--adapters", nargs="+", default=list(ADAPTER_DTYPES), choices=list(ADAPTER_DTYPES),
                        help="dtypes of the LoRA weights")  # fmt: skip
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--dora", action="store_true", help="DoRA adapters (PEFT use_dora=True)")
    parser.add_argument("--summary", type=Path, help="only print the table of this JSON record")
    args = parser.parse_args()
    if args.summary:
        record = bench.BenchRecord.from_json(args.summary)
    else:
        out = args.out or Path("benchmarks/results")
        if out.is_dir() or not out.suffix:
            out = out / f"{NAME}{'_dora' if args.dora else ''}.json"
        record = run(args.tokens, args.dropout, args.adapters, out, args.rep, args.rank, args.alpha, args.dora)
    print(f"bf16 matmul ceiling {record.ceilings['matmul_tflops']:.0f} TFLOP/s ({record.environment.get('gpu')})")
    print(summary(record))


if __name__ == "__main__":
    main()
