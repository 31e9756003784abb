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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
    """Whether ``cls`` is one of the subclasses :func:`forward_class` made."""
    forward = cls.__dict__.get("forward")
    return len(cls.__bases__) == 1 and forward is not None and _CLASSES.get((cls.__bases__[0], forward)) is cls


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
