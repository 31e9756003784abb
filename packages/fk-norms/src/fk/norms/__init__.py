"""fk.norms: fused normalization kernels for LLM training.

- :func:`rms_norm` / :class:`RMSNorm`: RMSNorm with "llama" and "gemma" casting, any row width.
- :func:`rms_norm_and_input`: ``(rms_norm(x), x)``, adding the gradient of the second output in RMSNorm's backward.
- :func:`fused_add_rms_norm` / :class:`FusedAddRMSNorm`: ``s = x + residual; (rms_norm(s), s)`` in one pass.
- :func:`group_norm` / :class:`GroupNorm`: GroupNorm of ``(N, C, *)`` inputs, per-channel affine.
- :func:`layer_norm` / :class:`LayerNorm`: LayerNorm with or without weight and bias, any row width.
- :func:`poly_norm` / :class:`PolyNorm`: PolyCom's ``w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b``.
"""

from fk.norms.fused_add_rms_norm import FusedAddRMSNorm, fused_add_rms_norm, fused_add_rms_norm_ref
from fk.norms.group_norm import GroupNorm, group_norm, group_norm_ref
from fk.norms.layer_norm import LayerNorm, layer_norm, layer_norm_ref
from fk.norms.poly_norm import PolyNorm, poly_norm, poly_norm_ref
from fk.norms.rms_norm import RMSNorm, rms_norm, rms_norm_and_input, rms_norm_ref

__all__ = [
    "FusedAddRMSNorm",
    "GroupNorm",
    "LayerNorm",
    "PolyNorm",
    "RMSNorm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "group_norm",
    "group_norm_ref",
    "layer_norm",
    "layer_norm_ref",
    "poly_norm",
    "poly_norm_ref",
    "rms_norm",
    "rms_norm_and_input",
    "rms_norm_ref",
]
