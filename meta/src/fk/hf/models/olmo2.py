"""OLMo 2: Olmo2RMSNorm including the norms after attention and after the MLP (there are none
before them) and ``q_norm``/``k_norm`` over the whole q and k projections (all heads at once),
Olmo2MLP (SwiGLU), Olmo2Attention's rotary embedding and Olmo2ForCausalLM's loss.

Olmo2RMSNorm computes ``w * (x * rsqrt(mean(x^2) + eps))`` in fp32 and rounds once: fk.norms'
gemma casting with no offset (``casting_mode="gemma", offset=0``), not Llama's."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="olmo2",
    modeling_module="transformers.models.olmo2.modeling_olmo2",
    rms_norm=("Olmo2RMSNorm",),
    mlp=("Olmo2MLP",),
    attention=("Olmo2Attention",),
    causal_lm=("Olmo2ForCausalLM",),
    casting_mode="gemma",
    offset=0.0,
)
