"""Multimodal rotary position embedding (mRoPE, Qwen2-VL): RoPE whose angles come from three position ids.

A token of a vision-language model has three positions: temporal, height and width (a text token
has the same value in all three). mRoPE gives each of the ``rotary_dim / 2`` rotary frequencies one
of the three axes, and rotates that frequency's pair of features by the angle of the token's
position on that axis::

    y = x * cos[axis(f)] + rot(x) * sin[axis(f)]      (feature f; cos/sin: (3, B, S, rotary_dim))

``mrope_section = [t, h, w]`` (``t + h + w = rotary_dim / 2``) says how many frequencies each axis
gets, in one of two arrangements:

- contiguous (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni, GLM-4V): frequencies ``[0, t)`` take the
  temporal axis, the next ``h`` the height axis, the last ``w`` the width axis.
- interleaved (``mrope_interleaved=True``; Qwen3-VL, Qwen3.5): frequency ``j`` takes the height axis
  when ``j % 3 == 1`` and ``j < 3h``, the width axis when ``j % 3 == 2`` and ``j < 3w``, and the
  temporal axis otherwise (``T H W T H W ... T T``).

The pairs and ``rot`` are :func:`fk.rope.rope`'s: rotate-half (frequency ``j`` at features ``j`` and
``j + rotary_dim/2``, tables laid out ``cat(freqs, freqs)``) or interleaved (``interleaved=True``,
features ``2j`` and ``2j+1``, tables laid out ``repeat_interleave(freqs, 2)``). As in ``rope``, the
formula is applied feature by feature, so any tables give the eager result; features past
``rotary_dim`` pass through.

Hugging Face: transformers 4.x Qwen2-VL/Qwen2.5-VL call ``apply_multimodal_rotary_pos_emb(q, k,
cos, sin, mrope_section)`` in each attention layer, with the three tables stacked; this module's
function of that name is its drop-in. transformers 5 selects the axes once per forward inside the
model's rotary embedding (``recomposition_frequencies``) and the attention layers call an ordinary
``apply_rotary_pos_emb``: there :func:`fk.rope.apply_rotary_pos_emb` (or ``rope(...,
interleaved=True)`` for GLM-4V's pairs) is the drop-in, and this module is not needed.

The fused path builds the per-token tables ``(B or 1, S, rotary_dim)`` from the three (a selection
along the feature dimension: a few small copies that read and write about ``rotary_dim`` elements
per token and table, against the ``2 (Hq + Hk) D`` elements of q and k that the kernel reads and
writes) and hands them to ``rope``'s kernel and custom op.

This file holds, in order: the reference, the kernels (none: ``rope``'s), the launchers (none:
``rope``'s custom op), and the functional API (:func:`mrope`, and the drop-in
:func:`apply_multimodal_rotary_pos_emb`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fk.core import validate
from fk.rope.rope import layout_of_unsqueeze_dim, rope, rope_ref

N_AXES = 3
"""Temporal, height and width: the leading axis of the mRoPE cos/sin tables."""


# --- 1. Reference ---------------------------------------------------------------------------------


def _frequency_axes(mrope_section: Sequence[int], mrope_interleaved: bool) -> list[int]:
    """The axis (0: temporal, 1: height, 2: width) of each of the ``sum(mrope_section)`` frequencies."""
    t, h, w = mrope_section
    if not mrope_interleaved:
        return [0] * t + [1] * h + [2] * w
    return [1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0 for j in range(t + h + w)]


def mrope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    *,
    layout: str = "bhsd",
    interleaved: bool = False,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch mRoPE of q and k (computes in fp32, or fp64 for fp64 input); see the module docstring.

    This is the definition the fused path is tested against. Arguments are as in :func:`mrope`.
    """
    rd = cos.shape[-1]
    axes = _frequency_axes(mrope_section, mrope_interleaved)
    feature_axes = [axes[f // 2] if interleaved else axes[f % (rd // 2)] for f in range(rd)]
    axis = torch.tensor(feature_axes, device=cos.device)
    feature = torch.arange(rd, device=cos.device)
    # cos[axis[f], :, :, f] for every feature f: (rd, B or 1, S) -> (B or 1, S, rd)
    c, s = cos[axis, :, :, feature].movedim(0, -1), sin[axis, :, :, feature].movedim(0, -1)
    return rope_ref(q, k, c, s, layout=layout, interleaved=interleaved)


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# None: once the per-token tables are built, mRoPE is RoPE, and rope's kernel runs it. Per pair
# (x1, x2) of frequency j with angle a = pos[axis(j)] * inv_freq[j]:
#   y1 = x1 cos(a) - x2 sin(a),  y2 = x2 cos(a) + x1 sin(a)
# Backward (the table selection is of constants, so the chain rule stops at rope's map):
#   dx1 = dy1 cos(a) + dy2 sin(a),  dx2 = dy2 cos(a) - dy1 sin(a)
# which is rope's backward with the same per-token tables. cos and sin get no gradient: as in rope,
# ones that require grad while autograd records are rejected.
#
# --- 3. Launchers ---------------------------------------------------------------------------------
#
# None: :func:`fk.rope.rope` registers the custom op (with its fake and autograd formula) that
# torch.compile traces; the table selection below is plain PyTorch, which it traces too.


def _per_token_table(
    table: torch.Tensor, mrope_section: Sequence[int], interleaved: bool, mrope_interleaved: bool
) -> torch.Tensor:
    """``(3, B or 1, S, rd)`` -> ``(B or 1, S, rd)``: each feature's entry from its frequency's axis.

    The features are viewed as ``(2, rd/2)`` (rotate-half: frequency j at features j and j + rd/2)
    or ``(rd/2, 2)`` (interleaved: at 2j and 2j+1), and the frequencies are selected along the
    ``rd/2`` dimension: three slices concatenated (contiguous sections), or the temporal table
    with the height and width frequencies copied over it (interleaved sections).
    """
    half = table.shape[-1] // 2
    freqs = table.unflatten(-1, (half, 2) if interleaved else (2, half))
    dim = -2 if interleaved else -1
    if mrope_interleaved:
        out = freqs[0].clone()
        for axis in (1, 2):
            every_third = slice(axis, N_AXES * mrope_section[axis], N_AXES)
            index = (..., every_third, slice(None)) if interleaved else (..., every_third)
            out[index] = freqs[axis][index]
    else:
        starts = (0, mrope_section[0], mrope_section[0] + mrope_section[1])
        parts = [freqs[axis].narrow(dim, start, mrope_section[axis]) for axis, start in enumerate(starts)]
        out = torch.cat(parts, dim=dim)
    return out.flatten(-2)


# --- 4. Functional API ----------------------------------------------------------------------------


def _check_inputs(cos: Any, sin: Any, mrope_section: Any, interleaved: Any, mrope_interleaved: Any) -> None:
    """What the table selection needs; :func:`fk.rope.rope` checks q, k and the selected tables."""
    for name, value in (("interleaved", interleaved), ("mrope_interleaved", mrope_interleaved)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    for name, t in (("cos", cos), ("sin", sin)):
        validate.check_tensor(name, t)
        validate.check_dtype(name, t)
    if cos.ndim != 4 or cos.shape[0] != N_AXES:
        raise ValueError(
            "cos must have shape (3, B or 1, S, rotary_dim) (a table per temporal, height and width position), "
            f"got {tuple(cos.shape)}"
        )
    validate.check_shape("sin", sin, cos.shape)
    rd = cos.shape[-1]
    if rd < 2 or rd % 2:
        raise ValueError(
            f"cos must have an even last dimension (rotary_dim) of at least 2, got shape {tuple(cos.shape)}"
        )
    sections_ok = isinstance(mrope_section, (list, tuple)) and len(mrope_section) == N_AXES
    sections_ok = sections_ok and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in mrope_section)
    if not sections_ok or sum(mrope_section) != rd // 2:
        raise ValueError(
            f"mrope_section must be 3 non-negative ints (temporal, height, width) summing to rotary_dim / 2 = {rd // 2} "
            f"(cos has shape {tuple(cos.shape)}), got {mrope_section!r}"
        )
    _, h, w = mrope_section
    if mrope_interleaved and (N_AXES * h > rd // 2 + 1 or N_AXES * w > rd // 2):
        raise ValueError(
            f"mrope_section {list(mrope_section)} does not fit the interleaved arrangement of {rd // 2} frequencies "
            f"(height takes frequencies 1, 4, ..., width 2, 5, ...): it needs 3 * {h} <= {rd // 2 + 1} and "
            f"3 * {w} <= {rd // 2}"
        )


def mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    *,
    layout: str = "bhsd",
    interleaved: bool = False,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary position embedding of q and k; returns ``(q_embed, k_embed)``.

    Args:
        q: ``(B, Hq, S, D)`` (``layout="bhsd"``) or ``(B, S, Hq, D)`` (``"bshd"``); fp32/fp16/bf16,
            any strides.
        k: like q with its own head count ``Hk`` (grouped-query attention), same dtype.
        cos, sin: ``(3, B or 1, S, rotary_dim)``, any float dtype: the tables of the temporal,
            height and width positions, each laid out as :func:`fk.rope.rope` expects
            (``cat(freqs, freqs)``, or ``repeat_interleave(freqs, 2)`` with ``interleaved``).
            ``rotary_dim`` is even and at most ``D``; features past it pass through. Not
            differentiated: they must not require grad while autograd records.
        mrope_section: ``[t, h, w]``, the number of frequencies of each axis, ``t + h + w =
            rotary_dim / 2`` (Hugging Face's ``rope_parameters["mrope_section"]``).
        layout: ``"bhsd"`` or ``"bshd"``, as above.
        interleaved: rotate pairs ``(x[2i], x[2i+1])`` instead of ``(x[i], x[i + rd/2])`` (GLM-4V).
        mrope_interleaved: arrange the sections ``T H W T H W ...`` (Qwen3-VL) instead of
            ``T...T H...H W...W`` (Qwen2-VL).

    The per-token tables are selected from the three (plain PyTorch), then :func:`fk.rope.rope`
    rotates q and k in one launch; its backward (one launch) gives dq and dk. The math runs in
    fp32; outputs have the dtype of q.
    """
    _check_inputs(cos, sin, mrope_section, interleaved, mrope_interleaved)
    c = _per_token_table(cos, mrope_section, interleaved, mrope_interleaved)
    s = _per_token_table(sin, mrope_section, interleaved, mrope_interleaved)
    return rope(q, k, c, s, layout=layout, interleaved=interleaved)


def apply_multimodal_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    unsqueeze_dim: int = 1,
    *,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for Hugging Face's ``apply_multimodal_rotary_pos_emb`` of Qwen2-VL, Qwen2.5-VL and
    Qwen2.5-Omni (transformers 4.x): rotate-half mRoPE with contiguous sections.

    ``cos``/``sin`` are ``(3, B, S, rotary_dim)`` as those models' rotary embedding returns them;
    Hugging Face splits them into ``mrope_section * 2`` and takes section ``i`` from axis ``i % 3``,
    which is :func:`mrope`'s selection. ``unsqueeze_dim=1`` takes q/k as ``(B, heads, S, D)``,
    ``unsqueeze_dim=2`` as ``(B, S, heads, D)``. ``mrope_interleaved=True`` arranges the sections
    as Qwen3-VL does. Returns ``(q_embed, k_embed)``; computes in fp32 and rounds once (the eager
    formula rounds each product to the input dtype).

    Not a drop-in for GLM-4V's function of the same name, which rotates interleaved pairs with the
    first half of the tables: that is ``mrope(q, k, cos[..., :rd // 2].repeat_interleave(2, -1),
    sin[..., :rd // 2].repeat_interleave(2, -1), mrope_section, interleaved=True)``.
    """
    layout = layout_of_unsqueeze_dim(unsqueeze_dim)
    return mrope(q, k, cos, sin, mrope_section, layout=layout, mrope_interleaved=mrope_interleaved)
