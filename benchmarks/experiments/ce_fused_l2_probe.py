"""Probe: can cross entropy's fused loss+gradient pass keep each row in L2 between its two reads?

The fused pass (fk.flce.cross_entropy, LAUNCH["fused"]) reads a row of logits twice (log-sum-exp,
then the gradient) and writes it once; bench_flce counts one read and one write. At 8192 x 128256
bf16 it ran at 66% of copy (2026-11-24T07:07 record): as if every second read came from DRAM. A
row is 256 KB, so rows in flight x 256 KB must stay well under the L2 (50 MB) for pass 2 to hit.

This probe times a stripped-down copy of the kernel (no options: plain CE, gradient in place)
over programs per SM, warps, columns per load, prefetching the next tile before computing the
current one (so one program per SM keeps two tiles of loads in flight), and the eviction hint on
the gradient's stores; then the best settings over vocabularies of 32768 ... 256000 columns; and
the committed kernel with its committed launch and with one program per SM, for comparison.

Run on a GPU: python benchmarks/experiments/ce_fused_l2_probe.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.flce.cross_entropy import LAUNCH, LaunchParams, LossOptions, launch_cross_entropy


@triton.jit
def _probe_kernel(
    x_ptr, target_ptr, lse_ptr, n_rows, n_cols, stride, scale,
    BLOCK: tl.constexpr, PREFETCH: tl.constexpr, STORE_EVICT_FIRST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    for row in range(pid, n_rows, tl.num_programs(0)):
        base = x_ptr + tl.cast(row, tl.int64) * stride
        label = tl.load(target_ptr + row).to(tl.int32)
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        if PREFETCH:
            nxt = tl.load(base + cols, mask=cols < n_cols, other=-float("inf"), eviction_policy="evict_last")
            for b in range(0, n_blocks):
                z = nxt.to(tl.float32)
                c = (b + 1) * BLOCK + cols
                nxt = tl.load(base + c, mask=c < n_cols, other=-float("inf"), eviction_policy="evict_last")
                e = tl.exp(-tl.abs(z - m))
                s = tl.where(z > m, s * e + 1.0, s + e)
                m = tl.maximum(m, z)
        else:
            for b in range(0, n_blocks):
                c = b * BLOCK + cols
                z = tl.load(base + c, mask=c < n_cols, other=-float("inf"), eviction_policy="evict_last")
                z = z.to(tl.float32)
                e = tl.exp(-tl.abs(z - m))
                s = tl.where(z > m, s * e + 1.0, s + e)
                m = tl.maximum(m, z)
        m_row = tl.max(m, axis=0)
        lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
        tl.store(lse_ptr + row, lse)
        # Pass 2, last tile first.
        if PREFETCH:
            c_next = (n_blocks - 1) * BLOCK + cols
            nxt = tl.load(base + c_next, mask=c_next < n_cols, other=0.0, eviction_policy="evict_first")
            for _back in range(0, n_blocks):
                c = c_next
                z = nxt.to(tl.float32)
                c_next = c - BLOCK
                nxt = tl.load(base + c_next, mask=(c_next >= 0) & (c_next < n_cols), other=0.0,
                              eviction_policy="evict_first")  # fmt: skip
                dz = (tl.exp(z - lse) - tl.where(c == label, 1.0, 0.0)) * scale
                if STORE_EVICT_FIRST:
                    tl.store(base + c, dz.to(x_ptr.dtype.element_ty), mask=c < n_cols, eviction_policy="evict_first")
                else:
                    tl.store(base + c, dz.to(x_ptr.dtype.element_ty), mask=c < n_cols)
        else:
            for back in range(0, n_blocks):
                c = (n_blocks - 1 - back) * BLOCK + cols
                z = tl.load(base + c, mask=c < n_cols, other=0.0, eviction_policy="evict_first").to(tl.float32)
                dz = (tl.exp(z - lse) - tl.where(c == label, 1.0, 0.0)) * scale
                if STORE_EVICT_FIRST:
                    tl.store(base + c, dz.to(x_ptr.dtype.element_ty), mask=c < n_cols, eviction_policy="evict_first")
                else:
                    tl.store(base + c, dz.to(x_ptr.dtype.element_ty), mask=c < n_cols)


def committed_kernel_ms(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, params: LaunchParams) -> float:
    """fk's kernel as linear cross entropy runs it (loss, then the gradient in place), launched with ``params``."""
    options = LossOptions(-100, 0.0, 0.0, 0.0)
    loss, scale = torch.empty_like(lse), torch.ones(1, device=x.device)
    committed = LAUNCH["fused"]
    LAUNCH["fused"] = params
    try:
        return bench.time_ms(
            lambda: launch_cross_entropy(x, t, None, None, options, lse=lse, loss=loss, grad=x, grad_scale=scale)
        )
    finally:
        LAUNCH["fused"] = committed


def main() -> None:
    copy = bench.copy_bandwidth_tbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MB")
    print(f"copy ceiling {copy:.2f} TB/s; fused pass counted as one read and one write")

    def data(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, vocab, device="cuda", generator=gen).to(torch.bfloat16)
        t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        return x, t, torch.empty(tokens, device="cuda")

    def probe_ms(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, per_sm: int, warps: int, block: int,
                 prefetch: bool, evict: bool) -> float:  # fmt: skip
        grid = (min(x.shape[0], per_sm * sms),)

        def run() -> None:
            _probe_kernel[grid](x, t, lse, x.shape[0], x.shape[1], x.stride(0), 1.0, BLOCK=block,
                                PREFETCH=prefetch, STORE_EVICT_FIRST=evict, num_warps=warps)  # fmt: skip

        return bench.time_ms(run)

    # Correctness of the probe kernel against PyTorch (on a fresh copy, small).
    x, t, lse = data(64, 32000)
    ref_lse = torch.logsumexp(x.float(), -1)
    ref_grad = torch.softmax(x.float(), -1) - torch.nn.functional.one_hot(t, 32000).float()
    for prefetch, evict in itertools.product((False, True), repeat=2):
        y = x.clone()
        _probe_kernel[(7,)](y, t, lse, 64, 32000, y.stride(0), 1.0, BLOCK=4096, PREFETCH=prefetch,
                            STORE_EVICT_FIRST=evict, num_warps=8)  # fmt: skip
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(y.float(), ref_grad, atol=2e-2, rtol=1e-2)
    print("probe kernel matches PyTorch")

    tokens, vocab = 8192, 128256
    x, t, lse = data(tokens, vocab)
    nbytes = 2 * x.numel() * 2
    results = []
    for per_sm, warps, block, prefetch, evict in itertools.product(
        (1, 2, 4), (8, 16, 32), (2048, 4096, 8192), (False, True), (False, True)
    ):
        if block // (32 * warps) < 1:
            continue
        ms = probe_ms(x, t, lse, per_sm, warps, block, prefetch, evict)
        frac = bench.tbps(nbytes, ms) / copy
        results.append((ms, per_sm, warps, block, prefetch, evict))
        print(f"per_sm={per_sm} warps={warps:2d} block={block:5d} prefetch={prefetch:d} store_evict_first={evict:d}: "
              f"{ms:.3f} ms, {frac:5.1%} of copy")  # fmt: skip
    results.sort()
    print("best five:")
    for ms, *setting in results[:5]:
        print(f"  {setting}: {ms:.3f} ms, {bench.tbps(nbytes, ms) / copy:5.1%} of copy")

    # The committed kernel, committed launch and one or two programs per SM.
    committed = LAUNCH["fused"]
    for params in (committed, LaunchParams(1, 8192, 32), LaunchParams(1, 4096, 16), LaunchParams(2, 4096, 16)):
        ms = committed_kernel_ms(x, t, lse, params)
        print(f"committed kernel {params}: {ms:.3f} ms, {bench.tbps(nbytes, ms) / copy:5.1%} of copy")
    del x

    # The best three settings over vocabularies (about 2 GB of logits each).
    for vocab in (32768, 65536, 128256, 256000):
        x, t, lse = data((1 << 30) // vocab, vocab)
        nbytes = 2 * x.numel() * 2
        for _ms, per_sm, warps, block, prefetch, evict in results[:3]:
            ms = probe_ms(x, t, lse, per_sm, warps, block, prefetch, evict)
            print(f"V={vocab:6d} rows={x.shape[0]:6d} per_sm={per_sm} warps={warps} block={block} prefetch={prefetch:d} "
                  f"evict={evict:d}: {ms:.3f} ms, {bench.tbps(nbytes, ms) / copy:5.1%} of copy")  # fmt: skip
        del x


if __name__ == "__main__":
    main()
