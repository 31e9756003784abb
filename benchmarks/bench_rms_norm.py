"""RMSNorm side by side: fk, Liger Kernel, torch.compile of the eager code, and eager PyTorch.

16384 rows of bf16, H in {1024 ... 32768}, weight trainable and frozen; forward and
forward+backward time, bandwidth against the device-to-device copy ceiling measured in the same
run, and peak memory. Two times per call: ``ms``, what a caller waits (at narrow rows the host
path, Python and kernel launches, outlasts the GPU work and is what it measures, so it varies
with the machine's CPU), and ``gpu_ms``, the GPU work alone (``bench.time_ms(gpu_only=True)``),
which is what a call costs inside a training step whose GPU queue is full. Bytes counted (the
minimum any implementation must move):

- forward: reads x, writes y: 4*M*H bytes (bf16);
- forward+backward: the forward, then the backward reads x and dy and writes dx: 10*M*H bytes.
  (The weight, rstd and the weight gradient are O(H) or O(M) and not counted.)

Run on a GPU:  python benchmarks/bench_rms_norm.py --out benchmarks/results
Redraw plots:  python benchmarks/bench_rms_norm.py --plot benchmarks/results/rms_norm.json
               (PNGs into docs/assets/benchmarks; benchmarks/report.py rebuilds docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from fk.core import bench
from fk.norms import rms_norm, rms_norm_ref

EPS = 1e-6
NAME = "rms_norm"


def _eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm, as written in transformers.
    return rms_norm_ref(x, w, EPS, "llama")


def providers() -> dict[str, Callable[[], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]:
    """Name -> factory of a fresh function (a fresh torch.compile for each shape)."""
    found: dict[str, Callable[[], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
        "fk": lambda: lambda x, w: rms_norm(x, w, EPS),
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # in_place=False, llama casting. (Liger's default, in_place=True, writes dx over dy: a timing
        # loop that reuses dy would then time a copy of dy too, which fk does not pay.)
        found["liger"] = lambda: lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
    except ImportError:
        print("liger-kernel is not installed: skipping it")
    found["torch.compile"] = lambda: bench.fresh_compile(_eager)
    found["eager"] = lambda: _eager
    return found


def measure(record: bench.BenchRecord, copy_tbps: float, name: str, fn: Callable[..., torch.Tensor],
            rows: int, width: int, trainable: bool, rep: int) -> None:  # fmt: skip
    """Time one provider at one shape, forward and forward+backward, and add the rows to ``record``."""
    gen = torch.Generator(device="cuda").manual_seed(width)
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(width, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_(trainable)
    dy = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    # Sanity: every provider computes the same function (bf16 rounding apart).
    with torch.no_grad():
        err = (fn(x, w).float() - _eager(x, w).float()).abs().max().item()
    if err > 0.1:
        raise AssertionError(f"{name} disagrees with eager at H={width}: max error {err}")
    grads = [x, w] if trainable else [x]

    def forward() -> None:
        fn(x, w)

    def forward_backward() -> None:
        fn(x, w).backward(dy)

    for mode, call, nbytes in (("fwd", forward, 4 * rows * width), ("fwd+bwd", forward_backward, 10 * rows * width)):
        ms = bench.time_ms(call, rep=rep, grad_to_none=grads)
        gpu_ms = bench.time_ms(call, rep=rep, grad_to_none=grads, gpu_only=True)
        for t in grads:
            t.grad = None
        peak = bench.peak_memory_bytes(call)
        for t in grads:
            t.grad = None
        achieved = bench.tbps(nbytes, ms)
        record.add(
            provider=name, H=width, rows=rows, weight="trainable" if trainable else "frozen", mode=mode,
            ms=ms, tbps=achieved, copy_fraction=bench.fraction(achieved, copy_tbps), peak_mb=peak / 2**20,
            gpu_ms=gpu_ms, gpu_copy_fraction=bench.fraction(bench.tbps(nbytes, gpu_ms), copy_tbps),
        )  # fmt: skip


def run(rows: int, widths: list[int], out: Path, rep: int) -> bench.BenchRecord:
    record = bench.BenchRecord(NAME, notes=f"{rows} rows, bf16, eps={EPS}, llama casting")
    ceilings = bench.measure_ceilings()
    record.ceilings = ceilings.as_dict()
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    factories = providers()
    cases = [(h, trainable, name) for h in widths for trainable in (True, False) for name in factories]
    for width, trainable, name in bench.progress(cases, desc=NAME):
        measure(record, ceilings.copy_tbps, name, factories[name](), rows, width, trainable, rep)
        torch.cuda.empty_cache()
    record.to_json(out / f"{NAME}.json")
    return record


def speedups(record: bench.BenchRecord) -> list[dict[str, object]]:
    """fk's speedup over the faster of Liger and torch.compile, per (H, weight, mode): of the time a
    caller waits, and of the GPU time alone (records without ``gpu_ms`` leave those columns out)."""
    table = []
    keys = sorted({(r["H"], r["weight"], r["mode"]) for r in record.rows})
    for h, weight, mode in keys:
        times = {r["provider"]: r for r in record.rows if (r["H"], r["weight"], r["mode"]) == (h, weight, mode)}
        peers = [times[p]["ms"] for p in ("liger", "torch.compile") if p in times]
        fk = times["fk"]
        gpu = {}
        if "gpu_ms" in fk:
            gpu_peers = [times[p]["gpu_ms"] for p in ("liger", "torch.compile") if p in times]
            gpu = {"fk GPU ms": fk["gpu_ms"], "fk GPU copy%": 100 * fk["gpu_copy_fraction"],
                   "best peer GPU ms": min(gpu_peers), "GPU speedup": min(gpu_peers) / fk["gpu_ms"]}  # fmt: skip
        table.append(
            {"H": h, "weight": weight, "mode": mode, "fk ms": fk["ms"], "fk TB/s": fk["tbps"],
             "fk copy%": 100 * fk["copy_fraction"], "best peer ms": min(peers),
             "speedup": min(peers) / fk["ms"],
             **{f"{p} ms": times[p]["ms"] for p in ("liger", "torch.compile", "eager") if p in times},
             "fk MB": fk["peak_mb"], **({"liger MB": times["liger"]["peak_mb"]} if "liger" in times else {}), **gpu}
        )  # fmt: skip
    return table


def plots(record: bench.BenchRecord, out: Path) -> None:
    copy = record.ceilings.get("copy_tbps")
    for weight in ("trainable", "frozen"):
        sub = record.subset(weight=weight)
        bench.plot(
            sub, x="H", y="tbps", facet="mode", logx=True, path=out / f"{NAME}_{weight}.png",
            title=f"RMSNorm, {record.rows[0]['rows']} rows, bf16, weight {weight} ({record.environment.get('gpu')})",
            ylabel="TB/s (bytes counted / time)", hline=copy, hline_label="copy ceiling",
        )  # fmt: skip


COLUMNS = ["H", "weight", "mode", "fk ms", "fk TB/s", "fk copy%", "liger ms", "torch.compile ms", "eager ms",
           "speedup", "fk GPU ms", "fk GPU copy%", "best peer GPU ms", "GPU speedup", "fk MB", "liger MB"]  # fmt: skip


def summary(record: bench.BenchRecord) -> str:
    """The markdown table for docs/benchmarks.md ("speedup": over the faster of Liger and torch.compile)."""
    return bench.markdown_table(speedups(record), COLUMNS, skip_absent=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--rep", type=int, default=100)
    parser.add_argument("--plot", type=Path, help="only redraw the plots from this JSON record")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/assets/benchmarks"))
    args = parser.parse_args()
    if args.plot:
        record = bench.BenchRecord.from_json(args.plot)
        plots(record, args.plot_dir)
    else:
        record = run(args.rows, args.widths, args.out, args.rep)
    print(summary(record))


if __name__ == "__main__":
    main()
