"""fk.flce's gradient scaling pass (``fk.flce.chunks.scale_cast``) at the head-gradient size of the
e2e benchmark (128256 x 2048): the fp32 accumulator scaled into a new bf16 tensor, and a bf16
gradient scaled in place by 0.5 and by exactly 1 (which the in-place kernel skips on the device),
for 1, 2, 4, 8 and 16 blocks of 4096 elements per program (both SCALE_CAST_BLOCKS and
SCALE_CAST_BLOCKS_IN_PLACE). GPU time, median of triton.testing.do_bench's calls (L2 flushed before
each).

Run on a GPU:  python benchmarks/experiments/scale_cast_blocks.py   (output: scale_cast_blocks_h200.txt)
"""

from __future__ import annotations

import torch
import triton

from fk.flce import chunks


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    shape = (128256, 2048)
    acc = torch.randn(shape, device="cuda", dtype=torch.float32)
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    half = torch.full((1,), 0.5, device="cuda")
    one = torch.ones(1, device="cuda")
    out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    tb = acc.numel() * (4 + 2) / 1e9, grad.numel() * 4 / 1e9  # GB moved: fp32 read + bf16 write; bf16 read + write
    for blocks in (1, 2, 4, 8, 16):
        chunks.SCALE_CAST_BLOCKS = chunks.SCALE_CAST_BLOCKS_IN_PLACE = blocks
        fp32 = triton.testing.do_bench(lambda: chunks.scale_cast(acc, half, torch.bfloat16, out=out), rep=200,
                                       return_mode="median")  # fmt: skip
        inplace = triton.testing.do_bench(lambda: chunks.scale_cast(grad, half, torch.bfloat16, out=grad), rep=200,
                                          return_mode="median")  # fmt: skip
        skipped = triton.testing.do_bench(lambda: chunks.scale_cast(grad, one, torch.bfloat16, out=grad), rep=200,
                                          return_mode="median")  # fmt: skip
        print(f"blocks/program {blocks:2d}: fp32 -> bf16 {fp32 * 1e3:7.1f} us ({tb[0] / fp32:.2f} TB/s)   "
              f"bf16 in place x0.5 {inplace * 1e3:7.1f} us ({tb[1] / inplace:.2f} TB/s)   "
              f"in place x1 (skipped) {skipped * 1e3:6.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
