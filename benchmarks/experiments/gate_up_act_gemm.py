"""#32: the LoRA MLP's forward writes gate and up (``fk.lora.lora_matmul``, one GEMM each with the
rank term in its epilogue), then fk.glu's pass reads both back and writes ``h = act(gate) up``: of
those five ``[M, I]`` trips, the pass's two reads need not exist. One persistent TMA GEMM with two
fp32 accumulators fed by one ``x`` tile (gate's and up's ``W`` tiles, as ``fk.lora.dora_dropout_matmul``
feeds two from one ``W`` tile), each taking its rank term ``s xa B^T`` by one more MMA, writes gate,
up (which the backward keeps) and ``h`` from its epilogue: three trips. At Llama-3.1-8B's MLP that
is 2 x 117 MB less at 4096 tokens (about 55 us at the copy bandwidth, 1.3% of QLoRA's MLP) and
2 x 470 MB at 16384 (about 220 us). Faster than fk's three launches, and at which launch?

Semantics as fk's path: gate and up rounded to 16 bits first, ``h`` formed from the rounded values
in fp32 and rounded once (fk.glu's forward). Each launch's outputs are checked against fk's path
before it is timed; GPU time with the GPU idle before each call, as ``bench_lora`` times its rows;
cuBLAS's two base products alone beside them.

Run on a GPU:  python benchmarks/experiments/gate_up_act_gemm.py
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
from fk.glu import activation_and_derivative, activation_code, gated_act_forward
from fk.lora.lora_matmul import GROUP_M
from fk.lora.projection import lora_and_base_out

R = 16
SCALING = 2.0
ACTIVATION = "silu"
SHAPES = (  # (tokens, intermediate size I, hidden size K): Llama-3.1-8B's, then Llama-3.2-1B's MLP
    (4096, 14336, 4096),
    (16384, 14336, 4096),
    (16384, 8192, 2048),
)
LAUNCHES = (  # ((BLOCK_M, BLOCK_N, BLOCK_K), stages, warps)
    ((128, 128, 64), 3, 8),
    ((128, 128, 64), 2, 8),
    ((128, 128, 32), 4, 8),
    ((64, 256, 64), 3, 8),
    ((128, 64, 64), 4, 4),
)


@triton.jit
def _gate_up_act_kernel(x_desc, wg_desc, wu_desc, xag_desc, bg_desc, xau_desc, bu_desc, g_desc, u_desc, h_desc,
                        scaling_g, inv_scaling_g, scaling_u, inv_scaling_u, n_rows, n_cols, n_inner,
                        ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, N_PROGRAMS: tl.constexpr):  # fmt: skip
    # gate = x Wg^T + s_g xa_g Bg^T and up likewise from one x tile a K step; h = act(gate) up from
    # their 16-bit values. Persistent, the tile loop flattened into the K loop (fk.lora.lora_matmul's
    # RANK_BY_TMA form); TMA reads past the edges as zeros and clips the stores.
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N), N_PROGRAMS,
                         flatten=True):  # fmt: skip
        off_m, off_n = grouped_tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, n_inner, BLOCK_K):
            x = x_desc.load([off_m, off_k])
            gate = exact_dot_add(x, wg_desc.load([off_n, off_k]).T, gate)
            up = exact_dot_add(x, wu_desc.load([off_n, off_k]).T, up)
        gate = exact_dot_add(xag_desc.load([off_m, 0]), bg_desc.load([off_n, 0]).T, gate * inv_scaling_g) * scaling_g
        gate_c = round_to(gate, g_desc.dtype)  # (each rounded and stored before the next is formed: registers)
        g_desc.store([off_m, off_n], gate_c)
        up = exact_dot_add(xau_desc.load([off_m, 0]), bu_desc.load([off_n, 0]).T, up * inv_scaling_u) * scaling_u
        up_c = round_to(up, u_desc.dtype)
        u_desc.store([off_m, off_n], up_c)
        act, _ = activation_and_derivative(gate_c.to(tl.float32), ACTIVATION)
        h_desc.store([off_m, off_n], round_to(act * up_c.to(tl.float32), h_desc.dtype))


def gate_up_act(x, wg, wu, xa_g, b_g, xa_u, b_u, *, tile=(128, 128, 64), num_stages=3, num_warps=8):  # type: ignore[no-untyped-def]
    """(gate, up, h) by the kernel: ``x`` ``[M, K]``, ``Wg`` and ``Wu`` ``[I, K]``, ``xa_*`` ``[M, r]``,
    ``B_*`` ``[I, r]``, all in one 16-bit dtype and TMA-ready; scales ``SCALING``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_rows, n_inner = x.shape
    n_cols = wg.shape[0]
    block_m, block_n, block_k = tile
    block_rank = dot_size(xa_g.shape[1])
    gate, up, h = (torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device) for _ in range(3))
    programs = persistent_grid(cdiv(n_rows, block_m) * cdiv(n_cols, block_n), x.device)

    def desc(t: torch.Tensor, block: list[int]):  # type: ignore[no-untyped-def]
        return TensorDescriptor.from_tensor(t, block)

    _gate_up_act_kernel[(programs,)](
        desc(x, [block_m, block_k]), desc(wg, [block_n, block_k]), desc(wu, [block_n, block_k]),
        desc(xa_g, [block_m, block_rank]), desc(b_g, [block_n, block_rank]), desc(xa_u, [block_m, block_rank]),
        desc(b_u, [block_n, block_rank]), desc(gate, [block_m, block_n]), desc(up, [block_m, block_n]),
        desc(h, [block_m, block_n]), SCALING, 1.0 / SCALING, SCALING, 1.0 / SCALING, n_rows, n_cols, n_inner,
        ACTIVATION=activation_code(ACTIVATION), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
        N_PROGRAMS=programs, num_stages=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return gate, up, h


def _operands(m: int, i: int, k: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(m + i + k)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    return [randn(m, k), randn(i, k, std=k**-0.5), randn(i, k, std=k**-0.5), randn(m, R), randn(i, R, std=0.1),
            randn(m, R), randn(i, R, std=0.1)]  # fmt: skip


def fk_path(x, wg, wu, xa_g, b_g, xa_u, b_u):  # type: ignore[no-untyped-def]
    """fk's LoRA MLP forward as it runs: gate and up by ``lora_matmul`` where it applies (rank term
    in the epilogue; else cuBLAS), then fk.glu's pass."""
    gate = lora_and_base_out(x, wg, None, xa_g, b_g, None, SCALING)
    up = lora_and_base_out(x, wu, None, xa_u, b_u, None, SCALING)
    return gate, up, gated_act_forward(gate, up, ACTIVATION)


def _check(got, want, what: str) -> None:  # type: ignore[no-untyped-def]
    for name, g, w in zip(("gate", "up", "h"), got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2, msg=f"{name} {what}")


def check(device: str) -> None:
    # fp16 in the interpreter: Triton 3.6's interpreter gets tl.dot on bf16 tiles wrong.
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    t = _operands(96, 160, 128, device, dtype)
    for launch in (((32, 32, 32), 2, 4), ((32, 64, 32), 2, 4)):
        tile, stages, warps = launch
        _check(gate_up_act(*t, tile=tile, num_stages=stages, num_warps=warps), fk_path(*t), str(launch))
    print("gate_up_act at other launches: within rounding of fk's path (gate, up, h)")


def timings() -> None:
    for m, i, k in SHAPES:
        t = _operands(m, i, k, "cuda", torch.bfloat16)
        print(f"== {m} tokens, gate and up {i} x {k}, r = {R}", flush=True)
        sweep(
            2 * 2 * m * i * k,
            ("cuBLAS: the two base products alone", lambda: (t[0] @ t[1].t(), t[0] @ t[2].t())),  # noqa: B023
            ("fk's path (2 lora_matmul + pass)", lambda: fk_path(*t)),  # noqa: B023
            LAUNCHES,
            lambda **launch: gate_up_act(*t, **launch),  # noqa: B023
            _check,
        )


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings())


if __name__ == "__main__":
    main()
