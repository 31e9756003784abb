"""fk.lora: fused LoRA projections (PEFT semantics) and a patcher for PEFT models.

- :func:`lora_linear` / :func:`lora_o`: one LoRA linear layer, base matmul and LoRA branch in one
  output buffer, rank-sized intermediates only.
  With ``magnitude``: DoRA (PEFT ``use_dora=True``), here, in :func:`lora_qkv` and :func:`lora_mlp`.
- :func:`lora_qkv` / :func:`lora_projections`: several projections of one input (q, k, v), one
  ``dx`` in the backward.
- :func:`lora_mlp`: gate/up/down LoRA projections around fk.glu's SwiGLU/GeGLU kernel, the
  activation recomputed in the backward instead of saved.
- :func:`patch` / :func:`unpatch`: swap the forward of a PEFT model's LoRA modules (needs ``peft``).
- :func:`dequantize` / :func:`dequantize_rows`: QLoRA base weights (bitsandbytes NF4, FP4, int8,
  read by :func:`from_bnb` into a :class:`QuantizedWeight`) in the compute dtype, a tile of rows at a
  time. Every function above takes a 4-bit :class:`QuantizedWeight` as a base weight (plain LoRA or DoRA),
  or a bitsandbytes LLM.int8() layer as an :class:`Int8Base` (:func:`int8_base`; plain LoRA,
  outside autocast): the layer's own product gives the base output, its dequantized weight ``dx``.
"""

from fk.lora.lora import (
    MLP_ACTIVATIONS,
    LoRAWeights,
    lora_linear,
    lora_linear_ref,
    lora_mlp,
    lora_mlp_ref,
    lora_o,
    lora_projections,
    lora_qkv,
)
from fk.lora.patching import PatchReport, is_patched, patch, unpatch

# Quantized (QLoRA) base weights.
from fk.lora.quant import (
    Int8Base,
    NestedAbsmax,
    QuantizedWeight,
    dequantize,
    dequantize_ref,
    dequantize_rows,
    from_bnb,
    int8_base,
    quantize_ref,
)

__all__ = [
    "MLP_ACTIVATIONS",
    "LoRAWeights",
    "PatchReport",
    "is_patched",
    "lora_linear",
    "lora_linear_ref",
    "lora_mlp",
    "lora_mlp_ref",
    "lora_o",
    "lora_projections",
    "lora_qkv",
    "patch",
    "unpatch",
]

__all__ += [  # quantized (QLoRA) base weights
    "Int8Base",
    "NestedAbsmax",
    "QuantizedWeight",
    "dequantize",
    "dequantize_ref",
    "dequantize_rows",
    "from_bnb",
    "int8_base",
    "quantize_ref",
]
