"""fk.norms: fused normalization kernels for LLM training.

- :func:`rms_norm` / :class:`RMSNorm`: RMSNorm with "llama" and "gemma" casting, any row width.
- :func:`layer_norm` / :class:`LayerNorm`: LayerNorm with or without weight and bias, any row width.
"""

from fk.norms.layer_norm import LayerNorm, layer_norm, layer_norm_ref
from fk.norms.rms_norm import RMSNorm, rms_norm, rms_norm_ref

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "layer_norm_ref", "rms_norm", "rms_norm_ref"]
