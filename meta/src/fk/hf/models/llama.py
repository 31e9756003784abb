"""Llama: LlamaRMSNorm (llama casting), LlamaMLP (SwiGLU), LlamaAttention's rotary embedding and
LlamaForCausalLM's loss."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="llama",
    modeling_module="transformers.models.llama.modeling_llama",
    rms_norm=("LlamaRMSNorm",),
    mlp=("LlamaMLP",),
    attention=("LlamaAttention",),
    causal_lm=("LlamaForCausalLM",),
)
