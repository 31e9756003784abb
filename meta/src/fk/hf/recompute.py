"""Norm outputs recomputed in the backward instead of kept (the ``recompute_norms`` switch).

In a pre-norm decoder layer each RMSNorm's output ``h = rms_norm(x)`` is the input of the next
projections (q, k, v; gate and up), whose backward needs it for the weight gradients
``dW = dy^T h``. Autograd keeps ``h`` from the forward to the backward: one ``[tokens, hidden]``
tensor per norm, two per layer. Yet the norm keeps its own input ``x`` for its backward anyway,
so ``h`` can be formed again from ``x`` when the projections' backward needs it: one norm
forward pass (read ``x``, write ``h``), and ``h`` is freed right after that backward.

:func:`recomputed` does that through ``torch.autograd.graph.saved_tensors_hooks``: while the
projections' forward runs under it, every tensor saved for the backward that shares ``h``'s
memory (``h`` itself, or a view of it such as the 2-D rows ``F.linear`` saves) is kept as a
note of its view instead; in the backward the note is turned back into a tensor by running the
norm again (once, however many ops saved a view of ``h``). The recomputed ``h`` equals the
forward's bit for bit: the same kernel runs on the same input (the tests check it).

Not used under ``torch.compile`` (the compiler plans its own recomputation), where other
saved-tensor hooks are active (non-reentrant activation checkpointing, activation offloading:
theirs would be shadowed for every tensor the projections save), or without grad mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class _Recipe:
    """How to form ``h`` again, and the ``h`` formed in the backward (kept while some saved view
    of it is still held by the graph: all of them are freed with the graph's nodes)."""

    __slots__ = ("formed", "make")

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self.make = make
        self.formed: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        if self.formed is None:
            with torch.no_grad():
                self.formed = self.make()
        return self.formed


class _View:
    """What a pack hook keeps of a saved view of ``h``: the view's geometry and the recipe."""

    __slots__ = ("offset", "recipe", "shape", "stride")

    def __init__(self, recipe: _Recipe, t: torch.Tensor) -> None:
        self.recipe = recipe
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        return self.recipe.tensor().as_strided(self.shape, self.stride, self.offset)


def applies(h: Any) -> bool:
    """Whether :func:`recomputed` would recompute ``h``: a contiguous tensor at the start of its
    memory (so any view of it is a view of the recomputed tensor too), grad mode on, not under
    ``torch.compile``, and no other saved-tensor hooks active."""
    if not isinstance(h, torch.Tensor) or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if not h.is_contiguous() or h.storage_offset() != 0:
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@contextlib.contextmanager
def recomputed(h: torch.Tensor, make: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Within this context, tensors saved for the backward that are ``h`` or views of it are not
    kept: the backward calls ``make()`` (under ``torch.no_grad``) to form ``h`` again, which must
    return a tensor equal to ``h``, of its shape, dtype, device and (contiguous) layout. A no-op
    where :func:`applies` is false."""
    if not applies(h):
        yield
        return
    recipe = _Recipe(make)
    ptr, dtype, device = h.untyped_storage().data_ptr(), h.dtype, h.device

    def pack(t: torch.Tensor) -> Any:
        same_memory = t.dtype == dtype and t.device == device and t.layout == torch.strided
        return _View(recipe, t) if same_memory and t.untyped_storage().data_ptr() == ptr else t

    def unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, _View) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
