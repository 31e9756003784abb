"""Preference losses on the fused head: against the same losses on the full logits in float64
(values, metrics and gradients of hidden, weight, bias), and their formulas against TRL 1.16's own
trainer code, called with stand-ins for the trainer, the model and accelerate."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fk.align import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    fused_linear_cpo_loss,
    fused_linear_dpo_loss,
    fused_linear_kto_loss,
    fused_linear_logprobs_ref,
    fused_linear_orpo_loss,
    token_statistics,
)
from fk.align.budget import HEAD_DTYPE_SUM_CHUNKS, sums_in_fp32
from fk.align.preference import SINGLE_PASS_DPO_TYPES, LossSpec, PreferenceOutput, sequence_grads, sequence_loss
from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.flce import chunks
from fk.flce.linear_cross_entropy import shift_labels

P, T, H, V = 2, 7, 16, 1003  # 2 pairs of 7 tokens: 28 tokens, an odd count per sequence
SMALL_CHUNKS = 8 * V * 4  # several chunks of 8 fp32 tokens: no pair (14 tokens) fits, two passes
ONE_PAIR = 16 * V * 4  # 16 fp32 tokens: one pair (or two KTO sequences) per chunk, one pass


def _batch(device: str, dtype: torch.dtype, seed: int, *, bias: bool = False, pairs: int = P) -> list[Any]:
    """(hidden, weight, bias, labels): unshifted labels as TRL builds them, the prompt (the first
    2 tokens, 3 for the rejected sequences) and one padded tail ignored."""
    h, w, b = testing.random_head((2 * pairs, T), V, H, dtype, device, seed=seed, bias=bias)
    g = torch.Generator().manual_seed(seed + 3)
    labels = torch.randint(0, V, (2 * pairs, T), generator=g)
    labels[:, :2] = -100
    labels[1::2, 2] = -100
    labels[0, -1] = -100
    return [h, w, b, labels.to(device)]


def _refs(device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (-30 + 3 * torch.randn(P, generator=g)).to(device), (-32 + 3 * torch.randn(P, generator=g)).to(device)


CANCELLING = ("log_odds_chosen",)
"""Metrics that are small differences of larger values: ORPO's mean log odds, ``log p - log(1 - p)``
of mean log-probabilities ``log p`` near ``log 0.5``, can be ~0.02 while ``log p`` is ~0.7, so an
fp32 rounding of ``log p`` (a few ulps of 0.7, as any summation order gives) is 1e-5 of the metric,
above the bound relative to its own size. They are compared apart, against the reference with a
bound relative to the chosen sequences' mean log-probabilities (:func:`_assert_cancelling_close`)."""


def _compare(loss_fn: Any, args: list[Any], budget: int = SMALL_CHUNKS, **kw: Any) -> None:
    h, w, b, labels = args

    def fk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
        return loss_fn(h, w, labels.to(h.device), bias=b, shift=True, memory_budget=budget, **_moved(kw, h))

    def ref(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
        return loss_fn(h, w, labels.to(h.device), bias=b, shift=True, reference=True, **_moved(kw, h))

    def without_cancelling(fn: Any) -> Any:
        def run(*a: Any) -> Any:
            out = fn(*a)
            return out._replace(**dict.fromkeys(CANCELLING)) if isinstance(out, PreferenceOutput) else out

        return run

    testing.compare_with_reference(without_cancelling(fk), without_cancelling(ref), [h, w, b],
                                   arg_names=["hidden", "weight", "bias"])  # fmt: skip
    with torch.no_grad():
        got = fk(h, w, b)
        if isinstance(got, PreferenceOutput):
            want = ref(*(t.double() if t is not None else None for t in (h, w, b)))
            _assert_cancelling_close(got, want, h.dtype)


def _assert_cancelling_close(got: PreferenceOutput, want: PreferenceOutput, dtype: torch.dtype) -> None:
    """Each :data:`CANCELLING` metric within 32 ulps (of ``dtype``) of 1 + the chosen sequences'
    largest |log-probability| (ORPO's are means per token), the size of the values it is the
    difference of."""
    ulp = torch.finfo(dtype).eps
    for name in CANCELLING:
        a, r = getattr(got, name), getattr(want, name)
        assert (a is None) == (r is None), f"{name}: fk gives {a is not None}, the reference {r is not None}"
        if a is None:
            continue
        size = float(want.chosen_logps.abs().max()) + 1.0
        error = float((a.double() - r).abs().max())
        assert error <= 32 * ulp * size, f"{name}: error {error:.3e} > 32 ulps of {size:.3f}"


def _moved(kw: dict[str, Any], like: torch.Tensor) -> dict[str, Any]:
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return {k: v.to(like.device, dtype) if torch.is_tensor(v) else v for k, v in kw.items()}


# The fused path is the same for every loss type (the loss is PyTorch on per-sequence values); these
# cover the different uses of those values: sums, per-token means (ipo), sorting (aot), all pairs
# at once (sft). Every type's formula is checked against TRL's code below.
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "aot", "sft", "exo_pair"])
def test_dpo_matches_full_logits(device: str, loss_type: str) -> None:
    ref_chosen, ref_rejected = _refs(device, seed=1)
    smoothing = 0.1 if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0
    _compare(fused_linear_dpo_loss, _batch(device, torch.float32, seed=2, bias=loss_type == "sigmoid"),
             ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected, loss_type=loss_type, beta=0.1,
             label_smoothing=smoothing)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_dpo_dtypes_reference_free_and_combined_types(device: str, dtype: torch.dtype) -> None:
    _compare(fused_linear_dpo_loss, _batch(device, dtype, seed=3), loss_type=["sigmoid", "sft"],
             loss_weights=[1.0, 0.5], beta=0.05)  # fmt: skip


@pytest.mark.parametrize("loss_type", CPO_LOSS_TYPES)
def test_cpo_matches_full_logits(device: str, loss_type: str) -> None:
    _compare(fused_linear_cpo_loss, _batch(device, torch.float32, seed=4), loss_type=loss_type,
             cpo_alpha=0.0 if loss_type == "simpo" else 1.0, label_smoothing=0.1 if loss_type == "sigmoid" else 0.0)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_orpo_and_alphapo_match_full_logits(device: str, dtype: torch.dtype) -> None:
    _compare(fused_linear_orpo_loss, _batch(device, dtype, seed=5, bias=True), beta=0.2)
    _compare(fused_linear_cpo_loss, _batch(device, dtype, seed=6), loss_type="simpo", cpo_alpha=0.0, alpha=0.1)


@pytest.mark.parametrize("budget", [SMALL_CHUNKS, ONE_PAIR], ids=["two_passes", "one_pass"])
def test_dpo_with_a_sequence_without_scored_tokens(device: str, budget: int) -> None:
    """An all-ignored rejected sequence: log-probability 0 and no gradient from its tokens."""
    batch = _batch(device, torch.float32, seed=22, bias=True)
    batch[3] = batch[3].clone()
    batch[3][-1, :] = -100
    ref_chosen, ref_rejected = _refs(device, seed=23)
    for loss_type in ("sigmoid", "ipo"):
        _compare(fused_linear_dpo_loss, batch, budget, ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
                 loss_type=loss_type)  # fmt: skip
    out = fused_linear_dpo_loss(batch[0], batch[1], batch[3], shift=True, memory_budget=budget)
    assert float(out.rejected_logps[-1]) == 0.0
    out.loss.backward()
    assert bool((batch[0].grad[-1] == 0).all())


def _kto_extras(device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"desirable": torch.tensor([True, False, True, True]).to(device),
            "ref_logps": (-30 + 3 * torch.randn(2 * P, generator=g)).to(device),
            "kl_logps": (-31 + 3 * torch.randn(3, generator=g)).to(device),
            "ref_kl_logps": (-33 + 3 * torch.randn(3, generator=g)).to(device)}  # fmt: skip


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_kto_matches_full_logits(device: str, loss_type: str, dtype: torch.dtype) -> None:
    extras = _kto_extras(device, seed=17)
    desirable = extras.pop("desirable")

    def kto(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, **kw: Any) -> Any:
        out = fused_linear_kto_loss(h, w, target, desirable.to(h.device), **kw)
        return (out.loss, out.logps, out.rewards, *out.metrics.values())

    _compare(kto, _batch(device, dtype, seed=18, bias=True), loss_type=loss_type, beta=0.2, desirable_weight=1.3,
             undesirable_weight=0.7, **extras)  # fmt: skip


# --- One pass: chunks of whole pairs --------------------------------------------------------------


def _kto_on(desirable: torch.Tensor) -> Any:
    def kto(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, **kw: Any) -> Any:
        out = fused_linear_kto_loss(h, w, target, desirable.to(h.device), **kw)
        return (out.loss, out.logps, out.rewards, *out.metrics.values())

    return kto


_KTO_KW = {"beta": 0.2, "desirable_weight": 1.3, "undesirable_weight": 0.7}
SINGLE_PASS_CASES = [
    *(pytest.param(fused_linear_dpo_loss, {"loss_type": t, "label_smoothing": 0.1 if t in ("exo_pair", "robust") else 0.0,
                                           "refs": t != "hinge"}, id=f"dpo-{t}")
      for t in sorted(SINGLE_PASS_DPO_TYPES)),
    *(pytest.param(fused_linear_cpo_loss, {"loss_type": t, "cpo_alpha": 0.0 if t == "simpo" else 1.0,
                                           "label_smoothing": 0.1 if t == "sigmoid" else 0.0}, id=f"cpo-{t}")
      for t in CPO_LOSS_TYPES),
    pytest.param(fused_linear_cpo_loss, {"loss_type": "simpo", "cpo_alpha": 0.0, "alpha": 0.1}, id="alphapo"),
    pytest.param(fused_linear_orpo_loss, {"beta": 0.2}, id="orpo"),
    *(pytest.param("kto", {"loss_type": t, **_KTO_KW}, id=f"kto-{t}") for t in KTO_LOSS_TYPES),
]  # fmt: skip


def _case(loss_fn: Any, kw: dict[str, Any], device: str) -> tuple[Any, dict[str, Any]]:
    """The loss function and its arguments of a :data:`SINGLE_PASS_CASES` entry."""
    kw = dict(kw)
    if loss_fn == "kto":
        extras = _kto_extras(device, seed=31)
        return _kto_on(extras.pop("desirable")), {**kw, **extras}
    if kw.pop("refs", False):
        kw["ref_chosen_logps"], kw["ref_rejected_logps"] = _refs(device, seed=32)
    return loss_fn, kw


@pytest.mark.parametrize(("loss_fn", "kw"), SINGLE_PASS_CASES)
def test_single_pass_matches_full_logits(device: str, loss_fn: Any, kw: dict[str, Any]) -> None:
    """Every loss type with a pair's gradient of its own, one pair (two KTO sequences) per chunk:
    loss, metrics and the gradients of hidden, weight and bias equal the fp64 full-logit ones."""
    fn, kw = _case(loss_fn, kw, device)
    _compare(fn, _batch(device, torch.float32, seed=30, bias=True), budget=ONE_PAIR, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_single_pass_several_pairs_per_chunk_equals_two_passes(device: str, dtype: torch.dtype) -> None:
    """Three pairs in chunks of two (the last chunk holds one), and all in one chunk (its logits'
    gradient kept for the backward): against the reference, and equal to the two passes to the
    dtype's rounding of the head's matmuls."""
    batch = _batch(device, dtype, seed=33, bias=True, pairs=3)
    itemsize = batch[0].element_size()
    for budget in (32 * V * itemsize, 1 << 30):
        _compare(fused_linear_dpo_loss, batch, budget=budget, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
        _compare(fused_linear_orpo_loss, batch, budget=budget, beta=0.2)
    desirable = torch.tensor([True, False, True, True, False, True])
    _compare(_kto_on(desirable), batch, budget=32 * V * itemsize, **_KTO_KW)


def test_weight_gradient_sum_dtype_follows_the_chunk_count(device: str) -> None:
    """``accum_dtype=None``: the single pass sums ``dW`` in the head's dtype over at most
    ``HEAD_DTYPE_SUM_CHUNKS`` chunks, in fp32 over more; a given ``accum_dtype`` decides alone. Bf16
    pairs in one chunk each, two more than that limit (the fp32 sum), against the reference."""
    limit = HEAD_DTYPE_SUM_CHUNKS
    assert not sums_in_fp32(None, torch.bfloat16, limit)
    assert sums_in_fp32(None, torch.bfloat16, limit + 1) and sums_in_fp32(None, torch.bfloat16, None)
    assert sums_in_fp32(torch.float32, torch.bfloat16, 1)
    assert not sums_in_fp32(torch.bfloat16, torch.bfloat16, limit + 1)
    batch = _batch(device, torch.bfloat16, seed=34, pairs=limit + 2)
    _compare(fused_linear_dpo_loss, batch, budget=ONE_PAIR // 2, beta=0.1)


def _specs() -> list[Any]:
    specs = [
        LossSpec("dpo", (t,), (1.0,), 0.3, 0.1 if t in ("exo_pair", "robust") else 0.0)
        for t in sorted(SINGLE_PASS_DPO_TYPES)
    ]
    specs.append(LossSpec("dpo", ("sigmoid", "sft", "discopop"), (1.0, 0.5, 2.0), 0.3, discopop_tau=0.2))
    specs += [
        LossSpec("cpo", (t,), (1.0,), 0.3, 0.1 if t == "sigmoid" else 0.0, cpo_alpha=0.0 if t == "simpo" else 1.0)
        for t in CPO_LOSS_TYPES
    ]
    specs += [LossSpec("cpo", ("simpo",), (1.0,), 2.0, alpha=0.1), LossSpec("orpo", ("orpo",), (1.0,), 0.2)]
    specs += [LossSpec("kto", (t,), (1.0,), 0.2, desirable_weight=1.3, undesirable_weight=0.7) for t in KTO_LOSS_TYPES]
    return [pytest.param(spec, id=f"{spec.family}-{'+'.join(spec.types)}{'-alpha' if spec.alpha else ''}")
            for spec in specs]  # fmt: skip


@pytest.mark.parametrize("spec", _specs())
def test_sequence_grads_equal_autograd_of_the_formula(spec: LossSpec) -> None:
    """The written-out gradient of each loss w.r.t. the sequence sums (what the one pass writes
    into each token's upstream gradient) against autograd of the loss' formula, in fp64, over 64
    pairs whose margins range from saturated to zero, taken in two halves as two chunks would."""
    g = torch.Generator().manual_seed(40)
    n_seqs = 128
    counts = torch.randint(1, 40, (n_seqs,), generator=g).double()
    sums = (-counts * torch.rand(n_seqs, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref = -counts * torch.rand(n_seqs, generator=g, dtype=torch.float64) * 3
    desirable = torch.rand(n_seqs, generator=g) > 0.4
    kl = torch.tensor(0.7, dtype=torch.float64)
    want = torch.autograd.grad(sequence_loss(spec, sums, counts, ref, desirable, kl), sums)[0]
    values = sums.detach()
    chosen_total = counts[: n_seqs // 2].sum() if spec.paired else counts.sum()
    halves = [torch.arange(0, 32), torch.arange(32, 64)]
    for half in halves:  # the chunk's sequences: chosen then rejected of the same pairs
        rows = torch.cat([half, half + 64])  # (KTO: any sequences)
        got = sequence_grads(spec, values[rows], counts[rows], ref[rows], desirable[rows], kl, n_seqs, chosen_total)
        torch.testing.assert_close(got, want[rows], rtol=1e-9, atol=1e-12)


def _count_head_matmuls(monkeypatch: pytest.MonkeyPatch, phase: list[str]) -> list[str]:
    """A log of the chunk engine's logits matmuls, each tagged with ``phase[0]`` when it ran."""
    calls: list[str] = []
    original = chunks.chunk_logits

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(phase[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(chunks, "chunk_logits", counted)
    return calls


@pytest.mark.parametrize(("loss_type", "budget", "forward", "backward"), [
    ("sigmoid", ONE_PAIR, 2, 0),  # one pass: a chunk per pair, no logits in the backward
    ("sigmoid", 1 << 30, 1, 0),  # one pass, one chunk
    ("sigmoid", SMALL_CHUNKS, 4, 4),  # no pair fits: two passes over 8-token chunks
    ("aot", ONE_PAIR, 2, 2),  # sorts across the batch: two passes (16-token chunks)
])  # fmt: skip
def test_single_pass_is_taken_where_each_pair_has_its_own_gradient(
    device: str, monkeypatch: pytest.MonkeyPatch, loss_type: str, budget: int, forward: int, backward: int
) -> None:
    phase = ["forward"]
    calls = _count_head_matmuls(monkeypatch, phase)
    h, w, b, labels = _batch(device, torch.float32, seed=34, bias=True)
    out = fused_linear_dpo_loss(h, w, labels, bias=b, shift=True, loss_type=loss_type, label_smoothing=0.1,
                                memory_budget=budget)  # fmt: skip
    phase[0] = "backward"
    out.loss.backward()
    assert (calls.count("forward"), calls.count("backward")) == (forward, backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("budget", [SMALL_CHUNKS, ONE_PAIR, 1 << 30], ids=["two_passes", "one_pass", "one_chunk"])
@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_token_stats_equal_the_full_logits(device: str, dtype: torch.dtype, budget: int, loss: str) -> None:
    """``return_token_stats``: each position's entropy, mean logit and top-1 against its label after
    the shift, from the single pass's own logits (a pair a chunk, or one chunk) or from one more
    pass where no pair fits, equal :func:`fk.align.token_statistics` on the full logits (made in
    the same dtype), 0 and False where not scored; the loss and its gradients are those without
    asking. In bf16 a logit can round to a tie with the label's: top-1 may differ there alone."""
    h, w, b, labels = _batch(device, dtype, seed=41, bias=True)
    with torch.no_grad():  # every other label the argmax of its position's logits: top-1 is often true
        top = torch.nn.functional.linear(h, w, b).argmax(-1)
        labels[:, 1::2] = torch.where(labels[:, 1::2] == -100, -100, top[:, 0::2][:, : labels[:, 1::2].shape[1]])
    desirable = torch.tensor([True, False, True, True], device=device)

    def run(stats: bool) -> Any:
        kw = {"bias": b, "shift": True, "memory_budget": budget, "return_token_stats": stats}
        if loss == "dpo":
            return fused_linear_dpo_loss(h, w, labels, **kw)
        return fused_linear_kto_loss(h, w, labels, desirable, **kw)

    plain, out = run(False), run(True)
    assert plain.token_stats is None and out.token_stats is not None
    torch.testing.assert_close(out.loss, plain.loss, rtol=0, atol=0)
    got_grads = torch.autograd.grad(out.loss, [h, w, b])
    for got, want in zip(got_grads, torch.autograd.grad(plain.loss, [h, w, b]), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    scored = shift_labels(labels, -100)
    want = token_statistics(h.detach(), w.detach(), scored, bias=b.detach())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.token_stats.entropy, want.entropy, **tol)
    torch.testing.assert_close(out.token_stats.mean_logit, want.mean_logit, **tol)
    assert out.token_stats.entropy.shape == labels.shape and bool((out.token_stats.entropy[scored == -100] == 0).all())
    assert int(want.top1.sum()) >= 4
    mismatched = int((out.token_stats.top1 != want.top1).sum())
    assert mismatched == 0 if dtype == torch.float32 else mismatched <= 1
    assert not bool(out.token_stats.top1[scored == -100].any())


# --- The formulas against TRL's code --------------------------------------------------------------

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (fk-align[testing])")


def _accelerator(device: torch.device) -> SimpleNamespace:
    same = lambda t: t  # noqa: E731  (one process: gathering returns the tensor)
    return SimpleNamespace(device=device, gather=same, gather_for_metrics=same, num_processes=1,
                           reduce=lambda t, reduction: t)  # fmt: skip


def _metric(trainer: SimpleNamespace, key: str) -> float:
    return float(trainer._metrics["train"][key][-1])


@needs_trl
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_equals_trl_dpo_trainer(loss_type: str) -> None:
    """TRL's ``DPOTrainer._compute_loss`` on a stand-in model whose fused head gives the fp64
    log-probabilities of the full logits: the same loss, gradients and logged metrics."""
    from trl import DPOTrainer

    h, w, _, labels = _batch("cpu", torch.float64, seed=7)
    ref_chosen, ref_rejected = (r.double() for r in _refs("cpu", seed=8))
    smoothing = 0.1 if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0
    completion_mask = (labels != -100).long()
    input_ids = labels.clamp(min=0)

    def model(input_ids: torch.Tensor, labels: torch.Tensor, fused_lm_head: bool, **_: Any) -> SimpleNamespace:
        assert fused_lm_head
        logps = fused_linear_logprobs_ref(h[:, :-1], w, labels[:, 1:])
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(h.device), aux_loss_enabled=False,
        precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=0.1, label_smoothing=smoothing, use_weighting=False,
        args=SimpleNamespace(discopop_tau=0.05), _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}  # fmt: skip
    want = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    want_grads = torch.autograd.grad(want, (h, w))
    got = fused_linear_dpo_loss(h, w, labels, shift=True, ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
                                loss_type=loss_type, beta=0.1, label_smoothing=smoothing, reference=True)  # fmt: skip
    got_grads = torch.autograd.grad(got.loss, (h, w))
    # (TRL makes exo_pair's epsilon an fp32 tensor: its log(epsilon) is 1e-8 off in fp64 arithmetic.)
    rtol = 1e-6 if loss_type == "exo_pair" else 1e-10
    torch.testing.assert_close(got.loss, want, rtol=rtol, atol=1e-12)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)
    for key, value in [("rewards/chosen", got.chosen_rewards), ("rewards/rejected", got.rejected_rewards),
                       ("rewards/margins", got.reward_margins), ("rewards/accuracies", got.reward_accuracies),
                       ("logps/chosen", got.chosen_logps), ("logps/rejected", got.rejected_logps)]:  # fmt: skip
        assert float(value.mean()) == pytest.approx(_metric(trainer, key), rel=1e-9, abs=1e-12), key


def _full_logits_logps(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, trainer_class: Any) -> torch.Tensor:
    """TRL's own ``get_batch_logps`` (shift inside, mean per token) on the full logits."""
    return trainer_class.get_batch_logps(h @ w.T, labels, average_log_prob=True)


@needs_trl
@pytest.mark.parametrize(("loss_type", "alpha"), [(t, 0.0) for t in CPO_LOSS_TYPES] + [("simpo", 0.2)])
def test_cpo_equals_trl_cpo_loss(loss_type: str, alpha: float) -> None:
    from trl.experimental.cpo import CPOTrainer

    h, w, _, labels = _batch("cpu", torch.float64, seed=9)
    average = loss_type in ("ipo", "simpo")
    trainer = SimpleNamespace(alpha=alpha, beta=0.1, loss_type=loss_type, simpo_gamma=0.5, label_smoothing=0.1,
                              accelerator=_accelerator(h.device))  # fmt: skip
    logps = CPOTrainer.get_batch_logps(h @ w.T, labels, average_log_prob=average)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trainer, logps[:P], logps[P:])
    chosen_logits = (h @ w.T)[:P, :-1].reshape(-1, V)
    nll = torch.nn.functional.cross_entropy(chosen_logits, labels[:P, 1:].reshape(-1))
    want = losses.mean() + 1.0 * nll
    got = fused_linear_cpo_loss(h, w, labels, shift=True, loss_type=loss_type, alpha=alpha, beta=0.1,
                                label_smoothing=0.1, simpo_gamma=0.5, reference=True)  # fmt: skip
    torch.testing.assert_close(got.loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.chosen_rewards, chosen_rewards, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.rejected_rewards, rejected_rewards, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.nll_loss, nll.detach(), rtol=1e-10, atol=1e-12)
    want_grads = torch.autograd.grad(want, (h, w))
    got_grads = torch.autograd.grad(got.loss, (h, w))
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@needs_trl
def test_orpo_equals_trl_odds_ratio_loss() -> None:
    from trl.experimental.orpo import ORPOTrainer

    h, w, _, labels = _batch("cpu", torch.float64, seed=10)
    logps = ORPOTrainer.get_batch_logps(h @ w.T, labels, average_log_prob=True)
    trainer = SimpleNamespace(beta=0.2, accelerator=_accelerator(h.device))
    losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(
        trainer, logps[:P], logps[P:]
    )
    nll = torch.nn.functional.cross_entropy((h @ w.T)[:P, :-1].reshape(-1, V), labels[:P, 1:].reshape(-1))
    want = nll - losses.mean()
    got = fused_linear_orpo_loss(h, w, labels, shift=True, beta=0.2, reference=True)
    # TRL casts the log-probabilities to fp32 (fk's are fp32 already): agreement to fp32 rounding.
    torch.testing.assert_close(got.loss, want, rtol=1e-6, atol=1e-7)
    for a, b in [(got.chosen_rewards, chosen_rewards), (got.rejected_rewards, rejected_rewards),
                 (got.log_odds_ratio, log_odds_ratio), (got.log_odds_chosen, log_odds_chosen)]:  # fmt: skip
        torch.testing.assert_close(a, b.detach().double(), rtol=1e-6, atol=1e-7)
    for a, b in zip(torch.autograd.grad(got.loss, (h, w)), torch.autograd.grad(want, (h, w)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --- Bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"beta": 0.0}, "beta"),
        ({"loss_type": "dpo"}, "loss_type"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": "exo_pair"}, "label_smoothing"),
        ({"ref_chosen_logps": "only"}, "ref_rejected_logps"),
        ({"ref_chosen_logps": "wrong_shape", "ref_rejected_logps": "wrong_shape"}, "ref_chosen_logps"),
        ({"loss_weights": [1.0, 2.0]}, "loss_weights"),
        ({"odd_batch": True}, "hidden"),
    ],
)
def test_bad_input_raises_naming_the_argument(kw: dict[str, Any], message: str) -> None:
    h, w, _, labels = _batch("cpu", torch.float32, seed=11)
    kw = dict(kw)
    if kw.pop("odd_batch", False):
        h, labels = h[:3], labels[:3]
    for name in ("ref_chosen_logps", "ref_rejected_logps"):
        if kw.get(name) == "only":
            kw[name] = torch.zeros(P)
        elif kw.get(name) == "wrong_shape":
            kw[name] = torch.zeros(P + 1)
    with pytest.raises(ValueError, match=message):
        fused_linear_dpo_loss(h, w, labels, **kw)


@pytest.mark.parametrize("budget", [SMALL_CHUNKS, ONE_PAIR], ids=["two_passes", "one_pass"])
def test_frozen_head_gets_no_gradient(device: str, budget: int) -> None:
    h, w, _, labels = _batch(device, torch.float32, seed=12)
    w.requires_grad_(False)
    out = fused_linear_dpo_loss(h, w, labels, shift=True, memory_budget=budget)
    want = fused_linear_dpo_loss(h, w, labels, shift=True, reference=True)
    torch.testing.assert_close(torch.autograd.grad(out.loss, h)[0], torch.autograd.grad(want.loss, h)[0],
                               rtol=1e-4, atol=1e-6)  # fmt: skip
    fused_linear_dpo_loss(h, w, labels, shift=True).loss.backward()
    assert w.grad is None


@pytest.mark.parametrize("budget", [SMALL_CHUNKS, ONE_PAIR], ids=["two_passes", "one_pass"])
def test_compile_matches_eager(device: str, budget: int) -> None:
    h, w, b, labels = _batch(device, torch.float32, seed=13, bias=True)
    ref_chosen, ref_rejected = _refs(device, seed=14)

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fused_linear_dpo_loss(h, w, labels, bias=b, shift=True, ref_chosen_logps=ref_chosen,
                                     ref_rejected_logps=ref_rejected, memory_budget=budget).loss  # fmt: skip

    testing.assert_compile_matches_eager(loss, [h, w, b])


@pytest.mark.gpu
def test_no_host_synchronization() -> None:
    h, w, b, labels = _batch("cuda", torch.bfloat16, seed=15, bias=True)
    ref_chosen, ref_rejected = _refs("cuda", seed=16)
    fused_linear_dpo_loss(h, w, labels, bias=b, shift=True).loss.backward()  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for loss_type in DPO_LOSS_TYPES:
            smoothing = 0.1 if loss_type in ("exo_pair", "robust") else 0.0
            fused_linear_dpo_loss(h, w, labels, bias=b, shift=True, ref_chosen_logps=ref_chosen,
                                  ref_rejected_logps=ref_rejected, loss_type=loss_type,
                                  label_smoothing=smoothing).loss.backward()  # fmt: skip
        for fn in (fused_linear_cpo_loss, fused_linear_orpo_loss):
            fn(h, w, labels, bias=b, shift=True).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_trl
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_kto_equals_trl_kto_trainer(loss_type: str) -> None:
    from trl import KTOTrainer

    h, w, _, labels = _batch("cpu", torch.float64, seed=19)
    kl_h, _, _, kl_labels = _batch("cpu", torch.float64, seed=20)
    extras = {k: v.double() if v.is_floating_point() else v for k, v in _kto_extras("cpu", seed=21).items()}
    completion_mask = (labels != -100).long()
    kl_completion_mask = (kl_labels != -100).long()
    input_ids, kl_input_ids = labels.clamp(min=0), kl_labels.clamp(min=0)
    ref_kl = extras["ref_kl_logps"][:1].expand(2 * P).clone()  # TRL: one KL completion per example

    def model(input_ids: torch.Tensor, labels: torch.Tensor, fused_lm_head: bool, **_: Any) -> SimpleNamespace:
        hidden = kl_h if input_ids is kl_input_ids else h
        logps = fused_linear_logprobs_ref(hidden[:, :-1], w, labels[:, 1:])
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros)

    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(h.device), calculate_KL=loss_type == "kto",
        precompute_ref_logps=True, aux_loss_enabled=False, loss_type=loss_type, beta=0.2, desirable_weight=1.3,
        undesirable_weight=0.7, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    trainer._compute_kl_logps = lambda model_, batch: KTOTrainer._compute_kl_logps(trainer, model_, batch)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion_mask,
              "KL_input_ids": kl_input_ids, "KL_attention_mask": torch.ones_like(kl_input_ids),
              "KL_completion_mask": kl_completion_mask, "label": extras["desirable"], "ref_logps": extras["ref_logps"],
              "ref_KL_logps": ref_kl}  # fmt: skip
    want = KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    kl_logps = None
    if loss_type == "kto":
        with torch.no_grad():
            kl_logps = fused_linear_logprobs_ref(kl_h, w, kl_labels, shift=True).sum(-1)
    got = fused_linear_kto_loss(h, w, labels, extras["desirable"], shift=True, ref_logps=extras["ref_logps"],
                                kl_logps=kl_logps, ref_kl_logps=ref_kl if kl_logps is not None else None,
                                loss_type=loss_type, beta=0.2, desirable_weight=1.3, undesirable_weight=0.7,
                                reference=True)  # fmt: skip
    torch.testing.assert_close(got.loss, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got.loss, (h, w)), torch.autograd.grad(want, (h, w)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for key in ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins"):
        assert float(got.metrics[key]) == pytest.approx(_metric(trainer, key), rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"desirable": "wrong_shape"}, "desirable"),
        ({"kl_logps": "only"}, "ref_kl_logps"),
        ({"ref_logps": "wrong_shape"}, "ref_logps"),
        ({"loss_type": "bco"}, "loss_type"),
        ({"desirable_weight": -1.0}, "desirable_weight"),
    ],
)
def test_kto_bad_input_raises_naming_the_argument(kw: dict[str, Any], message: str) -> None:
    h, w, _, labels = _batch("cpu", torch.float32, seed=24)
    kw = dict(kw)
    desirable = torch.tensor([True, False, True, False])
    if kw.pop("desirable", None) == "wrong_shape":
        desirable = desirable[:3]
    if kw.get("kl_logps") == "only":
        kw["kl_logps"] = torch.zeros(3)
    if kw.get("ref_logps") == "wrong_shape":
        kw["ref_logps"] = torch.zeros(3)
    with pytest.raises(ValueError, match=message):
        fused_linear_kto_loss(h, w, labels, desirable, **kw)
