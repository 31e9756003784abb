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
  no arithmetic but a sum of its inputs, over the op's own tensors: the forward's kernel reads 1
  (FusedAdd: 2) tensors of M x H and writes 1 (2); the backward's reads 2 (3) and writes 1, one of
  them a tensor the forward touched (x; FusedAdd: the new residual). Each direction's kernel is the
  fastest of a sweep: a Triton kernel over the flat tensors (tiles of 1024 to 16384 elements, 4 to
  16 warps) and, where one ATen op moves those bytes in one launch, that op (``copy_``, ``add``,
  ``addcmul``). The pair is then timed as one call three ways, and the fastest is the floor: as
  swept; with the backward's programs in reverse order (it starts on the rows the forward touched
  last, which L2 may still hold); and that with the shared tensor kept in L2 by eviction hints;
- the **bound**: the plain pair's time less the share of the counted bytes that the L2 could hold
  between forward and backward (its whole capacity), a lower bound that grants any implementation
  the most reuse of L2 there can be.

Any implementation runs at least one kernel per direction (autograd calls the backward apart
from the forward) and, with the L2 flushed before each call, moves at least the counted bytes less
what L2 keeps between its kernels. Where the target (the fastest peer's time / 1.1) is below both
the floor and the bound, no implementation meets it; "lowest/target" (the lower of the two over
the target) says by how much. "fk/floor" says how far fk is from the floor.

Run on a GPU:  python benchmarks/experiments/norm_stream_floor.py [--cases all|misses] [--ops ...]
(--cases all: every case of RMSNorm, FusedAddRMSNorm, LayerNorm, PolyNorm and GroupNorm, Liger's
GroupNorm left out)
Output of a run on an H200: norm_stream_floor_h200.txt beside this file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
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
# Peers left out: Liger's GroupNorm takes about 1.5 s a call at these shapes (docs/benchmarks.md);
# norms.json has its times.
SLOW = {("group_norm", "liger")}
BLOCKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)
REP = 30


@triton.jit
def _stream_kernel(a, b, c, out0, out1, n, N_IN: tl.constexpr, N_OUT: tl.constexpr, BLOCK: tl.constexpr,
                   REVERSE: tl.constexpr, KEEP: tl.constexpr):  # fmt: skip
    """out0 (and out1) = a (+ b (+ c)) over ``n`` elements: N_IN reads and N_OUT writes of each.

    REVERSE: program i takes the tile of program (n_programs - 1 - i), so a backward starts on the
    rows its forward touched last, which L2 may still hold. KEEP: 0 plain loads and stores; 1 keep
    ``a`` in L2 (evict_last) and evict the rest first; 2 the same for ``out1``.
    """
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n
    if KEEP == 0:
        total = tl.load(a + offsets, mask=in_range)
    elif KEEP == 1:
        total = tl.load(a + offsets, mask=in_range, eviction_policy="evict_last")
    else:
        total = tl.load(a + offsets, mask=in_range, eviction_policy="evict_first")
    if N_IN > 1:
        if KEEP == 0:
            total += tl.load(b + offsets, mask=in_range)
        else:
            total += tl.load(b + offsets, mask=in_range, eviction_policy="evict_first")
    if N_IN > 2:
        if KEEP == 0:
            total += tl.load(c + offsets, mask=in_range)
        else:
            total += tl.load(c + offsets, mask=in_range, eviction_policy="evict_first")
    if KEEP == 0:
        tl.store(out0 + offsets, total, mask=in_range)
    else:
        tl.store(out0 + offsets, total, mask=in_range, eviction_policy="evict_first")
    if N_OUT > 1:
        if KEEP == 0:
            tl.store(out1 + offsets, total, mask=in_range)
        elif KEEP == 2:
            tl.store(out1 + offsets, total, mask=in_range, eviction_policy="evict_last")
        else:
            tl.store(out1 + offsets, total, mask=in_range, eviction_policy="evict_first")


def _triton_stream(ins: list[torch.Tensor], outs: list[torch.Tensor], block: int, warps: int, reverse: bool = False,
                   keep: int = 0) -> Any:  # fmt: skip
    n = ins[0].numel()
    a, b, c = (ins + ins[:1] * 2)[:3]
    o0, o1 = (outs + outs[:1])[:2]
    grid = (triton.cdiv(n, block),)
    return lambda: _stream_kernel[grid](a, b, c, o0, o1, n, len(ins), len(outs), block, reverse, keep,
                                        num_warps=warps)  # fmt: skip


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


def _best_streams(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[tuple[Any, str], tuple[int, int]]:
    """((call, label) of the fastest one-launch stream from ``ins`` to ``outs``, (block, warps) of
    the fastest Triton one)."""
    tilings = [(block, warps) for block in BLOCKS for warps in WARPS]
    timed = [(_gpu_ms(_triton_stream(ins, outs, *tiling)), tiling) for tiling in tilings]
    triton_ms, tiling = min(timed)
    aten = _aten_stream(ins, outs)
    if aten is not None and _gpu_ms(aten) < triton_ms:
        return (aten, "aten"), tiling
    return (_triton_stream(ins, outs, *tiling), f"triton {tiling[0]}/{tiling[1]}w"), tiling


class Floor(NamedTuple):
    ms: float  # the fastest pair of streams, forward then backward, in one call
    label: str
    no_reuse_ms: float  # the fastest pair in plain order, which L2 does not help
    bound_ms: float  # no_reuse_ms less the share of the bytes the L2 could hold between the two


def _floor(fused_add: bool, width: int, nbytes: int) -> Floor:
    """The floor of one op's forward+backward at ``width``: streams over the op's own tensors, where
    the backward reads one tensor the forward touched (RMSNorm: x, read; FusedAddRMSNorm: the new
    residual, written), timed plain and with that tensor kept in L2 and the backward's order reversed."""
    new = [torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    x, r, dy, dres, y = new
    s, dx = torch.empty_like(x), torch.empty_like(x)
    if fused_add:
        fwd, bwd, keep = ([x, r], [y, s]), ([s, dy, dres], [dx]), 2
    else:
        fwd, bwd, keep = ([x], [y]), ([x, dy], [dx]), 1
    (fwd_call, fwd_label), fwd_tiling = _best_streams(*fwd)
    (bwd_call, bwd_label), bwd_tiling = _best_streams(*bwd)
    pairs = {
        f"{fwd_label} + {bwd_label}": (fwd_call, bwd_call),
        "triton, backward reversed": (_triton_stream(*fwd, *fwd_tiling), _triton_stream(*bwd, *bwd_tiling, True)),
        "triton, kept in L2, backward reversed": (_triton_stream(*fwd, *fwd_tiling, keep=keep),
                                                  _triton_stream(*bwd, *bwd_tiling, True, keep=0)),
    }  # fmt: skip
    timed = {}
    for label, (first, second) in pairs.items():

        def both(first: Any = first, second: Any = second) -> None:
            first()
            second()

        timed[label] = _gpu_ms(both)
    label = min(timed, key=lambda k: timed[k])
    no_reuse = timed[f"{fwd_label} + {bwd_label}"]
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return Floor(timed[label], label, no_reuse, no_reuse * max(0.0, 1 - l2 / nbytes))


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
        (name, weight, h) for name in ("rms_norm", "fused_add_rms_norm", "layer_norm", "poly_norm", "group_norm")
        for weight in ("frozen", "trainable") for h in bench_norms.WIDTHS
    ]  # fmt: skip
    cases = [case for case in cases if not args.ops or case[0] in args.ops]
    ceilings = bench.measure_ceilings()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {ceilings.copy_tbps:.2f} TB/s  rows {ROWS}  bf16  GPU-only ms, median of {REP}")  # fmt: skip
    header = ("op", "weight", "H", "fk", "best peer", "target", "floor", "no-reuse floor", "bound", "lowest/target",
              "fk/floor", "floor copy%", "floor kernels")  # fmt: skip
    print(" | ".join(header))
    floors: dict[tuple[bool, int], Floor] = {}
    for name, weight, width in cases:
        op = ops[name]
        trainable = weight == "trainable"
        times = {}
        for provider, factory in bench_norms.providers(op).items():
            if isinstance(factory, str) or (name, provider) in SLOW:
                continue
            times[provider] = _provider_ms(op, provider, factory(), width, trainable)
        peer, peer_ms = min(((p, t) for p, t in times.items() if p != "fk"), key=lambda pt: pt[1])
        nbytes = op.fwd_bwd_bytes * ROWS * width
        key = (name == "fused_add_rms_norm", width)
        if key not in floors:
            floors[key] = _floor(*key, nbytes)
        floor = floors[key]
        target = peer_ms / 1.1
        lowest = min(floor.ms, floor.bound_ms)
        floor_copy = 100 * bench.fraction(bench.tbps(nbytes, floor.ms), ceilings.copy_tbps)
        print(f"{name} | {weight} | {width} | {times['fk']:.4f} | {peer} {peer_ms:.4f} | {target:.4f} | "
              f"{floor.ms:.4f} | {floor.no_reuse_ms:.4f} | {floor.bound_ms:.4f} | {lowest / target:.3f} | "
              f"{times['fk'] / floor.ms:.3f} | {floor_copy:.1f} | {floor.label}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
