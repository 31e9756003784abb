"""mRoPE against its float64 reference and Hugging Face's code: on the GPU, else in Triton's interpreter."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.core.testing import attention_qk as qk
from fk.rope import apply_multimodal_rotary_pos_emb, apply_rotary_pos_emb, mrope, mrope_ref

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
PAIRS = [False, True]
PAIR_IDS = ["half", "interleaved"]
ARRANGEMENTS = [False, True]
ARRANGEMENT_IDS = ["contiguous", "interleaved_sections"]
NAMES = ["q", "k", "cos", "sin"]


# --- Hugging Face's formulas, copied from transformers 4.x (where the attention layers selected the axes) --


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers.models.qwen2_vl.modeling_qwen2_vl.rotate_half"""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rotate_half_llm(x: torch.Tensor) -> torch.Tensor:
    """transformers.models.glm4v.modeling_glm4v.rotate_half_llm"""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def hf_apply_multimodal_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: list[int],
    unsqueeze_dim: int = 1,
    *,
    glm4v: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 4.x ``apply_multimodal_rotary_pos_emb`` of transformers.models.qwen2_vl.modeling_qwen2_vl
    (Qwen2.5-VL's and Qwen2.5-Omni's are copies) or, with ``glm4v``, of transformers.models.glm4v.modeling_glm4v
    (the same selection, then interleaved pairs on the first half of the tables, and partial rotary)."""
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    if not glm4v:
        q_embed = (q * cos) + (hf_rotate_half(q) * sin)
        k_embed = (k * cos) + (hf_rotate_half(k) * sin)
        return q_embed, k_embed
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (hf_rotate_half_llm(q_rot) * sin)
    k_embed = (k_rot * cos) + (hf_rotate_half_llm(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


# --- inputs ----------------------------------------------------------------------------------------


def positions3(batch: int, seq: int, seed: int) -> torch.Tensor:
    """(3, B, S) temporal, height and width positions, different on each axis (as for image tokens)."""
    return torch.randint(0, 64, (3, batch, seq), generator=torch.Generator().manual_seed(seed))


def inv_freq(rd: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))


def tables(
    positions: torch.Tensor, freq: torch.Tensor, dtype: torch.dtype, device: str, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, B, S, rd) cos/sin of ``positions`` (3, B, S), laid out for rotate-half or interleaved pairs."""
    angles = positions.float()[..., None] * freq
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def _fk(sections: list[int], layout: str = "bhsd", interleaved: bool = False, mi: bool = False) -> Callable[..., Any]:
    return lambda q, k, c, s: mrope(q, k, c, s, sections, layout=layout, interleaved=interleaved, mrope_interleaved=mi)


def _ref(sections: list[int], layout: str = "bhsd", interleaved: bool = False, mi: bool = False) -> Callable[..., Any]:
    return lambda q, k, c, s: mrope_ref(
        q, k, c, s, sections, layout=layout, interleaved=interleaved, mrope_interleaved=mi
    )


# --- against the reference -------------------------------------------------------------------------


@pytest.mark.parametrize("mrope_interleaved", ARRANGEMENTS, ids=ARRANGEMENT_IDS)
@pytest.mark.parametrize("interleaved", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, interleaved: bool, mrope_interleaved: bool) -> None:
    q, k = qk(2, 7, 4, 2, 64, dtype, device, "bhsd", seed=1)
    c, s = tables(positions3(2, 7, seed=2), inv_freq(64), dtype, device, interleaved)
    sections = [12, 10, 10]
    result = testing.compare_with_reference(_fk(sections, "bhsd", interleaved, mrope_interleaved),
                                            _ref(sections, "bhsd", interleaved, mrope_interleaved),
                                            [q, k, c, s], arg_names=NAMES)  # fmt: skip
    assert result.names == ["output0", "output1", "grad of q", "grad of k"]


@pytest.mark.parametrize(("seq", "heads", "layout"), [(1, (3, 1), "bshd"), (7, (5, 5), "bhsd"), (33, (40, 8), "bshd")])
def test_odd_sequence_lengths_gqa_and_layouts(device: str, seq: int, heads: tuple[int, int], layout: str) -> None:
    q, k = qk(2, seq, *heads, 64, torch.bfloat16, device, layout, seed=seq)
    c, s = tables(positions3(2, seq, seed=seq), inv_freq(64), torch.bfloat16, device)
    sections = [16, 8, 8]
    testing.compare_with_reference(_fk(sections, layout), _ref(sections, layout), [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize(
    ("head_dim", "sections", "mrope_interleaved"),
    [
        (80, [8, 8, 8], False), (80, [8, 8, 8], True),  # partial rotary: 48 of 80 features
        (128, [16, 0, 16], False),  # no height frequencies
        (64, [16, 0, 0], False), (64, [16, 0, 0], True),  # temporal only: plain RoPE
        (96, [2, 3, 7], False),  # uneven
        (64, [6, 5, 5], True),  # Qwen3.5's shape: partial rotary, interleaved sections
    ],
)  # fmt: skip
@pytest.mark.parametrize("interleaved", PAIRS, ids=PAIR_IDS)
def test_partial_rotary_and_sections(
    device: str, interleaved: bool, head_dim: int, sections: list[int], mrope_interleaved: bool
) -> None:
    rd = 2 * sum(sections)  # at most head_dim: the features past it pass through
    q, k = qk(2, 5, 4, 2, head_dim, torch.float16, device, "bhsd", seed=rd)
    c, s = tables(positions3(2, 5, seed=rd), inv_freq(rd), torch.float16, device, interleaved)
    testing.compare_with_reference(_fk(sections, "bhsd", interleaved, mrope_interleaved),
                                   _ref(sections, "bhsd", interleaved, mrope_interleaved),
                                   [q, k, c, s], arg_names=NAMES)  # fmt: skip


@pytest.mark.parametrize("cos_batch", ["1", "B", "expanded"])
def test_cos_sin_shared_by_the_batch_or_per_sequence(device: str, cos_batch: str) -> None:
    q, k = qk(3, 6, 4, 2, 64, torch.float32, device, "bshd", seed=3)
    c, s = tables(positions3(3 if cos_batch == "B" else 1, 6, seed=4), inv_freq(64), torch.float32, device)
    if cos_batch == "expanded":
        c, s = c.expand(3, 3, 6, 64), s.expand(3, 3, 6, 64)
    testing.compare_with_reference(_fk([8, 12, 12], "bshd"), _ref([8, 12, 12], "bshd"), [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize(
    ("interleaved", "mrope_interleaved", "sections", "axes"),
    [
        (False, False, [1, 2, 3], [0, 1, 1, 2, 2, 2] * 2),  # each half: T H H W W W
        (True, False, [1, 2, 3], [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]),  # pairs side by side
        (False, True, [2, 2, 2], [0, 1, 2, 0, 1, 2] * 2),  # Qwen3-VL: T H W T H W
        (False, True, [4, 1, 1], [0, 1, 2, 0, 0, 0] * 2),  # past 3h and 3w: temporal
    ],
    ids=["contiguous", "contiguous_pairs", "interleaved_sections", "interleaved_sections_tail"],
)
def test_each_feature_takes_its_section_axis(
    device: str, interleaved: bool, mrope_interleaved: bool, sections: list[int], axes: list[int]
) -> None:
    # cos = 0 and sin = axis + 1: a feature's output is +-(the axis of its table + 1) times x's partner.
    q = torch.ones(1, 1, 2, 12, device=device)
    cos = torch.zeros(3, 1, 2, 12, device=device)
    sin = torch.arange(1.0, 4.0, device=device)[:, None, None, None].expand(3, 1, 2, 12)
    for fn in (mrope, mrope_ref):
        q_embed, _ = fn(q, q, cos, sin, sections, interleaved=interleaved, mrope_interleaved=mrope_interleaved)
        got = q_embed.abs()[0, 0, 0] - 1
        assert got.tolist() == axes, fn.__name__


S = testing.strategies()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=S.dtypes, layout=st.sampled_from(["bhsd", "bshd"]), interleaved=st.booleans(),
    mrope_interleaved=st.booleans(), batch=st.integers(1, 3), seq=st.integers(1, 9), n_k=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 4]), half=st.integers(1, 24), extra=st.integers(0, 9), data=st.data(),
)  # fmt: skip
def test_property_any_shape_and_sections(
    device: str, dtype: torch.dtype, layout: str, interleaved: bool, mrope_interleaved: bool,
    batch: int, seq: int, n_k: int, ratio: int, half: int, extra: int, data: st.DataObject,
) -> None:  # fmt: skip
    h = data.draw(st.integers(0, (half + 1) // 3))
    w = data.draw(st.integers(0, half // 3))
    sections = [half - h - w, h, w]
    rd, d = 2 * half, 2 * half + extra
    q, k = qk(batch, seq, n_k * ratio, n_k, d, dtype, device, layout, seed=seq * 131 + d)
    c, s = tables(positions3(batch, seq, seed=d), inv_freq(rd), dtype, device, interleaved)
    testing.compare_with_reference(_fk(sections, layout, interleaved, mrope_interleaved),
                                   _ref(sections, layout, interleaved, mrope_interleaved),
                                   [q, k, c, s], arg_names=NAMES)  # fmt: skip


# --- against Hugging Face --------------------------------------------------------------------------


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_drop_in_matches_transformers_4x_function(device: str, dtype: torch.dtype, unsqueeze_dim: int) -> None:
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    q, k = qk(2, 9, 8, 2, 64, dtype, device, layout, seed=5)
    # Any tables, not only cat(freqs, freqs): Hugging Face selects each half by the sections.
    c = testing.random_tensor((3, 2, 9, 64), dtype, device, seed=6)
    s = testing.random_tensor((3, 2, 9, 64), dtype, device, seed=7)
    sections = [8, 12, 12]

    def hf_fn(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        return hf_apply_multimodal_rotary_pos_emb(q, k, c, s, sections, unsqueeze_dim)

    testing.compare_with_reference(
        lambda q, k, c, s: apply_multimodal_rotary_pos_emb(q, k, c, s, sections, unsqueeze_dim),
        hf_fn, [q, k, c, s], arg_names=NAMES,
    )  # fmt: skip
    testing.compare_with_reference(_ref(sections, layout), hf_fn, [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_glm4v_4x_function_is_mrope_with_interleaved_pairs(device: str, dtype: torch.dtype) -> None:
    q, k = qk(2, 9, 4, 2, 64, dtype, device, "bhsd", seed=8)
    c, s = tables(positions3(2, 9, seed=9), inv_freq(32), dtype, device)  # partial rotary: rd = 32 of 64
    sections = [4, 6, 6]

    def fk_fn(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        c, s = (t[..., :16].repeat_interleave(2, dim=-1) for t in (c, s))
        return mrope(q, k, c, s, sections, interleaved=True)

    def hf_fn(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        return hf_apply_multimodal_rotary_pos_emb(q, k, c, s, sections, glm4v=True)

    testing.compare_with_reference(fk_fn, hf_fn, [q, k, c, s], arg_names=NAMES)


# transformers 5 selects the axes in each model's rotary embedding (recomposition_frequencies) and
# calls the model's own apply_rotary_pos_emb in attention: model -> (config class, rotary embedding
# class, extra rope parameters, interleaved pairs, interleaved sections).
HF_MODELS: dict[str, tuple[str, str, dict[str, Any], bool, bool]] = {
    "qwen2_vl": ("Qwen2VLTextConfig", "Qwen2VLRotaryEmbedding", {}, False, False),
    "qwen2_5_vl": ("Qwen2_5_VLTextConfig", "Qwen2_5_VLRotaryEmbedding", {}, False, False),
    "qwen3_vl": ("Qwen3VLTextConfig", "Qwen3VLTextRotaryEmbedding", {}, False, True),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5TextRotaryEmbedding", {"partial_rotary_factor": 0.5}, False, True),
    "glm4v": ("Glm4vTextConfig", "Glm4vTextRotaryEmbedding", {"partial_rotary_factor": 0.5}, True, False),
    "glm4v_moe": ("Glm4vMoeTextConfig", "Glm4vMoeTextRotaryEmbedding", {"partial_rotary_factor": 0.5}, False, False),
}


def hf_model_rope(model: str, sections: list[int]) -> tuple[Any, torch.nn.Module]:
    """The model's modeling module and its text rotary embedding (head_dim 64), from transformers."""
    config_name, rotary_name, extra, _, _ = HF_MODELS[model]
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    configuration = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections, **extra}
    config = getattr(configuration, config_name)(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_parameters=rope_parameters
    )
    return modeling, getattr(modeling, rotary_name)(config)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("model", list(HF_MODELS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_transformers_models(device: str, dtype: torch.dtype, model: str) -> None:
    interleaved, mrope_interleaved = HF_MODELS[model][3:]
    rd = 32 if "partial_rotary_factor" in HF_MODELS[model][2] else 64
    sections = [6, 5, 5] if rd == 32 else [12, 10, 10]
    modeling, rotary = hf_model_rope(model, sections)
    pos = positions3(2, 9, seed=10)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=dtype), pos)  # (B, S, rd): the axes already selected
    cos, sin = tables(pos, rotary.inv_freq, dtype, device, interleaved)  # (3, B, S, rd)
    q, k = qk(2, 9, 4, 2, 64, dtype, device, "bhsd", seed=11)
    testing.compare_with_reference(
        lambda q, k: mrope(q, k, cos, sin, sections, interleaved=interleaved, mrope_interleaved=mrope_interleaved),
        lambda q, k: modeling.apply_rotary_pos_emb(q, k, hf_cos.to(q), hf_sin.to(q)),
        [q, k], arg_names=["q", "k"],
    )  # fmt: skip


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_attention_call_of_transformers_5_is_apply_rotary_pos_emb(device: str, dtype: torch.dtype, model: str) -> None:
    # Qwen3-VL's interleaved mRoPE included: the rotary embedding has selected the axes, and
    # attention calls Llama's apply_rotary_pos_emb, for which fk's is the drop-in.
    sections = [12, 10, 10]
    modeling, rotary = hf_model_rope(model, sections)
    cos, sin = rotary(torch.zeros(1, dtype=dtype), positions3(2, 9, seed=12))
    q, k = qk(2, 9, 4, 2, 64, dtype, device, "bhsd", seed=13)
    testing.compare_with_reference(apply_rotary_pos_emb, modeling.apply_rotary_pos_emb,
                                   [q, k, cos.to(device), sin.to(device)], arg_names=NAMES)  # fmt: skip


# --- bad inputs, compile, paths --------------------------------------------------------------------


def test_bad_inputs(device: str) -> None:
    q = torch.randn(2, 4, 5, 64, device=device)
    k = torch.randn(2, 2, 5, 64, device=device)
    c, s = tables(positions3(2, 5, seed=14), inv_freq(64), torch.float32, device)
    sec = [8, 12, 12]
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (ValueError, r"mrope_section must be 3 non-negative ints .* summing to rotary_dim / 2 = 32 .*got \[8, 12, 11\]", lambda: mrope(q, k, c, s, [8, 12, 11])),
        (ValueError, r"mrope_section must be 3 non-negative ints .*got \[16, 16\]", lambda: mrope(q, k, c, s, [16, 16])),
        (ValueError, r"mrope_section must be 3 non-negative ints .*got \[40, -4, -4\]", lambda: mrope(q, k, c, s, [40, -4, -4])),
        (ValueError, r"mrope_section must be 3 non-negative ints .*got \[8\.0, 12, 12\]", lambda: mrope(q, k, c, s, [8.0, 12, 12])),  # type: ignore[list-item]
        (ValueError, "mrope_section must be 3 non-negative ints", lambda: mrope(q, k, c, s, 32)),  # type: ignore[arg-type]
        (ValueError, r"mrope_section \[8, 12, 12\] does not fit the interleaved arrangement of 32 frequencies", lambda: mrope(q, k, c, s, sec, mrope_interleaved=True)),
        (ValueError, r"cos must have shape \(3, B or 1, S, rotary_dim\) .*got \(2, 2, 5, 64\)", lambda: mrope(q, k, c[:2], s[:2], sec)),
        (ValueError, r"cos must have shape \(3, B or 1, S, rotary_dim\) .*got \(2, 5, 64\)", lambda: mrope(q, k, c[0], s[0], sec)),
        (ValueError, r"sin must have shape \(3, 2, 5, 64\), got \(3, 2, 5, 32\)", lambda: mrope(q, k, c, s[..., :32], sec)),
        (ValueError, "cos must have an even last dimension", lambda: mrope(q, k, c[..., :31], s[..., :31], sec)),
        (TypeError, r"cos must be a torch\.Tensor", lambda: mrope(q, k, [1.0], s, sec)),  # type: ignore[arg-type]
        (TypeError, "sin must have dtype in", lambda: mrope(q, k, c, s.int(), sec)),
        (TypeError, "mrope_interleaved must be a bool", lambda: mrope(q, k, c, s, sec, mrope_interleaved=1)),  # type: ignore[arg-type]
        (ValueError, r"cos must have one row per token \(6", lambda: mrope(torch.randn(2, 4, 6, 64, device=device), torch.randn(2, 2, 6, 64, device=device), c, s, sec)),
        (ValueError, "k must have the batch size, sequence length and head size of q", lambda: mrope(q, k[..., :32], c, s, sec)),
        (ValueError, "unsqueeze_dim must be 1", lambda: apply_multimodal_rotary_pos_emb(q, k, c, s, sec, unsqueeze_dim=0)),
    ]  # fmt: skip
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def test_cos_sin_that_require_grad_are_rejected(device: str) -> None:
    q, k = qk(2, 5, 4, 2, 64, torch.float32, device, "bhsd", seed=15)
    c, s = tables(positions3(2, 5, seed=16), inv_freq(64), torch.float32, device)
    with pytest.raises(ValueError, match=r"cos requires grad, but fk.rope does not differentiate cos and sin"):
        mrope(q, k, c.requires_grad_(), s, [8, 12, 12])
    with pytest.raises(ValueError, match="sin requires grad"):
        mrope(q, k, c.detach(), s.requires_grad_(), [8, 12, 12])
    with torch.no_grad():  # nothing is recorded: allowed
        mrope(q, k, c, s, [8, 12, 12])


@pytest.mark.parametrize("mrope_interleaved", ARRANGEMENTS, ids=ARRANGEMENT_IDS)
def test_torch_compile_fullgraph(device: str, mrope_interleaved: bool) -> None:
    q0, k0 = qk(2, 5, 4, 2, 64, torch.float32, device, "bhsd", seed=17)
    c, s = tables(positions3(2, 5, seed=18), inv_freq(48), torch.float32, device)  # partial: rd = 48

    def loss(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q_embed, k_embed = mrope(q * 2.0, k * 1.0, c, s, [8, 8, 8], mrope_interleaved=mrope_interleaved)
        return (q_embed * 3.0).sum() + (k_embed * k_embed).sum()

    testing.assert_compile_matches_eager(loss, [q0, k0])


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.rope import mrope, mrope_ref; from fk.core import backend;"
        "q = torch.randn(2, 4, 5, 64, dtype=torch.bfloat16); k = torch.randn(2, 2, 5, 64, dtype=torch.bfloat16);"
        "c = torch.randn(3, 1, 5, 48); s = torch.randn(3, 1, 5, 48);"
        "assert backend.kernel_path(q) is backend.KernelPath.REFERENCE;"
        "assert all(torch.equal(a, b) for a, b in zip(mrope(q, k, c, s, [8, 8, 8]), mrope_ref(q, k, c, s, [8, 8, 8])));"
        "print('ok')"
    )


# --- real sizes on the GPU -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mrope_interleaved", ARRANGEMENTS, ids=ARRANGEMENT_IDS)
def test_gpu_qwen_vl_size(mrope_interleaved: bool) -> None:
    q, k = qk(2, 2048, 28, 4, 128, torch.bfloat16, "cuda", "bhsd", seed=19)
    c, s = tables(positions3(2, 2048, seed=20), inv_freq(128), torch.bfloat16, "cuda")
    sections = [24, 20, 20] if mrope_interleaved else [16, 24, 24]
    testing.compare_with_reference(_fk(sections, mi=mrope_interleaved), _ref(sections, mi=mrope_interleaved),
                                   [q, k, c, s], arg_names=NAMES)  # fmt: skip
