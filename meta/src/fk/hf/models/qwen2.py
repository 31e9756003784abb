"""Qwen2: Qwen2RMSNorm (llama casting), Qwen2MLP (SwiGLU), Qwen2Attention's rotary embedding and
Qwen2ForCausalLM's loss."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="qwen2",
    modeling_module="transformers.models.qwen2.modeling_qwen2",
    rms_norm=("Qwen2RMSNorm",),
    mlp=("Qwen2MLP",),
    attention=("Qwen2Attention",),
    causal_lm=("Qwen2ForCausalLM",),
)
