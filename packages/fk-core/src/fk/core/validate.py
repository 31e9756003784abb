"""Input checks that run before any kernel launch.

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape,
device, value or layout) with a message that names the argument and says what was expected, so
that bad input never reaches Triton, where it would crash, assert on the device or silently give
a wrong answer.
"""

from __future__ import annotations

import os
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


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` must be an int (not a bool), at least ``minimum`` when given; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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


CHECK_LABELS = "FK_CHECK_LABELS"
"""The environment variable that says where :func:`check_labels` looks at the labels' values."""


def labels_checked_on(device: torch.device) -> bool:
    """Whether :func:`check_labels` looks at labels on ``device``, as ``FK_CHECK_LABELS`` says:

    - unset or empty: on the CPU only, where reading the labels costs no host synchronization;
    - ``1``: on every device; on a GPU the check waits for it (one host synchronization per call);
    - ``0``: nowhere (labels outside the range then give whatever the kernels give).

    An environment variable rather than a keyword argument: it is a debugging switch, and it must
    reach calls made by code one does not edit (``fk.hf``'s patched loss, a trainer's loss
    function), as ``CUDA_LAUNCH_BLOCKING`` does. It is read at each call, so a test or a debugging
    session can set it at any time. Nothing is checked while ``torch.compile`` traces (a check that
    depends on the labels' values would break the graph, so compiled code never checks), nor on the
    meta device (no values)."""
    if torch.compiler.is_compiling() or device.type == "meta":
        return False
    value = os.environ.get(CHECK_LABELS, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{CHECK_LABELS} must be 1 (check labels on every device), 0 (nowhere) or unset (on the CPU only), "
            f"got {value!r}"
        )
    return value == "1" or (value == "" and device.type == "cpu")


def check_labels(name: str, labels: torch.Tensor, n_classes: int, ignore_index: int, *, scored_from: int = 0) -> None:
    """Every label must lie in ``[0, n_classes)`` or be ``ignore_index``: a ``ValueError`` names the
    first one (in row-major order) that is not, by its position in ``labels`` as given, e.g.
    ``labels[1, 7] = 300000 is outside [0, 300) and is not ignore_index (-100)``.

    ``scored_from``: the labels before this position along the last dimension are never scored (a
    causal shift drops each sequence's first label) and are not checked. The check runs only where
    :func:`labels_checked_on` says (by default on the CPU only)."""
    if labels.numel() == 0 or not labels_checked_on(labels.device):
        return
    wide = labels.long()  # (a Python int compared with an int32 tensor wraps around)
    bad = (wide != ignore_index) & ((wide < 0) | (wide >= n_classes))
    if scored_from:
        bad[..., :scored_from] = False
    if not bad.any():
        return
    position = tuple(bad.nonzero()[0].tolist())
    where = f"{name}[{', '.join(str(i) for i in position)}]" if position else name
    raise ValueError(
        f"{where} = {wide[position].item()} is outside [0, {n_classes}) and is not ignore_index ({ignore_index})"
    )
