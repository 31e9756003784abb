"""fk.lora.quant's 4-bit dequantization against copy bandwidth, at bench_lora.py's QLoRA weights
(Llama-3.1-8B, NF4, nested absmax, bf16 output), and the launches of its kernel.

Rows: ``old`` the kernel before the probe (one element per lane: its byte, code, absmax and
nested scales each gathered per element, int64 indices; a copy of commit 514502a's, kept here),
``fk`` the committed kernel with ``LAUNCH_4BIT`` and each candidate launch, ``bnb``
bitsandbytes' ``dequantize_4bit`` (its CUDA kernel), and fk's int8 kernel. Bytes counted: the
packed codes (0.5 B an element), the absmax (1 B a block) and the bf16 output (2 B an element);
int8: 1 + 2 B an element. Each variant is first checked against ``dequantize_ref`` bit for bit.

Run on a GPU:  python benchmarks/experiments/qlora_dequant_probe.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv
from fk.lora import quant
from fk.lora.quant import Launch4bit, code_table, dequantize, dequantize_ref, quantize_ref

WEIGHTS = {"gate/up": (14336, 4096), "down": (4096, 14336), "q/o": (4096, 4096), "k/v": (1024, 4096)}
BLOCKSIZES = [64, 256]  # QLoRA's 64 (bench_lora's), and one longer than a 128-byte run
CANDIDATES = [
    Launch4bit(elements=e, max_run=r, num_warps=w)
    for e in (2048, 4096, 8192, 16384)
    for r in (64, 256)
    for w in (4, 8)
    if e // w >= 256
]


@triton.jit
def _old_kernel(out_ptr, data_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, start, n_rows, n_cols,
                out_row_stride, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr):  # fmt: skip
    # commit 514502a's _dequantize_4bit_kernel, nested absmax only
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    i = (start + rows).to(tl.int64)[:, None] * n_cols + cols[None, :]
    byte = tl.load(data_ptr + (i >> 1), mask=ok, other=0).to(tl.int32)
    index = tl.where((i & 1) == 0, byte >> 4, byte & 0xF)
    value = tl.load(code_ptr + index)
    block = i // BLOCKSIZE
    absmax_q = tl.load(absmax_ptr + block, mask=ok, other=0).to(tl.int32)
    scale = tl.load(code2_ptr + absmax_q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=ok, other=0.0)
    scale = scale + tl.load(offset_ptr)
    out = value * scale
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)  # fmt: skip


def _old(q: quant.QuantizedWeight) -> torch.Tensor:
    n, k = q.shape
    out = torch.empty(n, k, dtype=q.dtype, device=q.device)
    nested = q.nested
    _old_kernel[(cdiv(n, 16), cdiv(k, 256))](
        out, q.data.reshape(-1), code_table(q.quant_type, q.device), q.absmax.reshape(-1), nested.code,
        nested.absmax, nested.offset, 0, n, k, k, BLOCKSIZE=q.blocksize, BLOCKSIZE2=nested.blocksize,
        BLOCK_ROWS=16, BLOCK_COLS=256, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _with_launch(params: Launch4bit) -> Callable[[quant.QuantizedWeight], torch.Tensor]:
    def run(q: quant.QuantizedWeight) -> torch.Tensor:
        saved, quant.LAUNCH_4BIT = quant.LAUNCH_4BIT, params
        try:
            return dequantize(q)
        finally:
            quant.LAUNCH_4BIT = saved

    return run


def _bnb(weight: torch.Tensor, blocksize: int) -> tuple[Callable[[], object], torch.Tensor] | None:
    try:
        import bitsandbytes.functional as F
    except ImportError:
        return None
    packed, state = F.quantize_4bit(weight, blocksize=blocksize, compress_statistics=True, quant_type="nf4")
    return (lambda: F.dequantize_4bit(packed, state)), F.dequantize_4bit(packed, state)


def _line(name: str, ms: float, nbytes: float, copy: float, note: str = "") -> str:
    tbps = bench.tbps(nbytes, ms)
    return f"  {name:34} {ms * 1e3:8.1f} us  {tbps:5.2f} TB/s  {tbps / copy:5.1%} of copy  {note}"


def _time(fn: Callable[[], object]) -> float:
    return bench.time_stats_ms(fn, gpu_only=True).median


def main() -> None:
    print(bench.environment())
    copy = bench.copy_bandwidth_tbps()
    print(f"copy {copy:.2f} TB/s")
    best: dict[Launch4bit, list[float]] = {p: [] for p in CANDIDATES}
    for blocksize in BLOCKSIZES:
        for name, (n, k) in WEIGHTS.items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q = quantize_ref(weight, "nf4", blocksize, nested=True, nested_blocksize=256)
            want = dequantize_ref(q, dtype=torch.bfloat16)
            nbytes = n * k * 2.5 + cdiv(n * k, blocksize)
            print(f"-- {name} N={n} K={k}, blocksize {blocksize}")
            assert torch.equal(_old(q), want)
            print(_line("old (16 x 256, 4 warps)", _time(lambda q=q: _old(q)), nbytes, copy))
            times = {}
            for params in CANDIDATES:
                fn = _with_launch(params)
                assert torch.equal(fn(q), want), params
                times[params] = _time(lambda fn=fn, q=q: fn(q))
            fastest = min(times.values())
            for params, ms in sorted(times.items(), key=lambda item: item[1]):
                best[params].append(ms / fastest)
                mark = "  <- LAUNCH_4BIT" if params == quant.LAUNCH_4BIT else ""
                print(_line(f"fk {tuple(params)}", ms, nbytes, copy, mark))
            peer = _bnb(weight, blocksize)
            if peer is not None:
                print(_line("bnb dequantize_4bit", _time(peer[0]), nbytes, copy))
    print("launches by their worst time / fastest over all weights:")
    for params, ratios in sorted(best.items(), key=lambda item: max(item[1])):
        print(f"  {tuple(params)}: worst {max(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}")
    print("-- int8 (LAUNCH_INT8)")
    for name, (n, k) in WEIGHTS.items():
        q8 = quantize_ref(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "int8")
        assert torch.equal(dequantize(q8), dequantize_ref(q8, dtype=torch.bfloat16))
        print(_line(f"int8 {name}", _time(lambda q8=q8: dequantize(q8)), n * k * 3 + n * 4, copy))


if __name__ == "__main__":
    main()
