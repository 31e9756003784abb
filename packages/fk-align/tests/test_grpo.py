"""GRPO on the fused head: against the same loss on the full logits in float64 (values, metrics and
gradients of hidden, weight, bias), and against TRL 1.16's own ``GRPOTrainer._compute_loss``,
called with stand-ins for the trainer, its model and accelerate."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fk.align import GRPO_LOSS_TYPES, fused_linear_grpo_loss, fused_linear_logprobs_ref
from fk.core import testing
from fk.core.testing import DTYPES, dtype_name

B, T, H, V = 3, 5, 16, 1003  # 15 tokens: an odd count
SMALL_CHUNKS = 4 * V * 4  # 4 tokens (fp32) or 8 (half) per chunk: several chunks


def _batch(device: str, dtype: torch.dtype, seed: int, *, bias: bool = False) -> dict[str, Any]:
    """Hidden states, head and completions: one sequence of 2 tokens, one with no token at all."""
    h, w, b = testing.random_head((B, T), V, H, dtype, device, seed=seed, bias=bias)
    g = torch.Generator().manual_seed(seed + 3)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 2:] = 0
    mask[2, :] = 0
    mask[0, 4] = 0
    adv = torch.randn(B, generator=g)
    # Off-policy log-probs: the true ones (fp64, full logits) moved by up to ~0.4, so that some
    # ratios fall outside [1 - eps, 1 + eps] on each side.
    with torch.no_grad():
        true = fused_linear_logprobs_ref(h.double(), w.double(), torch.where(mask.bool(), ids, -100).to(device),
                                         bias=b.double() if b is not None else None).cpu()  # fmt: skip
    old = (true + 0.4 * torch.randn(B, T, generator=g)) * mask
    ref = (true + 0.3 * torch.randn(B, T, generator=g)) * mask
    return {"h": h, "w": w, "b": b, "ids": ids.to(device), "mask": mask.to(device), "adv": adv.to(device),
            "old": old.float().to(device), "ref": ref.float().to(device)}  # fmt: skip


def _compare(batch: dict[str, Any], *, off_policy: bool, memory_budget: int = SMALL_CHUNKS, **kw: Any) -> None:
    ids, mask, adv = batch["ids"], batch["mask"], batch["adv"]
    old = batch["old"] if off_policy else None
    ref = batch["ref"] if kw.get("beta", 0.0) else None

    def run(reference: bool) -> Any:
        def fn(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
            def cast(t: torch.Tensor) -> torch.Tensor:
                return t.to(h.device, torch.float64 if h.dtype == torch.float64 else torch.float32)

            out = fused_linear_grpo_loss(h, w, ids.to(h.device), mask.to(h.device), cast(adv), bias=b,
                                         old_per_token_logps=cast(old) if old is not None else None,
                                         ref_per_token_logps=cast(ref) if ref is not None else None,
                                         reference=reference, memory_budget=memory_budget, **kw)  # fmt: skip
            return (out.loss, out.per_token_logps, *([out.entropies] if out.entropies is not None else []),
                    *out.metrics.values())  # fmt: skip

        return fn

    # The loss sums terms of both signs (advantages), each ~|logp| |A| w: it can be far smaller than
    # its terms (cancellation), so fp32 gets an absolute term of a few units of the terms' size.
    testing.compare_with_reference(run(False), run(True), [batch["h"], batch["w"], batch["b"]],
                                   arg_names=["hidden", "weight", "bias"], atols={torch.float32: 1e-6})  # fmt: skip


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_off_policy_with_kl_matches_full_logits(device: str, loss_type: str, level: str) -> None:
    kw: dict[str, Any] = {"loss_type": loss_type, "importance_sampling_level": level, "beta": 0.04,
                          "epsilon_high": 0.28, "temperature": 0.8}  # fmt: skip
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = 8
    if loss_type == "dapo":
        kw["num_items_in_batch"] = 20.0
    if loss_type == "cispo":
        kw["epsilon_high"] = 1.1
    _compare(_batch(device, torch.float32, seed=1, bias=loss_type == "grpo"), off_policy=True, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("budget", [1 << 30, SMALL_CHUNKS], ids=["one_chunk", "chunks"])
def test_on_policy_dtypes(device: str, dtype: torch.dtype, budget: int) -> None:
    """One chunk keeps the logits' gradient for the backward's weight gradient; several
    accumulate it in fp32 in the forward."""
    _compare(_batch(device, dtype, seed=2, bias=True), off_policy=False, loss_type="dapo", memory_budget=budget)


def test_two_sided_clip_bias_correction_and_entropy_bonus(device: str) -> None:
    _compare(_batch(device, torch.float32, seed=3), off_policy=True, loss_type="bnpo", beta=0.1, delta=1.1,
             use_bias_correction_kl=True, entropy_coef=0.01, gradient_accumulation_steps=2)  # fmt: skip


def test_per_token_advantages_without_entropy(device: str) -> None:
    batch = _batch(device, torch.float32, seed=4)
    batch["adv"] = torch.randn(B, T, generator=torch.Generator().manual_seed(0)).to(device)
    _compare(batch, off_policy=True, loss_type="grpo", return_entropy=False)


def test_token_level_runs_in_one_pass(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the token level no recomputing backward runs: neither the logprobs op nor the reference."""
    import fk.align.grpo as module

    monkeypatch.setattr(module, "fused_linear_logprobs", None)
    monkeypatch.setattr(module, "fused_linear_logprobs_ref", None)
    batch = _batch(device, torch.float32, seed=5)
    out = fused_linear_grpo_loss(batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"], entropy_coef=0.1)
    out.loss.backward()
    assert batch["h"].grad is not None and batch["w"].grad is not None


def test_tokens_outside_the_mask_are_left_out_before_the_head(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``skip_ignored`` (the default): only the masked tokens' rows reach the op, and the loss,
    metrics, per-token values and gradients are those of every row computed."""
    import fk.align.grpo as module

    rows = testing.rows_reaching(monkeypatch, module, "_grpo_token_loss")
    batch = _batch(device, torch.float32, seed=11, bias=True)

    def run(skip: bool) -> list[torch.Tensor]:
        out = fused_linear_grpo_loss(batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"], bias=batch["b"],
                                     old_per_token_logps=batch["old"], ref_per_token_logps=batch["ref"], beta=0.04,
                                     entropy_coef=0.01, memory_budget=SMALL_CHUNKS, skip_ignored=skip)  # fmt: skip
        grads = torch.autograd.grad(out.loss, [batch["h"], batch["w"], batch["b"]])
        return [out.loss, out.per_token_logps, out.entropies, *out.metrics.values(), *grads]

    every, masked = run(False), run(True)
    assert rows == [B * T, int(batch["mask"].sum())] and rows[1] < rows[0]
    for got, want in zip(masked, every, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_compile_matches_eager(device: str) -> None:
    batch = _batch(device, torch.float32, seed=6, bias=True)

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fused_linear_grpo_loss(h, w, batch["ids"], batch["mask"], batch["adv"], bias=b,
                                      old_per_token_logps=batch["old"], ref_per_token_logps=batch["ref"], beta=0.04,
                                      memory_budget=SMALL_CHUNKS, entropy_coef=0.01).loss  # fmt: skip

    testing.assert_compile_matches_eager(loss, [batch["h"], batch["w"], batch["b"]])


# --- Against TRL's code ---------------------------------------------------------------------------

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (fk-align[testing])")


def _trl_loss(batch: dict[str, Any], h: torch.Tensor, w: torch.Tensor, kw: dict[str, Any], old: Any, ref: Any) -> Any:
    from trl import GRPOTrainer

    ids, mask = batch["ids"], batch["mask"]
    target = torch.where(mask.bool(), ids, -100)

    def per_token_logps_and_entropies(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int,
                                      **_: Any) -> Any:  # fmt: skip
        out = fused_linear_logprobs_ref(h, w, target, temperature=kw.get("temperature", 1.0), return_entropy=True)
        return out.logps, out.entropy, None

    same = lambda t: t  # noqa: E731
    accelerator = SimpleNamespace(device=h.device, gather=same, gather_for_metrics=same, num_processes=1, sync_gradients=False,
                                  reduce=lambda t, reduction: t)  # fmt: skip
    eps = kw.get("epsilon_low", 0.2)
    args = SimpleNamespace(use_bias_correction_kl=kw.get("use_bias_correction_kl", False), delta=kw.get("delta"),
                           sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, steps_per_generation=1)  # fmt: skip
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=kw.get("importance_sampling_level", "token"),
        beta=kw.get("beta", 0.0), args=args, loss_type=kw["loss_type"], epsilon_low=eps,
        epsilon_high=kw.get("epsilon_high", eps), use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=kw.get("gradient_accumulation_steps", 1),
        max_completion_length=kw.get("max_completion_length"), accelerator=accelerator,
        _entropy_bonus_enabled=kw.get("entropy_coef", 0.0) != 0.0, entropy_coef=kw.get("entropy_coef", 0.0),
        use_adaptive_entropy=False, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
    )  # fmt: skip
    inputs = {"prompt_ids": ids[:, :0], "prompt_mask": mask[:, :0], "completion_ids": ids, "completion_mask": mask,
              "advantages": batch["adv"].double(), "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(float(kw.get("num_items_in_batch", mask.sum())))}  # fmt: skip
    return GRPOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


@needs_trl
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
def test_equals_trl_grpo_trainer(loss_type: str, level: str, off_policy: bool) -> None:
    batch = _batch("cpu", torch.float64, seed=7)
    h, w = batch["h"], batch["w"]
    kw: dict[str, Any] = {"loss_type": loss_type, "importance_sampling_level": level, "beta": 0.04,
                          "epsilon_high": 0.28, "temperature": 0.8, "max_completion_length": 8,
                          "num_items_in_batch": 20.0, "delta": 1.5 if loss_type == "dapo" else None,
                          "use_bias_correction_kl": loss_type == "bnpo", "gradient_accumulation_steps": 2,
                          "entropy_coef": 0.01 if loss_type == "grpo" else 0.0}  # fmt: skip
    if loss_type == "cispo":
        kw["epsilon_high"] = 1.1
    old = batch["old"].double() if off_policy else None
    ref = batch["ref"].double()
    want, trl_metrics = _trl_loss(batch, h, w, kw, old, ref)
    # dapo/cispo: fk takes TRL's whole normalizer, num_items * accumulation steps / steps_per_generation (1 here).
    fk_kw = {**kw, "num_items_in_batch": kw["num_items_in_batch"] * kw["gradient_accumulation_steps"]}
    got = fused_linear_grpo_loss(h, w, batch["ids"], batch["mask"], batch["adv"].double(), old_per_token_logps=old,
                                 ref_per_token_logps=ref, reference=True, **fk_kw)  # fmt: skip
    torch.testing.assert_close(got.loss, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got.loss, (h, w)), torch.autograd.grad(want, (h, w)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    names = [k for k in trl_metrics if k not in ("entropy_coef",)]
    assert sorted(names) == sorted(got.metrics), (names, list(got.metrics))
    for key in names:
        assert float(got.metrics[key]) == pytest.approx(trl_metrics[key][-1], rel=1e-9, abs=1e-12, nan_ok=True), key


# --- Bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_type": "vespo"}, "loss_type"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
        ({"beta": 0.1}, "ref_per_token_logps"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"temperature": 0.0}, "temperature"),
        ({"advantages": "wrong"}, "advantages"),
        ({"completion_mask": "wrong"}, "completion_mask"),
        ({"old_per_token_logps": "wrong"}, "old_per_token_logps"),
        ({"completion_ids": "out_of_range"}, "target"),
        ({"skip_ignored": 1}, "skip_ignored"),
    ],
)
def test_bad_input_raises_naming_the_argument(change: dict[str, Any], message: str) -> None:
    batch = _batch("cpu", torch.float32, seed=8)
    args = [batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"]]
    kw: dict[str, Any] = {}
    for key, value in change.items():
        if key == "advantages":
            args[4] = torch.zeros(B + 1)
        elif key == "completion_mask":
            args[3] = batch["mask"][:, :2]
        elif key == "completion_ids":
            args[2] = batch["ids"].clone().fill_(V)
        elif value == "wrong":
            kw[key] = torch.zeros(B, T + 1)
        else:
            kw[key] = value
    with pytest.raises((ValueError, TypeError), match=message):
        fused_linear_grpo_loss(*args, **kw)


def test_frozen_head_gets_no_gradient(device: str) -> None:
    batch = _batch(device, torch.float32, seed=9)
    batch["w"].requires_grad_(False)
    _compare(batch, off_policy=True, loss_type="dapo", beta=0.04)
    fused_linear_grpo_loss(batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"]).loss.backward()
    assert batch["w"].grad is None and batch["h"].grad is not None


@pytest.mark.gpu
def test_no_host_synchronization() -> None:
    batch = _batch("cuda", torch.bfloat16, seed=10, bias=True)
    args = (batch["h"], batch["w"], batch["ids"], batch["mask"], batch["adv"])
    kw: dict[str, Any] = {"bias": batch["b"], "old_per_token_logps": batch["old"], "skip_ignored": False,
                          "ref_per_token_logps": batch["ref"], "beta": 0.04, "entropy_coef": 0.01}  # fmt: skip
    fused_linear_grpo_loss(*args, **kw).loss.backward()  # compile and warm up first
    items = torch.tensor(12.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for level in ("token", "sequence"):
            out = fused_linear_grpo_loss(*args, importance_sampling_level=level, num_items_in_batch=items, **kw)
            out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_reference_path_without_triton() -> None:
    """A CPU-only user without Triton's interpreter gets the PyTorch reference for every loss."""
    testing.run_on_reference_path(
        "import torch\n"
        "from fk.align import fused_linear_dpo_loss, fused_linear_grpo_loss, fused_linear_logprobs\n"
        "h = torch.randn(2, 5, 8, requires_grad=True)\n"
        "w = torch.randn(11, 8, requires_grad=True)\n"
        "ids = torch.randint(0, 11, (2, 5))\n"
        "out = fused_linear_grpo_loss(h, w, ids, torch.ones(2, 5), torch.randn(2), entropy_coef=0.1)\n"
        "(out.loss + fused_linear_dpo_loss(h, w, ids).loss + fused_linear_logprobs(h, w, ids).sum()).backward()\n"
        "assert h.grad is not None and w.grad is not None\n"
        "print('ok')\n"
    )
