"""fk.hf with TRL's ``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer`` and ``GKDTrainer``:
:func:`align_trainer`.

``trainer = fk.hf.align_trainer(DPOTrainer(...))`` (or a ``KTOTrainer``, a ``GRPOTrainer``, an
``RLOOTrainer``, a ``GKDTrainer``, or a subclass of one that keeps its loss method) patches the trainer's model with :func:`fk.hf.apply`,
unless a :class:`fk.hf.FkCallback` already did, and makes the trainer compute its training loss
with fk-align's loss on the fused LM head: the model's decoder gives the last hidden states, and
the loss reads the LM head's weight (and bias) without the ``[tokens, vocab]`` logits.

- ``DPOTrainer``: :func:`fk.align.fused_linear_dpo_loss` replaces ``_compute_loss``; the reference
  log-probabilities are TRL's (precomputed, or its ``compute_ref_log_probs`` on the reference
  model, or on the PEFT model with its adapter off).
- ``KTOTrainer``: :func:`fk.align.fused_linear_kto_loss` replaces ``_compute_loss``; the log-
  probabilities of the KL completions (the policy's, without gradient) and the reference's are
  TRL's, as for DPO.
- ``GRPOTrainer``: :func:`fk.align.fused_linear_grpo_loss` replaces ``_compute_loss``, on the
  batch TRL generated and scored (old and reference log-probabilities, advantages are TRL's).
- ``RLOOTrainer``: :func:`fk.align.fused_linear_rloo_loss` replaces ``_compute_loss``, on the
  batch TRL generated and scored (the old sequence log-probabilities and the advantages, the KL
  penalty already in them, are TRL's).
- ``GKDTrainer``: :func:`fk.align.fused_linear_distill_from_logits` replaces ``compute_loss``:
  the student's logits are never built; the teacher's are TRL's, as its ``compute_loss`` has them.

The loss is TRL's, and so are the metrics logged beside it, under the same names and with the same
reductions across processes. DPO's and KTO's ``entropy`` and ``logits/*`` (and DPO's
``mean_token_accuracy``) read the head's full distribution at each scored token: the loss gives them
from its own pass over the logits (``return_token_stats``).

A setting fk-align does not compute (see :func:`unsupported_settings`) leaves that trainer's loss
stock, with one warning naming the setting: a training run does not fail on the switch. Inputs
that fk's path does not take (multimodal inputs, ``return_outputs=True``) go to TRL's own method
for that call, with one warning.

Why a function and not the callback: a ``TrainerCallback`` is handed the model, never the trainer,
and the loss (its type, beta, the reference model, the metrics) lives on the trainer. Call it
before ``train()``: it adds a path to the model's ``forward`` on the instance (a keyword, unused
by anything else, that returns the loss computed in the model's forward), which accelerate's
mixed-precision wrapper and DDP then call through as they call TRL's fused head. The loss runs
inside the model's forward, as TRL's does, so DDP sees it as the module's output, and an LM head
that FSDP2 shards on its own is unsharded around it (:func:`fk.hf.sharding_hooks.run_as_forward`).

This module imports ``torch``; TRL is imported when :func:`align_trainer` is called.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

import fk.align as align
from fk.hf.sharding_hooks import plain_linear, run_as_forward

log = logging.getLogger("fk.hf")

HEAD_KWARG = "fk_head"
"""The keyword of the model's ``forward`` that takes fk's loss: ``fn(hidden_states, weight, bias)``."""

STATE = "_fk_align"  # the trainer's __dict__ key: which loss fk computes ("dpo", "kto", "grpo", "rloo", "gkd"), or None
_HEAD_MARK = "_fk_align_head"  # the model's __dict__ key: the forward takes HEAD_KWARG
_WARNED = "_fk_align_warned"

# Config fields that change the logits after the head (softcapping, scaling): fk's path leaves them stock.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")

# Inputs beyond the token ids and masks (vision-language models): that batch takes TRL's path.
_DPO_MODEL_INPUTS = ("input_ids", "attention_mask")
_KTO_BATCH = ("input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask",
              "KL_completion_mask", "label", "ref_logps", "ref_KL_logps")  # fmt: skip
_GRPO_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")  # fmt: skip


# --- 1. Which trainer, and what it asks for -------------------------------------------------------


def _trainer_classes() -> dict[str, tuple[type, str]]:
    """kind -> (TRL's class, the method fk replaces); empty without TRL. GKD first (it is an
    ``SFTTrainer``), and only when its module was imported (a GKDTrainer exists then): importing
    ``trl.experimental`` warns."""
    try:
        import trl
    except ImportError:
        return {}
    classes: dict[str, tuple[type, str]] = {}
    gkd = sys.modules.get("trl.experimental.gkd.gkd_trainer")
    if gkd is not None:
        classes["gkd"] = (gkd.GKDTrainer, "compute_loss")
    classes["dpo"] = (trl.DPOTrainer, "_compute_loss")
    classes["kto"] = (trl.KTOTrainer, "_compute_loss")
    classes["grpo"] = (trl.GRPOTrainer, "_compute_loss")
    classes["rloo"] = (trl.RLOOTrainer, "_compute_loss")
    return classes


def trainer_kind(trainer: Any) -> tuple[str, str] | None:
    """(kind, the loss method fk replaces) of a TRL trainer fk takes, or None."""
    for kind, (cls, method) in _trainer_classes().items():
        if isinstance(trainer, cls):
            return kind, method
    return None


def _unwrapped(model: Any) -> Any:
    """The causal LM whose ``forward`` TRL patched: the base model of a PEFT model, else the model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def unsupported_settings(trainer: Any, kind: str, method: str) -> list[str]:
    """The trainer's settings fk's loss does not compute, each named as a user sets it (empty:
    fk takes the loss)."""
    found = []
    cls = _trainer_classes()[kind][0]
    if getattr(type(trainer), method) is not getattr(cls, method):
        found.append(f"{type(trainer).__name__}.{method} (a subclass's own loss)")
    model = _unwrapped(trainer.model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in _HEAD_EXTRAS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            found.append(f"config.{name}={value!r} (logits changed after the head)")
    head = model.get_output_embeddings()
    args = trainer.args
    if kind == "grpo" and getattr(args, "cast_lm_head_to_fp32", False):
        found.append("cast_lm_head_to_fp32=True")
    elif not (isinstance(head, torch.nn.Module) and plain_linear(head)):
        found.append(f"an lm_head that is not a plain nn.Linear ({type(head).__name__})")
    if getattr(args, "n_gpu", 1) > 1:  # (a replica would see part of the batch: DPO's pairs split)
        found.append(f"n_gpu={args.n_gpu} (nn.DataParallel: several GPUs in one process; DDP is taken)")
    if getattr(trainer, "aux_loss_enabled", False):
        found.append("router_aux_loss_coef (a mixture of experts' load-balancing loss)")
    if kind == "dpo":
        if trainer.f_divergence_type != "reverse_kl":
            found.append(f"f_divergence_type={trainer.f_divergence_type!r}")
        if trainer.ld_alpha is not None:
            found.append(f"ld_alpha={trainer.ld_alpha!r}")
        if trainer.use_weighting:
            found.append("use_weighting=True")
        found += [f"loss_type={t!r}" for t in trainer.loss_types if t not in align.DPO_LOSS_TYPES]
    elif kind == "kto":
        if trainer.loss_type not in align.KTO_LOSS_TYPES:
            found.append(f"loss_type={trainer.loss_type!r}")
    elif kind == "grpo":
        if trainer.loss_type not in align.GRPO_LOSS_TYPES:
            found.append(f"loss_type={trainer.loss_type!r}")
        if trainer.top_entropy_quantile < 1.0:
            found.append(f"top_entropy_quantile={trainer.top_entropy_quantile!r}")
        if trainer.off_policy_mask_threshold is not None:
            found.append(f"off_policy_mask_threshold={trainer.off_policy_mask_threshold!r}")
        if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
            found.append("vllm_importance_sampling_correction=True")
        if trainer.use_adaptive_entropy:
            found.append("use_adaptive_entropy=True")
    return found


def _warn_once(trainer: Any, what: str) -> None:
    warned: set[str] = trainer.__dict__.setdefault(_WARNED, set())
    if what not in warned:
        warned.add(what)
        log.warning("fk.hf.align_trainer: %s; this call's loss is %s's own", what, type(trainer).__name__)


def _stock(trainer: Any, method: str) -> Callable[..., Any]:
    """TRL's method, bound to ``trainer`` (the class's, past fk's instance attribute)."""
    bound: Callable[..., Any] = getattr(type(trainer), method).__get__(trainer)
    return bound


# --- 2. The loss inside the model's forward -------------------------------------------------------


def _head_loss(module: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the decoder of the causal LM ``module`` on the inputs, then ``fn(hidden_states, weight,
    bias)`` with its LM head's parameters: under autocast both in autocast's dtype, as the head's
    own forward would have them, and ``fn`` itself outside autocast."""
    kwargs["use_cache"] = False
    outputs = module.base_model(*args, **kwargs)
    head = module.get_output_embeddings()

    def loss_forward(head: Any, hidden: torch.Tensor) -> Any:
        weight, bias = head.weight, head.bias
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        hidden = hidden.to(weight.device)
        with torch.autocast(device_type, enabled=False):
            return fn(hidden, weight, bias)

    hidden_states = outputs.last_hidden_state
    if head._forward_pre_hooks or head._forward_hooks:  # FSDP2's own shard of the head
        return run_as_forward(head, loss_forward, hidden_states)
    return loss_forward(head, hidden_states)


def install_head(model: Any) -> None:
    """Give the causal LM of ``model`` (its base model, for PEFT) a ``forward`` that takes
    ``fk_head=fn``: the decoder's last hidden states and the head's weight and bias go to ``fn``,
    whose result the forward returns. Without the keyword, the forward is the one it replaces
    (TRL's fused head, or the model's own), so generation and TRL's calls are unchanged."""
    module = _unwrapped(model)
    if module.__dict__.get(_HEAD_MARK):
        return
    previous = module.forward

    @functools.wraps(type(module).forward)  # (the signature, which generate() validates its kwargs against)
    def forward(*args: Any, **kwargs: Any) -> Any:
        fn = kwargs.pop(HEAD_KWARG, None)
        if fn is None:
            return previous(*args, **kwargs)
        return _head_loss(module, fn, args, kwargs)

    module.forward = forward
    module.__dict__[_HEAD_MARK] = True


# --- 3. DPO ---------------------------------------------------------------------------------------


def _ratio(trainer: Any, total: torch.Tensor, count: torch.Tensor) -> float:
    """sum(total) / sum(count) over the processes (``gather_for_metrics``), 0 without a count."""
    gather = trainer.accelerator.gather_for_metrics
    total_all, count_all = gather(total).sum().item(), gather(count).sum().item()
    return total_all / count_all if count_all > 0 else 0.0


def _log_entropy_and_tokens(
    trainer: Any, mode: str, entropy: torch.Tensor, mask: torch.Tensor, attention_mask: torch.Tensor
) -> None:
    """DPO's and KTO's ``entropy`` (the mean over the scored tokens ``mask`` of all processes) and
    ``num_tokens`` (the non-padding tokens trained on so far), as TRL logs them."""
    metrics = trainer._metrics[mode]
    metrics["entropy"].append(_ratio(trainer, (entropy * mask).sum(), mask.sum()))
    if mode == "train":
        tokens = trainer.accelerator.gather_for_metrics(attention_mask.sum()).sum().item()
        trainer._total_train_tokens += tokens // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]


def dpo_compute_loss(self: Any, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
    """``DPOTrainer._compute_loss`` on :func:`fk.align.fused_linear_dpo_loss`."""
    extra = sorted(k for k in inputs if k not in (*_DPO_MODEL_INPUTS, "completion_mask", "ref_chosen_logps",
                                                  "ref_rejected_logps"))  # fmt: skip
    if return_outputs or extra:
        _warn_once(self, "return_outputs=True" if return_outputs else f"inputs {', '.join(extra)}")
        return _stock(self, "_compute_loss")(model, inputs, return_outputs)
    mode = "train" if self.model.training else "eval"
    completion_mask = inputs["completion_mask"]
    labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
    if self.precompute_ref_logps:
        ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    else:
        ref_chosen, ref_rejected = self.compute_ref_log_probs(self.ref_model if self.ref_model is not None else model,
                                                              inputs)  # fmt: skip
    seq = labels.shape[1]

    def loss_fn(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        hidden = hidden[:, -seq:]  # (prompt-learning PEFT puts virtual tokens first)
        return align.fused_linear_dpo_loss(
            hidden, weight, labels, bias=bias, ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
            beta=self.beta, loss_type=list(self.loss_types), loss_weights=list(self.loss_weights),
            label_smoothing=self.label_smoothing, discopop_tau=self.args.discopop_tau, shift=True,
            return_token_stats=True,
        )  # fmt: skip

    model_kwargs = {k: inputs[k] for k in _DPO_MODEL_INPUTS if k in inputs}
    out = model(**model_kwargs, **{HEAD_KWARG: loss_fn})
    entropy, mean_logits, top1 = (values[:, :-1] for values in out.token_stats)  # (the labels' positions 1...)

    metrics = self._metrics[mode]
    mask = completion_mask[:, 1:].bool()
    _log_entropy_and_tokens(self, mode, entropy, mask, inputs["attention_mask"])
    chosen_mask, rejected_mask = mask.chunk(2, dim=0)
    chosen_logits, rejected_logits = mean_logits.chunk(2, dim=0)
    metrics["logits/chosen"].append(_ratio(self, chosen_logits[chosen_mask].sum(), chosen_mask.sum()))
    metrics["logits/rejected"].append(_ratio(self, rejected_logits[rejected_mask].sum(), rejected_mask.sum()))
    chosen_top1 = top1.chunk(2, dim=0)[0]
    metrics["mean_token_accuracy"].append(_ratio(self, (chosen_top1 & chosen_mask).sum(), chosen_mask.sum()))
    gather = self.accelerator.gather
    metrics["rewards/chosen"].append(gather(out.chosen_rewards).mean().item())
    metrics["rewards/rejected"].append(gather(out.rejected_rewards).mean().item())
    metrics["rewards/accuracies"].append(gather(out.reward_accuracies).mean().item())
    metrics["rewards/margins"].append(gather(out.reward_margins).mean().item())
    metrics["logps/chosen"].append(gather(out.chosen_logps).mean().item())
    metrics["logps/rejected"].append(gather(out.rejected_logps).mean().item())
    return out.loss


# --- 4. KTO ---------------------------------------------------------------------------------------


def kto_compute_loss(self: Any, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
    """``KTOTrainer._compute_loss`` on :func:`fk.align.fused_linear_kto_loss`. The KL estimate is
    TRL's: its policy's log-probabilities of the mismatched KL completions (without gradient,
    ``_compute_kl_logps``) against the reference's, averaged over the processes and clamped at 0;
    the reference's log-probabilities are TRL's (precomputed, or its ``compute_ref_log_probs``)."""
    extra = sorted(k for k in inputs if k not in _KTO_BATCH)
    if return_outputs or extra:
        _warn_once(self, "return_outputs=True" if return_outputs else f"inputs {', '.join(extra)}")
        return _stock(self, "_compute_loss")(model, inputs, return_outputs)
    mode = "train" if self.model.training else "eval"
    batch = {k: v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    kl_logps = self._compute_kl_logps(model, batch)
    if self.precompute_ref_logps:
        ref_logps, ref_kl_logps = batch["ref_logps"], batch.get("ref_KL_logps")
    else:
        ref_logps, ref_kl_logps = self.compute_ref_log_probs(self.ref_model if self.ref_model is not None else model,
                                                             batch)  # fmt: skip
    kl = torch.zeros(1, device=self.accelerator.device)
    kl_pair: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # (fk-align's KL estimate: none)
    if self.calculate_KL:
        kl = self.accelerator.gather_for_metrics((kl_logps - ref_kl_logps).mean().detach()).mean().clamp(min=0)
        kl_pair = (kl.reshape(1), torch.zeros_like(kl).reshape(1))  # (fk-align's estimate from these is kl)
    completion_mask = batch["completion_mask"]
    labels = batch["input_ids"].masked_fill(completion_mask == 0, -100)
    desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=labels.device)
    seq = labels.shape[1]

    def loss_fn(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        hidden = hidden[:, -seq:]  # (prompt-learning PEFT puts virtual tokens first)
        return align.fused_linear_kto_loss(
            hidden, weight, labels, desirable, bias=bias, ref_logps=ref_logps, kl_logps=kl_pair[0],
            ref_kl_logps=kl_pair[1], beta=self.beta, loss_type=self.loss_type,
            desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight, shift=True,
            return_token_stats=True,
        )  # fmt: skip

    model_kwargs = {k: batch[k] for k in _DPO_MODEL_INPUTS}
    out = model(**model_kwargs, **{HEAD_KWARG: loss_fn})
    entropy, mean_logits = (values[:, :-1] for values in out.token_stats[:2])  # (the labels' positions 1...)

    metrics = self._metrics[mode]
    metrics["kl"].append(kl.item())
    mask = completion_mask[:, 1:].bool()
    _log_entropy_and_tokens(self, mode, entropy, mask, batch["attention_mask"])
    gather = self.accelerator.gather_for_metrics
    kinds = (("chosen", desirable), ("rejected", ~desirable))
    for name, rows in kinds:  # (TRL logs nothing for a kind without tokens, or without sequences)
        count = gather(mask[rows].sum()).sum().item()
        if count > 0:
            metrics[f"logits/{name}"].append(gather(mean_logits[rows][mask[rows]].sum()).sum().item() / count)
    sequences = {name: gather(rows.sum()).sum().item() for name, rows in kinds}
    for name, rows in kinds:
        if sequences[name] > 0:
            for metric, values in (("rewards", out.rewards), ("logps", out.logps)):
                metrics[f"{metric}/{name}"].append(gather(values[rows].nansum()).nansum().item() / sequences[name])
    if sequences["chosen"] > 0 and sequences["rejected"] > 0:
        metrics["rewards/margins"].append(metrics["rewards/chosen"][-1] - metrics["rewards/rejected"][-1])
    return out.loss


# --- 5. GRPO --------------------------------------------------------------------------------------


def _generated_batch(trainer: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's ``input_ids`` and ``attention_mask`` (prompt, then completion) of a batch GRPO or
    RLOO generated; None, with one warning, for a batch with multimodal inputs (TRL's path takes it)."""
    multimodal = sorted(k for k in _GRPO_MULTIMODAL if inputs.get(k) is not None)
    if multimodal:
        _warn_once(trainer, f"inputs {', '.join(multimodal)}")
        return None
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    return input_ids, torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)


def grpo_compute_loss(self: Any, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``GRPOTrainer._compute_loss`` on :func:`fk.align.fused_linear_grpo_loss`."""
    batch = _generated_batch(self, inputs)
    if batch is None:
        return _stock(self, "_compute_loss")(model, inputs)
    input_ids, attention_mask = batch
    mode = "train" if self.model.training else "eval"
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    steps = completion_ids.shape[1]
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
    num_items = None
    if self.loss_type in ("dapo", "cispo"):  # TRL's window of the generation batch's token count
        num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
    entropy_coef = float(self.entropy_coef) if self._entropy_bonus_enabled else 0.0

    def loss_fn(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        return align.fused_linear_grpo_loss(
            hidden[:, -steps - 1 : -1], weight, completion_ids, mask, inputs["advantages"], bias=bias,
            old_per_token_logps=inputs.get("old_per_token_logps"),
            ref_per_token_logps=inputs["ref_per_token_logps"] if self.beta != 0.0 else None, beta=self.beta,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=self.args.delta,
            importance_sampling_level=self.importance_sampling_level, loss_type=self.loss_type,
            max_completion_length=self.max_completion_length, num_items_in_batch=num_items,
            gradient_accumulation_steps=accumulation, temperature=self.temperature, entropy_coef=entropy_coef,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            sapo_temperature_pos=self.args.sapo_temperature_pos, sapo_temperature_neg=self.args.sapo_temperature_neg,
        )  # fmt: skip

    with self.accelerator.autocast():  # (TRL's policy forward runs under it)
        out = model(input_ids=input_ids, attention_mask=attention_mask, **{HEAD_KWARG: loss_fn})

    # fk's metrics are this process' masked means: weighted by their counts, they reduce to TRL's global ones.
    metrics = self._metrics[mode]
    tokens = mask.sum().float()
    per_sequence = self.importance_sampling_level == "sequence"
    sequences = torch.tensor(float(mask.shape[0]), device=tokens.device)

    def global_mean(name: str, count: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([out.metrics[name] * count, count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if entropy_coef != 0.0:
        metrics["policy_loss"].append(self.accelerator.gather(out.metrics["policy_loss"]).nanmean().item())
        if mode == "train" and self.accelerator.sync_gradients:
            metrics["entropy_coef"].append(self.entropy_coef)
    if self.beta != 0.0:
        metrics["kl"].append(global_mean("kl", tokens))
    metrics["entropy"].append(global_mean("entropy", tokens))
    clip_count = sequences if per_sequence else tokens
    if "clip_ratio/low_mean" in out.metrics:
        from trl.trainer.utils import nanmax, nanmin

        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            metrics[name].append(global_mean(name, clip_count))
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(out.metrics["clip_ratio/low_min"])).item())
        metrics["clip_ratio/high_max"].append(
            nanmax(self.accelerator.gather(out.metrics["clip_ratio/high_max"])).item()
        )
    elif "cispo_clip_ratio" in out.metrics:
        metrics["cispo_clip_ratio"].append(global_mean("cispo_clip_ratio", clip_count))
    return out.loss


# --- 6. RLOO --------------------------------------------------------------------------------------


def rloo_compute_loss(self: Any, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``RLOOTrainer._compute_loss`` on :func:`fk.align.fused_linear_rloo_loss`."""
    batch = _generated_batch(self, inputs)
    if batch is None:
        return _stock(self, "_compute_loss")(model, inputs)
    input_ids, attention_mask = batch
    mode = "train" if self.model.training else "eval"
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    steps = completion_ids.shape[1]

    def loss_fn(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        return align.fused_linear_rloo_loss(
            hidden[:, -steps - 1 : -1], weight, completion_ids, completion_mask, inputs["advantages"],
            inputs["old_logps"], bias=bias, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            temperature=self.temperature,
        )  # fmt: skip

    with self.accelerator.autocast():  # (TRL's policy forward runs under it)
        out = model(input_ids=input_ids, attention_mask=attention_mask, **{HEAD_KWARG: loss_fn})

    from trl.trainer.utils import nanmax, nanmin

    metrics = self._metrics[mode]
    mask = completion_mask.float()
    totals = self.accelerator.reduce(torch.stack([(out.entropies * mask).sum(), mask.sum()]), reduction="sum")
    metrics["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
    low = self.accelerator.gather(out.low_clipped.float())
    high = self.accelerator.gather(out.high_clipped.float())
    metrics["clip_ratio/low_mean"].append(low.nanmean().item())
    metrics["clip_ratio/low_min"].append(nanmin(low).item())
    metrics["clip_ratio/high_mean"].append(high.nanmean().item())
    metrics["clip_ratio/high_max"].append(nanmax(high).item())
    region = self.accelerator.gather((out.low_clipped | out.high_clipped).float())
    metrics["clip_ratio/region_mean"].append(region.nanmean().item())
    return out.loss


# --- 7. GKD ---------------------------------------------------------------------------------------


def gkd_compute_loss(
    self: Any, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
) -> Any:
    """``GKDTrainer.compute_loss`` on :func:`fk.align.fused_linear_distill_from_logits`: TRL's
    generalized JSD (``beta``; 0 is forward KL, 1 reverse KL) at temperature 1, over the labelled
    tokens, divided by ``num_items_in_batch`` when the Trainer passes it, else by their count."""
    if return_outputs:
        _warn_once(self, "return_outputs=True")
        return _stock(self, "compute_loss")(model, inputs, return_outputs, num_items_in_batch)
    self.teacher_model.eval()
    with torch.no_grad():
        teacher_logits = self.teacher_model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).logits
    labels = inputs["labels"]

    def loss_fn(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return align.fused_linear_distill_from_logits(
            hidden[:, :-1], weight, teacher_logits[:, :-1], labels[:, 1:].to(hidden.device), loss="jsd",
            beta=self.beta, student_bias=bias, num_items_in_batch=num_items_in_batch,
        )  # fmt: skip

    return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **{HEAD_KWARG: loss_fn})


_LOSSES: dict[str, Callable[..., Any]] = {"dpo": dpo_compute_loss, "kto": kto_compute_loss, "grpo": grpo_compute_loss,
                                           "rloo": rloo_compute_loss, "gkd": gkd_compute_loss}  # fmt: skip


# --- 8. The switch --------------------------------------------------------------------------------


FROZEN_MODELS = ("ref_model", "teacher_model")
"""The trainer attributes of the models that run without gradient every step (DPO's, KTO's,
GRPO's and RLOO's reference, GKD's teacher): :func:`align_trainer` patches their blocks too (not their heads: TRL
computes their log-probabilities or logits with its own head code, over the patched decoder)."""


def align_trainer(trainer: Any, switches: dict[str, bool]) -> Any:
    """See :func:`fk.hf.align_trainer`."""
    from fk.hf import apply
    from fk.hf.patcher import patched_modules

    found = trainer_kind(trainer)
    if found is None:
        raise TypeError(
            f"trainer must be a TRL DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer or GKDTrainer (or a subclass), got "
            f"{type(trainer).__name__}; the transformers Trainer and SFTTrainer take fk.hf.FkCallback()"
        )
    kind, method = found
    if STATE in trainer.__dict__:
        return trainer
    if not any(patched_modules(trainer.model).values()):
        apply(trainer.model, **switches)
    for name in FROZEN_MODELS:
        frozen = getattr(trainer, name, None)
        frozen = trainer.accelerator.unwrap_model(frozen) if frozen is not None else None
        if isinstance(frozen, torch.nn.Module) and not any(patched_modules(frozen).values()):
            apply(frozen, **{**switches, "flce": False, "lora": False})
    unsupported = unsupported_settings(trainer, kind, method)
    if unsupported:
        log.warning("fk.hf.align_trainer: %s keeps its own loss: fk-align does not compute %s",
                    type(trainer).__name__, "; ".join(unsupported))  # fmt: skip
        trainer.__dict__[STATE] = None
        return trainer
    install_head(trainer.model)
    setattr(trainer, method, types.MethodType(_LOSSES[kind], trainer))
    trainer.__dict__[STATE] = kind
    log.info("fk.hf.align_trainer: %s computes its loss with fk.align (%s)", type(trainer).__name__, kind)
    return trainer
