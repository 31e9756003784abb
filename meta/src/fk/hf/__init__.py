"""fk.hf: the Hugging Face integration of the meta-package fk-hf.

- :func:`apply` patches a built ``transformers`` model in place with fk's kernels (and a PEFT
  model's LoRA layers with fk.lora), or, given a model type (``"llama"``), the family's classes so
  that models built afterwards come out patched; :func:`revert` undoes either. Any model: the
  blocks are recognized by structure and verified on a probe (:mod:`fk.hf.patcher`); the report
  says what was patched and what stayed stock, and why.
- :class:`AutoModelForCausalLM`: ``from_pretrained`` / ``from_config`` as transformers', the model
  returned already patched (switches in ``fk_options``).
- With the ``transformers`` Trainer or TRL's ``SFTTrainer``: ``callbacks=[fk.hf.FkCallback()]``
  (see :mod:`fk.hf.trainer`), or ``model_init=fk.hf.model_init(make_model)``.
- With TRL's ``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer`` or ``GKDTrainer``:
  ``fk.hf.align_trainer(trainer)``,
  which also computes the loss with fk-align's fused-head losses (see :mod:`fk.hf.align_trainers`).
- ``python -m fk.hf.demo`` trains a small Llama stock and patched, side by side (:mod:`fk.hf.demo`,
  on the helpers of :mod:`fk.hf.training`); ``python -m fk.hf.check`` runs every installed fk
  kernel against its reference.

Importing fk.hf imports neither ``transformers`` nor any kernel: that happens when a model is
patched (``pip install "fk-hf[hf]"`` brings ``transformers``), or when ``fk.hf.FkCallback`` is
first used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

from fk.hf.auto import AutoModelForCausalLM
from fk.hf.patcher import patched_modules
from fk.hf.report import PatchReport
from fk.hf.switches import OFF_BY_DEFAULT, SWITCHES, check_switches

if TYPE_CHECKING:
    from fk.hf.trainer import FkCallback

__all__ = [
    "OFF_BY_DEFAULT",
    "SWITCHES",
    "AutoModelForCausalLM",
    "FkCallback",
    "PatchReport",
    "align_trainer",
    "apply",
    "loss_options",
    "model_init",
    "patched_classes",
    "patched_modules",
    "revert",
    "supported_model_types",
]


def supported_model_types() -> list[str]:
    """The model types :func:`apply` takes as a string (every causal-LM type of the installed
    transformers), sorted. A built model of any type is taken (see :func:`apply`)."""
    from fk.hf.classes import causal_lm_types

    return sorted(causal_lm_types())


@overload
def apply(model: str, *, strict: bool = ..., **switches: bool) -> list[str]: ...
@overload
def apply(model: Any, *, strict: bool = ..., **switches: bool) -> PatchReport: ...
def apply(model: Any, *, strict: bool = False, **switches: bool) -> PatchReport | list[str]:
    """Patch the built Hugging Face model ``model`` in place with fk's kernels, or (``model`` a
    model type) the family's classes.

    Args:
        model: a ``transformers`` model (``LlamaForCausalLM``, ``LlamaModel``, a multimodal model
            whose language model is Llama-like, a ``PeftModel`` around one, ...). fk finds the
            blocks it can replace by what they are (:mod:`fk.hf.recognize`) and runs each block
            type once, stock and fk, on a small probe before it patches it
            (:mod:`fk.hf.probe`). Or a model type as a string (``"llama"``): every
            ``PreTrainedModel`` class of that family's modeling module is patched so that each
            model built afterwards (constructor, ``from_config``, ``from_pretrained``) is patched
            with these switches as it is built (see :mod:`fk.hf.classes`); returns the class names
            then. :func:`revert` with the same string restores the classes.
        strict: raise ``ValueError`` when a candidate block was left stock (the report says
            which and why); the blocks that could be patched stay patched.
        switches: the switches of :data:`fk.hf.switches.TABLE`, each a bool (``rms_norm``,
            ``layer_norm``, ``swiglu``, ``geglu``, ``rope``, ``qkv``, ``add_norm``, ``flce``,
            ``lora``; ``recompute_norms`` off by default): what each replaces is in the table and
            in docs/packages/meta.md. ``flce``: in training mode with labels the forward returns
            ``logits=None`` (pass ``skip_logits=False`` to get them, see
            :func:`fk.hf.loss_head.causal_lm_forward`). ``lora``: on a PEFT model,
            :func:`fk.lora.patch` fuses its LoRA layers first.

    Only modules are patched (each one's class swapped for a subclass with fk's ``forward``, see
    :mod:`fk.hf.patcher`): parameters, buffers and the ``state_dict`` are unchanged, and other
    models of the same classes are not affected. Calling ``apply`` again replaces the previous
    patch. Returns a :class:`~fk.hf.report.PatchReport`: how many modules each switch patched (a
    dict, switch -> count; ``lora``: fused LoRA units), and which block types were patched or
    left stock and why; it is also logged at INFO on the ``fk.hf`` logger.

    Raises ``TypeError`` for an unknown switch or a model that is not a ``torch.nn.Module``, and
    ``ValueError`` for a model-type string that is not a causal-LM type of the installed
    transformers (and under ``strict``, as above).
    """
    import torch

    from fk.hf.patcher import apply_patch

    checked = check_switches(switches)
    if isinstance(model, str):
        from fk.hf.classes import patch_classes

        return patch_classes(model, checked)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    return apply_patch(model, checked, strict=strict)


def revert(model: Any) -> int:
    """Undo :func:`apply`: on a built model (every submodule, fk.lora's patch of its LoRA layers
    included), returning how many modules were restored (0 for a model never patched); or, given
    a model type (``"llama"``), restore the family's classes, returning how many (0 when they were
    not patched). Models built while the classes were patched stay patched until reverted
    themselves. A model type that is not a causal-LM type raises the same ``ValueError`` as
    :func:`apply`."""
    from fk.hf.patcher import revert as revert_model

    if isinstance(model, str):
        from fk.hf.classes import unpatch_classes

        return unpatch_classes(model)
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
    from fk.hf.marks import LOSS_OPTIONS

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
    An unknown switch raises ``TypeError`` here."""
    checked = check_switches(switches)

    @functools.wraps(make_model)
    def init(*args: Any) -> Any:
        model = make_model(*args)
        apply(model, **checked)
        return model

    return init


def align_trainer(trainer: Any, **switches: bool) -> Any:
    """Make TRL's ``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer`` or ``GKDTrainer`` (or a subclass of
    one that keeps its loss method) train an fk-patched model with fk-align's losses on the fused LM head:
    ``trainer = fk.hf.align_trainer(DPOTrainer(...))``, before ``trainer.train()``.

    The trainer's model is patched with :func:`apply` and ``switches`` (unless it already carries
    a patch, from :class:`FkCallback`), so is a reference model or teacher the trainer runs every
    step (its blocks: its head stays TRL's or the model's own), and the trainer's loss method is
    replaced on the instance by one that runs the model's decoder and
    :func:`fk.align.fused_linear_dpo_loss`, :func:`fk.align.fused_linear_kto_loss`,
    :func:`fk.align.fused_linear_grpo_loss`, :func:`fk.align.fused_linear_rloo_loss` or
    :func:`fk.align.fused_linear_distill_from_logits`, returning TRL's loss and logging TRL's
    metrics. A setting fk-align does not compute (see
    docs/packages/meta.md) leaves the trainer's loss TRL's own, with one warning naming it. Returns
    ``trainer``; calling it again does nothing. Any other trainer, or an unknown switch, raises
    ``TypeError``. Imports ``trl`` (see :mod:`fk.hf.align_trainers`)."""
    checked = check_switches(switches)
    from fk.hf.align_trainers import align_trainer as align

    return align(trainer, checked)


def __getattr__(name: str) -> Any:
    if name == "FkCallback":  # a transformers.TrainerCallback: imports transformers on first use
        from fk.hf.trainer import FkCallback

        return FkCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
