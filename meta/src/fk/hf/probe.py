"""Before fk.hf trusts a block type, it runs stock and fk once on a small input and compares.

A norm or gated MLP is probed on its own device, in its own dtype, forward and backward (the input's
gradient and, for a norm, the weight's), on a copy of a norm with random weights (so that an offset
shows) and on the MLP itself (its gradients are taken with ``torch.autograd.grad``: nothing is left
in any ``.grad``). The rotary function is probed on the CPU in fp32 (it is a pure function of its
inputs: full and partial rotary). The head is probed last, on the whole patched model: the loss of
a batch of one 8-token sequence under ``torch.no_grad``, stock and fused, from the same random state.

What fails to agree within :data:`TOLERANCE` (or raises) stays stock, with the reason in the report.
Blocks on the meta device (a model built for ``from_pretrained`` before its weights are loaded)
are probed on CPU copies with random weights; the head, which needs the whole model, is then
taken on structure alone. So it is for a model built under DeepSpeed's ``zero.Init`` (ZeRO-3, as
``from_pretrained`` builds one when a ZeRO-3 config is active): its parameters are partitions
across the ranks; a norm or MLP is probed with its own parameters gathered for the probe (every
rank patches the same model, so every rank gathers the same ones), the head on structure alone
(gathering the whole model would take the memory ZeRO-3 is there to save).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fk.hf.marks import PLAN
from fk.hf.recognize import HeadPlan, MlpPlan, NormPlan, Refusal
from fk.hf.seq2seq_head import Seq2SeqHeadPlan
from fk.hf.sharding_hooks import is_zero3_partitioned

TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
"""Largest ``‖fk - stock‖ / ‖stock‖`` accepted, per dtype: a few times each dtype's rounding error
(fp32 leaves room for TF32 matmuls), far under the order-1 error of a wrong offset, activation or
rotation."""
PROBE_TOKENS = (2, 3)
"""Batch and sequence of a block probe's input."""
HEAD_PROBE_TOKENS = 8


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want64 = want.detach().double()
    return float((got.detach().double() - want64).norm() / want64.norm().clamp_min(1e-30))


def _agree(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], dtype: torch.dtype) -> float | None:
    """None when every pair agrees within the dtype's tolerance, else the largest error."""
    errors = [relative_error(g, w) if g.shape == w.shape else float("inf") for g, w in zip(got, want, strict=True)]
    worst = max(errors)
    return None if worst <= TOLERANCE.get(dtype, 1e-4) else worst


def _meta(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "meta"


@contextlib.contextmanager
def _gathered(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s DeepSpeed ZeRO-3 partitioned parameters (a model built under
    ``zero.Init``) are whole on every rank, read-only (``deepspeed.zero.GatheredParameters``, a
    collective: every rank probes the same modules); a module without any: nothing happens."""
    partitioned = [p for p in module.parameters() if is_zero3_partitioned(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        yield


def _weight(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # (recognize.mlp_candidate checked)
    return weight


def _materialized(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``; on the CPU with random weights where its parameters are on the meta
    device (a model built for ``from_pretrained`` before its weights are loaded), so that the
    copy can be probed. (The probe of a norm draws its own weights anyway.)"""
    probe = copy.deepcopy(module)
    if any(_meta(p) for p in probe.parameters()):
        probe = probe.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in probe.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * p.shape[-1] ** -0.5)
    return probe


def _with_grads(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """``fn(x)`` and the gradients of ``x`` and ``params`` for a fixed random output gradient."""
    x = x.detach().requires_grad_(True)
    out = fn(x)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), device="cpu").to(out)
    inputs = [x, *(p for p in params if p.requires_grad)]
    return (out, *torch.autograd.grad(out, inputs, dy))


# --- norms ---------------------------------------------------------------------------------------


def norm(module: torch.nn.Module, eps_attr: str) -> NormPlan | Refusal:
    """Which norm ``module`` is (see :mod:`fk.hf.recognize`): the first of RMSNorm with offset 0,
    RMSNorm with offset 1 (Gemma's ``1 + weight``) and LayerNorm whose forward and backward agree
    with stock's; its casting from :func:`casting`."""
    with _gathered(module):
        return _norm(module, eps_attr)


def _norm(module: torch.nn.Module, eps_attr: str) -> NormPlan | Refusal:
    from fk.norms import layer_norm

    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    some = weight if weight is not None else bias
    dtype = some.dtype if some is not None else torch.float32
    device = some.device if some is not None and not _meta(some) else torch.device("cpu")
    width = some.shape[0] if some is not None else 64
    probe = _materialized(module)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cpu"))
    params = list(probe.parameters())
    eps = getattr(module, eps_attr)
    x = torch.randn(*PROBE_TOKENS, width, generator=gen, device="cpu").to(device, dtype)
    try:
        want = _with_grads(probe, x, params)
    except Exception as e:
        return Refusal("rms_norm", f"stock forward failed on the probe ({type(e).__name__})")
    w, b = getattr(probe, "weight", None), getattr(probe, "bias", None)
    candidates: list[tuple[NormPlan, Callable[[torch.Tensor], torch.Tensor]]] = [
        (NormPlan("layer_norm", eps_attr), lambda t: layer_norm(t, w, b, eps))
    ]
    if bias is None:
        candidates[:0] = [
            (NormPlan("rms_norm", eps_attr, offset=offset), functools.partial(_rms, w=w, eps=eps, offset=offset))
            for offset in (0.0, 1.0)
        ]
    errors = []
    for plan, fn in candidates:
        try:
            error = _agree(_with_grads(fn, x, params), want, dtype)
        except Exception as e:
            return Refusal(plan.kind, f"fk failed on the probe ({type(e).__name__}: {e})")
        if error is None:
            if plan.kind == "layer_norm":
                return plan
            return NormPlan("rms_norm", eps_attr, casting(probe, eps, plan.offset), plan.offset)
        errors.append(error)
    return Refusal("rms_norm", f"probe mismatch {min(errors):.1e} (neither RMSNorm with offset 0 or 1 nor LayerNorm)")


def _rms(x: torch.Tensor, *, w: torch.Tensor | None, eps: float, offset: float) -> torch.Tensor:
    from fk.norms import rms_norm

    out: torch.Tensor = rms_norm(x, w, eps, offset=offset)
    return out


def casting(probe: torch.nn.Module, eps: float, offset: float) -> str:
    """``"llama"`` or ``"gemma"``: whichever of fk.norms' references equals the RMSNorm ``probe``
    (a copy with random weights) more closely in bf16 on the CPU (in fp32 the two are the same)."""
    from fk.norms import rms_norm_ref

    low = copy.deepcopy(probe).to("cpu", torch.bfloat16)
    weight = getattr(low, "weight", None)
    x = torch.randn(
        16, weight.shape[0] if weight is not None else 64, generator=torch.Generator().manual_seed(2), device="cpu"
    )
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        stock = low(x).float()
        errors = {mode: (rms_norm_ref(x, weight, eps, mode, offset).float() - stock).abs().max().item()
                  for mode in ("llama", "gemma")}  # fmt: skip
    return min(errors, key=lambda mode: errors[mode])


# --- gated MLPs ----------------------------------------------------------------------------------


def mlp(module: torch.nn.Module, plan: MlpPlan, forward: Callable[..., torch.Tensor]) -> MlpPlan | Refusal:
    """``plan`` where fk's ``forward`` of the gated MLP ``module`` agrees with stock's on the probe
    (on a CPU copy with random weights where the MLP's are on the meta device)."""
    with _gathered(module):
        return _mlp(module, plan, forward)


def _mlp(module: torch.nn.Module, plan: MlpPlan, forward: Callable[..., torch.Tensor]) -> MlpPlan | Refusal:
    if _meta(_weight(module.get_submodule("down_proj"))):
        module = _materialized(module)
    weight = _weight(module.get_submodule("gate_up_proj" if hasattr(module, "gate_up_proj") else "gate_proj"))
    x = torch.randn(*PROBE_TOKENS, weight.shape[-1], generator=torch.Generator().manual_seed(0), device="cpu")
    x = x.to(weight.device, weight.dtype)
    try:
        want = _with_grads(module, x, [])
    except Exception as e:
        return Refusal(plan.kind, f"stock forward failed on the probe ({type(e).__name__})")
    module.__dict__[PLAN] = plan
    try:
        got = _with_grads(lambda t: forward(module, t), x, [])
    except Exception as e:
        return Refusal(plan.kind, f"fk failed on the probe ({type(e).__name__}: {e})")
    finally:
        del module.__dict__[PLAN]
    error = _agree(got, want, weight.dtype)
    return plan if error is None else Refusal(plan.kind, f"probe mismatch {error:.1e}")


# --- rotary embedding ----------------------------------------------------------------------------


@functools.cache
def rope(fn: Callable[..., Any]) -> Callable[..., Any] | str:
    """The first of :func:`fk.hf.blocks.rope_variants` that equals ``fn`` (a model's own
    ``apply_rotary_pos_emb``) on random q (4 heads), k (2 heads), cos and sin in fp32, with full
    rotary and, where ``fn`` takes it, half; or why none does. A one-tensor ``fn`` (see
    :func:`fk.hf.recognize.rope_takes_one_tensor`) is compared on q alone, with the variants in
    that form (:func:`fk.hf.blocks.one_tensor_form`)."""
    from fk.hf.blocks import one_tensor_form, rope_variants
    from fk.hf.recognize import rope_takes_one_tensor

    if rope_takes_one_tensor(fn):
        variants = tuple((one_tensor_form(v), half) for v, half in rope_variants())
        return _first_rope_that_agrees(lambda f, q, k, c, s: (f(q, c, s),), fn, variants)
    return _first_rope_that_agrees(lambda f, q, k, c, s: tuple(f(q, k, c, s)), fn, rope_variants())


def _first_rope_that_agrees(
    call: Callable[..., tuple[Any, ...]], fn: Callable[..., Any], variants: tuple[tuple[Callable[..., Any], bool], ...]
) -> Callable[..., Any] | str:
    """:func:`rope`'s search: ``call(f, q, k, cos, sin)`` runs a rotary function of either form
    and gives its outputs as a tuple."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=gen, device="cpu"), torch.randn(2, 2, 5, 16, generator=gen, device="cpu")
    angles = [torch.randn(2, 5, rotary // 2, generator=gen, device="cpu") for rotary in (16, 8)]  # full, partial
    errors, failures = [], []
    for variant, half_tables in variants:
        checked, worst = 0, 0.0
        for a in angles:
            emb = a if half_tables else torch.cat([a, a], dim=-1)
            try:
                want = call(fn, q, k, emb.cos(), emb.sin())
            except Exception as e:
                failures.append(type(e).__name__)
                continue  # (that table width, or no partial rotary, in this function)
            try:
                got = call(variant, q, k, emb.cos(), emb.sin())
            except Exception as e:
                return f"fk failed on the probe ({type(e).__name__}: {e})"
            worst = max(worst, _agree(got, want, torch.float32) or 0.0)
            checked += 1
        if checked and worst == 0.0:
            return variant
        if checked:
            errors.append(worst)
    if not errors:
        return f"stock apply_rotary_pos_emb failed on the probe ({', '.join(sorted(set(failures)))})"
    return f"probe mismatch {min(errors):.1e} (no form of fk.rope's drop-in agrees)"


# --- the causal-LM head --------------------------------------------------------------------------


def head(module: torch.nn.Module, plan: HeadPlan | Seq2SeqHeadPlan, forward: Callable[..., Any]) -> Refusal | None:
    """None where the loss of fk's head ``forward`` (with ``plan``) equals stock's on the probe.
    A model on the meta device (built for ``from_pretrained``, its weights not loaded yet), or
    partitioned by DeepSpeed's ``zero.Init``, is not probed: its head is taken on structure alone
    (its forward reads nothing beyond :data:`fk.hf.recognize.HEAD_NAMES`)."""
    weight = getattr(getattr(module, getattr(plan, "head", "lm_head")), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return Refusal("flce", "the head has no weight")
    if _meta(weight) or is_zero3_partitioned(weight):
        return None
    vocab = weight.shape[0]
    ids = torch.randint(0, vocab, (1, HEAD_PROBE_TOKENS), generator=torch.Generator().manual_seed(0), device="cpu")
    ids = ids.to(weight.device)
    labels = ids.clone()
    labels[0, :2] = -100
    kwargs: dict[str, Any] = {"input_ids": ids, "labels": labels, "use_cache": False}
    devices = [weight.device] if weight.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            want = type(module).forward(module, **kwargs).loss
            torch.manual_seed(0)
            module.__dict__[PLAN] = plan
            got = forward(module, skip_logits=True, **kwargs).loss
    except Exception as e:
        return Refusal("flce", f"the probe failed ({type(e).__name__}: {str(e)[:120]})")
    finally:
        module.__dict__.pop(PLAN, None)
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return Refusal("flce", "the probe's forward returned no loss")
    error = _agree((got.float(),), (want.float(),), weight.dtype)
    return None if error is None else Refusal("flce", f"probe mismatch {error:.1e} in the loss")
