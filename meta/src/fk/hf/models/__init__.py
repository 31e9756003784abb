"""The registry of model families fk.hf patches: ``config.model_type`` -> :class:`fk.hf.patching.ModelPatch`.

One file per family. Adding a family: a file defining ``PATCH`` and a line in :data:`REGISTRY`.
"""

from __future__ import annotations

from fk.hf.models import (
    gemma,
    gemma2,
    gemma3,
    granite,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    stablelm,
)
from fk.hf.patching import ModelPatch

REGISTRY: dict[str, ModelPatch] = {
    m.PATCH.model_type: m.PATCH
    for m in (gemma, gemma2, gemma3, granite, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe, stablelm)
}
