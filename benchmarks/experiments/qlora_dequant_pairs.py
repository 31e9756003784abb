"""#32: can the 4-bit dequantization get closer to copy than fk.lora.quant's kernel (57-72% of copy
at bench_lora's weights, INDEX.md#qlora_profile_4096), and what would one launch for q, k and v
together save over three?

The committed kernel splits a run's bytes into high nibbles (even elements) and low ones (odd) and
interleaves them back for one contiguous store (``tl.interleave``: a shuffle between lanes). The
``pairs`` kernel here keeps a byte's two elements together instead: it writes each byte's pair as
one 32-bit word (the even element in the low half: little-endian memory order), so the store is
as contiguous as the load and nothing is shuffled. Same scales, same rounding: checked bit for bit
against ``dequantize_ref``.

Rows: per weight (Llama-3.1-8B, NF4, blocksize 64, nested absmax, bf16 out): the committed
``dequantize``, then ``pairs`` at each launch; then q, k and v dequantized by three launches of each
kernel against one launch over a ``[6144, 4096]`` weight (the bytes of the three together).

Run on a GPU:  python benchmarks/experiments/qlora_dequant_pairs.py
Check in Triton's interpreter (tiny weights, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv
from fk.lora import quant
from fk.lora.quant import code_table, dequantize, dequantize_ref, quantize_ref

WEIGHTS = {"gate/up": (14336, 4096), "down": (4096, 14336), "q/o": (4096, 4096), "k/v": (1024, 4096)}
LAUNCHES = [(words, warps) for words in (1024, 2048, 4096) for warps in (4, 8)]  # (words a program, warps)


@triton.jit
def _pairs_kernel(
    out_ptr,  # [n_words] int32: the bf16 output viewed as words, element 2i in the low half of word i
    data_ptr,  # [n_words] uint8: byte i holds element 2i (high nibble) and 2i + 1 (low nibble)
    code_ptr,  # [16] fp32 code book
    absmax_ptr,  # [n_blocks] uint8: index into code2
    code2_ptr,  # [256] fp32
    absmax2_ptr,  # [ceil(n_blocks / BLOCKSIZE2)] fp32
    offset_ptr,  # [1] fp32
    n_words,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    RUNS: tl.constexpr,  # runs a program
    RUN_WORDS: tl.constexpr,  # words a run: BLOCKSIZE // 2 (a run is one block)
):
    first = tl.program_id(0).to(tl.int64) * (RUNS * RUN_WORDS)
    runs = tl.arange(0, RUNS)
    in_tile = runs[:, None] * RUN_WORDS + tl.arange(0, RUN_WORDS)[None, :]
    ok = in_tile < n_words - first
    byte = tl.load(data_ptr + first + in_tile, mask=ok, other=0).to(tl.int32)
    block = (first * 2) // BLOCKSIZE + runs
    block_ok = block * BLOCKSIZE < n_words * 2
    absmax_q = tl.load(absmax_ptr + block, mask=block_ok, other=0).to(tl.int32)
    scale = tl.load(code2_ptr + absmax_q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=block_ok, other=0.0)
    scale = scale + tl.load(offset_ptr)
    even = (tl.load(code_ptr + (byte >> 4)) * scale[:, None]).to(tl.bfloat16, fp_downcast_rounding="rtne")
    odd = (tl.load(code_ptr + (byte & 0xF)) * scale[:, None]).to(tl.bfloat16, fp_downcast_rounding="rtne")
    low = even.to(tl.uint16, bitcast=True).to(tl.uint32)
    high = odd.to(tl.uint16, bitcast=True).to(tl.uint32)
    tl.store(out_ptr + first + in_tile, (low | (high << 16)).to(tl.int32, bitcast=True), mask=ok)


def pairs(q: quant.QuantizedWeight, words: int = 2048, warps: int = 4) -> torch.Tensor:
    """The whole weight in bf16 by the pairs kernel (NF4/FP4 with nested absmax, an even count)."""
    n, k = q.shape
    assert (n * k) % 2 == 0 and q.nested is not None and q.blocksize % 2 == 0
    out = torch.empty(n, k, dtype=torch.bfloat16, device=q.device)
    n_words = n * k // 2
    run_words = q.blocksize // 2
    runs = max(1, words // run_words)
    nested = q.nested
    _pairs_kernel[(cdiv(n_words, runs * run_words),)](
        out.view(torch.int32).reshape(-1), q.data.reshape(-1), code_table(q.quant_type, q.device),
        q.absmax.reshape(-1), nested.code.reshape(-1), nested.absmax.reshape(-1), nested.offset.reshape(-1),
        n_words, BLOCKSIZE=q.blocksize, BLOCKSIZE2=nested.blocksize, RUNS=runs, RUN_WORDS=run_words,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _weight(n: int, k: int, device: str) -> quant.QuantizedWeight:
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    return quantize_ref(weight, "nf4", 64, nested=True, nested_blocksize=256)


def _line(name: str, ms: float, nbytes: float, copy: float) -> str:
    tbps = bench.tbps(nbytes, ms)
    return f"  {name:30} {ms * 1e3:8.1f} us  {tbps:5.2f} TB/s  {tbps / copy:5.1%} of copy"


def _time(fn: Callable[[], object]) -> float:
    return bench.time_stats_ms(fn, gpu_only=True).median


def check(device: str) -> None:
    """The pairs kernel against the committed one, bit for bit (on a GPU both equal dequantize_ref;
    in Triton's interpreter some bf16 values come out one ulp from torch's rounding, both kernels' alike)."""
    for n, k in [(3, 128), (5, 192), (64, 64)]:
        q = _weight(n, k, device)
        want = dequantize(q)
        for words, warps in [(32, 1), (64, 2)]:
            assert torch.equal(pairs(q, words, warps), want), (n, k, words, warps)
    print("pairs kernel: bit-equal to fk.lora.quant.dequantize")


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, timings)


def timings(args: argparse.Namespace, copy: float) -> None:
    print("NF4, blocksize 64, nested absmax, bf16 out")
    for name, (n, k) in WEIGHTS.items():
        q = _weight(n, k, "cuda")
        want = dequantize_ref(q, dtype=torch.bfloat16)
        nbytes = n * k * 2.5 + cdiv(n * k, 64)
        print(f"-- {name} N={n} K={k}")
        print(_line("fk dequantize (LAUNCH_4BIT)", _time(lambda q=q: dequantize(q)), nbytes, copy))
        for words, warps in LAUNCHES:
            assert torch.equal(pairs(q, words, warps), want)
            ms = _time(lambda q=q, words=words, warps=warps: pairs(q, words, warps))
            print(_line(f"pairs {words} words, {warps} warps", ms, nbytes, copy))
    print("-- q, k, v: three launches against one over their bytes together ([6144, 4096])")
    qkv = [_weight(n, 4096, "cuda") for n in (4096, 1024, 1024)]
    together = _weight(6144, 4096, "cuda")
    nbytes = 6144 * 4096 * 2.5 + cdiv(6144 * 4096, 64)
    print(_line("fk dequantize x3", _time(lambda: [dequantize(q) for q in qkv]), nbytes, copy))
    print(_line("fk dequantize x1", _time(lambda: dequantize(together)), nbytes, copy))
    for words, warps in LAUNCHES:
        three = _time(lambda words=words, warps=warps: [pairs(q, words, warps) for q in qkv])
        one = _time(lambda words=words, warps=warps: pairs(together, words, warps))
        print(_line(f"pairs x3 {words} words, {warps} warps", three, nbytes, copy))
        print(_line(f"pairs x1 {words} words, {warps} warps", one, nbytes, copy))


if __name__ == "__main__":
    main()
