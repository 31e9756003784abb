"""Decoder-level fusion (the ``add_norm`` switch): a pre-norm decoder layer whose forward is
Llama's, compared by bytecode with the templates below, gets :func:`add_norm_forward`: the attention's
residual add inside the post-attention RMSNorm (one pass instead of an add kernel each way), the
MLP's residual add inside its down projection's matmul where the MLP runs as one
:func:`fk.glu.gated_mlp`, and the input norm handing the layer input on as the residual. Each norm
runs with its own plan (casting, offset, epsilon) as :mod:`fk.hf.probe` found it."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from fk.core.forward import has_hooks, is_forward_class, stock_forward
from fk.hf.blocks import computes_as_stock, whole_mlp
from fk.hf.functions import rewrapped, same_code
from fk.hf.marks import KIND, PLAN, RECOMPUTE, STOCK, SWITCHED_OFF
from fk.hf.recognize import NormPlan


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


def is_pre_norm_decoder(module: torch.nn.Module) -> bool:
    """Whether ``type(module).forward`` (under the wrappers ``transformers`` puts on it: gradient
    checkpointing, renamed-argument deprecation) is exactly :func:`_pre_norm_decoder_forward`, or
    its transformers 5.24 form with ``cache`` for ``past_key_values``. Llama, Mistral, Qwen2, Qwen3,
    Qwen3-MoE and Gemma decoder layers are."""
    return add_norm_forward_for(type(module).forward) is not None


@functools.cache
def add_norm_forward_for(stock: Callable[..., Any]) -> Callable[..., Any] | None:
    """The ``add_norm`` forward that replaces ``stock`` (a decoder layer's forward), under the same
    wrappers (see :func:`rewrapped`), or None when ``stock`` is not a pre-norm decoder forward."""
    inner = inspect.unwrap(stock)
    for template, forward in ((_pre_norm_decoder_forward, add_norm_forward),
                              (_pre_norm_decoder_forward_cache, add_norm_forward_cache)):  # fmt: skip
        if same_code(inner, template):
            return rewrapped(stock, forward)
    return None


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
        return stock_forward(self, STOCK, hidden_states, **attention_kwargs)
    plan: NormPlan = norm.__dict__[PLAN]
    recompute = RECOMPUTE in self.__dict__
    input_norm: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if _input_norm_hands_on(self.input_layernorm, hidden_states):
        input_plan: NormPlan = self.input_layernorm.__dict__[PLAN]
        eps = getattr(self.input_layernorm, input_plan.eps_attr)
        hidden_states, residual = rms_norm_and_input(
            hidden_states,
            self.input_layernorm.weight,
            eps,
            casting_mode=input_plan.casting_mode,
            offset=input_plan.offset,
        )
        if recompute:
            input_norm = recomputed(hidden_states, _rms_norm_of(residual, self.input_layernorm.weight, eps, input_plan))
    else:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    with input_norm:
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attention_kwargs)
    post_norm: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if isinstance(hidden_states, torch.Tensor) and hidden_states.dtype == residual.dtype:
        eps = getattr(norm, plan.eps_attr)
        hidden_states, residual = fused_add_rms_norm(
            hidden_states, residual, norm.weight, eps, casting_mode=plan.casting_mode, offset=plan.offset
        )
        if recompute:
            post_norm = recomputed(hidden_states, _rms_norm_of(residual, norm.weight, eps, plan))
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


def _rms_norm_of(x: torch.Tensor, weight: torch.Tensor, eps: float, plan: NormPlan) -> Callable[[], torch.Tensor]:
    """``fk.norms.rms_norm(x, weight, eps)`` with the norm's casting and offset, to be called
    later (in the backward, by :func:`fk.hf.recompute.recomputed`): the output that
    :func:`fk.norms.rms_norm_and_input` and :func:`fk.norms.fused_add_rms_norm` gave, formed again
    from the input they keep for their own backward."""
    from fk.norms import rms_norm

    return functools.partial(rms_norm, x, weight, eps, casting_mode=plan.casting_mode, offset=plan.offset)


def _add_norm_applies(norm: torch.nn.Module, x: Any) -> bool:
    """Whether ``fused_add_rms_norm`` computes what ``norm`` would on the layer input ``x``: the
    ``rms_norm`` switch patched it (its plan, probed, is an RMSNorm's), it has a weight and
    :func:`computes_as_stock` holds (stock's result then has ``x``'s dtype too). (The attention's
    output must have ``x``'s dtype too; :func:`add_norm_forward` checks that when it has it.)"""
    plan = norm.__dict__.get(PLAN)
    if not (
        isinstance(plan, NormPlan)
        and plan.kind == "rms_norm"
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
    ):
        return False
    return computes_as_stock([norm], x)


def _runs_fk_forward_alone(module: Any, kinds: tuple[str, ...]) -> bool:
    """Whether calling ``module`` would run the fk forward of one of ``kinds`` and nothing else:
    its class is the one fk set, with no forward on the instance, no hooks and the patch not
    switched off."""
    if module.__dict__.get(KIND) not in kinds or SWITCHED_OFF in module.__dict__ or "forward" in module.__dict__:
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
    forward on the instance, no hooks and the patch not switched off; :func:`whole_mlp` holds on
    ``x``; and ``residual`` has the output's shape and ``x``'s dtype. Not while ``torch.compile``
    traces (the class check reads a class's ``__dict__``, which dynamo does not trace; the compiler
    fuses the add itself)."""
    if torch.compiler.is_compiling():
        return None
    if not _runs_fk_forward_alone(mlp, ("swiglu", "geglu")) or hasattr(mlp, "gate_up_proj"):
        return None
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor) and whole_mlp(mlp, x)):
        return None
    if residual.dtype != x.dtype or residual.shape != (*x.shape[:-1], mlp.down_proj.weight.shape[0]):
        return None
    activation: str = mlp.__dict__[PLAN].activation
    return activation
