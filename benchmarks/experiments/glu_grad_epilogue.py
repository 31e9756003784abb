"""#32: the LoRA MLP's backward forms ``dh = dy Wd + (s G_d) A_d`` (``fk.lora.lora_matmul``'s input
gradient), writes it, and fk.glu's gradient pass reads it back with gate and up to write
``d gate``, ``d up`` and ``h`` (six ``[M, I]`` trips). A GEMM whose epilogue reads gate's and up's
tiles and writes the three from the fp32 ``dh`` tile never writes ``dh``: two trips less (2 x 117
MB at Llama-3.1-8B's MLP at 4096 tokens, about 55 us at the copy bandwidth, 1.3% of QLoRA's MLP;
2 x 470 MB at 16384, about 220 us). Faster than fk's two launches, and at which launch?

Semantics as fk's path: ``dh`` rounded to 16 bits first, then fk.glu's gradient formulas in fp32 on
the 16-bit ``dh``, gate and up, each output rounded once. The kernel writes ``d gate`` and ``d up``
to new buffers here (fk's MLP writes them over gate and up: the same bytes), and ``h`` to a third.
Each launch's outputs are checked against fk's path before it is timed; GPU time with the GPU
idle before each call, as ``bench_lora`` times its rows; cuBLAS's ``dy Wd`` alone beside them.

Run on a GPU:  python benchmarks/experiments/glu_grad_epilogue.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from launch_sweep import sweep

from fk.core import bench
from fk.core.launch import cdiv, dot_size, persistent_grid
from fk.core.tiles import exact_dot_add, grouped_tile_offsets, round_to
from fk.glu import activation_and_derivative, activation_code, gated_act_backward_with_value
from fk.lora.lora_matmul import GROUP_M, base_and_lora_grad, fused_grad_applies

R = 16
ACTIVATION = "silu"
SHAPES = (  # (tokens, hidden size H, intermediate size I): Llama-3.1-8B's, then Llama-3.2-1B's MLP
    (4096, 4096, 14336),
    (16384, 4096, 14336),
    (16384, 2048, 8192),
)
LAUNCHES = (  # ((BLOCK_M, BLOCK_N, BLOCK_K), stages, warps)
    ((128, 128, 64), 3, 8),
    ((128, 128, 64), 4, 8),
    ((64, 256, 64), 3, 8),
    ((128, 64, 64), 4, 4),
    ((64, 128, 64), 4, 4),
)
# (128 x 256 tiles, compiled for sm_90 on the CPU: 7484 bytes spilled and 280 KB of shared memory: left out)


@triton.jit
def _glu_grad_kernel(dy_desc, w_desc, sg_desc, a_desc, gate_desc, up_desc, dgate_desc, dup_desc, h_desc, n_rows,
                     n_cols, n_inner, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, N_PROGRAMS: tl.constexpr):  # fmt: skip
    # dh = dy Wd + sG A (Wd [H, I] read as stored), rounded to 16 bits; then, with g and u this tile
    # of gate and up: d gate = dh u act'(g), d up = dh act(g), h = act(g) u, each rounded once.
    # Persistent, the tile loop flattened into the K loop (fk.lora.lora_matmul's RANK_BY_TMA form).
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N), N_PROGRAMS,
                         flatten=True):  # fmt: skip
        off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, n_inner, BLOCK_K):
            acc = exact_dot_add(dy_desc.load([off_m, off_k]), w_desc.load([off_k, off_n]), acc)
        acc = exact_dot_add(sg_desc.load([off_m, 0]), a_desc.load([0, off_n]), acc)
        dh = round_to(acc, dgate_desc.dtype).to(tl.float32)
        g = gate_desc.load([off_m, off_n]).to(tl.float32)
        act, grad = activation_and_derivative(g, ACTIVATION)
        u = up_desc.load([off_m, off_n]).to(tl.float32)
        dup_desc.store([off_m, off_n], round_to(dh * act, dup_desc.dtype))
        h_desc.store([off_m, off_n], round_to(act * u, h_desc.dtype))
        dgate_desc.store([off_m, off_n], round_to(dh * u * grad, dgate_desc.dtype))


def glu_grad(dy, wd, sg, lora_a, gate, up, *, tile=(128, 128, 64), num_stages=3, num_warps=8):  # type: ignore[no-untyped-def]
    """(d gate, d up, h) by the kernel: ``dy`` ``[M, H]``, ``Wd`` ``[H, I]``, ``s G`` ``[M, r]``,
    ``A_d`` ``[r, I]``, gate and up ``[M, I]``, all in one 16-bit dtype and TMA-ready."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_rows, n_inner = dy.shape
    n_cols = wd.shape[1]
    block_m, block_n, block_k = tile
    block_rank = dot_size(sg.shape[1])
    dgate, dup, h = (torch.empty_like(gate) for _ in range(3))
    programs = persistent_grid(cdiv(n_rows, block_m) * cdiv(n_cols, block_n), dy.device)

    def desc(t: torch.Tensor, block: list[int]):  # type: ignore[no-untyped-def]
        return TensorDescriptor.from_tensor(t, block)

    out = [block_m, block_n]
    _glu_grad_kernel[(programs,)](
        desc(dy, [block_m, block_k]), desc(wd, [block_k, block_n]), desc(sg, [block_m, block_rank]),
        desc(lora_a, [block_rank, block_n]), desc(gate, out), desc(up, out), desc(dgate, out), desc(dup, out),
        desc(h, out), n_rows, n_cols, n_inner, ACTIVATION=activation_code(ACTIVATION), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, N_PROGRAMS=programs, num_stages=num_stages,
        num_warps=num_warps,
    )  # fmt: skip
    return dgate, dup, h


def _operands(m: int, hidden: int, inter: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(m + hidden + inter)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return [randn(m, hidden), randn(hidden, inter, std=hidden**-0.5), randn(m, R), randn(R, inter, std=0.1),
            randn(m, inter), randn(m, inter)]  # fmt: skip


def fk_path(dy, wd, sg, lora_a, gate, up):  # type: ignore[no-untyped-def]
    """fk's LoRA MLP backward as it runs (its buffers new, not over gate and up): ``dh`` by
    ``lora_matmul``'s input gradient where it applies, else cuBLAS (as ``fk.lora.lora``), then
    fk.glu's gradient pass with ``h``."""
    if fused_grad_applies(dy, wd, sg, lora_a):
        dh = base_and_lora_grad(dy, wd, sg, lora_a)
    else:
        dh = torch.mm(sg, lora_a).addmm_(dy, wd)
    dgate, dup, h, _ = gated_act_backward_with_value(dh, gate, up, ACTIVATION)
    return dgate, dup, h


def _check(got, want, what: str) -> None:  # type: ignore[no-untyped-def]
    for name, g, w in zip(("d gate", "d up", "h"), got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2, msg=f"{name} {what}")


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    t = _operands(96, 128, 160, device, dtype)
    for launch in (((32, 32, 32), 2, 4), ((32, 64, 32), 2, 4)):
        tile, stages, warps = launch
        _check(glu_grad(*t, tile=tile, num_stages=stages, num_warps=warps), fk_path(*t), str(launch))
    print("glu_grad at other launches: within rounding of fk's path (d gate, d up, h)")


def timings() -> None:
    for m, hidden, inter in SHAPES:
        t = _operands(m, hidden, inter, "cuda", torch.bfloat16)
        print(f"== {m} tokens, dh = dy Wd: Wd {hidden} x {inter}, r = {R}", flush=True)
        sweep(
            2 * m * hidden * inter,
            ("cuBLAS: dy Wd alone", lambda: t[0] @ t[1]),  # noqa: B023
            ("fk's path (lora_matmul + pass)", lambda: fk_path(*t)),  # noqa: B023
            LAUNCHES,
            lambda **launch: glu_grad(*t, **launch),  # noqa: B023
            _check,
        )


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
