"""Input checks that run before any kernel launch.

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape,
device, value or layout) with a message that names the argument and says what was expected, so
that bad input never reaches Triton, where it would crash, assert on the device or silently give
a wrong answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes every fk kernel accepts for activations and weights."""


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` must be a ``torch.Tensor``; returns it for chaining."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    """``tensor.dtype`` must be one of ``allowed``."""
    if tensor.dtype not in allowed:
        raise TypeError(
            f"{name} must have dtype in ({_dtype_names(allowed)}), got {str(tensor.dtype).removeprefix('torch.')}"
        )


def check_same_dtype(name: str, tensor: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """``tensor`` must have the dtype of ``other``."""
    if tensor.dtype != other.dtype:
        raise TypeError(
            f"{name} must have the dtype of {other_name} ({str(other.dtype).removeprefix('torch.')}), "
            f"got {str(tensor.dtype).removeprefix('torch.')}"
        )


def check_same_device(name: str, tensor: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """``tensor`` must live on the device of ``other``."""
    if tensor.device != other.device:
        raise ValueError(f"{name} must be on the device of {other_name} ({other.device}), got {tensor.device}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int | Sequence[int]) -> None:
    """``tensor.ndim`` must be ``ndim`` (or one of several)."""
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if tensor.ndim not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise ValueError(f"{name} must have {want} dimension(s), got shape {tuple(tensor.shape)}")


def check_min_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """``tensor`` must have at least ``ndim`` dimensions."""
    if tensor.ndim < ndim:
        raise ValueError(f"{name} must have at least {ndim} dimension(s), got shape {tuple(tensor.shape)}")


def check_shape(name: str, tensor: torch.Tensor, shape: Sequence[int]) -> None:
    """``tensor.shape`` must equal ``shape``."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def check_positive_float(name: str, value: object) -> float:
    """``value`` must be a real number greater than zero; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not value > 0:  # also rejects NaN
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` must be one of the strings in ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return str(value)


def check_max_width(name: str, width: int, max_width: int) -> None:
    """A row of ``width`` elements must fit the kernel's limit."""
    if width > max_width:
        raise ValueError(f"{name} has rows of {width} elements; this kernel handles at most {max_width}")


def check_overwritable(name: str, tensor: torch.Tensor, option: str) -> None:
    """``tensor`` may be written over by ``option`` (an in-place forward, or a gradient written
    into an input's buffer) only if it is not a leaf that requires grad, nor a view of one: that
    would overwrite a parameter, or a user's input, and make its ``.grad`` share its memory."""
    if not tensor.requires_grad:  # (autograd has no stake in it)
        return
    if tensor.is_leaf:
        raise ValueError(f"{option}=True cannot overwrite {name}: it is a leaf tensor that requires grad")
    base = tensor._base
    if base is not None and base.requires_grad and base.is_leaf:
        raise ValueError(f"{option}=True cannot overwrite {name}: it is a view of a leaf tensor that requires grad")
