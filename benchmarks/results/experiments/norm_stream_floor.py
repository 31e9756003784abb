"""The bytes floor of the norm cases that miss #3's 1.1x target, beside the target, in one run.

#3 asks every norm, forward+backward, to be 1.1x faster than the fastest of Liger, torch.compile
and native PyTorch. ``bench_norms.py`` counts the bytes any implementation must move (bf16):
RMSNorm, LayerNorm and PolyNorm read x and write y in the forward and read x and dy and write dx
in the backward (10 M H bytes); FusedAddRMSNorm reads x and the residual and writes y and the new
residual, then reads dy, the residual's gradient and the new residual and writes one gradient
(16 M H). Parameters, statistics and parameter gradients are O(H) or O(M) and left out.

This script times, in one process and as ``bench_norms.py`` times forward+backward (the GPU's
time alone, L2 flushed before each call, median of the calls):

- fk and each peer on the case, forward+backward as ``bench_norms.py`` runs it;
- the **floor**: one streaming kernel per direction that moves exactly the counted bytes and does
  no arithmetic but a sum of its inputs. The forward's kernel reads 1 (FusedAdd: 2) tensors of
  M x H and writes 1 (2); the backward's reads 2 (3) and writes 1. Each direction's kernel is the
  fastest of a sweep: a Triton kernel over the flat tensors (tiles of 1024 to 16384 elements, 4 to
  16 warps) and, where one ATen op moves those bytes in one launch, that op (``copy_``, ``add``,
  ``addcmul``). Then both directions are timed together, as one call.

Any implementation runs at least one kernel per direction (autograd calls the backward apart
from the forward) and moves at least the counted bytes through HBM at these sizes: M = 16384 rows
make every tensor 32 MiB at H = 1024 and 1 GiB at H = 32768, and the L2 is flushed before each
call. At H = 1024 a tensor is smaller than an H200's L2, so an implementation could find part of
x there in the backward; above it, no. Where the target (the fastest peer's time / 1.1) is below
the floor, no implementation meets it; "floor / target" says by how much. "fk / floor" says how
far fk is from the floor.

Run on a GPU:  python benchmarks/results/experiments/norm_stream_floor.py [--cases all|misses] [--ops ...]
Output of a run on an H200: norm_stream_floor_h200.txt beside this file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import bench_norms

from fk.core import bench

ROWS = 16384
MISSES = [  # (op, weight, H) whose GPU-time speedup was under 1.1 in norms.json of 2026-11-24T19:28
    ("rms_norm", "frozen", h) for h in (1024, 2048, 4096, 8192, 16384, 32768)
] + [("rms_norm", "trainable", 1024), ("rms_norm", "trainable", 32768)] + [
    ("fused_add_rms_norm", "frozen", h) for h in (1024, 2048, 4096, 8192, 16384)
] + [("fused_add_rms_norm", "trainable", h) for h in (1024, 2048, 4096, 16384, 32768)] + [
    ("layer_norm", "frozen", 1024), ("poly_norm", "frozen", 1024), ("poly_norm", "frozen", 8192),
    ("poly_norm", "frozen", 16384),
]  # fmt: skip
BLOCKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)
REP = 30


@triton.jit
def _stream_kernel(a, b, c, out0, out1, n, N_IN: tl.constexpr, N_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """out0 (and out1) = a (+ b (+ c)) over ``n`` elements: N_IN reads and N_OUT writes of each."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n
    total = tl.load(a + offsets, mask=in_range)
    if N_IN > 1:
        total += tl.load(b + offsets, mask=in_range)
    if N_IN > 2:
        total += tl.load(c + offsets, mask=in_range)
    tl.store(out0 + offsets, total, mask=in_range)
    if N_OUT > 1:
        tl.store(out1 + offsets, total, mask=in_range)


def _triton_stream(ins: list[torch.Tensor], outs: list[torch.Tensor], block: int, warps: int) -> Any:
    n = ins[0].numel()
    a, b, c = (ins + ins[:1] * 2)[:3]
    o0, o1 = (outs + outs[:1])[:2]
    grid = (triton.cdiv(n, block),)
    return lambda: _stream_kernel[grid](a, b, c, o0, o1, n, len(ins), len(outs), block, num_warps=warps)


def _aten_stream(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
    """One ATen launch that reads ``ins`` and writes ``outs`` (None where no single op does)."""
    if len(outs) != 1:
        return None
    if len(ins) == 1:
        return lambda: outs[0].copy_(ins[0])
    if len(ins) == 2:
        return lambda: torch.add(ins[0], ins[1], out=outs[0])
    return lambda: torch.addcmul(ins[0], ins[1], ins[2], out=outs[0])


def _gpu_ms(fn: Any, grads: list[torch.Tensor] | None = None) -> float:
    return bench.time_ms(fn, warmup=3, rep=REP, grad_to_none=grads, gpu_only=True)


def _best_stream(n_in: int, n_out: int, width: int) -> tuple[Any, str, float]:
    """(call, label, GPU ms) of the fastest one-launch stream of ``n_in`` reads and ``n_out`` writes."""
    ins = [torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16) for _ in range(n_in)]
    outs = [torch.empty(ROWS, width, device="cuda", dtype=torch.bfloat16) for _ in range(n_out)]
    candidates = [(f"triton {block}/{warps}w", _triton_stream(ins, outs, block, warps)) for block in BLOCKS
                  for warps in WARPS]  # fmt: skip
    aten = _aten_stream(ins, outs)
    if aten is not None:
        candidates.append(("aten", aten))
    timed = [(fn, label, _gpu_ms(fn)) for label, fn in candidates]
    return min(timed, key=lambda t: t[2])


def _provider_ms(op: bench_norms.Op, name: str, fn: Any, width: int, trainable: bool) -> float:
    acts, params = bench_norms._inputs(op, ROWS, width, trainable)
    args = [*acts, *params]
    grads = [*acts, *params] if trainable else list(acts)
    out_shapes = [o.shape for o in bench_norms._outputs(op.eager(*[a.detach() for a in acts], *params))]
    dys = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in out_shapes]

    def forward_backward() -> None:
        torch.autograd.grad(bench_norms._outputs(fn(*args)), grads, dys)

    return _gpu_ms(forward_backward, grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", choices=["misses", "all"], default="misses")
    parser.add_argument("--ops", nargs="+", help="only these ops' cases")
    args = parser.parse_args()
    ops = {op.name: op for op in bench_norms.OPS}
    cases = MISSES if args.cases == "misses" else [
        (name, weight, h) for name in ("rms_norm", "fused_add_rms_norm", "layer_norm", "poly_norm")
        for weight in ("frozen", "trainable") for h in bench_norms.WIDTHS
    ]  # fmt: skip
    cases = [case for case in cases if not args.ops or case[0] in args.ops]
    ceilings = bench.measure_ceilings()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {ceilings.copy_tbps:.2f} TB/s  rows {ROWS}  bf16  GPU-only ms, median of {REP}")  # fmt: skip
    header = ("op", "weight", "H", "fk", "best peer", "target", "floor", "floor/target", "fk/floor", "floor copy%",
              "floor kernels")  # fmt: skip
    print(" | ".join(header))
    floors: dict[tuple[int, int, int], tuple[Any, str, float]] = {}
    for name, weight, width in cases:
        op = ops[name]
        trainable = weight == "trainable"
        times = {}
        for provider, factory in bench_norms.providers(op).items():
            if isinstance(factory, str):
                continue
            times[provider] = _provider_ms(op, provider, factory(), width, trainable)
        peer, peer_ms = min(((p, t) for p, t in times.items() if p != "fk"), key=lambda pt: pt[1])
        fwd, bwd = ((2, 2), (3, 1)) if name == "fused_add_rms_norm" else ((1, 1), (2, 1))
        for pattern in (fwd, bwd):
            if (*pattern, width) not in floors:
                floors[(*pattern, width)] = _best_stream(*pattern, width)
        (fwd_call, fwd_label, _), (bwd_call, bwd_label, _) = floors[(*fwd, width)], floors[(*bwd, width)]

        def both(fwd_call: Any = fwd_call, bwd_call: Any = bwd_call) -> None:
            fwd_call()
            bwd_call()

        floor_ms = _gpu_ms(both)
        target = peer_ms / 1.1
        nbytes = op.fwd_bwd_bytes * ROWS * width
        floor_copy = 100 * bench.fraction(bench.tbps(nbytes, floor_ms), ceilings.copy_tbps)
        print(f"{name} | {weight} | {width} | {times['fk']:.4f} | {peer} {peer_ms:.4f} | {target:.4f} | "
              f"{floor_ms:.4f} | {floor_ms / target:.3f} | {times['fk'] / floor_ms:.3f} | {floor_copy:.1f} | "
              f"{fwd_label} + {bwd_label}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
