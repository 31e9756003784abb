"""fk.hf with the ``transformers`` Trainer and TRL's ``SFTTrainer``: :class:`FkCallback`.

``Trainer(..., callbacks=[fk.hf.FkCallback()])`` patches the trainer's model with :func:`fk.hf.apply`
on ``on_init_end``, the first event a callback receives, which carries the model the trainer will
train. That moment matters; it is, in the Trainer's order of work (transformers 5.23, TRL 1.16):

- after the model exists: the one passed in, the one ``model_init`` built in the constructor, or
  the one TRL's ``SFTTrainer`` loaded from a name and wrapped with PEFT from ``peft_config``, so
  fk.lora fuses the LoRA layers TRL added;
- before ``train()`` enables activation checkpointing (flags on the layers; the patched forwards
  run inside the checkpointed layers as they are), creates the optimizer (patching swaps forwards
  only, so the parameters the optimizer holds are the same either way) and hands the model to
  accelerate, which under mixed precision replaces the top module's ``forward`` on the instance
  with an autocast wrapper, and may wrap the model for DDP or ``torch.compile``. fk.hf leaves a
  module whose forward was already replaced alone, so patching after that would lose the fused loss;
  patched before, the wrapper calls fk's forward;
- before ``SFTTrainer`` adds its own fused LM head (``add_fused_lm_head`` replaces the causal LM's
  ``forward`` after the Trainer's constructor returns): TRL's head then computes the training loss,
  with per-token entropy and accuracy for its metrics, from the backbone fk patched (norms, MLPs or
  LoRA layers, rotary embedding); fk's fused loss serves only calls that do not ask for TRL's head.

``on_train_begin`` patches too, when the model carries no fk patch at all: a callback added with
``trainer.add_callback`` after construction. Modules already wrapped by then (see above) are left
stock.

The model stays patched after training, as the trainer leaves it: evaluation, ``generate`` and
``save_pretrained`` work on a patched model as on a stock one. With ``model_init``, ``train()``
builds a new model that no callback receives (the Trainer's callbacks keep the one from its
constructor): wrap the function with :func:`fk.hf.model_init` instead.

This module imports ``transformers``; ``import fk.hf`` does not import it (``fk.hf.FkCallback`` is
resolved on first use).
"""

from __future__ import annotations

import logging
from typing import Any

import transformers

from fk.hf import apply
from fk.hf.patcher import patched_modules
from fk.hf.switches import check_switches

log = logging.getLogger("fk.hf")


class FkCallback(transformers.TrainerCallback):
    """A ``transformers.TrainerCallback`` that patches the trainer's model with :func:`fk.hf.apply`
    before training (see the module's docstring for when, and why then).

    Args:
        **switches: :func:`fk.hf.apply`'s switches (``rms_norm``, ``layer_norm``, ``swiglu``,
            ``geglu``, ``rope``, ``flce``, ``lora``); every switch not given is on. An unknown name or a value that is not
            a bool raises ``TypeError`` here, before the trainer is built.

    After patching, :attr:`patched` holds what :func:`fk.hf.apply` returned (None before): its
    report, also logged.
    """

    def __init__(self, **switches: bool) -> None:
        self.switches = check_switches(switches)
        self.patched: dict[str, int] | None = None

    def _patch(self, model: Any) -> None:
        self.patched = apply(model, **self.switches)

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._patch(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None and not any(patched_modules(model).values()):
            self._patch(model)
