"""Host (CPU) time per call of fk's RMSNorm, piece by piece: where the microseconds go.

At small sizes a kernel's GPU time is a few microseconds and the host path decides the speed:
validation, the autograd.Function, allocations, the Triton launch, the autograd engine. This
script times each piece on a tiny problem (16 x 1024), so the GPU is never the bottleneck.

- On a GPU: real launches, wall-clock per call after synchronizing (what the GPU machine's CPU
  costs).
- Without one (``--stub``, the default there): the Triton kernels are replaced by no-ops and CPU
  tensors take the kernel path, so the Python around the launches is measured alone.

Run:  python benchmarks/host_overhead.py
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable

import torch

import fk.core.backend as backend


def wall_us(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> float:
    for _ in range(max(10, n // 20)):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n * 1e6


class _NoLaunch:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stub", action="store_true", help="stub the kernels out (default without a GPU)")
    parser.add_argument("-n", type=int, default=2000, help="calls per measurement")
    args = parser.parse_args()
    module = importlib.import_module("fk.norms.rms_norm")
    stub = args.stub or not torch.cuda.is_available()
    device = "cpu" if stub else "cuda"
    if stub:
        module._rms_norm_fwd_kernel = _NoLaunch()  # type: ignore[attr-defined]
        module._rms_norm_bwd_kernel = _NoLaunch()  # type: ignore[attr-defined]
        backend.INTERPRETER_ON = True  # CPU tensors take the kernel path (whose launches are stubs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(16, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    xd, wd = x.detach(), w.detach()
    _, rstd = module._rms_norm_fwd(xd, wd, 1e-6, 0.0, False, False)
    rows = [
        ("torch.empty", lambda: torch.empty(16, 1024, device=device, dtype=torch.bfloat16)),
        ("one aten op (x + 1)", lambda: xd + 1),
        ("forward launcher", lambda: module._rms_norm_fwd(xd, wd, 1e-6, 0.0, False, False)),
        ("backward launcher", lambda: module._rms_norm_bwd(dy, xd, wd, rstd, 0.0, True)),
        ("rms_norm forward (no grad)", lambda: module.rms_norm(xd, wd)),
        ("rms_norm forward (grad)", lambda: module.rms_norm(x, w)),
        ("rms_norm forward+backward", lambda: module.rms_norm(x, w).backward(dy)),
        ("engine floor: (x * 2) fwd+bwd", lambda: (x * 2).backward(dy)),
    ]
    if not stub:
        rows.append(("F.rms_norm fwd+bwd", lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6).backward(dy)))
    print(f"host time per call, {'stubbed kernels on CPU' if stub else torch.cuda.get_device_name()}")
    for name, fn in rows:
        print(f"{name:32s} {wall_us(fn, args.n, sync):8.1f} us")


if __name__ == "__main__":
    main()
