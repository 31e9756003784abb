"""torch's CUDA dropout masks, drawn inside fk's kernels bit for bit: PEFT's masks without
``torch.native_dropout`` writing the dropped input.

PEFT's LoRA dropout is ``torch.native_dropout`` on the input. On a CUDA device its mask comes from
Philox-4x32-10 (curand's), laid out by the launch: ``T`` threads (blocks of 256, at most
``multiprocessors x max_threads_per_multiprocessor / 256`` blocks), each handling ``V`` consecutive
elements an iteration (``V``, the kernel's vector size: 8 for a 16-byte-aligned 16-bit tensor
whose size 8 divides, 4 for fp32, on the torch versions measured) and striding by ``T V``. So the
keep bit of element ``e`` of the flattened input is, with ``it = e // (T V)``,
``thread = (e mod T V) // V``, ``j = e mod V``:

    words = philox(key = seed, counter = offset / 4 + it (V / 4) + j // 4, subsequence = thread)
    u = float32(words[j mod 4]) * 2^-32 + 2^-33 (curand_uniform4)
    keep = u < float32(1 - p)

with ``(seed, offset)`` the device generator's state when the call is made, after which the
generator's offset moves on by ``4 ceil(numel / (4 T))`` (rounded up to a multiple of 4): all of
it public arithmetic. :func:`reserve` moves the generator exactly so and returns each draw's
:class:`Draw`; :func:`keep_tile` draws a tile of the mask inside a kernel; :func:`keep_ref` is the
same in plain PyTorch (int64 arithmetic), the reference both are tested against.

Whether this torch lays its masks out so is checked once per device and dtype, against
``torch.native_dropout`` itself (:func:`replicates`: one draw of a few million elements, compared,
the generator put back); where it does not (another torch, another vector size, a CUDA graph being
captured, an offset not a multiple of 4), :func:`reserve` returns None and the caller draws with
``torch.native_dropout`` as before. No mask is ever silently different from PEFT's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_THREADS = 256
"""Threads a block of torch's dropout kernel (``dropout_cuda``'s ``block_size``)."""
_MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = tl.constexpr(0xD2511F53), tl.constexpr(0xCD9E8D57)
"""Philox-4x32's multipliers (curand's ``PHILOX_M4x32_0/1``, Triton's ``PHILOX_ROUND_A/B``)."""
PHILOX_W0, PHILOX_W1 = tl.constexpr(0x9E3779B9), tl.constexpr(0xBB67AE85)
"""Added to the key after each round (``PHILOX_W32_0/1``, ``PHILOX_KEY_A/B``)."""
PHILOX_ROUNDS = tl.constexpr(10)


class Draw(NamedTuple):
    """One ``torch.native_dropout`` call's random numbers: what :func:`keep_tile` needs."""

    seed: int
    """The generator's seed (the Philox key), 0 to 2**64 - 1."""
    counter: int
    """The generator's offset when the call is made, divided by 4 (offsets are multiples of 4)."""
    threads: int
    """``T``: the threads torch's kernel launches for this size on this device."""
    vec: int
    """``V``: elements a thread handles an iteration (4 or 8)."""
    p_keep: float
    """``1 - p``, compared in fp32."""


# --- 1. Reference ---------------------------------------------------------------------------------


def _mul_wide(m: int, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of ``m * a`` for 32-bit unsigned ``m`` and int64 ``a`` in [0, 2**32):
    in 16-bit halves, so that no int64 product overflows."""
    low_part = (a & 0xFFFF) * m  # < 2**48
    t = (a >> 16) * m + (low_part >> 16)  # < 2**49
    return t >> 16, ((t & 0xFFFF) << 16) | (low_part & 0xFFFF)


def philox_ref(seed: int, counter: torch.Tensor, subsequence: torch.Tensor) -> list[torch.Tensor]:
    """Philox-4x32-10's four 32-bit words (int64 tensors) for 64-bit ``counter`` and ``subsequence``
    (int64 tensors, broadcast), key ``seed``: curand's ``curand_Philox4x32_10`` with counter words
    ``(counter lo, counter hi, subsequence lo, subsequence hi)``."""
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2, c3 = subsequence & _MASK32, (subsequence >> 32) & _MASK32
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(PHILOX_ROUNDS.value):
        hi0, lo0 = _mul_wide(PHILOX_M0.value, c0)
        hi1, lo1 = _mul_wide(PHILOX_M1.value, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0.value) & _MASK32, (k1 + PHILOX_W1.value) & _MASK32
    return [c0, c1, c2, c3]


def keep_ref(n_elements: int, draw: Draw, device: torch.device | str = "cpu") -> torch.Tensor:
    """The keep mask (bool ``[n_elements]``) of the flattened input torch's dropout draws with
    ``draw``, in plain PyTorch: the module docstring's formula."""
    e = torch.arange(n_elements, dtype=torch.int64, device=device)
    per_iteration = draw.threads * draw.vec
    j = e % draw.vec
    counter = draw.counter + (e // per_iteration) * (draw.vec // 4) + j // 4
    words = torch.stack(philox_ref(draw.seed, counter, (e % per_iteration) // draw.vec), dim=1)
    bits = words.gather(1, (j % 4)[:, None])[:, 0]
    return _uniform(bits) < torch.tensor(draw.p_keep, dtype=torch.float32, device=device)


def _uniform(words: torch.Tensor) -> torch.Tensor:
    """curand's ``_curand_uniform``: ``float32(w) 2^-32 + 2^-33``, one rounding (its fma), in fp32."""
    return (words.to(torch.float32).double() * 2.0**-32 + 2.0**-33).float()


@functools.cache
def keep_threshold(p_keep: float) -> int:
    """The least 32-bit word ``w`` whose uniform is not below ``float32(p_keep)``: ``w`` is kept
    exactly when ``w < keep_threshold(p_keep)`` (the uniform rises with ``w``), so the kernels compare
    words, not floats (no int-to-float conversion: a quarter-rate instruction on an H200)."""
    target = torch.tensor(p_keep, dtype=torch.float32)
    low, high = 0, 2**32  # invariant: uniform(low - 1) < target <= uniform(high), uniform(2**32) := inf
    while low < high:
        middle = (low + high) // 2
        if _uniform(torch.tensor(middle, dtype=torch.int64)) < target:
            low = middle + 1
        else:
            high = middle
    return low


# --- 2. The kernels' part -------------------------------------------------------------------------


@triton.jit
def _philox(seed, c0, c1, c2, c3):
    """Philox-4x32-10 of 32-bit words (uint32 tensors), key ``seed``: as ``tl.philox``, but each
    round's two 32 x 32-bit products as 64-bit ones (``mul.wide.u32``: high and low words from one
    instruction, where ``tl.philox``'s ``umulhi`` and ``mul`` are two)."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(PHILOX_ROUNDS):
        p0 = c0.to(tl.uint64) * PHILOX_M0
        p2 = c2.to(tl.uint64) * PHILOX_M1
        c0, c1, c2, c3 = (
            (p2 >> 32).to(tl.uint32) ^ c1 ^ k0,
            p2.to(tl.uint32),
            (p0 >> 32).to(tl.uint32) ^ c3 ^ k1,
            p0.to(tl.uint32),
        )
        k0 += PHILOX_W0
        k1 += PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def _keep_words(seed, counter, thread, below):
    """The four keep bits of one Philox draw (``counter`` int64, ``thread`` int32 tensors): each
    word below ``below`` (uint32, :func:`keep_threshold`)."""
    zero = tl.zeros_like(thread).to(tl.uint32)
    # tl.cast, not seed.to: a seed of 1 arrives as a constexpr int (Triton specializes integer
    # arguments equal to 1), which has no .to (torch.manual_seed(1) failed to compile on a GPU)
    w0, w1, w2, w3 = _philox(tl.cast(seed, tl.uint64), (counter & 0xFFFFFFFF).to(tl.uint32),
                             (counter >> 32).to(tl.uint32), thread.to(tl.uint32), zero)  # fmt: skip
    return w0 < below, w1 < below, w2 < below, w3 < below


@triton.jit
def _interleave(k0, k1, k2, k3):
    """``[..., G, 4]`` with ``k_j`` at position ``j`` (as ``[..., G, 2, 2]``; a join's new axis is
    the last, so the first join pairs the elements two apart)."""
    return tl.join(tl.join(k0, k2), tl.join(k1, k3))


@triton.jit
def keep_tile(seed, counter, threads, threshold, rows, first_col, groups_per_row, VEC: tl.constexpr,
              BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):  # fmt: skip
    """The keep mask (bool ``[BLOCK_ROWS, BLOCK_COLS]``) of rows ``rows`` (int64) and columns
    ``first_col`` on of a contiguous ``[M, K]`` input, ``K = groups_per_row VEC`` (``first_col`` and
    ``BLOCK_COLS`` multiples of ``VEC``), ``threshold`` the draw's :func:`keep_threshold`: one
    Philox draw for each 4 elements, as torch's kernel. (The words are spread over their elements
    by joins: shifting a group's bits out over a third axis instead computed each draw 8 times,
    compiled for sm_90, in the layout Triton gave that axis.)"""
    below = tl.cast(threshold, tl.uint32)  # (as the seed in _keep_words: any scalar argument may arrive as 1)
    groups: tl.constexpr = BLOCK_COLS // VEC
    # flat e // V, in int32 (the input has fewer than 2**31 elements; int64 division costs far more)
    group = rows.to(tl.int32)[:, None] * groups_per_row + (first_col // VEC + tl.arange(0, groups))[None, :]
    iteration = group // threads
    thread = group - iteration * threads
    counter = counter + iteration.to(tl.int64) * (VEC // 4)
    k0, k1, k2, k3 = _keep_words(seed, counter, thread, below)
    if VEC == 4:
        keep = _interleave(k0, k1, k2, k3)
    else:  # VEC == 8: elements 4..7 of each group from the next draw, the draw the slowest axis
        h0, h1, h2, h3 = _keep_words(seed, counter + 1, thread, below)
        keep = _interleave(tl.join(k0, h0), tl.join(k1, h1), tl.join(k2, h2), tl.join(k3, h3))
    return tl.reshape(keep, (BLOCK_ROWS, BLOCK_COLS))


@triton.jit
def _keep_mask_kernel(out_ptr, seed, counter, threads, threshold, n_groups, VEC: tl.constexpr, BLOCK: tl.constexpr):
    first = tl.program_id(0) * BLOCK
    keep = keep_tile(seed, counter, threads, threshold, tl.zeros((1,), tl.int64), first, n_groups, VEC, 1, BLOCK)
    cols = first + tl.arange(0, BLOCK)
    tl.store(out_ptr + cols[None, :], keep, mask=cols[None, :] < n_groups * VEC)


KEEP_MASK_BLOCK = 1024
"""Elements a program of :func:`keep_mask` draws."""


def keep_mask(n_elements: int, draw: Draw, device: torch.device | str) -> torch.Tensor:
    """The keep mask (bool ``[n_elements]``, ``n_elements`` a multiple of ``draw.vec``) by
    :func:`keep_tile`, on ``device`` (a CUDA device, or the CPU in Triton's interpreter)."""
    if n_elements % draw.vec:
        raise ValueError(f"n_elements must be a multiple of draw.vec = {draw.vec}, got {n_elements}")
    out = torch.empty(n_elements, dtype=torch.bool, device=device)
    _keep_mask_kernel[(triton.cdiv(n_elements, KEEP_MASK_BLOCK),)](
        out, draw.seed, draw.counter, draw.threads, keep_threshold(draw.p_keep), n_elements // draw.vec,
        VEC=draw.vec, BLOCK=KEEP_MASK_BLOCK,
    )  # fmt: skip
    return out


# --- 3. The generator's side ----------------------------------------------------------------------


def _launch_threads(n_elements: int, device: torch.device) -> int:
    """``T``: torch's dropout grid (``ceil(n / 256)`` blocks, at most what the device keeps resident)
    times 256."""
    props = torch.cuda.get_device_properties(device)
    resident = props.multi_processor_count * (props.max_threads_per_multi_processor // BLOCK_THREADS)
    return min(resident, triton.cdiv(n_elements, BLOCK_THREADS)) * BLOCK_THREADS


def _offset_step(n_elements: int, threads: int) -> int:
    """How far one call moves the generator's offset (torch's ``counter_offset``)."""
    return ((n_elements - 1) // (threads * 4) + 1) * 4


def _vector_size(x: torch.Tensor, widest: int, aligned: bool = False) -> int:
    """The vector size torch's dropout kernel takes for ``x`` (contiguous), at most ``widest``: the
    widest of 8, 4, 2, 1 that ``x``'s address is aligned to (taken as aligned with ``aligned``) and
    its size divides."""
    vec = widest
    while vec > 1 and ((not aligned and x.data_ptr() % (vec * x.element_size())) or x.numel() % vec):
        vec //= 2
    return vec


def _generator(device: torch.device) -> torch.Generator:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def _draws(x: torch.Tensor, ps: list[float], vec: int, generator: torch.Generator) -> list[Draw] | None:
    """Each of ``ps``' draws on ``x``, in order, the generator moved past them; None (the generator
    untouched) where its offset is not a multiple of 4."""
    offset = generator.get_offset()
    if offset % 4:
        return None
    threads = _launch_threads(x.numel(), x.device)
    step = _offset_step(x.numel(), threads)
    seed = generator.initial_seed()
    draws = [Draw(seed, (offset + i * step) // 4, threads, vec, 1.0 - p) for i, p in enumerate(ps)]
    generator.set_offset(offset + len(ps) * step)
    return draws


def replicates(device: torch.device, dtype: torch.dtype) -> int:
    """The vector size (8 or 4) at which this torch's dropout masks for ``dtype`` on ``device`` are
    :func:`keep_ref`'s, or 0 where they are neither: checked once (:func:`_replicated_vector_size`).
    Also 0, for this call only, while the generator's offset is not a multiple of 4 (the check's own
    draws could not start there); the verdict is remembered only once the check has run."""
    if _generator(device).get_offset() % 4:
        return 0
    return _replicated_vector_size(device, dtype)


@functools.cache
def _replicated_vector_size(device: torch.device, dtype: torch.dtype) -> int:
    """:func:`replicates`' check, at a generator offset that is a multiple of 4: a draw of a few
    million elements (two iterations of every thread and part of a third) compared with
    ``torch.native_dropout``'s, the generator put back where it was, so that the masks drawn after
    the check are the ones PEFT would draw."""
    generator = _generator(device)
    offset = generator.get_offset()
    threads = _launch_threads(2**30, device)
    x = torch.ones(2 * threads * 8 + 8 * 3, dtype=dtype, device=device)
    try:
        _, torch_mask = torch.native_dropout(x, 0.25, True)
        for vec in (8, 4):
            if vec <= 16 // x.element_size():
                generator.set_offset(offset)
                draws = _draws(x, [0.25], vec, generator)
                if draws is not None and torch.equal(keep_mask(x.numel(), draws[0], device), torch_mask):
                    return vec
        return 0
    finally:
        generator.set_offset(offset)


def reserve(x: torch.Tensor, ps: list[float], drawn_as: torch.dtype | None = None) -> list[Draw] | None:
    """The draws of ``torch.native_dropout(x, p, True)`` for each ``p`` in ``ps``, called in that
    order, with the device's default generator moved past them as those calls would; None (nothing
    moved) where fk cannot replicate them: ``x`` not a contiguous CUDA tensor, a vector size torch
    would not take the layout of :func:`keep_tile` at, a CUDA graph being captured, or a torch whose
    masks :func:`replicates` did not find equal.

    ``drawn_as``: the draws on ``x`` cast to that dtype instead (PEFT casts its input to the LoRA
    weights' fp32, or its MLP forms down's input in fp32, before the dropout), a new tensor and so
    aligned as the caching allocator aligns its blocks (512 bytes)."""
    if not x.is_cuda or not x.is_contiguous() or x.numel() == 0 or x.numel() >= 2**31:
        return None
    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return None
    widest = replicates(x.device, x.dtype if drawn_as is None else drawn_as)
    if widest == 0:
        return None
    vec = _vector_size(x, widest, aligned=drawn_as is not None)
    if vec < 4:
        return None
    return _draws(x, ps, vec, _generator(x.device))
