"""The forwards fk.hf gives single blocks: norms, gated MLPs, an attention's rotary embedding and
its q/k/v projections. Each reads what it needs of its module from the plan
:mod:`fk.hf.recognize` found for it (``module.__dict__[fk.hf.marks.PLAN]``), and runs the stock
forward wherever fk's would not compute the same (another dtype, hooks, autocast)."""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fk.core.forward import has_hooks, stock_forward
from fk.hf.functions import function_copy, rewrapped
from fk.hf.marks import GROUP, PLAN, STOCK
from fk.hf.sharding_hooks import is_dtensor, plain_linear

if TYPE_CHECKING:
    from fk.hf.recognize import NormPlan


def rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's forward through :func:`fk.norms.rms_norm`, with the casting, offset and
    epsilon its :class:`~fk.hf.recognize.NormPlan` found (the weight may be absent).

    Where the weight's dtype differs from the input's (stock then returns the weight's dtype, by
    type promotion), the stock forward runs instead.
    """
    from fk.norms import rms_norm

    weight = getattr(self, "weight", None)
    if weight is not None and weight.dtype != hidden_states.dtype:
        return stock_forward(self, STOCK, hidden_states)
    plan: NormPlan = self.__dict__[PLAN]
    eps = getattr(self, plan.eps_attr)
    out: torch.Tensor = rms_norm(hidden_states, weight, eps, casting_mode=plan.casting_mode, offset=plan.offset)
    return out


def layer_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm module's forward (``torch.nn.LayerNorm`` or a model's own, over the last
    dimension) through :func:`fk.norms.layer_norm`, with the module's weight and bias, either of
    which may be absent, and the epsilon its :class:`~fk.hf.recognize.NormPlan` found.

    Where the parameters' dtype differs from the input's (stock then returns the parameters' dtype,
    by type promotion), the stock forward runs.
    """
    from fk.norms import layer_norm

    weight, bias = getattr(self, "weight", None), getattr(self, "bias", None)
    if any(p is not None and p.dtype != x.dtype for p in (weight, bias)):
        return stock_forward(self, STOCK, x)
    plan: NormPlan = self.__dict__[PLAN]
    out: torch.Tensor = layer_norm(x, weight, bias, getattr(self, plan.eps_attr))
    return out


def swiglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP-style forward with the SiLU gate.

    Where :func:`whole_mlp` allows it, the whole MLP is :func:`fk.glu.gated_mlp`, which does not
    keep ``act(gate) * up`` for the backward. Otherwise ``down_proj(fk.glu.swiglu(gate_proj(x),
    up_proj(x)))``, with the gradients of the gate and up projections' outputs written into their
    own buffers (``inplace_grad=True``): they are intermediate activations nothing else reads.
    """
    from fk.glu import gated_mlp, swiglu, swiglu_fused

    if hasattr(self, "gate_up_proj"):  # one fused projection, gate first (Phi-3)
        return self.down_proj(swiglu_fused(self.gate_up_proj(x), inplace_grad=True))
    if whole_mlp(self, x):
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, "silu")
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), inplace_grad=True))


def geglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """GemmaMLP-style forward with the GELU gate (tanh-approximated or exact, as the module's
    activation is): :func:`fk.glu.gated_mlp` or :func:`fk.glu.geglu`, as in :func:`swiglu_forward`."""
    from fk.glu import gated_mlp, geglu, geglu_fused

    activation = self.__dict__[PLAN].activation
    approximate = "none" if activation == "gelu" else "tanh"
    if hasattr(self, "gate_up_proj"):
        return self.down_proj(geglu_fused(self.gate_up_proj(x), approximate, inplace_grad=True))
    if whole_mlp(self, x):
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return gated_mlp(x, *weights, activation)
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), approximate, inplace_grad=True))


def projections_forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The forward of an attention block's q, k or v projection (a plain ``nn.Linear``) under the
    ``qkv`` switch; the three form a :class:`fk.core.forward.SharedInputGroup`. The first one called
    computes all three with :func:`fk.hf.projections.linear_projections` (one ``dx`` accumulation in
    the backward) and returns its own output; the others, called next with the same tensor, take
    theirs. Where that would not compute exactly what their forwards do (see :func:`computes_as_stock`), or
    when called with more than the input, each runs its stock forward."""
    from fk.hf.projections import linear_projections

    group, index = self.__dict__[GROUP]
    if self is not group.members[index]:  # a copy (a DataParallel replica): it computes alone
        return stock_forward(self, STOCK, x, *args, **kwargs)
    if index == 0:
        group.pending.clear()
        if not group.split and not (args or kwargs) and computes_as_stock(group.members, x):
            weights = [m.weight for m in group.members]
            biases = [m.bias for m in group.members]
            return group.hand_out(x, linear_projections(x, weights, biases))
        return stock_forward(self, STOCK, x, *args, **kwargs)
    found, out = group.take(self, x, input_alone=not (args or kwargs))
    return out if found else stock_forward(self, STOCK, x, *args, **kwargs)


def computes_as_stock(modules: list[torch.nn.Module], x: Any) -> bool:
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
            if isinstance(p, torch.Tensor) and (p.dtype != x.dtype or p.device != x.device or is_dtensor(p)):
                return False
    return True


def whole_mlp(module: Any, x: torch.Tensor) -> bool:
    """Whether the gated MLP ``module`` can run as one :func:`fk.glu.gated_mlp` on ``x``: its three
    projections are plain ``nn.Linear`` layers without a bias (see :func:`plain_linear`, and no
    hooks at all, not even FSDP2's, whose unsharding only a module call runs; not LoRA or
    quantized layers), autocast is off for ``x``'s device, and ``x`` has the weights' dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return False
    for proj in (module.gate_proj, module.up_proj, module.down_proj):
        if not (plain_linear(proj) and proj.bias is None and not has_hooks(proj)):
            return False
        if proj.weight.dtype != x.dtype or is_dtensor(proj.weight):
            return False
    return True


# --- rotary embedding: fk.rope's drop-in for each form of Hugging Face's apply_rotary_pos_emb ---------
#
# Every form rotates pairs of features by the angles the model's rotary module tabulates; they differ
# in which features pair up and how the tables are laid out. Each function below takes Hugging Face's
# arguments (q, k, cos, sin, position_ids=None, unsqueeze_dim=1) and computes its form with
# fk.rope's one kernel; fk.hf.probe picks, per model, the first that equals the model's own function.


def rope_interleaved(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1) -> Any:
    """Cohere's: pairs ``(x[2i], x[2i+1])``, tables as given (each frequency repeated in place)."""
    from fk.rope import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved=True)


def rope_interleaved_halved(
    q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1
) -> Any:
    """GLM's (Helium's, ERNIE 4.5's): pairs ``(x[2i], x[2i+1])`` with the tables' first half, each
    entry repeated twice (``t[..., :d/2].repeat_interleave(2)``); features past the tables pass."""
    from fk.rope import apply_rotary_pos_emb

    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    return apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved=True)


def rope_negated_sine(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1) -> Any:
    """NanoChat's: ``rotate_half(x) = (x2, -x1)``, i.e. Llama's with the angle's sign flipped."""
    from fk.rope import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, -sin, position_ids, unsqueeze_dim)


def rope_half_tables(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1) -> Any:
    """GPT-OSS's: Llama's pairs with tables of one entry per pair (``d/2`` wide), i.e. Llama's
    with each table written twice."""
    from fk.rope import apply_rotary_pos_emb

    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)


@functools.cache
def one_tensor_form(variant: Callable[..., Any]) -> Callable[..., Any]:
    """``variant`` (one of the drop-ins above) in the one-tensor form Gemma 3n's and Gemma 4's
    ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` takes: x rotated as q, beside a k of no
    heads, which fk.rope leaves untouched (as :func:`fk.rope.rope_single` does). One function per
    variant, so that the patched attention class is made once."""

    def one_tensor(x: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        from fk.rope.rope import layout_of_unsqueeze_dim

        no_heads = x.narrow(1 if layout_of_unsqueeze_dim(unsqueeze_dim) == "bhsd" else 2, 0, 0)
        return variant(x, no_heads, cos, sin, None, unsqueeze_dim)[0]

    one_tensor.__qualname__ = one_tensor.__name__ = f"{variant.__name__}_one_tensor"
    return one_tensor


@functools.cache
def rope_variants() -> tuple[tuple[Callable[..., Any], bool], ...]:
    """The drop-ins in the order the probe tries them, each with whether the model's own function
    takes tables of one entry per pair (``d/2`` wide) rather than one per feature. First
    :func:`fk.rope.apply_rotary_pos_emb` itself: Llama's ``x cos + rotate_half(x) sin``, pairs
    ``(x[i], x[i + d/2])``, tables as given."""
    from fk.rope import apply_rotary_pos_emb

    return (
        (apply_rotary_pos_emb, False),
        (rope_interleaved, False),
        (rope_interleaved_halved, False),
        (rope_negated_sine, False),
        (rope_half_tables, True),
    )


@functools.cache
def rope_forward(
    stock: Callable[..., Any], replacements: tuple[tuple[str, Callable[..., Any]], ...]
) -> Callable[..., Any]:
    """A copy of ``stock`` (an attention forward) whose globals named in ``replacements`` (``(name,
    fk's function)`` pairs, e.g. ``apply_rotary_pos_emb``) are fk's, under the same wrappers (see
    :func:`fk.hf.functions.rewrapped`). One copy per ``stock`` and replacements (so the patched
    class is made once per attention class). :func:`fk.hf.recognize.rope_candidate` checked that the
    function under the wrappers reads those globals and that it can be rewrapped."""
    outer, inner = stock, inspect.unwrap(stock)  # (transformers 5.24 wraps it: renamed-argument deprecation)
    # The copy's globals are a module of their own, registered under its own name: torch.compile
    # finds an inlined function's globals through sys.modules[globals["__name__"]], and with the
    # modeling module's name it would guard on the stock apply_rotary_pos_emb (and fail).
    name = f"fk.hf.patched_globals.{inner.__module__}.{inner.__qualname__}"
    namespace = types.ModuleType(name)
    namespace.__dict__.update({k: v for k, v in inner.__globals__.items() if k not in ("__name__", "__spec__")})
    namespace.__dict__.update(replacements)
    sys.modules[name] = namespace
    copy = rewrapped(outer, function_copy(inner, namespace.__dict__, inner.__closure__))
    assert copy is not None  # (rope_candidate checked)
    return copy
