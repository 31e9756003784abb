"""Sweep fk RoPE's launch parameters on a GPU (a development tool; results pick the defaults).

Each variant sets the module constants of ``fk.rope.rope`` and times fk alone, forward and
forward+backward, at Llama-3-8B shapes (see bench_rope.py, whose byte counts the TB/s use), by the
GPU's time alone (``bench.time_ms(gpu_only=True)``, as bench_rope's GPU columns: at S=1024 the wall
time of a forward+backward is the host's). The module's own settings are marked. Also prints the
host time of one call (small tensors: launch-bound). Run:  python benchmarks/tune_rope.py
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import itertools
import pstats
import time
from collections.abc import Callable

import torch

from fk.core import bench

module = importlib.import_module("fk.rope.rope")
bench_rope = importlib.import_module("bench_rope")

SPACE = {
    "TOKEN_ELEMENTS": [4096, 16384],
    "TILE_ELEMENTS": [2048, 4096, 8192],
    "ELEMENTS_PER_WARP": [256, 512, 1024],
    "LOADS_FIRST": [False, True],
}


def configure(values: dict[str, int]) -> None:
    for key, value in values.items():
        setattr(module, key, value)
    module.rope_tiling.cache_clear()


def host_us(fn: object, n: int = 300) -> float:
    for _ in range(20):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def calls(q: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:  # fmt: skip
    def fwd() -> None:
        module.rope(q.detach(), k.detach(), cos, sin)

    def fwd_bwd() -> None:
        torch.autograd.backward(module.rope(q, k, cos, sin), (dq, dk))

    return fwd, fwd_bwd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096])
    parser.add_argument("--rep", type=int, default=30)
    parser.add_argument("--host-only", action="store_true", help="only the host times (and a profile)")
    args = parser.parse_args()
    if not args.host_only:
        sweep(args.seqs, args.rep)
    host_times()


def sweep(seqs: list[int], rep: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    defaults = {name: getattr(module, name) for name in SPACE}
    rows = []
    for seq in seqs:
        q, k, dq, dk, cos, sin = bench_rope.inputs(seq, gen=gen)
        nbytes = bench_rope.forward_bytes(seq)
        for values in [dict(zip(SPACE, v, strict=True)) for v in itertools.product(*SPACE.values())]:
            configure(values)
            tiling = module.rope_tiling(bench_rope.N_Q, bench_rope.N_KV, bench_rope.HEAD_DIM)

            fwd, fwd_bwd = calls(q, k, dq, dk, cos, sin)
            f = bench.time_ms(fwd, rep=rep, warmup=3, gpu_only=True)
            fb = bench.time_ms(fwd_bwd, rep=rep, warmup=3, grad_to_none=[q, k], gpu_only=True)
            rows.append({"S": seq, "module's": "yes" if values == defaults else "", **values,
                         "tiling": str(tiling.__dict__), "fwd ms": f, "fwd TB/s": bench.tbps(nbytes, f),
                         "fwd+bwd ms": fb, "fwd+bwd TB/s": bench.tbps(2 * nbytes, fb)})  # fmt: skip
    configure(defaults)  # (host_times below times the module's own settings)
    rows.sort(key=lambda r: (r["S"], r["fwd+bwd ms"]))
    print(bench.markdown_table(rows, list(rows[0])))


def host_times() -> None:
    """Host time per call at a launch-bound size, and where fk's forward+backward spends it."""
    q = torch.randn(1, 32, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t[:, :16].contiguous() for t in bench_rope._cos_sin(16))
    qd, kd = q.detach(), k.detach()
    print("host us: launcher", host_us(lambda: module._rope_fwd(qd, kd, cos, sin, None, False, False)))
    print("host us: rope fwd no grad", host_us(lambda: module.rope(qd, kd, cos, sin)))
    print("host us: rope fwd+bwd", host_us(lambda: torch.autograd.backward(module.rope(q, k, cos, sin), (qd, kd))))
    eager = bench_rope._eager
    print("host us: eager fwd+bwd", host_us(lambda: torch.autograd.backward(eager(q, k, cos, sin), (qd, kd))))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        torch.autograd.backward(module.rope(q, k, cos, sin), (qd, kd))
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
