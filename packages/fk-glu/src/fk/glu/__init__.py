"""fk.glu: fused gated activations (SwiGLU, GeGLU) for LLM training.

- :func:`swiglu` / :func:`geglu` / :func:`gated_act`: ``act(gate) * up`` of two tensors.
- :func:`swiglu_fused` / :func:`geglu_fused` / :func:`gated_act_fused`: the same of one fused
  ``gate_up`` tensor (gate in the first half of the last dimension), read without a copy.
- :func:`gated_mlp`: ``down(act(x Wg^T) * (x Wu^T))`` without keeping ``act(gate) * up`` for the
  backward (recomputed there).
- :func:`gated_act_forward` / :func:`gated_act_backward`: the activation and its gradients with no
  autograd node, for use inside other autograd Functions (fk.lora's LoRA MLP);
  :func:`gated_act_backward_with_value` also recomputes the activation in the same pass.
- :func:`activation_and_derivative` (a ``triton.jit`` function) and :func:`activation_code`: the
  activation and its derivative in fp32 registers, for other packages' kernels that fuse them.
- :class:`GatedMLP`: gate/up/down projections, state_dict-compatible with Hugging Face's LlamaMLP
  and GemmaMLP.
"""

from fk.glu.glu import (
    ACTIVATIONS,
    HF_ACTIVATIONS,
    GatedMLP,
    activation_and_derivative,
    activation_code,
    gated_act,
    gated_act_backward,
    gated_act_backward_ref,
    gated_act_backward_with_value,
    gated_act_forward,
    gated_act_fused,
    gated_act_fused_ref,
    gated_act_ref,
    gated_mlp,
    gated_mlp_ref,
    geglu,
    geglu_fused,
    geglu_ref,
    resolve_activation,
    swiglu,
    swiglu_fused,
    swiglu_ref,
)

__all__ = [
    "ACTIVATIONS",
    "HF_ACTIVATIONS",
    "GatedMLP",
    "activation_and_derivative",
    "activation_code",
    "gated_act",
    "gated_act_backward",
    "gated_act_backward_ref",
    "gated_act_backward_with_value",
    "gated_act_forward",
    "gated_act_fused",
    "gated_act_fused_ref",
    "gated_act_ref",
    "gated_mlp",
    "gated_mlp_ref",
    "geglu",
    "geglu_fused",
    "geglu_ref",
    "resolve_activation",
    "swiglu",
    "swiglu_fused",
    "swiglu_ref",
]
