"""Gated activations: ``y = act(gate) * up``, with ``act`` SiLU (SwiGLU) or GELU (GeGLU).

Three activations share one pair of kernels through a ``tl.constexpr`` switch:

- ``"silu"``: ``silu(a) = a * sigmoid(a)`` (Llama, Mistral, Qwen, ...: SwiGLU);
- ``"gelu_tanh"``: the tanh approximation ``0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``
  (Gemma's ``gelu_pytorch_tanh``, ``torch.nn.functional.gelu(approximate="tanh")``);
- ``"gelu"``: the exact ``0.5 a (1 + erf(a / sqrt(2)))``.

``gate`` and ``up`` come as two tensors, or as one fused ``gate_up`` tensor whose last dimension
holds ``gate`` then ``up`` (the output of one ``[2 * intermediate, hidden]`` projection), read in
place, without a copy. The kernels compute in fp32 and round once, to the dtype of the inputs.
The backward recomputes the activation from ``gate`` (nothing is saved beyond ``gate`` and
``up``), and can write the gradients into the buffers of ``gate`` and ``up`` (``inplace_grad``).

This file holds, in order: the references, the Triton kernels, the launchers registered as custom
ops, the functional API (:func:`swiglu`, :func:`geglu`, :func:`gated_act` and their ``_fused``
forms), the building blocks without autograd (:func:`gated_act_forward`,
:func:`gated_act_backward`, shared with fk.lora) and the gated MLP that does not keep
``act(gate) * up`` for its backward (:func:`gated_mlp`), and the module :class:`GatedMLP`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fk.core import validate
from fk.core.backend import uses_kernel
from fk.core.launch import RowTiling, as_rows, row_tiling, writable_rows
from fk.core.ops import define_autograd_op, mark_overwritten

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
"""The activations the kernels implement (codes 0, 1, 2 inside the kernels)."""

HF_ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_tanh": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}
"""``hidden_act`` names of Hugging Face configs (``ACT2FN`` keys) -> the activation they compute."""

GELU_APPROXIMATIONS = ("tanh", "none")


def resolve_activation(name: str, arg: str = "activation") -> str:
    """The activation (one of :data:`ACTIVATIONS`) computed by ``name``, a Hugging Face name or our own."""
    if not isinstance(name, str) or name not in HF_ACTIVATIONS:
        raise ValueError(f"{arg} must be one of {', '.join(repr(k) for k in HF_ACTIVATIONS)}, got {name!r}")
    return HF_ACTIVATIONS[name]


def _geglu_activation(approximate: str) -> str:
    validate.check_choice("approximate", approximate, GELU_APPROXIMATIONS)
    return "gelu_tanh" if approximate == "tanh" else "gelu"


# --- 1. Reference ---------------------------------------------------------------------------------


def gated_act_ref(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Plain PyTorch ``act(gate) * up``, computed in fp32 (fp64 for fp64 inputs) and rounded once.

    This is the definition the kernels are tested against.
    """
    activation = resolve_activation(activation)
    compute = torch.promote_types(gate.dtype, torch.float32)
    a, b = gate.to(compute), up.to(compute)
    if activation == "silu":
        return (F.silu(a) * b).to(gate.dtype)
    return (F.gelu(a, approximate="tanh" if activation == "gelu_tanh" else "none") * b).to(gate.dtype)


def gated_act_fused_ref(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """:func:`gated_act_ref` of the two halves of ``gate_up``'s last dimension (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return gated_act_ref(gate, up, activation)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gated_act_ref(gate, up, "silu")


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return gated_act_ref(gate, up, _geglu_activation(approximate))


# --- 2. Kernels -----------------------------------------------------------------------------------
#
# Per element, with a = gate and b = up (both fp32 in registers), y = act(a) * b. Backward, with
# upstream gradient dy:
#   db = dy * act(a)
#   da = dy * b * act'(a)
# SiLU and tanh-GELU are both a * sigmoid(k(a)):
#   silu:      k(a) = a                                       k'(a) = 1
#   gelu_tanh: 0.5 (1 + tanh(z)) = sigmoid(2z), z = sqrt(2/pi) (a + 0.044715 a^3), so
#              k(a) = a (K1 + K3 a^2), K1 = 2 sqrt(2/pi), K3 = K1 * 0.044715;  k'(a) = K1 + 3 K3 a^2
#   and with s = sigmoid(k(a)): act = a s,  act' = s + a s (1 - s) k'(a).
# (One exp and one division per element, no tanh: the kernels stay memory-bound.)
# Exact GELU: act = a Phi(a), Phi(a) = 0.5 (1 + erf(a / sqrt 2));  act' = Phi(a) + a phi(a),
#   phi(a) = exp(-a^2 / 2) / sqrt(2 pi).
#
# The kernels are elementwise over a [rows, cols] matrix whose rows may be strided (the halves of
# a fused gate_up tensor) but whose columns are contiguous. Program p handles a tile of ROWS rows
# by BLOCK_COLS columns. When every operand is dense the launcher passes the whole tensor as one
# row of rows * cols elements, so no lane is masked off at row ends.

_K1 = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)
_K3 = tl.constexpr(0.07135481627159279)  # 2 * sqrt(2 / pi) * 0.044715
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def activation_and_derivative(a, ACTIVATION: tl.constexpr):
    """(act(a), act'(a)) for fp32 ``a``; ACTIVATION 0 = silu, 1 = gelu_tanh, 2 = gelu (erf)
    (:func:`activation_code`). Public: other packages' kernels that fuse a gated activation
    (fk.lora's DoRA MLP) call it."""
    if ACTIVATION == 2:
        cdf = 0.5 + 0.5 * tl.math.erf(a * _INV_SQRT2)
        act = a * cdf
        grad = cdf + a * _INV_SQRT_2PI * tl.exp(-0.5 * a * a)
    else:
        if ACTIVATION == 1:
            a2 = a * a
            k = a * (_K1 + _K3 * a2)
            dk = _K1 + 3.0 * _K3 * a2
        else:
            k = a
            dk = 1.0
        s = 1.0 / (1.0 + tl.exp(-k))
        act = a * s
        grad = s + act * (1.0 - s) * dk
    return act, grad


@triton.jit
def _tile(n_rows, n_cols, ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, OFFSETS_64: tl.constexpr):
    """This program's tile: first row and column (int64), row and column offsets, mask."""
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_COLS)
    row_start = (pid // n_col_blocks).to(tl.int64) * ROWS
    col_start = (pid % n_col_blocks).to(tl.int64) * BLOCK_COLS
    r = tl.arange(0, ROWS)
    if OFFSETS_64:
        r = r.to(tl.int64)
    c = tl.arange(0, BLOCK_COLS)
    mask = (r < n_rows - row_start)[:, None] & (c < n_cols - col_start)[None, :]
    return row_start, col_start, r[:, None], c[None, :], mask


@triton.jit
def _glu_fwd_kernel(
    a_ptr,  # [M, N] gate, row stride a_row_stride, unit column stride
    b_ptr,  # [M, N] up, row stride b_row_stride, unit column stride
    y_ptr,  # [M, N] output, row stride y_row_stride, unit column stride
    n_rows,
    n_cols,
    a_row_stride,
    b_row_stride,
    y_row_stride,
    ACTIVATION: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,
    OFFSETS_64: tl.constexpr,  # row offsets within a tile may pass 2**31: compute them in int64
):
    row0, col0, r, c, mask = _tile(n_rows, n_cols, ROWS, BLOCK_COLS, OFFSETS_64)
    a = tl.load(a_ptr + (row0 * a_row_stride + col0) + (r * a_row_stride + c), mask=mask, other=0.0)
    b = tl.load(b_ptr + (row0 * b_row_stride + col0) + (r * b_row_stride + c), mask=mask, other=0.0)
    act, _ = activation_and_derivative(a.to(tl.float32), ACTIVATION)
    y = act * b.to(tl.float32)
    tl.store(y_ptr + (row0 * y_row_stride + col0) + (r * y_row_stride + c), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    dy_ptr,  # [M, N] upstream gradient, row stride dy_row_stride, unit column stride
    a_ptr,  # [M, N] gate (forward input)
    b_ptr,  # [M, N] up (forward input)
    da_ptr,  # [M, N] gradient of gate (may be a_ptr itself: every element is read before it is written)
    db_ptr,  # [M, N] gradient of up (may be b_ptr itself)
    h_ptr,  # [M, N] the forward's output act(a) * b, recomputed (may be dy_ptr itself); when STORE_H
    n_rows,
    n_cols,
    dy_row_stride,
    a_row_stride,
    b_row_stride,
    da_row_stride,
    db_row_stride,
    h_row_stride,
    ACTIVATION: tl.constexpr,
    COMPUTE_DA: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    row0, col0, r, c, mask = _tile(n_rows, n_cols, ROWS, BLOCK_COLS, OFFSETS_64)
    dy = tl.load(dy_ptr + (row0 * dy_row_stride + col0) + (r * dy_row_stride + c), mask=mask, other=0.0)
    a = tl.load(a_ptr + (row0 * a_row_stride + col0) + (r * a_row_stride + c), mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    act, grad = activation_and_derivative(a.to(tl.float32), ACTIVATION)
    if COMPUTE_DA or STORE_H:
        b = tl.load(b_ptr + (row0 * b_row_stride + col0) + (r * b_row_stride + c), mask=mask, other=0.0)
        b = b.to(tl.float32)
        if COMPUTE_DA:
            da = dy * b * grad
            tl.store(da_ptr + (row0 * da_row_stride + col0) + (r * da_row_stride + c), da.to(da_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        if STORE_H:
            h = act * b
            tl.store(h_ptr + (row0 * h_row_stride + col0) + (r * h_row_stride + c), h.to(h_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    if COMPUTE_DB:
        db = dy * act
        tl.store(db_ptr + (row0 * db_row_stride + col0) + (r * db_row_stride + c), db.to(db_ptr.dtype.element_ty), mask=mask)  # fmt: skip


# --- 3. Launchers, registered as custom ops -------------------------------------------------------

# Launch parameters (benchmarks/tune_glu.py sweeps them on a GPU): elements per program and warps.
FWD_TILE = 2048
FWD_WARPS = 4
BWD_TILE = 2048
BWD_WARPS = 4
_INT32_MAX = 2**31 - 1
_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}
_FLOAT_DTYPES = frozenset(validate.FLOAT_DTYPES)


def activation_code(activation: str) -> int:
    """The ``ACTIVATION`` constexpr of :func:`activation_and_derivative` for an activation's name
    (any name :func:`resolve_activation` takes)."""
    return _CODES[resolve_activation(activation)]


@functools.lru_cache(maxsize=256)
def _tiling(n_cols: int, tile: int) -> RowTiling:
    # Every tile holds `tile` elements: narrow rows are grouped, wide rows split into column blocks.
    return row_tiling(n_cols, max_block_cols=tile, min_tile_elements=tile, name="gate")


def _disjoint(x: torch.Tensor, y: torch.Tensor) -> bool:
    """True when the ``[rows, cols]`` views ``x`` and ``y`` provably share no element."""
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return True
    item = x.element_size()
    rows, cols = x.shape

    def span(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + ((rows - 1) * t.stride(0) + cols) * item

    (x0, x1), (y0, y1) = span(x), span(y)
    if x1 <= y0 or y1 <= x0:
        return True
    if rows > 1 and x.stride(0) == y.stride(0):  # interleaved rows, as the halves of gate_up
        d = ((y.data_ptr() - x.data_ptr()) // item) % x.stride(0)
        return (y.data_ptr() - x.data_ptr()) % item == 0 and cols <= d <= x.stride(0) - cols
    return False


def _launch_args(tensors: tuple[torch.Tensor, ...], tile: int) -> tuple[tuple[int], list[int], dict[str, Any]]:
    """(grid, [rows, cols, *row strides], tile constexprs) for a launch over same-shape row views."""
    n_rows, n_cols = tensors[0].shape
    strides = [t.stride(0) for t in tensors]
    if n_rows == 1 or all(s == n_cols for s in strides):  # all dense: one long row, no masked row ends
        total = n_rows * n_cols
        return ((total + tile - 1) // tile,), [1, total, *(0 for _ in strides)], {
            "BLOCK_COLS": tile, "ROWS": 1, "OFFSETS_64": False}  # fmt: skip
    tiling = _tiling(n_cols, tile)
    rows = tiling.rows_per_tile
    grid = (((n_rows + rows - 1) // rows) * ((n_cols + tiling.block_cols - 1) // tiling.block_cols),)
    offsets_64 = rows * (max(strides) + n_cols) > _INT32_MAX
    return grid, [n_rows, n_cols, *strides], {"BLOCK_COLS": tiling.block_cols, "ROWS": rows, "OFFSETS_64": offsets_64}


def _launch_fwd(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, activation: int) -> None:
    grid, sizes, tile = _launch_args((a, b, y), FWD_TILE)
    _glu_fwd_kernel[grid](a, b, y, *sizes, ACTIVATION=activation, num_warps=FWD_WARPS, **tile)


def _launch_bwd(
    dy: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    da: torch.Tensor | None,
    db: torch.Tensor | None,
    activation: int,
    h: torch.Tensor | None = None,
) -> None:
    da_ = da if da is not None else a  # never written: COMPUTE_DA is False
    db_ = db if db is not None else b
    h_ = h if h is not None else dy  # never written: STORE_H is False
    grid, sizes, tile = _launch_args((dy, a, b, da_, db_, h_), BWD_TILE)
    _glu_bwd_kernel[grid](
        dy, a, b, da_, db_, h_, *sizes,
        ACTIVATION=activation, COMPUTE_DA=da is not None, COMPUTE_DB=db is not None, STORE_H=h is not None,
        num_warps=BWD_WARPS, **tile,
    )  # fmt: skip


# Two tensors: gate and up.


def _glu_fwd(a: torch.Tensor, b: torch.Tensor, activation: int, inplace: bool) -> torch.Tensor:
    """Forward launcher: returns ``act(a) * b`` with a's shape and dtype (``inplace`` is the backward's)."""
    y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if y.numel() == 0:
        return y
    n = a.shape[-1]
    _launch_fwd(as_rows(a), as_rows(b), y.view(-1, n), activation)
    return y


def _glu_fwd_fake(a: torch.Tensor, b: torch.Tensor, activation: int, inplace: bool) -> torch.Tensor:
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


def _grad_buffer(t: torch.Tensor, needed: bool, in_place: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient of ``t`` and its ``[rows, N]`` view for the kernel (None when not needed).

    In place, it is a new view of ``t``'s own buffer where ``t`` can be written as rows; otherwise a
    new tensor.
    """
    if not needed:
        return t.new_empty(0), None
    rows = writable_rows(t) if in_place else None
    if rows is not None:
        return t.view(t.shape), rows
    grad = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return grad, grad.view(-1, t.shape[-1])


def _glu_bwd(
    dy: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    activation: int,
    inplace: bool,
    compute_da: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward launcher: returns (da, db), an empty tensor for each one not computed.

    With ``inplace`` (eager mode only: a custom op may not return its inputs' buffers) the
    gradients are written into the buffers of ``a`` and ``b`` where their layout allows it.
    """
    if a.numel() == 0:
        return _glu_bwd_fake(dy, a, b, activation, inplace, compute_da, compute_db)
    a_rows, b_rows = as_rows(a), as_rows(b)
    in_place = inplace and _disjoint(a_rows, b_rows)
    da, da_rows = _grad_buffer(a, compute_da, in_place)
    db, db_rows = _grad_buffer(b, compute_db, in_place)
    if compute_da or compute_db:
        _launch_bwd(as_rows(dy), a_rows, b_rows, da_rows, db_rows, activation)
    return da, db


def _glu_bwd_with_value(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, activation: int, inplace: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager launcher: (da, db, h) with h = act(a) * b recomputed by the same pass (one more write,
    no more reads). With ``inplace``, where layouts allow it, da and db go over a's and b's buffers
    and h over dy's (each element is read before it is written)."""
    if a.numel() == 0:
        return a.new_empty(a.shape), b.new_empty(b.shape), a.new_empty(a.shape)
    a_rows, b_rows, dy_rows = as_rows(a), as_rows(b), as_rows(dy)
    in_place = inplace and _disjoint(a_rows, b_rows)
    da, da_rows = _grad_buffer(a, True, in_place)
    db, db_rows = _grad_buffer(b, True, in_place)
    over_dy = in_place and _disjoint(dy_rows, a_rows) and _disjoint(dy_rows, b_rows)
    h, h_rows = _grad_buffer(dy, True, over_dy)
    _launch_bwd(dy_rows, a_rows, b_rows, da_rows, db_rows, activation, h=h_rows)
    return da, db, h


def _glu_bwd_fake(
    dy: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    activation: int,
    inplace: bool,
    compute_da: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    def grad(needed: bool) -> torch.Tensor:
        return torch.empty(a.shape if needed else (0,), dtype=a.dtype, device=a.device)

    return grad(compute_da), grad(compute_db)


def _glu_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, activation, inplace = inputs
    ctx.save_for_backward(a, b)
    ctx.activation = activation
    ctx.inplace = inplace
    ctx.set_materialize_grads(False)


def _glu_backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None) -> tuple[Any, ...]:
    a, b = ctx.saved_tensors
    need_da, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if dy is None or not (need_da or need_db):
        return None, None, None, None
    inplace = bool(ctx.inplace) and run_backward is _glu_bwd  # the eager path
    da, db = run_backward(dy, a, b, ctx.activation, inplace, need_da, need_db)
    if inplace:
        mark_overwritten(da if need_da else None, a)
        mark_overwritten(db if need_db else None, b)
    return (da if need_da else None), (db if need_db else None), None, None


_glu = define_autograd_op(
    __name__, "glu",
    forward=_glu_fwd, forward_fake=_glu_fwd_fake,
    backward_launcher=_glu_bwd, backward_fake=_glu_bwd_fake,
    setup_context=_glu_setup_context, backward=_glu_backward,
)  # fmt: skip


# One fused tensor: gate_up[..., :N] is gate, gate_up[..., N:] is up.


def _halves(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows.shape[1] // 2
    return rows[:, :n], rows[:, n:]


def _glu_fused_fwd(gate_up: torch.Tensor, activation: int, inplace: bool) -> torch.Tensor:
    """Forward launcher: ``act(gate) * up`` of shape ``gate_up.shape[:-1] + (N,)``."""
    n = gate_up.shape[-1] // 2
    y = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    if y.numel() == 0:
        return y
    a, b = _halves(as_rows(gate_up))
    _launch_fwd(a, b, y.view(-1, n), activation)
    return y


def _glu_fused_fwd_fake(gate_up: torch.Tensor, activation: int, inplace: bool) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    return torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)


def _glu_fused_bwd(dy: torch.Tensor, gate_up: torch.Tensor, activation: int, inplace: bool) -> torch.Tensor:
    """Backward launcher: the gradient of ``gate_up`` (written into its buffer with ``inplace``, eager only)."""
    width = gate_up.shape[-1]
    n = width // 2
    out_rows = writable_rows(gate_up) if inplace else None
    if out_rows is not None:
        grad = gate_up.view(gate_up.shape)
    else:
        grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        out_rows = grad.view(-1, width) if grad.numel() else None
    if out_rows is not None and n > 0 and out_rows.shape[0] > 0:
        a, b = _halves(as_rows(gate_up))
        da, db = _halves(out_rows)
        _launch_bwd(as_rows(dy), a, b, da, db, activation)
    return grad


def _glu_fused_bwd_fake(dy: torch.Tensor, gate_up: torch.Tensor, activation: int, inplace: bool) -> torch.Tensor:
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)


def _glu_fused_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    gate_up, activation, inplace = inputs
    ctx.save_for_backward(gate_up)
    ctx.activation = activation
    ctx.inplace = inplace
    ctx.set_materialize_grads(False)


def _glu_fused_backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None) -> tuple[Any, ...]:
    (gate_up,) = ctx.saved_tensors
    if dy is None or not ctx.needs_input_grad[0]:
        return None, None, None
    inplace = bool(ctx.inplace) and run_backward is _glu_fused_bwd  # the eager path
    grad = run_backward(dy, gate_up, ctx.activation, inplace)
    if inplace:
        mark_overwritten(grad, gate_up)
    return grad, None, None


_glu_fused = define_autograd_op(
    __name__, "glu_fused",
    forward=_glu_fused_fwd, forward_fake=_glu_fused_fwd_fake,
    backward_launcher=_glu_fused_bwd, backward_fake=_glu_fused_bwd_fake,
    setup_context=_glu_fused_setup_context, backward=_glu_fused_backward,
)  # fmt: skip


# --- 4. Functional API ----------------------------------------------------------------------------


def _check_inplace(inplace_grad: object) -> bool:
    if not isinstance(inplace_grad, bool):
        raise TypeError(f"inplace_grad must be a bool, got {type(inplace_grad).__name__}")
    return inplace_grad


def gated_act(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", *, inplace_grad: bool = False
) -> torch.Tensor:
    """``act(gate) * up`` elementwise, computed in fp32 and rounded once to the inputs' dtype.

    Args:
        gate: the gate projection, shape ``(..., N)``, fp32/fp16/bf16, any strides.
        up: the up projection, same shape, dtype and device as ``gate``.
        activation: ``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` (exact erf), or a Hugging Face
            ``hidden_act`` name (``"swish"``, ``"gelu_pytorch_tanh"``, ``"gelu_new"``, ...).
        inplace_grad: write the gradients of ``gate`` and ``up`` into their own buffers instead of
            allocating new ones (saves two ``(..., N)`` tensors in the backward). Use it when
            nothing else reads ``gate`` or ``up`` after the backward (as in an MLP, where they
            are intermediate activations); their contents are overwritten, and a second backward
            through the same graph raises. Applies in eager mode, to inputs that can be viewed
            as rows with unit column stride and do not overlap; otherwise (and under
            ``torch.compile``) the gradients are allocated as usual. A leaf that requires grad (a
            parameter, say) is refused (``ValueError``): its data would become its gradient.

    The backward recomputes the activation from ``gate``: only ``gate`` and ``up`` are saved. A
    gradient is computed only for the inputs that require one.
    """
    # One cheap test for the common case (host time matters at small sizes); the named checks
    # below run, and raise, only when it fails.
    fine = (
        isinstance(gate, torch.Tensor)
        and isinstance(up, torch.Tensor)
        and gate.dtype in _FLOAT_DTYPES
        and up.dtype == gate.dtype
        and up.device == gate.device
        and gate.ndim >= 1
        and up.shape == gate.shape
    )
    if not fine:
        validate.check_tensor("gate", gate)
        validate.check_tensor("up", up)
        validate.check_dtype("gate", gate)
        validate.check_same_dtype("up", up, "gate", gate)
        validate.check_same_device("up", up, "gate", gate)
        validate.check_min_ndim("gate", gate, 1)
        validate.check_shape("up", up, gate.shape)
    activation = resolve_activation(activation)
    inplace = _check_inplace(inplace_grad)
    if inplace and torch.is_grad_enabled():
        validate.check_overwritable("gate", gate, "inplace_grad")
        validate.check_overwritable("up", up, "inplace_grad")
    if not uses_kernel(gate):
        return gated_act_ref(gate, up, activation)
    return _glu(gate, up, _CODES[activation], inplace)


def gated_act_fused(gate_up: torch.Tensor, activation: str = "silu", *, inplace_grad: bool = False) -> torch.Tensor:
    """:func:`gated_act` of a fused ``gate_up`` tensor of shape ``(..., 2 * N)``: gate first, then up.

    The two halves are read where they lie (no copy, any strides); the result has shape
    ``(..., N)``. The gradient is one ``(..., 2 * N)`` tensor, written into ``gate_up``'s own
    buffer with ``inplace_grad`` (see :func:`gated_act`).
    """
    validate.check_tensor("gate_up", gate_up)
    validate.check_dtype("gate_up", gate_up)
    validate.check_min_ndim("gate_up", gate_up, 1)
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up must have an even last dimension (gate and up halves), got shape {tuple(gate_up.shape)}"
        )
    activation = resolve_activation(activation)
    inplace = _check_inplace(inplace_grad)
    if inplace and torch.is_grad_enabled():
        validate.check_overwritable("gate_up", gate_up, "inplace_grad")
    if not uses_kernel(gate_up):
        return gated_act_fused_ref(gate_up, activation)
    return _glu_fused(gate_up, _CODES[activation], inplace)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_grad: bool = False) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` (see :func:`gated_act`)."""
    return gated_act(gate, up, "silu", inplace_grad=inplace_grad)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, inplace_grad: bool = False
) -> torch.Tensor:
    """GeGLU: ``gelu(gate, approximate) * up``; ``approximate`` is ``"tanh"`` (Gemma) or ``"none"`` (erf)."""
    return gated_act(gate, up, _geglu_activation(approximate), inplace_grad=inplace_grad)


def swiglu_fused(gate_up: torch.Tensor, *, inplace_grad: bool = False) -> torch.Tensor:
    """SwiGLU of a fused ``gate_up`` tensor (see :func:`gated_act_fused`)."""
    return gated_act_fused(gate_up, "silu", inplace_grad=inplace_grad)


def geglu_fused(gate_up: torch.Tensor, approximate: str = "tanh", *, inplace_grad: bool = False) -> torch.Tensor:
    """GeGLU of a fused ``gate_up`` tensor (see :func:`gated_act_fused`)."""
    return gated_act_fused(gate_up, _geglu_activation(approximate), inplace_grad=inplace_grad)


# --- 5. Building blocks without autograd, and the gated MLP ----------------------------------------
#
# gated_act_forward / gated_act_backward compute act(gate) * up and its gradients for code that runs
# inside its own torch.autograd.Function (the gated MLP below, fk.lora's LoRA MLP): no autograd
# node of their own. Each picks the launcher itself in eager mode, the custom op while
# torch.compile traces (a custom op may not return its inputs' buffers, so nothing is written in
# place there), and the plain PyTorch reference where no kernel runs (CPU without the interpreter).
#
# Gated MLP, for x2 = x as [M, K], Wg and Wu [I, K], Wd [N, I]:
#   forward:  g = x2 Wg^T, u = x2 Wu^T (saved), h = act(g) * u (not saved), y = h Wd^T
#   backward, with upstream gradient dy [M, N]:
#     dh  = dy Wd                       [M, I]
#     dg  = dh * u * act'(g)            written over g's buffer (eager)
#     du  = dh * act(g)                 written over u's buffer (eager)
#     h   = act(g) * u                  recomputed by the same pass, written over dh's buffer (eager)
#     dWd = dy^T h
#     dWg = dg^T x2,  dWu = du^T x2
#     dx  = dg Wg + du Wu               one buffer: mm, then addmm_
# With a residual r [M, N] (a decoder layer's ``r + mlp(x)``): y = r + h Wd^T in one addmm, the
# residual accumulated into by the matmul (torch.addmm copies r into y's buffer first, a device copy
# of two passes where an add kernel makes three; the sum is rounded once), and dr = dy.
# So the [M, I] tensors kept from forward to backward are g and u only (nn.Linear's down
# projection would keep h too); the backward adds at most one transient [M, I] tensor at a time
# (h, then dh). Each gradient is formed only when its input requires one: a frozen weight costs
# neither a matmul nor a buffer, and a frozen Wd spares the recomputation of h.


def gated_act_backward_ref(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``act(gate) * up`` for upstream gradient ``dh``, in plain PyTorch.

    The kernels' formulas (section 2), computed in fp32 (fp64 for fp64 inputs) and rounded once:
    the path :func:`gated_act_backward` takes where no kernel runs.
    """
    activation = resolve_activation(activation)
    compute = torch.promote_types(gate.dtype, torch.float32)
    a, b, dy = gate.to(compute), up.to(compute), dh.to(compute)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(a * _INV_SQRT2.value))
        value = a * cdf
        grad = cdf + a * _INV_SQRT_2PI.value * torch.exp(-0.5 * a * a)
    else:  # a * sigmoid(k(a))
        k1, k3 = _K1.value, _K3.value
        k, dk = (a, 1.0) if activation == "silu" else (a * (k1 + k3 * a * a), k1 + 3.0 * k3 * a * a)
        s = torch.sigmoid(k)
        value = a * s
        grad = s + value * (1.0 - s) * dk
    return (dy * b * grad).to(gate.dtype), (dy * value).to(up.dtype)


def _written_over(dgate: torch.Tensor, dup: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the gradients went over ``gate``'s or ``up``'s own buffer."""
    return gate.numel() > 0 and (dgate.data_ptr() == gate.data_ptr() or dup.data_ptr() == up.data_ptr())


def gated_act_forward(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` with no autograd node: for use inside another ``torch.autograd.Function``.

    Takes the launcher in eager mode, the custom op while ``torch.compile`` traces, and
    :func:`gated_act_ref` where no kernel runs. The inputs are not validated (the caller's job):
    same shape, dtype and device, unit last stride not required.
    """
    activation = resolve_activation(activation)
    if not uses_kernel(gate):
        return gated_act_ref(gate, up, activation)
    if torch.compiler.is_compiling():
        y: torch.Tensor = _glu.fwd_op(gate, up, _CODES[activation], False)  # type: ignore[attr-defined]
        return y
    return _glu_fwd(gate, up, _CODES[activation], False)


def gated_act_backward(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(d gate, d up, written) of ``act(gate) * up`` with no autograd node (see :func:`gated_act_forward`).

    With ``inplace``, in eager mode and where their layout allows it, the gradients are written
    over ``gate``'s and ``up``'s own buffers, and ``written`` is True: the caller must then bump
    both tensors' versions (``torch.autograd.graph.increment_version``) when they are saved for a
    backward, so that a second backward through them fails loudly instead of reading gradients
    as activations. Under ``torch.compile`` and on the reference path, new tensors are returned
    and ``written`` is False.
    """
    activation = resolve_activation(activation)
    if not uses_kernel(gate):
        dgate, dup = gated_act_backward_ref(dh, gate, up, activation)
        return dgate, dup, False
    code = _CODES[activation]
    if torch.compiler.is_compiling():
        dgate, dup = _glu.bwd_op(dh, gate, up, code, False, True, True)  # type: ignore[attr-defined]
        return dgate, dup, False
    dgate, dup = _glu_bwd(dh, gate, up, code, inplace, True, True)
    written = _written_over(dgate, dup, gate, up)
    return dgate, dup, written


def gated_act_backward_with_value(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(d gate, d up, h, written): :func:`gated_act_backward` that also recomputes the forward's
    ``h = act(gate) * up``, in the same pass in eager mode (one more write, no more reads).

    With ``inplace`` and ``written`` True, the gradients went over ``gate``'s and ``up``'s buffers
    (bump their versions, as :func:`gated_act_backward` says) and ``h`` over ``dh``'s, which the
    caller must not read again. Under ``torch.compile`` and on the reference path, ``h`` comes from
    :func:`gated_act_forward` and nothing is written in place.
    """
    activation = resolve_activation(activation)
    if not uses_kernel(gate) or torch.compiler.is_compiling():
        dgate, dup, written = gated_act_backward(dh, gate, up, activation)
        return dgate, dup, gated_act_forward(gate, up, activation), written
    dgate, dup, h = _glu_bwd_with_value(dh, gate, up, _CODES[activation], inplace)
    written = _written_over(dgate, dup, gate, up)
    return dgate, dup, h, written


def gated_mlp_ref(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    activation: str = "silu",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(act(F.linear(x, Wg)) * F.linear(x, Wu), Wd)`` (plus ``residual``) in plain PyTorch
    (autograd through every op), with the activation as :func:`gated_act_ref` computes it: the
    definition tests use."""
    h = gated_act_ref(F.linear(x, gate_weight), F.linear(x, up_weight), activation)
    y = F.linear(h, down_weight)
    return y if residual is None else residual + y


class _GatedMLPFunction(torch.autograd.Function):
    """``act(x Wg^T) * (x Wu^T)`` times ``Wd^T``, saving x, gate, up and the weights (see the math above)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        wg: torch.Tensor,
        wu: torch.Tensor,
        wd: torch.Tensor,
        activation: str,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        gate = torch.mm(x2, wg.t())
        up = torch.mm(x2, wu.t())
        del x2
        h = gated_act_forward(gate, up, activation)
        # With a residual, the matmul accumulates into a copy of it (one rounding of the sum).
        y = torch.mm(h, wd.t()) if residual is None else torch.addmm(residual.reshape(-1, wd.shape[0]), h, wd.t())
        del h  # recomputed in the backward
        ctx.save_for_backward(x, gate, up, wg, wu, wd)
        ctx.activation = activation
        ctx.set_materialize_grads(False)
        return y  # (2-D: the caller views it, so that the output may be changed in place)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None) -> Any:
        x, gate, up, wg, wu, wd = ctx.saved_tensors
        need_dx, need_dwg, need_dwu, need_dwd = ctx.needs_input_grad[:4]
        if dy is None:
            return None, None, None, None, None, None
        # y = r + ...: the residual's gradient is dy itself (2-D, as y: viewed as the residual)
        dr = dy.view(*x.shape[:-1], dy.shape[-1]) if ctx.needs_input_grad[5] else None
        act = ctx.activation
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dwg = dwu = dwd = None
        if not (need_dx or need_dwg or need_dwu):  # only Wd trains (or none): h alone
            dwd = torch.mm(dy2.t(), gated_act_forward(gate, up, act)) if need_dwd else None
            return None, None, None, dwd, None, dr
        dh = torch.mm(dy2, wd)
        if need_dwd:
            dgate, dup, h, written = gated_act_backward_with_value(dh, gate, up, act, inplace=True)
            del dh  # (h may be its buffer)
            dwd = torch.mm(dy2.t(), h)
            del h
        else:
            dgate, dup, written = gated_act_backward(dh, gate, up, act, inplace=True)
            del dh
        if written:  # gate and up now hold their gradients: a second backward must fail loudly
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
        x2 = x.reshape(-1, x.shape[-1])
        if need_dwg:
            dwg = torch.mm(dgate.t(), x2)
        if need_dwu:
            dwu = torch.mm(dup.t(), x2)
        if need_dx:
            dx = torch.mm(dgate, wg).addmm_(dup, wu).view(x.shape)
        return dx, dwg, dwu, dwd, None, dr


def _check_gated_mlp_inputs(
    x: object, gate_weight: object, up_weight: object, down_weight: object, residual: object, same_dtype: bool
) -> None:
    names = ("x", "gate_weight", "up_weight", "down_weight")
    tensors = (x, gate_weight, up_weight, down_weight)
    for name, t in zip(names, tensors, strict=True):
        validate.check_tensor(name, t)
        assert isinstance(t, torch.Tensor)
        validate.check_dtype(name, t)
        if name != "x":
            validate.check_same_device(name, t, "x", x)  # type: ignore[arg-type]
            if same_dtype:
                validate.check_same_dtype(name, t, "x", x)  # type: ignore[arg-type]
            validate.check_ndim(name, t, 2)
    assert isinstance(x, torch.Tensor) and isinstance(gate_weight, torch.Tensor)
    assert isinstance(up_weight, torch.Tensor) and isinstance(down_weight, torch.Tensor)
    validate.check_min_ndim("x", x, 1)
    n_inter, hidden = gate_weight.shape[0], x.shape[-1]
    validate.check_shape("gate_weight", gate_weight, (n_inter, hidden))
    validate.check_shape("up_weight", up_weight, (n_inter, hidden))
    validate.check_shape("down_weight", down_weight, (down_weight.shape[0], n_inter))
    if residual is not None:
        validate.check_tensor("residual", residual)
        assert isinstance(residual, torch.Tensor)
        validate.check_dtype("residual", residual)
        validate.check_same_device("residual", residual, "x", x)
        if same_dtype:
            validate.check_same_dtype("residual", residual, "x", x)
        validate.check_shape("residual", residual, (*x.shape[:-1], down_weight.shape[0]))


def gated_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    activation: str = "silu",
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(act(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)`` (plus
    ``residual``), keeping only ``x``, the gate and up projections and the weights from forward to
    backward.

    A gated MLP (Llama's, Gemma's) written with ``nn.Linear`` layers keeps ``h = act(gate) * up`` for
    the down projection's weight gradient: one more ``(..., intermediate)`` tensor per layer. This
    one recomputes ``h`` in the backward (one elementwise pass) and frees it before forming
    ``dh``; the activation's gradients are written over the gate and up buffers (internal tensors
    nobody else sees), so a second backward through the same graph raises.

    Args:
        x: ``(..., hidden)``, fp32/fp16/bf16, any strides.
        gate_weight, up_weight: ``[intermediate, hidden]``; down_weight: ``[out, intermediate]``.
            Same dtype and device as ``x`` (under ``torch.autocast`` enabled for ``x``'s device,
            any float dtype: every operand is cast to autocast's dtype first, as ``F.linear``
            would cast it, and the result has that dtype).
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU), or a Hugging Face
            ``hidden_act`` name (``"swish"``, ``"gelu_pytorch_tanh"``, ...).
        residual: ``(..., out)`` with ``x``'s leading dimensions, dtype and device, or None: a
            decoder layer's residual stream, added to the output inside the down projection's
            matmul (``torch.addmm``: a device copy of the residual and a matmul that accumulates
            into it, no add kernel; the sum is rounded once, where ``residual +
            mlp(x)`` rounds the projection first). Its gradient is the output's.

    No biases: a caller whose projections have one uses ``nn.Linear`` layers with :func:`gated_act`.
    A gradient is computed only for the inputs that require one (a frozen weight costs neither a
    matmul nor a buffer). Works on the reference path (CPU without Triton's interpreter), in the
    interpreter, on the GPU and under ``torch.compile(fullgraph=True)``.
    """
    device_type = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    cast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    _check_gated_mlp_inputs(x, gate_weight, up_weight, down_weight, residual, same_dtype=cast is None)
    activation = resolve_activation(activation)
    out_shape = (*x.shape[:-1], down_weight.shape[0])
    if cast is None:
        y: torch.Tensor = _GatedMLPFunction.apply(x, gate_weight, up_weight, down_weight, activation, residual)
        return y.view(out_shape)
    operands = [t if t.dtype == cast else t.to(cast) for t in (x, gate_weight, up_weight, down_weight)]
    r = residual if residual is None or residual.dtype == cast else residual.to(cast)
    with torch.autocast(device_type, enabled=False):
        y = _GatedMLPFunction.apply(*operands, activation, r)
    return y.view(out_shape)


# --- 6. Module ------------------------------------------------------------------------------------


def _bare_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes exactly ``F.linear(x, module.weight)``: a ``torch.nn.Linear``
    itself (no subclass or wrapper), without a bias, a replaced forward or hooks of its own."""
    return (
        type(module) is torch.nn.Linear
        and module.bias is None
        and "forward" not in module.__dict__
        and not (module._forward_hooks or module._forward_pre_hooks)
        and not (module._backward_hooks or module._backward_pre_hooks)
    )


class GatedMLP(torch.nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: a drop-in for Hugging Face's LlamaMLP / GemmaMLP.

    The state_dict keys are those of the Hugging Face modules (``gate_proj.weight``,
    ``up_proj.weight``, ``down_proj.weight``, plus ``.bias`` with ``bias=True``), so weights load
    either way. ``hidden_act`` takes the Hugging Face names (``"silu"``, ``"gelu_pytorch_tanh"``,
    ``"gelu"``, ...).

    Without biases (and while the projections are plain ``nn.Linear`` layers, with no hooks), the
    forward is :func:`gated_mlp`: ``act(gate) * up`` is not kept for the backward, and the
    activation gradients always overwrite its internal gate and up buffers (which nothing else
    sees). Otherwise the projections run as modules around :func:`gated_act`, and
    ``inplace_grad`` (default True) says whether the gradients are written into the projections'
    output buffers.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        bias: bool = False,
        *,
        inplace_grad: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.activation = resolve_activation(hidden_act, "hidden_act")
        self.inplace_grad = _check_inplace(inplace_grad)
        kw: dict[str, Any] = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> GatedMLP:
        """Build from a Hugging Face model config (``hidden_size``, ``intermediate_size``, ``mlp_bias``,
        and ``hidden_activation`` as Gemma names it, else ``hidden_act``)."""
        act = str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"))
        bias = bool(getattr(config, "mlp_bias", False))
        return cls(config.hidden_size, config.intermediate_size, act, bias, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if all(_bare_linear(p) for p in projections):
            return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.activation)
        h = gated_act(self.gate_proj(x), self.up_proj(x), self.activation, inplace_grad=self.inplace_grad)
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"hidden_act={self.hidden_act!r}, inplace_grad={self.inplace_grad}"
