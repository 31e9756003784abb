"""#32's QKV rows (plain LoRA and QLoRA, bf16 adapters) trail 1.5x PEFT by 3-14%, with the base
GEMMs at the ceiling: what would other orders of the base and rank-16 products save? At Llama-3.1-8B's
q/k/v (K = 4096; N = 4096, 1024, 1024; r = 16, bf16), GPU time alone of each variant of the
forward's products and of the input gradient's, against fk's whole QKV forward+backward
(``fk.lora.lora_qkv``, dense bf16 base, no dropout) in the same run:

forward (``y_i = x W_i^T + s xa_i B_i^T``, ``xa = x A^T`` of the three ``A`` stacked, given):
- ``base, then low`` (fk's order): each ``y_i = x W_i^T``, then ``y_i += s xa_i B_i^T`` (a second
  pass over ``y_i``);
- ``low, then base``: ``y_i = s xa_i B_i^T``, then ``y_i += x W_i^T`` (the base GEMM reads ``y_i``
  in its epilogue);
- ``one base GEMM``: the three ``W`` as one ``[6144, 4096]`` (a 4-bit base is dequantized into such a
  buffer at no extra cost; a dense one would be copied: its time is printed apart), ``y = x W^T``
  once, then the three low-rank terms into views of ``y``; and the same with the low term first.

input gradient (``dx = sum_i dy_i W_i + sG A``, ``sG`` ``[M, 48]`` and ``A`` ``[48, K]`` stacked):
- ``base, then low`` (fk's): ``dx = dy_q W_q``, ``+= dy_k W_k``, ``+= dy_v W_v``, ``+= sG A``;
- ``low, then base``: ``dx = sG A``, then the three base terms added;
- ``one GEMM``: ``[dy_q | dy_k | dy_v | sG]`` copied into one ``[M, 6192]`` buffer (timed with it)
  against ``[W_q; W_k; W_v; A]`` ``[6192, K]``, one product.

Run on a GPU:  python benchmarks/experiments/lora_qkv_orders.py   (output: lora_qkv_orders_h200.txt)
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from fk.core import bench
from fk.lora import LoRAWeights, lora_qkv

K, NS, R, S = 4096, (4096, 1024, 1024), 16, 2.0
TOKENS = (4096, 16384)


def gpu_ms(fn: object) -> float:
    return bench.time_ms(fn, warmup=10, rep=50, gpu_only=True)  # type: ignore[arg-type]


def main() -> None:
    print(f"# {bench.environment()}")
    dev, c = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=c, generator=gen) * scale

    Ws = [randn(n, K, scale=K**-0.5) for n in NS]
    As = [randn(R, K, scale=K**-0.5) for _ in NS]
    Bs = [randn(n, R, scale=R**-0.5) for n in NS]
    for m in TOKENS:
        one_size(m, Ws, As, Bs, randn)


def one_size(m: int, Ws: list[torch.Tensor], As: list[torch.Tensor], Bs: list[torch.Tensor], randn: Any) -> None:
    """Times and prints every variant at ``m`` tokens."""
    dev, c = Ws[0].device, Ws[0].dtype
    W_cat = torch.cat(Ws)
    WA_cat = torch.cat([*Ws, *As])
    A_cat = torch.cat(As)
    x = randn(m, K)
    xa = randn(m, 3 * R)
    xas = list(xa.split(R, dim=1))
    dys = [randn(m, n) for n in NS]
    sg = randn(m, 3 * R)
    ys = [torch.empty(m, n, device=dev, dtype=c) for n in NS]
    y = torch.empty(m, sum(NS), device=dev, dtype=c)
    y_views = list(y.split(list(NS), dim=1))
    dx = torch.empty(m, K, device=dev, dtype=c)
    dy_cat = torch.empty(m, sum(NS) + 3 * R, device=dev, dtype=c)

    def fwd_base_low() -> None:
        for yi, w, xai, b in zip(ys, Ws, xas, Bs, strict=True):
            torch.mm(x, w.t(), out=yi)
            yi.addmm_(xai, b.t(), alpha=S)

    def fwd_low_base() -> None:
        for yi, w, xai, b in zip(ys, Ws, xas, Bs, strict=True):
            torch.addmm(yi, xai, b.t(), beta=0, alpha=S, out=yi)
            yi.addmm_(x, w.t())

    def fwd_one_base() -> None:
        torch.mm(x, W_cat.t(), out=y)
        for yi, xai, b in zip(y_views, xas, Bs, strict=True):
            yi.addmm_(xai, b.t(), alpha=S)

    def fwd_one_base_low_first() -> None:
        for yi, xai, b in zip(y_views, xas, Bs, strict=True):
            torch.addmm(yi, xai, b.t(), beta=0, alpha=S, out=yi)
        y.addmm_(x, W_cat.t())

    def bwd_base_low() -> None:
        torch.mm(dys[0], Ws[0], out=dx)
        dx.addmm_(dys[1], Ws[1])
        dx.addmm_(dys[2], Ws[2])
        dx.addmm_(sg, A_cat)

    def bwd_low_base() -> None:
        torch.mm(sg, A_cat, out=dx)
        for dyi, w in zip(dys, Ws, strict=True):
            dx.addmm_(dyi, w)

    def bwd_one() -> None:
        torch.cat([*dys, sg], dim=1, out=dy_cat)
        torch.mm(dy_cat, WA_cat, out=dx)

    def copy_weights() -> None:
        torch.cat(Ws, out=W_cat)

    parts = [torch.nn.Parameter(t.clone()) for t in (*As, *Bs)]
    xg = x.clone().requires_grad_(True)
    weights = [LoRAWeights(w, None, parts[i], parts[3 + i], S) for i, w in enumerate(Ws)]

    def fk_qkv() -> None:
        q, k, v = lora_qkv(xg, *weights)
        torch.autograd.backward((q, k, v), dys)

    whole = gpu_ms(fk_qkv)
    print(f"\nM = {m}: fk.lora.lora_qkv forward+backward (dense bf16 base, bf16 adapters, no dropout) {whole:.3f} ms")
    base_f, base_b = gpu_ms(fwd_base_low), gpu_ms(bwd_base_low)
    for label, fn, ref in [
        ("forward: base, then low (fk)", fwd_base_low, base_f),
        ("forward: low, then base", fwd_low_base, base_f),
        ("forward: one base GEMM, then low", fwd_one_base, base_f),
        ("forward: low, then one base GEMM", fwd_one_base_low_first, base_f),
        ("input gradient: base, then low (fk)", bwd_base_low, base_b),
        ("input gradient: low, then base", bwd_low_base, base_b),
        ("input gradient: one GEMM (dy copied in)", bwd_one, base_b),
        ("(a dense base: the three W copied into one)", copy_weights, None),
    ]:
        t = base_f if fn is fwd_base_low else base_b if fn is bwd_base_low else gpu_ms(fn)
        saved = "" if ref is None else f"  saves {ref - t:+.3f} ms ({(ref - t) / whole:+.1%} of fk's QKV)"
        print(f"  {label:46s} {t:7.3f} ms{saved}")
    # the same values, so the variants compute one thing (bf16 roundings aside)
    fwd_base_low()
    ref_y = torch.cat(ys, dim=1).float()
    fwd_one_base_low_first()
    bwd_base_low()
    ref_dx = dx.float()
    bwd_one()
    print(f"  max |difference|: forward {(y.float() - ref_y).abs().max().item():.3g} "
          f"(of {ref_y.abs().max().item():.3g}), input gradient {(dx.float() - ref_dx).abs().max().item():.3g} "
          f"(of {ref_dx.abs().max().item():.3g})")  # fmt: skip


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    main()
