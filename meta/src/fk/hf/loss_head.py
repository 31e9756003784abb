"""The causal-LM head and its loss (the ``flce`` switch): in training with labels, the loss comes
from :func:`fk.flce.linear_cross_entropy` on the final hidden states, without the ``[tokens, vocab]``
logits; a tied input embedding takes the head's gradient in place."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fk.core.forward import has_hooks
from fk.hf.marks import LOSS_OPTIONS, PLAN
from fk.hf.recognize import HeadPlan
from fk.hf.sharding_hooks import is_dtensor, is_zero3_parameter, is_zero3_partitioned, plain_linear, run_as_forward


def _keep_last(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # transformers before 5.20: positions as one 1-D index, as its stock forwards
        return hidden_states[:, logits_to_keep, :]
    return slice_logits_to_keep(hidden_states, logits_to_keep)


ZERO3_MEMORY_BUDGET = 64 << 20
"""fk-flce's ``memory_budget`` by default where the head's weight is a DeepSpeed ZeRO-3 parameter:
logits in chunks of 64 MiB (fk-flce's own default, 4 GiB, keeps the logits' gradient of a batch
whole from the forward to the backward), with the head's gradient summed across chunks in the
weight's dtype (``accum_dtype``), as Liger Kernel sums it, not in an fp32 buffer the size of the
weight. Under ZeRO-3 the optimizer states and gradients are sharded and no longer hide those
buffers under a larger peak, and the step waits on the host and on the all-gathers, not on the
loss. 2 x H200, Llama-3.2-1B shape, 4 x 2048 tokens a GPU: 23.9 GiB a GPU with fk-flce's
defaults, 22.06 with 128 MiB chunks, 22.03 with 64 MiB, Liger's to the byte (Liger's chunks are
256 rows of logits, 66 MB; ``benchmarks/experiments/INDEX.md#zero3_step_floor``). Options set
through :func:`fk.hf.loss_options` replace these defaults."""


def loss_defaults(head_weight: torch.Tensor) -> dict[str, Any]:
    """The fused loss's options where :func:`fk.hf.loss_options` set none: fk-flce's defaults, or
    under DeepSpeed ZeRO-3 :data:`ZERO3_MEMORY_BUDGET` and the weight's dtype for the sum."""
    if is_zero3_parameter(head_weight):
        return {"memory_budget": ZERO3_MEMORY_BUDGET, "accum_dtype": head_weight.dtype}
    return {}


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
    extra_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` of ``lm_head(hidden_states)`` without the logits.

    As stock: position t is scored against ``labels[:, t + 1]`` (or against ``shift_labels[:, t]``
    when given), ``ignore_index`` labels are left out, and with ``num_items_in_batch`` the summed
    loss is divided by it instead of by the count of scored tokens; ``softcap`` soft-caps the logits
    first (``softcap * tanh(logits / softcap)``). Under autocast, the hidden states and head weight
    are cast to autocast's dtype first, as stock's ``lm_head`` would. ``options`` are more keyword
    arguments of :func:`fk.flce.linear_cross_entropy` (``memory_budget``, ``accum_dtype``; see
    :func:`fk.hf.loss_options`; where none are set, :func:`loss_defaults`). ``weight``, when given,
    stands for ``lm_head.weight`` (an alias of it whose gradient goes elsewhere:
    :class:`_TiedHeadWeight`). ``extra_bias`` ``(V,)``, when given, is added to the head's bias (the
    BART family's ``final_logits_bias``, which the logits get after the head).
    """
    from fk.flce import linear_cross_entropy

    target, shift = (shift_labels, False) if shift_labels is not None else (labels, True)

    def loss_forward(head: Any, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        head_weight: torch.Tensor = head.weight if weight is None else weight
        bias: torch.Tensor | None = getattr(head, "bias", None)
        if extra_bias is not None:
            extra = extra_bias.to(device=head_weight.device, dtype=head_weight.dtype)
            bias = extra if bias is None else bias + extra
        if is_dtensor(head_weight):
            raise TypeError(
                "lm_head.weight is a sharded DTensor where fk's fused loss reads it: FSDP2 unshards a "
                "parameter only around the forward of the module fully_shard was given. Shard a tied head "
                "with its embedding as one group, fully_shard([model.model.embed_tokens, model.lm_head]), or leave "
                "the head to the root's fully_shard(model)"
            )
        if is_zero3_partitioned(head_weight):
            raise TypeError(
                "lm_head.weight is a DeepSpeed ZeRO-3 partition (not gathered) where fk's fused loss reads it: "
                "ZeRO-3 gathers a parameter only around the forward of its module, and this head carries none of "
                "its hooks. Train the model through the engine deepspeed.initialize returns (or through "
                "accelerate or the Trainer), or gather the weight with deepspeed.zero.GatheredParameters"
            )
        chosen = options or loss_defaults(head.weight)  # the module's own parameter, not a tied alias
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            hidden, head_weight = hidden.to(dtype), head_weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            loss: torch.Tensor = linear_cross_entropy(
                hidden, head_weight, target, bias, ignore_index=ignore_index, shift=shift,
                num_items_in_batch=num_items_in_batch, softcap=softcap, **chosen,
            )  # fmt: skip
        return loss

    target = target.to(hidden_states.device)
    if lm_head._forward_pre_hooks or lm_head._forward_hooks:  # FSDP2's or ZeRO-3's (see plain_linear): run them
        return run_as_forward(lm_head, loss_forward, hidden_states, target)
    return loss_forward(lm_head, hidden_states, target)


def causal_lm_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The causal-LM forward of Llama-form models (see :func:`fk.hf.recognize.head_candidate`), with
    the loss from fused linear cross entropy (:func:`_fused_forward`). Positional arguments bind as
    the stock forward's parameters are ordered (:attr:`fk.hf.recognize.HeadPlan.positional`): a
    model called as ``model(input_ids, cache)`` (GPT-2's order) or ``model(input_ids, mask)``
    (Llama's) gets what stock gives it."""
    if args:
        names = self.__dict__[PLAN].positional
        if len(args) > len(names):
            raise TypeError(f"forward() takes at most {len(names)} positional arguments after self, got {len(args)}")
        for name, value in zip(names, args, strict=False):
            if name in kwargs:
                raise TypeError(f"forward() got multiple values for argument {name!r}")
            kwargs[name] = value
    return _fused_forward(self, **kwargs)


def _fused_forward(
    self: Any,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    skip_logits: bool | None = None,
    **kwargs: Any,
) -> Any:
    """:func:`causal_lm_forward` with its arguments by name.

    Same arguments and outputs as stock, plus ``skip_logits``: when true, the loss comes from
    :func:`fused_causal_lm_loss` and ``logits`` is None (never materialized); when false, the
    logits are computed and the loss (if ``labels`` are given) is stock's. It defaults to true
    exactly when the model is in training mode and ``labels`` are given, so evaluation (and
    ``generate``) get their logits as stock. ``skip_logits=True`` without labels raises.
    ``num_items_in_batch``, ``ignore_index`` and ``shift_labels`` are read from ``kwargs`` as
    stock's loss reads them. The head's extras, as its plan found them in the stock forward, are
    computed on both paths as stock computes them: ``config.final_logit_softcapping`` (Gemma 2 and
    3), the divisor ``config.logits_scaling`` (Granite), the factor ``self.logit_scale`` (Cohere),
    ``self.model.lm_head_multiplier`` (Falcon-H1) or ``text_config.output_multiplier`` (Muse
    Glimmer; on the fused path the hidden states are scaled instead: ``(h s) W^T = (h W^T) s``),
    the hidden states cast to the head's dtype and the logits to fp32 (Mamba, HunYuan V4), the
    head's ``out_features`` as the loss's vocabulary size (Apertus 1.5), the BART family's unshifted
    ``CrossEntropyLoss()`` (position t against ``labels[:, t]``, the mean over labels not -100;
    ``num_items_in_batch``, ``shift_labels`` and ``ignore_index`` not read, as stock's reads none of
    them: :attr:`HeadPlan.unshifted_labels`), and a mixture of experts'
    load-balancing loss (the modeling module's ``load_balancing_loss_func``, times ``router_aux_loss_coef`` or JetMoe's
    ``aux_loss_coef``, added where stock adds it), each read from the text config of a
    vision-language model's composite config where the head has no attribute of that name. ``labels`` and ``logits_to_keep`` go to the decoder
    too where the stock forward hands them to it (:attr:`HeadPlan.handed_on`: Gemma 3's and 4's
    image masks read the labels; Gemma 4's decoder drops positions itself). The cache goes to the
    decoder under the name the installed transformers gives it (``cache`` from 5.24,
    ``past_key_values`` before); either name is taken. ``return_dict=False`` gives a
    tuple, as stock. A head that is not a plain ``nn.Linear`` (see :func:`plain_linear`: a
    LoRA-wrapped or quantized head) always takes the stock path, logits included.

    On the fused path the model builds no key/value cache unless the caller asks for one
    (``use_cache=True``) or passes one: with ``config.use_cache`` true, as
    most configs have it, stock's training forward copies every layer's keys and values into a
    new cache that nothing reads (two concatenations a layer: 0.9 ms of a 116 ms Llama-3.2-1B
    step on an H200, ``benchmarks/experiments/INDEX.md#e2e_probes-copies``); the cache
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
    plan: HeadPlan = self.__dict__[PLAN]
    text_config = _text_config(self.config)
    cache = kwargs.pop("cache", None)
    legacy_cache = kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy_cache
    if skip_logits is None:
        skip_logits = self.training and labels is not None
    if skip_logits and labels is None:
        raise ValueError("skip_logits=True needs labels: without them there is nothing to compute but the logits")
    skip_logits = skip_logits and plain_linear(self.lm_head)
    if skip_logits and use_cache is None and cache is None:
        use_cache = False  # (see the docstring: a cache nothing reads)
    tied: _TiedGradient | None = None
    if skip_logits and input_ids is not None and inputs_embeds is None and _tied_embedding(self):
        embed, tied = self.get_input_embeddings(), _TiedGradient()
        inputs_embeds = _TiedEmbedding.apply(input_ids, embed.weight, tied, embed.padding_idx)
        input_ids = None
    moe: dict[str, Any] = {}
    router_logits = kwargs.pop("output_router_logits", None)
    if plan.router_logits_arg:
        moe["output_router_logits"] = text_config.output_router_logits if router_logits is None else router_logits
    handed = {name: value for name, value in (("labels", labels), ("logits_to_keep", logits_to_keep))
              if name in plan.handed_on}  # fmt: skip
    if not plan.logits_to_keep:  # (where stock's forward takes none: in its **kwargs, as stock's)
        if not isinstance(logits_to_keep, int) or logits_to_keep != 0:
            kwargs["logits_to_keep"] = logits_to_keep
        logits_to_keep = 0
    if plan.position_ids:
        handed["position_ids"] = position_ids
    elif position_ids is not None:  # (where stock's forward takes none: in its **kwargs, as stock's)
        kwargs["position_ids"] = position_ids
    if plan.decoder_return_dict:
        handed["return_dict"] = True
    decoder = operator.attrgetter(plan.backbone)(self)
    outputs = decoder(
        input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
        use_cache=use_cache, **{plan.cache_arg: cache}, **moe, **handed, **kwargs,
    )  # fmt: skip
    hidden_states = outputs.last_hidden_state
    given = input_ids if input_ids is not None else inputs_embeds
    if "logits_to_keep" not in handed or given is None or hidden_states.shape[1] == given.shape[1]:
        hidden_states = _keep_last(hidden_states, logits_to_keep)  # (unless the decoder did, as stock reads it)
    softcap = getattr(text_config, "final_logit_softcapping", None) if plan.softcap else None
    divisor = text_config.logits_scaling if plan.divide_by_config else None
    factor = self.logit_scale if plan.multiply_by_logit_scale else None
    if plan.multiply_by_head_multiplier:
        factor = decoder.lm_head_multiplier
    if plan.multiply_by_output_multiplier:
        factor = text_config.output_multiplier
    logits = loss = None
    if plan.cast_to_head:  # (Mamba's and HunYuan V4's heads: their input in the head's dtype)
        hidden_states = hidden_states.to(self.lm_head.weight.dtype)
    loss_kwargs = {"shift_labels": kwargs.get("shift_labels"), "num_items_in_batch": kwargs.get("num_items_in_batch"),
                   "ignore_index": kwargs.get("ignore_index", -100)}  # fmt: skip
    if plan.unshifted_labels:  # (the BART family's CrossEntropyLoss(): labels[:, t] for position t, the mean)
        loss_kwargs = {"shift_labels": labels, "num_items_in_batch": None, "ignore_index": -100}
    if skip_logits:
        assert labels is not None
        scaled = hidden_states if divisor is None else hidden_states / divisor
        scaled = scaled if factor is None else scaled * factor
        loss = fused_causal_lm_loss(
            scaled, self.lm_head, labels, **loss_kwargs, softcap=softcap, options=self.__dict__.get(LOSS_OPTIONS),
            weight=_TiedHeadWeight.apply(self.lm_head.weight, tied) if tied is not None else None,
        )  # fmt: skip
    else:
        logits = self.lm_head(hidden_states)
        logits = logits.float() if plan.float_logits else logits
        if divisor is not None:  # as stock computes it
            logits = logits / divisor
        if factor is not None:
            logits = logits * factor
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        vocab = self.lm_head.out_features if plan.vocab_from_head else text_config.vocab_size
        if labels is not None and plan.unshifted_labels:
            loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), labels.to(logits.device).view(-1))
        elif labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=vocab, **kwargs)
    aux_loss = None
    if plan.aux_loss is not None and moe.get("output_router_logits", router_logits):
        experts, per_token, weight = (_moe_setting(self, text_config, name) for name in
                                      ("num_experts", "num_experts_per_tok", plan.aux_loss_weight))  # fmt: skip
        aux_loss = plan.aux_loss(outputs.router_logits, experts, per_token, attention_mask)
        if loss is not None:
            loss = loss + weight * aux_loss.to(loss.device)
    return _output(plan, outputs, loss=loss, logits=logits, aux_loss=aux_loss)


def causal_lm_forward_as(stock: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`causal_lm_forward` under the parameters of ``stock`` (the causal LM's own forward),
    ``skip_logits`` added: HF Trainer (``remove_unused_columns``) keeps the dataset columns a
    model's forward names, and a vision-language model's names its ``pixel_values``,
    ``image_grid_thw``, ``token_type_ids``, ... (which :func:`_fused_forward` takes in its
    ``**kwargs``): with ``_fused_forward``'s parameters the Trainer would drop the images."""

    @functools.wraps(causal_lm_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return causal_lm_forward(self, *args, **kwargs)

    forward.__signature__ = with_skip_logits(stock)  # type: ignore[attr-defined]
    return forward


def with_skip_logits(stock: Callable[..., Any]) -> inspect.Signature:
    """The signature of the stock forward ``stock`` with a keyword-only ``skip_logits=None`` added
    (before its ``**kwargs``), as fk's fused-head forwards show theirs."""
    parameters = list(inspect.signature(stock).parameters.values())
    if "skip_logits" not in (p.name for p in parameters):
        at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
        parameters.insert(at, inspect.Parameter("skip_logits", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(parameters)


def _text_config(config: Any) -> Any:
    """A composite (vision-language) config's text config, where the vocabulary size and the
    head's extras are; any other config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _moe_setting(model: Any, text_config: Any, name: str) -> Any:
    """A mixture of experts' setting as its head reads it: the head's attribute (Mixtral's
    ``num_experts``), else its text config's (Qwen3-VL-MoE's ``config.text_config.num_experts``)."""
    return getattr(model, name) if hasattr(model, name) else getattr(text_config, name)


def _output(plan: HeadPlan, outputs: Any, **computed: Any) -> Any:
    """An instance of the head's output class: the ``computed`` fields it has, and every other
    field of it taken from the decoder's ``outputs`` by name (the cache, hidden states, attentions,
    router logits)."""
    fields = {n: computed[n] if n in computed else getattr(outputs, n, None) for n in plan.output_fields}
    return plan.output_class(**fields)


def _tied_embedding(model: Any) -> bool:
    """Whether ``model`` (a causal LM on the fused path) hands its head's gradient to its input
    embedding (:class:`_TiedEmbedding`): the embedding is a plain ``torch.nn.Embedding`` (no
    subclass: Gemma's scales its output) without hooks (FSDP2's unsharding), ``max_norm`` or
    ``scale_grad_by_freq``, its weight is the head's, trainable and not sharded, and the head has
    no hooks either. Not while ``torch.compile`` traces, nor without grad mode (no backward), nor
    in a vision-language model (a composite config), whose decoder finds its image tokens in the
    input ids."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if _text_config(model.config) is not model.config:
        return False
    embed = model.get_input_embeddings()
    if type(embed) is not torch.nn.Embedding or has_hooks(embed) or has_hooks(model.lm_head):
        return False
    if embed.max_norm is not None or embed.scale_grad_by_freq:
        return False
    weight = embed.weight
    return weight is getattr(model.lm_head, "weight", None) and weight.requires_grad and not is_dtensor(weight)


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
