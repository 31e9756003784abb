"""Probes of bench_e2e.py's full fine-tune (Llama-3.2-1B shape, batch 4 x 2048, bf16, AdamW) that
decided fk.hf's settings; their output on an H200 is in e2e_probes_h200.txt beside this file.

- ``phases [fk|liger] [budget MiB] [recompute_norms]``: memory by phase of one step (static, after the forward, the
  forward's and backward's peaks) and what autograd saves, by shape;
- ``saved [fk|liger|stock]``: what one forward saves for the backward, by the autograd nodes that
  hold each storage (read from the graph: a custom Function's ``saved_tensors``, a built-in node's
  ``_saved_*`` attributes), largest first: which op keeps which activation;
- ``budgets``: step time and peak memory per fused-loss budget (fk.hf.loss_options with bf16
  accumulation), the settings interleaved over 3 rounds of 5 timed steps on one model;
- ``alternate_budget``: step time and peak memory, default fused loss against the 384 MiB budget
  with bf16 accumulation (fk-lowmem's), the two taking turns every step on one model, 30 steps each;
- ``qkv``, ``add_norm``, ``recompute_norms``: step time with that fk.hf switch off and on,
  interleaved over 4 rounds;
- ``recipe`` after any of ``host``, ``pyprofile``, ``syncs`` (with ``lora``): LoRA as bench_e2e.py's
  ``lora-recipe`` trains it (LoRA dropout 0.05, the forward under bf16 autocast);
- ``host [stock|liger|fk] [lora]``: the host's time to enqueue one forward while the GPU spins on a
  long sleep kernel (so the queue never drains and only the host is timed), then one backward. A
  provider whose forward synchronizes (Liger's loss does) shows the sleep in its time instead;
- ``pyprofile [stock|liger|fk] [lora] [busy] [backward] [rows=N] [callers=TEXT]``: cProfile of one
  forward's host path (GPU asleep; ``busy``: not; ``backward``: and the backward's), by own and by
  cumulative time (N functions each; 28), and the callers of the functions whose names hold TEXT;
- ``clocks [stock|liger|fk] [lora] [lowmem]``: the SM clock, power draw and temperature over 30
  training steps (nvidia-smi every 50 ms);
- ``headstart [stock|liger|fk] [lora] [lowmem]``: the step's wall time when a GPU sleep of 2-20
  ms gives the host a head start, less the sleep: how long the GPU waits for the host, measured
  without instrumenting the step;
- ``timeline [stock|liger|fk] [lora]``: when the host and when the GPU reach each decoder layer,
  the end of the forward, of the backward and of the optimizer step, in ms from a step's start;
- ``syncs [stock|liger|fk] [lora]``: every host synchronization of one training step, with the
  Python frames that caused it;
- ``idle [stock|liger|fk] [lora] [recompute_norms] [lowmem] [by_kernel]``: two training steps under
  torch.profiler (device activity only): per step, the kernels' span, the time some kernel runs,
  and the idle time between kernels by gap size, with the longest gaps, where they fall in the
  step and the kernels on either side, and the idle time per 10 ms of the step; ``lowmem``: with
  fk-lowmem's loss options; ``lora``: on bench_e2e.py's PEFT LoRA model (r=16 on every
  linear layer, fp32 adapters) instead; ``recompute_norms``: fk with that switch on;
  ``by_kernel``: also the first step's GPU time by kernel name; ``around=TEXT``: the kernels on
  either side of each kernel whose name holds TEXT (the first step);
- ``copies [stock|liger|fk]``: one forward+backward under torch.profiler; the GPU time of the
  copy-like ops (cat, copy_, clone, contiguous, sum, add), each with the chain of CPU ops and
  Python frames that launched it and its input shapes, costliest first: where a step moves memory
  without computing.

Run on a GPU:  python benchmarks/experiments/e2e_probes.py budgets
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fk.hf
from fk.hf import training

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_e2e import LOWMEM_LOSS_OPTIONS  # benchmarks/bench_e2e.py

GIB = 2**30


def _lowmem_if_asked(model: Any) -> str:
    """With ``lowmem`` in the arguments, give ``model`` fk-lowmem's loss options (bench_e2e.py's);
    the suffix that names the setting in the output."""
    if "lowmem" not in sys.argv:
        return ""
    fk.hf.loss_options(model, **LOWMEM_LOSS_OPTIONS)
    return " lowmem"


def _recipe() -> bool:
    """With ``recipe`` in the arguments, LoRA as bench_e2e.py's ``lora-recipe`` trains it: LoRA
    dropout (``training.RECIPE_LORA_DROPOUT``) and every forward under bf16 autocast."""
    return "recipe" in sys.argv[2:]


def _casting() -> Any:
    """The forward's autocast under ``recipe``, else nothing."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if _recipe() else contextlib.nullcontext()


def _model(provider: str = "fk", lora: bool = False, recompute: bool = False) -> Any:
    if provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    shape = training.SHAPES["llama-3.2-1b"]
    dropout = training.RECIPE_LORA_DROPOUT if _recipe() else None
    model = training.build_model(shape, dtype=torch.bfloat16, device="cuda", seed=0, max_positions=2048, lora=lora,
                                 lora_dropout=dropout)  # fmt: skip
    if provider == "fk":
        fk.hf.apply(model, recompute_norms=recompute)
    return model


def _steps(model: Any, opt: Any, corpus: Any, steps: int = 7, warmup: int = 2) -> Any:
    autocast = torch.bfloat16 if _recipe() else None
    return training.train(model, corpus, steps=steps, warmup=warmup, batch=4, seq=2048, lr=1e-4, optimizer=opt,
                          autocast=autocast)  # fmt: skip


def phases(provider: str, budget_mib: int, recompute: bool = False) -> None:
    model = _model(provider, recompute=recompute)
    if budget_mib:
        fk.hf.loss_options(model, memory_budget=budget_mib << 20, accum_dtype=torch.bfloat16)
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    _steps(model, opt, corpus, steps=3, warmup=0)
    tokens = corpus.batch(50, 4, 2048).cuda()
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[tuple[int, ...], str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in saved:
            saved[s.data_ptr()] = (tuple(t.shape), str(t.dtype).removeprefix("torch."), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=tokens, labels=tokens).loss
    torch.cuda.synchronize()
    after_fwd, fwd_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated()
    print(f"{provider}{' recompute_norms' if recompute else ''} budget {budget_mib} MiB: static {static / GIB:.3f}  after fwd {after_fwd / GIB:.3f} "
          f"fwd peak {fwd_peak / GIB:.3f}  bwd peak {bwd_peak / GIB:.3f} GiB")  # fmt: skip
    by_shape: collections.Counter[tuple[Any, str]] = collections.Counter()
    count: collections.Counter[tuple[Any, str]] = collections.Counter()
    for shape, dtype, nbytes in saved.values():
        by_shape[(shape, dtype)] += nbytes
        count[(shape, dtype)] += 1
    print(f"saved {sum(by_shape.values()) / GIB:.3f} GiB in {len(saved)} storages")
    for key, nbytes in by_shape.most_common(14):
        print(f"   {nbytes / GIB:7.3f} GiB  x{count[key]:3d}  {key}")


def saved_by_node(provider: str) -> None:
    model, tokens = _trained(provider)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    loss = model(input_ids=tokens, labels=tokens).loss
    holders: dict[int, set[str]] = collections.defaultdict(set)
    info: dict[int, tuple[tuple[int, ...], str, int]] = {}
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack += [n for n, _ in node.next_functions]
        name = type(node).__name__
        tensors: list[Any] = []
        if hasattr(node, "saved_tensors"):
            with contextlib.suppress(RuntimeError):
                tensors += list(node.saved_tensors)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:
                    continue
                tensors += value if isinstance(value, (list, tuple)) else [value]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                ptr = t.untyped_storage().data_ptr()
                if ptr in params:
                    continue
                holders[ptr].add(name)
                info[ptr] = (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.untyped_storage().nbytes())
    groups: collections.Counter[tuple[Any, ...]] = collections.Counter()
    count: collections.Counter[tuple[Any, ...]] = collections.Counter()
    for ptr, names in holders.items():
        _shape, dtype, nbytes = info[ptr]
        key = (nbytes, dtype, " + ".join(sorted(names)))
        groups[key] += nbytes
        count[key] += 1
    print(f"{provider}: saved {sum(groups.values()) / GIB:.3f} GiB in {len(holders)} storages (parameters aside)")
    for (nbytes, dtype, names), total in groups.most_common(30):
        print(
            f"   {total / GIB:7.3f} GiB  x{count[(nbytes, dtype, names)]:3d} of {nbytes / 2**20:8.2f} MiB {dtype:9s} {names}"
        )


def interleaved(settings: dict[str, Any], rounds: int) -> None:
    """``settings``: name -> function that sets them on the model."""
    model = _model()
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    times: dict[str, list[float]] = {name: [] for name in settings}
    peaks: dict[str, float] = {}
    for _ in range(rounds):
        for name, apply in settings.items():
            apply(model)
            run = _steps(model, opt, corpus)
            times[name] += run.step_seconds[run.warmup :]
            peaks[name] = run.peak_bytes / GIB
    for name, t in times.items():
        print(f"{name:12s} median {statistics.median(t) * 1e3:.2f} ms  mean {statistics.mean(t) * 1e3:.2f}  "
              f"min {min(t) * 1e3:.2f}  n={len(t)}  peak {peaks[name]:.3f} GiB")  # fmt: skip


def alternate(settings: dict[str, Any], steps: int, warmup: int = 2) -> None:
    """Like :func:`interleaved`, but the settings take turns every step: ``warmup`` untimed turns,
    then ``steps`` timed steps of each (each step's own peak memory)."""
    model = _model()
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    times: dict[str, list[float]] = {name: [] for name in settings}
    peaks: dict[str, float] = {name: 0.0 for name in settings}
    for turn in range(warmup + steps):
        for name, apply in settings.items():
            apply(model)
            run = training.train(model, corpus, steps=1, batch=4, seq=2048, lr=1e-4, optimizer=opt, first_step=turn)
            if turn >= warmup:
                times[name] += run.step_seconds
                peaks[name] = max(peaks[name], run.peak_bytes / GIB)
    for name, t in times.items():
        print(f"{name:12s} median {statistics.median(t) * 1e3:.2f} ms  mean {statistics.mean(t) * 1e3:.2f}  "
              f"min {min(t) * 1e3:.2f}  n={len(t)}  peak {peaks[name]:.3f} GiB")  # fmt: skip


def _trained(provider: str, lora: bool = False, recompute: bool = False) -> tuple[Any, torch.Tensor]:
    """The provider's model after 3 training steps, and a batch of 4 x 2048 tokens for it."""
    model = _model(provider, lora, recompute)
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    _steps(model, opt, corpus, steps=3, warmup=0)
    return model, corpus.batch(7, 4, 2048).cuda()


def host(provider: str, lora: bool = False) -> None:
    model, tokens = _trained(provider, lora)
    forward, backward = [], []
    for _ in range(6):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3e9))  # about two seconds of GPU time: the queue stays full
        start = time.perf_counter()
        with _casting():
            loss = model(input_ids=tokens, labels=tokens).loss
        middle = time.perf_counter()
        loss.backward()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        del loss
    print(f"{provider}{' lora' if lora else ''}{' recipe' if _recipe() else ''}: host time to enqueue the forward {statistics.median(forward) * 1e3:.1f} ms, "
          f"the backward {statistics.median(backward) * 1e3:.1f} ms (medians of 6)")  # fmt: skip


def pyprofile(provider: str, lora: bool = False) -> None:
    """cProfile of one forward's host path, the GPU asleep (as in :func:`host`): the Python
    functions by own time and by cumulative time. With ``busy`` in the arguments, the GPU is not put
    to sleep: the forward runs as in training, its kernels running while the host launches more;
    with ``backward``, the backward is profiled too; ``rows=N``: N functions a list (28);
    ``callers=TEXT``: also the callers of each function whose name holds TEXT, with their calls."""
    import cProfile
    import io
    import pstats

    model, tokens = _trained(provider, lora)
    torch.cuda.synchronize()
    if "busy" not in sys.argv:
        torch.cuda._sleep(int(3e9))
    profiler = cProfile.Profile()
    profiler.enable()
    with _casting():
        loss = model(input_ids=tokens, labels=tokens).loss
    if "backward" in sys.argv[3:]:
        loss.backward()
    profiler.disable()
    torch.cuda.synchronize()
    del loss
    rows = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("rows=")), 28))
    callers = [a.split("=", 1)[1] for a in sys.argv if a.startswith("callers=")]
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(rows)
        print("\n".join(line[:160] for line in out.getvalue().splitlines() if line.strip()))
    for text in callers:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_callers(text)
        print("\n".join(line[:200] for line in out.getvalue().splitlines() if line.strip()))


def syncs(provider: str, lora: bool = False) -> None:
    """Every host synchronization of one training step (forward, backward, optimizer step), as
    ``torch.cuda.set_sync_debug_mode("warn")`` reports them, with the Python frames that asked for
    each (the last ones outside torch's own files)."""
    import traceback
    import warnings

    model, tokens = _trained(provider, lora)
    opt = training.make_optimizer(model, 1e-4)
    torch.cuda.synchronize()
    found: list[tuple[str, list[str]]] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [
            f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
        ]
        found.append((str(message).splitlines()[0][:100], [f for f in frames if "/torch/" not in f][-4:]))

    def forward() -> Any:
        with _casting():
            return model(input_ids=tokens, labels=tokens).loss

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for phase, run in (("forward", forward), ("backward", None)):
                if phase == "forward":
                    loss = run()
                    print(f"forward: {len(found)} synchronizations")
                else:
                    before = len(found)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    print(f"backward and optimizer step: {len(found) - before} synchronizations")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for message, frames in found:
        print(f"  {message}")
        for frame in frames:
            print(f"      {frame}")


def timeline(provider: str, lora: bool = False) -> None:
    """When the host reaches each decoder layer's forward, the loss, the backward and the optimizer
    step, against when the GPU reaches the same point (a CUDA event recorded there), in ms from the
    step's start, for 3 training steps (the last is printed in full). Where the GPU's time is the
    host's plus only the launch latency, the GPU waited for the host (host-bound)."""
    model, tokens = _trained(provider, lora)
    opt = training.make_optimizer(model, 1e-4)
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, time.perf_counter(), event))

    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: mark(f"layer {i}"))
    for step in range(3):
        marks.clear()
        torch.cuda.synchronize()
        mark("start")
        loss = model(input_ids=tokens, labels=tokens).loss
        mark("forward returned")
        loss.backward()
        mark("backward returned")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer returned")
        torch.cuda.synchronize()
        t0, e0 = marks[0][1], marks[0][2]
        rows = [(name, (t - t0) * 1e3, e0.elapsed_time(e)) for name, t, e in marks]
        print(f"{provider} step {step}: host {rows[-1][1]:.1f} ms, GPU {rows[-1][2]:.1f} ms to the optimizer's return")
        if step == 2:
            for name, host_ms, gpu_ms in rows:
                print(
                    f"   {name:20s} host {host_ms:7.2f} ms   GPU {gpu_ms:7.2f} ms   GPU - host {gpu_ms - host_ms:7.2f}"
                )


def headstart(provider: str, lora: bool = False) -> None:
    """How much of a step the GPU spends waiting for the host, measured without instrumenting it:
    each step starts with a GPU sleep of X ms (X = 0, 2, 5, 10, 20; the settings take turns, 12
    steps each), during which the host enqueues the step's work. Wall time minus X, against X = 0:
    the time the host's lead saves, which a faster host path would save too."""
    model, tokens = _trained(provider, lora)
    name = provider + _lowmem_if_asked(model)
    opt = training.make_optimizer(model, 1e-4)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(1e8))
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = 1e8 / start.elapsed_time(end)
    leads = (0, 2, 5, 10, 20)
    times: dict[int, list[float]] = {lead: [] for lead in leads}
    for turn in range(14):
        for lead in leads:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if lead:
                torch.cuda._sleep(int(lead * cycles_per_ms))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            torch.cuda.synchronize()
            if turn >= 2:
                times[lead].append((time.perf_counter() - t0) * 1e3 - lead)
    base = statistics.median(times[0])
    for lead in leads:
        t = statistics.median(times[lead])
        print(f"{name}: GPU sleep {lead:2d} ms first: step minus the "
              f"sleep {t:7.2f} ms (median of {len(times[lead])}), {base - t:5.2f} ms less than without")  # fmt: skip


def clocks(provider: str, lora: bool = False) -> None:
    """The GPU's SM clock, power draw and temperature while it trains: ``nvidia-smi`` sampled every
    50 ms over 30 steps (after the 3 of ``_trained`` and 5 more), medians and the range."""
    import subprocess

    model, _ = _trained(provider, lora)
    name = provider + _lowmem_if_asked(model)
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    _steps(model, opt, corpus, steps=5, warmup=0)
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"]
    sampler = subprocess.Popen([*query, "-lms", "50"], stdout=subprocess.PIPE, text=True)
    try:
        run = _steps(model, opt, corpus, steps=30, warmup=0)
    finally:
        sampler.terminate()
    samples = [[float(v) for v in line.split(",")] for line in sampler.communicate()[0].splitlines() if line.strip()]
    print(f"{name}: median step {statistics.median(run.step_seconds) * 1e3:.2f} ms; {len(samples)} samples:", end="")
    for i, what in enumerate(("SM MHz", "W", "C")):
        values = sorted(s[i] for s in samples)
        print(f"  {what} {statistics.median(values):.0f} ({values[0]:.0f}-{values[-1]:.0f})", end="")
    print()


GAP_BUCKETS_US = (2.0, 5.0, 20.0, 100.0, float("inf"))


def idle(provider: str, lora: bool = False, recompute: bool = False) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = _model(provider, lora, recompute)
    _lowmem_if_asked(model)
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    opt = training.make_optimizer(model, 1e-4)
    _steps(model, opt, corpus, steps=4, warmup=0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run = training.train(model, corpus, steps=2, batch=4, seq=2048, lr=1e-4, optimizer=opt, first_step=100)
    print(
        f"{provider}{' lora' if lora else ''}{' recompute_norms' if recompute else ''}: profiled steps {[round(t * 1e3, 1) for t in run.step_seconds]} ms wall"
    )
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:50]) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Optimizer."))  # fmt: skip
    # The two steps are split at the longest gap (the host's synchronization between them).
    gaps = [(spans[i + 1][0] - max(s[1] for s in spans[: i + 1]), i) for i in range(len(spans) - 1)]
    split = max(gaps)[1] + 1
    for step, kernels in enumerate((spans[:split], spans[split:])):
        begin, busy_until, busy = kernels[0][0], kernels[0][1], kernels[0][1] - kernels[0][0]
        buckets = collections.Counter[float]()
        counts = collections.Counter[float]()
        long_gaps = []
        by_window = collections.Counter[int]()  # idle per 10 ms of the step, by where the gap starts
        before = kernels[0][2]
        for start, end, name in kernels[1:]:
            gap = start - busy_until
            if gap > 0:
                bucket = next(b for b in GAP_BUCKETS_US if gap < b)
                buckets[bucket] += gap
                counts[bucket] += 1
                by_window[int((busy_until - begin) // 10_000)] += gap
                if gap >= 100:
                    long_gaps.append((gap, (start - begin) / 1e3, before, name))
            busy += max(0.0, end - max(start, busy_until))
            if end > busy_until:
                busy_until, before = end, name
        span = busy_until - begin
        print(f"step {step}: {len(kernels)} kernels, first to last {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
              f"idle {(span - busy) / 1e3:.2f} ms")  # fmt: skip
        low = 0.0
        for b in GAP_BUCKETS_US:
            print(f"   gaps {low:5.0f}-{b:<5.0f} us: {counts[b]:5d}, {buckets[b] / 1e3:6.2f} ms")
            low = b
        print(
            "   idle by 10 ms of the step (ms): "
            + " ".join(f"{by_window[w] / 1e3:.2f}" for w in range(max(by_window) + 1))
        )
        for gap, at, before, after in sorted(long_gaps, reverse=True)[:12]:
            print(f"   {gap / 1e3:6.3f} ms idle at {at:7.2f} ms  after {before}  before {after}")
        around = [a.split("=", 1)[1] for a in sys.argv if a.startswith("around=")]
        if step == 0 and around:  # the kernels on either side of each kernel whose name has that text
            sides = collections.Counter[tuple[str, str]]()
            for i, (_, _, name) in enumerate(kernels):
                if around[0] in name and 0 < i < len(kernels) - 1:
                    sides[(kernels[i - 1][2], kernels[i + 1][2])] += 1
            for (before, after), n in sides.most_common(10):
                print(f"   x{n:3d}  after {before}  before {after}")
        if step == 0 and "by_kernel" in sys.argv:
            by_name, n_of = collections.Counter[str](), collections.Counter[str]()
            for start, end, name in kernels:
                by_name[name] += end - start
                n_of[name] += 1
            for name, total in by_name.most_common(40):
                print(f"   {total / 1e3:8.3f} ms  x{n_of[name]:4d}  {name}")


COPY_OPS = ("aten::cat", "aten::copy_", "aten::clone", "aten::contiguous", "aten::sum", "aten::add", "aten::add_")


def copies(provider: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    model, tokens = _trained(provider)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, record_shapes=True) as prof:
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.cuda.synchronize()
    found: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.name not in COPY_OPS or event.device_time_total <= 0:
            continue
        if event.cpu_parent is not None and event.cpu_parent.name in COPY_OPS:
            continue  # (counted with its parent: clone -> copy_)
        chain, parent = [], event.cpu_parent
        while parent is not None and len(chain) < 3:
            chain.append(parent.name)
            parent = parent.cpu_parent
        frames = [f for f in event.stack if "torch/nn/modules/module.py" not in f][:4]
        where = " <- ".join(chain + frames) or f"(no parent op or Python frame; thread {event.thread})"
        found[(event.name, where, str(event.input_shapes))].append(event.device_time_total)
    rows = sorted(found.items(), key=lambda kv: -sum(kv[1]))
    total = sum(sum(t) for _, t in rows)
    print(f"{provider}: copy-like ops {total / 1e3:.2f} ms of GPU time in one forward+backward")
    for (name, where, shapes), times in rows[:25]:
        print(f"{sum(times) / 1e3:7.3f} ms  x{len(times):3d}  {name}  {shapes[:90]}")
        print(f"           {where[:260]}")


def main() -> None:
    what = sys.argv[1]
    if what == "phases":
        budget = int(sys.argv[3]) if len(sys.argv) > 3 else 0
        phases(sys.argv[2] if len(sys.argv) > 2 else "fk", budget, "recompute_norms" in sys.argv[4:])
    elif what == "saved":
        saved_by_node(sys.argv[2] if len(sys.argv) > 2 else "fk")
    elif what == "budgets":
        options = {"default": {}, **{f"{mib} MiB": {"memory_budget": mib << 20, "accum_dtype": torch.bfloat16}
                                     for mib in (512, 384, 256)}}  # fmt: skip
        interleaved({k: lambda m, o=o: fk.hf.loss_options(m, **o) for k, o in options.items()}, rounds=3)
    elif what == "alternate_budget":
        options = {"default": {}, "384 MiB": LOWMEM_LOSS_OPTIONS}
        alternate({k: lambda m, o=o: fk.hf.loss_options(m, **o) for k, o in options.items()}, steps=30)
    elif what == "clocks":
        clocks(sys.argv[2] if len(sys.argv) > 2 else "fk", "lora" in sys.argv[3:])
    elif what == "headstart":
        headstart(sys.argv[2] if len(sys.argv) > 2 else "fk", "lora" in sys.argv[3:])
    elif what == "timeline":
        timeline(sys.argv[2] if len(sys.argv) > 2 else "fk", "lora" in sys.argv[3:])
    elif what == "syncs":
        syncs(sys.argv[2] if len(sys.argv) > 2 else "fk", "lora" in sys.argv[3:])
    elif what == "host":
        host(sys.argv[2], "lora" in sys.argv[3:])
    elif what == "pyprofile":
        pyprofile(sys.argv[2], "lora" in sys.argv[3:])
    elif what == "idle":
        idle(sys.argv[2] if len(sys.argv) > 2 else "fk", "lora" in sys.argv[3:], "recompute_norms" in sys.argv[3:])
    elif what == "copies":
        copies(sys.argv[2] if len(sys.argv) > 2 else "fk")
    elif what in ("qkv", "add_norm", "recompute_norms"):
        switch = what
        interleaved(
            {f"{switch}={on}": lambda m, on=on: fk.hf.apply(m, **{switch: on}) for on in (False, True)}, rounds=4
        )
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
