"""RLOO on the fused head: against the same loss on the full logits in float64 (values, metrics and
gradients of hidden, weight, bias), and against TRL 1.16's own ``RLOOTrainer._compute_loss``,
called with stand-ins for the trainer, its model and accelerate."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fk.align import fused_linear_logprobs_ref, fused_linear_rloo_loss
from fk.core import testing
from fk.core.testing import DTYPES, dtype_name

B, T, H, V = 5, 4, 16, 1003  # 20 tokens; five completions: chunks of whole completions split them unevenly
SMALL_CHUNKS = 2 * T * V * 4  # two completions (fp32) or four (half) per chunk: several chunks
TEMPERATURE = 0.8


def _batch(device: str, dtype: torch.dtype, seed: int, *, bias: bool = False, spread: float = 0.3) -> dict[str, Any]:
    """Hidden states, head and completions (one of 1 token, one with none), advantages of both
    signs, and old log-probabilities the true ones moved by up to ``spread`` per token: with the
    default some ratios fall outside [1 - eps, 1 + eps] on each side; with 0 every ratio is 1."""
    h, w, b = testing.random_head((B, T), V, H, dtype, device, seed=seed, bias=bias)
    g = torch.Generator().manual_seed(seed + 3)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 1:] = 0
    mask[3, :] = 0
    mask[0, 3] = 0
    adv = torch.tensor([1.3, -0.7, 0.4, 0.9, -1.1])
    with torch.no_grad():
        true = fused_linear_logprobs_ref(h.double(), w.double(), torch.where(mask.bool(), ids, -100).to(device),
                                         bias=b.double() if b is not None else None, temperature=TEMPERATURE).cpu()  # fmt: skip
    old = (true + spread * torch.randn(B, T, generator=g) * mask).sum(-1)
    return {"h": h, "w": w, "b": b, "ids": ids.to(device), "mask": mask.to(device), "adv": adv.to(device),
            "old": old.float().to(device)}  # fmt: skip


def _compare(batch: dict[str, Any], *, memory_budget: int = SMALL_CHUNKS, **kw: Any) -> None:
    ids, mask = batch["ids"], batch["mask"]

    def run(reference: bool) -> Any:
        def fn(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
            def cast(t: torch.Tensor) -> torch.Tensor:
                return t.to(h.device, torch.float64 if h.dtype == torch.float64 else torch.float32)

            out = fused_linear_rloo_loss(h, w, ids.to(h.device), mask.to(h.device), cast(batch["adv"]),
                                         cast(batch["old"]), bias=b, temperature=TEMPERATURE, reference=reference,
                                         memory_budget=memory_budget, **kw)  # fmt: skip
            return (out.loss, out.logps, out.ratios, *([out.entropies] if out.entropies is not None else []),
                    *out.metrics.values())  # fmt: skip

        return fn

    testing.compare_with_reference(run(False), run(True), [batch["h"], batch["w"], batch["b"]],
                                   arg_names=["hidden", "weight", "bias"], atols={torch.float32: 1e-6})  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("budget", [1 << 30, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
def test_matches_full_logits(device: str, dtype: torch.dtype, budget: int) -> None:
    """One chunk keeps the logits' gradient for the backward's weight gradient; several
    accumulate it in the forward."""
    _compare(_batch(device, dtype, seed=1, bias=True), memory_budget=budget, epsilon_high=0.28)


def test_clipped_both_sides_and_on_policy(device: str) -> None:
    """Ratios clipped low and high (the clip metrics nonzero, and their gradient 0), then every
    ratio 1 (the tie between the clipped and unclipped terms, each taking half the gradient)."""
    batch = _batch(device, torch.float32, seed=2)
    out = fused_linear_rloo_loss(batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"], batch["old"],
                                 epsilon_low=0.05, temperature=TEMPERATURE)  # fmt: skip
    assert out.low_clipped.any() and out.high_clipped.any()
    _compare(batch, epsilon_low=0.05)
    _compare(_batch(device, torch.float32, seed=3, spread=0.0), return_entropy=False)


def test_one_pass(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Completions that fit the budget take the single pass: no recomputing backward runs."""
    import fk.align.preference as module

    monkeypatch.setattr(module, "fused_linear_logprobs", None)
    monkeypatch.setattr(module, "fused_linear_logprobs_ref", None)
    batch = _batch(device, torch.float32, seed=4)
    out = fused_linear_rloo_loss(batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"], batch["old"])
    out.loss.backward()
    assert batch["h"].grad is not None and batch["w"].grad is not None and out.entropies is not None


def test_completion_longer_than_the_budget_takes_two_passes(device: str) -> None:
    _compare(_batch(device, torch.float32, seed=5), memory_budget=V * 4)


def test_compile_matches_eager(device: str) -> None:
    batch = _batch(device, torch.float32, seed=6, bias=True)

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fused_linear_rloo_loss(h, w, batch["ids"], batch["mask"], batch["adv"], batch["old"], bias=b,
                                      temperature=TEMPERATURE, memory_budget=SMALL_CHUNKS).loss  # fmt: skip

    testing.assert_compile_matches_eager(loss, [batch["h"], batch["w"], batch["b"]])


def test_frozen_head_gets_no_gradient(device: str) -> None:
    batch = _batch(device, torch.float32, seed=7)
    batch["w"].requires_grad_(False)
    _compare(batch)
    out = fused_linear_rloo_loss(batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"], batch["old"])
    out.loss.backward()
    assert batch["w"].grad is None and batch["h"].grad is not None


# --- Against TRL's code ---------------------------------------------------------------------------

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (fk-align[testing])")


def _trl_loss(batch: dict[str, Any], h: torch.Tensor, w: torch.Tensor, eps: float, eps_high: float) -> Any:
    from trl import RLOOTrainer

    ids, mask = batch["ids"], batch["mask"]
    target = torch.where(mask.bool(), ids, -100)

    def per_token_logps_and_entropies(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int,
                                      **_: Any) -> Any:  # fmt: skip
        out = fused_linear_logprobs_ref(h, w, target, temperature=TEMPERATURE, return_entropy=True)
        return out.logps, out.entropy, None

    same = lambda t: t  # noqa: E731
    accelerator = SimpleNamespace(gather=same, gather_for_metrics=same, reduce=lambda t, reduction: t)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies, epsilon_low=eps, epsilon_high=eps_high,
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )  # fmt: skip
    inputs = {"prompt_ids": ids[:, :0], "prompt_mask": mask[:, :0], "completion_ids": ids, "completion_mask": mask,
              "advantages": batch["adv"].double(), "old_logps": batch["old"].double()}  # fmt: skip
    return RLOOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


@needs_trl
@pytest.mark.parametrize("spread", [0.0, 0.3], ids=["on_policy", "off_policy"])
def test_equals_trl_rloo_trainer(spread: float) -> None:
    batch = _batch("cpu", torch.float64, seed=8, spread=spread)
    h, w = batch["h"], batch["w"]
    want, trl_metrics = _trl_loss(batch, h, w, 0.1, 0.28)
    got = fused_linear_rloo_loss(h, w, batch["ids"], batch["mask"], batch["adv"].double(), batch["old"].double(),
                                 epsilon_low=0.1, epsilon_high=0.28, temperature=TEMPERATURE, reference=True)  # fmt: skip
    torch.testing.assert_close(got.loss, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got.loss, (h, w)), torch.autograd.grad(want, (h, w)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert sorted(trl_metrics) == sorted(got.metrics)
    for key in trl_metrics:
        assert float(got.metrics[key]) == pytest.approx(trl_metrics[key][-1], rel=1e-9, abs=1e-12), key
    if spread:
        assert float(got.metrics["clip_ratio/region_mean"]) > 0


# --- Bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"epsilon_high": float("nan")}, "epsilon_high"),
        ({"temperature": 0.0}, "temperature"),
        ({"advantages": "wrong"}, "advantages"),
        ({"old_logps": "wrong"}, "old_logps"),
        ({"completion_mask": "wrong"}, "completion_mask"),
        ({"completion_ids": "out_of_range"}, "target"),
    ],
)
def test_bad_input_raises_naming_the_argument(change: dict[str, Any], message: str) -> None:
    batch = _batch("cpu", torch.float32, seed=9)
    args = [batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"], batch["old"]]
    kw: dict[str, Any] = {}
    for key, value in change.items():
        if key == "advantages":
            args[4] = torch.zeros(B + 1)
        elif key == "old_logps":
            args[5] = torch.zeros(B, T)
        elif key == "completion_mask":
            args[3] = batch["mask"][:, :2]
        elif key == "completion_ids":
            args[2] = batch["ids"].clone().fill_(V)
        else:
            kw[key] = value
    with pytest.raises(ValueError, match=message):
        fused_linear_rloo_loss(*args, **kw)


@pytest.mark.gpu
def test_no_host_synchronization() -> None:
    batch = _batch("cuda", torch.bfloat16, seed=10, bias=True)
    args = (batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"], batch["old"])
    fused_linear_rloo_loss(*args, bias=batch["b"]).loss.backward()  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for budget in (1 << 30, SMALL_CHUNKS):
            fused_linear_rloo_loss(*args, bias=batch["b"], memory_budget=budget).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
