"""fk-patched models under DDP and FSDP2.

- DDP: wrap the patched model as any model (``DistributedDataParallel(model)``). The fused loss
  reads the head's own parameter, so its gradient is reduced with the others.
- FSDP2 (``torch.distributed.fsdp.fully_shard``): patch first (:func:`fk.hf.apply`), then shard
  as usual, for example with :func:`fully_shard_causal_lm`. When the head is in the root's group
  (``fully_shard(model)``), the root's hooks have gathered it before the patched forward reads it.
  When the head is sharded on its own (``fully_shard(model.lm_head)``, or with a tied embedding
  ``fully_shard([embed_tokens, lm_head])``), the fused loss runs as the head's forward, inside
  FSDP2's hooks (see :func:`fk.hf.sharding_hooks.run_as_forward`): the full weight is gathered for the
  loss and freed after it, and the weight's gradient is reduce-scattered into the shards as
  after a stock ``lm_head(h)``. A ``MixedPrecisionPolicy`` holds as for stock: the loss computes
  in ``param_dtype``; the gradients are reduced in ``reduce_dtype``.
- Tensor parallelism of the vocabulary: :func:`fk.flce.vocab_parallel_linear_cross_entropy` (a
  function for training code that shards the head itself; fk.hf does not shard models).
"""

from __future__ import annotations

from typing import Any

import torch


def _parts(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module], torch.nn.Module, torch.nn.Module]:
    """(the transformers model under any PEFT wrapper, its decoder layers, input embedding, head)."""
    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(base).__name__} has no model.layers: not a causal LM fk.hf knows how to shard")
    return base, list(layers), base.get_input_embeddings(), base.get_output_embeddings()


def fully_shard_causal_lm(
    model: torch.nn.Module,
    *,
    separate_head: bool = False,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    mesh: Any = None,
) -> torch.nn.Module:
    """FSDP2 on a (patched or stock) causal LM, in the usual recipe: ``fully_shard`` on each decoder
    layer, then on the head if ``separate_head`` (with the input embedding as one group when the
    two share their weight), then on the whole model (the root). Returns ``model``, sharded in place.

    ``mp_policy`` (a ``MixedPrecisionPolicy``), ``reshard_after_forward`` and ``mesh`` go to every
    ``fully_shard`` call.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mp_policy": mp_policy or MixedPrecisionPolicy(), "mesh": mesh}
    _base, layers, embed, head = _parts(model)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    if separate_head:
        tied = head.weight is embed.weight
        fully_shard([embed, head] if tied else head, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    return model
