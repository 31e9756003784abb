"""Gemma 3 (text, ``gemma3_text``): Gemma3RMSNorm (gemma casting, ``1 + weight``) including the
sandwich norms and the per-head ``q_norm``/``k_norm``, Gemma3MLP (GeGLU), Gemma3Attention's
rotary embedding and Gemma3ForCausalLM's loss with ``config.final_logit_softcapping`` when set.

The local (sliding-window) and global layers use different rotary tables, but the model computes
both and hands each attention its ``(cos, sin)``; the attention applies them with
``apply_rotary_pos_emb`` as Llama's does, so fk's rope patch applies to both kinds of layer. The
attention itself, the embedding scaling and the tied head are stock. The multimodal
``Gemma3ForConditionalGeneration`` (model type ``gemma3``) is not covered."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="gemma3_text",
    modeling_module="transformers.models.gemma3.modeling_gemma3",
    rms_norm=("Gemma3RMSNorm",),
    mlp=("Gemma3MLP",),
    attention=("Gemma3Attention",),
    causal_lm=("Gemma3ForCausalLM",),
    casting_mode="gemma",
    offset=1.0,
    eps_attr="eps",
    activation_attr="hidden_activation",
    logit_softcapping=True,
)
