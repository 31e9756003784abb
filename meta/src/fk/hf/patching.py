"""Patch a built Hugging Face model in place with fk's kernels, and undo it.

Modules are patched, not source: each patched module's class is swapped for a subclass that
differs only by its ``forward`` and keeps the class's name (see :mod:`fk.core.forward`; the class
itself and every other model of that class are untouched), so the parameters, buffers and
``state_dict`` stay exactly as they were, and a copy of the module (``torch.nn.DataParallel``'s
replicas) runs fk's forward with its own parameters. :func:`revert` gives back the original classes.

What each switch replaces (for the families in :mod:`fk.hf.models`):

- ``rms_norm``: the forward of each RMSNorm module by :func:`fk.norms.rms_norm` (same weight,
  same epsilon, the family's casting mode and offset).
- ``layer_norm``: the forward of each ``torch.nn.LayerNorm`` module of a family that uses them
  (StableLM) by :func:`fk.norms.layer_norm` (same weight, bias or none, and epsilon), where it
  normalizes over the last dimension alone and its parameters have the input's dtype.
- ``swiglu``: the forward of each gated MLP whose activation is SiLU by
  ``fk.glu.gated_mlp(x, gate_proj.weight, up_proj.weight, down_proj.weight)``, which does not keep
  ``act(gate) * up`` for the backward, where the projections are plain ``nn.Linear`` layers
  without bias or hooks, autocast is off and ``x`` has the weights' dtype; else by
  ``down_proj(fk.glu.swiglu(gate_proj(x), up_proj(x)))``, or, with one fused ``gate_up_proj``
  (Phi-3), ``down_proj(fk.glu.swiglu_fused(gate_up_proj(x)))``.
- ``geglu``: the same for gated MLPs whose activation is GELU (tanh-approximated, as Gemma's
  ``gelu_pytorch_tanh``, or exact) with :func:`fk.glu.gated_mlp` or :func:`fk.glu.geglu`. MLPs
  with any other activation are left alone.
- ``rope``: the attention's forward runs with :func:`fk.rope.apply_rotary_pos_emb` in place of the
  modeling file's ``apply_rotary_pos_emb``. The attention's own forward function is reused as it
  is; only the global name ``apply_rotary_pos_emb`` it looks up resolves to fk's (a copy of the
  function with that one global rebound).
- ``qkv``: an attention block's ``q_proj``, ``k_proj`` and ``v_proj``, where all three are plain
  ``nn.Linear`` layers, form a :class:`fk.core.forward.SharedInputGroup`: the first one called
  computes the three with :func:`fk.hf.projections.linear_projections`, whose backward forms the
  input's gradient in one buffer (two matmul epilogues instead of two add kernels), and the others
  take their outputs (see :func:`projections_forward`). Projections under LoRA are fk.lora's.
- ``add_norm``: each pre-norm decoder layer whose forward is exactly Llama's (see
  :func:`is_pre_norm_decoder`: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma) adds the
  attention's output to the residual stream inside its post-attention RMSNorm with
  :func:`fk.norms.fused_add_rms_norm` (see :func:`add_norm_forward`).
- ``recompute_norms`` (off unless turned on): in each decoder layer the ``add_norm`` switch
  patched, the outputs of the two RMSNorms are not kept for the backward: the projections'
  backward forms them again from the norms' inputs, which the norms keep anyway (see
  :mod:`fk.hf.recompute`). Two ``[tokens, hidden]`` activations less per layer, for two norm
  forward passes more in the backward. Where the input norm is not fk's
  :func:`fk.norms.rms_norm_and_input` (the ``rms_norm`` switch off), only the post-attention
  norm's output is recomputed.
- ``flce``: the causal-LM forward computes the loss with :func:`fk.flce.linear_cross_entropy` on
  the final hidden states, without materializing the logits (see :func:`causal_lm_forward`);
  a family whose logits are soft-capped (Gemma 2 and 3) passes ``config.final_logit_softcapping``
  as the loss's ``softcap``; Granite's logits, divided by ``config.logits_scaling``, come from the
  hidden states divided by it. A mixture of experts' (Mixtral, Qwen3-MoE) load-balancing loss is
  added as stock adds it. Under FSDP2 with the head sharded on its own (``fully_shard(lm_head)``,
  or ``fully_shard([embed_tokens, lm_head])`` for a tied head), the loss runs as the head's forward
  for one call (see :func:`run_as_forward`), so FSDP2's hooks unshard the weight before it, reshard
  it after, and reduce-scatter its gradient: the loss never reads a shard.
- ``lora``: on a model with PEFT LoRA layers (a ``peft.PeftModel``, or adapters injected into a
  ``transformers`` model), :func:`fk.lora.patch` swaps their forwards for fk.lora's fused ones
  first (an MLP whose three projections are LoRA layers then runs :func:`fk.lora.lora_mlp`, and
  is left to fk.lora rather than the ``swiglu``/``geglu`` patch). Its count is the number of
  fused LoRA units (MLPs, q/k/v groups, single linears).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fk.core.forward import (
    SharedInputGroup,
    has_hooks,
    is_forward_class,
    restore_class,
    stock_forward,
    swap_forward,
    swapped,
)

SWITCHES = ("rms_norm", "layer_norm", "swiglu", "geglu", "rope", "qkv", "add_norm", "flce", "lora", "recompute_norms")
OFF_BY_DEFAULT = ("recompute_norms",)
"""The switches that are off unless turned on (the others are on unless turned off)."""

_KIND = "_fk_hf_kind"
_LORA = "_fk_hf_lora_report"
"""Attribute of a model :func:`apply_patch` ran :func:`fk.lora.patch` on: its ``PatchReport``."""
LOSS_OPTIONS = "_fk_hf_loss_options"
"""Attribute of a causal LM: keyword arguments its fused loss passes on (see fk.hf.loss_options)."""
_STOCK = "_fk_hf_stock_forward"
"""Attribute of a patched module: its class's forward function before patching (unbound: called
with the running module, see :func:`fk.core.forward.stock_forward`)."""
_AUX_LOSS = "_fk_hf_load_balancing_loss_func"
"""Attribute of a patched mixture-of-experts causal LM: its modeling module's ``load_balancing_loss_func``."""
_GROUP = "_fk_hf_projection_group"
"""Attribute of a projection the ``qkv`` switch patched: ``(its SharedInputGroup, its index there)``."""
_RECOMPUTE = "_fk_hf_recompute_norms"
"""Attribute of a decoder layer the ``add_norm`` switch patched with ``recompute_norms`` on."""
_SWITCHED_OFF = "_fk_hf_switched_off"
"""Attribute of a reverted module whose fk forward stays under another's wrapper, switched off."""


@dataclass(frozen=True)
class ModelPatch:
    """How to patch one model family: where its classes live and what they compute.

    The class names are looked up in ``modeling_module`` when the patch is applied (so importing
    fk.hf imports no transformers model code).
    """

    model_type: str
    """``config.model_type`` of the family (the registry key)."""
    modeling_module: str
    """e.g. ``"transformers.models.llama.modeling_llama"``."""
    rms_norm: tuple[str, ...]
    mlp: tuple[str, ...]
    attention: tuple[str, ...]
    causal_lm: tuple[str, ...]
    layer_norm: tuple[str, ...] = ()
    """LayerNorm classes of the family; a dotted name (``"torch.nn.LayerNorm"``) is imported from
    its own module rather than the modeling module."""
    casting_mode: str = "llama"
    """fk.norms casting mode of the family's RMSNorm."""
    offset: float = 0.0
    """Added to the RMSNorm weight (Gemma stores ``w`` and applies ``1 + w``)."""
    eps_attr: str = "variance_epsilon"
    """The RMSNorm module's attribute holding its epsilon (Gemma's is ``eps``)."""
    activation_attr: str = "hidden_act"
    """The config attribute naming the MLP's activation (Gemma 2 and 3: ``hidden_activation``)."""
    logit_softcapping: bool = False
    """Whether the causal LM soft-caps its logits by ``config.final_logit_softcapping`` (when that
    is not None): ``c * tanh(logits / c)``, before the loss (Gemma 2 and 3)."""
    logits_scaling: bool = False
    """Whether the causal LM divides its logits by ``config.logits_scaling`` (Granite): the fused
    loss then takes the hidden states divided by it (``(h / s) W^T = (h W^T) / s``)."""
    router_aux_loss: bool = False
    """Whether the causal LM is a mixture of experts with the router's load-balancing loss (Mixtral,
    Qwen3-MoE): with ``output_router_logits`` (the argument, else the config's), the modeling
    module's ``load_balancing_loss_func`` is returned as ``aux_loss`` and, times
    ``router_aux_loss_coef``, added to the loss, as stock; the output is a ``MoeCausalLMOutputWithPast``."""

    def classes(self, names: tuple[str, ...]) -> tuple[type, ...]:
        def lookup(name: str) -> type:
            where, _, leaf = name.rpartition(".")
            cls: type = getattr(importlib.import_module(where or self.modeling_module), leaf)
            return cls

        return tuple(lookup(name) for name in names)


# --- forwards -------------------------------------------------------------------------------------


def rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm-style forward through :func:`fk.norms.rms_norm`.

    Where the weight's dtype differs from the input's (stock then returns the weight's dtype, by
    type promotion), the stock forward runs instead.
    """
    from fk.norms import rms_norm

    if self.weight.dtype != hidden_states.dtype:
        return stock_forward(self, _STOCK, hidden_states)
    patch: ModelPatch = self._fk_hf_patch
    eps = getattr(self, patch.eps_attr)
    out: torch.Tensor = rms_norm(hidden_states, self.weight, eps, casting_mode=patch.casting_mode, offset=patch.offset)
    return out


def layer_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.LayerNorm``'s forward through :func:`fk.norms.layer_norm` (over the last
    dimension, with the module's weight and bias, either of which may be absent).

    A LayerNorm over more than the last dimension, or whose parameters' dtype differs from the
    input's (stock then returns the parameters' dtype, by type promotion), runs the stock forward.
    """
    from fk.norms import layer_norm

    params = [p for p in (self.weight, self.bias) if p is not None]
    if len(self.normalized_shape) != 1 or any(p.dtype != x.dtype for p in params):
        return stock_forward(self, _STOCK, x)
    out: torch.Tensor = layer_norm(x, self.weight, self.bias, self.eps)
    return out


def swiglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP-style forward with the SiLU gate.

    Where :func:`_whole_mlp` allows it, the whole MLP is :func:`fk.glu.gated_mlp`, which does not
    keep ``act(gate) * up`` for the backward. Otherwise ``down_proj(fk.glu.swiglu(gate_proj(x),
    up_proj(x)))``, with the gradients of the gate and up projections' outputs written into their
    own buffers (``inplace_grad=True``): they are intermediate activations nothing else reads.
    """
    from fk.glu import gated_mlp, swiglu, swiglu_fused

    if hasattr(self, "gate_up_proj"):  # one fused projection, gate first (Phi-3)
        return self.down_proj(swiglu_fused(self.gate_up_proj(x), inplace_grad=True))
    if _whole_mlp(self, x):
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, "silu")
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), inplace_grad=True))


def geglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """GemmaMLP-style forward with the GELU gate (tanh-approximated or exact, as the module's
    activation is): :func:`fk.glu.gated_mlp` or :func:`fk.glu.geglu`, as in :func:`swiglu_forward`."""
    from fk.glu import gated_mlp, geglu, geglu_fused

    activation = _geglu_activation(self)
    approximate = "none" if activation == "gelu" else "tanh"
    if hasattr(self, "gate_up_proj"):
        return self.down_proj(geglu_fused(self.gate_up_proj(x), approximate, inplace_grad=True))
    if _whole_mlp(self, x):
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return gated_mlp(x, *weights, activation)
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), approximate, inplace_grad=True))


def _geglu_activation(module: Any) -> str:
    """fk.glu's name of the GELU a ``geglu``-patched MLP computes: ``"gelu"`` (exact) or ``"gelu_tanh"``."""
    return "gelu" if _mlp_activation(module, module._fk_hf_patch) == "gelu" else "gelu_tanh"


def projections_forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The forward of an attention block's q, k or v projection (a plain ``nn.Linear``) under the
    ``qkv`` switch; the three form a :class:`fk.core.forward.SharedInputGroup`. The first one called
    computes all three with :func:`fk.hf.projections.linear_projections` (one ``dx`` accumulation in
    the backward) and returns its own output; the others, called next with the same tensor, take
    theirs. Where that would not compute exactly what their forwards do (see :func:`_computes_as_stock`), or
    when called with more than the input, each runs its stock forward."""
    from fk.hf.projections import linear_projections

    group, index = self.__dict__[_GROUP]
    if self is not group.members[index]:  # a copy (a DataParallel replica): it computes alone
        return stock_forward(self, _STOCK, x, *args, **kwargs)
    if index == 0:
        group.pending.clear()
        if not group.split and not (args or kwargs) and _computes_as_stock(group.members, x):
            weights = [m.weight for m in group.members]
            biases = [m.bias for m in group.members]
            return group.hand_out(x, linear_projections(x, weights, biases))
        return stock_forward(self, _STOCK, x, *args, **kwargs)
    found, out = group.take(self, x, input_alone=not (args or kwargs))
    return out if found else stock_forward(self, _STOCK, x, *args, **kwargs)


def _computes_as_stock(modules: list[torch.nn.Module], x: Any) -> bool:
    """Whether a fused call on ``x`` with the parameters of ``modules`` computes what their own
    forwards would: ``x`` is a tensor, autocast is off for its device, and every module has no hooks
    and no forward set on the instance, and a weight and bias (where present) of ``x``'s dtype and
    device that are not sharded DTensors. (Used by the ``qkv`` and ``add_norm`` forwards.)"""
    if not isinstance(x, torch.Tensor) or torch.is_autocast_enabled(x.device.type):
        return False
    for m in modules:
        if has_hooks(m) or "forward" in m.__dict__:
            return False
        for p in (getattr(m, "weight", None), getattr(m, "bias", None)):
            if isinstance(p, torch.Tensor) and (p.dtype != x.dtype or p.device != x.device or _is_dtensor(p)):
                return False
    return True


def _pre_norm_decoder_forward(  # LlamaDecoderLayer's forward (transformers 5.2x), the template of add_norm
    self: Any,
    hidden_states: Any,
    attention_mask: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    use_cache: Any = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> Any:
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states


# The same forward from transformers 5.24 on, where past_key_values is named cache. The templates are
# compared by bytecode (is_pre_norm_decoder), so each is written out as transformers writes it.
def _pre_norm_decoder_forward_cache(
    self: Any,
    hidden_states: Any,
    attention_mask: Any = None,
    position_ids: Any = None,
    cache: Any = None,
    use_cache: Any = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> Any:
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states


def _same_code(fn: Any, template: Callable[..., Any]) -> bool:
    """Whether function ``fn`` has ``template``'s bytecode, names and arguments (annotations and
    docstrings aside)."""
    code, want = getattr(fn, "__code__", None), template.__code__
    star_args = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS  # (the other flags: __future__ imports, ...)
    return (
        code is not None
        and code.co_flags & star_args == want.co_flags & star_args
        and all(getattr(code, a) == getattr(want, a) for a in ("co_code", "co_names", "co_varnames", "co_argcount"))
    )


def is_pre_norm_decoder(module: torch.nn.Module) -> bool:
    """Whether ``type(module).forward`` (under the wrappers ``transformers`` puts on it: gradient
    checkpointing, renamed-argument deprecation) is exactly :func:`_pre_norm_decoder_forward`, or
    its transformers 5.24 form with ``cache`` for ``past_key_values``. Llama, Mistral, Qwen2, Qwen3,
    Qwen3-MoE and Gemma decoder layers are."""
    return _add_norm_forward_for(type(module).forward) is not None


@functools.cache
def _add_norm_forward_for(stock: Callable[..., Any]) -> Callable[..., Any] | None:
    """The ``add_norm`` forward that replaces ``stock`` (a decoder layer's forward), under the same
    wrappers (see :func:`_rewrapped`), or None when ``stock`` is not a pre-norm decoder forward."""
    inner = inspect.unwrap(stock)
    for template, forward in ((_pre_norm_decoder_forward, add_norm_forward),
                              (_pre_norm_decoder_forward_cache, add_norm_forward_cache)):  # fmt: skip
        if _same_code(inner, template):
            return _rewrapped(stock, forward)
    return None


def _rewrapped(outer: Any, new_inner: Callable[..., Any]) -> Callable[..., Any] | None:
    """``outer`` with the function at the bottom of its ``__wrapped__`` chain replaced by
    ``new_inner``: each wrapper (a closure over the function it wraps, as ``functools.wraps``
    decorators make) is copied with that closure cell pointing at the new function below it. So a
    patched forward keeps ``transformers``' decorators (its renamed-argument deprecation, say).
    None where a wrapper holds what it wraps some other way (then nothing is patched)."""
    wrapped = getattr(outer, "__wrapped__", None)
    if wrapped is None:
        return new_inner
    below = _rewrapped(wrapped, new_inner)
    if below is None or not isinstance(outer, types.FunctionType):
        return None
    found = False
    new_cells = []
    for cell in outer.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            held = None
        if held is wrapped:
            found = True
            new_cells.append(types.CellType(below))
        else:
            new_cells.append(cell)
    if not found:
        return None
    fn = _function_copy(outer, outer.__globals__, tuple(new_cells))
    fn.__dict__.update(outer.__dict__)
    fn.__wrapped__ = below
    fn.__module__ = outer.__module__
    return fn


def _function_copy(fn: types.FunctionType, globals_: dict[str, Any], closure: tuple[Any, ...] | None) -> Any:
    """``fn`` with other globals or closure cells: the same code, name, defaults, qualified name
    and docstring."""
    copy = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return copy


def add_norm_forward(
    self: Any,
    hidden_states: Any,
    attention_mask: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    use_cache: Any = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> Any:
    """:func:`_add_norm` with the arguments of :func:`_pre_norm_decoder_forward`."""
    attention_kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    return _add_norm(self, hidden_states, attention_kwargs)


def add_norm_forward_cache(
    self: Any,
    hidden_states: Any,
    attention_mask: Any = None,
    position_ids: Any = None,
    cache: Any = None,
    use_cache: Any = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> Any:
    """:func:`_add_norm` with the arguments of :func:`_pre_norm_decoder_forward_cache` (transformers 5.24)."""
    attention_kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    return _add_norm(self, hidden_states, attention_kwargs)


def _add_norm(self: Any, hidden_states: Any, attention_kwargs: dict[str, Any]) -> Any:
    """A pre-norm decoder layer's forward (see :func:`is_pre_norm_decoder`) with the attention's
    residual add inside the post-attention RMSNorm: ``y, s = fk.norms.fused_add_rms_norm(attn,
    residual)`` computes ``s = residual + attn`` and ``y = rms_norm(s)`` in one pass, and its
    backward adds the gradient that reaches ``s`` from the layer's output to the norm's input
    gradient in the same pass (stock: one add kernel forward, one backward). Where the norm cannot
    take it (see :func:`_add_norm_applies`), the stock forward runs. Where the MLP runs as one
    :func:`fk.glu.gated_mlp` (see :func:`_mlp_takes_residual`), the layer's second residual add
    happens in its down projection's matmul: ``gated_mlp(y, ..., residual=s)`` (a device copy of
    ``s`` that the matmul accumulates into, instead of an add kernel). Where the input norm runs
    fk's RMSNorm (see :func:`_input_norm_hands_on`), it is :func:`fk.norms.rms_norm_and_input`, which
    hands the layer's input on as the residual: the gradient of that residual branch is added to
    the norm's input gradient inside its backward kernel (stock: one add kernel in the backward)."""
    from fk.glu import gated_mlp
    from fk.hf.recompute import recomputed
    from fk.norms import fused_add_rms_norm, rms_norm_and_input

    norm = self.post_attention_layernorm
    if not _add_norm_applies(norm, hidden_states):
        return stock_forward(self, _STOCK, hidden_states, **attention_kwargs)
    patch: ModelPatch = self._fk_hf_patch
    recompute = _RECOMPUTE in self.__dict__
    input_norm: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if _input_norm_hands_on(self.input_layernorm, hidden_states):
        eps = getattr(self.input_layernorm, patch.eps_attr)
        hidden_states, residual = rms_norm_and_input(
            hidden_states, self.input_layernorm.weight, eps, casting_mode=patch.casting_mode, offset=patch.offset
        )
        if recompute:
            input_norm = recomputed(hidden_states, _rms_norm_of(residual, self.input_layernorm.weight, eps, patch))
    else:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    with input_norm:
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attention_kwargs)
    post_norm: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if isinstance(hidden_states, torch.Tensor) and hidden_states.dtype == residual.dtype:
        eps = getattr(norm, patch.eps_attr)
        hidden_states, residual = fused_add_rms_norm(
            hidden_states, residual, norm.weight, eps, casting_mode=patch.casting_mode, offset=patch.offset
        )
        if recompute:
            post_norm = recomputed(hidden_states, _rms_norm_of(residual, norm.weight, eps, patch))
    else:  # an attention output of another dtype (stock promotes in the add): stock's steps
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = norm(hidden_states)
    with post_norm:
        activation = _mlp_takes_residual(self.mlp, hidden_states, residual)
        if activation is not None:
            weights = (self.mlp.gate_proj.weight, self.mlp.up_proj.weight, self.mlp.down_proj.weight)
            return gated_mlp(hidden_states, *weights, activation, residual=residual)
        hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _rms_norm_of(x: torch.Tensor, weight: torch.Tensor, eps: float, patch: ModelPatch) -> Callable[[], torch.Tensor]:
    """``fk.norms.rms_norm(x, weight, eps)`` with the family's casting and offset, to be called
    later (in the backward, by :func:`fk.hf.recompute.recomputed`): the output that
    :func:`fk.norms.rms_norm_and_input` and :func:`fk.norms.fused_add_rms_norm` gave, formed again
    from the input they keep for their own backward."""
    from fk.norms import rms_norm

    return functools.partial(rms_norm, x, weight, eps, casting_mode=patch.casting_mode, offset=patch.offset)


def _add_norm_applies(norm: torch.nn.Module, x: Any) -> bool:
    """Whether ``fused_add_rms_norm`` computes what ``norm`` (one of the family's RMSNorm classes,
    checked when patched) would on the layer input ``x``: it has a weight and
    :func:`_computes_as_stock` holds (stock's result then has ``x``'s dtype too). (The attention's
    output must have ``x``'s dtype too; :func:`add_norm_forward` checks that when it has it.)"""
    return isinstance(getattr(norm, "weight", None), torch.Tensor) and _computes_as_stock([norm], x)


def _runs_fk_forward_alone(module: Any, kinds: tuple[str, ...]) -> bool:
    """Whether calling ``module`` would run the fk forward of one of ``kinds`` and nothing else:
    its class is the one fk set, with no forward on the instance, no hooks and the patch not
    switched off."""
    if module.__dict__.get(_KIND) not in kinds or _SWITCHED_OFF in module.__dict__ or "forward" in module.__dict__:
        return False
    return is_forward_class(type(module)) and not has_hooks(module)


def _input_norm_hands_on(norm: Any, x: Any) -> bool:
    """Whether a decoder layer's input norm can run as :func:`fk.norms.rms_norm_and_input` on the
    layer input ``x``: calling ``norm`` would run fk's :func:`rms_norm_forward` and nothing else
    (see :func:`_runs_fk_forward_alone`), and :func:`_add_norm_applies` holds (its weight then has
    ``x``'s dtype, so that forward would run the kernel too). Not while ``torch.compile`` traces
    (as in :func:`_mlp_takes_residual`)."""
    if torch.compiler.is_compiling():
        return False
    return _runs_fk_forward_alone(norm, ("rms_norm",)) and _add_norm_applies(norm, x)


def _mlp_takes_residual(mlp: Any, x: Any, residual: Any) -> str | None:
    """The activation (``"silu"``, ``"gelu_tanh"``, ``"gelu"``) with which ``residual + mlp(x)`` can
    be one :func:`fk.glu.gated_mlp` call with ``residual=``, or None. It can when calling ``mlp``
    would run fk's own gated-MLP forward (:func:`swiglu_forward` or :func:`geglu_forward`, on
    separate gate and up projections) and nothing else: its class is the one fk set, with no
    forward on the instance, no hooks and the patch not switched off; :func:`_whole_mlp` holds on
    ``x``; and ``residual`` has the output's shape and ``x``'s dtype. Not while ``torch.compile``
    traces (the class check reads a class's ``__dict__``, which dynamo does not trace; the compiler
    fuses the add itself)."""
    if torch.compiler.is_compiling():
        return None
    if not _runs_fk_forward_alone(mlp, ("swiglu", "geglu")) or hasattr(mlp, "gate_up_proj"):
        return None
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor) and _whole_mlp(mlp, x)):
        return None
    if residual.dtype != x.dtype or residual.shape != (*x.shape[:-1], mlp.down_proj.weight.shape[0]):
        return None
    return "silu" if mlp.__dict__[_KIND] == "swiglu" else _geglu_activation(mlp)


def _whole_mlp(module: Any, x: torch.Tensor) -> bool:
    """Whether the gated MLP ``module`` can run as one :func:`fk.glu.gated_mlp` on ``x``: its three
    projections are plain ``nn.Linear`` layers without a bias (see :func:`plain_linear`, and no
    hooks at all, not even FSDP2's, whose unsharding only a module call runs; not LoRA or
    quantized layers), autocast is off for ``x``'s device, and ``x`` has the weights' dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return False
    for proj in (module.gate_proj, module.up_proj, module.down_proj):
        if not (plain_linear(proj) and proj.bias is None and not has_hooks(proj)):
            return False
        if proj.weight.dtype != x.dtype or _is_dtensor(proj.weight):
            return False
    return True


def _mlp_activation(module: Any, patch: ModelPatch) -> str | None:
    """What the gated MLP ``module`` computes between its projections: ``"silu"``, ``"gelu_tanh"``
    or ``"gelu"`` (see :data:`fk.glu.HF_ACTIVATIONS`), or None (not a gated MLP, or another
    activation). Its projections are ``gate_proj``, ``up_proj`` and ``down_proj``, or one fused
    ``gate_up_proj`` (gate in the first half of its outputs, as Phi-3's) and ``down_proj``."""
    from fk.glu import HF_ACTIVATIONS

    act = getattr(getattr(module, "config", None), patch.activation_attr, None)
    gate_up = hasattr(module, "gate_up_proj") or all(hasattr(module, name) for name in ("gate_proj", "up_proj"))
    has_projections = gate_up and hasattr(module, "down_proj")
    return HF_ACTIVATIONS.get(act) if has_projections and isinstance(act, str) else None


@functools.cache
def _rope_forward(stock: Callable[..., Any]) -> Callable[..., Any] | None:
    """A copy of ``stock`` (an attention forward) whose global ``apply_rotary_pos_emb`` is fk's,
    under the same wrappers (see :func:`_rewrapped`), or None when the function under them does not
    call a global of that name itself. One copy per ``stock`` (so the patched class is made once
    per attention class)."""
    from fk.rope import apply_rotary_pos_emb

    outer, stock = stock, inspect.unwrap(stock)  # (transformers 5.24 wraps it: renamed-argument deprecation)
    if not isinstance(stock, types.FunctionType) or "apply_rotary_pos_emb" not in stock.__code__.co_names:
        return None
    # The copy's globals are a module of their own, registered under its own name: torch.compile
    # finds an inlined function's globals through sys.modules[globals["__name__"]], and with the
    # modeling module's name it would guard on the stock apply_rotary_pos_emb (and fail).
    name = f"fk.hf.patched_globals.{stock.__module__}.{stock.__qualname__}"
    namespace = types.ModuleType(name)
    namespace.__dict__.update({k: v for k, v in stock.__globals__.items() if k not in ("__name__", "__spec__")})
    namespace.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]
    sys.modules[name] = namespace
    return _rewrapped(outer, _function_copy(stock, namespace.__dict__, stock.__closure__))


def _keep_last(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # transformers before 5.20: positions as one 1-D index, as its stock forwards
        return hidden_states[:, logits_to_keep, :]
    return slice_logits_to_keep(hidden_states, logits_to_keep)


def fused_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    options: dict[str, Any] | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` of ``lm_head(hidden_states)`` without the logits.

    As stock: position t is scored against ``labels[:, t + 1]`` (or against ``shift_labels[:, t]``
    when given), ``ignore_index`` labels are left out, and with ``num_items_in_batch`` the summed
    loss is divided by it instead of by the count of scored tokens; ``softcap`` soft-caps the logits
    first (``softcap * tanh(logits / softcap)``). Under autocast, the hidden states and head weight
    are cast to autocast's dtype first, as stock's ``lm_head`` would. ``options`` are more keyword
    arguments of :func:`fk.flce.linear_cross_entropy` (``memory_budget``, ``accum_dtype``; see
    :func:`fk.hf.loss_options`). ``weight``, when given, stands for ``lm_head.weight`` (an alias of
    it whose gradient goes elsewhere: :class:`_TiedHeadWeight`).
    """
    from fk.flce import linear_cross_entropy

    target, shift = (shift_labels, False) if shift_labels is not None else (labels, True)

    def loss_forward(head: Any, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        head_weight: torch.Tensor = head.weight if weight is None else weight
        bias: torch.Tensor | None = getattr(head, "bias", None)
        if _is_dtensor(head_weight):
            raise TypeError(
                "lm_head.weight is a sharded DTensor where fk's fused loss reads it: FSDP2 unshards a "
                "parameter only around the forward of the module fully_shard was given. Shard a tied head "
                "with its embedding as one group, fully_shard([model.model.embed_tokens, model.lm_head]), or leave "
                "the head to the root's fully_shard(model)"
            )
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            hidden, head_weight = hidden.to(dtype), head_weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            loss: torch.Tensor = linear_cross_entropy(
                hidden, head_weight, target, bias, ignore_index=ignore_index, shift=shift,
                num_items_in_batch=num_items_in_batch, softcap=softcap, **(options or {}),
            )  # fmt: skip
        return loss

    target = target.to(hidden_states.device)
    if lm_head._forward_pre_hooks or lm_head._forward_hooks:  # FSDP2's (see plain_linear): run them
        return run_as_forward(lm_head, loss_forward, hidden_states, target)
    return loss_forward(lm_head, hidden_states, target)


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


def _is_dtensor(t: torch.Tensor) -> bool:
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


def causal_lm_forward(
    self: Any,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    skip_logits: bool | None = None,
    **kwargs: Any,
) -> Any:
    """The causal-LM forward of Llama-like models, with the loss from fused linear cross entropy.

    Same arguments and outputs as stock, plus ``skip_logits``: when true, the loss comes from
    :func:`fused_causal_lm_loss` and ``logits`` is None (never materialized); when false, the
    logits are computed and the loss (if ``labels`` are given) is stock's. It defaults to true
    exactly when the model is in training mode and ``labels`` are given, so evaluation (and
    ``generate``) get their logits as stock. ``skip_logits=True`` without labels raises.
    ``num_items_in_batch``, ``ignore_index`` and ``shift_labels`` are read from ``kwargs`` as
    stock's loss reads them; a family with ``logit_softcapping`` soft-caps the logits by
    ``config.final_logit_softcapping`` on both paths, as stock, and one with ``logits_scaling``
    divides them by ``config.logits_scaling``; ``return_dict=False`` gives a
    tuple, as stock. A head that is not a plain ``nn.Linear`` (see :func:`plain_linear`: a
    LoRA-wrapped or quantized head) always takes the stock path, logits included.

    On the fused path the model builds no key/value cache unless the caller asks for one
    (``use_cache=True``) or passes one (``past_key_values``): with ``config.use_cache`` true, as
    most configs have it, stock's training forward copies every layer's keys and values into a
    new cache that nothing reads (two concatenations a layer: 0.9 ms of a 116 ms Llama-3.2-1B
    step on an H200, ``benchmarks/results/experiments/e2e_probes_h200.txt``); ``past_key_values``
    is then None in the output. (Without a cache and without an attention mask, transformers'
    mask code looks for packed sequences in the position ids, which waits for the GPU once per
    forward, as stock's forward does whenever it runs without a cache; with an attention mask,
    stock's and fk's forwards both wait once in the mask code anyway.)

    Also on the fused path, an input embedding tied to the head (see :func:`_tied_embedding`) is
    looked up by :class:`_TiedEmbedding` and handed to the model as ``inputs_embeds``: its backward
    adds the rows of the batch's tokens into the head's dense gradient, in place, and returns the
    sum as the weight's one gradient. Stock's dense embedding gradient fills a vocabulary-sized
    zero buffer, scatters into it, and is added whole: about 0.7 ms of a Llama-3.2-1B step on an
    H200 (128256 x 2048), against the index-add's 0.16 ms (an embedding gradient left sparse for
    autograd to add would cost a copy of the head's gradient more, 0.24 ms).
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if skip_logits is None:
        skip_logits = self.training and labels is not None
    if skip_logits and labels is None:
        raise ValueError("skip_logits=True needs labels: without them there is nothing to compute but the logits")
    skip_logits = skip_logits and plain_linear(self.lm_head)
    if skip_logits and use_cache is None and past_key_values is None:
        use_cache = False  # (see the docstring: a cache nothing reads)
    tied: _TiedGradient | None = None
    if skip_logits and input_ids is not None and inputs_embeds is None and _tied_embedding(self):
        embed, tied = self.get_input_embeddings(), _TiedGradient()
        inputs_embeds = _TiedEmbedding.apply(input_ids, embed.weight, tied, embed.padding_idx)
        input_ids = None
    patch: ModelPatch = self._fk_hf_patch
    moe: dict[str, Any] = {}
    if patch.router_aux_loss:
        router_logits = kwargs.pop("output_router_logits", None)
        moe["output_router_logits"] = self.config.output_router_logits if router_logits is None else router_logits
    outputs = self.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        inputs_embeds=inputs_embeds, use_cache=use_cache, **moe, **kwargs,
    )  # fmt: skip
    hidden_states = _keep_last(outputs.last_hidden_state, logits_to_keep)
    softcap = self.config.final_logit_softcapping if patch.logit_softcapping else None
    scaling = self.config.logits_scaling if patch.logits_scaling else None
    logits = loss = None
    if skip_logits:
        assert labels is not None
        loss = fused_causal_lm_loss(
            hidden_states if scaling is None else hidden_states / scaling, self.lm_head, labels, shift_labels=kwargs.get("shift_labels"),
            num_items_in_batch=kwargs.get("num_items_in_batch"), ignore_index=kwargs.get("ignore_index", -100),
            softcap=softcap, options=self.__dict__.get(LOSS_OPTIONS),
            weight=_TiedHeadWeight.apply(self.lm_head.weight, tied) if tied is not None else None,
        )  # fmt: skip
    else:
        logits = self.lm_head(hidden_states)
        if scaling is not None:  # as stock computes it
            logits = logits / scaling
        if softcap is not None:  # as stock computes it
            logits = torch.tanh(logits / softcap) * softcap
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    if moe:
        return _with_router_aux_loss(self, outputs, loss, logits, attention_mask, moe["output_router_logits"])
    return CausalLMOutputWithPast(
        loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )  # fmt: skip


def _tied_embedding(model: Any) -> bool:
    """Whether ``model`` (a causal LM on the fused path) hands its head's gradient to its input
    embedding (:class:`_TiedEmbedding`): the embedding is a plain ``torch.nn.Embedding`` (no
    subclass: Gemma's scales its output) without hooks (FSDP2's unsharding), ``max_norm`` or
    ``scale_grad_by_freq``, its weight is the head's, trainable and not sharded, and the head has
    no hooks either. Not while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return False
    embed = model.get_input_embeddings()
    if type(embed) is not torch.nn.Embedding or has_hooks(embed) or has_hooks(model.lm_head):
        return False
    if embed.max_norm is not None or embed.scale_grad_by_freq:
        return False
    weight = embed.weight
    return weight is getattr(model.lm_head, "weight", None) and weight.requires_grad and not _is_dtensor(weight)


class _TiedGradient:
    """Where the head's gradient of a tied weight waits for the embedding's backward."""

    __slots__ = ("dense",)

    def __init__(self) -> None:
        self.dense: torch.Tensor | None = None


class _TiedHeadWeight(torch.autograd.Function):
    """The head's alias of a tied weight: its gradient (dense) is left in ``tied``, not returned.
    The embedding's backward, which autograd runs after the loss's (the head reads what the
    embedding made), takes it from there."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tied: _TiedGradient) -> torch.Tensor:
        ctx.tied = tied
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.tied.dense = grad
        return None, None


class _TiedEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward returns the weight's whole gradient:
    the head's dense gradient left by :class:`_TiedHeadWeight`, with the rows of the looked-up tokens
    added in place (``index_add_``; the padding index's rows get none, as F.embedding's backward)."""

    @staticmethod
    def forward(
        ctx: Any, ids: torch.Tensor, weight: torch.Tensor, tied: _TiedGradient, padding_idx: int | None
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.tied, ctx.padding_idx, ctx.weight_shape = tied, padding_idx, weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        (ids,) = ctx.saved_tensors
        dense, ctx.tied.dense = ctx.tied.dense, None
        flat, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        if dense is None:  # the head's gradient never came (nothing of the loss reached it)
            dense = rows.new_zeros(ctx.weight_shape)
        return None, dense.index_add_(0, flat, rows.to(dense.dtype)), None, None


def _with_router_aux_loss(
    self: Any,
    outputs: Any,
    loss: torch.Tensor | None,
    logits: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    output_router_logits: bool,
) -> Any:
    """A mixture of experts' causal-LM output: the load-balancing loss of the routers' logits as
    stock computes it (the modeling module's ``load_balancing_loss_func``), added to ``loss``
    times ``router_aux_loss_coef`` when there is a loss."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    aux_loss = None
    if output_router_logits:
        # Looked up by apply_patch: an import here would break torch.compile's graph.
        load_balancing_loss_func = self.__dict__[_AUX_LOSS]
        aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                            attention_mask)  # fmt: skip
        if loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(
        loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions, router_logits=outputs.router_logits,
    )  # fmt: skip


# --- apply / revert -------------------------------------------------------------------------------


@functools.cache
def _revertible(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an fk forward), which calls the stock forward instead once :func:`revert` has switched
    it off: revert does that when someone else has wrapped fk's forward since (accelerate's
    autocast wrapper and TRL's fused head as an instance ``forward``, FSDP2's ``fully_shard`` as a
    subclass), since removing fk's would remove theirs too. A module fk did not patch (one built by
    calling a patched class) runs the stock forward too. One wrapper per ``fn``."""

    @functools.wraps(fn)  # the signature stays fn's: the Trainer inspects it
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _SWITCHED_OFF in self.__dict__ or _KIND not in self.__dict__:  # or built by type(module)(...)
            return stock_forward(self, _STOCK, *args, **kwargs)
        return fn(self, *args, **kwargs)

    return forward


@functools.cache
def _flce_forward() -> Callable[..., Any]:
    from transformers.utils import can_return_tuple

    return can_return_tuple(causal_lm_forward)


def _set_forward(module: torch.nn.Module, kind: str, fn: Callable[..., Any], patch: ModelPatch) -> None:
    module.__dict__[_KIND] = kind
    module.__dict__["_fk_hf_patch"] = patch
    swap_forward(module, _revertible(fn), _STOCK)


def is_patched(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself carries an fk.hf patch."""
    return _KIND in module.__dict__


def patched_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of ``model`` carry each kind of patch (``{"rms_norm": 5, ...}``)."""
    counts = dict.fromkeys(SWITCHES, 0)
    for module in model.modules():
        if is_patched(module):
            counts[module.__dict__[_KIND]] += 1
        if _RECOMPUTE in module.__dict__:
            counts["recompute_norms"] += 1
        report = module.__dict__.get(_LORA)
        if report is not None:
            counts["lora"] += report.n_patched
    return counts


def revert(model: torch.nn.Module) -> int:
    """Undo :func:`apply` on ``model`` (every submodule); returns how many modules were restored
    (each LoRA module whose forward fk.lora had swapped counts as one).

    A model that was never patched is left as it is (returns 0).
    """
    restored = 0
    for module in model.modules():
        if module.__dict__.pop(_LORA, None) is not None:
            import fk.lora

            restored += fk.lora.unpatch(module)
        if not is_patched(module):
            continue
        for key in (_KIND, "_fk_hf_patch", _AUX_LOSS, _GROUP, _RECOMPUTE):
            module.__dict__.pop(key, None)
        if restore_class(module):
            module.__dict__.pop(_STOCK, None)
        else:  # wrapped since by someone else (their subclass, or an instance forward): switch fk's off
            module.__dict__[_SWITCHED_OFF] = True
        restored += 1
    return restored


def has_lora_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds PEFT LoRA layers (``peft`` is not imported to find out: a model
    with PEFT layers has imported it already)."""
    import sys

    peft_lora = sys.modules.get("peft.tuners.lora.layer")
    layer = getattr(peft_lora, "LoraLayer", None)
    return layer is not None and any(isinstance(m, layer) for m in model.modules())


def _group_projections(attention: torch.nn.Module, patch: ModelPatch) -> None:
    """Give ``attention``'s ``q_proj``, ``k_proj`` and ``v_proj`` the ``qkv`` forward, as one
    shared-input group, where all three are plain ``nn.Linear`` layers fk has not patched and
    whose forward nobody replaced on the instance (see :func:`projections_forward`)."""
    members = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(m is not None and plain_linear(m) and not swapped(m) for m in members):
        return
    group = SharedInputGroup(members)  # type: ignore[arg-type]
    for index, member in enumerate(members):
        assert member is not None
        member.__dict__[_GROUP] = (group, index)
        _set_forward(member, "qkv", projections_forward, patch)


def apply_patch(model: torch.nn.Module, patch: ModelPatch, switches: dict[str, bool]) -> dict[str, int]:
    """Patch every module of ``model`` that ``patch`` and ``switches`` cover; see :func:`fk.hf.apply`.

    A model already patched is reverted first, so the switches of the latest call hold. Modules
    whose ``forward`` was already replaced on the instance by someone else (as accelerate's hooks
    do: it would shadow fk's), and modules whose class fk already swapped (fk.lora's, or an fk.hf
    forward that :func:`revert` switched off under another's wrapper), are left alone. With ``switches["lora"]``, :func:`fk.lora.patch` runs first on a
    model that has PEFT LoRA layers (see :func:`has_lora_layers`), so the modules it fuses (a
    LoRA MLP) carry its forward and are skipped here.
    """
    revert(model)
    if switches.get("lora", False) and has_lora_layers(model):
        import fk.lora

        model.__dict__[_LORA] = fk.lora.patch(model)
    norms, mlps = patch.classes(patch.rms_norm), patch.classes(patch.mlp)
    attentions, heads = patch.classes(patch.attention), patch.classes(patch.causal_lm)
    layer_norms = patch.classes(patch.layer_norm)
    for module in model.modules():
        if "forward" in module.__dict__ or swapped(module):
            continue
        if switches["rms_norm"] and isinstance(module, norms):
            _set_forward(module, "rms_norm", rms_norm_forward, patch)
        elif switches["layer_norm"] and isinstance(module, layer_norms):
            _set_forward(module, "layer_norm", layer_norm_forward, patch)
        elif isinstance(module, mlps) and (activation := _mlp_activation(module, patch)) is not None:
            if switches["swiglu"] and activation == "silu":
                _set_forward(module, "swiglu", swiglu_forward, patch)
            elif switches["geglu"] and activation in ("gelu_tanh", "gelu"):
                _set_forward(module, "geglu", geglu_forward, patch)
        elif isinstance(module, attentions):
            fn = _rope_forward(type(module).forward)
            if switches["rope"] and fn is not None:
                _set_forward(module, "rope", fn, patch)
            if switches["qkv"]:
                _group_projections(module, patch)
        elif (switches["add_norm"] and (add_norm := _add_norm_forward_for(type(module).forward)) is not None
              and isinstance(getattr(module, "post_attention_layernorm", None), norms)):  # fmt: skip
            _set_forward(module, "add_norm", add_norm, patch)
            if switches["recompute_norms"]:
                module.__dict__[_RECOMPUTE] = True
        elif switches["flce"] and isinstance(module, heads):
            _set_forward(module, "flce", _flce_forward(), patch)
            if patch.router_aux_loss:
                modeling = importlib.import_module(patch.modeling_module)
                module.__dict__[_AUX_LOSS] = modeling.load_balancing_loss_func
    return patched_modules(model)
