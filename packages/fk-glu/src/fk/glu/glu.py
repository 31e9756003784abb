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
forms) and the module :class:`GatedMLP`.
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
from fk.core.ops import define_autograd_op

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
def _activation(a, ACTIVATION: tl.constexpr):
    """(act(a), act'(a)) for fp32 ``a``; ACTIVATION 0 = silu, 1 = gelu_tanh, 2 = gelu (erf)."""
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
    act, _ = _activation(a.to(tl.float32), ACTIVATION)
    y = act * b.to(tl.float32)
    tl.store(y_ptr + (row0 * y_row_stride + col0) + (r * y_row_stride + c), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    dy_ptr,  # [M, N] upstream gradient, row stride dy_row_stride, unit column stride
    a_ptr,  # [M, N] gate (forward input)
    b_ptr,  # [M, N] up (forward input)
    da_ptr,  # [M, N] gradient of gate (may be a_ptr itself: every element is read before it is written)
    db_ptr,  # [M, N] gradient of up (may be b_ptr itself)
    n_rows,
    n_cols,
    dy_row_stride,
    a_row_stride,
    b_row_stride,
    da_row_stride,
    db_row_stride,
    ACTIVATION: tl.constexpr,
    COMPUTE_DA: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    row0, col0, r, c, mask = _tile(n_rows, n_cols, ROWS, BLOCK_COLS, OFFSETS_64)
    dy = tl.load(dy_ptr + (row0 * dy_row_stride + col0) + (r * dy_row_stride + c), mask=mask, other=0.0)
    a = tl.load(a_ptr + (row0 * a_row_stride + col0) + (r * a_row_stride + c), mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    act, grad = _activation(a.to(tl.float32), ACTIVATION)
    if COMPUTE_DA:
        b = tl.load(b_ptr + (row0 * b_row_stride + col0) + (r * b_row_stride + c), mask=mask, other=0.0)
        da = dy * b.to(tl.float32) * grad
        tl.store(da_ptr + (row0 * da_row_stride + col0) + (r * da_row_stride + c), da.to(da_ptr.dtype.element_ty), mask=mask)  # fmt: skip
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
) -> None:
    da_ = da if da is not None else a  # never written: COMPUTE_DA is False
    db_ = db if db is not None else b
    grid, sizes, tile = _launch_args((dy, a, b, da_, db_), BWD_TILE)
    _glu_bwd_kernel[grid](
        dy, a, b, da_, db_, *sizes,
        ACTIVATION=activation, COMPUTE_DA=da is not None, COMPUTE_DB=db is not None,
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


def _mark_written(grad: torch.Tensor | None, source: torch.Tensor) -> None:
    """Bump ``source``'s version when ``grad`` was written into its buffer.

    A later use of ``source`` saved for another backward (or a second backward through this op)
    then fails with PyTorch's "modified by an inplace operation" error instead of reading
    gradients as activations.
    """
    if grad is not None and grad.numel() and grad.data_ptr() == source.data_ptr():
        torch.autograd.graph.increment_version(source)


def _glu_backward(run_backward: Any, ctx: Any, dy: torch.Tensor | None) -> tuple[Any, ...]:
    a, b = ctx.saved_tensors
    need_da, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if dy is None or not (need_da or need_db):
        return None, None, None, None
    inplace = bool(ctx.inplace) and run_backward is _glu_bwd  # the eager path
    da, db = run_backward(dy, a, b, ctx.activation, inplace, need_da, need_db)
    if inplace:
        _mark_written(da if need_da else None, a)
        _mark_written(db if need_db else None, b)
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
        _mark_written(grad, gate_up)
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
            ``torch.compile``) the gradients are allocated as usual.

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


# --- 5. Module ------------------------------------------------------------------------------------


class GatedMLP(torch.nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: a drop-in for Hugging Face's LlamaMLP / GemmaMLP.

    The state_dict keys are those of the Hugging Face modules (``gate_proj.weight``,
    ``up_proj.weight``, ``down_proj.weight``, plus ``.bias`` with ``bias=True``), so weights load
    either way. ``hidden_act`` takes the Hugging Face names (``"silu"``, ``"gelu_pytorch_tanh"``,
    ``"gelu"``, ...). The activation gradients are written into the projections' output buffers
    (``inplace_grad=True``, see :func:`gated_act`): they are intermediate tensors nothing else reads.
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
        h = gated_act(self.gate_proj(x), self.up_proj(x), self.activation, inplace_grad=self.inplace_grad)
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"hidden_act={self.hidden_act!r}, inplace_grad={self.inplace_grad}"
