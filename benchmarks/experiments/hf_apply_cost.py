"""What fk.hf.apply costs at patch time: recognition plus the probes, on the GPU.

For each family, a model of the Llama-3.2-1B shape (``fk.hf.training.SHAPES``) is built in bf16 on
the GPU and patched twice: the first ``apply`` in the process includes Triton's compilation of the
kernels the probes launch (a cold cache; training would compile them at its first step anyway),
the second, on a fresh model, is what a patch costs with the kernels compiled. The probes leave
nothing behind: the patched model's forward is timed against a model patched the same way.

Run on a GPU:  python benchmarks/experiments/hf_apply_cost.py [--families llama olmo3 ...]
"""

from __future__ import annotations

import argparse
import time

import torch

import fk.hf
from fk.hf import training


def _build(family: str) -> torch.nn.Module:
    shape = training.SHAPES["llama-3.2-1b"]
    return training.build_model(shape, dtype=torch.bfloat16, device="cuda", seed=0, max_positions=2048,
                                model_type=family)  # fmt: skip


def _timed_apply(model: torch.nn.Module) -> tuple[float, fk.hf.PatchReport]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    report = fk.hf.apply(model)
    torch.cuda.synchronize()
    return time.perf_counter() - start, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "olmo3", "smollm3", "glm4", "exaone"])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("family    cold apply s  warm apply s  patched")
    for family in args.families:
        cold, _ = _timed_apply(_build(family))
        warm, report = _timed_apply(_build(family))
        counts = ", ".join(f"{k} {v}" for k, v in report.items() if v)
        print(f"{family:9} {cold:12.3f}  {warm:12.3f}  {counts}")
        if report.stock:
            print("          left stock: " + "; ".join(f"{k}: {v}" for k, v in report.stock.items()))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
