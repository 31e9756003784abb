"""The switches of :func:`fk.hf.apply`: one table, the only place their names and defaults are spelled.

Each switch names one kind of block fk.hf may replace; :func:`check_switches` turns a user's
keywords into the full set. What each block is, how it is recognized and what replaces it:
docs/packages/meta.md ("What fk.hf patches").
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Switch(NamedTuple):
    name: str
    default: bool
    replaces: str
    """What the switch replaces, in one line."""


TABLE: tuple[Switch, ...] = (
    Switch(
        "rms_norm", True, "RMSNorm modules (Llama's or Gemma's casting, with or without weight) by fk.norms.rms_norm"
    ),
    Switch(
        "layer_norm", True, "LayerNorm modules over the last dimension (with or without bias) by fk.norms.layer_norm"
    ),
    Switch("swiglu", True, "gated MLPs with a SiLU gate by fk.glu.gated_mlp or swiglu"),
    Switch("geglu", True, "gated MLPs with a GELU gate (tanh or exact) by fk.glu.gated_mlp or geglu"),
    Switch("rope", True, "the attention's standard apply_rotary_pos_emb by fk.rope's"),
    Switch("qkv", True, "an attention's q/k/v nn.Linear projections by one call with one input-gradient buffer"),
    Switch("add_norm", True, "a Llama-form decoder layer's residual add inside its post-attention RMSNorm"),
    Switch("flce", True, "the causal-LM head and its loss by fk.flce.linear_cross_entropy (no logits in training)"),
    Switch("lora", True, "a PEFT model's LoRA layers by fk.lora's fused ones"),
    Switch("recompute_norms", False, "in add_norm layers, the RMSNorm outputs formed again in the backward"),
)

SWITCHES = tuple(s.name for s in TABLE)
OFF_BY_DEFAULT = tuple(s.name for s in TABLE if not s.default)
"""The switches that are off unless turned on (the others are on unless turned off)."""


def check_switches(switches: dict[str, Any]) -> dict[str, bool]:
    """``switches`` with every one of :data:`SWITCHES` (its default unless given); ``TypeError`` for
    an unknown name or a value that is not a bool."""
    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise TypeError(f"unknown fk.hf switch(es) {', '.join(unknown)}; the switches are {', '.join(SWITCHES)}")
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return {s.name: switches.get(s.name, s.default) for s in TABLE}
