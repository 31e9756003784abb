"""Rotary position embedding (RoPE): q and k rotated in one launch.

For each token and head, the first ``rotary_dim`` features of ``x`` (a head of q or of k) are
split into pairs ``(x1, x2)`` and rotated by the position's angle; the remaining
``head_dim - rotary_dim`` features pass through unchanged (partial rotary, as Phi and GLM use)::

    y = x * cos + rot(x) * sin          (on the first rotary_dim features)

Two conventions define the pairs and ``rot``:

- rotate-half (``interleaved=False``; Llama, Mistral, Qwen, Gemma: Hugging Face's
  ``apply_rotary_pos_emb``): pairs are ``(x[i], x[i + rotary_dim/2])`` and
  ``rot(x) = cat(-x[rotary_dim/2:], x[:rotary_dim/2])``. ``cos``/``sin`` are laid out as Hugging
  Face computes them, ``cat(freqs, freqs)``.
- interleaved (``interleaved=True``; GPT-J, GPT-NeoX-style "rotate every two"): pairs are
  ``(x[2i], x[2i+1])`` and ``rot(x) = stack(-x[1::2], x[0::2])`` interleaved. ``cos``/``sin`` are
  laid out as ``repeat_interleave(freqs, 2)``, as Hugging Face's GPT-J computes them.

In both conventions the formula is applied elementwise with the full ``cos``/``sin`` rows, exactly
as the eager formulas do, so any ``cos``/``sin`` give the eager result (not only ones with the
duplicated layout). The math runs in fp32; outputs have the dtype of q and k.

``cos``/``sin`` have shape ``(B or 1, S, rotary_dim)`` (or ``(S, rotary_dim)``), as Hugging Face's
rotary embedding returns them, or, with ``position_ids`` of shape ``(B or 1, S)``, are a table
``(B or 1, P, rotary_dim)`` indexed by position (packed sequences restart their positions). They
are loaded once per token and reused across all heads of q and k. ``cos`` and ``sin`` are not
differentiated: passing ones that require grad while autograd records raises a ``ValueError``.

This file holds, in order: the reference, the Triton kernel, the launchers registered as custom
ops, and the functional API (:func:`rope`, :func:`rope_single` for one tensor, and the drop-in
:func:`apply_rotary_pos_emb`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import cdiv, next_power_of_2
from fk.core.ops import define_autograd_op

LAYOUTS = ("bhsd", "bshd")
"""``"bhsd"``: q is ``(B, heads, S, D)`` (Hugging Face's default, ``unsqueeze_dim=1``);
``"bshd"``: q is ``(B, S, heads, D)`` (``unsqueeze_dim=2``, flash-attention's layout)."""

POSITION_DTYPES = (torch.int32, torch.int64)


# --- 1. Reference ---------------------------------------------------------------------------------


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin_per_token(
    cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` as ``(B or 1, S, rotary_dim)``: the rows of each token's position."""
    cos3 = cos if cos.ndim == 3 else cos.unsqueeze(0)
    sin3 = sin if sin.ndim == 3 else sin.unsqueeze(0)
    if position_ids is None:
        return cos3, sin3
    pos = position_ids.long()
    if cos3.shape[0] == 1:
        return cos3[0][pos], sin3[0][pos]
    batch = torch.arange(cos3.shape[0], device=pos.device)[:, None]
    pos = pos.expand(cos3.shape[0], pos.shape[1])
    return cos3[batch, pos], sin3[batch, pos]


def rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    layout: str = "bhsd",
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch RoPE of q and k (computes in fp32, or fp64 for fp64 input); see the module docstring.

    This is the definition the kernels are tested against. Arguments are as in :func:`rope`.
    """
    c, s = _cos_sin_per_token(cos, sin, position_ids)
    # (B or 1, S, rd) -> broadcastable against q in its layout
    c, s = (c.unsqueeze(1), s.unsqueeze(1)) if layout == "bhsd" else (c.unsqueeze(2), s.unsqueeze(2))
    rd = cos.shape[-1]

    def apply(x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        rot = xf[..., :rd]
        y = rot * c.to(compute) + _rotate(rot, interleaved) * s.to(compute)
        return torch.cat((y, xf[..., rd:]), dim=-1).to(x.dtype)

    return apply(q), apply(k)


# --- 2. Kernel ------------------------------------------------------------------------------------
#
# For one pair (x1, x2) of a head (x1 = x[i], x2 = x[i + rd/2] for rotate-half; x1 = x[2i],
# x2 = x[2i+1] interleaved), with c1, c2, s1, s2 the cos/sin entries at the same two features:
#   y1 = x1 c1 - x2 s1
#   y2 = x2 c2 + x1 s2
# Backward (the transpose of that 2x2 map; the inverse rotation when c1 = c2 and s1 = s2, as in
# every model's cos/sin):
#   dx1 = dy1 c1 + dy2 s2
#   dx2 = dy2 c2 - dy1 s1
# which is the forward map with (s1, s2) replaced by (-s2, -s1): one kernel does both
# (BACKWARD swaps and negates the sines). Features past rd pass through: dx = dy there.
#
# Grid: (cdiv(S, BLOCK_S), B). A program takes BLOCK_S tokens of one sequence, loads their cos/sin
# rows once (fp32, [BLOCK_S, HALF_PAD] per half) and applies them to every head of q, then of k,
# in tiles of [BLOCK_S, BLOCK_H, HALF_PAD] per half. Head counts and dims are constexpr, so the
# head loops unroll and their masks vanish when the block divides the count. Where q and k are one
# tile each (LOADS_FIRST), the program loads both before it stores either, as Liger's kernel does.


@triton.jit
def _pair_offsets(HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Feature offsets of the first and second element of each pair, and the mask of real pairs.

    Interleaved pairs are read with two stride-2 accesses: they touch the same cache lines, so the
    memory traffic is that of one contiguous access.
    """
    idx = tl.arange(0, HALF_PAD)
    if INTERLEAVED:
        first = 2 * idx
        second = first + 1
    else:
        first = idx
        second = idx + HALF
    return first, second, idx < HALF


@triton.jit
def _load_pairs(ptrs, mask, HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(x1, x2) in fp32 from a [..., 1] pointer tile at feature 0 of each row: [..., HALF_PAD] each."""
    first, second, real = _pair_offsets(HALF, HALF_PAD, INTERLEAVED)
    m = mask & real
    x1 = tl.load(ptrs + first, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + second, mask=m, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_pairs(ptrs, mask, y1, y2, HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Store (y1, y2) at the features _load_pairs read them from, in the pointers' dtype."""
    first, second, real = _pair_offsets(HALF, HALF_PAD, INTERLEAVED)
    m = mask & real
    tl.store(ptrs + first, y1.to(ptrs.dtype.element_ty), mask=m)
    tl.store(ptrs + second, y2.to(ptrs.dtype.element_ty), mask=m)


@triton.jit
def _head_tile(x_ptr, o_ptr, x_tok, o_tok, tok_mask, x_sh, o_sh, h0, N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Pointers at feature 0 of heads h0 .. h0 + BLOCK_H of each token, in and out ([BLOCK_S, BLOCK_H, 1]), and their mask."""
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (tok_mask[:, None] & (h < N_HEADS)[None, :])[:, :, None]
    x_ptrs = (x_ptr + x_tok[:, None] + h[None, :] * x_sh)[:, :, None]
    o_ptrs = (o_ptr + o_tok[:, None] + h[None, :] * o_sh)[:, :, None]
    return x_ptrs, o_ptrs, mask


@triton.jit
def _store_rotated(o_ptrs, mask, x1, x2, c1, c2, s1, s2, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   INTERLEAVED: tl.constexpr):  # fmt: skip
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    _store_pairs(o_ptrs, mask, y1, y2, HALF, HALF_PAD, INTERLEAVED)


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr,  # one of q/k and its output, at the first feature of the first head
    x_tok, o_tok,  # [BLOCK_S] int64 offsets of each token (batch and sequence strides applied)
    tok_mask,  # [BLOCK_S]
    x_sh, o_sh,  # head strides
    c1, c2, s1, s2,  # [BLOCK_S, 1, HALF_PAD] fp32
    N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT_DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr, PASS_PAD: tl.constexpr, COPY_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    for h0 in tl.static_range(0, N_HEADS, BLOCK_H):
        x_ptrs, o_ptrs, mask = _head_tile(x_ptr, o_ptr, x_tok, o_tok, tok_mask, x_sh, o_sh, h0, N_HEADS, BLOCK_H)
        x1, x2 = _load_pairs(x_ptrs, mask, HALF, HALF_PAD, INTERLEAVED)
        _store_rotated(o_ptrs, mask, x1, x2, c1, c2, s1, s2, HALF, HALF_PAD, INTERLEAVED)
        if COPY_PASS:  # out of place with rotary_dim < head_dim: copy the features that pass through
            p = ROT_DIM + tl.arange(0, PASS_PAD)
            pm = mask & (p < HEAD_DIM)
            rest = tl.load(x_ptrs + p, mask=pm, other=0.0)
            tl.store(o_ptrs + p, rest.to(o_ptr.dtype.element_ty), mask=pm)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,  # [B, S, N_QH, HEAD_DIM] and [B, S, N_KH, HEAD_DIM] (any strides, unit feature stride)
    qo_ptr, ko_ptr,  # outputs of the same shapes (may be q_ptr/k_ptr: in place)
    cos_ptr, sin_ptr,  # [Bc, P, ROT_DIM], unit feature stride; batch stride 0 when shared (Bc = 1)
    pos_ptr,  # [Bp, S] int position ids (batch stride 0 when shared), read when HAS_POS
    seq_len,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,  # batch, sequence and head strides (elements)
    qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,
    cos_sb, cos_sp, sin_sb, sin_sp,  # batch and position strides of cos and sin
    pos_sb, pos_ss,
    N_QH: tl.constexpr, N_KH: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, BACKWARD: tl.constexpr,
    DO_Q: tl.constexpr, DO_K: tl.constexpr, COPY_PASS: tl.constexpr,
    LOADS_FIRST: tl.constexpr,  # q and k each one tile of heads, no pass-through copy: load both before storing
):  # fmt: skip
    HALF: tl.constexpr = ROT_DIM // 2
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    tok_mask = s < seq_len
    s = s.to(tl.int64)
    if HAS_POS:  # noqa: SIM108 (both branches must not be traced)
        pos = tl.load(pos_ptr + b * pos_sb + s * pos_ss, mask=tok_mask, other=0).to(tl.int64)
    else:
        pos = s
    cos_ptrs = (cos_ptr + b * cos_sb + pos * cos_sp)[:, None]
    sin_ptrs = (sin_ptr + b * sin_sb + pos * sin_sp)[:, None]
    c1, c2 = _load_pairs(cos_ptrs, tok_mask[:, None], HALF, HALF_PAD, INTERLEAVED)
    s1, s2 = _load_pairs(sin_ptrs, tok_mask[:, None], HALF, HALF_PAD, INTERLEAVED)
    if BACKWARD:
        s1, s2 = -s2, -s1
    c1, c2, s1, s2 = c1[:, None, :], c2[:, None, :], s1[:, None, :], s2[:, None, :]
    q_tok, qo_tok = b * q_sb + s * q_ss, b * qo_sb + s * qo_ss
    k_tok, ko_tok = b * k_sb + s * k_ss, b * ko_sb + s * ko_ss
    if LOADS_FIRST:
        # All four loads in flight before the first store (a store may alias a later load, in place,
        # so the compiler keeps the source order).
        qx, qo, qm = _head_tile(q_ptr, qo_ptr, q_tok, qo_tok, tok_mask, q_sh, qo_sh, 0, N_QH, BLOCK_HQ)
        kx, ko, km = _head_tile(k_ptr, ko_ptr, k_tok, ko_tok, tok_mask, k_sh, ko_sh, 0, N_KH, BLOCK_HK)
        q1, q2 = _load_pairs(qx, qm, HALF, HALF_PAD, INTERLEAVED)
        k1, k2 = _load_pairs(kx, km, HALF, HALF_PAD, INTERLEAVED)
        _store_rotated(qo, qm, q1, q2, c1, c2, s1, s2, HALF, HALF_PAD, INTERLEAVED)
        _store_rotated(ko, km, k1, k2, c1, c2, s1, s2, HALF, HALF_PAD, INTERLEAVED)
    else:
        if DO_Q:
            _rotate_heads(
                q_ptr, qo_ptr, q_tok, qo_tok, tok_mask, q_sh, qo_sh,
                c1, c2, s1, s2, N_QH, BLOCK_HQ, HALF, HALF_PAD, ROT_DIM, HEAD_DIM, PASS_PAD, COPY_PASS, INTERLEAVED,
            )  # fmt: skip
        if DO_K:
            _rotate_heads(
                k_ptr, ko_ptr, k_tok, ko_tok, tok_mask, k_sh, ko_sh,
                c1, c2, s1, s2, N_KH, BLOCK_HK, HALF, HALF_PAD, ROT_DIM, HEAD_DIM, PASS_PAD, COPY_PASS, INTERLEAVED,
            )  # fmt: skip


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

# Launch parameters (benchmarks/tune_rope.py sweeps them on a GPU; INDEX.md#rope_loads_first for the
# last two: Llama-3-8B heads, H200, 1-2.5% less forward+backward time at S = 1024, 4096 and 16384).
TOKEN_ELEMENTS = 4096  # a program takes enough tokens to hold at least this many q+k elements
MAX_BLOCK_S = 16  # ... but at most this many tokens
TILE_ELEMENTS = 4096  # most elements (tokens x heads x padded head size) of one tile of q or k
ELEMENTS_PER_WARP = 512  # one warp per this many q+k elements of a program
MAX_WARPS = 8
LOADS_FIRST = True  # q and k each one tile of heads: all their loads issued before the stores


def _floor_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True)
class RopeTiling:
    """Tokens per program, heads per tile of q and of k, and warps per program."""

    block_s: int
    block_hq: int
    block_hk: int
    num_warps: int


@functools.lru_cache(maxsize=256)
def rope_tiling(n_q_heads: int, n_k_heads: int, head_dim: int) -> RopeTiling:
    """The launch configuration for q and k with these head counts (0: not processed) and head size."""
    d_pad = next_power_of_2(head_dim)
    per_token = max(1, n_q_heads + n_k_heads) * d_pad
    block_s = min(MAX_BLOCK_S, _floor_power_of_2(TOKEN_ELEMENTS // per_token))
    max_heads = _floor_power_of_2(TILE_ELEMENTS // (block_s * d_pad))

    def heads(n: int) -> int:
        return max(1, min(next_power_of_2(n), max_heads))

    num_warps = min(MAX_WARPS, _floor_power_of_2(block_s * per_token // ELEMENTS_PER_WARP))
    return RopeTiling(block_s, heads(n_q_heads), heads(n_k_heads), num_warps)


def _unit_feature_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] == 1 or x.stride(-1) == 1 else x.contiguous()


def _empty_out(x: torch.Tensor) -> torch.Tensor:
    """An output for ``x``: its strides when it is dense with unit feature stride, else contiguous.

    (Eager elementwise ops keep the strides of a dense input, e.g. a transposed projection output.)
    """
    out = torch.empty_like(x)  # preserve_format: x's strides if dense, else contiguous
    return out if _unit_feature_stride(out) is out else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _check_positions(position_ids: torch.Tensor | None, n_positions: int) -> None:
    """Position ids must index the cos/sin table (one host synchronization)."""
    if position_ids is None or position_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(position_ids))
    if lo < 0 or hi >= n_positions:
        raise ValueError(
            f"position_ids must be in [0, {n_positions}) (the rows of cos and sin), got values in [{lo}, {hi}]"
        )


Pair = tuple[torch.Tensor, torch.Tensor]


def _bsh_strides(x: torch.Tensor, bshd: bool) -> tuple[int, int, int]:
    """Batch, sequence and head strides of ``x`` in the user's layout."""
    st = x.stride()
    return (st[0], st[1], st[2]) if bshd else (st[0], st[2], st[1])


def _table_strides(t: torch.Tensor) -> tuple[int, int]:
    """Batch stride (0 when shared by the batch) and position stride of a cos/sin tensor."""
    if t.ndim == 2:
        return 0, t.stride(0)
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1)


def _launch(
    q: Pair | None,
    k: Pair | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    bshd: bool,
    interleaved: bool,
    backward: bool,
) -> None:
    """Run the kernel once for q and k: each is (input, output) or None (not touched).

    Inputs and outputs have the user's layout and a unit feature stride; an output may be its input
    (in place). In the backward, the inputs are the upstream gradients and the outputs dq and dk.
    Strides are read, never views made: this runs on every call, and host time counts.
    """
    heads = 2 if bshd else 1
    q = q if q is not None and q[0].shape[heads] else None  # (a tensor of no heads is not touched: rope_single's k)
    k = k if k is not None and k[0].shape[heads] else None
    some = q if q is not None else k
    if some is None:
        return
    q_in, q_out = q if q is not None else some
    k_in, k_out = k if k is not None else some
    shape = q_in.shape
    batch, seq_len, head_dim = shape[0], shape[1 if bshd else 2], shape[3]
    n_qh, n_kh = (shape[2], k_in.shape[2]) if bshd else (shape[1], k_in.shape[1])
    if batch == 0 or seq_len == 0:
        return
    rot_dim = cos.shape[-1]
    cos, sin = _unit_feature_stride(cos), _unit_feature_stride(sin)
    pos, pos_sb, pos_ss = cos, 0, 0  # pos is never read when HAS_POS is False
    if position_ids is not None:
        pos, pos_ss = position_ids, position_ids.stride(1)
        pos_sb = position_ids.stride(0) if position_ids.shape[0] > 1 else 0
    tiling = rope_tiling(n_qh if q is not None else 0, n_kh if k is not None else 0, head_dim)
    copy_pass = rot_dim < head_dim and (q_out.data_ptr() != q_in.data_ptr() or k_out.data_ptr() != k_in.data_ptr())
    grid = (cdiv(seq_len, tiling.block_s), batch)
    loads_first = (LOADS_FIRST and q is not None and k is not None and not copy_pass
                   and tiling.block_hq >= n_qh and tiling.block_hk >= n_kh)  # fmt: skip
    _rope_kernel[grid](
        q_in, k_in, q_out, k_out, cos, sin, pos, seq_len,
        *_bsh_strides(q_in, bshd), *_bsh_strides(k_in, bshd), *_bsh_strides(q_out, bshd), *_bsh_strides(k_out, bshd),
        *_table_strides(cos), *_table_strides(sin), pos_sb, pos_ss,
        N_QH=n_qh, N_KH=n_kh, HEAD_DIM=head_dim, ROT_DIM=rot_dim,
        HALF_PAD=next_power_of_2(rot_dim // 2), PASS_PAD=next_power_of_2(max(1, head_dim - rot_dim)),
        BLOCK_S=tiling.block_s, BLOCK_HQ=tiling.block_hq, BLOCK_HK=tiling.block_hk,
        INTERLEAVED=interleaved, HAS_POS=position_ids is not None, BACKWARD=backward,
        DO_Q=q is not None, DO_K=k is not None, COPY_PASS=copy_pass, LOADS_FIRST=loads_first,
        num_warps=tiling.num_warps,
    )  # fmt: skip


def _rope_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    bshd: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher: returns (q_embed, k_embed), new tensors with the shapes and dtypes of q and k."""
    _check_positions(position_ids, cos.shape[-2])
    q_out, k_out = _empty_out(q), _empty_out(k)
    pairs = (_unit_feature_stride(q), q_out), (_unit_feature_stride(k), k_out)
    _launch(*pairs, cos, sin, position_ids, bshd, interleaved, backward=False)
    return q_out, k_out


def _rope_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    bshd: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_out(q), _empty_out(k)


def _rope_fwd_inplace(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    bshd: bool,
    interleaved: bool,
) -> None:
    """Rotate q and k (or q alone when k is None) where they lie (eager only: see :func:`rope`)."""
    _check_positions(position_ids, cos.shape[-2])
    pairs: list[Pair | None] = []
    for x in (q, k):
        if x is not None and _unit_feature_stride(x) is not x:  # features not contiguous: rotate a copy
            x_embed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            _launch((x.contiguous(), x_embed), None, cos, sin, position_ids, bshd, interleaved, backward=False)
            x.copy_(x_embed)
            x = None
        pairs.append(None if x is None else (x, x))
    _launch(pairs[0], pairs[1], cos, sin, position_ids, bshd, interleaved, backward=False)


def _rope_bwd(
    dq_embed: torch.Tensor | None,
    dk_embed: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    bshd: bool,
    interleaved: bool,
    need_dq: bool,
    need_dk: bool,
    q_strides: list[int],
    k_strides: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward launcher: (dq, dk); one not needed (or whose upstream gradient is None) is an empty
    tensor. ``q_strides``/``k_strides``: the strides dq and dk get (see :func:`_bwd_outputs`)."""
    dq, dk, q_pair, k_pair = _bwd_outputs(dq_embed, dk_embed, need_dq, need_dk, q_strides, k_strides)
    _launch(q_pair, k_pair, cos, sin, position_ids, bshd, interleaved, backward=True)
    return dq, dk


def _grad_out(upstream: torch.Tensor, strides: list[int]) -> torch.Tensor:
    """dq or dk: with ``strides`` (the forward's output strides: q's or k's own layout, so that the
    views the caller made q and k from take the gradient back without a copy), or, without them,
    the upstream gradient's (see :func:`_empty_out`)."""
    if strides:
        return torch.empty_strided(upstream.shape, strides, dtype=upstream.dtype, device=upstream.device)
    return _empty_out(upstream)


def _bwd_outputs(
    dq_embed: torch.Tensor | None,
    dk_embed: torch.Tensor | None,
    need_dq: bool,
    need_dk: bool,
    q_strides: list[int],
    k_strides: list[int],
) -> tuple[torch.Tensor, torch.Tensor, Pair | None, Pair | None]:
    some = dq_embed if dq_embed is not None else dk_embed
    assert some is not None, "the backward needs at least one upstream gradient"
    q_pair = k_pair = None
    dq, dk = some.new_empty(0), some.new_empty(0)
    if need_dq and dq_embed is not None:
        dq = _grad_out(dq_embed, q_strides)
        # Upstream gradients may have any strides, even all zero (from loss.sum()).
        q_pair = (_unit_feature_stride(dq_embed), dq)
    if need_dk and dk_embed is not None:
        dk = _grad_out(dk_embed, k_strides)
        k_pair = (_unit_feature_stride(dk_embed), dk)
    return dq, dk, q_pair, k_pair


def _rope_bwd_fake(
    dq_embed: torch.Tensor | None,
    dk_embed: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    bshd: bool,
    interleaved: bool,
    need_dq: bool,
    need_dk: bool,
    q_strides: list[int],
    k_strides: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    dq, dk, _, _ = _bwd_outputs(dq_embed, dk_embed, need_dq, need_dk, q_strides, k_strides)
    return dq, dk


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, cos, sin, position_ids, bshd, interleaved = inputs
    # The rotation of a tensor that needs no gradient does not either (as in the eager formula).
    frozen = [out for x, out in zip((q, k), output, strict=True) if not x.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.bshd, ctx.interleaved = bshd, interleaved
    # dq and dk take the outputs' strides, which are q's and k's own where those are dense (see
    # _empty_out): a gradient in the layout of the view q was made from (Hugging Face's
    # proj(x).view(...).transpose(1, 2)) flows back through that view without a copy.
    ctx.out_strides = [list(out.stride()) for out in output]
    ctx.set_materialize_grads(False)


def _backward(
    run_backward: Any, ctx: Any, dq_embed: torch.Tensor | None, dk_embed: torch.Tensor | None
) -> tuple[Any, ...]:
    cos, sin, position_ids = ctx.saved_tensors
    need_dq, need_dk = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    nones = (None, None, None, None, None)
    do_q, do_k = need_dq and dq_embed is not None, need_dk and dk_embed is not None
    if not (do_q or do_k):
        return None, None, *nones
    dq, dk = run_backward(
        dq_embed, dk_embed, cos, sin, position_ids, ctx.bshd, ctx.interleaved, do_q, do_k, *ctx.out_strides
    )
    return (dq if do_q else None), (dk if do_k else None), *nones


_rope = define_autograd_op(
    __name__, "rope",
    forward=_rope_fwd, forward_fake=_rope_fwd_fake,
    backward_launcher=_rope_bwd, backward_fake=_rope_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip


class _RopeInplace(torch.autograd.Function):
    """Eager in-place RoPE of one tensor (q or k) with autograd; the backward is that of :data:`_rope`.

    One tensor per Function: autograd cannot mark two views (q and k are usually views of one
    projection output) dirty in one Function. A custom op that writes into its inputs cannot have
    an autograd formula either, so under ``torch.compile`` the in-place option is the functional op
    followed by a copy (see :func:`rope`).
    """

    @staticmethod
    def forward(*inputs: Any) -> Any:
        x, cos, sin, position_ids, bshd, interleaved = inputs
        _rope_fwd_inplace(x, None, cos, sin, position_ids, bshd, interleaved)
        return x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, cos, sin, position_ids, bshd, interleaved = inputs
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.bshd, ctx.interleaved = bshd, interleaved
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dx_embed: torch.Tensor | None) -> Any:
        if dx_embed is None:
            return None, None, None, None, None, None
        cos, sin, position_ids = ctx.saved_tensors
        dx, _ = _rope_bwd(dx_embed, None, cos, sin, position_ids, ctx.bshd, ctx.interleaved, True, False, [], [])
        return dx, None, None, None, None, None


# --- 4. Functional API ----------------------------------------------------------------------------


def _check_inputs(
    q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, layout: str, interleaved: Any, inplace: Any
) -> None:
    validate.check_choice("layout", layout, LAYOUTS)
    for name, value in (("interleaved", interleaved), ("inplace", inplace)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        validate.check_tensor(name, t)
        validate.check_dtype(name, t)
    validate.check_ndim("q", q, 4)
    validate.check_ndim("k", k, 4)
    validate.check_same_dtype("k", k, "q", q)
    validate.check_same_device("k", k, "q", q)
    dims = "(B, heads, S, D)" if layout == "bhsd" else "(B, S, heads, D)"
    b_q, s_q, d_q = q.shape[0], q.shape[1 if layout == "bshd" else 2], q.shape[3]
    b_k, s_k, d_k = k.shape[0], k.shape[1 if layout == "bshd" else 2], k.shape[3]
    if (b_k, s_k, d_k) != (b_q, s_q, d_q):
        raise ValueError(
            f"k must have the batch size, sequence length and head size of q in layout {layout!r} {dims}: "
            f"q has shape {tuple(q.shape)}, k has shape {tuple(k.shape)}"
        )
    validate.check_ndim("cos", cos, (2, 3))
    validate.check_shape("sin", sin, cos.shape)
    validate.check_same_device("cos", cos, "q", q)
    validate.check_same_device("sin", sin, "q", q)
    rot_dim = cos.shape[-1]
    if rot_dim < 2 or rot_dim % 2 or rot_dim > d_q:
        raise ValueError(
            f"cos and sin must have an even last dimension (rotary_dim) in [2, head_dim={d_q}], got shape {tuple(cos.shape)}"
        )
    if cos.ndim == 3 and cos.shape[0] not in (1, b_q):
        raise ValueError(f"cos must have batch size 1 or {b_q} (that of q), got shape {tuple(cos.shape)}")
    if position_ids is None:
        if cos.shape[-2] != s_q:
            raise ValueError(
                f"cos must have one row per token ({s_q}, the sequence length of q) without position_ids, "
                f"got shape {tuple(cos.shape)}"
            )
    else:
        validate.check_tensor("position_ids", position_ids)
        validate.check_dtype("position_ids", position_ids, POSITION_DTYPES)
        validate.check_ndim("position_ids", position_ids, 2)
        validate.check_same_device("position_ids", position_ids, "q", q)
        if position_ids.shape[0] not in (1, b_q) or position_ids.shape[1] != s_q:
            raise ValueError(f"position_ids must have shape (1 or {b_q}, {s_q}), got {tuple(position_ids.shape)}")
    if torch.is_grad_enabled():
        for name, t in (("cos", cos), ("sin", sin)):
            if t.requires_grad:
                raise ValueError(
                    f"{name} requires grad, but fk.rope does not differentiate cos and sin: pass {name}.detach()"
                )
        if inplace:
            validate.check_overwritable("q", q, "inplace")
            validate.check_overwritable("k", k, "inplace")


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    layout: str = "bhsd",
    interleaved: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k in one kernel launch; returns ``(q_embed, k_embed)``.

    Args:
        q: ``(B, Hq, S, D)`` (``layout="bhsd"``) or ``(B, S, Hq, D)`` (``"bshd"``); fp32/fp16/bf16,
            any strides (views of a fused qkv projection are read in place, with no copy).
        k: like q with its own head count ``Hk`` (grouped-query attention), same dtype.
        cos, sin: ``(B or 1, S, rotary_dim)`` or ``(S, rotary_dim)``, any float dtype; with
            ``position_ids``, a table ``(B or 1, P, rotary_dim)`` or ``(P, rotary_dim)`` indexed by
            position. ``rotary_dim`` is even and at most ``D``; features past it pass through.
            Not differentiated: they must not require grad while autograd records.
        position_ids: optional ``(B or 1, S)`` int32/int64 row indices into cos/sin (packed
            sequences). Checked to lie in ``[0, P)``, which costs one host synchronization.
        layout: ``"bhsd"`` or ``"bshd"``, as above.
        interleaved: rotate pairs ``(x[2i], x[2i+1])`` (GPT-J) instead of ``(x[i], x[i + rd/2])``.
        inplace: write the result into q and k and return them (no new activation memory). q and k
            must not be leaves that require grad. Without autograd, one launch rotates both; while
            autograd records, q and k take one launch each (autograd cannot mark two views of one
            projection dirty in one function). Under ``torch.compile`` this is the out-of-place op
            followed by ``copy_`` into q and k (the compiler may turn it back into an in-place op).

    The math runs in fp32; outputs have the dtype of q. Gradients flow to q and k only (the
    backward is the inverse rotation, one launch for both); one that needs no gradient gets no work.
    """
    _check_inputs(q, k, cos, sin, position_ids, layout, interleaved, inplace)
    bshd = layout == "bshd"
    if not uses_kernel(q):
        q_embed, k_embed = rope_ref(q, k, cos, sin, position_ids, layout=layout, interleaved=interleaved)
        if inplace:
            return q.copy_(q_embed), k.copy_(k_embed)
        return q_embed, k_embed
    compiling = torch.compiler.is_compiling()
    records = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if not inplace:
        if compiling or records:
            q_embed, k_embed = _rope(q, k, cos, sin, position_ids, bshd, interleaved)
            return q_embed, k_embed
        return _rope_fwd(q, k, cos, sin, position_ids, bshd, interleaved)  # nothing to record: no autograd node
    if compiling:
        q_embed, k_embed = _rope(q, k, cos, sin, position_ids, bshd, interleaved)
        return q.copy_(q_embed), k.copy_(k_embed)
    if records:
        # One launch for each of q and k (see _RopeInplace).
        out = []
        for x in (q, k):
            if x.requires_grad:
                out.append(_RopeInplace.apply(x, cos, sin, position_ids, bshd, interleaved))
            else:
                _rope_fwd_inplace(x, None, cos, sin, position_ids, bshd, interleaved)
                out.append(x)
        return out[0], out[1]
    _rope_fwd_inplace(q, k, cos, sin, position_ids, bshd, interleaved)
    return q, k


def rope_single(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    layout: str = "bhsd",
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotary position embedding of one tensor (q or k alone, as Gemma 3n and Gemma 4 rotate them,
    each after its own norm); returns ``x_embed``. Arguments as in :func:`rope`, with ``x`` in
    place of q (no in-place option). It is :func:`rope` with a k of no heads, which the kernel
    leaves untouched: one launch, x's gradient from one launch too."""
    validate.check_choice("layout", layout, LAYOUTS)
    validate.check_tensor("x", x)
    validate.check_dtype("x", x)
    validate.check_ndim("x", x, 4)
    no_heads = x.narrow(2 if layout == "bshd" else 1, 0, 0)
    return rope(x, no_heads, cos, sin, position_ids, layout=layout, interleaved=interleaved)[0]


_UNSQUEEZE_LAYOUT = {1: "bhsd", -3: "bhsd", 2: "bshd", -2: "bshd"}


def layout_of_unsqueeze_dim(unsqueeze_dim: int) -> str:
    """The layout Hugging Face's ``unsqueeze_dim`` means: 1 is ``"bhsd"``, 2 is ``"bshd"`` (or -3, -2)."""
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in _UNSQUEEZE_LAYOUT:
        raise ValueError(
            f"unsqueeze_dim must be 1 (q is (B, heads, S, D)) or 2 (q is (B, S, heads, D)), got {unsqueeze_dim!r}"
        )
    return _UNSQUEEZE_LAYOUT[unsqueeze_dim]


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for Hugging Face's ``apply_rotary_pos_emb`` (Llama and its relatives): rotate-half RoPE.
    With ``interleaved=True``, the drop-in for the families whose ``rotate_half`` rotates the pairs
    ``(x[2i], x[2i+1])`` with the tables as given (Cohere's, Helium's: their rotary module repeats
    each frequency twice in place).

    ``unsqueeze_dim=1`` takes q/k as ``(B, heads, S, D)``, ``unsqueeze_dim=2`` as ``(B, S, heads, D)``.
    ``cos``/``sin`` are ``(B or 1, S, rotary_dim)`` as the model's rotary embedding returns them;
    ``position_ids`` is then ignored, as in Hugging Face since 4.38. With a ``(P, rotary_dim)``
    table (older Hugging Face), ``position_ids`` selects its rows. A ``rotary_dim`` below the head
    size rotates the leading features and passes the rest through. Returns ``(q_embed, k_embed)``;
    computes in fp32 and rounds once (the eager formula rounds each product to the input dtype).
    """
    layout = layout_of_unsqueeze_dim(unsqueeze_dim)
    if isinstance(cos, torch.Tensor) and cos.ndim != 2:
        position_ids = None
    return rope(q, k, cos, sin, position_ids, layout=layout, interleaved=interleaved)
