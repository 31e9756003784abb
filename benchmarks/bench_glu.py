"""SwiGLU and GeGLU side by side: fk, Liger Kernel, torch.compile of the eager code, and eager PyTorch.

tokens in {4096, 16384} x intermediate 14336, bf16, gate and up as two leaf tensors that require
grad; forward and forward+backward time, bandwidth against the device-to-device copy ceiling
measured in the same run, and peak memory. Bytes counted (the minimum any implementation must
move), with T = tokens * intermediate * 2 bytes (one bf16 tensor):

- forward: reads gate and up, writes the output: 3 T;
- forward+backward: the forward, then the backward reads gate, up and dy and writes the two
  gradients: 3 T + 5 T = 8 T.

Providers: ``fk`` (gradients in new buffers, as torch does), ``fk inplace`` (``inplace_grad=True``:
gradients written into the buffers of gate and up, as Liger always does), ``fk gate_up`` (one
fused ``[tokens, 2 * intermediate]`` input read as two strided halves), ``liger``
(LigerSiLUMulFunction / LigerGELUMulFunction), ``torch.compile`` and ``eager``
(``F.silu(gate) * up``, ``F.gelu(gate, approximate="tanh") * up``).

Run on a GPU:  python benchmarks/bench_glu.py --out benchmarks/results
Redraw plots:  python benchmarks/bench_glu.py --plot benchmarks/results/glu.json  (into docs/assets/benchmarks)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fk.core import bench
from fk.glu import geglu, geglu_fused, swiglu, swiglu_fused

NAME = "glu"
ACTS = ("swiglu", "geglu")
Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _eager(act: str) -> Fn:
    if act == "swiglu":
        return lambda a, b: F.silu(a) * b  # Hugging Face's LlamaMLP
    return lambda a, b: F.gelu(a, approximate="tanh") * b  # GemmaMLP ("gelu_pytorch_tanh")


def providers(act: str) -> dict[str, Callable[[], Fn]]:
    """Name -> factory of a fresh function of (gate, up) (a fresh torch.compile for each shape)."""
    fk_fn, fk_fused = (swiglu, swiglu_fused) if act == "swiglu" else (geglu, geglu_fused)
    found: dict[str, Callable[[], Fn]] = {
        "fk": lambda: lambda a, b: fk_fn(a, b),
        "fk inplace": lambda: lambda a, b: fk_fn(a, b, inplace_grad=True),
        # Marker: measure() passes one [tokens, 2 * intermediate] tensor as `a` and None as `b`.
        "fk gate_up": lambda: lambda gu, _: fk_fused(gu),
    }
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        # Liger writes the gradients into the buffers of gate and up.
        liger = LigerSiLUMulFunction if act == "swiglu" else LigerGELUMulFunction
        found["liger"] = lambda: lambda a, b: liger.apply(a, b)
    except ImportError:
        print("liger-kernel is not installed: skipping it")
    found["torch.compile"] = lambda: bench.fresh_compile(_eager(act))
    found["eager"] = lambda: _eager(act)
    return found


class _Upstream(torch.autograd.Function):
    """Stands in for the projection whose outputs gate and up are in a model: a non-leaf copy (made
    once, outside the timing) whose backward hands the gradient on unchanged, with no kernel. The
    in-place option refuses leaves (it would write gradients over them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def measure(record: bench.BenchRecord, copy_tbps: float, act: str, name: str, fn: Fn,
            tokens: int, width: int, rep: int) -> None:  # fmt: skip
    """Time one provider at one shape, forward and forward+backward, and add the rows to ``record``."""
    gen = torch.Generator(device="cuda").manual_seed(tokens + width)
    fused = name == "fk gate_up"
    gu = torch.randn(tokens, 2 * width, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    if fused:
        inputs = [gu.requires_grad_()]
        a, b = gu, None
    else:
        a, b = (t.contiguous().requires_grad_() for t in gu.chunk(2, dim=-1))
        inputs = [a, b]
        del gu
        if name == "fk inplace":  # it may not overwrite leaves: give it projection outputs' stand-ins
            a, b = _Upstream.apply(a), _Upstream.apply(b)
    # Sanity: every provider computes the same function (bf16 rounding apart).
    with torch.no_grad():
        gate, up = inputs[0].chunk(2, dim=-1) if fused else (a, b)
        err = (fn(a, b).float() - _eager(act)(gate, up).float()).abs().max().item()  # type: ignore[arg-type]
    if err > 0.1:
        raise AssertionError(f"{name} disagrees with eager ({act}, {tokens} tokens): max error {err}")

    def forward() -> None:
        fn(a, b)  # type: ignore[arg-type]

    def forward_backward() -> None:
        fn(a, b).backward(dy)  # type: ignore[arg-type]

    elements = tokens * width
    for mode, call, nbytes in (("fwd", forward, 3 * 2 * elements), ("fwd+bwd", forward_backward, 8 * 2 * elements)):
        ms = bench.time_ms(call, rep=rep, grad_to_none=inputs)
        gpu_ms = bench.time_ms(call, rep=rep, grad_to_none=inputs, gpu_only=True)
        for t in inputs:
            t.grad = None
        peak = bench.peak_memory_bytes(call)
        for t in inputs:
            t.grad = None
        achieved = bench.tbps(nbytes, ms)
        record.add(
            provider=name, act=act, tokens=tokens, intermediate=width, mode=mode, ms=ms, tbps=achieved,
            copy_fraction=bench.fraction(achieved, copy_tbps), peak_mb=peak / 2**20, gpu_ms=gpu_ms,
            gpu_copy_fraction=bench.fraction(bench.tbps(nbytes, gpu_ms), copy_tbps),
        )  # fmt: skip


def run(tokens: list[int], width: int, out: Path, rep: int) -> bench.BenchRecord:
    record = bench.BenchRecord(
        NAME, notes=f"tokens x {width}, bf16; bytes: fwd 3 tensors, fwd+bwd 8 tensors of tokens x {width} x 2 bytes"
    )
    ceilings = bench.measure_ceilings()
    record.ceilings = ceilings.as_dict()
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    cases = [(act, t, name) for act in ACTS for t in tokens for name in providers(act)]
    for act, t, name in bench.progress(cases, desc=NAME):
        measure(record, ceilings.copy_tbps, act, name, providers(act)[name](), t, width, rep)
        torch.cuda.empty_cache()
    record.to_json(out / f"{NAME}.json")
    return record


PEERS = ("liger", "torch.compile", "eager")


def speedups(record: bench.BenchRecord) -> list[dict[str, object]]:
    """fk against each peer, per (act, tokens, mode): speed ratios (peer ms / fk ms) and memory."""
    table = []
    keys = sorted(
        {(r["act"], r["tokens"], r["mode"]) for r in record.rows}, key=lambda k: (k[0] != "swiglu", k[1], k[2])
    )
    for act, tokens, mode in keys:
        rows = {r["provider"]: r for r in record.rows if (r["act"], r["tokens"], r["mode"]) == (act, tokens, mode)}
        fk = rows["fk"]
        line: dict[str, object] = {"act": act, "tokens": tokens, "mode": mode, "fk ms": fk["ms"],
                                   "fk TB/s": fk["tbps"], "fk copy%": 100 * fk["copy_fraction"]}  # fmt: skip
        if "fk inplace" in rows:
            line["inplace ms"] = rows["fk inplace"]["ms"]
        if "fk gate_up" in rows:
            line["gate_up ms"] = rows["fk gate_up"]["ms"]
        for p in PEERS:
            if p in rows:
                line[f"{p} ms"] = rows[p]["ms"]
                line[f"x {p}"] = rows[p]["ms"] / fk["ms"]
        if "gpu_ms" in fk:  # the GPU work alone (records from before it leave these columns out)
            line["fk GPU ms"], line["fk GPU copy%"] = fk["gpu_ms"], 100 * fk["gpu_copy_fraction"]
            for p in ("liger", "torch.compile"):
                if p in rows:
                    line[f"GPU x {p}"] = rows[p]["gpu_ms"] / fk["gpu_ms"]
        line["fk MB"] = fk["peak_mb"]
        for p in ("fk inplace", "liger", "torch.compile"):
            if p in rows:
                line[f"{p.removeprefix('fk ')} MB"] = rows[p]["peak_mb"]
        table.append(line)
    return table


COLUMNS = ["act", "tokens", "mode", "fk ms", "fk TB/s", "fk copy%", "inplace ms", "gate_up ms", "liger ms",
           "torch.compile ms", "eager ms", "x liger", "x torch.compile", "x eager", "fk GPU ms", "fk GPU copy%",
           "GPU x liger", "GPU x torch.compile", "fk MB", "inplace MB", "liger MB", "torch.compile MB"]  # fmt: skip


def summary(record: bench.BenchRecord) -> str:
    """The markdown table for docs/benchmarks.md ("x peer": the peer's time over fk's; "GPU x peer":
    the same of the GPU work alone, ``bench.time_ms(gpu_only=True)``)."""
    return bench.markdown_table(speedups(record), COLUMNS, skip_absent=True)


def plots(record: bench.BenchRecord, out: Path) -> None:
    copy = record.ceilings.get("copy_tbps")
    for act in _acts(record):
        sub = record.subset(act=act)
        width = sub.rows[0]["intermediate"]
        bench.plot(
            sub, x="tokens", y="tbps", facet="mode", logx=True, path=out / f"{NAME}_{act}.png",
            title=f"{act}, tokens x {width}, bf16 ({record.environment.get('gpu')})",
            ylabel="TB/s (bytes counted / time)", hline=copy, hline_label="copy ceiling",
        )  # fmt: skip


def _acts(record: bench.BenchRecord) -> list[str]:
    return [a for a in ACTS if any(r["act"] == a for r in record.rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--rep", type=int, default=100)
    parser.add_argument("--plot", type=Path, help="only redraw the plots from this JSON record")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/assets/benchmarks"))
    args = parser.parse_args()
    if args.plot:
        record = bench.BenchRecord.from_json(args.plot)
        plots(record, args.plot_dir)
    else:
        record = run(args.tokens, args.intermediate, args.out, args.rep)
    print(f"copy ceiling {record.ceilings['copy_tbps']:.2f} TB/s ({record.environment.get('gpu')})")
    print(summary(record))


if __name__ == "__main__":
    main()
