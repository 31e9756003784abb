"""Where fk's DoRA layers spend their time, against fk's plain LoRA on the same layer: bench_lora.py's
Llama-3.1-8B blocks (r=16, bf16 adapters by default, no dropout), forward+backward under the PyTorch
profiler. Per iteration: the GPU kernels summed by name, the wall time (synchronized), and the host
calls that wait for the GPU (a synchronization makes the host's time and the GPU's add up instead of
overlapping).

Run on a GPU:  python benchmarks/experiments/dora_profile.py [--block mlp qkv o] [--tokens N ...]
               [--adapters bf16|fp32] [--dropout P] [--qlora] [--host]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ITERS = 5
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")
"""Host calls that block until the GPU catches up (``cudaMemcpy `` with its space: the blocking copy)."""


def profile_one(fwd_bwd: object, label: str, top: int) -> None:
    for _ in range(3):
        fwd_bwd()  # type: ignore[operator]
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(ITERS):
        fwd_bwd()  # type: ignore[operator]
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - began) * 1e3 / ITERS
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fwd_bwd()  # type: ignore[operator]
        torch.cuda.synchronize()
    per_iter = collections.Counter[str]()
    launches = collections.Counter[str]()
    waits = collections.Counter[str]()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_iter[e.name[:100]] += e.device_time / 1e3 / ITERS
            launches[e.name[:100]] += 1
        elif any(e.name.startswith(w) for w in WAITS) or e.name == "cudaMemcpy":
            waits[e.name] += 1
    print(f"{label}: wall {wall_ms:.3f} ms, GPU {sum(per_iter.values()):.3f} ms per forward+backward; "
          f"{sum(launches.values()) // ITERS} kernels; host waits per iteration: "
          f"{ {k: v / ITERS for k, v in waits.items()} or 'none'}")  # fmt: skip
    for name, ms in per_iter.most_common(top):
        print(f"  {ms:7.3f} ms  x{launches[name] // ITERS:3d}  {name}")


def host_profile(fwd_bwd: object, label: str, top: int) -> None:
    """The host's Python time per forward+backward (cProfile over 20 iterations, by own time)."""
    for _ in range(3):
        fwd_bwd()  # type: ignore[operator]
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        fwd_bwd()  # type: ignore[operator]
    profiler.disable()
    torch.cuda.synchronize()
    print(f"{label}: host functions by own time, 20 iterations")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main() -> None:
    import bench_lora

    import fk.lora

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", nargs="+", choices=["mlp", "qkv", "o"], default=["mlp"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--adapters", choices=sorted(bench_lora.ADAPTER_DTYPES), default="bf16")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--qlora", action="store_true", help="4-bit bases (bench_lora --qlora's)")
    parser.add_argument("--top", type=int, default=24, help="kernels listed per case")
    parser.add_argument("--host", action="store_true", help="also the host's Python time per function (cProfile)")
    args = parser.parse_args()
    for block in args.block:
        for tokens in args.tokens:
            for dora in (False, True):
                model = bench_lora._lora_model(block, args.dropout, 16, 32, bench_lora.ADAPTER_DTYPES[args.adapters],
                                               dora, qlora=args.qlora)  # fmt: skip
                fk.lora.patch(model)
                call = bench_lora._call(model, block)
                in_features = bench_lora._projections(block, bench_lora.LLAMA)[0][0]
                gen = torch.Generator(device="cuda").manual_seed(0)
                x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
                x.requires_grad_()
                leaves = [x, *(p for p in model.parameters() if p.requires_grad)]
                outs = call(x)
                dys = [torch.randn_like(o) for o in outs]

                def fwd_bwd(call=call, leaves=leaves, x=x, dys=dys) -> None:  # type: ignore[no-untyped-def]
                    for t in leaves:
                        t.grad = None
                    torch.autograd.backward(call(x), dys)

                label = f"{block} {tokens} tokens, {'DoRA' if dora else 'LoRA'}"
                print(f"# {label}, {args.adapters} adapters, dropout {args.dropout}"
                      f"{', NF4 bases' if args.qlora else ''} ({torch.cuda.get_device_name()})")  # fmt: skip
                profile_one(fwd_bwd, label, args.top)
                if args.host:
                    host_profile(fwd_bwd, label, args.top)
                del model, x, dys, outs, leaves
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
