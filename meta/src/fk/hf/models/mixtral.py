"""Mixtral: MixtralRMSNorm (llama casting), MixtralAttention's rotary embedding and
MixtralForCausalLM's loss, with the router's load-balancing loss (``aux_loss``, times
``router_aux_loss_coef``) added as stock adds it when ``output_router_logits`` is set.

The sparse MoE block stays stock: its router, and its experts, which are one MixtralExperts module
holding every expert's weights as 3D tensors (``gate_up_proj``, ``down_proj``) and looping over
the experts a batch hits, not one gated-MLP module per expert that the ``swiglu`` patch could
take."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="mixtral",
    modeling_module="transformers.models.mixtral.modeling_mixtral",
    rms_norm=("MixtralRMSNorm",),
    mlp=(),
    attention=("MixtralAttention",),
    causal_lm=("MixtralForCausalLM",),
    router_aux_loss=True,
)
