"""Qwen3-MoE: Qwen3MoeRMSNorm (llama casting) including the per-head ``q_norm``/``k_norm``,
Qwen3MoeMLP (SwiGLU: the dense MLP of the layers listed in ``mlp_only_layers`` or left out by
``decoder_sparse_step``), Qwen3MoeAttention's rotary embedding and Qwen3MoeForCausalLM's loss, with
the router's load-balancing loss (``aux_loss``, times ``router_aux_loss_coef``) added as stock
adds it when ``output_router_logits`` is set.

The sparse MoE blocks stay stock: their router, and their experts, which are one Qwen3MoeExperts
module holding every expert's weights as 3D tensors, not one gated-MLP module per expert."""

from fk.hf.patching import ModelPatch

PATCH = ModelPatch(
    model_type="qwen3_moe",
    modeling_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    rms_norm=("Qwen3MoeRMSNorm",),
    mlp=("Qwen3MoeMLP",),
    attention=("Qwen3MoeAttention",),
    causal_lm=("Qwen3MoeForCausalLM",),
    router_aux_loss=True,
)
