"""Qwen3: Qwen3RMSNorm (llama casting), Qwen3MLP (SwiGLU), Qwen3Attention's rotary embedding and
Qwen3ForCausalLM's loss.

Qwen3 also normalizes each head of q and k (``q_norm``/``k_norm``, Qwen3RMSNorm over ``head_dim``):
those are patched like the other RMSNorms."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="qwen3",
    modeling_module="transformers.models.qwen3.modeling_qwen3",
    rms_norm=("Qwen3RMSNorm",),
    mlp=("Qwen3MLP",),
    attention=("Qwen3Attention",),
    causal_lm=("Qwen3ForCausalLM",),
)
