"""Which implementation runs for a tensor: compiled Triton, Triton's interpreter, or the reference.

- CUDA tensors run the Triton kernels compiled for the GPU.
- With ``TRITON_INTERPRET=1`` in the environment *before Triton is first imported*, the same
  kernels run on CPU tensors in Triton's interpreter. This is how CI, which has no GPU, tests
  every kernel.
- CPU tensors without the interpreter take the plain PyTorch reference, so a patched model still
  runs (slowly, but correctly) on a machine with no GPU.

Triton decides at decoration time whether a ``@triton.jit`` function is interpreted, so the
choice is read once, when this module is imported (which every kernel module does before it
defines its kernels), not from the environment at each call.
"""

from __future__ import annotations

import enum
import os

import torch


def _interpreter_is_on() -> bool:
    try:
        from triton import knobs
    except ImportError:  # older Triton: the environment variable is the switch
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)


class KernelPath(enum.Enum):
    """The three ways an fk op can run."""

    TRITON = "triton"
    INTERPRETER = "interpreter"
    REFERENCE = "reference"


INTERPRETER_ON: bool = _interpreter_is_on()
"""True when Triton's interpreter was switched on before Triton was imported."""


def kernel_path(tensor: torch.Tensor) -> KernelPath:
    """The path an op takes for ``tensor``: see the module docstring."""
    if INTERPRETER_ON:
        return KernelPath.INTERPRETER
    if tensor.is_cuda:
        return KernelPath.TRITON
    return KernelPath.REFERENCE


def uses_kernel(tensor: torch.Tensor) -> bool:
    """True when a Triton kernel (compiled or interpreted) handles ``tensor``."""
    return kernel_path(tensor) is not KernelPath.REFERENCE
