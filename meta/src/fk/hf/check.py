"""The fk kernel check: every installed fk kernel on a small problem, checked against its reference.

    python -m fk.hf.check            (or: nox -s check)

On a machine without a GPU the kernels run in Triton's interpreter (switched on here, before
Triton is imported); on a GPU they run compiled, and each is also timed (forward+backward)
against the eager PyTorch code it replaces. Each row compares fk's outputs and gradients with a
float64 evaluation of the reference, next to the error PyTorch itself makes at that dtype.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

if not torch.cuda.is_available():  # must happen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Case:
    """One row of the check: a kernel, the inputs it is shown on, and the code it replaces."""

    name: str
    module: str  # the fk module that must be importable for this row
    shape: str
    make: Callable[[str, torch.dtype], tuple[Callable[..., Any], Callable[..., Any], list[Any]]]
    """(device, dtype) -> (fk function, eager reference function, inputs)."""


def _rms_norm(
    casting_mode: str,
) -> Callable[[str, torch.dtype], tuple[Callable[..., Any], Callable[..., Any], list[Any]]]:
    def make(device: str, dtype: torch.dtype) -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
        from fk.core.testing import random_tensor
        from fk.norms import rms_norm, rms_norm_ref

        rows, width = (8192, 4096) if device == "cuda" else (64, 1000)
        x = random_tensor((rows, width), dtype, device, seed=0, requires_grad=True)
        w = random_tensor((width,), dtype, device, seed=1, offset=1.0, scale=0.1, requires_grad=True)
        return (
            lambda x, w: rms_norm(x, w, 1e-6, casting_mode=casting_mode),
            lambda x, w: rms_norm_ref(x, w, 1e-6, casting_mode),
            [x, w],
        )

    return make


def _rope(device: str, dtype: torch.dtype) -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
    from fk.core.testing import random_tensor
    from fk.rope import rope, rope_ref

    batch, seq, q_heads, k_heads, dim = (2, 2048, 32, 8, 128) if device == "cuda" else (1, 33, 4, 2, 64)
    q = random_tensor((batch, q_heads, seq, dim), dtype, device, seed=2, requires_grad=True)
    k = random_tensor((batch, k_heads, seq, dim), dtype, device, seed=3, requires_grad=True)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), 1e4 ** (-torch.arange(0, dim, 2) / dim))
    angles = torch.cat((angles, angles), dim=-1)[None]
    cos, sin = angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)
    return (
        lambda q, k: torch.cat([t.flatten() for t in rope(q, k, cos, sin)]),
        # The reference also runs on float64 CPU copies of q and k: bring cos and sin along.
        lambda q, k: torch.cat(
            [t.flatten() for t in rope_ref(q, k, cos.to(q.device, q.dtype), sin.to(q.device, q.dtype))]
        ),
        [q, k],
    )


def _glu(
    approximate: str | None,
) -> Callable[[str, torch.dtype], tuple[Callable[..., Any], Callable[..., Any], list[Any]]]:
    def make(device: str, dtype: torch.dtype) -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
        from fk.core.testing import random_tensor
        from fk.glu import geglu, geglu_ref, swiglu, swiglu_ref

        rows, width = (8192, 14336) if device == "cuda" else (64, 1000)
        gate = random_tensor((rows, width), dtype, device, seed=4, requires_grad=True)
        up = random_tensor((rows, width), dtype, device, seed=5, requires_grad=True)
        if approximate is None:
            return swiglu, swiglu_ref, [gate, up]
        return (lambda a, b: geglu(a, b, approximate)), (lambda a, b: geglu_ref(a, b, approximate)), [gate, up]

    return make


def _layer_norm(device: str, dtype: torch.dtype) -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
    from fk.core.testing import random_tensor
    from fk.norms import layer_norm, layer_norm_ref

    rows, width = (8192, 4096) if device == "cuda" else (64, 1000)
    x = random_tensor((rows, width), dtype, device, seed=6, requires_grad=True)
    w = random_tensor((width,), dtype, device, seed=7, offset=1.0, scale=0.1, requires_grad=True)
    b = random_tensor((width,), dtype, device, seed=8, scale=0.1, requires_grad=True)
    return (lambda x, w, b: layer_norm(x, w, b, 1e-5)), (lambda x, w, b: layer_norm_ref(x, w, b, 1e-5)), [x, w, b]


def _labels(n: int, vocab: int, device: str) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(9))
    labels[::7] = -100
    return labels.to(device)


def _cross_entropy(device: str, dtype: torch.dtype) -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
    from fk.core.testing import random_tensor
    from fk.flce import cross_entropy, cross_entropy_ref

    rows, vocab = (8192, 32000) if device == "cuda" else (33, 1000)
    logits = random_tensor((rows, vocab), dtype, device, seed=10, scale=2.0, requires_grad=True)
    labels = _labels(rows, vocab, device)
    return (
        lambda x: cross_entropy(x, labels.to(x.device), label_smoothing=0.1),
        lambda x: cross_entropy_ref(x, labels.to(x.device), label_smoothing=0.1).loss,
        [logits],
    )


def _linear_cross_entropy(device: str, dtype: torch.dtype) -> tuple[Callable[..., Any], Callable[..., Any], list[Any]]:
    from fk.core.testing import random_tensor
    from fk.flce import linear_cross_entropy, linear_cross_entropy_ref

    tokens, hidden, vocab = (512, 1024, 32000) if device == "cuda" else (33, 64, 1000)
    h = random_tensor((tokens, hidden), dtype, device, seed=11, requires_grad=True)
    w = random_tensor((vocab, hidden), dtype, device, seed=12, scale=hidden**-0.5, requires_grad=True)
    labels = _labels(tokens, vocab, device)
    return (
        lambda h, w: linear_cross_entropy(h, w, labels.to(h.device)),
        # fk's loss is fp32 whatever the input dtype: compare at that precision.
        lambda h, w: linear_cross_entropy_ref(h, w, labels.to(h.device)).loss.to(
            torch.promote_types(h.dtype, torch.float32)
        ),
        [h, w],
    )


CASES: list[Case] = [
    Case("RMSNorm (llama)", "fk.norms", "rows x 4096 / 64 x 1000", _rms_norm("llama")),
    Case("RMSNorm (gemma)", "fk.norms", "rows x 4096 / 64 x 1000", _rms_norm("gemma")),
    Case("SwiGLU", "fk.glu", "8192 x 14336 / 64 x 1000", _glu(None)),
    Case("GeGLU (tanh)", "fk.glu", "8192 x 14336 / 64 x 1000", _glu("tanh")),
    Case("RoPE (q and k, GQA)", "fk.rope", "2 x 32/8 x 2048 x 128 / 1 x 4/2 x 33 x 64", _rope),
    Case("LayerNorm", "fk.norms", "8192 x 4096 / 64 x 1000", _layer_norm),
    Case("Cross entropy", "fk.flce", "8192 x 32000 / 33 x 1000", _cross_entropy),
    Case("Linear + cross entropy", "fk.flce", "512 x 1024 x 32000 / 33 x 64 x 1000", _linear_cross_entropy),
]


def available_cases() -> list[Case]:
    """The rows whose fk package is installed."""
    return [c for c in CASES if importlib.util.find_spec(c.module) is not None]


def _time_ms(fn: Callable[..., Any], args: list[Any]) -> float:
    from fk.core import bench

    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def step() -> None:
        out = fn(*args)
        out.backward(torch.ones_like(out))

    return bench.time_ms(step, warmup=10, rep=50, grad_to_none=leaves)


def run(dtypes: list[torch.dtype]) -> list[dict[str, Any]]:
    from fk.core.backend import kernel_path
    from fk.core.testing import compare_with_reference, dtype_name

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[dict[str, Any]] = []
    for case in available_cases():
        for dtype in dtypes:
            fk_fn, ref_fn, args = case.make(device, dtype)
            start = time.perf_counter()
            row: dict[str, Any] = {"kernel": case.name, "dtype": dtype_name(dtype), "path": kernel_path(args[0]).value}
            try:
                result = compare_with_reference(fk_fn, ref_fn, args)
                row["max abs error"] = max(result.errors)
                row["check"] = "ok"
            except AssertionError as exc:
                row["max abs error"] = float("nan")
                row["check"] = f"FAILED: {exc}"
            row["seconds"] = time.perf_counter() - start
            if device == "cuda":
                fk_ms, eager_ms = _time_ms(fk_fn, args), _time_ms(ref_fn, args)
                row.update({"fk ms": fk_ms, "eager ms": eager_ms, "speedup": eager_ms / fk_ms})
            rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [" | ".join(columns), " | ".join("---" for _ in columns)]
    lines += [" | ".join(cell(r.get(c, "")) for c in columns) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "float16", "bfloat16"]
    )
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes]
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"
    print(f"fk kernel check on {where}: each kernel's outputs and gradients against a float64 reference")
    rows = run(dtypes)
    if not rows:
        print("no fk kernel package is installed")
        return 1
    print(_table(rows))
    failed = [r for r in rows if r["check"] != "ok"]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
