"""Sweep the launch tables of fk-lora's DoRA kernels on a GPU (a development tool; results pick the defaults).

The tables of ``fk.lora.dora_norm`` (``||W + s B A||``), ``fk.lora.dora_elementwise`` (``scale``: the
output without dropout; ``forward``: with dropout; ``backward``: the terms formed from ``dy``) and
``fk.lora.dora_glu`` (the MLP's gated activation, ``forward`` and ``backward``) were first guesses.
Each variant replaces one table entry and times that kernel's launcher alone, by the GPU's time, at
Llama-3.1-8B shapes (r = 16, bf16): the norm over the q, k/v, o, gate/up and down weights, the passes
over ``[tokens, N]`` activations for N in {4096 (q, o), 1024 (k, v), 14336 (gate, up)} at 4096 and
16384 tokens. It prints, per kernel, the module's setting and the best time at each shape, then every
variant's time over the best (the module's marked), best first by the worst of its ratios.

Run on a GPU:  python benchmarks/tune_dora.py [--kernels norm scale forward backward glu_forward glu_backward]
               [--tokens 4096 16384] [--top 8]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fk.core import bench

norm_module = importlib.import_module("fk.lora.dora_norm")
elementwise = importlib.import_module("fk.lora.dora_elementwise")
glu = importlib.import_module("fk.lora.dora_glu")

DEVICE = "cuda"
RANK = 16
WEIGHTS = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}  # [N, K]
WIDTHS = {"q/o": 4096, "k/v": 1024, "gate/up": 14336}  # activations' N
ROWS, COLS, WARPS, PROGRAMS = (16, 32, 64), (64, 128, 256), (4, 8), (2, 4, 8)


class Kernel(NamedTuple):
    module: Any
    key: str | None  # the entry of module.LAUNCH (None: LAUNCH is one LaunchParams)
    calls: Callable[[list[int]], dict[str, Callable[[], object]]]  # shape name -> a launch
    per_sm: bool  # whether programs_per_sm is swept


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) * scale


def _ms(n: int) -> torch.Tensor:
    return 1.0 + 0.01 * torch.randn(n, device=DEVICE, dtype=torch.float32)


def _norm_calls(_tokens: list[int]) -> dict[str, Callable[[], object]]:
    calls = {}
    for name, (n, k) in WEIGHTS.items():
        w, a, b = _randn(n, k), _randn(RANK, k, scale=0.01), _randn(n, RANK, scale=0.01)
        calls[name] = lambda w=w, a=a, b=b: norm_module.dora_weight_norm(w, a, b, 2.0, torch.bfloat16)
    return calls


def _activation_calls(
    tokens: list[int], make: Callable[[int, int], Callable[[], object]]
) -> dict[str, Callable[[], object]]:
    return {f"{name} x {m}": make(m, n) for name, n in WIDTHS.items() for m in tokens}


def _scale(m: int, n: int) -> Callable[[], object]:
    z, ms = _randn(m, n), _ms(n)
    return lambda: elementwise.dora_scaled_output(z, ms, None)


def _forward(m: int, n: int) -> Callable[[], object]:
    base, zd, ms = _randn(m, n), _randn(m, n), _ms(n)
    low_rank = elementwise.LowRank(_randn(m, RANK, scale=0.01), _randn(n, RANK, scale=0.01), 2.0)
    return lambda: elementwise.dora_dropout_output(base, zd, low_rank, ms, None)  # (y over base, z over zd)


def _backward(m: int, n: int) -> Callable[[], object]:
    dy, z, ms, norm = _randn(m, n), _randn(m, n), _ms(n), _ms(n)
    return lambda: elementwise.dora_grad_terms(dy, z, ms, norm, (torch.bfloat16, None), (True, False))


def _projection(m: int, n: int) -> Any:
    return glu.ScaledProjection(_randn(m, n), _ms(n), _ms(n), None)


def _glu_forward(m: int, n: int) -> Callable[[], object]:
    gate, up = _projection(m, n), _projection(m, n)
    return lambda: glu.dora_gated_act(gate, up, "silu")


def _glu_backward(m: int, n: int) -> Callable[[], object]:
    dh, gate, up = _randn(m, n), _projection(m, n), _projection(m, n)
    dtypes = ((torch.bfloat16, None), (torch.bfloat16, None))
    return lambda: glu.dora_gated_act_grad_terms(dh, gate, up, "silu", dtypes)


KERNELS = {
    "norm": Kernel(norm_module, None, _norm_calls, per_sm=True),
    "scale": Kernel(elementwise, "scale", lambda t: _activation_calls(t, _scale), per_sm=False),
    "forward": Kernel(elementwise, "forward", lambda t: _activation_calls(t, _forward), per_sm=False),
    "backward": Kernel(elementwise, "backward", lambda t: _activation_calls(t, _backward), per_sm=True),
    "glu_forward": Kernel(glu, "forward", lambda t: _activation_calls(t, _glu_forward), per_sm=False),
    "glu_backward": Kernel(glu, "backward", lambda t: _activation_calls(t, _glu_backward), per_sm=True),
}


def _current(kernel: Kernel) -> Any:
    return kernel.module.LAUNCH if kernel.key is None else kernel.module.LAUNCH[kernel.key]


def _set(kernel: Kernel, params: Any) -> None:
    if kernel.key is None:
        kernel.module.LAUNCH = params
    else:
        kernel.module.LAUNCH[kernel.key] = params


def _variants(kernel: Kernel) -> list[Any]:
    """The module's setting first, then the space's others (32 to 128 elements a thread)."""
    current = _current(kernel)
    found = [current]
    for rows, cols, warps, programs in itertools.product(ROWS, COLS, WARPS, PROGRAMS if kernel.per_sm else (0,)):
        if not 32 <= rows * cols // (32 * warps) <= 128:
            continue
        params = current._replace(block_rows=rows, block_cols=cols, num_warps=warps)
        if kernel.per_sm:
            params = params._replace(programs_per_sm=programs)
        if params not in found:
            found.append(params)
    return found


def sweep(name: str, kernel: Kernel, tokens: list[int], top: int) -> None:
    calls = kernel.calls(tokens)
    current = _current(kernel)
    times: dict[Any, dict[str, float]] = {}
    try:
        for params in _variants(kernel):
            _set(kernel, params)
            times[params] = {shape: 1e3 * bench.time_ms(call, warmup=5, rep=20, gpu_only=True)
                             for shape, call in calls.items()}  # fmt: skip
    finally:
        _set(kernel, current)
    best = {shape: min(t[shape] for t in times.values()) for shape in calls}
    print(f"--- {name}: GPU time (us), bf16, r = {RANK}")
    print("the module's " + ", ".join(f"{s} {times[current][s]:.1f}" for s in calls))
    print("best         " + ", ".join(f"{s} {best[s]:.1f}" for s in calls))
    ranked = sorted(times, key=lambda p: max(times[p][s] / best[s] for s in calls))
    print("(block_rows, block_cols, num_warps, programs_per_sm): time / best at " + ", ".join(calls))
    for params in ranked[:top] + ([current] if current not in ranked[:top] else []):
        mark = "  <- the module's" if params == current else ""
        fields = (params.block_rows, params.block_cols, params.num_warps, params.programs_per_sm)
        print(f"{fields} " + " ".join(f"{times[params][s] / best[s]:.3f}" for s in calls) + mark)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.kernels:
        sweep(name, KERNELS[name], args.tokens, args.top)


if __name__ == "__main__":
    main()
