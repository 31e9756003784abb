"""Probe: cross entropy's fused pass with each row split over several programs that hold their
chunk in registers, so a row of logits is read once and written once.

ce_fused_l2_probe.py found the committed fused pass at 98% of the copy bandwidth for its three
passes (two reads and a write), with no help from the L2 at any launch setting. Here a row of V
columns is split into G = cdiv(V, CHUNK) chunks, one per program (G programs a row, P / G rows in
flight). Each chunk of each row has a state word: 0 unclaimed, 1 its owner is loading it, 2 a helper
is reading it, 3 its (max, sum of exp) is published. Each program:
  1. claims its chunk (0 -> 1) and publishes its partial sums (-> 3, and the row's count + 1);
     if a helper had claimed it (2), it leaves the publishing to the helper. The chunk itself
     (kept in registers) was loaded during the previous row's wait;
  2. polls the row's count, at most ``max_spins`` times, until all G are published;
  3. if they are not (a partner not resident, or Triton's interpreter, which runs programs one
     after another), it becomes a helper: it claims every unclaimed chunk (0 -> 2), reads it and
     publishes its partial sums, with the same code as the owner (so the same bits), then waits for
     the chunks others have claimed: their claimers are running and wait for nothing first;
  4. combines the G partials into the log-sum-exp and overwrites its chunk with the gradient.
A chunk is published only after its last read, so no gradient overwrites logits someone still
needs, and every wait without a bound is on a program that is running, so nothing deadlocks.
(The first version, without the count and the early load, is in git; its output on an H100 is
ce_split_row_v1_h100.txt: 47.5% of copy at best.)

Run on a GPU: python benchmarks/experiments/ce_split_row_probe.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from fk.core import bench


@triton.jit
def _partial(z):
    m = tl.max(z, axis=0)
    return m, tl.sum(tl.exp(z - m), axis=0)


@triton.jit
def _load_chunk(row_ptr, chunk, n_cols, CHUNK: tl.constexpr):
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    return tl.load(row_ptr + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)


@triton.jit
def _publish(slot, states, counts, j, m, s):
    """Store chunk j's partial sums, mark them published and count them (release: whoever reads the
    count or the state with acquire then sees the sums)."""
    tl.store(slot + 2 * j, m)
    tl.store(slot + 2 * j + 1, s)
    tl.debug_barrier()  # every thread's stores before the release (CUTLASS's semaphore does the same)
    tl.atomic_xchg(states + j, 3, sem="release")
    tl.atomic_add(counts, 1, sem="release")


@triton.jit
def _split_row_kernel(
    x_ptr, target_ptr, lse_ptr, partial_ptr, state_ptr, count_ptr, fallback_ptr,
    n_rows, n_cols, stride, scale, max_spins,
    CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr, N_CHUNKS_POW2: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    chunk = pid % N_CHUNKS
    first_row = pid // N_CHUNKS
    rows_in_flight = tl.num_programs(0) // N_CHUNKS
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    k = tl.arange(0, N_CHUNKS_POW2)
    # Each program's chunk of its next row is loaded before the current row's wait: the load is in
    # flight while the program waits for its partners.
    x_next = tl.load(x_ptr + tl.cast(first_row, tl.int64) * stride + cols, mask=mask & (first_row < n_rows),
                     other=-float("inf"))  # fmt: skip
    for row in range(first_row, n_rows, rows_in_flight):
        row64 = tl.cast(row, tl.int64)
        base = x_ptr + row64 * stride
        slot = partial_ptr + row64 * N_CHUNKS * 2
        states = state_ptr + row64 * N_CHUNKS
        counts = count_ptr + row
        label = tl.load(target_ptr + row).to(tl.int32)
        z = x_next.to(tl.float32)
        after = row + rows_in_flight
        x_next = tl.load(x_ptr + tl.cast(after, tl.int64) * stride + cols, mask=mask & (after < n_rows),
                         other=-float("inf"))  # fmt: skip
        # 1. Claim and publish this program's chunk (loaded already: only this program writes it, so
        #    it may load before claiming). A helper may have claimed it: then the helper publishes it.
        if tl.atomic_cas(states + chunk, 0, 1, sem="acq_rel") == 0:
            m, s = _partial(z)
            _publish(slot, states, counts, chunk, m, s)
        # 2. Wait a bounded while for the other chunks' partials.
        arrived = tl.atomic_add(counts, 0, sem="acquire")
        spins = 0
        while (arrived < N_CHUNKS) & (spins < max_spins):
            arrived = tl.atomic_add(counts, 0, sem="acquire")
            spins += 1
        # 3. Not all in: compute the unclaimed ones here (nobody has read them, so nobody has
        #    written their gradient), then wait for the claimed ones, whose claimers are running
        #    and wait for nothing before they publish.
        if arrived < N_CHUNKS:
            tl.atomic_add(fallback_ptr, 1)
            for j in range(0, N_CHUNKS):
                if tl.atomic_cas(states + j, 0, 2, sem="acq_rel") == 0:
                    mj, sj = _partial(_load_chunk(base, j, n_cols, CHUNK))
                    _publish(slot, states, counts, j, mj, sj)
            while tl.atomic_add(counts, 0, sem="acquire") < N_CHUNKS:
                pass
        # 4. Every chunk of the row has been read (a chunk is published only after its last read):
        #    combine the partials and overwrite this chunk with its gradient.
        pm = tl.load(slot + 2 * k, mask=k < N_CHUNKS, other=-float("inf"), volatile=True)
        ps = tl.load(slot + 2 * k + 1, mask=k < N_CHUNKS, other=0.0, volatile=True)
        m_row = tl.max(pm, axis=0)
        lse = m_row + tl.log(tl.sum(ps * tl.exp(pm - m_row), axis=0))
        if chunk == 0:
            tl.store(lse_ptr + row, lse)
        dz = (tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
        tl.store(base + cols, dz.to(x_ptr.dtype.element_ty), mask=mask)


def split_row_pass(
    x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, *, chunk: int, warps: int, per_sm: int, max_spins: int,
    states: torch.Tensor | None = None, fallbacks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Runs the kernel on ``x`` in place; returns the partial sums ``[rows, G, 2]``."""
    rows, cols = x.shape
    n_chunks = triton.cdiv(cols, chunk)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    in_flight = max(1, min(rows, sms * per_sm // n_chunks))
    partial = torch.empty(rows, n_chunks, 2, device=x.device)
    # One zeroed buffer: a state word per chunk, then a count per row.
    if states is None:
        states = torch.zeros(rows * (n_chunks + 1), dtype=torch.int32, device=x.device)
    else:
        states.zero_()
    fallbacks = torch.zeros(1, dtype=torch.int32, device=x.device) if fallbacks is None else fallbacks
    _split_row_kernel[(in_flight * n_chunks,)](
        x, t, lse, partial, states, states[rows * n_chunks :], fallbacks, rows, cols, x.stride(0), 1.0, max_spins,
        CHUNK=chunk, N_CHUNKS=n_chunks, N_CHUNKS_POW2=triton.next_power_of_2(n_chunks), num_warps=warps,
    )  # fmt: skip
    return partial


def main() -> None:
    copy = bench.copy_bandwidth_tbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; copy ceiling {copy:.2f} TB/s; counted as one read and one write")

    def data(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, vocab, device="cuda", generator=gen).to(torch.bfloat16)
        t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        return x, t, torch.empty(tokens, device="cuda")

    # Correct with and without waiting (max_spins 0: every program that is not last computes the
    # partials itself), and the same bits either way.
    x, t, lse = data(300, 32011)
    ref_lse = torch.logsumexp(x.float(), -1)
    ref_grad = torch.softmax(x.float(), -1) - torch.nn.functional.one_hot(t, 32011).float()
    outs = []
    for spins in (0, 100000):
        y = x.clone()
        fb = torch.zeros(1, dtype=torch.int32, device="cuda")
        partial = split_row_pass(y, t, lse, chunk=4096, warps=8, per_sm=2, max_spins=spins, fallbacks=fb)
        want = torch.nn.functional.pad(x.float(), (0, 8 * 4096 - 32011), value=-float("inf")).view(300, 8, 4096)
        want_m = want.max(-1).values
        want_s = (want - want_m[..., None]).exp().sum(-1)
        bad = ((partial[..., 0] - want_m).abs() > 1e-6) | ((partial[..., 1] - want_s).abs() > 1e-3 * want_s)
        if bad.any():
            print(
                f"max_spins={spins}: {int(bad.sum())} wrong partials; by chunk {bad.sum(0).tolist()}; "
                f"first: {bad.nonzero()[:5].tolist()}"
            )
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(y.float(), ref_grad, atol=2e-2, rtol=1e-2)
        outs.append((y, lse.clone()))
        print(f"max_spins={spins}: matches PyTorch; {fb.item()} programs computed the partials themselves")
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), "waiting changed the result"
    print("same bits with and without waiting")

    tokens, vocab = 8192, 128256
    x, t, lse = data(tokens, vocab)
    nbytes = 2 * x.numel() * 2
    states = torch.zeros(tokens * (triton.cdiv(vocab, 2048) + 1), dtype=torch.int32, device="cuda")
    fb = torch.zeros(1, dtype=torch.int32, device="cuda")
    results = []
    for chunk, warps, per_sm in itertools.product((4096, 8192, 16384), (4, 8, 16), (1, 2, 3, 4)):
        per_thread = chunk // (32 * warps)
        if per_thread < 8 or per_thread > 32:
            continue
        fb.zero_()
        ms = bench.time_ms(
            lambda c=chunk, w=warps, p=per_sm, x=x: split_row_pass(
                x, t, lse, chunk=c, warps=w, per_sm=p, max_spins=1 << 20, states=states, fallbacks=fb
            ),
            warmup=5, rep=40,
        )  # fmt: skip
        frac = bench.tbps(nbytes, ms) / copy
        results.append((ms, chunk, warps, per_sm))
        print(f"chunk={chunk:5d} warps={warps:2d} per_sm={per_sm}: {ms:.3f} ms, {frac:5.1%} of copy, "
              f"{fb.item()} fallbacks", flush=True)  # fmt: skip
    results.sort()
    print("best five:")
    for ms, *setting in results[:5]:
        print(f"  chunk, warps, per_sm = {setting}: {ms:.3f} ms, {bench.tbps(nbytes, ms) / copy:5.1%} of copy")
    del x
    for vocab in (32000, 65536, 152064, 256000):
        x, t, lse = data((1 << 30) // vocab, vocab)
        nbytes = 2 * x.numel() * 2
        states = torch.zeros(x.shape[0] * (triton.cdiv(vocab, 2048) + 1), dtype=torch.int32, device="cuda")
        for _ms, chunk, warps, per_sm in results[:2]:
            fb.zero_()
            ms = bench.time_ms(
                lambda c=chunk, w=warps, p=per_sm, x=x, t=t, lse=lse, states=states: split_row_pass(
                    x, t, lse, chunk=c, warps=w, per_sm=p, max_spins=1 << 20, states=states, fallbacks=fb
                ),
                warmup=5, rep=40,
            )  # fmt: skip
            print(f"V={vocab:6d} rows={x.shape[0]:6d} chunk={chunk} warps={warps} per_sm={per_sm}: {ms:.3f} ms, "
                  f"{bench.tbps(nbytes, ms) / copy:5.1%} of copy, {fb.item()} fallbacks")  # fmt: skip
        del x


if __name__ == "__main__":
    main()
