"""fk.lora.dora_dropout_matmul's one-GEMM DoRA forward with dropout, ``(y, z)``, against float64:
the Triton kernel on the GPU where there is one (Hopper), else in the interpreter; where it
applies; and fk.lora's DoRA layer taking it."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.backend import uses_kernel
from fk.core.testing import dtype_name
from fk.lora import dora, dora_dropout_matmul, lora_matmul
from fk.lora.dora_dropout_matmul import dora_dropout_out, dora_dropout_out_applies, dora_dropout_out_ref

# (M, N, K, r): rows and columns across tile edges (128 x 128, K steps of 64); N and K multiples of 8
# and r of 8 (TMA's 16-byte rows); ranks under, at and over the 16 of an MMA, up to TMA_RANK_MAX.
SHAPES = [(1, 8, 8, 8), (37, 40, 72, 8), (130, 264, 200, 16), (300, 136, 136, 24), (129, 128, 64, 32)]
HALF = (torch.float16, torch.bfloat16)
SCALING = 1.7  # not a power of two: the kernel's 1 / s and s are not exact


def _inputs(m: int, n: int, k: int, r: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    """(x, d(x), W, xa, B, ms, b): ``d(x)`` x with a tenth of its elements dropped and the rest
    scaled by 1 / 0.9, ``ms`` around 1 (DoRA's ``mag / n`` near its initial value)."""
    x = testing.random_tensor((m, k), dtype, device, seed=seed)
    keep = testing.random_tensor((m, k), torch.float32, device, seed=seed + 5) > -1.28  # about 90% kept
    dropped = (x.float() * keep / 0.9).to(dtype)
    weight = testing.random_tensor((n, k), dtype, device, seed=seed + 1, scale=k**-0.5)
    xa = testing.random_tensor((m, r), dtype, device, seed=seed + 3)
    lora_b = testing.random_tensor((n, r), dtype, device, seed=seed + 4, scale=0.3)
    ms = 1 + 0.3 * testing.random_tensor((n,), torch.float32, device, seed=seed + 6)
    bias = testing.random_tensor((n,), dtype, device, seed=seed + 2)
    return [x, dropped, weight, xa, lora_b, ms, bias]


def _baseline(x, dropped, weight, xa, lora_b, ms, bias):  # type: ignore[no-untyped-def]
    """(y, z) by PyTorch at the inputs' dtype: each product rounded, as fk's other path forms them."""
    zd, base, lr = dropped @ weight.t(), x @ weight.t(), SCALING * (xa @ lora_b.t())
    y = base + (ms - 1) * zd + ms * lr
    return (y if bias is None else y + bias), zd + lr


def _kernel_runs(device: str) -> bool:
    probe = torch.empty(1, device=device)
    hopper = device != "cuda" or torch.cuda.get_device_capability()[0] == 9
    return uses_kernel(probe) and hopper and lora_matmul.HAS_TENSOR_DESCRIPTORS


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("m", "n", "k", "r"), SHAPES)
@pytest.mark.parametrize("dtype", HALF, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, m: int, n: int, k: int, r: int, with_bias: bool) -> None:
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    x, dropped, weight, xa, lora_b, ms, bias = _inputs(m, n, k, r, dtype, device)
    b = bias if with_bias else None
    assert dora_dropout_out_applies(x, dropped, weight, xa, lora_b, SCALING, ms, b) == (device != "cuda")
    want = dora_dropout_out_ref(x, dropped, weight, xa, lora_b, SCALING, ms, b)
    baseline = _baseline(x, dropped, weight, xa, lora_b, ms.to(dtype), b)
    got = dora_dropout_out(x, dropped, weight, xa, lora_b, SCALING, ms, b)
    for name, g, w, base in zip("yz", got, want, baseline, strict=True):
        assert g.dtype == dtype and g.shape == (m, n)
        testing.assert_close(g, w, base, name=name)


def test_every_term_counts(device: str) -> None:
    # Each input moves the outputs far past the tolerance: x against d(x) swapped, the rank product,
    # ms, the bias, a K step (K = 136: three steps of 64, the last partial).
    if not _kernel_runs(device):
        pytest.skip("the kernel runs on Hopper GPUs and in Triton's interpreter")
    x, dropped, weight, xa, lora_b, ms, bias = _inputs(130, 264, 136, 16, torch.float16, device, seed=2)
    y, z = (t.double() for t in dora_dropout_out(x, dropped, weight, xa, lora_b, SCALING, ms, bias))
    wrong = {
        "x and d(x) swapped": dora_dropout_out_ref(dropped, x, weight, xa, lora_b, SCALING, ms, bias),
        "no rank product": dora_dropout_out_ref(x, dropped, weight, xa, 0 * lora_b, SCALING, ms, bias),
        "ms = 1": dora_dropout_out_ref(x, dropped, weight, xa, lora_b, SCALING, torch.ones_like(ms), bias),
        "no bias": dora_dropout_out_ref(x, dropped, weight, xa, lora_b, SCALING, ms, None),
        "last K step": dora_dropout_out_ref(x[:, :128], dropped[:, :128], weight[:, :128], xa, lora_b, SCALING, ms, bias),
    }  # fmt: skip
    for why, (y_wrong, z_wrong) in wrong.items():
        assert max(float((y - y_wrong).abs().max()), float((z - z_wrong).abs().max())) > 0.05, why


def test_applies_only_where_it_can(device: str) -> None:
    # 4096 rows and 512 columns: 128 tiles of 128 x 128, enough on a GPU of up to 170 SMs.
    x, dropped, weight, xa, lora_b, ms, bias = _inputs(4096, 512, 64, 16, torch.bfloat16, device)
    assert dora_dropout_out_applies(x, dropped, weight, xa, lora_b, SCALING, ms, bias) == _kernel_runs(device)
    if not _kernel_runs(device):
        return
    # Sixteen tiles: too few for a GPU's SMs; the interpreter takes any size.
    few = (x[:512], dropped[:512], weight, xa[:512], lora_b, SCALING, ms, bias)
    assert dora_dropout_out_applies(*few) == (device != "cuda")
    wide = torch.empty(4096, 64, dtype=xa.dtype, device=device)  # r = 64: over TMA_RANK_MAX once padded
    odd_rank = torch.empty(4096, 12, dtype=xa.dtype, device=device)  # 24-byte rows: not TMA-ready
    unaligned = torch.empty(4096, 68, dtype=x.dtype, device=device)[:, 2:66]
    refused = {
        "fp32": (x.float(), dropped.float(), weight.float(), xa.float(), lora_b.float(), SCALING, ms, None),
        "d(x)'s dtype": (x, dropped.half(), weight, xa, lora_b, SCALING, ms, bias),
        "d(x)'s shape": (x, dropped[:, :56], weight, xa, lora_b, SCALING, ms, bias),
        "N not a multiple of 8": (x, dropped, weight[:500], xa, lora_b[:500], SCALING, ms[:500], bias[:500]),
        "x's rows not 16-byte aligned": (unaligned, dropped, weight, xa, lora_b, SCALING, ms, bias),
        "r over TMA_RANK_MAX": (x, dropped, weight, wide, torch.empty(512, 64, dtype=x.dtype, device=device),
                                SCALING, ms, bias),
        "xa's rows not TMA-ready": (x, dropped, weight, odd_rank, lora_b[:, :12], SCALING, ms, bias),
        "ms not fp32": (x, dropped, weight, xa, lora_b, SCALING, ms.to(x.dtype), bias),
        "bias strided": (x, dropped, weight, xa, lora_b, SCALING, ms,
                         torch.empty(1024, dtype=x.dtype, device=device)[::2]),
        "no rows": (x[:0], dropped[:0], weight, xa[:0], lora_b, SCALING, ms, bias),
        "s = 0": (x, dropped, weight, xa, lora_b, 0.0, ms, bias),
    }  # fmt: skip
    for why, args in refused.items():
        assert not dora_dropout_out_applies(*args), why  # type: ignore[arg-type]


def test_kernel_compiles_without_spills() -> None:
    # Compiled for sm_90 on the CPU at its launch, with and without a bias, at r = 16 and TMA_RANK_MAX:
    # the products on the warpgroup MMAs, nothing spilled, the shared memory under the 227 KB a
    # Hopper program gets.
    tile_m, tile_n, tile_k = dora_dropout_matmul.TILE
    for rank in (16, lora_matmul.TMA_RANK_MAX):
        for has_bias in (False, True):
            signature = {
                "x_desc": f"tensordesc<bf16[{tile_m}, {tile_k}]>", "dropped_desc": f"tensordesc<bf16[{tile_m}, {tile_k}]>",
                "w_desc": f"tensordesc<bf16[{tile_n}, {tile_k}]>", "xa_desc": f"tensordesc<bf16[{tile_m}, {rank}]>",
                "b_desc": f"tensordesc<bf16[{tile_n}, {rank}]>", "y_desc": f"tensordesc<bf16[{tile_m}, {tile_n}]>",
                "z_desc": f"tensordesc<bf16[{tile_m}, {tile_n}]>", "ms_ptr": "*fp32", "bias_ptr": "*bf16",
                "scaling": "fp32", "inv_scaling": "fp32", "n_rows": "i32", "n_cols": "i32", "n_inner": "i32",
                "HAS_BIAS": "", "BLOCK_M": "", "BLOCK_N": "", "BLOCK_K": "", "GROUP_M": "", "N_PROGRAMS": "",
            }  # fmt: skip
            constexprs = {"HAS_BIAS": has_bias, "BLOCK_M": tile_m, "BLOCK_N": tile_n, "BLOCK_K": tile_k,
                          "GROUP_M": lora_matmul.GROUP_M, "N_PROGRAMS": 132}  # fmt: skip
            compiled = testing.compile_kernel("fk.lora.dora_dropout_matmul", "_dora_dropout_out_kernel", signature,
                                              constexprs, num_warps=dora_dropout_matmul.NUM_WARPS)  # fmt: skip
            assert compiled.spill_bytes == 0, (rank, has_bias, compiled)
            assert compiled.sync_and_mma.get("wgmma.mma_async", 0) > 0, compiled.sync_and_mma
            assert compiled.shared_bytes <= 227 * 1024, (rank, has_bias, compiled.shared_bytes)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_dora_layer_with_dropout_takes_the_kernel(device: str, with_bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # fk.lora's DoRA linear with dropout, forward and backward, against the float64 reference with
    # fk's mask (drawn again under the same seed): its y and z from the kernel where it applies (on a
    # GPU 4096 rows and 1024 outputs, 256 tiles; in the interpreter a small layer).
    from fk.lora import lora_linear, lora_linear_ref

    calls = []
    fused = dora.dora_dropout_out

    def counted(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return fused(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(dora, "dora_dropout_out", counted)
    m, n, k = (4096, 1024, 256) if device == "cuda" else (130, 136, 72)
    c, p = torch.bfloat16, 0.1
    x = testing.random_tensor((m, k), c, device, seed=1).requires_grad_()
    weight = testing.random_tensor((n, k), c, device, seed=2, scale=k**-0.5)
    bias = testing.random_tensor((n,), c, device, seed=3) if with_bias else None
    lora_a = testing.random_tensor((16, k), c, device, seed=4, scale=0.1).requires_grad_()
    lora_b = testing.random_tensor((n, 16), c, device, seed=5, scale=0.1).requires_grad_()
    magnitude = (1 + 0.1 * testing.random_tensor((n,), c, device, seed=6)).requires_grad_()
    dy = testing.random_tensor((m, n), c, device, seed=7)
    leaves = [x, lora_a, lora_b, magnitude]
    torch.manual_seed(8)
    mask = torch.native_dropout(x.detach(), p, True)[1]

    def with_mask(t: torch.Tensor, p_: float, training: bool = True) -> torch.Tensor:
        assert training and p_ == p
        return t * mask.to(t.dtype) / (1 - p)

    def run(fn, cast):  # type: ignore[no-untyped-def]
        inputs = [t.detach().to(cast).requires_grad_() for t in leaves]
        b = None if bias is None else bias.to(cast)
        torch.manual_seed(8)
        with monkeypatch.context() as patched:
            if fn is not lora_linear:
                patched.setattr(torch.nn.functional, "dropout", with_mask)
            y = fn(inputs[0], weight.to(cast), b, inputs[1], inputs[2], 2.0, p, magnitude=inputs[3])
        return [y, *torch.autograd.grad(y, inputs, dy.to(cast))]

    got = run(lora_linear, c)
    assert len(calls) == (1 if _kernel_runs(device) else 0)
    want = run(lora_linear_ref, torch.float64)
    baseline = run(lora_linear_ref, c)
    for name, g, w, b in zip(["y", "dx", "dA", "dB", "dmagnitude"], got, want, baseline, strict=True):
        testing.assert_close(g, w, b, name=name)
