"""fk.hf under the wrappers that shard parameters and gather them with module hooks: FSDP2's
``fully_shard`` and DeepSpeed ZeRO-3. What counts as a plain linear head, and how the fused loss
runs inside the head's hooks.

fk's fused loss reads the LM head's weight itself, without calling the head. Both wrappers keep a
sharded weight outside its module's call and gather it in hooks on the module:

- FSDP2's ``fully_shard(lm_head)`` unshards the weight before the head's forward and reshards it
  after; the gradient that reaches the (unsharded) parameter in the backward is reduce-scattered.
  Outside those hooks ``lm_head.weight`` is a sharded ``DTensor``.
- DeepSpeed ZeRO-3 (``deepspeed.initialize`` with ``zero_optimization.stage`` 3) puts hooks on
  every module (``DeepSpeedZeRoOffload._register_deepspeed_module``): a forward pre-hook all-gathers
  the module's own parameters (``recurse=False``), a forward hook releases them, and two autograd
  functions it wraps around the module's outputs and inputs all-gather them again before the
  module's backward and release them after it. Outside those hooks the parameter's ``data`` is an
  empty tensor of shape ``(0,)`` (the rank's partition lives in ``ds_tensor``, on the GPU or, with
  ``offload_param``, on the CPU). A parameter's gradient is reduce-scattered into the partitions
  by hooks on its gradient accumulation, whatever computed it.

So the loss runs as the head's forward for one call (:func:`run_as_forward`): both wrappers' hooks
then run around it as around a stock ``lm_head(h)``. The weight is whole while the loss reads it;
under ZeRO-3 it is whole again in the backward, where fk's loss finds the weight it saved for
backward (a saved leaf tensor is the parameter itself, whose ``data`` ZeRO swaps back in), exactly
as stock's ``F.linear`` does. The gradient returned for the weight goes to the parameter's
``.grad`` and from there into ZeRO's or FSDP2's reduction.

(ZeRO-3 would also gather a weight read outside its module's call, inside the engine's forward: it
then registers the parameter as an "external" one of the module running at the time, the causal
LM here. The weight would then stay gathered to the end of that module's forward, and be gathered
again when the backward starts and held through every layer's backward: a ``[vocab, hidden]``
weight more on the GPU than stock holds. Through the head's own call, it is held as stock holds it;
``meta/tests/test_deepspeed.py`` checks that.)

Nothing here imports DeepSpeed: its hooks are told apart by the module that defines them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


def run_as_forward(module: torch.nn.Module, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(module, *args)``, called as ``module``'s forward for this one call, so that the module's
    own hooks run around it as around its forward: FSDP2's or DeepSpeed ZeRO-3's gather the full
    weight before ``fn`` reads it, free it after, gather it again for the backward where the wrapper
    does (ZeRO-3), and reduce the gradient that reaches it (and FSDP2's mixed-precision policy casts
    the floating inputs to its ``param_dtype``)."""
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


def is_zero3_parameter(t: Any) -> bool:
    """Whether ``t`` is a DeepSpeed ZeRO-3 parameter, gathered now or not (it carries the ``ds_id``
    ZeRO-3 gives its parameters)."""
    return hasattr(t, "ds_id")


def is_zero3_partitioned(t: Any) -> bool:
    """Whether ``t`` is a DeepSpeed ZeRO-3 parameter whose data is not gathered now (outside its
    module's hooks, or built under ``deepspeed.zero.Init``): its ``data`` is then an empty
    placeholder. Read from the attributes ZeRO-3 sets on its parameters (``ds_id``, ``ds_status``),
    without importing DeepSpeed."""
    status = getattr(t, "ds_status", None)
    return is_zero3_parameter(t) and status is not None and status.name != "AVAILABLE"


def _unwrapped(hook: Any) -> list[Any]:
    """``hook`` and what it wraps (``functools.wraps`` chains: ``torch.compiler.disable``,
    DeepSpeed's NVTX instrumentation, FSDP2's grouped modules), at most 8 deep."""
    chain = [hook]
    for _ in range(7):
        hook = getattr(hook, "__wrapped__", None)
        if hook is None:
            break
        chain.append(hook)
    return chain


def _fsdp_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of those FSDP2's ``fully_shard`` registers on a module (unshard
    before its forward; reshard and backward hooks after): a bound method of its ``FSDPState``."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return False
    return any(isinstance(getattr(h, "__self__", None), FSDPState) for h in _unwrapped(hook))


def _zero3_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of those DeepSpeed ZeRO-3 registers on every module (gather before
    the forward, release after; wrap outputs and inputs for the backward's gather and release):
    a function defined in a ``deepspeed`` module (the hooks are closures of
    ``deepspeed.runtime.zero.parameter_offload``, some under DeepSpeed's NVTX wrapper, defined in
    ``deepspeed.utils.nvtx``, which hides what it wraps). DeepSpeed puts no other hooks on a
    model's modules."""
    return any((getattr(h, "__module__", None) or "").startswith("deepspeed.") for h in _unwrapped(hook))


def gathering_hook(hook: Any) -> bool:
    """Whether ``hook`` is one a sharding wrapper (FSDP2, DeepSpeed ZeRO-3) registered to gather a
    module's parameters around its call (see the module's docstring)."""
    return _fsdp_hook(hook) or _zero3_hook(hook)


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
    a LoRA layer), with no replaced forward and no hooks, or only a sharding wrapper's
    (:func:`gathering_hook`: FSDP2's ``fully_shard(lm_head)``, DeepSpeed ZeRO-3's; the loss then
    runs inside them, see :func:`fk.hf.loss_head.fused_causal_lm_loss`). Only such a head is fused."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return _linear_class(type(module)) and all(gathering_hook(h) for h in hooks) and "forward" not in module.__dict__
