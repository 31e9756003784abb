"""fk's LoRA MLP (bench_lora.py's Llama-3.1-8B shapes, r=16, no dropout) against the rows of ``h``
it forms at a time (``fk.lora.lora.MLP_CHUNK_BYTES``): GPU time of forward+backward and peak
memory, with PEFT eager's in the same process. The down projection's GEMMs run once per chunk, so
the chunk's rows decide how their tiles fill the GPU's waves.

Run on a GPU:  python benchmarks/experiments/lora_mlp_chunks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fk.core import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
CHUNKS_MIB = [64, 96, 112, 116, 128, 160, 224, 448, 1 << 20]  # the last: one chunk (h whole)


def main() -> None:
    import bench_lora

    import fk.lora

    lora_module = sys.modules["fk.lora.lora"]
    default = lora_module.MLP_CHUNK_BYTES
    for adapter in ("fp32", "bf16"):
        for tokens in (16384, 4096):
            model = bench_lora._lora_model("mlp", 0.0, 16, 32, bench_lora.ADAPTER_DTYPES[adapter])
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            x = torch.randn(tokens, bench_lora.HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            x.requires_grad_()
            dy = torch.randn(tokens, bench_lora.HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            leaves = [x, *(p for p in model.parameters() if p.requires_grad)]

            def fwd_bwd(model: torch.nn.Module = model, x: torch.Tensor = x, dy: torch.Tensor = dy) -> None:
                model(x).backward(dy)

            def measure(
                label: str, fwd_bwd: object = fwd_bwd, leaves: list[torch.Tensor] = leaves, case: str = ""
            ) -> None:
                ms = bench.time_ms(fwd_bwd, warmup=5, rep=20, grad_to_none=leaves, gpu_only=True, head_start_ms=25.0)
                for t in leaves:
                    t.grad = None
                peak = bench.peak_memory_bytes(fwd_bwd) / MIB  # type: ignore[arg-type]
                for t in leaves:
                    t.grad = None
                print(f"{case}{label:28s} {ms:7.3f} ms GPU  {peak:7.0f} MB", flush=True)

            case = f"{adapter} adapters, {tokens:5d} tokens, "
            measure("peft", case=case)
            fk.lora.patch(model)
            for mib in CHUNKS_MIB:
                lora_module.MLP_CHUNK_BYTES = mib * MIB
                rows = lora_module._mlp_chunk_rows(torch.empty(1, bench_lora.INTER, dtype=torch.bfloat16), 0.0)
                mark = " (default)" if mib * MIB == default else ""
                measure(f"fk chunk {min(rows, tokens)} rows{mark}", case=case)
            lora_module.MLP_CHUNK_BYTES = default
            fk.lora.unpatch(model)


if __name__ == "__main__":
    main()
