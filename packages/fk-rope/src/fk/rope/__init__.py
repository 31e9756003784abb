"""fk.rope: rotary position embedding for LLM training, q and k rotated in one launch.

- :func:`rope`: RoPE of q and k with any head counts (grouped-query attention), rotate-half or
  interleaved pairs, partial rotary, position ids, ``(B, heads, S, D)`` or ``(B, S, heads, D)``
  layouts, strided inputs, and an in-place option.
- :func:`rope_single`: the same for one tensor (q or k alone: Gemma 3n, Gemma 4).
- :func:`apply_rotary_pos_emb`: drop-in for Hugging Face's function of that name.
- :func:`rope_ref`: the plain PyTorch definition the kernels are tested against.
- :func:`mrope`: multimodal RoPE (Qwen2-VL, Qwen3-VL, GLM-4V): each rotary frequency takes its
  angle from the temporal, height or width position, by ``mrope_section``; rotated by ``rope``'s
  kernel.
- :func:`apply_multimodal_rotary_pos_emb`: drop-in for Hugging Face's function of that name
  (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni in transformers 4.x).
- :func:`mrope_ref`: the plain PyTorch definition of mRoPE.
"""

from fk.rope.mrope import apply_multimodal_rotary_pos_emb, mrope, mrope_ref
from fk.rope.rope import apply_rotary_pos_emb, rope, rope_ref, rope_single

__all__ = [
    "apply_multimodal_rotary_pos_emb",
    "apply_rotary_pos_emb",
    "mrope",
    "mrope_ref",
    "rope",
    "rope_ref",
    "rope_single",
]
