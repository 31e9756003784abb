"""RoPE against its float64 reference and Hugging Face's formula: on the GPU, else in Triton's interpreter."""

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
from fk.core.backend import uses_kernel
from fk.core.testing import DTYPES, dtype_name
from fk.core.testing import attention_qk as qk
from fk.rope import apply_rotary_pos_emb, rope, rope_ref, rope_single
from fk.rope.rope import rope_tiling

LAYOUTS = ("bhsd", "bshd")
ROPE_MODULE = importlib.import_module("fk.rope.rope")  # (fk.rope.rope is also the function's name)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


# --- Hugging Face's formulas, copied (transformers is not a dependency) ----------------------------


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers.models.llama.modeling_llama.rotate_half"""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers.models.llama.modeling_llama.apply_rotary_pos_emb"""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


def hf_partial_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi's partial rotary (transformers.models.phi.modeling_phi.apply_rotary_pos_emb)."""
    rd = cos.shape[-1]
    q_rot, q_pass = q[..., :rd], q[..., rd:]
    k_rot, k_pass = k[..., :rd], k[..., rd:]
    q_embed, k_embed = hf_apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def gptj_rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """transformers.models.gptj.modeling_gptj.rotate_every_two"""
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def gptj_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPT-J's apply_rotary_pos_emb on (B, S, heads, D), with cos/sin already repeat_interleaved."""
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return tuple(x * c + gptj_rotate_every_two(x) * s for x in (q, k))


# --- inputs ----------------------------------------------------------------------------------------


def cos_sin(
    positions: torch.Tensor, rd: int, dtype: torch.dtype, device: str, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as Hugging Face's rotary embedding computes them for ``positions`` (B or 1, S)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    freqs = positions.float().cpu()[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def _fk(layout: str = "bhsd", interleaved: bool = False, inplace: bool = False) -> Callable[..., Any]:
    return lambda q, k, c, s, p=None: rope(q, k, c, s, p, layout=layout, interleaved=interleaved, inplace=inplace)


def _ref(layout: str = "bhsd", interleaved: bool = False) -> Callable[..., Any]:
    return lambda q, k, c, s, p=None: rope_ref(q, k, c, s, p, layout=layout, interleaved=interleaved)


NAMES = ["q", "k", "cos", "sin"]


# --- against the reference -------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, interleaved: bool, head_dim: int) -> None:
    q, k = qk(2, 7, 4, 1, head_dim, dtype, device, "bhsd", seed=head_dim)
    c, s = cos_sin(torch.arange(7)[None], head_dim, dtype, device, interleaved)
    result = testing.compare_with_reference(_fk(interleaved=interleaved), _ref(interleaved=interleaved),
                                            [q, k, c, s], arg_names=NAMES)  # fmt: skip
    assert result.names == ["output0", "output1", "grad of q", "grad of k"]


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_gqa_ratios_and_layouts(device: str, dtype: torch.dtype, layout: str, ratio: int) -> None:
    q, k = qk(2, 5, 2 * ratio, 2, 64, dtype, device, layout, seed=ratio)
    c, s = cos_sin(torch.arange(5)[None], 64, dtype, device)
    testing.compare_with_reference(_fk(layout), _ref(layout), [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize("seq", [1, 3, 33])
@pytest.mark.parametrize("heads", [(3, 1), (5, 5), (40, 8)])
def test_odd_sequence_lengths_and_head_counts(device: str, seq: int, heads: tuple[int, int]) -> None:
    q, k = qk(1, seq, *heads, 32, torch.bfloat16, device, "bshd", seed=seq)
    c, s = cos_sin(torch.arange(seq)[None], 32, torch.bfloat16, device)
    testing.compare_with_reference(_fk("bshd"), _ref("bshd"), [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize("rd", [2, 16, 24, 40])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_partial_rotary(device: str, dtype: torch.dtype, interleaved: bool, rd: int) -> None:
    q, k = qk(2, 5, 4, 2, 80, dtype, device, "bhsd", seed=rd)
    c, s = cos_sin(torch.arange(5)[None], rd, dtype, device, interleaved)
    testing.compare_with_reference(_fk(interleaved=interleaved), _ref(interleaved=interleaved),
                                   [q, k, c, s], arg_names=NAMES)  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_arbitrary_cos_sin(device: str, interleaved: bool) -> None:
    # Not the duplicated layout of a real model: the kernel applies the formula feature by feature.
    q, k = qk(2, 6, 4, 2, 64, torch.float32, device, "bshd", seed=3)
    c = testing.random_tensor((2, 6, 48), torch.float32, device, seed=4)
    s = testing.random_tensor((2, 6, 48), torch.float32, device, seed=5)
    testing.compare_with_reference(_fk("bshd", interleaved), _ref("bshd", interleaved), [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize("cos_shape", ["1SD", "BSD", "SD", "expanded"])
@pytest.mark.parametrize("cos_dtype", DTYPES, ids=dtype_name)
def test_cos_sin_shapes_and_dtypes(device: str, cos_dtype: torch.dtype, cos_shape: str) -> None:
    q, k = qk(3, 9, 4, 2, 64, torch.bfloat16, device, "bhsd", seed=6)
    positions = torch.arange(9)[None] + torch.arange(3)[:, None] * 5  # differs per sequence
    c, s = cos_sin(positions if cos_shape == "BSD" else positions[:1], 64, cos_dtype, device)
    if cos_shape == "SD":
        c, s = c[0], s[0]
    elif cos_shape == "expanded":
        c, s = c.expand(3, -1, -1), s.expand(3, -1, -1)
    testing.compare_with_reference(_fk(), _ref(), [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize("table", ["PD", "1PD", "BPD"])
@pytest.mark.parametrize("pos_batch", [1, 2])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=dtype_name)
def test_position_ids_for_packed_sequences(device: str, pos_dtype: torch.dtype, pos_batch: int, table: str) -> None:
    # Three packed sequences of 4, 2 and 5 tokens: positions restart at each.
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]])
    position_ids = (packed if pos_batch == 1 else torch.cat([packed, packed.flip(1)])).to(pos_dtype).to(device)
    q, k = qk(2, 11, 4, 2, 64, torch.float32, device, "bshd", seed=7)
    c, s = cos_sin(torch.arange(16)[None], 64, torch.float32, device)  # a table of 16 positions
    if table == "PD":
        c, s = c[0], s[0]
    elif table == "BPD":
        c, s = torch.cat([c, c * 0.5]), torch.cat([s, s * 0.5])  # a different table per sequence
    testing.compare_with_reference(_fk("bshd"), _ref("bshd"), [q, k, c, s, position_ids],
                                   arg_names=[*NAMES, "position_ids"])  # fmt: skip
    # The same as cos/sin gathered per token (Hugging Face's way) when the table is shared.
    if table != "BPD":
        got = rope(q.detach(), k.detach(), c, s, position_ids, layout="bshd")
        c3, s3 = (t if t.ndim == 3 else t[None] for t in (c, s))
        per_token = (c3[0][position_ids.long()], s3[0][position_ids.long()])
        want = rope(q.detach(), k.detach(), *per_token, layout="bshd")
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- strided inputs, in place, frozen inputs ---------------------------------------------------------


# compare_with_reference clones its arguments, and a clone of a non-dense view is contiguous: so the
# functions below build their strided inputs themselves (differentiably, so gradients are checked).


def _as_qkv_views(q: torch.Tensor, k: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as slices of one fused (B, S, Hq + 2 Hk, D) projection output, in ``layout``."""
    q4, k4 = _bshd(q, layout), _bshd(k, layout)
    heads = torch.cat([q4, k4, k4 * 0.5], dim=2)  # q, k, v heads side by side
    n_q, n_k = q4.shape[2], k4.shape[2]
    qv, kv = _bshd(heads[:, :, :n_q], layout), _bshd(heads[:, :, n_q : n_q + n_k], layout)
    assert not qv.is_contiguous() and not kv.is_contiguous() and qv.stride(-1) == 1
    return qv, kv


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_views_of_fused_qkv_projection(device: str, dtype: torch.dtype, layout: str) -> None:
    q, k = qk(2, 5, 8, 2, 64, dtype, device, layout, seed=8)
    c, s = cos_sin(torch.arange(5)[None], 64, dtype, device)

    def fk_fn(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        return rope(*_as_qkv_views(q, k, layout), c, s, layout=layout)

    testing.compare_with_reference(fk_fn, _ref(layout), [q, k, c, s], arg_names=NAMES)


def test_strided_views_are_not_copied(device: str) -> None:
    heads = torch.randn(2, 5, 12, 64, device=device)
    q, k = heads[:, :, :8].transpose(1, 2), heads[:, :, 8:10].transpose(1, 2)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    want = rope(q.contiguous(), k.contiguous(), c, s)
    rope(q, k, c, s, inplace=True)  # in place on the views: only possible without a copy
    torch.testing.assert_close((heads[:, :, :8].transpose(1, 2), heads[:, :, 8:10].transpose(1, 2)), want)


def test_strided_views_out_of_place_allocate_only_the_outputs(device: str) -> None:
    """q and k as views of a fused projection are read where they lie: forward and backward
    allocate the two results each and nothing of q's or k's size besides (a copy would)."""
    heads = torch.randn(2, 5, 12, 64, device=device, requires_grad=True)
    q, k = heads[:, :, :8].transpose(1, 2), heads[:, :, 8:10].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    q_bytes, k_bytes = q.numel() * 4, k.numel() * 4
    out: list[torch.Tensor] = []
    sizes = testing.allocation_sizes(lambda: out.extend(rope(q, k, c, s)))
    assert testing.count_buffers(sizes, q_bytes, device) == 1 and testing.count_buffers(sizes, k_bytes, device) == 1
    dq, dk = torch.randn_like(out[0]), torch.randn_like(out[1])
    sizes = testing.allocation_sizes(lambda: torch.autograd.grad(out, (q, k), (dq, dk)))
    assert testing.count_buffers(sizes, q_bytes, device) == 1 and testing.count_buffers(sizes, k_bytes, device) == 1
    torch.testing.assert_close(out, list(rope(q.contiguous(), k.contiguous(), c, s)))


@pytest.mark.parametrize("strides", ["row_strided", "transposed"])
def test_other_strides(device: str, strides: str) -> None:
    q, k = qk(2, 6, 4, 2, 64, torch.float16, device, "bhsd", seed=9)
    c, s = cos_sin(torch.arange(6)[None], 64, torch.float16, device)

    def restride(t: torch.Tensor) -> torch.Tensor:
        if strides == "row_strided":  # a gap after every head
            return torch.cat([t, t[..., :3]], dim=-1)[..., : t.shape[-1]]
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)  # features not contiguous

    def fk_fn(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        q, k, c = restride(q), restride(k), restride(c)
        assert not q.is_contiguous() and not c.is_contiguous()
        return rope(q, k, c, s)

    testing.compare_with_reference(fk_fn, _ref(), [q, k, c, s], arg_names=NAMES)


def test_output_keeps_dense_input_strides(device: str) -> None:
    # Hugging Face's q: a (B, S, H, D) projection transposed to (B, H, S, D). Eager keeps its strides.
    q = torch.randn(2, 5, 4, 64, device=device).transpose(1, 2)
    k = torch.randn(2, 5, 2, 64, device=device).transpose(1, 2)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    q_embed, k_embed = rope(q, k, c, s)
    assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_gradients_take_the_input_layout(device: str, dtype: torch.dtype) -> None:
    # Attention's backward hands contiguous (B, H, S, D) gradients; dq and dk come back in the
    # layout of Hugging Face's transposed projection views, so reshaping them back into the
    # projections' (B, S, H * D) outputs needs no copy. Values as the reference's.
    proj_q = testing.random_tensor((2, 5, 4 * 64), dtype, device, seed=31, requires_grad=True)
    proj_k = testing.random_tensor((2, 5, 2 * 64), dtype, device, seed=32, requires_grad=True)
    c, s = cos_sin(torch.arange(5)[None], 64, dtype, device)
    dq_embed = testing.random_tensor((2, 4, 5, 64), dtype, device, seed=33)
    dk_embed = testing.random_tensor((2, 2, 5, 64), dtype, device, seed=34)
    grads = {}
    for name, fn in (("fk", rope), ("ref", rope_ref)):
        q, k = proj_q.view(2, 5, 4, 64).transpose(1, 2), proj_k.view(2, 5, 2, 64).transpose(1, 2)
        outputs = fn(q, k, c, s)
        if name == "fk":
            dq, dk = torch.autograd.grad(outputs, (q, k), (dq_embed, dk_embed), retain_graph=True)
            assert dq.stride() == q.stride() and dk.stride() == k.stride()
        torch.autograd.backward(outputs, (dq_embed, dk_embed))
        grads[name] = (proj_q.grad, proj_k.grad)
        proj_q.grad = proj_k.grad = None
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for got, want in zip(grads["fk"], grads["ref"], strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rd", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_inplace_without_grad(device: str, dtype: torch.dtype, rd: int, layout: str) -> None:
    q, k = (t.detach() for t in qk(2, 5, 4, 2, 64, dtype, device, layout, seed=10))
    c, s = cos_sin(torch.arange(5)[None], rd, dtype, device)
    want = rope(q, k, c, s, layout=layout)
    q_ptr = q.data_ptr()
    q_out, k_out = rope(q, k, c, s, layout=layout, inplace=True)
    assert q_out is q and k_out is k and q.data_ptr() == q_ptr
    torch.testing.assert_close((q, k), want, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inplace_on_qkv_views_with_grad(device: str, layout: str) -> None:
    batch, seq, n_q, n_k, d = 2, 5, 4, 2, 64
    x = testing.random_tensor((batch, seq, 16), torch.float32, device, seed=11)
    w = testing.random_tensor(((n_q + 2 * n_k) * d, 16), torch.float32, device, seed=12, requires_grad=True)
    c, s = cos_sin(torch.arange(seq)[None], d, torch.float32, device)
    dy = testing.random_tensor((batch, seq, (n_q + 2 * n_k) * d), torch.float32, device, seed=13)

    def run(inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        heads = (x @ w.t()).view(batch, seq, n_q + 2 * n_k, d)
        q, k = heads[:, :, :n_q], heads[:, :, n_q : n_q + n_k]
        if layout == "bhsd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q_embed, k_embed = rope(q, k, c, s, layout=layout, inplace=inplace)
        if inplace:
            assert q_embed is q and k_embed is k
        out = torch.cat([_bshd(q_embed, layout), _bshd(k_embed, layout), heads[:, :, n_q + n_k :]], dim=2)
        (grad,) = torch.autograd.grad(out, w, dy.view_as(out))
        if inplace:  # the projection's output itself now holds the rotated q and k
            torch.testing.assert_close(heads[:, :, : n_q + n_k], out[:, :, : n_q + n_k])
        return out.detach(), grad

    out_ip, grad_ip = run(True)
    out_oop, grad_oop = run(False)
    torch.testing.assert_close(out_ip, out_oop, rtol=0, atol=0)
    torch.testing.assert_close(grad_ip, grad_oop, rtol=1e-6, atol=1e-6)


def _bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bshd" else x.transpose(1, 2)


@pytest.mark.parametrize("frozen", ["q", "k"])
def test_frozen_input_gets_no_gradient(device: str, frozen: str) -> None:
    q, k = qk(2, 5, 4, 2, 64, torch.bfloat16, device, "bhsd", seed=14)
    (q if frozen == "q" else k).requires_grad_(False)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.bfloat16, device)
    result = testing.compare_with_reference(_fk(), _ref(), [q, k, c, s], arg_names=NAMES)
    assert result.names == ["output0", "output1", f"grad of {'k' if frozen == 'q' else 'q'}"]


def test_only_one_output_used(device: str) -> None:
    q, k = qk(2, 5, 4, 2, 64, torch.float32, device, "bhsd", seed=15)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    q_embed, _ = rope(q, k, c, s)
    q_embed.backward(torch.ones_like(q_embed))
    assert k.grad is None and q.grad is not None
    qr = q.detach().double().requires_grad_()
    rope_ref(qr, k.detach().double(), c.double(), s.double())[0].backward(torch.ones_like(qr))
    assert qr.grad is not None
    torch.testing.assert_close(q.grad.double(), qr.grad, rtol=1e-5, atol=1e-5)


def test_upstream_gradient_with_zero_strides(device: str) -> None:
    q, k = qk(2, 5, 4, 2, 64, torch.float32, device, "bhsd", seed=16)
    c, s = cos_sin(torch.arange(5)[None], 48, torch.float32, device)
    q_embed, k_embed = rope(q, k, c, s)
    (q_embed.sum() + k_embed.sum()).backward()
    qr, kr = (t.detach().double().requires_grad_() for t in (q, k))
    a, b = rope_ref(qr, kr, c.double(), s.double())
    (a.sum() + b.sum()).backward()
    assert q.grad is not None and k.grad is not None and qr.grad is not None and kr.grad is not None
    torch.testing.assert_close(q.grad.double(), qr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad.double(), kr.grad, rtol=1e-5, atol=1e-5)


def test_every_output_element_is_written(device: str) -> None:
    for _ in range(3):
        torch.full((2, 7, 6, 80), float("nan"), device=device)
    q, k = qk(2, 7, 4, 2, 80, torch.bfloat16, device, "bshd", seed=17)
    c, s = cos_sin(torch.arange(7)[None], 32, torch.bfloat16, device)
    q_embed, k_embed = rope(q, k, c, s, layout="bshd")
    (q_embed.float().sum() + k_embed.float().sum()).backward()
    for t in (q_embed, k_embed, q.grad, k.grad):
        assert t is not None and torch.isfinite(t).all()


def test_empty_sequence(device: str) -> None:
    q, k = qk(2, 0, 4, 2, 64, torch.float32, device, "bhsd", seed=18)
    c, s = torch.zeros(1, 0, 64, device=device), torch.zeros(1, 0, 64, device=device)
    q_embed, k_embed = rope(q, k, c, s)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_heads_in_several_tiles(device: str, interleaved: bool) -> None:
    n_q, n_k, d = 96, 40, 128  # q in whole tiles; k in a full and a masked one
    tiling = rope_tiling(n_q, n_k, d)
    assert tiling.block_hq < n_q and tiling.block_hk < n_k and n_q % tiling.block_hq == 0
    q, k = qk(1, 3, n_q, n_k, d, torch.bfloat16, device, "bshd", seed=28)
    c, s = cos_sin(torch.arange(3)[None], 96, torch.bfloat16, device, interleaved)
    testing.compare_with_reference(_fk("bshd", interleaved), _ref("bshd", interleaved), [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_loads_first(
    device: str, dtype: torch.dtype, layout: str, interleaved: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # q and k each in one tile of heads, all their loads before the stores (LOADS_FIRST): against
    # the reference, and in place equal to the result of q's tile stored before k's is loaded.
    q, k = qk(2, 9, 6, 2, 64, dtype, device, layout, seed=29)
    c, s = cos_sin(torch.arange(9)[None], 64, dtype, device, interleaved)
    monkeypatch.setattr(ROPE_MODULE, "LOADS_FIRST", False)
    want = rope(q.detach(), k.detach(), c, s, layout=layout, interleaved=interleaved)
    monkeypatch.setattr(ROPE_MODULE, "LOADS_FIRST", True)
    tiling = rope_tiling(6, 2, 64)
    assert tiling.block_hq >= 6 and tiling.block_hk >= 2
    testing.compare_with_reference(_fk(layout, interleaved), _ref(layout, interleaved), [q, k, c, s], arg_names=NAMES)
    qd, kd = q.detach().clone(), k.detach().clone()
    rope(qd, kd, c, s, layout=layout, interleaved=interleaved, inplace=True)
    torch.testing.assert_close((qd, kd), want, rtol=0, atol=0)


def test_tiling_covers_every_head() -> None:
    for n_q, n_k, d in [(32, 8, 128), (64, 8, 128), (3, 1, 256), (40, 8, 80), (128, 128, 64), (0, 8, 128)]:
        t = rope_tiling(n_q, n_k, d)
        assert t.block_s >= 1 and t.block_hq >= 1 and t.block_hk >= 1 and t.num_warps >= 1


# --- one tensor ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["full", "partial", "interleaved", "positions"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_single_matches_reference(device: str, dtype: torch.dtype, layout: str, case: str) -> None:
    x, _ = qk(2, 7, 5, 1, 80, dtype, device, layout, seed=40)
    interleaved, rd = case == "interleaved", 32 if case == "partial" else 80
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2, device=device) if case == "positions" else None
    c, s = cos_sin(torch.arange(7 if positions is None else 4)[None], rd, dtype, device, interleaved)

    def fk_fn(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return rope_single(x, c, s, positions, layout=layout, interleaved=interleaved)

    def ref_fn(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return rope_ref(x, x, c, s, positions, layout=layout, interleaved=interleaved)[0]

    result = testing.compare_with_reference(fk_fn, ref_fn, [x, c, s], arg_names=["x", "cos", "sin"])
    assert result.names == ["output0", "grad of x"]


def test_single_launches_one_kernel_of_x_alone(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The k of no heads rope_single hands on is not touched: one launch, of x alone, forward and backward.
    kernel, launches = ROPE_MODULE._rope_kernel, []

    class Recording:
        def __getitem__(self, grid: Any) -> Callable[..., None]:
            def launch(*args: Any, **kw: Any) -> None:
                launches.append((kw["DO_Q"], kw["DO_K"], kw["BACKWARD"]))
                kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(ROPE_MODULE, "_rope_kernel", Recording())
    x, _ = qk(2, 5, 4, 1, 64, torch.float32, device, "bshd", seed=41)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    if not uses_kernel(x):
        pytest.skip("without the kernel (no GPU, no interpreter) the reference runs")
    rope_single(x, c, s, layout="bshd").sum().backward()
    assert launches == [(True, False, False), (True, False, True)]


def test_single_bad_inputs(device: str) -> None:
    x = torch.randn(2, 4, 5, 64, device=device)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (TypeError, r"x must be a torch\.Tensor", lambda: rope_single([1.0], c, s)),  # type: ignore[arg-type]
        (TypeError, "x must have dtype in", lambda: rope_single(x.int(), c, s)),
        (ValueError, "x must have 4 dimension", lambda: rope_single(x[0], c, s)),
        (ValueError, "layout must be one of", lambda: rope_single(x, c, s, layout="sbhd")),
        (ValueError, r"cos must have one row per token \(5", lambda: rope_single(x, c[:, :4], s[:, :4])),
    ]  # fmt: skip
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


# --- against Hugging Face --------------------------------------------------------------------------


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_hf_formula(device: str, dtype: torch.dtype, unsqueeze_dim: int) -> None:
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    q, k = qk(2, 9, 8, 2, 128, dtype, device, layout, seed=19)
    c, s = cos_sin(torch.arange(9)[None] + torch.arange(2)[:, None], 128, dtype, device)

    def fk_fn(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        return apply_rotary_pos_emb(q, k, c, s, None, unsqueeze_dim)

    def hf_fn(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        return hf_apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim)

    testing.compare_with_reference(fk_fn, hf_fn, [q, k, c, s], arg_names=NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_phi_partial_rotary_and_gptj(device: str, dtype: torch.dtype) -> None:
    q, k = qk(2, 5, 4, 4, 80, dtype, device, "bhsd", seed=20)
    c, s = cos_sin(torch.arange(5)[None], 32, dtype, device)
    testing.compare_with_reference(lambda *a: apply_rotary_pos_emb(*a), hf_partial_rotary, [q, k, c, s])
    q, k = qk(2, 5, 4, 4, 64, dtype, device, "bshd", seed=21)
    c, s = cos_sin(torch.arange(5)[None], 64, dtype, device, interleaved=True)
    testing.compare_with_reference(_fk("bshd", interleaved=True), gptj_apply, [q, k, c, s])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_drop_in_interleaved_matches_cohere_formula(device: str, dtype: torch.dtype) -> None:
    """``interleaved=True``: Cohere's ``apply_rotary_pos_emb`` (pairs ``(x[2i], x[2i+1])``, tables
    as given, ``(B, heads, S, D)``), which the rotate-half drop-in does not compute."""
    q, k = qk(2, 5, 4, 2, 64, dtype, device, "bhsd", seed=23)
    c, s = cos_sin(torch.arange(5)[None], 64, dtype, device, interleaved=True)

    def cohere(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Any:
        c, s = c.unsqueeze(1), s.unsqueeze(1)
        return tuple(x * c + gptj_rotate_every_two(x.transpose(1, 2)).transpose(1, 2) * s for x in (q, k))

    testing.compare_with_reference(lambda *a: apply_rotary_pos_emb(*a, interleaved=True), cohere, [q, k, c, s])
    got = apply_rotary_pos_emb(q.detach(), k.detach(), c, s)
    assert not torch.allclose(got[0].float(), cohere(q.detach(), k.detach(), c, s)[0].float(), atol=1e-2)


def test_drop_in_position_ids_select_table_rows(device: str) -> None:
    q, k = qk(2, 5, 4, 2, 64, torch.float32, device, "bhsd", seed=22)
    c, s = cos_sin(torch.arange(12)[None], 64, torch.float32, device)
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 0, 1]], device=device)
    got = apply_rotary_pos_emb(q.detach(), k.detach(), c[0], s[0], pos)  # older HF: cos[position_ids]
    want = hf_apply_rotary_pos_emb(q.detach(), k.detach(), c[0][pos], s[0][pos])
    torch.testing.assert_close(got, want)
    # With per-token cos/sin (HF >= 4.38), position_ids is ignored, as Hugging Face ignores it.
    per_token = c[0][pos], s[0][pos]
    torch.testing.assert_close(apply_rotary_pos_emb(q.detach(), k.detach(), *per_token, pos.flip(1)), want)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_transformers(device: str, dtype: torch.dtype, unsqueeze_dim: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_fn

    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    q, k = qk(2, 33, 8, 2, 128, dtype, device, layout, seed=23)
    c, s = cos_sin(torch.arange(33)[None], 128, dtype, device)
    testing.compare_with_reference(
        lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=unsqueeze_dim),
        lambda q, k, c, s: hf_fn(q, k, c, s, unsqueeze_dim=unsqueeze_dim),
        [q, k, c, s], arg_names=NAMES,
    )  # fmt: skip


# --- bad inputs, compile, paths --------------------------------------------------------------------


def test_bad_inputs(device: str) -> None:
    q = torch.randn(2, 4, 5, 64, device=device)
    k = torch.randn(2, 2, 5, 64, device=device)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (TypeError, r"q must be a torch\.Tensor", lambda: rope([1.0], k, c, s)),  # type: ignore[arg-type]
        (TypeError, "q must have dtype in", lambda: rope(q.int(), k, c, s)),
        (TypeError, r"k must have the dtype of q \(float32\), got float16", lambda: rope(q, k.half(), c, s)),
        (ValueError, "q must have 4 dimension", lambda: rope(q[0], k, c, s)),
        (ValueError, "k must have the batch size, sequence length and head size of q", lambda: rope(q, k[..., :32], c, s)),
        (ValueError, "k must have the batch size, sequence length and head size of q", lambda: rope(q, k[:, :, :4], c, s)),
        (ValueError, "k must be on the device of q", lambda: rope(q, k.to("meta"), c, s)),
        (ValueError, "cos must have 2 or 3 dimension", lambda: rope(q, k, c[None], s[None])),
        (ValueError, r"sin must have shape \(1, 5, 64\), got \(1, 5, 32\)", lambda: rope(q, k, c, s[..., :32])),
        (ValueError, "even last dimension", lambda: rope(q, k, c[..., :31], s[..., :31])),
        (ValueError, "even last dimension", lambda: rope(q[..., :32], k[..., :32], c, s)),
        (ValueError, "cos must have batch size 1 or 2", lambda: rope(q, k, c.expand(3, 5, 64), s.expand(3, 5, 64))),
        (ValueError, r"cos must have one row per token \(5", lambda: rope(q, k, c[:, :4], s[:, :4])),
        (ValueError, "cos must be on the device of q", lambda: rope(q, k, c.to("meta"), s)),
        (ValueError, "layout must be one of", lambda: rope(q, k, c, s, layout="sbhd")),
        (TypeError, "interleaved must be a bool", lambda: rope(q, k, c, s, interleaved=1)),  # type: ignore[arg-type]
        (TypeError, "position_ids must have dtype in", lambda: rope(q, k, c, s, torch.zeros(1, 5, device=device))),
        (ValueError, r"position_ids must have shape \(1 or 2, 5\)", lambda: rope(q, k, c, s, torch.zeros(1, 4, dtype=torch.long, device=device))),
        (ValueError, r"position_ids must be in \[0, 5\).*\[1, 5\]", lambda: rope(q, k, c, s, torch.arange(6, device=device)[None, 1:])),
        (ValueError, r"position_ids must be in \[0, 5\).*\[-1, 3\]", lambda: rope(q, k, c, s, torch.arange(-1, 4, device=device)[None])),
        (ValueError, "unsqueeze_dim must be 1", lambda: apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=0)),
    ]  # fmt: skip
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def test_cos_sin_that_require_grad_are_rejected(device: str) -> None:
    q, k = qk(2, 5, 4, 2, 64, torch.float32, device, "bhsd", seed=24)
    c, s = cos_sin(torch.arange(5)[None], 64, torch.float32, device)
    with pytest.raises(ValueError, match=r"cos requires grad, but fk.rope does not differentiate cos and sin"):
        rope(q, k, c.requires_grad_(), s)
    with pytest.raises(ValueError, match="sin requires grad"):
        rope(q, k, c.detach(), s.requires_grad_())
    with torch.no_grad():  # nothing is recorded: allowed
        rope(q, k, c, s)
    with pytest.raises(ValueError, match="inplace=True cannot overwrite q: it is a leaf tensor that requires grad"):
        rope(q, k, c.detach(), s.detach(), inplace=True)


@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile_fullgraph(device: str, inplace: bool) -> None:
    q0, k0 = qk(2, 5, 4, 2, 64, torch.float32, device, "bhsd", seed=25)
    c, s = cos_sin(torch.arange(5)[None], 48, torch.float32, device)

    def loss(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q_embed, k_embed = rope(q * 2.0, k * 1.0, c, s, inplace=inplace)
        return (q_embed * 3.0).sum() + (k_embed * k_embed).sum()

    testing.assert_compile_matches_eager(loss, [q0, k0])


def test_single_torch_compile_fullgraph(device: str) -> None:
    x0, _ = qk(2, 5, 4, 1, 64, torch.float32, device, "bshd", seed=42)
    c, s = cos_sin(torch.arange(5)[None], 48, torch.float32, device)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return (rope_single(x * 2.0, c, s, layout="bshd") * 3.0).sum()

    testing.assert_compile_matches_eager(loss, [x0])


S = testing.strategies()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=S.dtypes, layout=st.sampled_from(LAYOUTS), interleaved=st.booleans(),
    batch=st.integers(1, 3), seq=st.integers(1, 9), n_k=st.integers(1, 3), ratio=st.sampled_from([1, 2, 4]),
    half=st.integers(1, 24), extra=st.integers(0, 9),
)  # fmt: skip
def test_property_any_shape(
    device: str, dtype: torch.dtype, layout: str, interleaved: bool,
    batch: int, seq: int, n_k: int, ratio: int, half: int, extra: int,
) -> None:  # fmt: skip
    rd, d = 2 * half, 2 * half + extra
    q, k = qk(batch, seq, n_k * ratio, n_k, d, dtype, device, layout, seed=seq * 131 + d)
    c, s = cos_sin(torch.arange(seq)[None], rd, dtype, device, interleaved)
    testing.compare_with_reference(_fk(layout, interleaved), _ref(layout, interleaved), [q, k, c, s], arg_names=NAMES)


def test_cpu_without_interpreter_takes_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch; from fk.rope import rope, rope_ref; from fk.core import backend;"
        "q = torch.randn(2, 4, 5, 64, dtype=torch.bfloat16); k = torch.randn(2, 2, 5, 64, dtype=torch.bfloat16);"
        "c = torch.randn(1, 5, 32); s = torch.randn(1, 5, 32);"
        "assert backend.kernel_path(q) is backend.KernelPath.REFERENCE;"
        "assert all(torch.equal(a, b) for a, b in zip(rope(q, k, c, s), rope_ref(q, k, c, s)));"
        "q2, k2 = q.clone(), k.clone(); out = rope(q2, k2, c, s, inplace=True);"
        "assert out[0] is q2 and torch.equal(q2, rope_ref(q, k, c, s)[0]); print('ok')"
    )


# --- real sizes on the GPU -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(4, 4096, 32, 8, 128), (2, 2048, 64, 8, 128), (2, 1027, 32, 32, 80), (1, 4096, 16, 16, 256)]
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_training_shapes(shape: tuple[int, int, int, int, int], layout: str) -> None:
    batch, seq, n_q, n_k, d = shape
    q, k = qk(batch, seq, n_q, n_k, d, torch.bfloat16, "cuda", layout, seed=seq)
    c, s = cos_sin(torch.arange(seq)[None], d, torch.bfloat16, "cuda")
    testing.compare_with_reference(_fk(layout), _ref(layout), [q, k, c, s], arg_names=NAMES)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_gpu_partial_rotary_and_positions(interleaved: bool) -> None:
    q, k = qk(2, 3000, 32, 8, 128, torch.bfloat16, "cuda", "bshd", seed=26)
    position_ids = (torch.arange(3000) % 1000)[None].expand(2, -1).cuda()
    c, s = cos_sin(torch.arange(1000)[None], 64, torch.float32, "cuda", interleaved)
    testing.compare_with_reference(_fk("bshd", interleaved), _ref("bshd", interleaved), [q, k, c, s, position_ids],
                                   arg_names=[*NAMES, "position_ids"])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_gpu_matches_transformers_at_llama_size() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_fn

    qkv = testing.random_tensor((4, 4096, 48 * 128), torch.bfloat16, "cuda", seed=27).view(4, 4096, 48, 128)
    q, k = qkv[:, :, :32].transpose(1, 2), qkv[:, :, 32:40].transpose(1, 2)
    q.requires_grad_(), k.requires_grad_()
    c, s = cos_sin(torch.arange(4096)[None], 128, torch.bfloat16, "cuda")
    testing.compare_with_reference(apply_rotary_pos_emb, hf_fn, [q, k, c, s], arg_names=NAMES)
