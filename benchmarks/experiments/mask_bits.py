"""#32: fk-lora keeps each LoRA dropout mask as bool, a byte an element, written by the forward and
read by the backward's two dropout passes (``masked_low_rank``: dx's masked terms; ``masked_a_grad``:
the dA's). At QKV with 16384 tokens the three masks are 201 MB, more than the two passes' other
reads (dx read and written, 268 MB; x, 134 MB), and the rows with dropout are 2-11% short of their
target (``rows_short_profile``: those passes take 0.194 and 0.109 ms there). Stored as bits (32 to
an int32 word: word ``j // 32`` of a row, bit ``j % 32``), the masks would be 25 MB and a saved
mask 1/8 the memory: how much faster would the two passes read them?

Each pass as the module runs it (bool) against a copy of its kernel that reads the packed words
instead (a word loaded for each element, shifted and tested: ``_keep_bits``), at the module's launch
and one more; 16384 x 4096 (Llama-3.1-8B's q/k/v and O input), three masks and one, r = 16, bf16;
GPU time with the GPU idle before each call. Each bits variant's output checked against the bool
kernel's before it is timed.

Run on a GPU:  python benchmarks/experiments/mask_bits.py
Check in Triton's interpreter (tiny shapes, no timing):  TRITON_INTERPRET=1 python ... --check
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fk.core import bench
from fk.core.launch import cdiv, column_strip_grid, dot_size
from fk.core.reduce import sum_rows
from fk.core.tiles import exact_dot, grid_tile, round_to
from fk.lora import masked_a_grad, masked_low_rank
from fk.lora.masked_a_grad import MaskedA
from fk.lora.masked_low_rank import MaskedLowRank

K, R, P = 4096, 16, 0.05


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool ``[M, K]`` mask as int32 words ``[M, ceil(K / 32)]``: column ``j`` is bit ``j % 32`` of
    word ``j // 32`` (columns past ``K`` zero)."""
    m, k = mask.shape
    padded = torch.zeros((m, cdiv(k, 32) * 32), dtype=torch.int64, device=mask.device)
    padded[:, :k] = mask
    shifts = torch.arange(32, device=mask.device, dtype=torch.int64)
    words = (padded.view(m, -1, 32) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@triton.jit
def _keep_bits(words_ptr, word_row_stride, rows, cols, ok):
    """The keep bits of a ``[rows, cols]`` tile (1 keep, 0 drop) from a packed mask."""
    words = tl.load(words_ptr + rows[:, None] * word_row_stride + (cols // 32)[None, :], mask=ok, other=0)
    return (words >> (cols % 32)[None, :]) & 1


@triton.jit
def _keep_words(words_ptr, word_row_stride, rows, row_ok, col_start, n_cols, BLOCK_COLS: tl.constexpr):
    """The same tile from its ``BLOCK_COLS / 32`` words a row, each loaded once and spread over its 32
    columns (``col_start`` a multiple of 32)."""
    n_words: tl.constexpr = BLOCK_COLS // 32
    word_cols = col_start // 32 + tl.arange(0, n_words)
    ok = row_ok[:, None] & (word_cols < tl.cdiv(n_cols, 32))[None, :]
    words = tl.load(words_ptr + rows[:, None] * word_row_stride + word_cols[None, :], mask=ok, other=0)
    bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    return tl.reshape(bits, (rows.shape[0], BLOCK_COLS))


@triton.jit
def _keep(words_ptr, word_row_stride, rows, cols, row_ok, ok, n_cols, WIDE: tl.constexpr, BLOCK_COLS: tl.constexpr):
    if WIDE:
        return _keep_words(words_ptr, word_row_stride, rows, row_ok, tl.min(cols, 0), n_cols, BLOCK_COLS)
    return _keep_bits(words_ptr, word_row_stride, rows, cols, ok)


# --- dx += sum_t f_t m_t (G_t A_t): masked_low_rank's kernel (no addend), the masks as bits --------


@triton.jit
def _low_rank_tile(g_ptr, a_ptr, rank, g_row_stride, a_row_stride, rows, cols, row_ok, col_ok,
                   BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    ks = tl.arange(0, BLOCK_RANK)
    k_ok = ks < rank
    g = tl.load(g_ptr + rows[:, None] * g_row_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
    a = tl.load(a_ptr + ks[:, None].to(tl.int64) * a_row_stride + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
    return exact_dot(g, a)


@triton.jit
def _dx_bits_kernel(dx_ptr, g_ptrs, a_ptrs, word_ptrs, ranks, g_row_strides, a_row_strides, word_row_strides, factors,
                    n_rows, n_cols, dx_row_stride, N_TERMS: tl.constexpr, WIDE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                    BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    rows, cols, row_ok, col_ok = grid_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    ok = row_ok[:, None] & col_ok[None, :]
    dx_at = dx_ptr + rows[:, None] * dx_row_stride + cols[None, :]
    total = tl.load(dx_at, mask=ok, other=0.0).to(tl.float32)
    keep0 = _keep(word_ptrs[0], word_row_strides[0], rows, cols, row_ok, ok, n_cols, WIDE, BLOCK_COLS)
    keep1 = keep0
    keep2 = keep0
    if N_TERMS > 1:
        keep1 = _keep(word_ptrs[1], word_row_strides[1], rows, cols, row_ok, ok, n_cols, WIDE, BLOCK_COLS)
    if N_TERMS > 2:
        keep2 = _keep(word_ptrs[2], word_row_strides[2], rows, cols, row_ok, ok, n_cols, WIDE, BLOCK_COLS)
    product0 = _low_rank_tile(g_ptrs[0], a_ptrs[0], ranks[0], g_row_strides[0], a_row_strides[0], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
    total += tl.where(keep0 != 0, product0 * factors[0], 0.0)
    if N_TERMS > 1:
        product1 = _low_rank_tile(g_ptrs[1], a_ptrs[1], ranks[1], g_row_strides[1], a_row_strides[1], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
        total += tl.where(keep1 != 0, product1 * factors[1], 0.0)
    if N_TERMS > 2:
        product2 = _low_rank_tile(g_ptrs[2], a_ptrs[2], ranks[2], g_row_strides[2], a_row_strides[2], rows, cols, row_ok, col_ok, BLOCK_ROWS, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
        total += tl.where(keep2 != 0, product2 * factors[2], 0.0)
    tl.store(dx_at, round_to(total, dx_ptr.dtype.element_ty), mask=ok)


def dx_bits(dx: torch.Tensor, terms: Sequence[MaskedLowRank], words: Sequence[torch.Tensor], block_rows: int,
            block_cols: int, num_warps: int, wide: bool = False) -> torch.Tensor:  # fmt: skip
    """``dx += sum_t f_t m_t (G_t A_t)`` in place, the masks read from their packed ``words``."""
    n_rows, n_cols = dx.shape
    gs, as_ = tuple(t.g for t in terms), tuple(t.a for t in terms)
    _dx_bits_kernel[(cdiv(n_rows, block_rows), cdiv(n_cols, block_cols))](
        dx, gs, as_, tuple(words), tuple(g.shape[1] for g in gs), tuple(g.stride(0) for g in gs),
        tuple(a.stride(0) for a in as_), tuple(w.stride(0) for w in words), tuple(float(t.factor) for t in terms),
        n_rows, n_cols, dx.stride(0), N_TERMS=len(terms), WIDE=wide, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        BLOCK_RANK=dot_size(R), num_warps=num_warps,
    )  # fmt: skip
    return dx


# --- dA_t = f_t (s G_t)^T (x * m_t): masked_a_grad's kernel, the masks as bits --------------------


@triton.jit
def _add_masked_product(acc, x, gs_ptr, gs_row_stride, rank, word_ptr, word_row_stride, rows, row_ok, cols, ok,
                        n_cols, WIDE: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    ks = tl.arange(0, BLOCK_RANK)
    gs = tl.load(gs_ptr + rows[:, None] * gs_row_stride + ks[None, :], mask=row_ok[:, None] & (ks < rank)[None, :], other=0.0)  # fmt: skip
    keep = _keep(word_ptr, word_row_stride, rows, cols, row_ok, ok, n_cols, WIDE, BLOCK_COLS)
    return acc + exact_dot(tl.trans(gs), tl.where(keep != 0, x, tl.zeros_like(x)))


@triton.jit
def _store_partial(acc, factor, partials_ptr, group, rank_start, rank, n_ranks, n_cols, cols, col_ok,
                   BLOCK_RANK: tl.constexpr):  # fmt: skip
    ks = tl.arange(0, BLOCK_RANK)
    out = partials_ptr + (group.to(tl.int64) * n_ranks + rank_start + ks[:, None]) * n_cols + cols[None, :]
    tl.store(out, acc * factor, mask=(ks < rank)[:, None] & col_ok[None, :])


@triton.jit
def _da_bits_kernel(x_ptr, gs_ptrs, gs_row_strides, word_ptrs, word_row_strides, ranks, rank_starts, factors,
                    partials_ptr, n_rows, n_cols, n_ranks, x_row_stride, N_TERMS: tl.constexpr, WIDE: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr):  # fmt: skip
    group, groups = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    acc0 = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    for tile in range(group, tl.cdiv(n_rows, BLOCK_ROWS), groups):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=ok, other=0.0)
        acc0 = _add_masked_product(acc0, x, gs_ptrs[0], gs_row_strides[0], ranks[0], word_ptrs[0], word_row_strides[0], rows, row_ok, cols, ok, n_cols, WIDE, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 1:
            acc1 = _add_masked_product(acc1, x, gs_ptrs[1], gs_row_strides[1], ranks[1], word_ptrs[1], word_row_strides[1], rows, row_ok, cols, ok, n_cols, WIDE, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
        if N_TERMS > 2:
            acc2 = _add_masked_product(acc2, x, gs_ptrs[2], gs_row_strides[2], ranks[2], word_ptrs[2], word_row_strides[2], rows, row_ok, cols, ok, n_cols, WIDE, BLOCK_COLS, BLOCK_RANK)  # fmt: skip
    _store_partial(acc0, factors[0], partials_ptr, group, rank_starts[0], ranks[0], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 1:
        _store_partial(acc1, factors[1], partials_ptr, group, rank_starts[1], ranks[1], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip
    if N_TERMS > 2:
        _store_partial(acc2, factors[2], partials_ptr, group, rank_starts[2], ranks[2], n_ranks, n_cols, cols, col_ok, BLOCK_RANK)  # fmt: skip


def da_bits(x: torch.Tensor, terms: Sequence[MaskedA], words: Sequence[torch.Tensor],
            params: masked_a_grad.LaunchParams, wide: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """``[f_t (s G_t)^T (x * m_t)]``, the masks read from their packed ``words``, at ``params``."""
    ranks = [t.gs.shape[1] for t in terms]
    n_rows, n_cols = x.shape
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    groups, strips = column_strip_grid(n_rows, n_cols, params.block_rows, params.block_cols, x.device,
                                       params.programs_per_sm)  # fmt: skip
    partials = torch.empty((groups, sum(ranks), n_cols), dtype=torch.float32, device=x.device)
    gss = tuple(t.gs for t in terms)
    _da_bits_kernel[(groups, strips)](
        x, gss, tuple(g.stride(0) for g in gss), tuple(words), tuple(w.stride(0) for w in words), tuple(ranks),
        tuple(starts), tuple(float(t.factor) for t in terms), partials, n_rows, n_cols, sum(ranks), x.stride(0),
        N_TERMS=len(terms), WIDE=wide, BLOCK_ROWS=params.block_rows, BLOCK_COLS=params.block_cols, BLOCK_RANK=dot_size(R),
        num_warps=params.num_warps,
    )  # fmt: skip
    stacked = sum_rows(partials.view(groups, -1), x.dtype).view(sum(ranks), n_cols)
    return [stacked.narrow(0, s, r) for s, r in zip(starts, ranks, strict=True)]


# --- inputs, check, timings -----------------------------------------------------------------------


def _inputs(m: int, k: int, device: str, n_terms: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device=device).manual_seed(m + k + n_terms)
    c = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter's tl.dot is wrong on bf16
    x = torch.randn(m, k, device=device, generator=gen).to(c)
    dx = torch.randn(m, k, device=device, generator=gen).to(c)
    masks = [torch.rand(m, k, device=device, generator=gen) >= P for _ in range(n_terms)]
    gs = [torch.randn(m, R, device=device, generator=gen).to(c) for _ in range(n_terms)]
    a = [torch.randn(R, k, device=device, generator=gen).to(c) for _ in range(n_terms)]
    f = 1.0 / (1.0 - P)
    dx_terms = [MaskedLowRank(g, ai, mask, f) for g, ai, mask in zip(gs, a, masks, strict=True)]
    da_terms = [MaskedA(g, mask, f, c) for g, mask in zip(gs, masks, strict=True)]
    return x, dx, dx_terms, da_terms, [pack_bits(mask) for mask in masks]


DX_LAUNCHES = ((32, 128, 2), (64, 128, 4))  # (rows, columns, warps): the module's first
DA_LAUNCHES = (masked_a_grad.LAUNCH[16], masked_a_grad.LaunchParams(32, 128, 4, 4))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=what)


def _bool_dx(dx: torch.Tensor, terms: Sequence[MaskedLowRank]) -> torch.Tensor:
    return masked_low_rank.add_masked_low_ranks_(dx.clone(), terms)


def check(device: str) -> None:
    m, k = (48, 160) if device == "cpu" else (16384, K)
    dx_launches = ((16, 32, 2), (32, 64, 4)) if device == "cpu" else DX_LAUNCHES
    da_launches = (masked_a_grad.LaunchParams(16, 32, 2, 2),) if device == "cpu" else DA_LAUNCHES
    for n_terms in (1, 3):
        x, dx, dx_terms, da_terms, words = _inputs(m, k, device, n_terms)
        assert all(torch.equal(w, pack_bits(t.mask)) for w, t in zip(words, dx_terms, strict=True))
        want = _bool_dx(dx, dx_terms)
        for launch in dx_launches:
            for wide in (False, True):
                _close(dx_bits(dx.clone(), dx_terms, words, *launch, wide), want, f"dx {n_terms} {launch} {wide}")
        wants = masked_a_grad.masked_a_grads(x, da_terms)
        for params in da_launches:
            for wide in (False, True):
                for got, w in zip(da_bits(x, da_terms, words, params, wide), wants, strict=True):
                    _close(got, w, f"dA {n_terms} {params} {wide}")
    print("mask_bits: the passes reading packed masks within rounding of the bool kernels (dx, dA; 1 and 3 masks)")


def timings(copy: float) -> None:
    for n_terms in (3, 1):
        x, dx, dx_terms, da_terms, words = _inputs(16384, K, "cuda", n_terms)
        mask_mb = n_terms * x.numel() / 1e6
        print(f"== 16384 x {K}, {n_terms} mask(s): bool {mask_mb:.0f} MB, bits {mask_mb / 8:.0f} MB", flush=True)
        base = bench.time_ms(lambda: masked_low_rank.add_masked_low_ranks_(dx, dx_terms), gpu_only=True)  # noqa: B023
        print(f"  dx  bool, the module's launch        {base * 1e3:7.1f} us", flush=True)
        for launch in DX_LAUNCHES:
            for wide in (False, True):
                t = bench.time_ms(lambda: dx_bits(dx, dx_terms, words, *launch, wide), gpu_only=True)  # noqa: B023
                how = "words" if wide else "gather"
                print(f"  dx  bits, {how:6s} {launch!s:20s} {t * 1e3:7.1f} us  ({t / base:.3f}x)", flush=True)
        base = bench.time_ms(lambda: masked_a_grad.masked_a_grads(x, da_terms), gpu_only=True)  # noqa: B023
        print(f"  dA  bool, the module's launch        {base * 1e3:7.1f} us", flush=True)
        for params in DA_LAUNCHES:
            for wide in (False, True):
                t = bench.time_ms(lambda: da_bits(x, da_terms, words, params, wide), gpu_only=True)  # noqa: B023
                how = "words" if wide else "gather"
                print(f"  dA  bits, {how:6s} {tuple(params)!s:20s} {t * 1e3:7.1f} us  ({t / base:.3f}x)", flush=True)


def main() -> None:
    bench.run_probe(argparse.ArgumentParser(), check, lambda args, copy: timings(copy))


if __name__ == "__main__":
    main()
