"""StableLM: ``torch.nn.LayerNorm`` (with bias; before attention and MLP, or one before both with
the parallel residual, the final norm, and the optional per-head q/k LayerNorms without bias),
StableLmMLP (SwiGLU), StableLmAttention's partial rotary embedding (a quarter of each head by
default: its ``apply_rotary_pos_emb`` gets the rotated slices of q and k, which fk's rope reads in
place) and StableLmForCausalLM's loss."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="stablelm",
    modeling_module="transformers.models.stablelm.modeling_stablelm",
    rms_norm=(),
    layer_norm=("torch.nn.LayerNorm",),
    mlp=("StableLmMLP",),
    attention=("StableLmAttention",),
    causal_lm=("StableLmForCausalLM",),
)
