"""Swap the forward of PEFT LoRA modules for fk.lora's fused functions: :func:`patch` / :func:`unpatch`.

The modules are found by structure, not by model class:

- a module with ``gate_proj``, ``up_proj`` and ``down_proj`` children that are PEFT ``lora.Linear``,
  an ``act_fn`` child that computes SiLU or GELU, and a class ``forward`` that is
  ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` and nothing more (LlamaMLP, MistralMLP,
  Qwen2MLP, GemmaMLP and over a hundred other ``transformers`` MLPs) gets its own forward replaced
  by :func:`fk.lora.lora_mlp`. The forward is compared with that expression by its bytecode:
  MLPs with the same children that clamp, scale, normalize or sparsify in between (Gemma3n's,
  Falcon-H1's, BitNet's, ...) keep their forward, and their projections are patched one by one;
- ``q_proj``, ``k_proj`` and ``v_proj`` children of one module (an attention block) that are
  ``lora.Linear`` form a shared-input group: the first one called computes all of them with
  :func:`fk.lora.lora_projections` (one ``dx`` in the backward, masks drawn in the order q, k, v as
  PEFT draws them) and hands its result to the others when they are called with the same tensor;
- every other ``lora.Linear`` (``o_proj``, ...) uses :func:`fk.lora.lora_linear`.

Only forwards are swapped: each patched module's class becomes a subclass that differs only by its
``forward`` and keeps the class's name (see :mod:`fk.core.forward`), so a copy of the module
(``torch.nn.DataParallel``'s replicas) runs the fused forward with its own parameters; a copy of a
q/k/v projection computes its own projection alone (the group fuses the modules it was built
from). Model source is never rewritten, and :func:`unpatch` gives back the original classes. A
module whose ``forward`` was replaced on the instance (by accelerate's hooks, say) is left alone:
that forward would shadow fk.lora's.

DoRA (``use_dora=True``) is fused too: a DoRA ``lora.Linear`` passes its magnitude vector to
:func:`fk.lora.lora_linear` / :func:`fk.lora.lora_projections` (a q/k/v group fuses when all its
members are DoRA or none is), and a DoRA MLP goes to :func:`fk.lora.lora_mlp` (with DoRA on gate
and up, or on neither; otherwise its projections are fused one by one).

QLoRA: a ``lora.Linear`` (PEFT's ``lora.bnb.Linear4bit``) on a bitsandbytes 4-bit base is fused
alone, in a q/k/v group, and in a gated MLP (any of gate, up and down 4-bit), plain LoRA and DoRA
(grouped as above). PEFT's ``lora.bnb.Linear8bitLt`` (or a ``lora.Linear``) on a bitsandbytes
LLM.int8() ``Linear8bitLt`` base with ``has_fp16_weights=False`` is fused in the same places, plain
LoRA and DoRA: the layer's own product gives the base output (:class:`fk.lora.quant.Int8Base`); a
``Linear8bitLt`` with ``has_fp16_weights=True``, or not quantized yet, is left to PEFT.

At every call the patched forward checks that the module is still plain LoRA or DoRA (and, for a
fused MLP, that no hooks are registered on its projections, which the fused call would skip: PEFT's
mixed-batch ``adapter_names`` arrive through such hooks): one active adapter,
not merged, adapters enabled, no LoRA variant but DoRA (with its dropout
module in its layer's training mode), a ``torch.nn.Linear`` base layer
or a bitsandbytes 4-bit ``Linear4bit`` one (plain LoRA or DoRA outside autocast, the input in its
``compute_dtype``; plain LoRA or DoRA under autocast to its ``compute_dtype``, the input in that dtype
or in fp32, as ``peft.prepare_model_for_kbit_training`` leaves the hidden states) or int8
``Linear8bitLt`` one (plain LoRA or DoRA, outside autocast, its bias in
the input's dtype), base and LoRA weights in fp32, fp16 or bf16, the base weight
in the input's dtype (any of those under autocast, which casts every operand, as fk.lora's
functions then do), and PEFT's input dtype
casting enabled where the LoRA weights' dtype is not the input's. Otherwise
it runs PEFT's own forward, and says so once per module and reason on the ``fk.lora`` logger.
Modules that can never take the fused path (other quantized or custom layers, LoRA variants other
than DoRA at patch time) are left alone and reported as skipped.

This module imports ``peft`` (only when :func:`patch` is called); the rest of fk.lora does not.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fk.core.forward import SharedInputGroup, has_hooks, restore_class, stock_forward, swap_forward, swapped
from fk.lora.lora import LoRAWeights, module_mlp, module_projections
from fk.lora.quant import Int8Base, QuantizedWeight, from_bnb, int8_base

log = logging.getLogger("fk.lora")

_STATE = "_fk_lora_patches"
"""Attribute of the model :func:`patch` ran on: the modules whose class it swapped."""
_CALL = "_fk_lora_call"
"""Attribute of a patched module: ``(function, *arguments)`` its forward runs as
``function(module, *arguments, x, ...)``; absent once :func:`unpatch` has switched it off."""
_STOCK = "_fk_lora_stock_forward"
"""Attribute of a patched module: its class's forward function before patching (unbound)."""
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_QKV = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class PatchReport:
    """What :func:`patch` did: qualified module names per kind, and the LoRA modules left to PEFT."""

    mlp: list[str] = field(default_factory=list)
    """MLP modules whose forward is :func:`fk.lora.lora_mlp`."""
    qkv: list[list[str]] = field(default_factory=list)
    """Groups of projections that share their input (q/k/v of one attention block)."""
    linear: list[str] = field(default_factory=list)
    """``lora.Linear`` modules patched alone (``o_proj``, ...)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """LoRA modules left to PEFT's forward, with the reason."""

    @property
    def n_patched(self) -> int:
        return len(self.mlp) + len(self.qkv) + len(self.linear)

    def __str__(self) -> str:
        return (
            f"fk.lora patched {len(self.mlp)} MLP, {len(self.qkv)} QKV group(s), {len(self.linear)} other "
            f"linear(s); {len(self.skipped)} LoRA module(s) left to PEFT"
        )


def _lora_linear_class() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


def _lora_layer_class() -> type:
    from peft.tuners.lora.layer import LoraLayer

    return LoraLayer


def _dora_variant_class() -> type:
    from peft.tuners.lora.variants import DoraLinearVariant

    return DoraLinearVariant


def _peft_bnb_class(name: str) -> type | None:
    """PEFT's LoRA layer ``name`` (``"Linear4bit"``, ``"Linear8bitLt"``) for a bitsandbytes base (None
    where PEFT defines none: bitsandbytes is not installed: PEFT's module imports it unconditionally)."""
    try:
        import peft.tuners.lora.bnb as peft_bnb
    except ImportError:
        return None
    cls: type | None = getattr(peft_bnb, name, None)
    return cls


def _is_4bit(module: Any) -> bool:
    """Whether ``module`` is PEFT's ``lora.bnb.Linear4bit`` (or a plain ``lora.Linear``, which PEFT
    builds around a bitsandbytes base where it finds no 4-bit backend, as on CPU) on a quantized
    4-bit bitsandbytes base (duck-typed: its base weight carries a ``quant_state``). fk.lora fuses
    those on their own, in q/k/v groups and in gated MLPs (plain LoRA and DoRA)."""
    if type(module) is not _lora_linear_class() and type(module) is not _peft_bnb_class("Linear4bit"):
        return False
    return _has_4bit_weight(_base_layer(module))


def _is_int8(module: Any) -> bool:
    """Whether ``module`` is PEFT's ``lora.bnb.Linear8bitLt`` (or a plain ``lora.Linear``, which PEFT
    builds around a ``Linear8bitLt`` when the model is not marked ``is_loaded_in_8bit``: its forward
    computes the same) on a bitsandbytes LLM.int8() base whose weight is int8 (:func:`_has_int8_weight`)."""
    if type(module) is not _lora_linear_class() and type(module) is not _peft_bnb_class("Linear8bitLt"):
        return False
    return _has_int8_weight(_base_layer(module))


def _has_int8_weight(base: nn.Module) -> bool:
    """Whether ``base`` is a bitsandbytes ``Linear8bitLt`` with its weight quantized to int8 and kept
    so (duck-typed: an int8 weight, and a ``state`` with ``has_fp16_weights`` off)."""
    weight = base._parameters.get("weight")
    state = base.__dict__.get("state")
    return (
        weight is not None
        and weight.dtype == torch.int8
        and state is not None
        and getattr(state, "has_fp16_weights", True) is False
    )


def _has_4bit_weight(base: nn.Module) -> bool:
    """Whether ``base``'s weight is a quantized bitsandbytes 4-bit one (it carries a ``quant_state``).
    (At call time, :func:`_call_parts` asks this only: the class was checked at patch time, and a
    patched module's class is :func:`fk.core.forward.swap_forward`'s.)"""
    weight = base._parameters.get("weight")
    return weight is not None and getattr(weight, "quant_state", None) is not None


def _other_variants(module: Any) -> list[str]:
    """The names of the LoRA variants of ``module``'s adapters other than DoRA (which fk.lora fuses)."""
    dora = _dora_variant_class()
    variants = getattr(module, "lora_variant", {}) or {}
    return sorted(type(v).__name__ for v in variants.values() if type(v) is not dora)


def _has_dora(module: Any) -> bool:
    """Whether an adapter of ``module`` is DoRA."""
    dora = _dora_variant_class()
    variants = getattr(module, "lora_variant", {}) or {}
    return any(type(v) is dora for v in variants.values()) or any((getattr(module, "use_dora", {}) or {}).values())


def _static_reason(module: Any, lora_linear_cls: type) -> str | None:
    """Why ``module`` can never take the fused path (None: it can)."""
    int8 = _is_int8(module)
    quantized = _is_4bit(module) or int8
    if not int8 and type(_base_layer(module)).__name__ == "Linear8bitLt":
        state = getattr(_base_layer(module), "state", None)
        if getattr(state, "has_fp16_weights", False):
            return "bitsandbytes Linear8bitLt with has_fp16_weights=True (its weight is requantized at every call): left to PEFT"  # fmt: skip
        return "bitsandbytes Linear8bitLt whose weight is not int8 (not quantized yet): left to PEFT"
    if type(module) is not lora_linear_cls and not quantized:
        return f"{type(module).__module__}.{type(module).__name__} is not PEFT's plain lora.Linear (quantized or custom layer)"  # fmt: skip
    base = getattr(module, "get_base_layer")()  # noqa: B009 (mypy narrows module to object above)
    if type(base) is not nn.Linear and not quantized:
        return f"base layer {type(base).__name__} is not torch.nn.Linear"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out=True"
    others = _other_variants(module)
    if others:
        return f"LoRA variant {', '.join(others)} (fk.lora fuses plain LoRA and DoRA)"
    return None


def _base_layer(module: Any) -> nn.Module:
    """PEFT's ``get_base_layer()`` without its ``hasattr`` probe of the last module, which costs a
    raised ``AttributeError`` per call (``_modules`` holds every submodule by name)."""
    base = module
    while (inner := base._modules.get("base_layer")) is not None:
        base = inner
    return base


def _call_parts(module: Any, x: Any) -> LoRAWeights | str:
    """The module's parameters for a fused call on ``x``, or why PEFT's forward must run instead.

    This runs at every call of every patched module, so it reads submodules and parameters from
    ``_modules`` and ``_parameters``: through the attributes (``nn.Module.__getattr__``, and PEFT's
    ``get_base_layer``, which ends on a raised ``AttributeError``) it took 19-33 us a call against
    5-8 us on the 2-core CPU machine this project tests on
    (``benchmarks/experiments/INDEX.md#lora_checks_probe``). The checks are the same."""
    if module.disable_adapters:
        return "adapters are disabled"
    if module.merged:
        return "the adapter is merged into the base weight"
    children = module._modules
    lora_a_dict, lora_b_dict = children["lora_A"]._modules, children["lora_B"]._modules
    active = [a for a in module.active_adapters if a in lora_a_dict]
    if len(active) != 1:
        return f"{len(active)} active adapters (fk.lora fuses exactly one)"
    name = active[0]
    variant = (getattr(module, "lora_variant", {}) or {}).get(name)
    dora = variant is not None and type(variant) is _dora_variant_class()
    if variant is not None and not dora:
        return f"LoRA variant {type(variant).__name__} is active (fk.lora fuses plain LoRA and DoRA)"
    if not dora and module.use_dora.get(name, False):
        return "use_dora is set without PEFT's DoRA variant"
    base = _base_layer(module)
    quantized = type(base) is not nn.Linear and _has_4bit_weight(base)
    int8 = type(base) is not nn.Linear and not quantized and _has_int8_weight(base)
    if type(base) is not nn.Linear and not quantized and not int8:
        return f"base layer {type(base).__name__} is not torch.nn.Linear (or an int8 Linear8bitLt)"
    dropout = children["lora_dropout"]._modules[name]
    if isinstance(dropout, nn.Identity):
        p = 0.0
    elif type(dropout) is nn.Dropout:
        p = float(dropout.p) if dropout.training else 0.0
        if dora and dropout.training != module.training:  # (PEFT's DoRA branch asks the module, not the dropout)
            return "DoRA with the dropout's training mode unlike its module's"
    else:
        return f"dropout module {type(dropout).__name__}"
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        return "input is not a float tensor"
    if quantized or int8:
        return _quantized_parts(module, name, base, x, p, int8, dora)
    lora_a, lora_b = lora_a_dict[name]._parameters, lora_b_dict[name]._parameters
    weight, lora_a_w, lora_b_w = base._parameters["weight"], lora_a["weight"], lora_b["weight"]
    assert weight is not None and lora_a_w is not None and lora_b_w is not None
    autocast = torch.is_autocast_enabled(x.device.type)
    magnitude = _dora_magnitude(module, name) if dora else None
    if isinstance(magnitude, str):
        return magnitude
    for what, t in (("base weight", weight), ("lora_A", lora_a_w), ("lora_B", lora_b_w)):
        if t.dtype not in _FLOATS:
            if autocast:  # (it leaves other dtypes alone, so PEFT's branch runs in them)
                return f"{what} dtype {t.dtype} under autocast (autocast casts fp32, fp16 and bf16 only)"
            return f"{what} dtype {t.dtype} (fk.lora takes fp32, fp16 and bf16)"
    if not autocast and weight.dtype != x.dtype:
        return f"base weight dtype {weight.dtype} differs from the input's {x.dtype}"
    if lora_a_w.dtype != x.dtype and not getattr(module, "cast_input_dtype_enabled", True):
        return "input dtype casting is disabled"
    return LoRAWeights(
        weight, base._parameters.get("bias"), lora_a_w, lora_b_w, float(module.scaling[name]), p, lora_b.get("bias"),
        magnitude,
    )  # fmt: skip


def _dora_magnitude(module: Any, name: str) -> torch.Tensor | str:
    """Adapter ``name``'s DoRA magnitude vector, or why fk cannot take it."""
    magnitude = module._modules["lora_magnitude_vector"]._modules[name]._parameters["weight"]
    if magnitude is None or magnitude.dtype not in _FLOATS:
        return "DoRA magnitude is not an fp32, fp16 or bf16 parameter"
    return magnitude


def _quantized_parts(
    module: Any, name: str, base: Any, x: torch.Tensor, p: float, int8: bool, dora: bool
) -> LoRAWeights | str:
    """:func:`_call_parts` for a LoRA layer on a bitsandbytes base (plain LoRA or ``dora``, checked up
    to the dropout), outside autocast with the input in the base's ``compute_dtype``; under
    autocast, on a 4-bit base whose ``compute_dtype`` is autocast's, the input in that dtype or in
    fp32 (``peft.prepare_model_for_kbit_training`` keeps the hidden states in fp32).

    Under autocast every matmul of PEFT's layer runs in autocast's dtype (bitsandbytes casts the
    input for the base product, autocast the LoRA branch's operands), as in the fused call, which
    casts the LoRA weights itself; what the patcher matches is the dropout. PEFT casts the input to
    the LoRA weights' dtype before the dropout (``_cast_input_dtype``), except where input casting
    is disabled and in ``lora.bnb.Linear4bit`` (the layer PEFT puts on a model loaded in 4 bits)
    where ``torch.is_autocast_enabled()`` (CUDA's) is on: there the mask is drawn on the input's
    dtype, under CPU autocast and in ``lora.Linear`` on the LoRA weights'. The LoRA weights go to
    the fused call cast to the dtype the mask is drawn in (the fused functions draw it in theirs;
    autograd carries the gradients back through the cast); DoRA's norm is formed in that dtype
    too, PEFT's input's at its DoRA forward, with or without dropout. The fused call returns
    autocast's dtype; PEFT's layer the input's, bitsandbytes casting its product back, or wider
    (:func:`_peft_output_dtype`): :func:`_as_peft_output` casts.

    4-bit (``lora.bnb.Linear4bit``): the base weight as a :class:`fk.lora.quant.QuantizedWeight`
    (read at every call: it shares the layer's tensors, no copy), dequantized by the fused call to
    bitsandbytes' ``compute_dtype`` (the input's where bitsandbytes has none yet, as its forward
    sets it) and the bias cast to it, as bitsandbytes' ``Linear4bit.forward`` casts both. DoRA: with
    its magnitude (its norm from the weight dequantized to bitsandbytes' own dtype, as PEFT's
    ``dequantize_module_weight`` gives it: fk.lora.dora).

    int8 (``lora.bnb.Linear8bitLt``): the layer as an :class:`fk.lora.quant.Int8Base` (its own
    product for the base output; its weight, read at every call, for ``dx`` and, DoRA, for its norm
    and its product on the dropped input, as PEFT's ``dequantize_module_weight`` gives it), any float input. Its
    bias must have the input's dtype: ``Linear8bitLt.forward`` casts it in place otherwise, which
    PEFT's forward then does for this call (and the next call is fused)."""
    what = "int8" if int8 else "4-bit"
    autocast = torch.is_autocast_enabled(x.device.type)
    if autocast and int8:
        return "int8 base under autocast (fk.lora fuses it outside autocast)"
    magnitude = _dora_magnitude(module, name) if dora else None
    if isinstance(magnitude, str):
        return magnitude
    compute = x.dtype if int8 else getattr(base, "compute_dtype", None) or x.dtype
    if autocast:
        autocast_dtype = torch.get_autocast_dtype(x.device.type)
        if compute != autocast_dtype:
            return f"4-bit base of compute_dtype {compute} under autocast to {autocast_dtype} (fk.lora fuses it where the two agree)"  # fmt: skip
        if x.dtype not in (compute, torch.float32):
            return f"input dtype {x.dtype} on a 4-bit base under autocast to {compute} (fk.lora fuses inputs in it or in fp32)"  # fmt: skip
    elif compute != x.dtype:
        return f"input dtype {x.dtype} differs from the 4-bit base's compute_dtype {compute} (outside autocast)"
    weight: QuantizedWeight | Int8Base
    try:
        weight = int8_base(base) if int8 else from_bnb(base)
    except (TypeError, ValueError) as e:
        return f"{what} base not readable: {e}"
    if isinstance(weight, QuantizedWeight) and weight.quant_type not in ("nf4", "fp4"):
        return f"base quant_type {weight.quant_type} (fk.lora fuses nf4 and fp4)"
    children = module._modules
    lora_a = children["lora_A"]._modules[name]._parameters
    lora_b = children["lora_B"]._modules[name]._parameters
    lora_a_w, lora_b_w = lora_a["weight"], lora_b["weight"]
    assert lora_a_w is not None and lora_b_w is not None
    if lora_a_w.dtype not in _FLOATS or lora_b_w.dtype not in _FLOATS:
        return f"lora_A dtype {lora_a_w.dtype} (fk.lora takes fp32, fp16 and bf16)"
    if not autocast and lora_a_w.dtype != x.dtype and not getattr(module, "cast_input_dtype_enabled", True):
        return "input dtype casting is disabled"
    bias = base._parameters.get("bias")
    if bias is not None and bias.dtype != compute:
        if int8:
            return f"base bias dtype {bias.dtype} differs from the input's {x.dtype} (Linear8bitLt casts it in place)"
        bias = bias.to(compute)  # (autograd carries a trainable bias's gradient back through the cast)
    lora_bias = lora_b.get("bias")
    if autocast:  # the LoRA weights in the dtype PEFT draws the mask in (see above)
        casts = getattr(module, "cast_input_dtype_enabled", True) and not _bnb_skips_casts(module)
        drawn_in = lora_a_w.dtype if casts and (p > 0 or dora) else x.dtype  # (DoRA's norm is formed in it too)
        lora_a_w, lora_b_w = lora_a_w.to(drawn_in), lora_b_w.to(drawn_in)
        lora_bias = None if lora_bias is None else lora_bias.to(drawn_in)
    return LoRAWeights(weight, bias, lora_a_w, lora_b_w, float(module.scaling[name]), p, lora_bias, magnitude)


def _bnb_skips_casts(module: Any) -> bool:
    """Whether ``module`` is PEFT's ``lora.bnb.Linear4bit`` under CUDA autocast (its
    ``torch.is_autocast_enabled()``), where its forward neither casts its input to the LoRA weights'
    dtype nor its result back to the input's. (``isinstance``: a patched module's class is a
    subclass of its own.)"""
    peft_4bit = _peft_bnb_class("Linear4bit")
    return peft_4bit is not None and isinstance(module, peft_4bit) and torch.is_autocast_enabled()


def _peft_output_dtype(module: Any, parts: LoRAWeights, x_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype PEFT's layer returns under autocast on an input of ``x_dtype``: autocast's on a dense
    base (``F.linear``'s, to which ``lora.Linear`` casts its sum back); on a 4-bit base the input's
    (bitsandbytes casts its product back to it), except DoRA in ``lora.bnb.Linear4bit`` under CUDA
    autocast, which adds DoRA's terms (in autocast's dtype, scaled by ``magnitude / norm``) without
    casting the sum back."""
    autocast_dtype = torch.get_autocast_dtype(device_type)
    if not isinstance(parts.weight, QuantizedWeight):
        return autocast_dtype
    if parts.magnitude is not None and _bnb_skips_casts(module):
        return torch.promote_types(x_dtype, torch.promote_types(parts.magnitude.dtype, autocast_dtype))
    return x_dtype


def _as_peft_output(y: torch.Tensor, x: torch.Tensor, parts: LoRAWeights, module: Any) -> torch.Tensor:
    """The fused output ``y`` of ``module`` on ``x`` in the dtype PEFT's layer returns: outside autocast
    ``x``'s, as the fused call's; under it :func:`_peft_output_dtype` (the fused call returns
    autocast's dtype, its sum rounded to it: at most half a unit in its last place from PEFT's
    wider sum)."""
    if not torch.is_autocast_enabled(x.device.type):
        return y
    dtype = _peft_output_dtype(module, parts, x.dtype, x.device.type)
    return y if y.dtype == dtype else y.to(dtype)


def _peft_intermediate(x: torch.Tensor, gate: LoRAWeights, up: LoRAWeights, modules: list[nn.Module]) -> torch.Tensor:
    """``x``, or a stand-in without elements of the dtype PEFT's ``act_fn(gate_proj(x)) * up_proj(x)``
    has where it differs from ``x``'s (under autocast, gate's and up's output dtypes:
    :func:`_peft_output_dtype`): ``down_proj``'s checks, its mask's dtype and its output's are
    those of its own input, which the fused MLP forms inside."""
    if not torch.is_autocast_enabled(x.device.type):
        return x
    outputs = [_peft_output_dtype(m, p, x.dtype, x.device.type) for m, p in zip(modules, (gate, up), strict=True)]
    dtype = torch.promote_types(*outputs)
    return x if dtype == x.dtype else x.new_empty((0, x.shape[-1]), dtype=dtype)


def _fallback(module: nn.Module, label: str, reason: str) -> None:
    logged: set[str] = module.__dict__.setdefault("_fk_lora_logged", set())
    if reason not in logged:
        logged.add(reason)
        log.info("fk.lora: %s runs PEFT's forward: %s", label, reason)


def _patched_forward(self: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The forward of every module :func:`patch` swapped: its own ``_CALL``, or the stock forward
    once :func:`unpatch` has switched it off (or for a module built by calling a patched class)."""
    call = self.__dict__.get(_CALL)
    if call is None:
        return stock_forward(self, _STOCK, x, *args, **kwargs)
    return call[0](self, *call[1:], x, *args, **kwargs)


def _linear_forward(module: nn.Module, label: str, x: Any, *args: Any, **kwargs: Any) -> Any:
    parts = _call_parts(module, x) if not (args or kwargs) else "extra forward arguments"
    if isinstance(parts, str):
        _fallback(module, label, parts)
        return stock_forward(module, _STOCK, x, *args, **kwargs)
    (y,) = module_projections(x, [parts], from_module=True)
    return _as_peft_output(y, x, parts, module)


def _label(member: nn.Module) -> str:
    """The label a q/k/v group member was patched with (its ``_CALL`` is ``(_shared_forward, group, label, index)``)."""
    label: str = member.__dict__[_CALL][2]
    return label


def _shared_forward(
    module: nn.Module, group: SharedInputGroup, label: str, index: int, x: Any, *args: Any, **kwargs: Any
) -> Any:
    """The forward of q/k/v projection ``index`` of a shared-input group (see
    :class:`fk.core.forward.SharedInputGroup`): the first one computes all with
    :func:`lora_projections`, the others take their outputs."""
    if module is not group.members[index]:  # a copy (a DataParallel replica): its siblings are other copies
        return _linear_forward(module, label, x, *args, **kwargs)
    if index == 0:
        group.pending.clear()
        if not group.split and not (args or kwargs):
            parts = [_call_parts(m, x) for m in group.members]
            reasons = [f"{_label(m)}: {p}" for m, p in zip(group.members, parts, strict=True) if isinstance(p, str)]
            if not reasons and len({p.magnitude is None for p in parts if not isinstance(p, str)}) > 1:
                reasons = ["DoRA on some of the projections only (each is fused alone)"]
            if not reasons:
                ys = module_projections(x, parts, from_module=True)  # type: ignore[arg-type]
                members = group.members
                return group.hand_out(x, [_as_peft_output(y, x, p, m) for y, p, m in zip(ys, parts, members, strict=True)])  # type: ignore[arg-type]  # fmt: skip
            _fallback(module, label + " (QKV group)", "; ".join(reasons))
        return _linear_forward(module, label, x, *args, **kwargs)
    was_split = group.split
    found, out = group.take(module, x, input_alone=not (args or kwargs))
    if found:
        return out
    if group.split and not was_split:
        log.warning(
            "fk.lora: %s was called with another input than %s; its group is no longer fused "
            "(this call's dropout mask was drawn in fused order)", label, _label(group.members[0]),
        )  # fmt: skip
    return _linear_forward(module, label, x, *args, **kwargs)


def _activation_of(act_fn: Any) -> str | None:
    """The fk.glu activation ``act_fn`` computes (by its class), or None when unknown."""
    name = type(act_fn).__name__
    if name in ("SiLU", "SiLUActivation"):
        return "silu"
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"):
        return "gelu_tanh"
    if name == "GELU":
        return "gelu_tanh" if getattr(act_fn, "approximate", "none") == "tanh" else "gelu"
    if name == "GELUActivation":
        return "gelu"
    return None


def _gated_mlp_forward(self: Any, x: Any) -> Any:  # LlamaMLP's forward, and 130-odd others'
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _gated_mlp_forward_returned(self: Any, x: Any) -> Any:  # the same without the local (Idefics2MLP, ...)
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_GATED_MLP_CODE = {(f.__code__.co_code, f.__code__.co_names) for f in (_gated_mlp_forward, _gated_mlp_forward_returned)}


def _computes_gated_mlp(module: nn.Module) -> bool:
    """Whether ``type(module).forward`` is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``:
    one argument besides ``self``, and the bytecode and names of one of the two ways
    ``transformers`` writes it (argument names, annotations and docstrings aside)."""
    code = getattr(type(module).forward, "__code__", None)
    return (
        code is not None
        and code.co_argcount == 2
        and code.co_kwonlyargcount == 0
        and not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
        and (code.co_code, code.co_names) in _GATED_MLP_CODE
    )


def _mlp_forward(mlp: nn.Module, label: str, act: str, x: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:
        _fallback(mlp, label, "extra forward arguments")
        return stock_forward(mlp, _STOCK, x, *args, **kwargs)
    projections = [getattr(mlp, n) for n in _MLP]
    hooked = [n for n, m in zip(_MLP, projections, strict=True) if has_hooks(m)]
    if hooked:  # the fused call would skip them (PEFT's mixed-batch adapter_names come this way)
        _fallback(mlp, label, f"hooks are registered on {', '.join(hooked)} (or globally)")
        return stock_forward(mlp, _STOCK, x)
    gate, up = _call_parts(projections[0], x), _call_parts(projections[1], x)
    h = x if isinstance(gate, str) or isinstance(up, str) else _peft_intermediate(x, gate, up, projections[:2])
    down = _call_parts(projections[2], h)
    reasons = [f"{n}: {p}" for n, p in zip(_MLP, (gate, up, down), strict=True) if isinstance(p, str)]
    if not reasons and (gate.magnitude is None) != (up.magnitude is None):  # type: ignore[union-attr]
        reasons = ["DoRA on one of gate_proj and up_proj only"]
    if reasons:
        _fallback(mlp, label, "; ".join(reasons))
        return stock_forward(mlp, _STOCK, x)
    y = module_mlp(x, gate, up, down, act, from_module=True)  # type: ignore[arg-type]
    return _as_peft_output(y, h, down, projections[2])  # type: ignore[arg-type]


def _swap(module: nn.Module, call: tuple[Any, ...], saved: list[nn.Module]) -> None:
    module.__dict__[_CALL] = call
    swap_forward(module, _patched_forward, _STOCK)
    saved.append(module)


def _replaced(module: nn.Module) -> str | None:
    """Why fk.lora's forward could not run on ``module`` (None: it can)."""
    if "forward" in module.__dict__:
        return "its forward was replaced on the instance (it would shadow fk.lora's)"
    if swapped(module):
        return "its class carries an fk forward already (switched off under another's wrapper)"
    return None


def patch(peft_model: nn.Module) -> PatchReport:
    """Swap the forward of the PEFT LoRA modules of ``peft_model`` for fk.lora's fused functions.

    Returns a :class:`PatchReport` (also logged on ``fk.lora``). Patching an already patched model
    first undoes the previous patch. :func:`unpatch` restores every forward.
    """
    unpatch(peft_model)
    lora_linear_cls, lora_layer_cls = _lora_linear_class(), _lora_layer_class()
    report = PatchReport()
    saved: list[nn.Module] = []
    names = {id(m): n for n, m in peft_model.named_modules()}
    taken: set[int] = set()

    def eligible(module: nn.Module | None) -> bool:
        if module is None or id(module) in taken or not isinstance(module, lora_layer_cls):
            return False
        reason = _replaced(module) or _static_reason(module, lora_linear_cls)
        if reason is not None:
            report.skipped[names[id(module)]] = reason
            return False
        return True

    for qualname, parent in peft_model.named_modules():
        children = dict(parent.named_children())
        mlp = [children.get(n) for n in _MLP]
        act = _activation_of(children.get("act_fn"))
        if act is not None and not _computes_gated_mlp(parent):
            log.info(
                "fk.lora: %s has gate/up/down projections but computes more than "
                "down_proj(act_fn(gate_proj(x)) * up_proj(x)): its projections are patched one by one",
                qualname or type(parent).__name__,
            )
            act = None
        if act is not None and mlp[0] is not None and mlp[1] is not None and _has_dora(mlp[0]) != _has_dora(mlp[1]):
            act = None  # DoRA on one of gate and up only: the projections are fused one by one
        if act is not None and _replaced(parent) is None and all(eligible(m) for m in mlp):
            label = qualname or type(parent).__name__
            _swap(parent, (_mlp_forward, label, act), saved)
            taken.update(id(m) for m in mlp if m is not None)
            report.mlp.append(qualname)
            continue
        qkv = [(n, children[n]) for n in _QKV if n in children and eligible(children[n])]
        if len({_has_dora(m) for _, m in qkv}) > 1:
            qkv = []  # DoRA on some of them only: each is fused alone
        if len(qkv) >= 2:
            group = SharedInputGroup([m for _, m in qkv])
            for i, (_, m) in enumerate(qkv):
                _swap(m, (_shared_forward, group, names[id(m)], i), saved)
                taken.add(id(m))
            report.qkv.append([names[id(m)] for _, m in qkv])
    for qualname, module in peft_model.named_modules():
        if id(module) in taken or not eligible(module):
            continue
        _swap(module, (_linear_forward, qualname), saved)
        taken.add(id(module))
        report.linear.append(qualname)
    for qualname, reason in report.skipped.items():
        log.info("fk.lora: %s left to PEFT's forward: %s", qualname, reason)
    peft_model.__dict__[_STATE] = saved
    log.info("%s", report)
    return report


def unpatch(peft_model: nn.Module) -> int:
    """Restore every forward that :func:`patch` swapped on ``peft_model``; returns how many.

    A module that another library has wrapped since (a subclass of its class, as FSDP2's
    ``fully_shard`` makes, or an instance ``forward``) keeps their wrapper; fk.lora's forward
    under it is switched off and runs PEFT's."""
    saved = peft_model.__dict__.pop(_STATE, [])
    for module in reversed(saved):
        module.__dict__.pop(_CALL, None)
        if restore_class(module):
            module.__dict__.pop(_STOCK, None)
        module.__dict__.pop("_fk_lora_logged", None)
    return len(saved)


def is_patched(peft_model: nn.Module) -> bool:
    """True when :func:`patch` swapped forwards on ``peft_model`` and :func:`unpatch` has not undone them."""
    return bool(peft_model.__dict__.get(_STATE))
