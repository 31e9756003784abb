"""Recognize the blocks fk can replace by what they are, not by the model's name.

Each ``*_plan`` function looks at one module (or one forward function) and answers with a plan (what
fk's forward needs to know: a norm's epsilon attribute, casting and offset; an MLP's activation; the
attention's rotary function; the head's extras), a :class:`Refusal` (a candidate fk will not
patch, and why), or None (not a candidate of that kind at all). Structure proposes; the probe
(:mod:`fk.hf.probe`) decides: every plan comes from, or is checked by, running stock and fk on a
small input.

- **Norms**: a module without children whose only parameters are a 1-D ``weight`` and ``bias``
  (either may be absent), with no buffers, a float epsilon attribute (:data:`EPS_ATTRS`) and a
  forward of one argument. Which norm it is (RMSNorm with offset 0 or 1, or LayerNorm) is what
  agrees with stock on the probe; Llama's casting (normalize in fp32, cast, times weight) or
  Gemma's (all in fp32) is the one whose reference equals stock bit for bit in bf16.
- **Gated MLPs**: a module with ``down_proj`` and ``gate_proj`` + ``up_proj`` (or one fused
  ``gate_up_proj``, gate first) child modules and an activation attribute (:data:`ACT_ATTRS`)
  that computes, on a test vector, SiLU, tanh-GELU or exact GELU.
- **Rotary embedding**: an attention forward that reads a global ``apply_rotary_pos_emb`` whose
  signature is Hugging Face's, ``(q, k, cos, sin, ...)``, or the one-tensor form ``(x, cos, sin,
  unsqueeze_dim)`` (Gemma 3n, Gemma 4), and whose values equal fk.rope's on random q, k, cos and
  sin (full and partial rotary).
- **The causal-LM head**: a module with an ``lm_head`` whose forward (under transformers'
  decorators) takes Llama's arguments, and others only to hand them to its decoder unchanged
  (:func:`handed_to_decoder`: GPT-2's ``token_type_ids``, Gemma 4's ``per_layer_inputs``), and
  reads nothing beyond :data:`HEAD_NAMES`; what it reads tells its extras (final logit
  softcapping, a logit scale or divisor, a mixture of experts' load-balancing loss, the BART
  family's unshifted ``CrossEntropyLoss()``). The probe
  compares the model's loss, stock and fk.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import operator
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fk.hf.functions import rewrapped

EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "layer_norm_epsilon")
"""Names a norm module keeps its epsilon under, in the order they are looked for."""
ACT_ATTRS = ("act_fn", "activation_fn", "act", "activation")
"""Names a gated MLP keeps its activation under."""
ROPE_FUNCTION = "apply_rotary_pos_emb"
ROPE_PARAMETERS = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")
"""Hugging Face's ``apply_rotary_pos_emb`` parameters: the first four, then any of the last two."""
ROPE_ONE_TENSOR_PARAMETERS = ("x", "cos", "sin", "unsqueeze_dim")
"""Those of the one-tensor form (Gemma 3n's and Gemma 4's, which rotate q and k in separate calls):
the first three, then optionally the last."""


class Refusal(NamedTuple):
    """A candidate block fk leaves stock: the switch it would have fallen under, and why."""

    kind: str
    reason: str


@dataclass(frozen=True)
class NormPlan:
    kind: str
    """``"rms_norm"`` or ``"layer_norm"``."""
    eps_attr: str
    casting_mode: str = "llama"
    offset: float = 0.0


@dataclass(frozen=True)
class MlpPlan:
    kind: str
    """``"swiglu"`` or ``"geglu"``."""
    activation: str
    """fk.glu's name: ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``."""


@dataclass(frozen=True)
class HeadPlan:
    backbone: str
    """The attribute of the decoder the head's forward calls (``"model"``), or its path (OPT's
    ``"model.decoder"``)."""
    cache_arg: str
    """What the forward and the decoder call the key/value cache: ``"cache"`` (transformers 5.24)
    or ``"past_key_values"``."""
    output_class: type
    output_fields: tuple[str, ...]
    """The output class's fields (a ``ModelOutput`` dataclass), read once here: ``torch.compile``
    does not trace ``dataclasses.fields``."""
    softcap: bool
    """``logits = c * tanh(logits / c)`` with ``c = config.final_logit_softcapping`` (when set)."""
    divide_by_config: bool
    """``logits = logits / config.logits_scaling`` (Granite)."""
    multiply_by_logit_scale: bool
    """``logits = logits * self.logit_scale`` (Cohere)."""
    multiply_by_head_multiplier: bool
    """``logits = logits * self.<backbone>.lm_head_multiplier`` (Falcon-H1)."""
    router_logits_arg: bool
    """The forward takes ``output_router_logits`` (else the config's is used, where read)."""
    aux_loss: Callable[..., Any] | None
    """The modeling module's ``load_balancing_loss_func``, where the forward adds it to the loss."""
    aux_loss_weight: str = "router_aux_loss_coef"
    """The head's attribute that weighs it (JetMoe's: ``aux_loss_coef``)."""
    positional: tuple[str, ...] = ()
    """The stock forward's parameters in order (after ``self``): positional arguments bind to these
    in fk's forward too (GPT-2's second is the cache, Llama's the attention mask)."""
    handed_on: tuple[str, ...] = ()
    """Llama's arguments beyond those fk's head always hands to the decoder that the stock forward
    hands it too (:func:`head_args_handed_on`): ``labels``, ``logits_to_keep`` (then the head slices
    only what the decoder left whole)."""
    logits_to_keep: bool = True
    """The forward takes ``logits_to_keep`` (where it does not, fk's head keeps every position and
    leaves one given to where stock's goes, its ``**kwargs``)."""
    position_ids: bool = True
    """The forward takes ``position_ids`` and hands them to the decoder (Bloom's, MPT's and Mamba's
    take none: fk's head hands none either)."""
    cast_to_head: bool = False
    """The stock forward casts the hidden states to the head weight's dtype,
    ``self.lm_head(h.to(self.lm_head.weight.dtype))`` (Mamba's; HunYuan V4's, whose head is fp32):
    fk's head casts the same."""
    float_logits: bool = False
    """It takes the logits in fp32, ``self.lm_head(...).float()`` (Mamba's): so do fk's (its fused
    loss is fp32 inside)."""
    multiply_by_output_multiplier: bool = False
    """``logits = logits * text_config.output_multiplier`` (Muse Glimmer, before its soft cap)."""
    vocab_from_head: bool = False
    """The loss's vocabulary size is the head's ``out_features`` (Apertus 1.5's output vocabulary),
    not the config's ``vocab_size``."""
    decoder_return_dict: bool = False
    """The stock forward hands its ``return_dict`` to the decoder (Falcon's, GPT-Neo's): fk's asks the
    decoder for its output object (``return_dict=True``) and answers ``return_dict`` itself, as
    Llama's does (``transformers.utils.can_return_tuple``)."""
    unshifted_labels: bool = False
    """The stock forward scores position t against ``labels[:, t]`` (no shift) with a fresh
    ``CrossEntropyLoss()``, the mean over the labels that are not -100, ``num_items_in_batch``,
    ``shift_labels`` and ``ignore_index`` not read (the BART family's decoders,
    :func:`unshifted_cross_entropy`): so does fk's."""


# --- norms ---------------------------------------------------------------------------------------


def norm_candidate(module: torch.nn.Module) -> str | Refusal | None:
    """The epsilon attribute of a norm-shaped ``module`` (see the module docstring), a Refusal,
    or None when it is not norm-shaped."""
    if next(module.children(), None) is not None or next(module.buffers(recurse=False), None) is not None:
        return None
    eps_attr = next((a for a in EPS_ATTRS if isinstance(getattr(module, a, None), float)), None)
    if eps_attr is None:
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or any(p.ndim != 1 for p in params.values()):
        return None
    if isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm) and len(module.normalized_shape) != 1:
        return Refusal("layer_norm", "normalizes over more than the last dimension")
    if isinstance(module, torch.nn.GroupNorm):
        return None
    if not takes_one_input(type(module).forward):
        return Refusal("rms_norm", "its forward takes more than the input")
    return eps_attr


def takes_one_input(forward: Callable[..., Any]) -> bool:
    """Whether ``forward`` (a module's, with ``self``) takes exactly one argument besides ``self``."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


# --- gated MLPs ----------------------------------------------------------------------------------

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}


def mlp_candidate(module: torch.nn.Module) -> MlpPlan | Refusal | None:
    """The plan of a gated MLP (see the module docstring), a Refusal, or None when ``module`` has
    not a gated MLP's projections."""
    children = dict(module.named_children())
    projections = ("gate_up_proj", "down_proj") if "gate_up_proj" in children else ("gate_proj", "up_proj", "down_proj")
    if not all(isinstance(getattr(children.get(n), "weight", None), torch.Tensor) for n in projections):
        return None
    if not takes_one_input(type(module).forward):
        return Refusal("swiglu", "its forward takes more than the input")
    act = next((getattr(module, a) for a in ACT_ATTRS if callable(getattr(module, a, None))), None)
    if act is None:
        return Refusal("swiglu", "no activation attribute (act_fn) found")
    name = activation_name(act)
    if name is None:
        return Refusal("swiglu", f"activation {type(act).__name__}: no fk kernel")
    return MlpPlan("swiglu" if name == "silu" else "geglu", name)


def activation_name(act: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """Which of fk.glu's activations ``act`` computes on a test vector (to fp32 rounding), or None."""
    if isinstance(act, torch.nn.Module) and next(act.parameters(), None) is not None:
        return None
    t = torch.linspace(-6.0, 6.0, 97, device="cpu")  # (explicit: a model built under torch.device("meta"))
    try:
        with torch.no_grad():
            got = act(t)
    except Exception:
        return None
    for name, fn in _ACTIVATIONS.items():
        if isinstance(got, torch.Tensor) and got.shape == t.shape and torch.allclose(got, fn(t), atol=1e-6, rtol=1e-5):
            return name
    return None


# --- rotary embedding ----------------------------------------------------------------------------


def rope_candidate(stock: Callable[..., Any]) -> Callable[..., Any] | Refusal | None:
    """The global rotary function an attention forward ``stock`` calls (see the module docstring),
    a Refusal, or None when it calls none."""
    inner = inspect.unwrap(stock)
    if not isinstance(inner, types.FunctionType) or ROPE_FUNCTION not in inner.__code__.co_names:
        return None
    fn = inner.__globals__.get(ROPE_FUNCTION)
    if not callable(fn):
        return Refusal("rope", f"{ROPE_FUNCTION} is not a function in its module")
    if rewrapped(stock, inner) is None:
        return Refusal("rope", "the attention's forward is wrapped in a way fk cannot re-wrap")
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return Refusal("rope", f"{ROPE_FUNCTION} has no signature")
    hugging_faces = names[:4] == ROPE_PARAMETERS[:4] and set(names[4:]) <= set(ROPE_PARAMETERS[4:])
    if not hugging_faces and not rope_takes_one_tensor(fn):
        return Refusal("rope", f"{ROPE_FUNCTION} takes ({', '.join(names)}), not Hugging Face's arguments")
    return fn


def rope_takes_one_tensor(fn: Callable[..., Any]) -> bool:
    """Whether a model's ``apply_rotary_pos_emb`` is the one-tensor form (:data:`ROPE_ONE_TENSOR_PARAMETERS`)."""
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == ROPE_ONE_TENSOR_PARAMETERS[:3] and set(names[3:]) <= set(ROPE_ONE_TENSOR_PARAMETERS[3:])


# --- the causal-LM head --------------------------------------------------------------------------

HEAD_ARGS = {"input_ids", "attention_mask", "inputs_embeds", "labels", "use_cache"}
"""What a causal LM's forward takes (besides ``self``, the cache and ``output_router_logits``)."""
HEAD_ARGS_OPTIONAL = {"position_ids", "return_dict", "logits_to_keep"}
"""What it may take or not (:attr:`HeadPlan.position_ids`, :attr:`HeadPlan.decoder_return_dict`,
:attr:`HeadPlan.logits_to_keep`): the older heads (Bloom, Falcon, GPT-Neo, MPT, Mamba) take
``return_dict`` by name, some no ``position_ids``; some take no ``logits_to_keep`` (the Qwen-Omni
thinkers, MiniCPM-V 4.6, VideoLLaMA 3: their logits cover every position)."""
HEAD_NAMES = {
    "last_hidden_state", "slice_logits_to_keep", "lm_head", "loss_function", "config", "vocab_size",
    "cache", "past_key_values", "hidden_states", "attentions", "router_logits", "output_router_logits",
    "to", "device", "float", "torch", "tanh", "final_logit_softcapping", "logits_scaling", "logit_scale",
    "load_balancing_loss_func", "num_experts", "num_experts_per_tok", "router_aux_loss_coef", "cross_attentions",
    "shared_kv_states", "image_outputs", "video_outputs", "text_config", "get_text_config", "aux_loss_coef",
    "lm_head_multiplier", "return_dict", "use_return_dict", "contiguous", "pad_token_id", "output_multiplier",
    "out_features",
}  # fmt: skip
"""The names Llama's causal-LM forward reads, and those of the extras fk's head computes too; the
decoder's outputs its output takes over by name, as fk's does (GPT-2's ``cross_attentions``,
Gemma 4's ``shared_kv_states``, a vision-language model's ``image_outputs`` and ``video_outputs``);
a composite config's text config, where a vision-language head reads the vocabulary size and the
extras, as fk's head does (``config.get_text_config()``); the older heads' ``return_dict``, the
``contiguous()`` OPT's takes of its logits, and the ``pad_token_id`` XGLM's hands its loss function
(whose default, ``ForCausalLMLoss``, ignores it, as fk's loss does); Muse Glimmer's
``output_multiplier`` and Apertus 1.5's ``out_features`` (:class:`HeadPlan`)."""


@functools.cache
def _source_tree(forward: types.FunctionType) -> ast.Module | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None


def _handed_on(tree: ast.Module, backbone: str) -> dict[int, str]:
    """The names ``self.<backbone>(...)`` is called with as keywords of their own name
    (``name=name``), by the ``id`` of the node read."""
    return {
        id(keyword.value): keyword.arg
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == f"self.{backbone}"
        for keyword in call.keywords
        if isinstance(keyword.value, ast.Name) and keyword.value.id == keyword.arg
    }  # fmt: skip


def called_backbone(forward: types.FunctionType, module: torch.nn.Module, backbone: str) -> str:
    """The decoder's path from the head: ``backbone``, or ``backbone.<child>`` where ``forward``
    calls a child module of it and nothing else of it (OPT's ``self.model.decoder(...)``); read from
    the source."""
    tree = _source_tree(forward)
    if tree is None:
        return backbone
    called = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    on_backbone = {c for c in called if c == f"self.{backbone}" or c.startswith(f"self.{backbone}.")}
    if len(on_backbone) == 1:
        path = on_backbone.pop().removeprefix("self.")
        if path.count(".") == 1 and isinstance(operator.attrgetter(path)(module), torch.nn.Module):
            return path
    return backbone


def handed_to_decoder(forward: types.FunctionType, backbone: str, decoder: torch.nn.Module, names: set[str]) -> set[str]:  # fmt: skip
    """Those of the arguments ``names`` that ``forward`` (a causal LM's, unwrapped) reads only to
    hand them on, under their own name, to ``self.<backbone>(...)``, and that the decoder's forward
    takes: fk's head hands them on the same way (its ``**kwargs``). Read from the source; none
    where there is no source."""
    tree = _source_tree(forward)
    if tree is None:
        return set()
    handing = _handed_on(tree, backbone)
    reads: dict[str, list[bool]] = {name: [] for name in names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in reads:
            reads[node.id].append(id(node) in handing)
    return {name for name, handed in reads.items() if handed and all(handed) and decoder_takes(decoder, name)}


def decoder_takes(decoder: torch.nn.Module, name: str) -> bool:
    """Whether the decoder's forward takes an argument ``name``, by name or as one of its ``**kwargs``."""
    takes = inspect.signature(type(decoder).forward).parameters
    return name in takes or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())


def head_candidate(module: torch.nn.Module) -> HeadPlan | Refusal | None:
    """The plan of a causal LM's head (see the module docstring), a Refusal, or None when
    ``module`` has no ``lm_head`` and ``config``."""
    if not isinstance(getattr(module, "lm_head", None), torch.nn.Module) or not hasattr(module, "config"):
        return None
    inner = inspect.unwrap(type(module).forward)
    if not isinstance(inner, types.FunctionType):
        return Refusal("flce", "its forward is not a Python function")
    code = inner.__code__
    args = set(code.co_varnames[1 : code.co_argcount])
    cache_arg = "cache" if "cache" in args else "past_key_values"
    backbones = [n for n in code.co_names if isinstance(getattr(module, n, None), torch.nn.Module) and n != "lm_head"]
    extra_args = args - HEAD_ARGS - HEAD_ARGS_OPTIONAL - {cache_arg, "output_router_logits"}
    missing = HEAD_ARGS - args
    handed_on: tuple[str, ...] = ()
    return_dict_handed = False
    if len(backbones) == 1:  # (fk's forward hands its keyword arguments to the decoder)
        backbones = [called_backbone(inner, module, backbones[0])]
        decoder = operator.attrgetter(backbones[0])(module)
        extra_args -= handed_to_decoder(inner, backbones[0], decoder, extra_args)
        if decoder_takes(decoder, "use_cache"):  # (stock's **kwargs hand it on, as fk's head does by name)
            missing.discard("use_cache")
        handed_on = head_args_handed_on(inner, backbones[0], decoder)
        return_dict_handed = "return_dict" in args and "return_dict" in handed_names(inner, backbones[0])
    if extra_args or missing:
        differences = ", ".join([*sorted(extra_args), *(f"no {a}" for a in sorted(missing))])
        return Refusal("flce", f"its forward takes other arguments than Llama's ({differences})")
    outputs = [n for n in code.co_names if _is_output_class(inner.__globals__.get(n))]
    keeps = {"shape"} if "logits_to_keep" in handed_on else set()
    unshifted = unshifted_cross_entropy(inner)
    keeps |= {"CrossEntropyLoss", "view"} if unshifted else set()
    cast_to_head, float_logits = head_call_casts(inner)
    keeps |= {"dtype", "weight"} if cast_to_head else set()
    read_by_name = attributes_read_by_getattr(inner)  # (PaliGemma's softcap: getattr(config, "final_...", None))
    by_name = {"getattr"} if read_by_name is not None and read_by_name <= HEAD_NAMES else set()
    path = {part for backbone in backbones for part in backbone.split(".")}
    unknown = set(code.co_names) - HEAD_NAMES - path - set(outputs) - keeps - by_name
    if len(backbones) != 1 or len(outputs) != 1 or unknown:
        what = sorted(unknown) or backbones or outputs
        return Refusal("flce", f"its forward reads what fk's head does not compute ({', '.join(what)})")
    names = set(code.co_names) | (read_by_name or set())
    aux = inner.__globals__.get("load_balancing_loss_func") if "load_balancing_loss_func" in names else None
    return HeadPlan(
        backbone=backbones[0], cache_arg=cache_arg, output_class=inner.__globals__[outputs[0]],
        output_fields=tuple(f.name for f in dataclasses.fields(inner.__globals__[outputs[0]])),
        softcap="final_logit_softcapping" in names, divide_by_config="logits_scaling" in names,
        multiply_by_logit_scale="logit_scale" in names, multiply_by_head_multiplier="lm_head_multiplier" in names,
        router_logits_arg="output_router_logits" in args, aux_loss=aux,
        aux_loss_weight="aux_loss_coef" if "aux_loss_coef" in names else "router_aux_loss_coef",
        positional=code.co_varnames[1 : code.co_argcount], handed_on=handed_on,
        position_ids="position_ids" in args, decoder_return_dict=return_dict_handed, cast_to_head=cast_to_head,
        float_logits=float_logits, multiply_by_output_multiplier="output_multiplier" in names,
        vocab_from_head="out_features" in names, unshifted_labels=unshifted,
        logits_to_keep="logits_to_keep" in args,
    )  # fmt: skip


HEAD_DTYPE = "self.lm_head.weight.dtype"
"""The head's dtype as a forward's source spells it (:func:`head_call_casts`)."""


def head_call_casts(forward: types.FunctionType) -> tuple[bool, bool]:
    """How ``forward`` calls its head, read from its source: whether every call casts its input
    to the head weight's dtype (``self.lm_head(h.to(self.lm_head.weight.dtype))``, the dtype
    positional or by name), and whether every call's logits are taken ``.float()``."""
    tree = _source_tree(forward)
    if tree is None:
        return False, False
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.lm_head"]
    floats = {id(node.func.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and node.func.attr == "float" and not node.args}  # fmt: skip

    def casts(call: ast.Call) -> bool:
        if len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Call):
            return False
        to = call.args[0]
        dtypes = [*to.args, *(k.value for k in to.keywords if k.arg == "dtype")]
        one_dtype = len(to.args) + len(to.keywords) == 1 and len(dtypes) == 1
        return one_dtype and ast.unparse(to.func).endswith(".to") and ast.unparse(dtypes[0]) == HEAD_DTYPE

    return bool(calls) and all(map(casts, calls)), bool(calls) and all(id(call) in floats for call in calls)


UNSHIFTED_LOSS = ("loss_fct = CrossEntropyLoss()", "loss_fct(logits.view(-1, self.config.vocab_size), labels.view(-1))")
"""The BART family's loss as its causal LMs' forwards spell it (:func:`unshifted_cross_entropy`)."""


def unshifted_cross_entropy(forward: types.FunctionType) -> bool:
    """Whether ``forward`` computes its loss as the BART family's causal LMs do, read from its
    source: :data:`UNSHIFTED_LOSS`, torch's ``CrossEntropyLoss`` made with no arguments (the mean,
    -100 ignored) and called once on the logits and labels unshifted, and neither called otherwise."""
    tree = _source_tree(forward)
    if tree is None or forward.__globals__.get("CrossEntropyLoss") is not torch.nn.CrossEntropyLoss:
        return False
    made, called = UNSHIFTED_LOSS
    nodes = list(ast.walk(tree))
    assigned = [ast.unparse(node) for node in nodes if isinstance(node, ast.Assign)]
    calls = [ast.unparse(node) for node in nodes if isinstance(node, ast.Call)
             and ast.unparse(node.func) in ("loss_fct", "CrossEntropyLoss")]  # fmt: skip
    return assigned.count(made) == 1 and sorted(calls) == sorted([made.partition(" = ")[2], called])


def attributes_read_by_getattr(forward: types.FunctionType) -> set[str] | None:
    """The attribute names ``forward`` reads as ``getattr(obj, "name", ...)`` with a constant name;
    None where it calls ``getattr`` otherwise, or has no source."""
    tree = _source_tree(forward)
    if tree is None:
        return None
    names: set[str] = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "getattr":
            if (
                len(call.args) < 2
                or not isinstance(call.args[1], ast.Constant)
                or not isinstance(call.args[1].value, str)
            ):
                return None
            names.add(call.args[1].value)
    return names


def head_args_handed_on(forward: types.FunctionType, backbone: str, decoder: torch.nn.Module) -> tuple[str, ...]:
    """Those of ``labels`` and ``logits_to_keep`` that ``forward`` (a causal LM's, unwrapped) hands
    to its decoder under their own name and the decoder takes: fk's head hands them on too. Gemma 3's
    and Gemma 4's multimodal decoders read ``labels`` (training makes their image tokens attend both
    ways); Gemma 4's decoder drops the positions ``logits_to_keep`` leaves out itself (before its
    KV-shared layers), and its head slices only hidden states still as long as the input, which is
    what it reads ``shape`` for."""
    handed = handed_names(forward, backbone)
    return tuple(name for name in ("labels", "logits_to_keep") if name in handed and decoder_takes(decoder, name))


def handed_names(forward: types.FunctionType, backbone: str) -> set[str]:
    """The names ``forward`` hands to ``self.<backbone>(...)`` as keywords of their own name; none
    where it has no source."""
    tree = _source_tree(forward)
    return set() if tree is None else set(_handed_on(tree, backbone).values())


def _is_output_class(obj: Any) -> bool:
    if not isinstance(obj, type):
        return False
    from transformers.utils import ModelOutput

    return issubclass(obj, ModelOutput)
