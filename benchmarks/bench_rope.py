"""RoPE side by side: fk, Liger Kernel, torch.compile of the eager code, and eager PyTorch.

Llama-3-8B attention shapes: B=4, S in {1024, 4096, 16384}, 32 q heads, 8 kv heads, head_dim 128,
bf16, cos/sin of shape (1, S, 128) in bf16 as Hugging Face's rotary embedding returns them. Two
layouts of q, k and their upstream gradients, all (B, heads, S, D) as Hugging Face's function
takes them:

- ``hf``: as Hugging Face's attention makes them, (B, S, heads, D) projections transposed (the
  layout Liger rotates without a copy);
- ``contiguous``: contiguous (B, heads, S, D) tensors (Liger copies them to (B, S, heads, D)).

Forward and forward+backward time, bandwidth against the device-to-device copy ceiling measured
in the same run, and peak memory. Bytes counted (the minimum any implementation must move), with
Q = B*S*32*128 and K = B*S*8*128 elements and 2 bytes each:

- forward: reads q and k, writes q_embed and k_embed, reads cos and sin once:
  2*(2*(Q + K)) + 2*(2*S*128) bytes;
- forward+backward: the forward, then the backward reads dq_embed and dk_embed, writes dq and dk
  and reads cos and sin once more: twice the forward's bytes.

Run on a GPU:  python benchmarks/bench_rope.py --out benchmarks/results
Redraw plots:  python benchmarks/bench_rope.py --plot benchmarks/results/rope.json  (into docs/assets/benchmarks)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from fk.core import bench
from fk.rope import apply_rotary_pos_emb, rope

NAME = "rope"
BATCH, N_Q, N_KV, HEAD_DIM = 4, 32, 8, 128
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Hugging Face's apply_rotary_pos_emb (Llama), as written in transformers.
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def providers() -> dict[str, Callable[[], Fn]]:
    """Name -> factory of a fresh function (a fresh torch.compile for each shape)."""
    found: dict[str, Callable[[], Fn]] = {
        "fk": lambda: apply_rotary_pos_emb,
        "fk inplace": lambda: lambda q, k, c, s: rope(q, k, c, s, inplace=True),  # forward only
    }
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        # Liger rotates q and k in place (and dq, dk in place in the backward) and returns them.
        found["liger"] = lambda: lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s)
    except ImportError:
        print("liger-kernel is not installed: skipping it")
    found["torch.compile"] = lambda: bench.fresh_compile(_eager)
    found["eager"] = lambda: _eager
    return found


LAYOUTS = ("hf", "contiguous")


def _tensor(seq: int, heads: int, gen: torch.Generator, layout: str = "hf") -> torch.Tensor:
    """A (B, heads, S, D) bf16 tensor in ``layout``."""
    if layout == "contiguous":
        return torch.randn(BATCH, heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(BATCH, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x.transpose(1, 2)


def _cos_sin(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM))
    freqs = torch.arange(seq, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def forward_bytes(seq: int) -> int:
    q, k = BATCH * seq * N_Q * HEAD_DIM, BATCH * seq * N_KV * HEAD_DIM
    return 2 * (2 * (q + k)) + 2 * (2 * seq * HEAD_DIM)


class Inputs(NamedTuple):
    """One case's tensors: q and k (leaves that require gradients), their upstream gradients, cos and sin."""

    q: torch.Tensor
    k: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def inputs(seq: int, layout: str = "hf", gen: torch.Generator | None = None) -> Inputs:
    """The tensors of the case at ``seq`` in ``layout``, drawn from ``gen`` (default: seeded with ``seq``)."""
    gen = gen if gen is not None else torch.Generator(device="cuda").manual_seed(seq)
    q, k = _tensor(seq, N_Q, gen, layout).requires_grad_(), _tensor(seq, N_KV, gen, layout).requires_grad_()
    dq, dk = _tensor(seq, N_Q, gen, layout), _tensor(seq, N_KV, gen, layout)
    return Inputs(q, k, dq, dk, *_cos_sin(seq))


def calls(fn: Fn, case: Inputs) -> tuple[Callable[[], None], Callable[[], None]]:
    """(the forward without autograd, the forward+backward) of ``fn`` on ``case``, as timed."""
    q, k, dq, dk, cos, sin = case

    def forward() -> None:
        with torch.no_grad():
            fn(q.detach(), k.detach(), cos, sin)

    def forward_backward() -> None:
        # Liger writes over q/k and dq/dk: their values change between calls, the cost does not.
        q_embed, k_embed = fn(q, k, cos, sin)
        torch.autograd.backward((q_embed, k_embed), (dq, dk))

    return forward, forward_backward


def measure(record: bench.BenchRecord, copy_tbps: float, name: str, fn: Fn, seq: int, layout: str, rep: int) -> None:
    """Time one provider at one shape and layout, forward and forward+backward; add the rows to ``record``."""
    case = inputs(seq, layout)
    q, k, cos, sin = case.q, case.k, case.cos, case.sin
    # Sanity: every provider computes the same function (bf16 rounding apart). Liger writes into
    # its inputs, so it gets copies here.
    with torch.no_grad():
        want = _eager(q.float(), k.float(), cos.float(), sin.float())
        got = fn(q.detach().clone(), k.detach().clone(), cos, sin)
        err = max((a.float() - b).abs().max().item() for a, b in zip(got, want, strict=True))
    if err > 0.1:
        raise AssertionError(f"{name} disagrees with eager at S={seq}: max error {err}")

    forward, forward_backward = calls(fn, case)
    nbytes = forward_bytes(seq)
    for mode, call, counted in (("fwd", forward, nbytes), ("fwd+bwd", forward_backward, 2 * nbytes)):
        if name == "fk inplace" and mode == "fwd+bwd":
            continue  # q and k here are leaves, which nothing may overwrite while autograd records
        ms = bench.time_ms(call, rep=rep, grad_to_none=[q, k])
        gpu_ms = bench.time_ms(call, rep=rep, grad_to_none=[q, k], gpu_only=True)
        q.grad = k.grad = None
        peak = bench.peak_memory_bytes(call)
        q.grad = k.grad = None
        achieved = bench.tbps(counted, ms)
        record.add(
            provider=name, layout=layout, S=seq, batch=BATCH, q_heads=N_Q, kv_heads=N_KV, head_dim=HEAD_DIM, mode=mode,
            ms=ms, tbps=achieved, copy_fraction=bench.fraction(achieved, copy_tbps), peak_mb=peak / 2**20,
            gpu_ms=gpu_ms, gpu_copy_fraction=bench.fraction(bench.tbps(counted, gpu_ms), copy_tbps),
        )  # fmt: skip


def run(seqs: list[int], out: Path, rep: int) -> bench.BenchRecord:
    notes = (f"Llama-3-8B attention: B={BATCH}, {N_Q} q / {N_KV} kv heads, d={HEAD_DIM}, bf16, cos/sin (1, S, 128) "
             "bf16; bytes: q, k read and written once each way, cos/sin read once per pass")  # fmt: skip
    record = bench.BenchRecord(NAME, notes=notes)
    ceilings = bench.measure_ceilings()
    record.ceilings = ceilings.as_dict()
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    factories = providers()
    cases = [(layout, s, name) for layout in LAYOUTS for s in seqs for name in factories]
    for layout, seq, name in bench.progress(cases, desc=NAME):
        try:
            measure(record, ceilings.copy_tbps, name, factories[name](), seq, layout, rep)
        except Exception as exc:  # a failing peer is reported, and does not cost the other measurements
            if name == "fk":
                raise
            print(f"{name} failed at S={seq}: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    record.to_json(out / f"{NAME}.json")
    return record


def speedups(record: bench.BenchRecord) -> list[dict[str, object]]:
    """fk against each peer, per (layout, S, mode): peer time / fk time (> 1: fk is faster)."""
    table = []
    keys = sorted({(r["layout"], r["S"], r["mode"]) for r in record.rows}, key=lambda t: (-len(t[0]), t[2], t[1]))
    for layout, seq, mode in keys:
        times = {r["provider"]: r for r in record.rows if (r["layout"], r["S"], r["mode"]) == (layout, seq, mode)}
        fk = times["fk"]
        row: dict[str, object] = {"layout": layout, "S": seq, "mode": mode, "fk ms": fk["ms"], "fk TB/s": fk["tbps"],
                                  "fk copy%": 100 * fk["copy_fraction"]}  # fmt: skip
        for peer in ("fk inplace", "liger", "torch.compile", "eager"):
            if peer in times:
                row[f"{peer} ms"] = times[peer]["ms"]
                row[f"vs {peer}"] = times[peer]["ms"] / fk["ms"]
        if "gpu_ms" in fk:  # the GPU work alone (records from before it leave these columns out)
            row["fk GPU ms"], row["fk GPU copy%"] = fk["gpu_ms"], 100 * fk["gpu_copy_fraction"]
            for peer in ("liger", "torch.compile"):
                if peer in times:
                    row[f"GPU vs {peer}"] = times[peer]["gpu_ms"] / fk["gpu_ms"]
        row["fk MB"] = fk["peak_mb"]
        for peer in ("fk inplace", "liger", "torch.compile"):
            if peer in times:
                row[f"{peer} MB"] = times[peer]["peak_mb"]
        table.append(row)
    return table


def plots(record: bench.BenchRecord, out: Path) -> None:
    copy = record.ceilings.get("copy_tbps")
    gpu = record.environment.get("gpu")
    for layout in LAYOUTS:
        sub = record.subset(layout=layout)
        if not sub.rows:
            continue
        bench.plot(
            sub, x="S", y="tbps", facet="mode", logx=True, path=out / f"{NAME}_{layout}.png",
            title=f"RoPE, Llama-3-8B shapes (B={BATCH}, {N_Q}/{N_KV} heads, d={HEAD_DIM}), bf16, {layout} layout ({gpu})",
            ylabel="TB/s (bytes counted / time)", hline=copy, hline_label="copy ceiling",
        )  # fmt: skip


COLUMNS = ["layout", "S", "mode", "fk ms", "fk TB/s", "fk copy%", "liger ms", "torch.compile ms", "eager ms",
           "vs liger", "vs torch.compile", "vs eager", "fk inplace ms", "fk GPU ms", "fk GPU copy%", "GPU vs liger",
           "GPU vs torch.compile", "fk MB", "fk inplace MB", "liger MB", "torch.compile MB"]  # fmt: skip


def summary(record: bench.BenchRecord) -> str:
    """The markdown table for docs/benchmarks.md ("vs X": X's time over fk's, > 1 when fk is faster;
    "GPU vs X": the same of the GPU work alone, ``bench.time_ms(gpu_only=True)``)."""
    return bench.markdown_table(speedups(record), COLUMNS, skip_absent=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rep", type=int, default=100)
    parser.add_argument("--plot", type=Path, help="only redraw the plots from this JSON record")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/assets/benchmarks"))
    args = parser.parse_args()
    if args.plot:
        record = bench.BenchRecord.from_json(args.plot)
        plots(record, args.plot_dir)
    else:
        record = run(args.seqs, args.out, args.rep)
    print(summary(record))


if __name__ == "__main__":
    main()
