"""GPU time and peak memory of the trainable RMSNorm, FusedAddRMSNorm and LayerNorm forward+backward against the
number of backward programs per SM (each keeps one fp32 partial row of the weight gradient, and
of LayerNorm's bias gradient), next to Liger Kernel's in the same process. 16384 rows, bf16.

(FusedAddRMSNorm runs RMSNorm's kernels: its rows are RMSNorm's settings, backward of y alone.)

It sets the settings RMSNorm had before its backward prefetched (BWD_NARROW_PROGRAMS_PER_SM and
BWD_NARROW_COLS, gone since): it runs against fk.norms as of 10494ad, not later
(``norm_backward_prefetch_h200.txt`` is the sweep that replaced those settings).

Run on a GPU:  python benchmarks/experiments/norm_partials_probe.py [widths ...]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from fk.core import bench

ROWS = 16384


def _case(op: str, width: int) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, Callable[[], torch.Tensor]]]:
    """(leaves, dy, {provider: forward}) for ``op`` at ``width``."""
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    import fk.norms

    x = torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if op == "rms_norm":
        providers = {"fk": lambda: fk.norms.rms_norm(x, w, 1e-6),
                     "liger": lambda: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)}  # fmt: skip
        return [x, w], torch.randn_like(x), providers
    if op == "fused_add_rms_norm":
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        r = torch.randn_like(x).requires_grad_()
        providers = {"fk": lambda: fk.norms.fused_add_rms_norm(x, r, w, 1e-6)[0],
                     "liger": lambda: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", False)[0]}  # fmt: skip
        return [x, r, w], torch.randn_like(x), providers
    providers = {"fk": lambda: fk.norms.layer_norm(x, w, b, 1e-6),
                 "liger": lambda: LigerLayerNormFunction.apply(x, w, b, 1e-6)}  # fmt: skip
    return [x, w, b], torch.randn_like(x), providers


def main() -> None:
    import sys

    widths = [int(w) for w in sys.argv[1:]] or [1024, 2048, 4096, 8192]
    for op in ("rms_norm", "fused_add_rms_norm", "layer_norm"):
        module = importlib.import_module(f"fk.norms.{'rms_norm' if op == 'fused_add_rms_norm' else op}")
        defaults = {k: getattr(module, k) for k in ("BWD_PROGRAMS_PER_SM", "BWD_NARROW_PROGRAMS_PER_SM")}
        for width in widths:
            leaves, dy, providers = _case(op, width)
            name = "BWD_NARROW_PROGRAMS_PER_SM" if width <= module.BWD_NARROW_COLS else "BWD_PROGRAMS_PER_SM"
            for provider, per_sm in [("liger", None), *(("fk", n) for n in (defaults[name], 1, 2, 4, 8))]:
                if per_sm is not None:
                    setattr(module, name, per_sm)
                forward = providers[provider]

                def fwd_bwd(forward: Callable[[], torch.Tensor] = forward, dy: torch.Tensor = dy) -> None:
                    forward().backward(dy)

                ms = bench.time_ms(fwd_bwd, warmup=5, rep=30, grad_to_none=leaves, gpu_only=True)
                for t in leaves:
                    t.grad = None
                peak = bench.peak_memory_bytes(fwd_bwd) / 2**20
                for t in leaves:
                    t.grad = None
                label = provider if per_sm is None else f"fk {name}={per_sm}"
                if per_sm == defaults[name]:
                    label += " (default)"
                print(f"{op} H={width:5d} {label:44s} {ms:.4f} ms  {peak:8.2f} MB", flush=True)
            setattr(module, name, defaults[name])


if __name__ == "__main__":
    main()
