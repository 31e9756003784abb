"""fk.hf.recompute and the recompute_norms switch: the norms' outputs are freed after the forward,
formed again in the backward bit for bit, and the gradients are the ones kept outputs give."""

from __future__ import annotations

import copy
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fk.hf
from fk.hf.recompute import applies, recomputed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_patching import _batch, _model


def _toy(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen).to(device).requires_grad_()
    w = torch.randn(6, 8, generator=gen).to(device).requires_grad_()
    dy = torch.randn(3, 5, 6, generator=gen).to(device)
    return x, w, dy


def test_saved_views_of_the_output_are_formed_again_once(device: str) -> None:
    """Two ops that save views of h (F.linear's 2-D rows, a transpose) keep notes instead: h is
    freed after the forward, formed again once in the backward, and the gradients are exact."""
    x, w, dy = _toy(device)
    made: list[int] = []

    def loss_of(recompute: bool) -> torch.Tensor:
        h = torch.tanh(x)
        ref = weakref.ref(h)

        def make() -> torch.Tensor:
            made.append(1)
            return torch.tanh(x)

        if recompute:
            with recomputed(h, make):
                y = F.linear(h, w) + (h.transpose(1, 2) ** 2).sum()
        else:
            y = F.linear(h, w) + (h.transpose(1, 2) ** 2).sum()
        del h
        assert (ref() is None) == recompute  # kept by the graph only without recomputation
        return (y * dy).sum()

    loss_of(False).backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    loss_of(True).backward()
    assert made == [1]
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])


def test_no_op_without_grad_under_other_hooks_and_for_views(device: str) -> None:
    """Nothing is recomputed (``make`` never runs) without grad mode, inside other saved-tensor
    hooks (activation checkpointing's, which would be shadowed), or for an ``h`` that is a view."""
    x, w, dy = _toy(device)
    h = torch.tanh(x)
    assert applies(h)

    def never() -> torch.Tensor:
        raise AssertionError("recomputed where it must not")

    with torch.no_grad():
        assert not applies(h)
        with recomputed(h, never):
            F.linear(h, w)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not applies(h)
        with recomputed(h, never):
            y = F.linear(h, w)
    (y * dy).sum().backward()
    assert not applies(h[1:]) and not applies(h.transpose(0, 1))


def _norm_outputs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Weak references to every output of the two norms the add_norm forward calls."""
    import fk.norms

    refs: list[Any] = []
    for name in ("rms_norm_and_input", "fused_add_rms_norm"):
        fn = getattr(fk.norms, name)

        def spy(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            out = _fn(*a, **k)
            refs.append(weakref.ref(out[0]))
            return out

        monkeypatch.setattr(fk.norms, name, spy)
    return refs


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_norms_frees_the_outputs_with_the_same_gradients(
    model_type: str, dtype: torch.dtype, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With recompute_norms, the outputs of both norms of every layer are freed when the forward
    ends, and the loss and every gradient are bit for bit those of the same patch keeping them
    (Gemma's offset and casting too); ``revert`` drops the switch with the patch."""
    kept = _model(model_type, device).to(dtype)
    fk.hf.apply(kept)
    freed = copy.deepcopy(kept)
    counts = fk.hf.apply(freed, recompute_norms=True)
    assert counts["recompute_norms"] == 2 and fk.hf.apply(copy.deepcopy(kept))["recompute_norms"] == 0
    refs = _norm_outputs(monkeypatch)
    ids, labels = _batch(device)
    losses = []
    for model, recompute in ((kept, False), (freed, True)):
        loss = model(input_ids=ids, labels=labels).loss
        assert len(refs) == 4 and all((r() is None) == recompute for r in refs)
        loss.backward()
        losses.append(loss)
        refs.clear()
    assert torch.equal(losses[0], losses[1])
    grads = dict(freed.named_parameters())
    for name, p in kept.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name
    assert fk.hf.revert(freed) > 0 and fk.hf.apply(freed, recompute_norms=False)["recompute_norms"] == 0


def test_recompute_norms_under_gradient_checkpointing(device: str) -> None:
    """Under transformers' gradient checkpointing, recompute_norms changes nothing: the same
    gradients as without it (checkpointing's own recomputation runs the layers again)."""
    kept = _model("llama", device)
    kept.gradient_checkpointing_enable()
    fk.hf.apply(kept)
    freed = copy.deepcopy(kept)
    fk.hf.apply(freed, recompute_norms=True)
    ids, labels = _batch(device)
    for model in (kept, freed):
        model(input_ids=ids, labels=labels).loss.backward()
    grads = dict(freed.named_parameters())
    for name, p in kept.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name


def test_recompute_norms_on_a_peft_lora_model(device: str) -> None:
    """On a PEFT LoRA model (fk.lora's fused projections save the norm outputs), the same LoRA
    gradients (dA is formed from the recomputed outputs)."""
    peft = pytest.importorskip("peft")
    base = _model("llama", device)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False
    )  # B not 0: dA depends on h
    kept = peft.get_peft_model(base, config)
    freed = copy.deepcopy(kept)
    fk.hf.apply(kept)
    assert fk.hf.apply(freed, recompute_norms=True)["recompute_norms"] == 2
    ids, labels = _batch(device)
    for model in (kept, freed):
        model(input_ids=ids, labels=labels).loss.backward()
    grads = dict(freed.named_parameters())
    for name, p in kept.named_parameters():
        if p.requires_grad:
            assert torch.equal(grads[name].grad, p.grad), name
