"""fk.hf: the fk meta-package's Hugging Face integration.

- :func:`apply` patches a built ``transformers`` model in place with fk's kernels (and a PEFT
  model's LoRA layers with fk.lora), or, given a model type (``"llama"``), the family's classes so
  that models built afterwards come out patched; :func:`revert` undoes either. Supported
  families: :func:`supported_model_types` (see :mod:`fk.hf.models`).
- :class:`AutoModelForCausalLM`: ``from_pretrained`` / ``from_config`` as transformers', the model
  returned already patched (switches in ``fk_options``).
- With the ``transformers`` Trainer or TRL's ``SFTTrainer``: ``callbacks=[fk.hf.FkCallback()]``
  (see :mod:`fk.hf.trainer`), or ``model_init=fk.hf.model_init(make_model)``.
- ``python -m fk.hf.demo`` trains a small Llama stock and patched, side by side (:mod:`fk.hf.demo`,
  on the helpers of :mod:`fk.hf.training`); ``python -m fk.hf.check`` runs every installed fk
  kernel against its reference.

Importing fk.hf imports neither ``transformers`` nor any kernel: that happens when a model is
patched (``pip install "fk[hf]"`` brings ``transformers``), or when ``fk.hf.FkCallback`` is
first used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

from fk.hf.auto import AutoModelForCausalLM
from fk.hf.patching import OFF_BY_DEFAULT, SWITCHES, ModelPatch, patched_modules

if TYPE_CHECKING:
    from fk.hf.trainer import FkCallback

__all__ = [
    "SWITCHES",
    "AutoModelForCausalLM",
    "FkCallback",
    "apply",
    "loss_options",
    "model_init",
    "patched_classes",
    "patched_modules",
    "revert",
    "supported_model_types",
]


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values :func:`apply` patches, sorted."""
    from fk.hf.models import REGISTRY

    return sorted(REGISTRY)


def _patch_for(model_type: str) -> ModelPatch:
    """The family's :class:`~fk.hf.patching.ModelPatch`; ``ValueError`` naming the supported ones."""
    from fk.hf.models import REGISTRY

    patch = REGISTRY.get(model_type)
    if patch is None:
        raise ValueError(
            f"fk.hf does not support model type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return patch


def _check_switches(switches: dict[str, Any]) -> dict[str, bool]:
    """``switches`` with every one of :data:`SWITCHES` (true unless given, or false unless given
    for those in :data:`OFF_BY_DEFAULT`); ``TypeError`` for an unknown name or a value that is not
    a bool."""
    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise TypeError(f"unknown fk.hf switch(es) {', '.join(unknown)}; the switches are {', '.join(SWITCHES)}")
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return {name: switches.get(name, name not in OFF_BY_DEFAULT) for name in SWITCHES}


@overload
def apply(
    model: str, *, rms_norm: bool = ..., layer_norm: bool = ..., swiglu: bool = ..., geglu: bool = ...,
    rope: bool = ..., qkv: bool = ..., add_norm: bool = ..., flce: bool = ..., lora: bool = ...,
    recompute_norms: bool = ...,
) -> list[str]: ...  # fmt: skip
@overload
def apply(
    model: Any, *, rms_norm: bool = ..., layer_norm: bool = ..., swiglu: bool = ..., geglu: bool = ...,
    rope: bool = ..., qkv: bool = ..., add_norm: bool = ..., flce: bool = ..., lora: bool = ...,
    recompute_norms: bool = ...,
) -> dict[str, int]: ...  # fmt: skip
def apply(
    model: Any,
    *,
    rms_norm: bool = True,
    layer_norm: bool = True,
    swiglu: bool = True,
    geglu: bool = True,
    rope: bool = True,
    qkv: bool = True,
    add_norm: bool = True,
    flce: bool = True,
    lora: bool = True,
    recompute_norms: bool = False,
) -> dict[str, int] | list[str]:
    """Patch the built Hugging Face model ``model`` in place with fk's kernels, or (``model`` a
    model type) the family's classes.

    Args:
        model: a ``transformers`` model (``LlamaForCausalLM``, ``LlamaModel``, a ``PeftModel``
            around one, ...) whose ``config.model_type`` is one of :func:`supported_model_types`;
            or one of those model types as a string (``"llama"``): every ``PreTrainedModel``
            class of that family's modeling module is patched so that each model built
            afterwards (constructor, ``from_config``, ``from_pretrained``) is patched with these
            switches as it is built (see :mod:`fk.hf.classes`); returns the class names then.
            :func:`revert` with the same string restores the classes.
        rms_norm: RMSNorm modules run :func:`fk.norms.rms_norm` (same weight and eps; Gemma's
            ``1 + weight`` and fp32 casting).
        layer_norm: ``torch.nn.LayerNorm`` modules of a family that uses them (StableLM) run
            :func:`fk.norms.layer_norm` (same weight, bias and eps).
        swiglu: gated MLPs with a SiLU activation run :func:`fk.glu.swiglu` between their
            projections.
        geglu: gated MLPs with a GELU activation (Gemma's tanh approximation, or exact) run
            :func:`fk.glu.geglu` between their projections.
        rope: attention modules apply the rotary embedding with :func:`fk.rope.apply_rotary_pos_emb`.
        qkv: an attention block's ``q_proj``, ``k_proj`` and ``v_proj`` (plain ``nn.Linear``
            layers) run as one :func:`fk.hf.projections.linear_projections` call, whose backward
            accumulates the input's gradient in one buffer instead of adding three (see
            :func:`fk.hf.patching.projections_forward`); its count is the number of projections.
        add_norm: pre-norm decoder layers whose forward is Llama's (Llama, Mistral, Qwen2, Qwen3,
            Qwen3-MoE, Gemma) add the attention's output to the residual stream inside the
            post-attention RMSNorm (:func:`fk.norms.fused_add_rms_norm`: one pass forward and one
            backward instead of an add kernel each way besides the norm's); counts the layers.
        flce: the causal-LM forward computes the loss with :func:`fk.flce.linear_cross_entropy`
            when labels are given in training mode, and returns ``logits=None`` then; pass
            ``skip_logits=False`` to the forward to get the logits (and stock's loss) anyway. See
            :func:`fk.hf.patching.causal_lm_forward`. Gemma 2 and 3's final logit softcapping is
            passed to the loss.
        lora: on a PEFT model (``peft.PeftModel``, or a model with PEFT LoRA layers injected),
            :func:`fk.lora.patch` fuses its LoRA layers too (a LoRA-wrapped MLP then runs
            :func:`fk.lora.lora_mlp` instead of the ``swiglu``/``geglu`` patch); no effect on a
            model without LoRA layers. Frozen base weights (norms, LM head) get no gradient: fk's
            kernels compute only the gradients that ``requires_grad`` asks for.
        recompute_norms: off by default. In the decoder layers ``add_norm`` patches, the two
            RMSNorm outputs are formed again in the backward from the norms' inputs instead of
            kept from the forward (see :mod:`fk.hf.recompute`): two ``[tokens, hidden]``
            activations less per layer, for two norm forward passes in the backward. Not under
            ``torch.compile``, nor with activation checkpointing or offloading (whose
            saved-tensor hooks it would shadow); there it does nothing.

    Only modules are patched (each one's class swapped for a subclass with fk's ``forward``, see
    :mod:`fk.hf.patching`): parameters, buffers and the
    ``state_dict`` are unchanged, and other models of the same classes are not affected. Calling
    ``apply`` again replaces the previous patch. Returns how many modules each switch patched
    (``lora``: how many fused LoRA units, see :mod:`fk.hf.patching`).

    Raises ``ValueError`` for a model type fk.hf does not support, naming the supported ones.
    """
    from fk.hf.patching import apply_patch

    switches = _check_switches(
        {
            "rms_norm": rms_norm,
            "layer_norm": layer_norm,
            "swiglu": swiglu,
            "geglu": geglu,
            "rope": rope,
            "qkv": qkv,
            "add_norm": add_norm,
            "flce": flce,
            "lora": lora,
            "recompute_norms": recompute_norms,
        }
    )
    if isinstance(model, str):
        from fk.hf.classes import patch_classes

        return patch_classes(_patch_for(model), switches)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise TypeError(f"model must be a Hugging Face model with a config.model_type, got {type(model).__name__}")
    return apply_patch(model, _patch_for(model_type), switches)


def revert(model: Any) -> int:
    """Undo :func:`apply`: on a built model (every submodule, fk.lora's patch of its LoRA layers
    included), returning how many modules were restored (0 for a model never patched); or, given
    a model type (``"llama"``), restore the family's classes, returning how many (0 when they were
    not patched). Models built while the classes were patched stay patched until reverted
    themselves. An unsupported model type raises the same ``ValueError`` as :func:`apply`."""
    from fk.hf.patching import revert as revert_model

    if isinstance(model, str):
        from fk.hf.classes import unpatch_classes

        return unpatch_classes(_patch_for(model).model_type)
    return revert_model(model)


def patched_classes() -> dict[str, list[str]]:
    """The model types whose classes :func:`apply` patched (and :func:`revert` has not restored),
    each with its class names."""
    from fk.hf.classes import patched_classes as classes

    return classes()


LOSS_OPTION_NAMES = ("memory_budget", "accum_dtype")


def loss_options(model: Any, **options: Any) -> int:
    """Set keyword arguments of :func:`fk.flce.linear_cross_entropy` that the fused loss of
    ``model`` passes on: ``memory_budget`` (bytes of logits per chunk) and ``accum_dtype`` (of the
    weight gradient across chunks). For example ``fk.hf.loss_options(model, memory_budget=256 << 20,
    accum_dtype=torch.bfloat16)`` trades some speed for memory (see the fk-flce docs for the
    measured cost); with no options, the defaults come back. Returns how many causal-LM modules of
    ``model`` took them (every module of a ``model`` whose forward :func:`apply` may patch, patched
    now or later; 0 when it has none). An unknown option raises ``TypeError``."""
    unknown = sorted(set(options) - set(LOSS_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown loss option(s) {', '.join(unknown)}; the options are {', '.join(LOSS_OPTION_NAMES)}")
    from fk.hf.patching import LOSS_OPTIONS

    count = 0
    for module in model.modules():
        if hasattr(module, "lm_head") and hasattr(module, "config"):
            module.__dict__[LOSS_OPTIONS] = dict(options)
            count += 1
    return count


def model_init(make_model: Callable[..., Any], **switches: bool) -> Callable[..., Any]:
    """``make_model`` (a ``Trainer``'s ``model_init``: no argument, or the hyperparameter-search
    trial) wrapped so that the model it returns comes out patched by :func:`apply` with
    ``switches``: ``Trainer(model_init=fk.hf.model_init(make_model), ...)``. The wrapper takes the
    arguments ``make_model`` takes (its signature is ``make_model``'s, which the Trainer inspects).
    An unknown switch raises ``TypeError`` here; an unsupported model, ``ValueError`` when built."""
    checked = _check_switches(switches)

    @functools.wraps(make_model)
    def init(*args: Any) -> Any:
        model = make_model(*args)
        apply(model, **checked)
        return model

    return init


def __getattr__(name: str) -> Any:
    if name == "FkCallback":  # a transformers.TrainerCallback: imports transformers on first use
        from fk.hf.trainer import FkCallback

        return FkCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
