"""#32: ``fk.lora.dropped_lora_inputs``, the dropout's forward in one pass over ``x`` with each mask
drawn in the kernel as ``torch.native_dropout`` draws it (``fk.lora.torch_dropout``).

1. Are the masks torch's, bit for bit, on this GPU and torch? ``replicates`` per dtype (the vector
   size found, 0 for none), then three draws in a row at Llama-3.1-8B's q/k/v input (x [4096, 4096],
   bf16) and at awkward ones (a misaligned start, which takes vector size 4; fp16; 1000 columns)
   against three ``torch.native_dropout`` calls under the same seed, and the generator's offset after.
2. Its launch (rows a program, columns a step, warps, programs an SM) against what it replaces:
   ``torch.native_dropout`` and ``torch.mm`` on the dropped input a projection (fk before, PEFT's
   operations), at q/k/v (three masks), gate/up (two) and O (one), x [tokens, 4096], r = 16, bf16,
   4096 and 16384 tokens; GPU time (``fk.core.bench.time_ms(gpu_only=True)``) and the fraction of a
   copy's speed for the kernel's bytes (x read once, each mask written once).

Run on a GPU:  python benchmarks/experiments/dropped_lora_inputs_tune.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
import itertools

import torch

from fk.core import bench
from fk.lora import dropped_lora_inputs as module
from fk.lora import torch_dropout
from fk.lora.dropped_lora_inputs import DroppedInput, LaunchParams
from fk.lora.torch_dropout import Draw

R, P, K = 16, 0.05, 4096
SETTINGS = [
    LaunchParams(rows, cols, warps, per_sm)
    for rows, cols, warps, per_sm in itertools.product((32, 64), (64, 128), (4, 8), (2, 4, 8))
    if not (rows == 32 and warps == 8)
]


def check(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(70, 200, device=device, generator=gen).to(dtype)
    terms = [DroppedInput((0.1 * torch.randn(R, 200, device=device, generator=gen)).to(dtype),
                          Draw(2**63 + 12345 * i, 8 + 40 * i, 96, 8, 1 - P), 1 / (1 - P)) for i in range(3)]  # fmt: skip
    want_xas, want_masks = module.dropped_lora_inputs_ref(x, terms)
    for params in (LaunchParams(32, 64, 4, 1), LaunchParams(32, 64, 4, 64)):
        xas, masks = module._launch(x, terms, params=params)
        for got, w, m, wm in zip(xas, want_xas, masks, want_masks, strict=True):
            torch.testing.assert_close(got.double(), w, rtol=2e-2, atol=2e-2)
            assert torch.equal(m, wm)
    print("dropped_lora_inputs (whole rows and split K): masks equal to keep_ref, products within bf16 rounding")


def _torch_masks(x: torch.Tensor, n: int, seed: int) -> tuple[list[torch.Tensor], int]:
    generator = torch.cuda.default_generators[x.device.index or 0]
    generator.manual_seed(seed)
    masks = [torch.native_dropout(x, P, True)[1] for _ in range(n)]
    return masks, generator.get_offset()


def _fk_masks(x: torch.Tensor, n: int, seed: int) -> tuple[list[torch.Tensor], int, int]:
    generator = torch.cuda.default_generators[x.device.index or 0]
    generator.manual_seed(seed)
    draws = torch_dropout.reserve(x, [P] * n)
    if draws is None:
        return [], generator.get_offset(), 0
    a = torch.zeros(R, x.shape[1], dtype=x.dtype, device=x.device)
    _, masks = module.dropped_lora_inputs(x.view(-1, x.shape[-1]), [DroppedInput(a, d, 1 / (1 - P)) for d in draws])
    return [m.view(x.shape) for m in masks], generator.get_offset(), draws[0].vec


def replication() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        print(f"replicates({dtype}): vector size {torch_dropout.replicates(device, dtype)}", flush=True)
    cases = {
        "x [4096, 4096] bf16": torch.randn(4096, 4096, device="cuda").bfloat16(),
        "x [16384, 4096] bf16": torch.randn(16384, 4096, device="cuda").bfloat16(),
        "x [4096, 4096] fp16": torch.randn(4096, 4096, device="cuda").half(),
        "x [2, 513, 1000] bf16": torch.randn(2, 513, 1000, device="cuda").bfloat16(),
        "x [100, 4096] bf16": torch.randn(100, 4096, device="cuda").bfloat16(),
        "x [4096, 4096] bf16 from element 4 (8-byte aligned)": torch.randn(4096 * 4096 + 4, device="cuda")
        .bfloat16()[4:]
        .view(4096, 4096),
    }
    for name, x in cases.items():
        want, want_offset = _torch_masks(x, 3, 1234)
        got, offset, vec = _fk_masks(x, 3, 1234)
        same = len(got) == 3 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        print(f"  {name}: vector size {vec}, three masks equal: {same}, offset {offset} (torch {want_offset})",
              flush=True)  # fmt: skip
        if not same:  # which launch torch took: T from ceil(n / per_block) blocks, capped, and V
            n, props = x.numel(), torch.cuda.get_device_properties(x.device)
            resident = props.multi_processor_count * props.max_threads_per_multi_processor // 256
            for per_block, vec in itertools.product((256, 1024, 2048), (4, 8)):
                threads = min(resident, -(-n // per_block)) * 256
                draw = Draw(1234, 0, threads, vec, 1 - P)
                if torch.equal(torch_dropout.keep_ref(n, draw, x.device), want[0].flatten()):
                    print(f"    torch's first mask: ceil(n / {per_block}) blocks, V = {vec}", flush=True)


def timings(copy_tbps: float) -> None:
    x = torch.randn(4096, K, device="cuda").bfloat16()
    (draw,) = torch_dropout.reserve(x, [P]) or [None]
    assert draw is not None
    t_torch = bench.time_ms(lambda: torch.native_dropout(x, P, True), gpu_only=True)
    t_mask = bench.time_ms(lambda: torch_dropout.keep_mask(x.numel(), draw, x.device), gpu_only=True)
    print(f"one mask of [4096, {K}]: torch.native_dropout {t_torch * 1e3:.1f} us, keep_mask {t_mask * 1e3:.1f} us",
          flush=True)  # fmt: skip
    for m, n_terms in ((4096, 3), (4096, 1), (16384, 3)):
        gen = torch.Generator(device="cuda").manual_seed(m + n_terms)
        x = torch.randn(m, K, device="cuda", generator=gen).bfloat16()
        lora_as = [(0.1 * torch.randn(R, K, device="cuda", generator=gen)).bfloat16() for _ in range(n_terms)]
        draws = torch_dropout.reserve(x, [P] * n_terms)
        assert draws is not None
        terms = [DroppedInput(a, d, 1 / (1 - P)) for a, d in zip(lora_as, draws, strict=True)]
        moved = m * K * (2 + n_terms)  # bytes: x once, each mask once (the outputs are rank-sized)
        print(f"== x [{m}, {K}], {n_terms} masks, r = {R}", flush=True)

        def before() -> list[torch.Tensor]:
            return [torch.mm(torch.native_dropout(x, P, True)[0], a.t()) for a in lora_as]  # noqa: B023

        now = bench.time_ms(before, gpu_only=True)
        print(f"  {'native_dropout + torch.mm a projection (fk before)':50s} {now * 1e3:7.1f} us", flush=True)
        results = []
        for params in SETTINGS:
            t = bench.time_ms(lambda: module._launch(x, terms, params=params), gpu_only=True)  # noqa: B023
            results.append((t, params))
        for t, params in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  {tuple(params)!s:50s} {t * 1e3:7.1f} us  {moved / t / 1e9 / copy_tbps:5.1%} of copy  "
                  f"({t / now:.3f}x)", flush=True)  # fmt: skip
        table = next(r for r in results if r[1] == module.LAUNCH[16])
        print(f"  the table's {tuple(module.LAUNCH[16])}: {table[0] * 1e3:.1f} us", flush=True)


def main() -> None:
    def body(args: argparse.Namespace, copy: float) -> None:
        replication()
        timings(copy)

    bench.run_probe(argparse.ArgumentParser(), check, body)


if __name__ == "__main__":
    main()
