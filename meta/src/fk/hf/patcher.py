"""Patch a built model in place, and undo it: :func:`apply_patch`, :func:`revert`.

Modules are patched, not source: each patched module's class is swapped for a subclass that
differs only by its ``forward`` and keeps the class's name (see :mod:`fk.core.forward`; the class
itself and every other model of that class are untouched), so the parameters, buffers and
``state_dict`` stay exactly as they were, and a copy of the module (``torch.nn.DataParallel``'s
replicas) runs fk's forward with its own parameters.

Which modules: those :mod:`fk.hf.recognize` finds by structure and :mod:`fk.hf.probe` verifies,
once per block type and call. First the blocks (norms, gated MLPs, attention), then what is built
of them (decoder layers, whose ``add_norm`` needs their norms patched, and the head, probed on the
patched model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch

from fk.core.forward import SharedInputGroup, restore_class, stock_forward, swap_forward, swapped
from fk.hf import probe
from fk.hf.blocks import (
    geglu_forward,
    layer_norm_forward,
    projections_forward,
    rms_norm_forward,
    rope_forward,
    swiglu_forward,
)
from fk.hf.decoder import add_norm_forward_for
from fk.hf.loss_head import causal_lm_forward, causal_lm_forward_as
from fk.hf.marks import ALL, GROUP, KIND, LORA, PLAN, RECOMPUTE, STOCK, SWITCHED_OFF
from fk.hf.recognize import (
    ROPE_FUNCTION,
    HeadPlan,
    MlpPlan,
    NormPlan,
    Refusal,
    head_candidate,
    mlp_candidate,
    norm_candidate,
    rope_candidate,
)
from fk.hf.report import PatchReport
from fk.hf.seq2seq_head import Seq2SeqHeadPlan, seq2seq_candidate, seq2seq_forward
from fk.hf.sharding_hooks import plain_linear
from fk.hf.switches import SWITCHES

BLOCK_FORWARDS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm_forward,
    "layer_norm": layer_norm_forward,
    "swiglu": swiglu_forward,
    "geglu": geglu_forward,
}


@functools.cache
def _revertible(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an fk forward), which calls the stock forward instead once :func:`revert` has switched
    it off: revert does that when someone else has wrapped fk's forward since (accelerate's
    autocast wrapper and TRL's fused head as an instance ``forward``, FSDP2's ``fully_shard`` as a
    subclass), since removing fk's would remove theirs too. A module fk did not patch (one built by
    calling a patched class) runs the stock forward too. One wrapper per ``fn``."""

    @functools.wraps(fn)  # the signature stays fn's: the Trainer inspects it
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if SWITCHED_OFF in self.__dict__ or KIND not in self.__dict__:  # or built by type(module)(...)
            return stock_forward(self, STOCK, *args, **kwargs)
        return fn(self, *args, **kwargs)

    return forward


@functools.cache
def _flce_forward(stock: Callable[..., Any]) -> Callable[..., Any]:
    """The fused head's forward for a causal-LM class whose forward is ``stock``: its parameters
    shown as stock's (:func:`fk.hf.loss_head.causal_lm_forward_as`); one per class."""
    from transformers.utils import can_return_tuple

    return can_return_tuple(causal_lm_forward_as(stock))


@functools.cache
def _seq2seq_forward(stock: Callable[..., Any]) -> Callable[..., Any]:
    """The fused head's forward for an encoder-decoder LM class whose forward is ``stock``
    (:func:`fk.hf.seq2seq_head.seq2seq_forward`); one per class."""
    return seq2seq_forward(stock)


def _set_forward(module: torch.nn.Module, kind: str, fn: Callable[..., Any], plan: Any = None) -> None:
    module.__dict__[KIND] = kind
    if plan is not None:
        module.__dict__[PLAN] = plan
    swap_forward(module, _revertible(fn), STOCK)


def is_patched(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself carries an fk.hf patch."""
    return KIND in module.__dict__


def patched_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of ``model`` carry each kind of patch (``{"rms_norm": 5, ...}``)."""
    counts = dict.fromkeys(SWITCHES, 0)
    for module in model.modules():
        if is_patched(module):
            counts[module.__dict__[KIND]] += 1
        if RECOMPUTE in module.__dict__:
            counts["recompute_norms"] += 1
        report = module.__dict__.get(LORA)
        if report is not None:
            counts["lora"] += report.n_patched
    return counts


def revert(model: torch.nn.Module) -> int:
    """Undo :func:`apply_patch` on ``model`` (every submodule); returns how many modules were
    restored (each LoRA module whose forward fk.lora had swapped counts as one).

    A model that was never patched is left as it is (returns 0).
    """
    restored = 0
    for module in model.modules():
        if not is_patched(module):
            module.__dict__.pop(PLAN, None)  # (a norm's plan kept for add_norm, see _patch_block)
        if module.__dict__.pop(LORA, None) is not None:
            import fk.lora

            restored += fk.lora.unpatch(module)
        if not is_patched(module):
            continue
        for key in ALL:
            module.__dict__.pop(key, None)
        if restore_class(module):
            module.__dict__.pop(STOCK, None)
        else:  # wrapped since by someone else (their subclass, or an instance forward): switch fk's off
            module.__dict__[SWITCHED_OFF] = True
        restored += 1
    return restored


def has_lora_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds PEFT LoRA layers (``peft`` is not imported to find out: a model
    with PEFT layers has imported it already)."""
    import sys

    peft_lora = sys.modules.get("peft.tuners.lora.layer")
    layer = getattr(peft_lora, "LoraLayer", None)
    return layer is not None and any(isinstance(m, layer) for m in model.modules())


def _group_projections(attention: torch.nn.Module) -> bool:
    """Give ``attention``'s ``q_proj``, ``k_proj`` and ``v_proj`` the ``qkv`` forward, as one
    shared-input group, where all three are plain ``nn.Linear`` layers fk has not patched and
    whose forward nobody replaced on the instance (see :func:`fk.hf.blocks.projections_forward`).
    The group computes exactly what the three ``F.linear`` calls do, so it needs no probe."""
    members = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(m is not None and plain_linear(m) and not swapped(m) for m in members):
        return False
    group = SharedInputGroup(members)  # type: ignore[arg-type]
    for index, member in enumerate(members):
        assert member is not None
        member.__dict__[GROUP] = (group, index)
        _set_forward(member, "qkv", projections_forward)
    return True


class _Verdicts:
    """The probe's verdict per block type (and what else decides it), once per :func:`apply_patch`
    call, and the report's two lists."""

    def __init__(self) -> None:
        self.cache: dict[Hashable, Any] = {}
        self.patched: dict[str, str] = {}
        self.stock: dict[str, str] = {}

    def decide(self, key: Hashable, find: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = find()
        return self.cache[key]

    def record(self, module: torch.nn.Module, kind: str, refusal: Refusal | None = None) -> None:
        name = type(module).__name__
        if refusal is None:
            kinds = self.patched.get(name)
            self.patched[name] = kind if kinds is None or kind in kinds.split(", ") else f"{kinds}, {kind}"
        else:
            self.stock.setdefault(name, f"{refusal.kind}: {refusal.reason}")


def _free(module: torch.nn.Module) -> bool:
    """Modules whose ``forward`` someone replaced on the instance (accelerate's hooks: it would
    shadow fk's), and modules whose class fk already swapped (fk.lora's, or an fk.hf forward
    :func:`revert` switched off under another's wrapper), are left alone."""
    return "forward" not in module.__dict__ and not swapped(module)


def _patch_block(module: torch.nn.Module, switches: dict[str, bool], verdicts: _Verdicts) -> None:
    """A norm, gated MLP or attention block of pass one (see :func:`apply_patch`)."""
    cls = type(module)
    eps_attr = norm_candidate(module)
    if eps_attr is not None:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        key = (cls, "norm", eps_attr, weight is None, bias is None)
        found = (
            eps_attr if isinstance(eps_attr, Refusal) else verdicts.decide(key, lambda: probe.norm(module, eps_attr))
        )
        if isinstance(found, Refusal):
            verdicts.record(module, found.kind, found)
        elif switches[found.kind]:
            _set_forward(module, found.kind, BLOCK_FORWARDS[found.kind], found)
            verdicts.record(module, found.kind)
        else:  # not patched, but add_norm may fuse it (fk.hf.decoder reads the plan)
            module.__dict__[PLAN] = found
        return
    mlp = mlp_candidate(module)
    if mlp is not None:
        if isinstance(mlp, MlpPlan) and switches[mlp.kind]:
            found_mlp = mlp
            mlp = verdicts.decide((cls, mlp), lambda: probe.mlp(module, found_mlp, BLOCK_FORWARDS[found_mlp.kind]))
        if isinstance(mlp, Refusal):
            verdicts.record(module, mlp.kind, mlp)
        elif switches[mlp.kind]:
            _set_forward(module, mlp.kind, BLOCK_FORWARDS[mlp.kind], mlp)
            verdicts.record(module, mlp.kind)
        return
    rope = rope_candidate(cls.forward) if switches["rope"] else None
    if isinstance(rope, Refusal):
        verdicts.record(module, "rope", rope)
    elif rope is not None:
        fk_rope = probe.rope(rope)
        if isinstance(fk_rope, str):
            verdicts.record(module, "rope", Refusal("rope", fk_rope))
        else:
            forward = rope_forward(cls.forward, ((ROPE_FUNCTION, fk_rope),))
            _set_forward(module, "rope", forward)  # (the copied forward is all it needs)
            verdicts.record(module, "rope")
    if switches["qkv"] and _group_projections(module):
        verdicts.record(module, "qkv")


def _patch_composite(module: torch.nn.Module, switches: dict[str, bool], verdicts: _Verdicts) -> None:
    """A decoder layer or causal-LM head of pass two (see :func:`apply_patch`)."""
    add_norm = add_norm_forward_for(type(module).forward) if switches["add_norm"] else None
    post_norm = getattr(module, "post_attention_layernorm", None)
    post_plan = post_norm.__dict__.get(PLAN) if isinstance(post_norm, torch.nn.Module) else None
    if add_norm is not None and isinstance(post_plan, NormPlan) and post_plan.kind == "rms_norm":
        _set_forward(module, "add_norm", add_norm)
        if switches["recompute_norms"]:
            module.__dict__[RECOMPUTE] = True
        verdicts.record(module, "add_norm")
        return
    head: HeadPlan | Seq2SeqHeadPlan | Refusal | None = head_candidate(module) if switches["flce"] else None
    encoder_decoder = seq2seq_candidate(module) if switches["flce"] else None
    if encoder_decoder is not None:  # (an encoder-decoder LM's forward is never Llama's)
        head = encoder_decoder
    if isinstance(head, Refusal):
        verdicts.record(module, "flce", head)
    elif isinstance(head, Seq2SeqHeadPlan):
        refusal = probe.head(module, head, _seq2seq_forward(type(module).forward))
        if refusal is None:
            _set_forward(module, "flce", _seq2seq_forward(type(module).forward), head)
        verdicts.record(module, "flce", refusal)
    elif head is not None:
        refusal = probe.head(module, head, causal_lm_forward)
        if refusal is None:
            _set_forward(module, "flce", _flce_forward(type(module).forward), head)
        verdicts.record(module, "flce", refusal)


def apply_patch(model: torch.nn.Module, switches: dict[str, bool], *, strict: bool = False) -> PatchReport:
    """Patch every block of ``model`` that structure recognizes, the probe verifies and ``switches``
    allow; see :func:`fk.hf.apply`.

    A model already patched is reverted first, so the switches of the latest call hold. With
    ``switches["lora"]``, :func:`fk.lora.patch` runs first on a model that has PEFT LoRA layers
    (see :func:`has_lora_layers`), so the modules it fuses (a LoRA MLP) carry its forward and are
    skipped here. ``strict``: raise ``ValueError`` (after patching what could be) when a candidate
    block was left stock.
    """
    revert(model)
    if switches.get("lora", False) and has_lora_layers(model):
        import fk.lora

        model.__dict__[LORA] = fk.lora.patch(model)
    verdicts = _Verdicts()
    for module in list(model.modules()):
        if _free(module):
            _patch_block(module, switches, verdicts)
    for module in list(model.modules()):
        if _free(module):
            _patch_composite(module, switches, verdicts)
    report = PatchReport(patched_modules(model), verdicts.patched, verdicts.stock)
    report.log()
    if strict and report.stock:
        raise ValueError(f"fk.hf.apply(strict=True): some blocks could not be patched\n{report}")
    return report
