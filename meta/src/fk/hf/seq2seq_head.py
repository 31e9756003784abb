"""The fused loss on an encoder-decoder LM's head (the ``flce`` switch): BART, mBART, Marian,
Pegasus, M2M100/NLLB, T5 and their kin, whose ``ForConditionalGeneration`` forward scores the
decoder's position t against ``labels[:, t]`` with a fresh ``CrossEntropyLoss`` (the mean over
labels not -100), on ``head(x)`` or ``head(x) + self.final_logits_bias``.

How, without re-implementing each model's forward: in training with labels, the stock forward runs
with the labels turned into the decoder's inputs as it would turn them (the model's
``prepare_decoder_input_ids_from_labels``, else its module's ``shift_tokens_right(labels,
config.pad_token_id, config.decoder_start_token_id)``, which its forward calls) and without the
labels themselves, and with its head
replaced for that call by a stand-in that keeps its input (whatever the forward computed for the
head: T5's rescaled hidden states included) and returns a ``[..., 1]`` zero tensor, so nothing
vocabulary-sized is made; ``final_logits_bias`` is a ``[1, 1]`` zero for that call too. The loss
is then :func:`fk.hf.loss_head.fused_causal_lm_loss` on the kept input, the head's weight and its
bias plus ``final_logits_bias``, the labels unshifted. The output is stock's with that loss and no
logits. Anything else the forward does to the logits after the head (a softcap, a scale) would be
missed: :func:`fk.hf.probe.head` compares the loss with stock's before the head is patched, and
such a model stays stock.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import torch

from fk.hf.loss_head import fused_causal_lm_loss, with_skip_logits
from fk.hf.marks import LOSS_OPTIONS, PLAN
from fk.hf.recognize import Refusal
from fk.hf.sharding_hooks import plain_linear

HEAD_NAMES = ("lm_head", "proj_out")
"""The attributes an encoder-decoder LM keeps its output projection under (Whisper's: ``proj_out``)."""

LOGITS_BIAS = "final_logits_bias"
"""The ``[1, V]`` buffer the BART family adds to the head's output."""


@dataclasses.dataclass(frozen=True)
class Seq2SeqHeadPlan:
    """What :func:`seq2seq_forward` needs of a model: its head's attribute, whether stock adds
    :data:`LOGITS_BIAS` after it, and its module's ``shift_tokens_right`` where the model has no
    ``prepare_decoder_input_ids_from_labels``."""

    head: str
    logits_bias: bool
    shift_tokens_right: Any = None

    def decoder_input_ids(self, model: Any, labels: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs that ``model``'s forward makes of ``labels``."""
        if self.shift_tokens_right is None:
            ids: torch.Tensor = model.prepare_decoder_input_ids_from_labels(labels=labels)
            return ids
        config = model.config
        shifted: torch.Tensor = self.shift_tokens_right(labels, config.pad_token_id, config.decoder_start_token_id)
        return shifted


def seq2seq_candidate(module: torch.nn.Module) -> Seq2SeqHeadPlan | Refusal | None:
    """The plan of an encoder-decoder LM's head, a Refusal, or None where ``module`` is not one
    (no ``config.is_encoder_decoder``, no decoder inputs made from labels, no head)."""
    config = getattr(module, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return None
    name = next((n for n in HEAD_NAMES if isinstance(getattr(module, n, None), torch.nn.Module)), None)
    if name is None:
        return None
    forward = inspect.unwrap(type(module).forward)
    if not isinstance(forward, types.FunctionType):
        return Refusal("flce", "its forward is not a Python function")
    code = forward.__code__
    shift = None
    if not callable(getattr(module, "prepare_decoder_input_ids_from_labels", None)):
        shift = forward.__globals__.get("shift_tokens_right") if "shift_tokens_right" in code.co_names else None
        if not callable(shift):
            return Refusal("flce", "it makes its decoder's inputs from the labels in a way fk does not know")
    args = code.co_varnames[1 : code.co_argcount]
    if "labels" not in args or "CrossEntropyLoss" not in code.co_names or name not in code.co_names:
        return Refusal("flce", "its forward computes no CrossEntropyLoss on its head's output")
    if not plain_linear(getattr(module, name)):
        return Refusal("flce", f"its {name} is not a plain nn.Linear")
    bias = LOGITS_BIAS in code.co_names
    if bias and not isinstance(getattr(module, LOGITS_BIAS, None), torch.Tensor):
        return Refusal("flce", f"its forward reads {LOGITS_BIAS}, which it does not hold")
    return Seq2SeqHeadPlan(name, bias, shift)


class _KeptInput(torch.nn.Module):
    """The head's stand-in for one call: keeps its input, returns a ``[..., 1]`` zero tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.input: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input = x
        return x.new_zeros(()).expand(*x.shape[:-1], 1)


def seq2seq_forward(stock: Any) -> Any:
    """The forward of an encoder-decoder LM class whose stock forward is ``stock``, with the loss
    from fused linear cross entropy in training with labels (see the module docstring); its
    signature is stock's, ``skip_logits`` added as in :func:`fk.hf.loss_head.causal_lm_forward_as`
    (true by default exactly when the model trains and ``labels`` are given). Positional
    arguments, ``return_dict=False`` and decoder inputs given beside the labels take the stock path
    (with the logits) as well."""

    def forward(self: Any, *args: Any, skip_logits: bool | None = None, **kwargs: Any) -> Any:
        plan: Seq2SeqHeadPlan = self.__dict__[PLAN]
        labels = kwargs.get("labels")
        if skip_logits is None:
            skip_logits = self.training and labels is not None
        if skip_logits and labels is None:
            raise ValueError("skip_logits=True needs labels: without them there is nothing to compute but the logits")
        head = getattr(self, plan.head)
        given = any(kwargs.get(k) is not None for k in ("decoder_input_ids", "decoder_inputs_embeds"))
        if not skip_logits or args or given or kwargs.get("return_dict") is False or not plain_linear(head):
            return stock(self, *args, **kwargs)
        assert labels is not None
        kwargs["labels"] = None
        kwargs["decoder_input_ids"] = plan.decoder_input_ids(self, labels)
        if kwargs.get("use_cache") is None:  # (stock turns the cache off when it has labels)
            kwargs["use_cache"] = False
        kept = _KeptInput()
        logits_bias = self._buffers.get(LOGITS_BIAS) if plan.logits_bias else None
        self._modules[plan.head] = kept
        if logits_bias is not None:
            self._buffers[LOGITS_BIAS] = logits_bias.new_zeros(1, 1)
        try:
            outputs = stock(self, *args, **kwargs)
        finally:
            self._modules[plan.head] = head
            if logits_bias is not None:
                self._buffers[LOGITS_BIAS] = logits_bias
        if kept.input is None:
            raise RuntimeError(f"{type(self).__name__}'s forward did not call its {plan.head}")
        loss = fused_causal_lm_loss(kept.input, head, labels, shift_labels=labels, options=self.__dict__.get(LOSS_OPTIONS),
                                    extra_bias=logits_bias.reshape(-1) if logits_bias is not None else None)  # fmt: skip
        return dataclasses.replace(outputs, loss=loss, logits=None)

    forward.__signature__ = with_skip_logits(stock)  # type: ignore[attr-defined]
    forward.__name__ = forward.__qualname__ = "forward"
    forward.__doc__ = stock.__doc__
    return forward
