"""fk.norms: fused normalization kernels for LLM training.

- :func:`rms_norm` / :class:`RMSNorm`: RMSNorm with "llama" and "gemma" casting, any row width.
- :func:`fused_add_rms_norm` / :class:`FusedAddRMSNorm`: ``s = x + residual; (rms_norm(s), s)`` in one pass.
- :func:`group_norm` / :class:`GroupNorm`: GroupNorm of ``(N, C, *)`` inputs, per-channel affine.
- :func:`layer_norm` / :class:`LayerNorm`: LayerNorm with or without weight and bias, any row width.
"""

from fk.norms.fused_add_rms_norm import FusedAddRMSNorm, fused_add_rms_norm, fused_add_rms_norm_ref
from fk.norms.group_norm import GroupNorm, group_norm, group_norm_ref
from fk.norms.layer_norm import LayerNorm, layer_norm, layer_norm_ref
from fk.norms.rms_norm import RMSNorm, rms_norm, rms_norm_ref

__all__ = [
    "FusedAddRMSNorm",
    "GroupNorm",
    "LayerNorm",
    "RMSNorm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "group_norm",
    "group_norm_ref",
    "layer_norm",
    "layer_norm_ref",
    "rms_norm",
    "rms_norm_ref",
]
