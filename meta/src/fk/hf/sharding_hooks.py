"""fk.hf under FSDP2: a head whose weight FSDP2 shards on its own, and what counts as a plain linear.

fk's fused loss reads the LM head's weight itself, without calling the head. Where FSDP2's
``fully_shard(lm_head)`` put hooks on the head (unshard before its forward, reshard and
reduce-scatter after), the loss runs as the head's forward for one call (:func:`run_as_forward`),
so those hooks run around it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


def run_as_forward(module: torch.nn.Module, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(module, *args)``, called as ``module``'s forward for this one call, so that the module's
    own hooks run around it as around its forward. For a head FSDP2 shards on its own, they
    all-gather the full weight before ``fn`` reads it, free it after, and reduce-scatter the
    gradient that reaches it in the backward (and, with a mixed-precision policy, cast the
    floating inputs to its ``param_dtype``)."""
    module.__dict__["forward"] = types.MethodType(fn, module)
    try:
        out: torch.Tensor = module(*args)
    finally:
        del module.__dict__["forward"]
    return out


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def _fsdp_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of those FSDP2's ``fully_shard`` registers on a module (unshard
    before its forward; reshard and backward hooks after)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return False
    for _ in range(8):  # a bound method of FSDPState, possibly under functools.wraps wrappers (grouped modules)
        if isinstance(getattr(hook, "__self__", None), FSDPState):
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


def _linear_class(cls: type) -> bool:
    """``torch.nn.Linear`` itself, or the class FSDP2's ``fully_shard`` makes of it (``FSDPLinear``)."""
    if cls is torch.nn.Linear:
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return cls.__bases__ == (FSDPModule, torch.nn.Linear)


def plain_linear(module: Any) -> bool:
    """Whether ``module`` computes exactly ``F.linear(x, module.weight, module.bias)``: a
    ``torch.nn.Linear`` itself (not a subclass, such as a quantized layer, nor a wrapper, such as
    a LoRA layer), with no replaced forward and no hooks, or only FSDP2's (``fully_shard(lm_head)``:
    the loss then runs inside them, see :func:`fused_causal_lm_loss`). Only such a head is fused."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return _linear_class(type(module)) and all(_fsdp_hook(h) for h in hooks) and "forward" not in module.__dict__
