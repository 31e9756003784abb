"""Phi-3: Phi3RMSNorm (llama casting), Phi3MLP (SwiGLU on its fused ``gate_up_proj``, through
:func:`fk.glu.swiglu_fused`, gate in the first half, read without a copy), Phi3Attention's rotary
embedding and Phi3ForCausalLM's loss.

The attention's fused ``qkv_proj`` and its split into q, k and v stay stock; the split q and k go
through ``apply_rotary_pos_emb`` as Llama's do, so fk's rope replaces it, including a partial
rotary embedding (``partial_rotary_factor`` below 1: the leading features rotate, the rest pass
through, as stock). The residual dropouts are stock."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="phi3",
    modeling_module="transformers.models.phi3.modeling_phi3",
    rms_norm=("Phi3RMSNorm",),
    mlp=("Phi3MLP",),
    attention=("Phi3Attention",),
    causal_lm=("Phi3ForCausalLM",),
)
