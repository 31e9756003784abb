"""Granite: GraniteRMSNorm (llama casting), GraniteMLP (SwiGLU), GraniteAttention's rotary
embedding and GraniteForCausalLM's loss, whose logits are divided by ``config.logits_scaling``:
the fused loss takes the final hidden states divided by it (``(h / s) W^T = (h W^T) / s``).

Granite's other multipliers stay where stock applies them: ``embedding_multiplier`` in the model's
forward, ``residual_multiplier`` in the decoder layer's, ``attention_multiplier`` as the
attention's softmax scale (the attention is stock but for its rotary embedding)."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="granite",
    modeling_module="transformers.models.granite.modeling_granite",
    rms_norm=("GraniteRMSNorm",),
    mlp=("GraniteMLP",),
    attention=("GraniteAttention",),
    causal_lm=("GraniteForCausalLM",),
    logits_scaling=True,
)
