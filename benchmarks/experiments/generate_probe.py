"""Why is fk-patched generation slower than stock's and Liger's in bench_align_e2e.py's GRPO steps?

GRPO's steps there are ~90% ``model.generate`` (16 completions of 128 tokens after an 896-token
prompt, the Llama-3.2-1B shape): one decode step is 16 rows through 16 layers, so its time is the
host's. For stock, fk (``fk.hf.apply``) and Liger (``_apply_liger_kernel_to_instance``, as TRL's
``use_liger_kernel``), each on a fresh model in training mode under ``torch.no_grad`` (as TRL
generates), this prints:

- ``generate``: ms of the whole call (prefill and 128 decode steps), best of 2;
- ``decode``: one decode step's host time to enqueue (no synchronization) and its wall time
  (synchronized), median of 20, and whether it synchronizes (``torch.cuda.set_sync_debug_mode``);
- the profiler's top host ops of 5 decode steps by self CPU time, and kernels launched a step.

Run on a GPU:  python benchmarks/experiments/generate_probe.py
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

import fk.hf
from fk.hf.training import SHAPES, build_model

PROMPT, NEW, ROWS = 896, 128, 16


def _model(provider: str) -> torch.nn.Module:
    model = build_model(SHAPES["llama-3.2-1b"], dtype=torch.bfloat16, device="cuda")
    if provider == "fk":
        fk.hf.apply(model)
    elif provider == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    return model.train()


def _decode_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, int]:
    """(host ms to enqueue, wall ms, synchronizations) of one decode step after a cached prefill."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    enqueue, wall, syncs = [], [], 0
    for _ in range(20):
        mask = torch.cat([mask, mask[:, :1]], dim=1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
            torch.cuda.set_sync_debug_mode("default")
        enqueue.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        syncs = max(syncs, sum("synchronizing" in str(w.message) for w in caught))
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(enqueue) * 1e3, statistics.median(wall) * 1e3, syncs


def _profile(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> str:
    from torch.profiler import ProfilerActivity, profile

    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            mask = torch.cat([mask, mask[:, :1]], dim=1)
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    table = events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
    return f"kernel launches a decode step: {launches / 5:.0f}\n{table}"


def main() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, SHAPES["llama-3.2-1b"].vocab, (ROWS, PROMPT), device="cuda")
    mask = torch.ones_like(ids)
    for provider in ("stock", "fk", "liger"):
        try:
            model = _model(provider)
        except ImportError as error:
            print(f"== {provider}: not installed ({error})")
            continue
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=True)
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=True)  # fmt: skip
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            enqueue, wall, syncs = _decode_step(model, ids, mask)
            print(f"== {provider}: generate {min(times):.0f} ms; decode step: enqueue {enqueue:.2f} ms, "
                  f"wall {wall:.2f} ms, synchronizations {syncs}; patched {fk.hf.patched_modules(model)}")  # fmt: skip
            print(_profile(model, ids, mask))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
