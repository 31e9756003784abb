"""Every model type of transformers' causal-LM, image-text-to-text and seq2seq LM registries, built tiny and
random: fk.hf.apply patches what it recognizes and the probe verifies, with loss and every gradient
equal to stock's (fp32, on CPU through Triton's interpreter), or leaves it stock, and never raises.
(``python -m fk.hf.coverage`` writes the same check as docs/models.md.)"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from fk.hf import coverage  # noqa: E402

CASES = [(registry, t) for registry, types in coverage.registries().items() for t in sorted(types)]
WIDELY_TRAINED = {
    "llama", "llama4_text", "mistral", "ministral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
    "gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "phi", "phi3", "deepseek_v2", "deepseek_v3",
    "glm4", "gpt_oss", "olmo2", "granite", "exaone4", "smollm3", "cohere2", "falcon_h1", "nemotron", "minicpm3",
    "hunyuan_v1_dense",
}  # fmt: skip
"""Causal-LM types whose tiny build must succeed: a change of coverage's shrinking that leaves one
unbuilt fails here instead of skipping it."""
SHRUNK_BY_NAME = {
    ("causal_lm", "blt"), ("causal_lm", "dots3_note_text"), ("image_text_to_text", "apertus1p5"),
    ("image_text_to_text", "inkling2"), ("image_text_to_text", "janus"), ("image_text_to_text", "minimax_m3_vl"),
    ("image_text_to_text", "muse_spark"), ("image_text_to_text", "nemotron_h_omni"),
}  # fmt: skip
"""Types that build tiny only with their own size names in ``coverage.SMALL`` (a projector's, a
byte-level model's hash vocabulary) or with a heterogeneous config's per-layer sizes shrunk
(DOTS-3 Note's sliding layers): they must build too."""
MUST_BUILD = {("causal_lm", t) for t in WIDELY_TRAINED} | SHRUNK_BY_NAME


@pytest.mark.parametrize(("registry", "model_type"), CASES, ids=[f"{r}-{t}" for r, t in CASES])
def test_patched_or_left_stock_never_wrong(registry: str, model_type: str, device: str) -> None:
    if device != "cpu":
        pytest.skip("the registry is checked in fp32 on the CPU")
    transformers.logging.set_verbosity_error()
    row = coverage.check(model_type, registry)
    if row.status == "not checked":
        assert (registry, model_type) not in MUST_BUILD, f"not checked: {row.detail}"
        pytest.skip(f"not checked: {row.detail}")
    assert row.status in ("patched", "nothing patched"), f"{row.status}: {row.detail}\n{row.stock}"


def test_heterogeneous_config_shrinks_every_layer() -> None:
    """DOTS-3 Note's sliding layers override the global heads and ranks (transformers'
    ``per_layer_config``): the tiny config keeps a layer of each kind, and the sliding layer's own
    sizes are coverage's small ones too (as the global ones, so that no override is left)."""
    config = coverage.tiny_config("dots3_note_text")
    assert config.layer_types == ["indexed_attention", "sliding_attention"]
    sliding = config.per_layer_config[1]
    assert (sliding.num_attention_heads, sliding.kv_lora_rank, sliding.qk_nope_head_dim) == (
        coverage.SMALL["num_attention_heads"], coverage.SMALL["kv_lora_rank"], coverage.SMALL["qk_nope_head_dim"])  # fmt: skip
    assert config.per_layer_config[0].num_attention_heads == coverage.SMALL["num_attention_heads"]
