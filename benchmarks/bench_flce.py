"""Fused linear + cross entropy, and cross entropy on logits, side by side with the peers.

Linear + cross entropy (``--only lce``), bf16, mean reduction, at (tokens, H, V) in
{(8192, 4096, 128256), (16384, 2048, 128256), (8192, 2304, 256000)}, LM head trainable and frozen:
forward+backward time, TFLOP/s against the bf16 matmul ceiling measured in the same run
(6 N H V FLOPs trainable, 4 N H V frozen: the matmuls any implementation must do), and peak memory
above what was allocated before the call (the returned gradients included). Providers: ``fk``
(default memory budget), ``fk low-mem`` (``accum_dtype=bf16``, 256 MiB budget), ``fk min-mem``
(``accum_dtype=bf16``, 64 MiB budget), ``liger``
(LigerFusedLinearCrossEntropyFunction), ``cce`` (cut_cross_entropy.linear_cross_entropy, its
default settings), ``torch.compile`` of the eager code and ``eager``
(``F.cross_entropy(F.linear(h, w).float(), t)``, as Hugging Face's causal-LM loss upcasts).

Cross entropy on logits (``--only ce``), 8192 x 128256 bf16 logits: forward+backward of ``fk``,
``liger`` (LigerCrossEntropyFunction, which writes the gradient into the logits), ``torch.compile``
and ``eager``, in TB/s counting 3 passes over the logits (forward read; backward read and write),
and fk's fused loss+gradient kernel alone (``fk fused pass``: reads the logits and writes the
gradient over them: 2 passes), against the copy ceiling.

Run on a GPU:  python benchmarks/bench_flce.py --out benchmarks/results
Redraw plots:  python benchmarks/bench_flce.py --plot benchmarks/results/flce.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fk.core import bench
from fk.flce import cross_entropy, linear_cross_entropy
from fk.flce.cross_entropy import LossOptions, launch_cross_entropy

NAME = "flce"
SHAPES = ((8192, 4096, 128256), (16384, 2048, 128256), (8192, 2304, 256000))
LceFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _eager_lce(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def lce_providers() -> dict[str, Callable[[], LceFn]]:
    found: dict[str, Callable[[], LceFn]] = {
        "fk": lambda: lambda h, w, t: linear_cross_entropy(h, w, t),
        "fk low-mem": lambda: (
            lambda h, w, t: linear_cross_entropy(h, w, t, accum_dtype=w.dtype, memory_budget=256 * 2**20)
        ),
        "fk min-mem": lambda: (
            lambda h, w, t: linear_cross_entropy(h, w, t, accum_dtype=w.dtype, memory_budget=64 * 2**20)
        ),
    }
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as Liger

        found["liger"] = lambda: lambda h, w, t: _first(Liger.apply(h, w, t))
    except ImportError:
        print("liger-kernel is not installed: skipping it")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        found["cce"] = lambda: lambda h, w, t: cce(h, w, t)
    except ImportError:
        print("cut-cross-entropy is not installed: skipping it")
    found["torch.compile"] = lambda: torch.compile(_eager_lce, dynamic=False)
    found["eager"] = lambda: _eager_lce
    return found


def measure_lce(record: bench.BenchRecord, matmul_tflops: float, name: str, fn: LceFn,
                shape: tuple[int, int, int], frozen: bool, rep: int) -> None:  # fmt: skip
    tokens, hidden, vocab = shape
    gen = torch.Generator(device="cuda").manual_seed(tokens + hidden + vocab)
    h = (torch.randn(tokens, hidden, device="cuda", generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * hidden**-0.5).to(torch.bfloat16)
    w.requires_grad_(not frozen)
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    t[::17] = -100
    # Sanity check with grad enabled, as timed: a no_grad call would make torch.compile recompile.
    err = abs(fn(h, w, t).float().item() - _eager_lce(h, w, t).item())
    for x in (h, w):
        x.grad = None
    if err > 2e-2:
        raise AssertionError(f"{name} disagrees with eager at {shape}: loss error {err}")
    inputs = [h] if frozen else [h, w]

    def forward_backward() -> None:
        fn(h, w, t).backward()

    ms = bench.time_ms(forward_backward, warmup=3, rep=rep, grad_to_none=inputs)
    for x in inputs:
        x.grad = None
    peak = bench.peak_memory_bytes(forward_backward)
    for x in inputs:
        x.grad = None
    flops = (4 if frozen else 6) * tokens * hidden * vocab
    achieved = bench.tflops(flops, ms)
    record.add(
        kind="lce", provider=name, tokens=tokens, hidden=hidden, vocab=vocab, weight="frozen" if frozen else "trainable",
        ms=ms, tflops=achieved, matmul_fraction=bench.fraction(achieved, matmul_tflops), peak_mb=peak / 2**20,
    )  # fmt: skip


def measure_ce(record: bench.BenchRecord, copy_tbps: float, tokens: int, vocab: int, rep: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens + vocab)
    logits = torch.randn(tokens, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    t[::17] = -100
    nbytes = logits.numel() * logits.element_size()

    def eager(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float(), y)

    cases: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"fk": cross_entropy}
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        cases["liger"] = lambda x, y: _first(LigerCrossEntropyFunction.apply(x, y, None))
    except ImportError:
        pass
    cases["torch.compile"] = torch.compile(eager, dynamic=False)
    cases["eager"] = eager
    for name, fn in cases.items():
        # Liger writes the gradient over its input: later calls then run on those values, which
        # costs the same time.
        x = logits.clone()

        def forward_backward(fn: Any = fn, x: torch.Tensor = x) -> None:
            fn(x.detach().requires_grad_(), t).backward()

        ms = bench.time_ms(forward_backward, rep=rep)
        peak = bench.peak_memory_bytes(forward_backward)
        achieved = bench.tbps(3 * nbytes, ms)
        record.add(kind="ce", provider=name, tokens=tokens, vocab=vocab, ms=ms, tbps=achieved,
                   copy_fraction=bench.fraction(achieved, copy_tbps), peak_mb=peak / 2**20)  # fmt: skip
    # fk's fused pass alone: loss, lse and the gradient written over the logits.
    lse = torch.empty(tokens, device="cuda")
    loss = torch.empty(tokens, device="cuda")
    scale = torch.ones(1, device="cuda")
    work = logits.clone()
    options = LossOptions(-100, 0.0, 0.0, 0.0)
    ms = bench.time_ms(lambda: launch_cross_entropy(work, t, None, None, options, lse=lse, loss=loss, grad=work,
                                                    grad_scale=scale), rep=rep)  # fmt: skip
    achieved = bench.tbps(2 * nbytes, ms)
    record.add(kind="ce", provider="fk fused pass", tokens=tokens, vocab=vocab, ms=ms, tbps=achieved,
               copy_fraction=bench.fraction(achieved, copy_tbps), peak_mb=0.0)  # fmt: skip


def run(only: str | None, out: Path, rep: int) -> bench.BenchRecord:
    record = bench.BenchRecord(NAME, notes="bf16; lce: FLOPs 6NHV trainable, 4NHV frozen; ce: 3 passes over logits")
    ceilings = bench.measure_ceilings()
    record.ceilings = ceilings.as_dict()
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    if only in (None, "ce"):
        measure_ce(record, ceilings.copy_tbps, 8192, 128256, rep)
    if only in (None, "lce"):
        cases = [(s, frozen, name) for s in SHAPES for frozen in (False, True) for name in lce_providers()]
        for shape, frozen, name in bench.progress(cases, desc=NAME):
            torch._dynamo.reset()  # a fresh compile for each case, never the recompile limit
            measure_lce(record, ceilings.matmul_tflops, name, lce_providers()[name](), shape, frozen, rep)
            torch.cuda.empty_cache()
    record.to_json(out / f"{NAME}.json")
    return record


LCE_PEERS = ("cce", "liger", "torch.compile", "eager")


def lce_table(record: bench.BenchRecord) -> list[dict[str, object]]:
    table = []
    rows_all = [r for r in record.rows if r["kind"] == "lce"]
    keys = sorted({(r["tokens"], r["hidden"], r["vocab"], r["weight"]) for r in rows_all},
                  key=lambda k: (SHAPES.index(k[:3]) if k[:3] in SHAPES else 99, k[3] != "trainable"))  # fmt: skip
    for key in keys:
        rows = {r["provider"]: r for r in rows_all if (r["tokens"], r["hidden"], r["vocab"], r["weight"]) == key}
        fk = rows["fk"]
        line: dict[str, object] = {"N, H, V": f"{key[0]}, {key[1]}, {key[2]}", "weight": key[3], "fk ms": fk["ms"],
                                   "fk TFLOP/s": fk["tflops"], "fk matmul%": 100 * fk["matmul_fraction"]}  # fmt: skip
        for p in LCE_PEERS:
            if p in rows:
                line[f"x {p}"] = rows[p]["ms"] / fk["ms"]
        line["fk MB"] = fk["peak_mb"]
        for p in ("fk low-mem", "fk min-mem", *LCE_PEERS):
            if p in rows:
                line[f"{p} MB"] = rows[p]["peak_mb"]
        for p in ("fk low-mem", "fk min-mem"):
            if p in rows:
                line[f"{p.removeprefix('fk ')} ms"] = rows[p]["ms"]
        table.append(line)
    return table


LCE_COLUMNS = ["N, H, V", "weight", "fk ms", "fk TFLOP/s", "fk matmul%", "x cce", "x liger", "x torch.compile",
               "x eager", "low-mem ms", "min-mem ms", "fk MB", "fk low-mem MB", "fk min-mem MB", "cce MB", "liger MB", "torch.compile MB",
               "eager MB"]  # fmt: skip
CE_COLUMNS = ["provider", "tokens", "vocab", "ms", "tbps", "copy_fraction", "peak_mb"]


def summary(record: bench.BenchRecord) -> str:
    """Markdown for docs/benchmarks.md ("x peer": the peer's time over fk's)."""
    parts = []
    lce = lce_table(record)
    if lce:
        parts.append(bench.markdown_table(lce, LCE_COLUMNS))
    ce = [r for r in record.rows if r["kind"] == "ce"]
    if ce:
        parts.append(bench.markdown_table(ce, CE_COLUMNS))
    return "\n\n".join(parts)


def plots(record: bench.BenchRecord, out: Path) -> None:
    lce = record.subset(kind="lce")
    if lce.rows:
        for row in lce.rows:
            row["shape"] = f"{row['tokens']}x{row['hidden']}x{row['vocab']}"
        bench.plot(
            lce, x="shape", y="tflops", facet="weight", path=out / f"{NAME}_lce.png",
            title=f"linear + cross entropy, bf16 ({record.environment.get('gpu')})",
            ylabel="TFLOP/s (matmul FLOPs / time)", hline=record.ceilings.get("matmul_tflops"),
            hline_label="bf16 matmul ceiling",
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", choices=("ce", "lce"))
    parser.add_argument("--rep", type=int, default=10)
    parser.add_argument("--plot", type=Path, help="only redraw the plots from this JSON record")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/assets/benchmarks"))
    args = parser.parse_args()
    if args.plot:
        record = bench.BenchRecord.from_json(args.plot)
        plots(record, args.plot_dir)
    else:
        record = run(args.only, args.out, args.rep)
    print(summary(record))


if __name__ == "__main__":
    main()
