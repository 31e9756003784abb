"""fk.rope: rotary position embedding for LLM training, q and k rotated in one launch.

- :func:`rope`: RoPE of q and k with any head counts (grouped-query attention), rotate-half or
  interleaved pairs, partial rotary, position ids, ``(B, heads, S, D)`` or ``(B, S, heads, D)``
  layouts, strided inputs, and an in-place option.
- :func:`apply_rotary_pos_emb`: drop-in for Hugging Face's function of that name.
- :func:`rope_ref`: the plain PyTorch definition the kernels are tested against.
"""

from fk.rope.rope import apply_rotary_pos_emb, rope, rope_ref

__all__ = ["apply_rotary_pos_emb", "rope", "rope_ref"]
