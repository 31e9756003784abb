"""Why fk's LoRA MLP at 16384 tokens takes ~2 ms more wall-clock time than GPU time (lora.json of
2026-11-24T09:36: fp32 adapters, 19.9 ms against 17.8 ms GPU; PEFT 31.2 against 31.1).

1. Wall-clock (``bench.time_ms``) and GPU-only time (``gpu_only=True``) of forward+backward against
   ``fk.lora.lora.MLP_CHUNK_BYTES``, with PEFT's in the same process.
2. One profiled forward+backward at the default, timed as the benchmark times it (no head start):
   the GPU's idle gaps between kernels, largest first, with the kernels on either side.

Run on a GPU:  python benchmarks/experiments/lora_mlp_wall_probe.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from fk.core import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20


def main() -> None:
    import bench_lora

    import fk.lora

    lora_module = sys.modules["fk.lora.lora"]
    default = lora_module.MLP_CHUNK_BYTES
    tokens = 16384
    for adapter in ("fp32", "bf16"):
        model = bench_lora._lora_model("mlp", 0.0, 16, 32, bench_lora.ADAPTER_DTYPES[adapter])
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, bench_lora.HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        x.requires_grad_()
        dy = torch.randn(tokens, bench_lora.HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        leaves = [x, *(p for p in model.parameters() if p.requires_grad)]

        def fwd_bwd(model: torch.nn.Module = model, x: torch.Tensor = x, dy: torch.Tensor = dy) -> None:
            model(x).backward(dy)

        def measure(
            label: str, fwd_bwd: object = fwd_bwd, leaves: list[torch.Tensor] = leaves, adapter: str = adapter
        ) -> None:
            wall = bench.time_stats_ms(fwd_bwd, warmup=5, rep=30, grad_to_none=leaves)  # type: ignore[arg-type]
            gpu = bench.time_ms(fwd_bwd, warmup=2, rep=20, grad_to_none=leaves, gpu_only=True, head_start_ms=25.0)  # type: ignore[arg-type]
            for t in leaves:
                t.grad = None
            peak = bench.peak_memory_bytes(fwd_bwd) / MIB  # type: ignore[arg-type]
            for t in leaves:
                t.grad = None
            print(f"{adapter} {label:26s} wall {wall.median:7.3f} ms (min {wall.min:7.3f})  GPU {gpu:7.3f} ms  "
                  f"{peak:6.0f} MB", flush=True)  # fmt: skip

        measure("peft")
        fk.lora.patch(model)
        for mib in (128, 256, 512, 1 << 20):
            lora_module.MLP_CHUNK_BYTES = mib * MIB
            rows = lora_module._mlp_chunk_rows(torch.empty(1, bench_lora.INTER, dtype=torch.bfloat16), 0.0)
            measure(f"fk chunk {min(rows, tokens)} rows" + (" (default)" if mib * MIB == default else ""))
        lora_module.MLP_CHUNK_BYTES = default

        # Idle gaps of one forward+backward, launched as the wall-clock timing launches it.
        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        for t in leaves:
            t.grad = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd_bwd()
            torch.cuda.synchronize()
        kernels = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: e.time_range.start,
        )
        gaps = []
        for before, after in itertools.pairwise(kernels):
            gap = after.time_range.start - before.time_range.end
            if gap > 0:
                gaps.append((gap, before.name[:60], after.name[:60]))
        span = kernels[-1].time_range.end - kernels[0].time_range.start
        busy = sum(e.time_range.end - e.time_range.start for e in kernels)
        print(f"{adapter} fk profiled: {len(kernels)} kernels, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, "
              f"idle {sum(g for g, *_ in gaps) / 1e3:.3f} ms")  # fmt: skip
        for gap, before, after in sorted(gaps, reverse=True)[:12]:
            print(f"    {gap:7.1f} us idle between {before} -> {after}")
        fk.lora.unpatch(model)


if __name__ == "__main__":
    main()
