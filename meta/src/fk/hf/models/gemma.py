"""Gemma: GemmaRMSNorm (gemma casting: ``1 + weight``, all in fp32, rounded once), GemmaMLP
(GeGLU, ``gelu_pytorch_tanh``), GemmaAttention's rotary embedding and GemmaForCausalLM's loss.

The embedding's ``sqrt(hidden_size)`` scaling and the tied head are stock."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="gemma",
    modeling_module="transformers.models.gemma.modeling_gemma",
    rms_norm=("GemmaRMSNorm",),
    mlp=("GemmaMLP",),
    attention=("GemmaAttention",),
    causal_lm=("GemmaForCausalLM",),
    casting_mode="gemma",
    offset=1.0,
    eps_attr="eps",
)
