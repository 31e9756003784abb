"""fk.glu: fused gated activations (SwiGLU, GeGLU) for LLM training.

- :func:`swiglu` / :func:`geglu` / :func:`gated_act`: ``act(gate) * up`` of two tensors.
- :func:`swiglu_fused` / :func:`geglu_fused` / :func:`gated_act_fused`: the same of one fused
  ``gate_up`` tensor (gate in the first half of the last dimension), read without a copy.
- :class:`GatedMLP`: gate/up/down projections, state_dict-compatible with Hugging Face's LlamaMLP
  and GemmaMLP.
"""

from fk.glu.glu import (
    ACTIVATIONS,
    HF_ACTIVATIONS,
    GatedMLP,
    gated_act,
    gated_act_fused,
    gated_act_fused_ref,
    gated_act_ref,
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
    "gated_act",
    "gated_act_fused",
    "gated_act_fused_ref",
    "gated_act_ref",
    "geglu",
    "geglu_fused",
    "geglu_ref",
    "resolve_activation",
    "swiglu",
    "swiglu_fused",
    "swiglu_ref",
]
