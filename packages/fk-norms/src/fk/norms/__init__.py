"""fk.norms: fused normalization kernels for LLM training.

- :func:`rms_norm` / :class:`RMSNorm`: RMSNorm with "llama" and "gemma" casting, any row width.
"""

from fk.norms.rms_norm import RMSNorm, rms_norm, rms_norm_ref

__all__ = ["RMSNorm", "rms_norm", "rms_norm_ref"]
