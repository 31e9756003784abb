"""bench_memory.py's ``throughput`` step (Llama-3.2-1B shape, DeepSpeed ZeRO-3 without offload, bf16,
4 x 2048 tokens a GPU) for one variant of fk's fused loss, timed and then profiled: is fk's default
loss (one chunk, the logits' gradient kept for the backward) what makes its ZeRO-3 step slower than
fk-lowmem's (384 MiB chunks, the head's gradient summed in bf16)?

Variants: ``fk`` (defaults), ``fk-lowmem`` (both options), ``fk-budget`` (the 384 MiB budget alone),
``fk-bf16`` (the bf16 sum alone), ``liger``, ``stock``. Rank 0 prints the median of 6 timed steps
(after 3), then the 15 CUDA kernels and the 15 host operators (self time) of one profiled step, then
(added for ``zero3_step_floor``: why fk's and Liger's steps with next to no compute took 40-50 ms
longer than stock's) the host's Python time of one more step by package (cProfile, own time) and
its 20 functions with the most own time. An optional second argument sets the tokens a sequence
and the sequences a GPU (``SEQxBATCH``, default 2048x4; ``64x1`` is zero3_step_floor's step).

Run on 2 GPUs:  torchrun --standalone --nproc-per-node 2 benchmarks/experiments/zero3_step_probe.py fk [64x1]
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_e2e import patch_after_build, patch_before_build  # benchmarks/
from bench_memory import ds_config

from fk.hf import training

OPTIONS = {"fk-budget": {"memory_budget": 384 << 20}, "fk-bf16": {"accum_dtype": torch.bfloat16}}


def build(variant: str, batch: int) -> tuple[Any, Callable[[int, int, int], float], int]:
    """The ZeRO-3 engine of ``variant`` (rank's GPU, NCCL), a function timing one training step of
    (step index, tokens a sequence, sequences a GPU) in seconds, and this process's rank."""
    import deepspeed
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    provider = "fk" if variant in OPTIONS else variant
    shape = training.SHAPES["llama-3.2-1b"]
    patch_before_build(provider, "llama")
    model = training.build_model(shape, dtype=torch.bfloat16, device="cuda", seed=0, max_positions=1 << 20)
    patch_after_build(provider, model)
    if variant in OPTIONS:
        import fk.hf

        fk.hf.loss_options(model, **OPTIONS[variant])
    job = {"scenario": "throughput", "lr": 1e-4, "cpu_adam": False, "batch": batch}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(job))
    corpus = training.MarkovCorpus(shape.vocab, active=1024, branching=4)

    def step(i: int, seq: int, batch: int) -> float:
        rows = corpus.batch(i, batch * world, seq)[rank * batch : (rank + 1) * batch].to(engine.device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine(input_ids=rows, labels=rows)
        engine.backward(out.loss)
        engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    return engine, step, rank


def main() -> None:
    import torch.distributed as dist

    variant = sys.argv[1]
    seq, batch = map(int, (sys.argv[2] if len(sys.argv) > 2 else "2048x4").split("x"))
    _, timed_step, rank = build(variant, batch)
    world = dist.get_world_size()

    def step(i: int) -> float:
        return timed_step(i, seq, batch)

    times = [step(i) for i in range(9)][3:]
    if rank == 0:
        print(f"{variant} world {world}, {batch} x {seq} tokens a GPU: median step {1e3 * statistics.median(times):.1f} ms "
              f"({[round(1e3 * t, 1) for t in times]}), peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")  # fmt: skip
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        step(9)
    if rank == 0:
        averages = prof.key_averages()
        print(averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    profile = cProfile.Profile()
    profile.enable()
    step(10)
    profile.disable()
    if rank == 0:
        print_host_time(pstats.Stats(profile))
    dist.barrier()


PACKAGES = ("deepspeed", "liger_kernel", "fk", "transformers", "triton", "torch")


def print_host_time(stats: pstats.Stats) -> None:
    """Own time of the profiled step's Python functions summed by the package that defines them (C
    functions apart: torch's operators among them), and the 20 functions with the most own time."""
    by_package: collections.Counter = collections.Counter()
    rows = []
    for (filename, line, name), (_, calls, own, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
        package = "C functions" if filename == "~" else next((p for p in PACKAGES if f"/{p}/" in filename), "other")
        by_package[package] += own
        rows.append((own, calls, f"{filename.split('site-packages/')[-1]}:{line}({name})"))
    print("host own time by package (ms): " + ", ".join(f"{p} {1e3 * t:.1f}" for p, t in by_package.most_common()))
    for own, calls, where in sorted(rows, reverse=True)[:20]:
        print(f"{1e3 * own:8.2f} ms {calls:7d} calls  {where}")


if __name__ == "__main__":
    main()
