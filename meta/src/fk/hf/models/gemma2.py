"""Gemma 2: Gemma2RMSNorm (gemma casting, ``1 + weight``) including the sandwich norms around
attention and the MLP, Gemma2MLP (GeGLU), Gemma2Attention's rotary embedding and
Gemma2ForCausalLM's loss with the final logit softcapping (``config.final_logit_softcapping``).

The attention-logit softcapping is inside the attention, which stays stock (only its rotary
embedding is fk's); the embedding scaling and the tied head are stock too."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="gemma2",
    modeling_module="transformers.models.gemma2.modeling_gemma2",
    rms_norm=("Gemma2RMSNorm",),
    mlp=("Gemma2MLP",),
    attention=("Gemma2Attention",),
    causal_lm=("Gemma2ForCausalLM",),
    casting_mode="gemma",
    offset=1.0,
    eps_attr="eps",
    activation_attr="hidden_activation",
    logit_softcapping=True,
)
