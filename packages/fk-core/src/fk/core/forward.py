"""Give one module another ``forward`` by swapping its class, and take it back (fk.hf, fk.lora).

:func:`swap_forward` sets ``module.__class__`` to a subclass of its class whose only difference is
``forward`` (created once per class and forward, and cached). The forward therefore runs with
whichever module is called as ``self``: a copy that shares the original's ``__dict__`` (as
``torch.nn.DataParallel``'s replicas, made by ``_replicate_for_data_parallel``, do) computes with
its own parameters, which an instance attribute ``forward`` (a method bound to the original) would
not. The subclass keeps the class's ``__name__``, ``__qualname__`` and ``__module__``
(``transformers`` writes ``type(model).__name__`` into saved configs), and nothing else.

The class's forward before the swap is kept in the instance's ``__dict__`` as a plain function
(see :func:`stock_forward`): call it with the running module, ``stock(self, *args)``, never as a
method bound to one module.

:func:`restore_class` undoes the swap only where the module's class is still exactly the one
:func:`swap_forward` set and no instance ``forward`` shadows it. Otherwise another library has
wrapped the module since (FSDP2's ``fully_shard`` makes ``FSDP<Name>`` subclasses of the current
class; accelerate sets an instance ``forward`` that calls the class's): removing fk's class would
remove theirs too, so the caller switches its forward off instead (it then calls the stock one).

:func:`has_hooks` tells whether calling a module runs hooks: a fused forward that computes a
child's work without calling the child must not skip them.

:class:`SharedInputGroup` fuses sibling modules that their parent calls one after another with the
same input (an attention block's q, k and v projections): the first member's call computes every
member's output, and each other member, called next with that very tensor, takes its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_CLASSES: dict[tuple[type, Callable[..., Any]], type] = {}
_LOCK = threading.Lock()


def forward_class(cls: type, forward: Callable[..., Any]) -> type:
    """The subclass of ``cls`` whose ``forward`` is ``forward``, named as ``cls`` (one per pair)."""
    key = (cls, forward)
    with _LOCK:
        sub = _CLASSES.get(key)
        if sub is None:
            namespace = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
            sub = _CLASSES[key] = type(cls)(cls.__name__, (cls,), namespace)
    return sub


def is_forward_class(cls: type) -> bool:
    """Whether ``cls`` is one of the subclasses :func:`forward_class` made. Its ``forward`` may be
    wrapped since (``functools.wraps``): ``transformers``' ``GradientCheckpointingLayer`` wraps
    the ``forward`` of every subclass it gets, the ones made here included."""
    if len(cls.__bases__) != 1:
        return False
    forward = cls.__dict__.get("forward")
    while forward is not None:
        if _CLASSES.get((cls.__bases__[0], forward)) is cls:
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def swapped(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class is, or derives from, a class :func:`swap_forward` set (it carries
    an fk forward, possibly under another library's subclass, or switched off)."""
    return any(is_forward_class(cls) for cls in type(module).__mro__)


def swap_forward(module: torch.nn.Module, forward: Callable[..., Any], stock_key: str) -> None:
    """Make ``forward`` the forward of ``module`` (only this instance), keeping the class's forward
    function before the swap as ``module.__dict__[stock_key]``."""
    module.__dict__[stock_key] = type(module).forward
    module.__class__ = forward_class(type(module), forward)


def stock_forward(module: Any, stock_key: str, *args: Any, **kwargs: Any) -> Any:
    """The forward ``module``'s class had before :func:`swap_forward`, run on ``module``. A module
    without ``stock_key`` (one built by calling a swapped class, ``type(module)(...)``, which
    :func:`swap_forward` never saw) runs the forward of the class under the first swapped one."""
    stock = module.__dict__.get(stock_key)
    if stock is None:
        cls = next(c for c in type(module).__mro__ if is_forward_class(c))
        stock = cls.__bases__[0].forward  # type: ignore[attr-defined]
    return stock(module, *args, **kwargs)


def restore_class(module: torch.nn.Module) -> bool:
    """Give ``module`` back the class it had before :func:`swap_forward` and return True, when its
    class is still exactly the one set there and no instance ``forward`` shadows it; else change
    nothing and return False (the caller switches its forward off)."""
    cls = type(module)
    if "forward" in module.__dict__ or not is_forward_class(cls):
        return False
    module.__class__ = cls.__bases__[0]
    return True


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs hooks: its own forward, forward-pre, backward or
    backward-pre hooks, or global module hooks (``torch.nn.modules.module.register_module_*``)."""
    from torch.nn.modules import module as nn_module

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


@dataclass
class SharedInputGroup:
    """Modules their parent calls one after another with the same input, computed by one call.

    The first member's patched forward computes all the members' outputs at once
    (:meth:`hand_out`: it keeps the others' outputs and returns its own); each other member's
    patched forward then asks :meth:`take` for its output. Only the very tensor the first member
    was called with gets it: a member called with another input computes its own output, and the
    group is marked :attr:`split` (its first member then stops fusing), since the parent does not
    call its members with one input. Outputs are held from the first member's call until each
    other member's call takes its own, or the first member's next call drops them.
    """

    members: list[torch.nn.Module]
    """In the order the parent calls them; the first one computes for all."""
    pending: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    """``id(member)`` -> (the input, its output) for the members yet to be called."""
    split: bool = False
    """A member was called with another input than the first: the group no longer fuses."""

    def hand_out(self, x: torch.Tensor, outputs: Sequence[Any]) -> Any:
        """Keep ``outputs[i]`` (of input ``x``) for member ``i`` > 0, and return ``outputs[0]``."""
        self.pending = {id(m): (x, out) for m, out in zip(self.members[1:], outputs[1:], strict=True)}
        return outputs[0]

    def take(self, module: torch.nn.Module, x: torch.Tensor, *, input_alone: bool = True) -> tuple[bool, Any]:
        """``(True, output)`` when the first member computed ``module``'s output of ``x``; else
        ``(False, None)``, marking the group split when it holds an output of another input, or
        when ``module`` was called with more than its input (``input_alone`` false)."""
        entry = self.pending.pop(id(module), None)
        if entry is None:
            return False, None
        if entry[0] is x and input_alone:
            return True, entry[1]
        self.split = True
        self.pending.clear()
        return False, None
