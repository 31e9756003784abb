"""FusedAddRMSNorm: ``s = x + residual; y = rms_norm(s)`` in one pass, returning ``(y, s)``.

This is the step every pre-norm decoder layer takes twice (Hugging Face's Llama, Mistral, Qwen,
...)::

    residual = residual + hidden_states          # in the activations' dtype
    hidden_states = rms_norm(residual)

One kernel reads ``x`` and ``residual`` once, writes the new residual ``s`` (rounded to x's dtype,
as the eager addition does) and the normalized ``y``. RMSNorm's options carry over: ``casting_mode``
(``"llama"`` or ``"gemma"``), ``offset``, an optional weight whose gradient is computed only when it
requires grad. ``in_place=True`` writes ``s`` over ``residual`` (see :func:`fused_add_rms_norm`).

This file holds, in order: the reference, the kernels (RMSNorm's own, see below), the launchers
registered as custom ops, the functional API :func:`fused_add_rms_norm` and the module
:class:`FusedAddRMSNorm`.
"""

from __future__ import annotations

from typing import Any

import torch

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import writable_rows
from fk.core.ops import define_autograd_op, define_op
from fk.norms.rms_norm import (
    CASTING_MODES,
    _default_offset,
    check_rms_norm_args,
    launch_backward,
    launch_forward,
    module_eps,
    rms_norm_ref,
)

# --- 1. Reference ---------------------------------------------------------------------------------


def fused_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    casting_mode: str = "llama",
    offset: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: ``s = x + residual`` (in x's dtype), ``(rms_norm_ref(s), s)``.

    This is the definition the kernels are tested against.
    """
    s = x + residual
    return rms_norm_ref(s, weight, eps, casting_mode, offset), s


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# No kernel of its own: RMSNorm's two kernels (fk.norms.rms_norm) take this op as constexpr flags.
# Forward, HAS_RESIDUAL: per row, s = round_to_x_dtype(x + residual) is written out (over the
# residual when in place) and normalized; rows wider than one tile re-read s, not x and the
# residual, in their second pass.
#
# Backward. s feeds two places: the output s itself and y = rms_norm(s). With dy and ds the
# gradients of y and s, and rms_norm's backward dx_rms(dy) (see rms_norm.py):
#   d_s       = ds + dx_rms(dy)          (HAS_DRES adds ds inside the kernel: one pass, no extra buffer)
#   d_x       = d_residual = d_s         (s = x + residual: both inputs get the same gradient)
#   dw_j      = sum over rows of dy_j * shat_j, shat = s * rstd (as RMSNorm's)
# The rounding of s to x's dtype is treated as the identity, as autograd treats a cast.


# --- 3. Launchers, registered as custom ops -------------------------------------------------------


def _fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward launcher: returns (y, s = x + residual, rstd fp32 with shape x.shape[:-1])."""
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y, rstd = launch_forward(x, weight, eps, offset, gemma, residual, s.view(-1, x.shape[-1]))
    return y, s, rstd


def _fwd_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, s, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def _fwd_in_place(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher writing s over ``residual``: returns (y, rstd)."""
    rows = writable_rows(residual)
    assert rows is not None  # checked by fused_add_rms_norm before any launch
    return launch_forward(x, weight, eps, offset, gemma, residual, rows)


def _fwd_in_place_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def _bwd(
    dy: torch.Tensor,
    ds: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward launcher: returns (d_s = ds + rms_norm's dx, dw or an empty tensor when not computed)."""
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    dw = launch_backward(dy, s, weight, rstd, offset, compute_dw, dx, dres=ds)
    return dx, (dw if dw is not None else s.new_empty(0))


def _bwd_fake(
    dy: torch.Tensor,
    ds: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    if compute_dw and weight is not None:
        return dx, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return dx, s.new_empty(0)


def _save(ctx: Any, inputs: tuple[Any, ...], s: torch.Tensor, rstd: torch.Tensor) -> None:
    _x, _residual, weight, _eps, offset, _gemma = inputs
    ctx.save_for_backward(s, weight, rstd)
    ctx.offset = offset
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _save(ctx, inputs, output[1], output[2])


def _backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None, ds: torch.Tensor | None, _drstd: Any) -> Any:
    s, weight, rstd = ctx.saved_tensors
    need_x, need_r, need_w = ctx.needs_input_grad[:3]
    if dy is None:  # only s was used: y contributes nothing, d_s = ds
        return ds if need_x else None, ds if need_r else None, None, None, None, None
    if not (need_x or need_r or need_w):
        return (None,) * 6
    d_s, dw = run_backward(dy, ds, s, weight, rstd, ctx.offset, need_w)
    # x and residual get the same tensor: autograd copies it before accumulating into two leaves.
    return (d_s if need_x else None), (d_s if need_r else None), (dw if need_w else None), None, None, None


_fused_add_rms_norm = define_autograd_op(
    __name__, "fused_add_rms_norm",
    forward=_fwd, forward_fake=_fwd_fake,
    backward_launcher=_bwd, backward_fake=_bwd_fake,
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip

# In place without autograd (inference, or no input needs a gradient): a custom op that mutates
# residual, so torch.compile(fullgraph=True) traces it too.
_fused_add_rms_norm_in_place_op = define_op(
    __name__, "fused_add_rms_norm_in_place", _fwd_in_place, fake=_fwd_in_place_fake, mutates_args=("residual",)
)


class _InPlaceWithGrad(torch.autograd.Function):
    """Eager autograd for ``in_place=True``: s is written over residual, which is marked dirty, so
    autograd rebases residual's history onto this op (and its version counter catches any earlier
    op that saved the old residual for its backward)."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> Any:
        residual = inputs[1]
        y, rstd = _fwd_in_place(*inputs)
        ctx.mark_dirty(residual)
        _save(ctx, inputs, residual, rstd)
        return y, residual, rstd

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return _backward(_bwd, ctx, *grads)


# --- 4. Functional API ----------------------------------------------------------------------------


def _check_in_place(x: torch.Tensor, residual: torch.Tensor, records_grad: bool) -> None:
    if writable_rows(residual) is None:
        raise ValueError(
            "in_place=True needs a residual that can be written in place as rows of unit column stride "
            f"without overlap, got shape {tuple(residual.shape)} and strides {residual.stride()}"
        )
    # (Storage identity cannot be traced; under torch.compile functionalization orders the writes.)
    compiling = torch.compiler.is_compiling()
    if not compiling and residual.numel() and residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("in_place=True needs a residual that shares no memory with x")
    if not records_grad:
        return
    if residual.is_leaf and residual.requires_grad:
        raise ValueError("in_place=True cannot write over residual: it is a leaf tensor that requires grad")
    if compiling:
        raise ValueError(
            "in_place=True is not supported under torch.compile when gradients are recorded; use in_place=False"
        )


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    casting_mode: str = "llama",
    offset: float | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual; y = rms_norm(s, weight, eps)`` in one pass; returns ``(y, s)``.

    Args:
        x: input of shape ``(..., H)``, fp32/fp16/bf16, any strides (the sublayer's output).
        residual: the residual stream, x's shape and dtype, any strides.
        weight, eps, casting_mode, offset: as in :func:`fk.norms.rms_norm`.
        in_place: write ``s`` over ``residual`` and return ``residual`` itself as the second output
            (one activation-sized buffer less). Needs a residual whose rows can be written in
            place and that shares no memory with ``x``. With autograd recording, the residual is
            marked dirty: it must not be a leaf that requires grad, and any earlier op that saved
            the old residual for its backward makes ``backward()`` fail with PyTorch's in-place
            error (never a silent wrong gradient); under ``torch.compile`` only the no-gradient
            case (inference) is supported.

    Returns ``(y, s)``, both of x's shape and dtype. The gradients of ``x`` and ``residual`` are
    equal (``ds + d rms_norm/ds``); the weight gradient is computed only when ``weight`` requires
    grad.
    """
    eps = check_rms_norm_args(x, weight, eps, casting_mode, offset)
    validate.check_tensor("residual", residual)
    validate.check_same_dtype("residual", residual, "x", x)
    validate.check_shape("residual", residual, x.shape)
    validate.check_same_device("residual", residual, "x", x)
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
    records_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight))
    if in_place:
        _check_in_place(x, residual, records_grad)
    if not uses_kernel(x):
        y, s = fused_add_rms_norm_ref(x, residual, weight, eps, casting_mode, offset)
        if in_place:
            residual.copy_(s)
            return y, residual
        return y, s
    args = (x, residual, weight, eps, _default_offset(casting_mode, offset), casting_mode == "gemma")
    if not in_place:
        y, s, _ = _fused_add_rms_norm(*args)
        return y, s
    if records_grad:
        y, s, _ = _InPlaceWithGrad.apply(*args)
        return y, s
    if torch.compiler.is_compiling():
        y, _ = _fused_add_rms_norm_in_place_op(*args)
    else:
        y, _ = _fwd_in_place(*args)
    return y, residual


# --- 5. Module ------------------------------------------------------------------------------------


class FusedAddRMSNorm(torch.nn.RMSNorm):
    """RMSNorm of ``x + residual``: ``forward(x, residual) -> (y, x + residual)``.

    Same constructor and state_dict as ``torch.nn.RMSNorm`` (it subclasses it), so it loads a
    decoder layer's norm weights as they are; extra keyword arguments ``casting_mode``, ``offset``
    and ``in_place`` are as in :func:`fused_add_rms_norm`. As in PyTorch, ``eps=None`` means
    ``torch.finfo(x.dtype).eps``; a multi-dimensional ``normalized_shape`` normalizes over all of
    its trailing dimensions.
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        casting_mode: str = "llama",
        offset: float | None = None,
        in_place: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.casting_mode = validate.check_choice("casting_mode", casting_mode, CASTING_MODES)
        self.offset = offset
        self.in_place = in_place

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        shape = tuple(self.normalized_shape)
        eps = module_eps(self, x)
        kwargs: dict[str, Any] = {"casting_mode": self.casting_mode, "offset": self.offset, "in_place": self.in_place}
        if len(shape) == 1:
            return fused_add_rms_norm(x, residual, self.weight, eps, **kwargs)
        lead = x.shape[: x.ndim - len(shape)]
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"residual must have shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        # A view for in_place (writes must land in residual); view() raises where there is none.
        r_flat = residual.view(*lead, -1) if self.in_place else residual.reshape(*lead, -1)
        w_flat = self.weight.reshape(-1) if self.weight is not None else None
        y, s = fused_add_rms_norm(x.reshape(*lead, -1), r_flat, w_flat, eps, **kwargs)
        return y.reshape(x.shape), (residual if self.in_place else s.reshape(x.shape))

    def extra_repr(self) -> str:
        extra = ", in_place=True" if self.in_place else ""
        return f"{super().extra_repr()}, casting_mode={self.casting_mode!r}{extra}"
