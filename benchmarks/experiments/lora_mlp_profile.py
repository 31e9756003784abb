"""Where fk's LoRA MLP spends its GPU time: bench_lora.py's Llama-3.1-8B MLP (r=16, fp32 adapters,
no dropout) at 16384 tokens, forward+backward under the PyTorch profiler, kernels summed per
iteration, fk and PEFT eager in one process. What is not one of the six base GEMMs is what fk can
still remove.

Run on a GPU:  python benchmarks/experiments/lora_mlp_profile.py [--tokens N] [--adapters fp32|bf16]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ITERS = 5


def kernel_table(fwd_bwd: object, label: str) -> None:
    for _ in range(3):
        fwd_bwd()  # type: ignore[operator]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fwd_bwd()  # type: ignore[operator]
        torch.cuda.synchronize()
    per_iter = collections.Counter[str]()
    launches = collections.Counter[str]()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_iter[e.name[:100]] += e.device_time / 1e3 / ITERS
            launches[e.name[:100]] += 1
    print(f"{label}: GPU time per forward+backward {sum(per_iter.values()):.3f} ms")
    for name, ms in per_iter.most_common(30):
        print(f"  {ms:7.3f} ms  x{launches[name] // ITERS:3d}  {name}")


def main() -> None:
    import bench_lora

    import fk.lora

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--adapters", choices=sorted(bench_lora.ADAPTER_DTYPES), default="fp32")
    args = parser.parse_args()
    model = bench_lora._lora_model("mlp", 0.0, 16, 32, bench_lora.ADAPTER_DTYPES[args.adapters])
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, bench_lora.HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    x.requires_grad_()
    dy = torch.randn(args.tokens, bench_lora.HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    leaves = [x, *(p for p in model.parameters() if p.requires_grad)]

    def fwd_bwd() -> None:
        for t in leaves:
            t.grad = None
        model(x).backward(dy)

    print(f"# {args.tokens} tokens, {args.adapters} adapters, r=16, no dropout ({torch.cuda.get_device_name()})")
    kernel_table(fwd_bwd, "peft")
    fk.lora.patch(model)
    kernel_table(fwd_bwd, "fk")


if __name__ == "__main__":
    main()
