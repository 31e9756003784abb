"""Mistral: MistralRMSNorm (llama casting), MistralMLP (SwiGLU), MistralAttention's rotary embedding and
MistralForCausalLM's loss."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="mistral",
    modeling_module="transformers.models.mistral.modeling_mistral",
    rms_norm=("MistralRMSNorm",),
    mlp=("MistralMLP",),
    attention=("MistralAttention",),
    causal_lm=("MistralForCausalLM",),
)
