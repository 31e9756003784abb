"""#32, after ``triton_base_gemm``: Triton's persistent TMA GEMM runs the base products of
Llama-3.1-8B's attention at 4096 tokens as fast as cuBLAS (``x W^T`` 179 against 176 us, ``dy W``
178 against 189), but adding ``s u B^T`` after its K loop cost 45 us, as much as cuBLAS's separate
product and ``addmm``. Where in the kernel does the LoRA term cost nothing, and what do the
backward's masked terms cost there? Each against what fk runs now (cuBLAS and fk's masked pass):

- forward, ``y = x W^T + s u B^T`` (``u = x A^T``, ``[M, r]``): fk's ``mm`` of the rank product
  and ``addmm`` (beta = 1) against the GEMM with the rank product as the accumulator's first MMA
  (``lora_first``) or its last (``lora_last``);
- LoRA's input gradient, ``dx = dy W + f m (G A)`` (``G = s dy B``, ``m`` the dropout mask): fk's
  ``mm`` and ``fk.lora.masked_low_rank`` against the GEMM adding the masked term in its epilogue
  (``masked``);
- DoRA's, ``dx += f m (dy_ms1 W + G A)``: fk's ``mm`` (the addend) and masked pass against the GEMM
  masking its own product, adding ``dx`` through TMA (``masked_accumulate``): no ``[M, K]`` addend
  written, none held;
- the GEMM alone (``none``);

each with the tile loop flattened into the K loop (``tl.range(flatten=True)``, as Triton's
persistent tutorials do) and not, at 4096 and 16384 tokens, W 4096 x 4096 (q, O) and 1024 x 4096
(k, v), r = 16, bf16, p = 0.05; GPU time (median of ``triton.testing.do_bench``, L2 flushed) and
TFLOP/s of the base product.

Run on a GPU:  python benchmarks/experiments/gemm_lora_epilogues.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from triton_base_gemm import CONFIGS, SHAPES

from fk.core import bench
from fk.core.launch import multiprocessor_count
from fk.lora import masked_low_rank

R, P = 16, 0.05
EPILOGUES = ("none", "lora_first", "lora_last", "masked", "masked_accumulate")
VARIANTS = [
    (epilogue, flatten) for epilogue in EPILOGUES for flatten in (True, False) if epilogue != "lora_first" or flatten
]
"""(epilogue, flatten): whether the tile loop is flattened into the K loop (``tl.range(flatten=...)``)."""


@triton.jit
def _epilogue_gemm_kernel(a_desc, b_desc, c_desc, u_ptr, v_ptr, mask_ptr, scale, factor, n_rows, n_cols, n_inner,
                          B_TRANSPOSED: tl.constexpr, EPILOGUE: tl.constexpr, FLATTEN: tl.constexpr, RANK: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          N_PROGRAMS: tl.constexpr):  # fmt: skip
    # C = A B (B given as [N, K] when B_TRANSPOSED) with a rank-r term u v (u [M, r], v [r, N]):
    # none: C = A B; lora_*: + scale u v; masked: + factor m (u v); masked_accumulate: C += factor m (A B + u v).
    tiles_m, tiles_n = tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N)
    k_steps = tl.cdiv(n_inner, BLOCK_K)
    in_group = GROUP_M * tiles_n
    ks = tl.arange(0, RANK)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, N_PROGRAMS, flatten=FLATTEN):
        group = tile // in_group
        first_m = group * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % in_group) % group_m
        tile_n = (tile % in_group) // group_m
        off_m, off_n = tile_m * BLOCK_M, tile_n * BLOCK_N
        rows = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = off_n + tl.arange(0, BLOCK_N)
        u = tl.load(u_ptr + rows[:, None] * RANK + ks[None, :], mask=rows[:, None] < n_rows, other=0.0)
        v = tl.load(v_ptr + ks[:, None] * n_cols + cols[None, :], mask=cols[None, :] < n_cols, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EPILOGUE == "lora_first":
            acc = tl.dot((u * scale).to(u.dtype), v, acc)
        for step in range(k_steps):
            off_k = step * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_TRANSPOSED:
                acc = tl.dot(a, b_desc.load([off_n, off_k]).T, acc)
            else:
                acc = tl.dot(a, b_desc.load([off_k, off_n]), acc)
        if EPILOGUE == "lora_last":
            acc = tl.dot((u * scale).to(u.dtype), v, acc)
        if EPILOGUE == "masked" or EPILOGUE == "masked_accumulate":
            ok = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
            keep = tl.load(mask_ptr + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0) != 0
            if EPILOGUE == "masked":
                acc += tl.where(keep, factor * tl.dot(u, v), 0.0)
            else:
                acc = tl.where(keep, factor * tl.dot(u, v, acc), 0.0)
                acc += c_desc.load([off_m, off_n]).to(tl.float32)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def epilogue_mm(a: torch.Tensor, b: torch.Tensor, b_transposed: bool, epilogue: str, u: torch.Tensor, v: torch.Tensor,
                config: tuple[int, ...], *, flatten: bool = True, scale: float = 1.0, mask: torch.Tensor | None = None, factor: float = 1.0,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``a @ b(.T)`` with the rank-``r`` term of ``epilogue`` (see the kernel); ``out`` is ``C``
    (read by ``masked_accumulate``, written by all)."""
    bm, bn, bk, stages, warps, group_m = config
    m = a.shape[0]
    n = b.shape[0] if b_transposed else b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device) if out is None else out
    programs = min(multiprocessor_count(a.device), triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _epilogue_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]),
        TensorDescriptor.from_tensor(b, [bn, bk] if b_transposed else [bk, bn]),
        TensorDescriptor.from_tensor(c, [bm, bn]), u, v, c if mask is None else mask, scale, factor, m, n,
        a.shape[1], B_TRANSPOSED=b_transposed, EPILOGUE=epilogue, FLATTEN=flatten, RANK=u.shape[1], BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=group_m, N_PROGRAMS=programs, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return c


def _inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Forward: x [M, K], W [N, K], u [M, r], B^T [r, N]. Backward (the gradient of x, [M, K] from
    dy [M, N]): G [M, r], A [r, K], the mask [M, K], dx [M, K]."""
    gen = torch.Generator(device=device).manual_seed(m + n + k)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return {"x": randn(m, k), "w": randn(n, k, std=k**-0.5), "u": randn(m, R), "b_t": randn(R, n, std=0.1),
            "dy": randn(m, n), "g": randn(m, R), "a": randn(R, k, std=0.1), "dx": randn(m, k),
            "mask": torch.rand(m, k, device=device, generator=gen) >= P}  # fmt: skip


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    f = 1 / (1 - P)
    for m, n, k in ((40, 48, 80), (130, 64, 96)):
        t = _inputs(m, n, k, device, dtype)
        d = {name: value.double() for name, value in t.items()}
        config = (32, 32, 32, 2, 4, 2)
        want_fwd = d["x"] @ d["w"].t() + 0.5 * d["u"] @ d["b_t"]
        for epilogue in ("lora_first", "lora_last"):
            got = epilogue_mm(t["x"], t["w"], True, epilogue, t["u"], t["b_t"], config, scale=0.5)
            torch.testing.assert_close(got.double(), want_fwd, rtol=2e-2, atol=2e-2, msg=epilogue)
        got = epilogue_mm(t["x"], t["w"], True, "none", t["u"], t["b_t"], config, flatten=False)
        torch.testing.assert_close(got.double(), d["x"] @ d["w"].t(), rtol=2e-2, atol=2e-2, msg="none")
        got = epilogue_mm(t["dy"], t["w"], False, "masked", t["g"], t["a"], config, mask=t["mask"], factor=f)
        want = d["dy"] @ d["w"] + f * d["mask"] * (d["g"] @ d["a"])
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2, msg="masked")
        got = epilogue_mm(t["dy"], t["w"], False, "masked_accumulate", t["g"], t["a"], config, mask=t["mask"],
                          factor=f, out=t["dx"].clone())  # fmt: skip
        want = d["dx"] + f * d["mask"] * (d["dy"] @ d["w"] + d["g"] @ d["a"])
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2, msg="masked_accumulate")
    print("epilogue_mm: within rounding of float64 (" + ", ".join(EPILOGUES) + ")")


def ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, rep=40, return_mode="median"))


def timings() -> None:
    f = 1 / (1 - P)
    for label, m, n, k in SHAPES:
        t = _inputs(m, n, k, "cuda", torch.bfloat16)
        x, w, u, b_t, dy, g, a, mask = (t[name] for name in ("x", "w", "u", "b_t", "dy", "g", "a", "mask"))
        dx = t["dx"]
        flops = 2 * m * n * k
        print(f"== {label}: {m} tokens, W {n} x {k}, {flops / 1e9:.0f} GFLOP the base product", flush=True)

        def row(what: str, t: float) -> None:
            print(f"  {what:66s} {t * 1e3:7.1f} us  {flops / t / 1e9:6.0f} TFLOP/s", flush=True)  # noqa: B023

        def lora_bwd() -> None:
            masked_low_rank.add_masked_low_rank_(torch.mm(dy, w), g, a, mask, f)  # noqa: B023

        def dora_bwd() -> None:
            masked_low_rank.add_masked_low_rank_(dx, g, a, mask, f, addend=torch.mm(dy, w))  # noqa: B023

        row("cuBLAS x W^T alone", ms(lambda: torch.mm(x, w.t())))  # noqa: B023
        row("cuBLAS dy W alone", ms(lambda: torch.mm(dy, w)))  # noqa: B023
        row("fk now, forward: mm(u, B^T), addmm(., x, W^T)", ms(lambda: torch.addmm(torch.mm(u, b_t), x, w.t())))  # noqa: B023
        row("fk now, LoRA dx: mm(dy, W), masked pass", ms(lora_bwd))
        row("fk now, DoRA dx: mm(dy, W) (addend), masked pass", ms(dora_bwd))
        best: dict[str, tuple[float, tuple[int, ...]]] = {}
        for config in CONFIGS:
            for epilogue, flatten in VARIANTS:
                if epilogue.startswith("masked"):
                    fn = lambda: epilogue_mm(dy, w, False, epilogue, g, a, config, flatten=flatten, mask=mask,  # noqa: B023, E731
                                             factor=f, out=dx)  # fmt: skip # noqa: B023
                else:
                    fn = lambda: epilogue_mm(x, w, True, epilogue, u, b_t, config, flatten=flatten, scale=2.0)  # noqa: B023, E731
                try:
                    t_ms = ms(fn)
                except (triton.runtime.errors.OutOfResources, RuntimeError) as error:
                    print(f"  {epilogue} {config}: {type(error).__name__}")
                    continue
                what = f"{epilogue}{'' if flatten else ' unflattened'}"
                row(f"triton {what} {config}", t_ms)
                if what not in best or t_ms < best[what][0]:
                    best[what] = (t_ms, config)
        for what, (t_ms, config) in best.items():
            row(f"best triton {what} {config}", t_ms)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
