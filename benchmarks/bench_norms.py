"""Every fk norm side by side: fk, Liger Kernel, torch.compile of the eager code, and native PyTorch.

Ops: RMSNorm, FusedAddRMSNorm, LayerNorm, GroupNorm (32 groups of an (M, H) input), PolyNorm.
M = 16384 rows of bf16, H in {1024 ... 32768}, parameters trainable and frozen; forward and
forward+backward time, bandwidth against the device-to-device copy ceiling measured in the same
run, and peak memory. Bytes counted (the minimum any implementation must move, bf16):

- RMSNorm, LayerNorm, GroupNorm, PolyNorm: forward reads x, writes y (4*M*H bytes); forward+backward
  adds reading x and dy and writing dx (10*M*H bytes in all).
- FusedAddRMSNorm: forward reads x and the residual, writes y and the new residual (8*M*H);
  the backward reads dy, d(residual), the new residual and writes one gradient (16*M*H in all).
  (Parameters, statistics and parameter gradients are O(H) or O(M) and not counted.)

Forward+backward takes the inputs' gradients with ``torch.autograd.grad``, as a layer inside a
model hands them on, not into leaves' ``.grad`` (FusedAddRMSNorm's x and residual get one gradient
tensor; ``.backward()`` would copy it into the second leaf's ``.grad``, two more passes).

Liger Kernel runs with ``in_place=False`` where it has the option (its default writes dx over dy,
which a timing loop that reuses dy would have to pay a copy for). A provider that is not installed,
or an op that Liger 0.8.5 lacks, is recorded as a row with ``status="not available"``.

Two more tables, as LoRA users read them (fk only, and the mixed workload with every provider):

- frozen: RMSNorm alone at M = 2048 tokens, backward and forward+backward with the weight frozen,
  and its speedup over the same call with the weight trainable;
- lora: a frozen RMSNorm followed by a LoRA linear layer (frozen H x H base weight, trainable rank-16
  A and B), forward+backward, with each provider's RMSNorm.

Run on a GPU:  python benchmarks/bench_norms.py --out benchmarks/results/norms.json   [--quick]
In parts (a whole run takes longer than a 10-minute GPU call), each op with its peers in one call:
               python benchmarks/bench_norms.py --ops rms_norm fused_add_rms_norm --merge
Redraw plots:  python benchmarks/bench_norms.py --plot benchmarks/results/norms.json
               (PNGs into docs/assets/benchmarks; benchmarks/report.py rebuilds docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fk.core import bench
from fk.norms import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    group_norm,
    group_norm_ref,
    layer_norm,
    layer_norm_ref,
    poly_norm,
    poly_norm_ref,
    rms_norm,
    rms_norm_ref,
)

NAME = "norms"
EPS = 1e-6
GROUPS = 32
WIDTHS = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_WIDTHS = [1024, 4096, 32768]
SLOW_CALL_S = 0.1
SLOW_REP = 3
LORA_RANK = 16

Fn = Callable[..., Any]


class Op(NamedTuple):
    """One normalization: how to build its inputs, and each provider's implementation."""

    name: str
    params: tuple[str, ...]  # names of the parameter inputs (weight, bias), after the activations
    n_inputs: int  # activation inputs (1, or 2 for FusedAddRMSNorm)
    fwd_bytes: int  # bytes per element of x (bf16) counted for the forward
    fwd_bwd_bytes: int
    eager: Fn  # the eager PyTorch reference (what torch.compile compiles)
    fk: Fn
    native: Fn | None  # a native PyTorch op, where one exists
    liger: Callable[[], Fn] | None  # factory (imports Liger lazily), None where Liger lacks the op


def _liger_rms() -> Fn:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def _liger_fused_add() -> Fn:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)


def _liger_layer() -> Fn:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)


def _liger_group() -> Fn:
    from liger_kernel.ops.group_norm import LigerGroupNormFunction

    return lambda x, w, b: LigerGroupNormFunction.apply(x, w, b, x.shape[1], GROUPS, EPS)


def _liger_poly() -> Fn:
    from liger_kernel.ops.poly_norm import LigerPolyNormFunction

    return lambda x, w, b: LigerPolyNormFunction.apply(x, w, b, EPS, False)


def _native_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, x.shape[-1:], w, EPS)


def _native_fused_add(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + r
    return torch.nn.functional.rms_norm(s, s.shape[-1:], w, EPS), s


OPS = [
    Op("rms_norm", ("weight",), 1, 4, 10, lambda x, w: rms_norm_ref(x, w, EPS), lambda x, w: rms_norm(x, w, EPS),
       _native_rms, _liger_rms),
    Op("fused_add_rms_norm", ("weight",), 2, 8, 16, lambda x, r, w: fused_add_rms_norm_ref(x, r, w, EPS),
       lambda x, r, w: fused_add_rms_norm(x, r, w, EPS), _native_fused_add, _liger_fused_add),
    Op("layer_norm", ("weight", "bias"), 1, 4, 10, lambda x, w, b: layer_norm_ref(x, w, b, EPS),
       lambda x, w, b: layer_norm(x, w, b, EPS),
       lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS), _liger_layer),
    Op("group_norm", ("weight", "bias"), 1, 4, 10, lambda x, w, b: group_norm_ref(x, GROUPS, w, b, EPS),
       lambda x, w, b: group_norm(x, GROUPS, w, b, EPS),
       lambda x, w, b: torch.nn.functional.group_norm(x, GROUPS, w, b, EPS), _liger_group),
    Op("poly_norm", ("weight", "bias"), 1, 4, 10, lambda x, w, b: poly_norm_ref(x, w, b, EPS),
       lambda x, w, b: poly_norm(x, w, b, EPS), None, _liger_poly),
]  # fmt: skip


def providers(op: Op) -> dict[str, Fn | str]:
    """Provider name -> factory of a fresh function, or the reason it is not available."""
    found: dict[str, Fn | str] = {"fk": lambda: op.fk}
    if op.liger is None:
        found["liger"] = "not available: no such op in Liger Kernel"
    else:
        try:
            op.liger()
            found["liger"] = op.liger
        except ImportError as e:
            found["liger"] = f"not available: {e}"
    found["torch.compile"] = lambda: bench.fresh_compile(op.eager)
    found["native"] = (lambda: op.native) if op.native is not None else "not available: no native PyTorch op"
    return found


def _outputs(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _inputs(op: Op, rows: int, width: int, trainable: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(activations, params) on the GPU; activations require grad, params only when trainable."""
    gen = torch.Generator(device="cuda").manual_seed(width)
    acts = [
        torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(op.n_inputs)
    ]
    if op.name == "poly_norm":
        params = [
            torch.tensor([0.3, 0.3, 0.4], device="cuda"),
            torch.tensor(0.1, device="cuda"),
        ]  # 0-dim bias, as Liger
    else:
        params = [1 + 0.1 * torch.randn(width, device="cuda", generator=gen)]
        if "bias" in op.params:
            params.append(0.1 * torch.randn(width, device="cuda", generator=gen))
    params = [p.to(torch.bfloat16).requires_grad_(trainable) for p in params]
    return acts, params


def measure(record: bench.BenchRecord, copy_tbps: float, op: Op, name: str, fn: Fn, rows: int, width: int,
            trainable: bool, rep: int) -> None:  # fmt: skip
    """Time one provider at one shape, forward and forward+backward, and add the rows to ``record``."""
    acts, params = _inputs(op, rows, width, trainable)
    args = [*acts, *params]
    with torch.no_grad():
        want = _outputs(op.eager(*args))
        got = _outputs(fn(*args))
        err = max((g.float() - e.float()).abs().max().item() for g, e in zip(got, want, strict=True))
    if err > 0.25:
        raise AssertionError(f"{op.name}: {name} disagrees with eager at H={width}: max error {err}")
    del want, got
    grads = [*acts, *params] if trainable else list(acts)
    out_shapes = [o.shape for o in _outputs(op.eager(*[a.detach() for a in acts], *params))]
    dys = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in out_shapes]

    def forward() -> None:
        fn(*args)

    def forward_backward() -> None:
        # torch.autograd.grad, not .backward(): the gradients come back as an inner layer's backward
        # hands them on, without accumulating into .grad. FusedAddRMSNorm returns one tensor as the
        # gradient of both x and the residual; .backward() into two leaves copies it for the second.
        torch.autograd.grad(_outputs(fn(*args)), grads, dys)

    # A provider that takes over SLOW_CALL_S a call (Liger's GroupNorm at these shapes: seconds) gets
    # SLOW_REP repetitions, so that the whole table fits in one run; its median is still a median.
    # The call that decides is the second: the first compiles the backward (Triton's JIT, or
    # torch.compile's), which takes longer than SLOW_CALL_S for every provider.
    forward_backward()
    torch.cuda.synchronize()
    began = time.perf_counter()
    forward_backward()
    torch.cuda.synchronize()
    slow = time.perf_counter() - began > SLOW_CALL_S
    warmup, reps = (0, SLOW_REP) if slow else (5, rep)  # (the calls above warmed it up)
    n = rows * width
    for mode, call, nbytes in (("fwd", forward, op.fwd_bytes * n), ("fwd+bwd", forward_backward, op.fwd_bwd_bytes * n)):
        ms = bench.time_ms(call, warmup=warmup, rep=reps, grad_to_none=grads)
        gpu: dict[str, float] = {}
        try:  # the GPU's work alone
            gpu_ms = bench.time_ms(call, warmup=0, rep=reps, grad_to_none=grads, gpu_only=True)
            gpu = {"gpu_ms": gpu_ms, "gpu_copy_fraction": bench.fraction(bench.tbps(nbytes, gpu_ms), copy_tbps)}
        except RuntimeError as error:  # a host path too long to hide behind the head start
            print(f"{op.name}: {name} H={width} {mode}: no GPU-only time ({error})")
        for t in grads:
            t.grad = None
        peak = bench.peak_memory_bytes(call)
        for t in grads:
            t.grad = None
        achieved = bench.tbps(nbytes, ms)
        record.add(
            table="ops", op=op.name, provider=name, H=width, rows=rows, weight="trainable" if trainable else "frozen",
            mode=mode, ms=ms, tbps=achieved, copy_fraction=bench.fraction(achieved, copy_tbps), peak_mb=peak / 2**20,
            rep=reps, **gpu,
        )  # fmt: skip


def run_ops(record: bench.BenchRecord, copy_tbps: float, rows: int, widths: list[int], rep: int,
            ops: list[str], save: Callable[[], None]) -> None:  # fmt: skip
    for op in OPS:
        if op.name not in ops:
            continue
        found = providers(op)
        for name, factory in found.items():
            if isinstance(factory, str):
                record.add(table="ops", op=op.name, provider=name, status=factory)
                print(f"{op.name}: {name} {factory}")
        cases = [(h, t, n) for h in widths for t in (True, False) for n, f in found.items() if not isinstance(f, str)]
        for width, trainable, name in bench.progress(cases, desc=op.name):
            factory = found[name]
            assert not isinstance(factory, str)
            measure(record, copy_tbps, op, name, factory(), rows, width, trainable, rep)
            torch.cuda.empty_cache()
        save()  # keep what is measured so far if a later op runs out of time


def run_frozen(record: bench.BenchRecord, tokens: int, widths: list[int], rep: int) -> None:
    """fk's RMSNorm alone at ``tokens`` rows: backward and forward+backward, trainable and frozen."""
    for width in bench.progress(widths, desc="frozen"):
        for trainable in (True, False):
            x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=trainable)
            dy = torch.randn_like(x)
            grads = [x, w] if trainable else [x]
            y = rms_norm(x, w, EPS)
            bwd = bench.time_ms(partial(y.backward, dy, retain_graph=True), warmup=5, rep=rep, grad_to_none=grads)
            full = bench.time_ms(partial(_rms_fwd_bwd, x, w, dy), warmup=5, rep=rep, grad_to_none=grads)
            weight = "trainable" if trainable else "frozen"
            record.add(table="frozen", provider="fk", H=width, rows=tokens, weight=weight, mode="bwd", ms=bwd)
            record.add(table="frozen", provider="fk", H=width, rows=tokens, weight=weight, mode="fwd+bwd", ms=full)
        torch.cuda.empty_cache()


def _rms_fwd_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> None:
    rms_norm(x, w, EPS).backward(dy)


def _lora_step(norm: Fn, x: torch.Tensor, w: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               dy: torch.Tensor) -> None:  # fmt: skip
    h = norm(x, w)
    out = h @ base.t() + (h @ a.t()) @ b.t()
    out.backward(dy)


def run_lora(record: bench.BenchRecord, tokens: int, widths: list[int], rep: int) -> None:
    """A frozen RMSNorm, then a LoRA linear layer (frozen base weight, trainable A and B), fwd+bwd."""
    op = OPS[0]
    for width in bench.progress(widths, desc="lora"):
        gen = torch.Generator(device="cuda").manual_seed(width)
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        w = torch.ones(width, device="cuda", dtype=torch.bfloat16)  # frozen norm weight
        base = (torch.randn(width, width, device="cuda", generator=gen) / width**0.5).to(torch.bfloat16)
        a = (torch.randn(LORA_RANK, width, device="cuda", generator=gen) / width**0.5).to(torch.bfloat16)
        b = torch.zeros(width, LORA_RANK, device="cuda", dtype=torch.bfloat16)
        a.requires_grad_()
        b.requires_grad_()
        dy = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=gen)
        for name, factory in providers(op).items():
            if isinstance(factory, str):
                continue
            step = partial(_lora_step, factory(), x, w, base, a, b, dy)
            ms = bench.time_ms(step, warmup=5, rep=rep, grad_to_none=[x, a, b])
            gpu: dict[str, float] = {}
            try:  # the GPU's work alone: at these sizes the wall time is mostly the host's
                gpu = {"gpu_ms": bench.time_ms(step, warmup=0, rep=rep, grad_to_none=[x, a, b], gpu_only=True)}
            except RuntimeError as error:
                print(f"lora: {name} H={width}: no GPU-only time ({error})")
            for t in (x, a, b):
                t.grad = None
            peak = bench.peak_memory_bytes(step)
            for t in (x, a, b):
                t.grad = None
            record.add(table="lora", provider=name, H=width, rows=tokens, weight="frozen", mode="fwd+bwd", ms=ms,
                       peak_mb=peak / 2**20, **gpu)  # fmt: skip
        torch.cuda.empty_cache()


def case(row: dict[str, Any]) -> str:
    """What one run measures together: an op with its peers, or the frozen or lora table."""
    return str(row.get("op")) if row.get("table") == "ops" else str(row.get("table"))


def run(rows: int, tokens: int, widths: list[int], out: Path, rep: int, ops: list[str],
        merge: bool = False) -> bench.BenchRecord:  # fmt: skip
    """Measure ``ops`` (and, with RMSNorm, the frozen and lora tables, which are RMSNorm's). With
    ``merge``, the record at ``out`` keeps its other cases' rows (:func:`case`), each with the date
    of the call that measured it: a whole run takes longer than one GPU call may last."""
    record = bench.BenchRecord(NAME, notes=f"{rows} rows (frozen and lora tables: {tokens}), bf16, eps={EPS}")
    ceilings = bench.measure_ceilings()
    record.ceilings = ceilings.as_dict()
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    old = bench.BenchRecord.from_json(out) if merge and out.exists() else None
    tables = ["frozen", "lora"] if "rms_norm" in ops else []

    def save() -> None:
        merged = bench.BenchRecord(record.name, record.environment, record.ceilings, list(record.rows), record.notes)
        (bench.merge_records(merged, old, case, [*ops, *tables]) if old else merged).to_json(out)

    run_ops(record, ceilings.copy_tbps, rows, widths, rep, ops, save)
    if tables:
        run_frozen(record, tokens, widths, rep)
        run_lora(record, tokens, widths, rep)
    save()
    return bench.BenchRecord.from_json(out)


# --- tables and plots (pure Python: they run without a GPU) -------------------------------------------

PEERS = ("liger", "torch.compile", "native")


def speedups(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """Per (op, H, weight, mode): fk against the fastest of Liger, torch.compile and native PyTorch."""
    rows = [r for r in record.rows if r.get("table") == "ops" and "ms" in r]
    table = []
    keys = sorted({(r["op"], r["H"], r["weight"], r["mode"]) for r in rows}, key=lambda k: (k[0], k[2], k[3], k[1]))
    for op, h, weight, mode in keys:
        times = {r["provider"]: r for r in rows if (r["op"], r["H"], r["weight"], r["mode"]) == (op, h, weight, mode)}
        if "fk" not in times:
            continue
        fk = times["fk"]
        peers = [times[p]["ms"] for p in PEERS if p in times]
        gpu = {}
        if "gpu_ms" in fk:  # (records from before the GPU-only column leave it out)
            gpu_peers = [times[p]["gpu_ms"] for p in PEERS if "gpu_ms" in times.get(p, {})]
            gpu = {"fk GPU ms": fk["gpu_ms"], "fk GPU copy%": 100 * fk["gpu_copy_fraction"],
                   **({"GPU speedup": min(gpu_peers) / fk["gpu_ms"]} if gpu_peers else {})}  # fmt: skip
        table.append(
            {"op": op, "H": h, "weight": weight, "mode": mode, "fk ms": fk["ms"], "fk TB/s": fk["tbps"],
             "fk copy%": 100 * fk["copy_fraction"],
             **{f"{p} ms": times[p]["ms"] for p in PEERS if p in times},
             "speedup": min(peers) / fk["ms"] if peers else None,
             "fk MB": fk["peak_mb"], **({"liger MB": times["liger"]["peak_mb"]} if "liger" in times else {}), **gpu}
        )  # fmt: skip
    return table


def frozen_speedups(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """RMSNorm at M tokens: frozen-weight time and its speedup over the trainable weight."""
    rows = [r for r in record.rows if r.get("table") == "frozen"]
    out = []
    for h in sorted({r["H"] for r in rows}):
        ms = {(r["weight"], r["mode"]): r["ms"] for r in rows if r["H"] == h}
        out.append(
            {"H": h, "bwd frozen ms": ms[("frozen", "bwd")], "bwd trainable ms": ms[("trainable", "bwd")],
             "bwd speedup": ms[("trainable", "bwd")] / ms[("frozen", "bwd")],
             "fwd+bwd frozen ms": ms[("frozen", "fwd+bwd")], "fwd+bwd trainable ms": ms[("trainable", "fwd+bwd")],
             "fwd+bwd speedup": ms[("trainable", "fwd+bwd")] / ms[("frozen", "fwd+bwd")]}
        )  # fmt: skip
    return out


def lora_table(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """Frozen RMSNorm + LoRA linear, fwd+bwd ms per provider, and fk's speedup over the fastest peer."""
    rows = [r for r in record.rows if r.get("table") == "lora"]
    out = []
    for h in sorted({r["H"] for r in rows}):
        ms = {r["provider"]: r["ms"] for r in rows if r["H"] == h}
        gpu = {r["provider"]: r["gpu_ms"] for r in rows if r["H"] == h and "gpu_ms" in r}
        peers = [ms[p] for p in PEERS if p in ms]
        gpu_peers = [gpu[p] for p in PEERS if p in gpu]
        out.append({"H": h, **{f"{p} ms": v for p, v in ms.items()},
                    "speedup": min(peers) / ms["fk"] if peers and "fk" in ms else None,
                    **({"fk GPU ms": gpu["fk"], "GPU speedup": min(gpu_peers) / gpu["fk"]}
                       if gpu_peers and "fk" in gpu else {})})  # fmt: skip
    return out


def unavailable(record: bench.BenchRecord) -> list[str]:
    return [f"{r['op']}: {r['provider']} {r['status']}" for r in record.rows if "status" in r]


COLUMNS = ["op", "H", "weight", "mode", "fk ms", "fk TB/s", "fk copy%", "liger ms", "torch.compile ms", "native ms",
           "speedup", "fk GPU ms", "fk GPU copy%", "GPU speedup", "fk MB", "liger MB"]  # fmt: skip
FROZEN_COLUMNS = ["H", "bwd frozen ms", "bwd trainable ms", "bwd speedup", "fwd+bwd frozen ms",
                  "fwd+bwd trainable ms", "fwd+bwd speedup"]  # fmt: skip
LORA_COLUMNS = ["H", "fk ms", "liger ms", "torch.compile ms", "native ms", "speedup", "fk GPU ms", "GPU speedup"]


def summary(record: bench.BenchRecord) -> str:
    """The markdown tables for docs/benchmarks.md ("speedup": over the fastest peer)."""
    parts = [bench.markdown_table(speedups(record), COLUMNS, skip_absent=True)]
    if any(r.get("table") == "frozen" for r in record.rows):
        parts.append(
            "Frozen weight, RMSNorm alone:\n\n" + bench.markdown_table(frozen_speedups(record), FROZEN_COLUMNS)
        )
    if any(r.get("table") == "lora" for r in record.rows):
        parts.append(
            "Frozen RMSNorm + LoRA linear (r=16), fwd+bwd:\n\n" + bench.markdown_table(lora_table(record), LORA_COLUMNS)
        )
    missing = unavailable(record)
    if missing:
        parts.append("Not measured: " + "; ".join(missing) + ".")
    return "\n\n".join(parts)


def plots(record: bench.BenchRecord, out: Path) -> None:
    copy = record.ceilings.get("copy_tbps")
    for op in sorted({r["op"] for r in record.rows if r.get("table") == "ops"}):
        for weight in ("trainable", "frozen"):
            sub = bench.BenchRecord(
                record.name, record.environment, record.ceilings,
                [r for r in record.rows if r.get("table") == "ops" and r.get("op") == op and r.get("weight") == weight
                 and "ms" in r],
            )  # fmt: skip
            if not sub.rows:
                continue
            bench.plot(
                sub, x="H", y="tbps", facet="mode", logx=True, path=out / f"norms_{op}_{weight}.png",
                title=f"{op}, {sub.rows[0]['rows']} rows, bf16, {weight} ({record.environment.get('gpu')})",
                ylabel="TB/s (bytes counted / time)", hline=copy, hline_label="copy ceiling",
            )  # fmt: skip


def _out_path(out: Path) -> Path:
    """``--out`` may name the JSON file or the results folder (as for the other bench scripts)."""
    return out if out.suffix == ".json" else out / f"{NAME}.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="JSON file or results folder")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the frozen and lora tables")
    parser.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    parser.add_argument("--rep", type=int, default=20, help="timed repetitions per measurement")
    parser.add_argument("--ops", nargs="+", default=[op.name for op in OPS], choices=[op.name for op in OPS])
    parser.add_argument("--quick", action="store_true", help=f"H in {QUICK_WIDTHS} and 10 repetitions")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the ops (and tables) not run now from the record at --out")  # fmt: skip
    parser.add_argument("--plot", type=Path, help="only redraw the plots from this JSON record")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/assets/benchmarks"))
    args = parser.parse_args(argv)
    if args.plot:
        record = bench.BenchRecord.from_json(args.plot)
        plots(record, args.plot_dir)
    else:
        widths, rep = (QUICK_WIDTHS, 10) if args.quick else (args.widths, args.rep)
        record = run(args.rows, args.tokens, widths, _out_path(args.out), rep, args.ops, args.merge)
    print(summary(record))


if __name__ == "__main__":
    main()
