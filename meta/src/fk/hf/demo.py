"""The fk demo: a small Llama trained from random init, stock and patched by fk.hf, side by side.

    python -m fk.hf.demo            (or: nox -s demo)
    python -m fk.hf.demo --lora     (a PEFT LoRA model: fk.hf.apply fuses its LoRA layers too)

Builds a Llama-architecture model (transformers' ``LlamaForCausalLM``) from one seed and trains it
on a generated corpus (a random sparse Markov chain: see ``fk.hf.training.MarkovCorpus``; nothing
is downloaded) twice: once stock, once after ``fk.hf.apply(model)``. Same weights, same batches,
same AdamW. It prints the loss of every step of both runs and their largest difference, then
tokens/s and memory of each, draws the two loss curves into a PNG (with matplotlib installed), and
exits with status 1 when the losses differ by more than the dtype's tolerance.

On a GPU: bf16, Llama-3.2-1B's layers and 128256-token vocabulary with 4 layers, 8 x 2048 tokens a
step; memory is CUDA's peak (``torch.cuda.max_memory_allocated``). Without one: a tiny model in
fp32 whose fk kernels run in Triton's interpreter (switched on here, before Triton is imported),
about a minute; the interpreter is a correctness tool, so its tokens/s say nothing about
speed, and memory is the bytes autograd holds for the backward pass (``saved for backward``).

``python -m fk.hf.check`` (``nox -s check``) checks each kernel alone against its reference.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # must happen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fk.hf import training

PROVIDERS = ("stock", "fk")
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 5e-3, torch.float16: 2.5e-2, torch.bfloat16: 5e-2}
"""Largest relative difference between stock's and fk's loss, at any step, that counts as agreeing.

Both runs do the same arithmetic in a different order (fused kernels, fp32 accumulation where stock
rounds to the dtype): each step's loss differs by about one rounding of the dtype, and training
carries the difference on to the next steps' weights. On a GPU fp32 matmuls in Triton may use TF32.
In bf16 the two runs drift apart as the steps go on: on an H200 (the GPU defaults, 50 steps) the
first 40 steps agreed within 3e-4 relative and the last ten within 1.8e-2, the optimizer having
amplified one-rounding differences; hence 5e-2, which a wrong kernel (a loss off by a few percent
from the first step, or a curve that stops falling) still exceeds.
"""


@dataclass(frozen=True)
class Settings:
    """One demo run's sizes (the defaults of :func:`default_settings`, or the command line's)."""

    shape: training.ModelShape
    dtype: torch.dtype
    device: str
    batch: int
    seq: int
    steps: int
    warmup: int
    lr: float
    lora: bool
    active: int
    """How many distinct tokens the corpus uses (see ``MarkovCorpus``)."""
    branching: int


def default_settings(cuda: bool, lora: bool = False) -> Settings:
    """GPU: bf16, the ``demo`` shape, 8 x 2048 tokens, 50 steps; CPU: fp32, ``tiny``, 2 x 32, 20 steps."""
    if cuda:
        return Settings(training.SHAPES["demo"], torch.bfloat16, "cuda", batch=8, seq=2048, steps=50, warmup=5,
                        lr=5e-4, lora=lora, active=1024, branching=4)  # fmt: skip
    return Settings(training.SHAPES["tiny"], torch.float32, "cpu", batch=2, seq=32, steps=20, warmup=2,
                    lr=3e-3, lora=lora, active=32, branching=2)  # fmt: skip


def run_one(provider: str, settings: Settings) -> training.RunResult:
    """Build the model (one seed), patch it for ``provider == "fk"``, train it; frees it afterwards."""
    import fk.hf
    from fk.core import bench

    s = settings
    model = training.build_model(s.shape, dtype=s.dtype, device=s.device, seed=0, lora=s.lora, max_positions=s.seq)
    if provider == "fk":
        counts = fk.hf.apply(model)
        print("fk.hf.apply patched " + ", ".join(f"{n} {k}" for k, n in counts.items() if n), flush=True)
    corpus = training.MarkovCorpus(s.shape.vocab, active=s.active, branching=s.branching)
    result = training.train(
        model, corpus, steps=s.steps, batch=s.batch, seq=s.seq, lr=s.lr, warmup=s.warmup,
        measure_saved=s.device != "cuda", steps_iter=lambda steps: bench.progress(steps, desc=provider),
    )  # fmt: skip
    del model
    gc.collect()
    if s.device == "cuda":
        torch.cuda.empty_cache()
    return result


@dataclass(frozen=True)
class Agreement:
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tolerance


def compare(stock: list[float], fk: list[float], dtype: torch.dtype) -> Agreement:
    """The largest absolute and relative (to stock's) difference of the per-step losses.

    A loss that is not finite in either run, or runs of different length, never agree.
    """
    import math

    if len(stock) != len(fk) or not all(math.isfinite(x) for x in (*stock, *fk)):
        return Agreement(math.inf, math.inf, TOLERANCE[dtype])
    diffs = [abs(a - b) for a, b in zip(stock, fk, strict=True)]
    rel = [d / max(abs(a), 1e-6) for d, a in zip(diffs, stock, strict=True)]
    return Agreement(max(diffs, default=0.0), max(rel, default=0.0), TOLERANCE[dtype])


def loss_table(results: dict[str, training.RunResult], max_rows: int = 30) -> str:
    """Markdown table of the per-step losses (every step up to ``max_rows``, else evenly spaced, last included)."""
    from fk.core import bench

    stock, fk = results["stock"].losses, results["fk"].losses
    n = len(stock)
    every = max(1, -(-n // max_rows))
    steps = sorted({*range(0, n, every), n - 1})
    rows = [{"step": i + 1, "stock loss": stock[i], "fk loss": fk[i], "|fk - stock|": abs(fk[i] - stock[i])}
            for i in steps]  # fmt: skip
    return bench.markdown_table(rows, ["step", "stock loss", "fk loss", "|fk - stock|"])


def summary_table(results: dict[str, training.RunResult], cuda: bool) -> str:
    """Markdown table of tokens/s, memory and final loss of both runs, with fk's over stock's."""
    from fk.core import bench

    stock, fk = results["stock"], results["fk"]
    if cuda:
        assert stock.peak_bytes is not None and fk.peak_bytes is not None
        memory = ("peak memory (GiB, CUDA max allocated)", stock.peak_bytes / 2**30, fk.peak_bytes / 2**30)
    else:
        assert stock.saved_bytes is not None and fk.saved_bytes is not None
        memory = ("saved for backward (MiB; CPU: no CUDA peak)", stock.saved_bytes / 2**20, fk.saved_bytes / 2**20)
    measures = [
        ("tokens/s (median step)", stock.tokens_per_s, fk.tokens_per_s),
        memory,
        ("final loss", stock.losses[-1], fk.losses[-1]),
    ]
    rows = [{"": name, "stock": a, "fk": b, "fk / stock": b / a if a else None} for name, a, b in measures]
    return bench.markdown_table(rows, ["", "stock", "fk", "fk / stock"])


def plot(results: dict[str, training.RunResult], path: Path, title: str) -> Path | None:
    """The two loss curves in one PNG at ``path`` (fk.core.bench's plot); None without matplotlib."""
    from fk.core import bench

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    record = bench.BenchRecord("demo", environment={})
    for provider, result in results.items():
        for step, loss in enumerate(result.losses, start=1):
            record.add(provider=provider, step=step, loss=loss)
    return bench.plot(record, x="step", y="loss", path=path, title=title, ylabel="training loss")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lora", action="store_true", help="a PEFT LoRA model (r=16 on all linear layers)")
    parser.add_argument("--steps", type=int, help="training steps (GPU 50, CPU 20)")
    parser.add_argument("--batch", type=int, help="sequences per step (GPU 8, CPU 2)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (GPU 2048, CPU 32)")
    parser.add_argument("--lr", type=float, help="AdamW learning rate (GPU 5e-4, CPU 3e-3)")
    parser.add_argument("--shape", choices=sorted(training.SHAPES), help="model size (GPU demo, CPU tiny)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="GPU bfloat16, CPU float32")
    parser.add_argument("--plot", type=Path, help="PNG of the loss curves (default fk-demo[-lora].png here)")
    parser.add_argument("--no-plot", action="store_true", help="draw no plot")
    return parser


def settings_from(args: argparse.Namespace, cuda: bool) -> Settings:
    s = default_settings(cuda, args.lora)
    changes: dict[str, Any] = {k: getattr(args, k) for k in ("steps", "batch", "seq", "lr") if getattr(args, k)}
    if args.shape:
        changes["shape"] = training.SHAPES[args.shape]
    if args.dtype:
        changes["dtype"] = getattr(torch, args.dtype)
    from dataclasses import replace

    return replace(s, **changes)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    s = settings_from(args, cuda)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print('the demo trains a transformers model: pip install "fk-hf[hf]" (or transformers)', file=sys.stderr)
        return 2
    if s.lora:
        try:
            training._import_peft()
        except ImportError as exc:
            print(f"--lora: {exc}", file=sys.stderr)
            return 2
    device = torch.cuda.get_device_name() if cuda else "CPU"
    where = device if cuda else "CPU (fk's kernels in Triton's interpreter)"
    kind = "PEFT LoRA (r=16, all linear layers) on " if s.lora else ""
    dtype = str(s.dtype).removeprefix("torch.")
    print(f"fk demo on {where}: {kind}a Llama ({s.shape.describe()}), {dtype}, random init, trained "
          f"{s.steps} steps of {s.batch} x {s.seq} tokens (AdamW, lr {s.lr:g}), stock and with fk.hf.apply", flush=True)  # fmt: skip
    results = {provider: run_one(provider, s) for provider in PROVIDERS}
    print(loss_table(results))
    print()
    print(summary_table(results, cuda))
    if not cuda:
        print(
            "(CPU: fk's kernels ran in Triton's interpreter, a correctness tool; its tokens/s say nothing about speed)"
        )
    agreement = compare(results["stock"].losses, results["fk"].losses, s.dtype)
    if not args.no_plot:
        path = args.plot or Path("fk-demo-lora.png" if s.lora else "fk-demo.png")
        drawn = plot(results, path, f"{'LoRA ' if s.lora else ''}training loss, stock vs fk ({device}, {dtype})")
        print(f"loss curves: {drawn}" if drawn else "matplotlib is not installed: no plot")
    verdict = "agree" if agreement.ok else "DISAGREE"
    print(f"losses {verdict}: max |fk - stock| = {agreement.max_abs:.3g} (relative {agreement.max_rel:.3g}; "
          f"{dtype} tolerance {agreement.tolerance:g})")  # fmt: skip
    return 0 if agreement.ok else 1


if __name__ == "__main__":
    sys.exit(main())
