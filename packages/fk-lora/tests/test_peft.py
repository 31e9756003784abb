"""fk.lora against PEFT's own forward on the same modules of a tiny Llama: outputs and gradients,
with PEFT's dropout masks, and :func:`fk.lora.patch` / :func:`fk.lora.unpatch` on whole models.

Each comparison follows fk.core.testing's rule: fk's error against a float64 evaluation of the
same PEFT modules may be at most twice PEFT's own error at the test dtype, plus a floor. The
float64 run replays the dropout masks that PEFT drew, so fk matches only if it drew the same.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import fk.lora
from fk.core import testing
from fk.core.testing import dtype_name

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HIDDEN = 48


def _model(
    device: str,
    dtype: torch.dtype = torch.float32,
    *,
    lora_fp32: bool = False,
    dropout: float = 0.0,
    rslora: bool = False,
    lora_bias: bool = False,
    base_bias: bool = False,
    train_bias: bool = False,
    dora: bool = False,
    act: str = "silu",
    layers: int = 1,
) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, vocab_size=64, max_position_embeddings=64,
        attention_bias=base_bias, mlp_bias=base_bias, hidden_act=act,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(dtype)
    lora_config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, use_rslora=rslora,
        lora_bias=lora_bias, use_dora=dora, init_lora_weights=False,
        bias="lora_only" if train_bias else "none",
    )  # fmt: skip
    model = peft.get_peft_model(base, lora_config, autocast_adapter_dtype=lora_fp32)
    return model.to(device).train()


def _layer(model: Any) -> Any:
    return model.base_model.model.model.layers[0]


def _dropouts(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Dropout}


def _run(
    model: nn.Module, fn: Callable[[nn.Module, torch.Tensor], Sequence[torch.Tensor]], x: torch.Tensor, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    x = x.detach().clone().requires_grad_()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    outs = list(fn(model, x))
    dys = [testing.random_tensor(o.shape, torch.float32, "cpu", seed=9 + i).to(o.device, o.dtype) for i, o in enumerate(outs)]  # fmt: skip
    grads = torch.autograd.grad(outs, [x, *params], dys, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def _compare(
    model: nn.Module,
    fn: Callable[[nn.Module, torch.Tensor], Sequence[torch.Tensor]],
    x: torch.Tensor,
    *,
    seed: int = 5,
    floors: dict[torch.dtype, float] | None = None,
    autocast: torch.dtype | None = None,
) -> None:
    """fk (patched) and PEFT on ``model``, against float64 PEFT replaying PEFT's dropout masks.

    ``autocast``: fk and PEFT run under ``torch.autocast`` with this dtype (the float64 reference
    without it).
    """
    reference_fn = fn
    if autocast is not None:
        fn = _under_autocast(fn, autocast)
    reference = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
    masks: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, name=n: masks.__setitem__(name, (out != 0).cpu()))
        for n, m in _dropouts(model).items()
    ]
    peft_out, peft_grads = _run(model, fn, x, seed)
    for h in hooks:
        h.remove()
    for n, m in _dropouts(reference).items():
        if n in masks:
            m.register_forward_hook(lambda mod, inp, out, name=n: inp[0] * masks[name] / (1 - mod.p))

    report = fk.lora.patch(model)
    assert report.n_patched
    try:
        fk_out, fk_grads = _run(model, fn, x, seed)
        fallbacks = {n: m.__dict__["_fk_lora_logged"] for n, m in model.named_modules() if m.__dict__.get("_fk_lora_logged")}  # fmt: skip
        assert not fallbacks, f"fk.lora ran PEFT's forward: {fallbacks}"
    finally:
        fk.lora.unpatch(model)
    ref_out, ref_grads = _run(reference, reference_fn, x.to("cpu", torch.float64), seed)

    names = [f"output{i}" for i in range(len(fk_out))] + ["grad of x"]
    names += [f"grad of {n}" for n, p in model.named_parameters() if p.requires_grad]
    floors = floors or {}
    for name, a, r, b in zip(names, fk_out + fk_grads, ref_out + ref_grads, peft_out + peft_grads, strict=True):
        assert (a is None) == (b is None), f"{name}: fk gives {a is not None}, PEFT gives {b is not None}"
        if a is None:
            continue
        assert r is not None and a.dtype == b.dtype, f"{name}: dtype {a.dtype}, PEFT's {b.dtype}"
        testing.assert_close(a, r, b, name=name, floor=floors.get(a.dtype))


def _under_autocast(
    fn: Callable[[nn.Module, torch.Tensor], Sequence[torch.Tensor]], dtype: torch.dtype
) -> Callable[[nn.Module, torch.Tensor], Sequence[torch.Tensor]]:
    def run(model: nn.Module, x: torch.Tensor) -> Sequence[torch.Tensor]:
        with torch.autocast(x.device.type, dtype=dtype):
            return fn(model, x)

    return run


def _qkv(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    attn = _layer(model).self_attn
    return [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]


def _o(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [_layer(model).self_attn.o_proj(x)]


def _mlp(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [_layer(model).mlp(x)]


DTYPE_CASES = {
    "float32": (torch.float32, False),
    "bfloat16": (torch.bfloat16, False),
    "bfloat16_lora_fp32": (torch.bfloat16, True),  # PEFT's default: adapter weights kept in fp32
}


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("block", ["qkv", "o", "mlp"])
def test_layers_match_peft(device: str, block: str, case: str, dropout: float) -> None:
    dtype, lora_fp32 = DTYPE_CASES[case]
    model = _model(device, dtype, lora_fp32=lora_fp32, dropout=dropout)
    x = testing.random_tensor((2, 5, HIDDEN), dtype, device, seed=1)
    # fp32 LoRA weights with bf16 activations: fk's LoRA backward runs in bf16 and rounds the
    # rank-sized gradients to bf16 before casting them to fp32 (PEFT's run in fp32).
    floors = {torch.float32: testing.FLOOR[torch.bfloat16]} if lora_fp32 else None
    _compare(model, {"qkv": _qkv, "o": _o, "mlp": _mlp}[block], x, floors=floors)


VARIANTS: dict[str, dict[str, Any]] = {
    "rslora_lora_bias_trainable_base_bias": {"rslora": True, "lora_bias": True, "base_bias": True, "train_bias": True},
    "frozen_base_bias": {"base_bias": True},
    "geglu": {"act": "gelu_pytorch_tanh"},
    "gelu_erf": {"act": "gelu"},
}


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_peft(device: str, variant: str, case: str) -> None:
    dtype, lora_fp32 = DTYPE_CASES[case]
    model = _model(device, dtype, lora_fp32=lora_fp32, dropout=0.25, **VARIANTS[variant])
    x = testing.random_tensor((2, 5, HIDDEN), dtype, device, seed=2)
    floors = {torch.float32: testing.FLOOR[torch.bfloat16]} if lora_fp32 else None  # as in test_layers_match_peft
    _compare(model, lambda m, x: [*_qkv(m, x), *_mlp(m, x), *_o(m, x)], x, floors=floors)


AUTOCAST_CASES = {
    "fp32_model": (torch.float32, False, torch.float32),  # HF Trainer bf16=True: fp32 weights
    "fp32_model_bf16_input": (torch.float32, False, torch.bfloat16),  # o_proj, down_proj's inputs
    "bf16_model_lora_fp32": (torch.bfloat16, True, torch.bfloat16),
}


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("case", list(AUTOCAST_CASES))
@pytest.mark.parametrize("block", ["qkv", "o", "mlp"])
def test_layers_match_peft_under_bf16_autocast(device: str, block: str, case: str, dropout: float) -> None:
    """Under ``torch.autocast(dtype=bf16)`` fk casts as autocast does: every matmul in bf16, the
    output in bf16, the dropout drawn on the input cast to the LoRA weights' dtype, as PEFT's."""
    dtype, lora_fp32, x_dtype = AUTOCAST_CASES[case]
    model = _model(device, dtype, lora_fp32=lora_fp32, dropout=dropout)
    x = testing.random_tensor((2, 5, HIDDEN), x_dtype, device, seed=1)
    # fp32 gradients computed by bf16 matmuls (fk sums dx's terms in bf16, PEFT in x's dtype)
    floors = {torch.float32: testing.FLOOR[torch.bfloat16]}
    _compare(model, {"qkv": _qkv, "o": _o, "mlp": _mlp}[block], x, floors=floors, autocast=torch.bfloat16)


DORA_AUTOCAST_MODELS = {
    "bf16_model_lora_fp32": (torch.bfloat16, True),  # a model loaded in bf16, PEFT's default fp32 adapters
    "bf16_model_lora_bf16": (torch.bfloat16, False),
    "fp32_model": (torch.float32, True),  # HF Trainer bf16=True on fp32 weights: PEFT's norm from them
}


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("case", list(DORA_AUTOCAST_MODELS))
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("block", ["qkv", "o", "mlp"])
def test_dora_matches_peft_under_bf16_autocast(
    device: str, block: str, x_dtype: torch.dtype, case: str, dropout: float
) -> None:
    """DoRA under ``torch.autocast(dtype=bf16)`` (HF Trainer's ``bf16=True``) on a bf16 or fp32 model,
    its input in bf16 or fp32: fused, every matmul in bf16, the row norm from ``B A`` in the LoRA
    weights' dtype and the weight (cast to bf16: on an fp32 model 1.8e-4 from PEFT's at most,
    ``benchmarks/experiments/INDEX.md#dora_norm_rounding``), the dropout drawn on the input cast
    to the LoRA weights' dtype, as PEFT's; outputs and every gradient (the magnitude's included)
    against float64 PEFT with PEFT's masks."""
    dtype, lora_fp32 = DORA_AUTOCAST_MODELS[case]
    model = _model(device, dtype, lora_fp32=lora_fp32, dropout=dropout, dora=True)
    x = testing.random_tensor((2, 5, HIDDEN), x_dtype, device, seed=1)
    floors = {torch.float32: testing.FLOOR[torch.bfloat16]}
    _compare(model, {"qkv": _qkv, "o": _o, "mlp": _mlp}[block], x, floors=floors, autocast=torch.bfloat16)


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16], ids=dtype_name)
def test_variants_match_peft_under_autocast(device: str, autocast: torch.dtype) -> None:
    model = _model(device, dropout=0.25, **VARIANTS["rslora_lora_bias_trainable_base_bias"])
    x = testing.random_tensor((2, 5, HIDDEN), torch.float32, device, seed=2)
    floors = {torch.float32: testing.FLOOR[autocast]}
    fn = lambda m, x: [*_qkv(m, x), *_mlp(m, x), *_o(m, x)]  # noqa: E731
    _compare(model, fn, x, floors=floors, autocast=autocast)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_autocast_takes_the_fused_path_on_a_model(
    device: str, checkpointing: bool, dora: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole fp32 model under bf16 autocast (what HF Trainer's ``bf16=True`` does), plain LoRA or
    DoRA: no fallback, and loss and gradients as PEFT's under the same autocast, to bf16's precision."""
    model = _model(device, dropout=0.1, layers=2, dora=dora)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    with autocast:
        want_loss, want_grads = _loss(model, ids, seed=3)
    report = fk.lora.patch(model)
    assert report.n_patched == 2 * 3 and not report.skipped
    try:
        with caplog.at_level(logging.INFO, logger="fk.lora"), autocast:
            got_loss, got_grads = _loss(model, ids, seed=3)
    finally:
        fk.lora.unpatch(model)
    # every patched forward either fuses or logs why it ran PEFT's
    assert not [r.getMessage() for r in caplog.records if "runs PEFT's forward" in r.getMessage()]
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-2, atol=2e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype == torch.float32
        scale = float(w.abs().max())
        torch.testing.assert_close(g, w, rtol=0.0, atol=0.05 * scale)


@pytest.mark.parametrize("case", ["bf16_model_lora_fp32", "fp32_model"])
def test_recipes_draw_every_dropout_in_one_pass(device: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF Trainer's ``bf16=True`` with PEFT's fp32 adapters: a bf16 model (PEFT drops each bf16 input
    cast to fp32) or fp32 hidden states (an fp32 model; ``prepare_model_for_kbit_training``'s): every
    projection's dropout drawn by fk.lora.dropped_lora_inputs' one pass, none by
    ``torch.native_dropout``. (On the CPU torch's masks cannot be replicated: the draws are stubbed.)"""
    from fk.lora import projection, torch_dropout
    from fk.lora.torch_dropout import Draw

    if device == "cpu":
        stub = lambda x, ps, drawn_as=None: [Draw(7, 4 * i, 96, 4, 1 - p) for i, p in enumerate(ps)]  # noqa: E731
        monkeypatch.setattr(projection, "reserve", stub)
    else:  # the one-time check that torch's fp32 masks are replicated, which draws with torch, done first
        assert torch_dropout.replicates(torch.device("cuda", torch.cuda.current_device()), torch.float32)
    dtype = {"bf16_model_lora_fp32": torch.bfloat16, "fp32_model": torch.float32}[case]
    model = _model(device, dtype, lora_fp32=True, dropout=0.1, layers=2)
    one_pass, native = [], []
    real_one_pass, real_native = projection.dropped_lora_inputs, torch.native_dropout
    monkeypatch.setattr(
        projection, "dropped_lora_inputs", lambda x, *a: one_pass.append(x.dtype) or real_one_pass(x, *a)
    )
    monkeypatch.setattr(torch, "native_dropout", lambda x, *a: native.append(x.shape) or real_native(x, *a))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    fk.lora.patch(model)
    try:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            _loss(model, ids, seed=3)
    finally:
        fk.lora.unpatch(model)
    assert not native, f"torch.native_dropout drew on {native}"
    assert len(one_pass) == 2 * 4  # a layer: q, k and v together; o; gate and up together; down


def _loss(model: nn.Module, ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_patch_round_trip_on_a_model(device: str, checkpointing: bool) -> None:
    model = _model(device, dropout=0.1, layers=2)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    want_loss, want_grads = _loss(model, ids, seed=3)

    report = fk.lora.patch(model)
    assert fk.lora.is_patched(model)
    assert len(report.mlp) == 2 and len(report.qkv) == 2 and not report.skipped
    assert all(len(g) == 3 for g in report.qkv)
    assert sorted(n.rsplit(".", 1)[-1] for n in report.linear) == ["o_proj", "o_proj"]
    got_loss, got_grads = _loss(model, ids, seed=3)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    frozen = [p for n, p in model.named_parameters() if "base_layer.weight" in n]
    assert frozen and all(p.grad is None and not p.requires_grad for p in frozen)

    assert fk.lora.unpatch(model) == 2 + 2 * 3 + 2
    assert not fk.lora.is_patched(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    again_loss, again_grads = _loss(model, ids, seed=3)
    assert torch.equal(again_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(again_grads, want_grads, strict=True))


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("block", ["qkv", "o", "mlp"])
def test_dora_layers_match_peft(device: str, block: str, case: str, dropout: float) -> None:
    """PEFT's DoRA (``use_dora=True``): outputs and the gradients of x, the base bias, lora_A,
    lora_B and the magnitude, with PEFT's dropout masks (PEFT's DoRA recomputes the base product
    on the dropped input)."""
    dtype, lora_fp32 = DTYPE_CASES[case]
    model = _model(device, dtype, lora_fp32=lora_fp32, dropout=dropout, dora=True, base_bias=True, train_bias=True)
    x = testing.random_tensor((2, 5, HIDDEN), dtype, device, seed=1)
    floors = {torch.float32: testing.FLOOR[torch.bfloat16]} if lora_fp32 else None  # as in test_layers_match_peft
    _compare(model, {"qkv": _qkv, "o": _o, "mlp": _mlp}[block], x, floors=floors)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("block", ["qkv", "o", "mlp"])
def test_layers_match_peft_with_dy_products_at_any_size(
    device: str, block: str, dropout: float, dora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU fk.lora.dy_products (``s G`` and ``dB`` from one read of ``dy``) is taken only for
    ``dy`` of 4096 x 4096 and more; here at any size, so that the device runs it inside LoRA's and
    DoRA's backward, against PEFT (the interpreter takes it at every size anyway)."""
    from fk.lora import dy_products as module

    monkeypatch.setattr(module, "MIN_ROWS", 1)
    monkeypatch.setattr(module, "MIN_COLS", 1)
    launches: list[int] = []
    launch = module._launch
    monkeypatch.setattr(module, "_launch", lambda *args: launches.append(1) or launch(*args))
    model = _model(device, torch.bfloat16, dropout=dropout, dora=dora)
    x = testing.random_tensor((2, 5, HIDDEN), torch.bfloat16, device, seed=1)
    _compare(model, {"qkv": _qkv, "o": _o, "mlp": _mlp}[block], x)
    assert launches, "the kernel did not run"


def test_dora_model_is_patched_as_lora_is(device: str) -> None:
    """A DoRA model: q/k/v fused as a group, o_proj alone, the MLP as a whole; nothing is left to PEFT."""
    model = _model(device, dora=True)
    report = fk.lora.patch(model)
    try:
        assert not report.skipped and len(report.mlp) == len(report.qkv) == 1
        assert [n.rsplit(".", 1)[-1] for n in report.linear] == ["o_proj"]
    finally:
        fk.lora.unpatch(model)


def test_dora_model_with_gradient_checkpointing_matches_peft(device: str) -> None:
    """A two-layer DoRA model with dropout under gradient checkpointing (the recomputed forward
    draws the same masks): loss and every trainable gradient, the magnitudes' included, as PEFT's."""
    model = _model(device, dropout=0.1, layers=2, dora=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    want_loss, want_grads = _loss(model, ids, seed=3)
    report = fk.lora.patch(model)
    try:
        assert len(report.mlp) == len(report.qkv) == 2 and not report.skipped
        got_loss, got_grads = _loss(model, ids, seed=3)
        assert not [n for n, m in model.named_modules() if m.__dict__.get("_fk_lora_logged")], "PEFT's forward ran"
    finally:
        fk.lora.unpatch(model)
    assert sum("lora_magnitude_vector" in n for n, p in model.named_parameters() if p.requires_grad) == 2 * 7
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_dora_on_gate_but_not_up_fuses_the_projections_one_by_one(device: str) -> None:
    model = _model(device, dora=True)
    mlp = _layer(model).mlp
    plain = _model(device)
    mlp.up_proj = _layer(plain).mlp.up_proj
    report = fk.lora.patch(model)
    try:
        assert not report.mlp and not report.skipped
        assert {n.rsplit(".", 1)[-1] for n in report.linear} == {"o_proj", "gate_proj", "up_proj", "down_proj"}
    finally:
        fk.lora.unpatch(model)


class _QuantizedLinear(nn.Linear):
    """Stands for a bitsandbytes ``Linear4bit`` base layer (bitsandbytes is not a test dependency)."""


def test_quantized_layers_are_left_to_peft(device: str, caplog: pytest.LogCaptureFixture) -> None:
    """A quantized base layer, and PEFT's own LoRA class for one (``lora.bnb.Linear4bit``, a
    subclass of ``lora.Linear``): fk.lora leaves both to PEFT, says so, and changes nothing."""
    model = _model(device)
    attn, mlp = _layer(model).self_attn, _layer(model).mlp
    attn.o_proj.base_layer.__class__ = _QuantizedLinear
    mlp.down_proj.__class__ = type("Linear4bit", (type(mlp.down_proj),), {})
    x = testing.random_tensor((2, 3, HIDDEN), torch.float32, device, seed=5)
    want = [_o(model, x)[0], _mlp(model, x)[0]]
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        report = fk.lora.patch(model)
    try:
        got = [_o(model, x)[0], _mlp(model, x)[0]]
    finally:
        fk.lora.unpatch(model)
    skipped = {name.rsplit(".", 1)[-1]: reason for name, reason in report.skipped.items()}
    assert "_QuantizedLinear is not torch.nn.Linear" in skipped["o_proj"]
    assert "Linear4bit is not PEFT's plain lora.Linear" in skipped["down_proj"]
    assert not report.mlp  # the MLP is not fused without its down projection
    assert "left to PEFT's forward" in caplog.text
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_patch_works_without_bitsandbytes(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes is optional: without it (PEFT's ``lora.bnb`` module then fails to import),
    fk.lora still patches, and leaves a LoRA layer of a class it does not know to PEFT (the case
    that asks whether a layer is PEFT's 4-bit one)."""
    model = _model(device)
    mlp = _layer(model).mlp
    mlp.up_proj.__class__ = type("OtherLoraLinear", (type(mlp.up_proj),), {})
    x = testing.random_tensor((2, 3, HIDDEN), torch.float32, device, seed=6)
    want = [_o(model, x)[0], _mlp(model, x)[0]]
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    monkeypatch.delitem(sys.modules, "peft.tuners.lora.bnb", raising=False)
    report = fk.lora.patch(model)
    try:
        got = [_o(model, x)[0], _mlp(model, x)[0]]
    finally:
        fk.lora.unpatch(model)
    assert report.qkv and not report.mlp
    assert any(name.endswith("up_proj") for name in report.skipped)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no_dropout", "dropout"])
def test_compile_fullgraph_of_a_patched_peft_model(device: str, dropout: float) -> None:
    """``torch.compile(fullgraph=True)`` of a whole patched PEFT model (aot_eager: the traced
    graph, run eagerly), with and without LoRA dropout: the loss and the LoRA gradients of eager."""
    model = _model(device, dropout=dropout)
    fk.lora.patch(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(fn: Callable[..., Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(3)
        loss = fn(input_ids=ids, labels=ids).loss
        return loss.detach(), list(torch.autograd.grad(loss, params))

    try:
        torch._dynamo.reset()
        got = run(torch.compile(model, fullgraph=True, backend="aot_eager"))
        want = run(model)
    finally:
        torch._dynamo.reset()
        fk.lora.unpatch(model)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_merged_or_disabled_adapters_run_peft_forward(device: str, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(device)
    x = testing.random_tensor((2, 3, HIDDEN), torch.float32, device, seed=6)
    unmerged = _mlp(model, x)[0].detach()
    with torch.no_grad():
        with model.disable_adapter():
            disabled = _mlp(model, x)[0]
        model.merge_adapter()  # (a disabled adapter's forward unmerges it: merge after)
        merged = _mlp(model, x)[0]
    fk.lora.patch(model)
    with caplog.at_level(logging.INFO, logger="fk.lora"), torch.no_grad():
        assert torch.equal(_mlp(model, x)[0], merged)
        _mlp(model, x)  # logged once per module and reason
        model.unmerge_adapter()
        with model.disable_adapter():
            # (merging and unmerging moved the base weights by rounding errors)
            torch.testing.assert_close(_mlp(model, x)[0], disabled, rtol=1e-5, atol=1e-6)
    messages = [r.getMessage() for r in caplog.records if r.name == "fk.lora"]
    assert sum("merged" in m for m in messages) == 1
    assert any("disabled" in m for m in messages)
    torch.testing.assert_close(_mlp(model, x)[0], unmerged, rtol=1e-5, atol=1e-5)  # fused again
    fk.lora.unpatch(model)


def test_two_active_adapters_fall_back(device: str, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(device)
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=TARGETS, init_lora_weights=False))
    model.base_model.set_adapter(["default", "other"])
    x = testing.random_tensor((2, 3, HIDDEN), torch.float32, device, seed=7)
    want = _o(model, x)[0]
    fk.lora.patch(model)
    with caplog.at_level(logging.INFO, logger="fk.lora"):
        got = _o(model, x)[0]
    assert torch.equal(got, want)
    assert any("2 active adapters" in r.getMessage() for r in caplog.records)
    fk.lora.unpatch(model)


@pytest.mark.parametrize("dtype", [torch.float32], ids=dtype_name)
def test_patch_twice_is_one_patch(device: str, dtype: torch.dtype) -> None:
    model = _model(device, dtype)
    first = fk.lora.patch(model)
    second = fk.lora.patch(model)
    assert first == second
    assert fk.lora.unpatch(model) == first.n_patched - len(first.qkv) + sum(len(g) for g in first.qkv)
    assert all("forward" not in m.__dict__ for m in model.modules())


def _assert_o_falls_back(
    model: nn.Module, x: torch.Tensor, caplog: pytest.LogCaptureFixture, reason: str, autocast: bool
) -> None:
    """The patched o_proj on ``x`` (under bf16 autocast when ``autocast``) gives PEFT's output
    exactly, and fk.lora logs ``reason`` for taking PEFT's forward."""
    context = (
        torch.autocast(torch.device(x.device).type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    )
    with context, torch.no_grad():
        want = _o(model, x)[0]
    fk.lora.patch(model)
    with caplog.at_level(logging.INFO, logger="fk.lora"), context, torch.no_grad():
        got = _o(model, x)[0]
    fk.lora.unpatch(model)
    assert torch.equal(got, want)
    assert any(reason in r.getMessage() for r in caplog.records)


def test_float64_lora_weights_under_autocast_fall_back(device: str, caplog: pytest.LogCaptureFixture) -> None:
    """Autocast leaves float64 operands alone, so PEFT's LoRA branch then runs in float64: fk.lora
    cannot cast as autocast does and runs PEFT's forward, with a log line."""
    model = _model(device)
    o_proj = _layer(model).self_attn.o_proj
    o_proj.lora_A["default"].double()
    o_proj.lora_B["default"].double()
    x = testing.random_tensor((2, 3, HIDDEN), torch.float32, device, seed=8)
    _assert_o_falls_back(model, x, caplog, "lora_A dtype torch.float64 under autocast", autocast=True)


def test_float64_lora_weights_fall_back(device: str, caplog: pytest.LogCaptureFixture) -> None:
    """Outside autocast too, float64 LoRA weights (PEFT casts the input to them) take PEFT's forward
    with a log line, not an error from fk.lora's argument checks."""
    model = _model(device)
    o_proj = _layer(model).self_attn.o_proj
    o_proj.lora_A["default"].double()
    o_proj.lora_B["default"].double()
    x = testing.random_tensor((2, 3, HIDDEN), torch.float32, device, seed=8)
    _assert_o_falls_back(model, x, caplog, "lora_A dtype torch.float64 (fk.lora takes", autocast=False)


def test_disabled_input_dtype_casting_falls_back_under_autocast(device: str, caplog: pytest.LogCaptureFixture) -> None:
    """PEFT's ``disable_input_dtype_casting`` (a bf16 input kept as it is before fp32 LoRA weights)
    takes PEFT's forward, with a log line, under autocast as without it."""
    model = _model(device)
    _layer(model).self_attn.o_proj.cast_input_dtype_enabled = False
    x = testing.random_tensor((2, 3, HIDDEN), torch.bfloat16, device, seed=8)
    _assert_o_falls_back(model, x, caplog, "input dtype casting is disabled", autocast=True)


@pytest.mark.parametrize("block", ["o", "qkv", "mlp"])
def test_patched_module_names_a_wrong_input_width(device: str, block: str) -> None:
    """A patched module called on an input of the wrong width raises a ValueError that says what
    the weight takes, before any launch (the checks of parameters read from PEFT are lighter)."""
    model = _model(device)
    fk.lora.patch(model)
    layer = _layer(model)
    x = testing.random_tensor((2, 3, HIDDEN + 1), torch.float32, device, seed=8)
    call = {
        "o": lambda: layer.self_attn.o_proj(x),
        "qkv": lambda: layer.self_attn.q_proj(x),
        "mlp": lambda: layer.mlp(x),
    }
    with pytest.raises(ValueError, match=f"takes {HIDDEN} input features, got x of shape"):
        call[block]()
    fk.lora.unpatch(model)


def test_mixed_batch_adapter_names_match_peft(device: str) -> None:
    """PEFT's mixed-batch inference hands ``adapter_names`` to each LoRA layer through forward
    pre-hooks: the fused MLP (and QKV group) must not skip them."""
    model = _model(device).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        want = model(input_ids=ids, adapter_names=["default", "__base__"]).logits
        fk.lora.patch(model)
        try:
            got = model(input_ids=ids, adapter_names=["default", "__base__"]).logits
            plain = model(input_ids=ids).logits  # the hooks are gone again: the fused path
        finally:
            fk.lora.unpatch(model)
        with model.disable_adapter():
            base_only = model(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got[1], base_only[1], rtol=1e-5, atol=1e-5)  # "__base__": no adapter
    assert not torch.allclose(plain[1], base_only[1], rtol=1e-3, atol=1e-3)


def test_hooks_on_an_mlp_projection_run(device: str, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(device)
    mlp = _layer(model).mlp
    calls: list[str] = []
    handle = mlp.down_proj.register_forward_hook(lambda mod, inp, out: calls.append("down_proj"))
    x = testing.random_tensor((3, 5, HIDDEN), torch.float32, device, seed=1)
    want = mlp(x)
    fk.lora.patch(model)
    try:
        with caplog.at_level(logging.INFO, logger="fk.lora"):
            got = mlp(x)
        handle.remove()
        fused = mlp(x)
    finally:
        fk.lora.unpatch(model)
    assert calls == ["down_proj", "down_proj"]  # PEFT's call and fk's
    assert "hooks are registered on down_proj" in caplog.text
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)


class _ClampedMLP(nn.Module):
    """Llama's MLP children with a clamp between the projections (as Step3p7's and DeepSeek-V4's)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = (
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
            mlp.act_fn,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=0.01) * self.up_proj(x))


def test_mlp_that_computes_more_is_not_fused(device: str) -> None:
    """Same children, another computation: not fused as a whole (its projections are, one by one),
    and the result is the module's own."""
    model = _model(device)
    layer = _layer(model)
    layer.mlp = _ClampedMLP(layer.mlp)
    x = testing.random_tensor((3, 5, HIDDEN), torch.float32, device, seed=2)
    want = layer.mlp(x)
    report = fk.lora.patch(model)
    try:
        got = layer.mlp(x)
    finally:
        fk.lora.unpatch(model)
    assert not report.mlp
    assert {n.rsplit(".", 1)[-1] for n in report.linear} >= {"gate_proj", "up_proj", "down_proj"}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
