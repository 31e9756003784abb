"""How much host work does one ZeRO-3 training step of a Llama make, stock against fk.hf-patched?
(bench_memory's throughput step on 2 GPUs is bound by the host and the all-gathers, and fk's step with
next to no compute ran 40-50 ms longer than stock's: INDEX.md#zero3_step_floor.) Python function
calls of a step (cProfile's primitive calls) by the package that defines them. CPU: 2 processes over
gloo, DeepSpeed's CPU accelerator, a Llama of the 1B shape's structure (16 layers, tied head) at tiny
width, fp32, fk's kernels in Triton's interpreter (its calls counted apart: on a GPU a launch is
one call); counts, not times.

Run on a CPU:  TRITON_INTERPRET=1 python benchmarks/experiments/zero3_host_calls.py
"""

from __future__ import annotations

import collections
import cProfile
import json
import os
import pstats
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 2


def _python_calls(profile: cProfile.Profile) -> dict[str, int]:
    """Python function calls of a profiled step by the package that defines the function."""
    calls: collections.Counter = collections.Counter()
    for (filename, _, _), (_, primitive, *_rest) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        for package in ("deepspeed", "fk", "transformers", "triton", "torch"):
            if f"/{package}/" in filename:
                calls[package] += primitive
                break
        else:
            calls["other"] += primitive
    return dict(calls)


def worker(rank: int, world: int, init_file: str, provider: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="29533"
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import transformers

    import fk.hf

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=16, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if provider == "fk":
        fk.hf.apply(model)
    ds = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
    }  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    per_step = []
    for _ in range(STEPS + 1):
        profile = cProfile.Profile()
        profile.enable()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        profile.disable()
        per_step.append(_python_calls(profile))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(per_step[1:], f)  # the first step builds DeepSpeed's trace of the modules
    dist.destroy_process_group()


def main() -> None:
    results = {}
    for provider in ("stock", "fk"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(worker, args=(2, os.path.join(tmp, "init"), provider, out), nprocs=2)
            with open(out) as f:
                results[provider] = json.load(f)
    for provider, steps in results.items():
        for i, step in enumerate(steps):
            print(f"{provider:6} step {i + 2}: Python calls by package {step}")


if __name__ == "__main__":
    sys.exit(main())
